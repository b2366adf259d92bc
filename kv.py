"""The KV cache of a looped LM: static buffers written by absolute position.

A looped layer applied at depth d has its own slot, because a row at depth d attends to the depth-d
keys of earlier positions. Huginn's prelude and coda layers have one slot each. Rolling back a
rejected draft needs no copy: the rows are forgotten, their entries lie past every reader's
position until a new row at that position overwrites them, and reads never look past the reader.
"""
import torch
import torch.nn.functional as F


class KVCache:
    def __init__(self, model, capacity, num_steps=None):
        a = model.args
        self.n_core, self.num_steps, self.capacity = a.n_core, num_steps or model.num_steps, capacity
        # slot of looped layer j at depth d: d * n_core + j; prelude and coda layers after them
        n_slots = self.num_steps * a.n_core + a.n_prelude + a.n_coda
        shape = (n_slots, a.n_kv_heads, capacity, a.head_dim)
        self.k = torch.zeros(shape, device=model.device, dtype=model.dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self):
        return self.k.nbytes + self.v.nbytes

    def slot(self, layer, depth):
        if layer >= self.n_core:
            return self.num_steps * self.n_core + layer - self.n_core
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
