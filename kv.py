"""The KV cache of a looped LM: static buffers written by absolute position.

A looped layer applied at depth d has its own slot, because a row at depth d attends to the depth-d
keys of earlier positions. Huginn's prelude and coda layers have one slot each. Rolling back a
rejected draft needs no copy: the rows are forgotten, their entries lie past every reader's
position until a new row at that position overwrites them, and reads never look past the reader.
"""
import torch
import torch.nn.functional as F

from models import causal_attention


class KVCache:
    def __init__(self, model, capacity, num_steps=None, per_depth=True):
        a = model.args
        self.n_core, self.num_steps, self.capacity = a.n_core, num_steps or model.num_steps, capacity
        # slot of looped layer j at depth d: d * n_core + j; prelude and coda layers after them
        self.depth_slots = self.num_steps * a.n_core if per_depth else 0
        n_slots = self.depth_slots + a.n_prelude + a.n_coda
        shape = (n_slots, a.n_kv_heads, capacity, a.head_dim)
        self.k = torch.zeros(shape, device=model.device, dtype=model.dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self):
        return self.k.nbytes + self.v.nbytes

    def slot(self, layer, depth):
        if layer >= self.n_core:
            return self.depth_slots + layer - self.n_core
        return depth * self.n_core + layer

    def attend(self, layer, depth, pos, q, k, v):
        """Write this call's keys and values, then attend each row (q [N, H, hd] at positions pos)
        to every position up to its own in its slot. depth is an int, or a per-row tensor."""
        span = int(pos.max()) + 1
        if span > self.capacity:
            raise IndexError(f"position {span - 1} is past the KV cache's capacity of {self.capacity} positions")
        p = pos.to(self.k.device)
        slot = self.slot(layer, depth)
        slots = slot.to(p.device) if torch.is_tensor(slot) else torch.full_like(p, slot)
        self.k[slots, :, p] = k
        self.v[slots, :, p] = v
        visible = torch.arange(span, device=p.device)[None] <= p[:, None]  # [N, span]
        if not torch.is_tensor(slot):  # one slot for all rows: attend straight from the buffer
            y = F.scaled_dot_product_attention(
                q.transpose(0, 1), self.k[slot, :, :span], self.v[slot, :, :span],
                attn_mask=visible, enable_gqa=True)
            return y.transpose(0, 1)
        # rows at different depths (the wavefront): one batched call, each row with its own slot
        y = F.scaled_dot_product_attention(
            q[:, :, None], self.k[slots, :, :span], self.v[slots, :, :span],
            attn_mask=visible[:, None, None], enable_gqa=True)
        return y[:, :, 0]


class SharedKVCache(KVCache):
    """Cross-recurrence KV sharing that stays exact with respect to its own AR (spec section 6).

    The prompt is prefilled with per-depth KV. After it, a row at position p and depth d reads the
    depth-d KV of the positions within window - 1 behind it, and the final-depth KV of every older
    position. The wavefront can honour this: a position `window` behind p started at least
    window * k >= T ticks earlier, so it has finished; nearer ones are deeper in the wave.

    Memory per looped layer: one final-depth buffer over the sequence, and a ring of per-depth
    entries for the last max(window, 2 * window - 2) positions: after a rejection, dropped rows up
    to window - 1 ahead have written ring entries, while the restarted row reads back window - 1.
    Only the oldest row reaches full depth, and it is verified, never dropped, so the final buffer
    holds committed tokens only.
    """

    def __init__(self, model, capacity, num_steps, window, prompt_len):
        super().__init__(model, capacity, num_steps, per_depth=False)  # prelude and coda slots only
        a = model.args
        self.window, self.prompt_len = window, prompt_len
        self.ring = min(max(window, 2 * window - 2), capacity)
        final = (a.n_core, a.n_kv_heads, capacity, a.head_dim)
        ring = (self.num_steps, a.n_core, a.n_kv_heads, self.ring, a.head_dim)
        self.final_k = torch.zeros(final, device=model.device, dtype=model.dtype)
        self.final_v = torch.zeros_like(self.final_k)
        self.ring_k = torch.zeros(ring, device=model.device, dtype=model.dtype)
        self.ring_v = torch.zeros_like(self.ring_k)

    @property
    def nbytes(self):
        return super().nbytes + sum(t.nbytes for t in (self.final_k, self.final_v, self.ring_k, self.ring_v))

    def attend(self, layer, depth, pos, q, k, v):
        if layer >= self.n_core:
            return super().attend(layer, depth, pos, q, k, v)
        if int(pos.max()) >= self.capacity:
            raise IndexError(f"position {int(pos.max())} is past the KV cache's capacity of {self.capacity} positions")
        depth = torch.full_like(pos, depth) if not torch.is_tensor(depth) else depth
        ring_k, ring_v = self.ring_k[:, layer], self.ring_v[:, layer]  # [T, Hkv, ring, hd]
        final = depth == self.num_steps - 1
        if final.any():
            p = pos[final].to(q.device)
            self.final_k[layer][:, p] = k[final.to(q.device)].transpose(0, 1)
            self.final_v[layer][:, p] = v[final.to(q.device)].transpose(0, 1)
        if int(pos.min()) < self.prompt_len:
            # the prefill: every prompt position at one depth, reading that depth only
            if not torch.equal(pos, torch.arange(self.prompt_len)):
                raise ValueError("the shared KV cache prefills the whole prompt in one call")
            last = slice(max(0, self.prompt_len - self.ring), None)  # the ring keeps the latest
            d, p = depth[last].to(q.device), pos[last].to(q.device) % self.ring
            ring_k[d, :, p], ring_v[d, :, p] = k[last], v[last]
            return causal_attention(q, k, v)
        d, p = depth.to(q.device), pos.to(q.device)
        ring_k[d, :, p % self.ring], ring_v[d, :, p % self.ring] = k, v
        # keys: the final-depth prefix [0, max(pos) - window], shared by all rows, read once;
        # and each row's own window (p - window, p] at its depth, from the ring
        n, heads, hd = q.shape
        qg = q.view(n, k.shape[1], heads // k.shape[1], hd) * hd ** -0.5  # [N, Hkv, group, hd]
        span = int(pos.max()) - self.window + 1
        fpos = torch.arange(max(span, 0), device=q.device)
        fk, fv = self.final_k[layer, :, :len(fpos)], self.final_v[layer, :, :len(fpos)]
        wpos = p[:, None] + torch.arange(1 - self.window, 1, device=q.device)  # [N, window]
        wk = ring_k[d[:, None], :, wpos % self.ring].transpose(1, 2)  # [N, Hkv, window, hd]
        wv = ring_v[d[:, None], :, wpos % self.ring].transpose(1, 2)
        scores = torch.cat([torch.einsum("nkgd,ksd->nkgs", qg, fk), torch.einsum("nkgd,nkwd->nkgw", qg, wk)], -1)
        visible = torch.cat([fpos[None] <= (p[:, None] - self.window), wpos >= 0], -1)  # [N, keys]
        weights = (scores.float() if scores.element_size() < 4 else scores).masked_fill(~visible[:, None, None], float("-inf")).softmax(-1).to(q.dtype)
        y = (torch.einsum("nkgs,ksd->nkgd", weights[..., :len(fpos)], fv)
             + torch.einsum("nkgw,nkwd->nkgd", weights[..., len(fpos):], wv))
        return y.reshape(n, heads, hd)
