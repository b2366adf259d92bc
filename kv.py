"""The KV cache of a looped LM: static buffers written by absolute position.

A looped layer applied at depth d has its own slot, because a row at depth d attends to the depth-d
keys of earlier positions. Huginn's prelude and coda layers have one slot each. Rolling back a
rejected draft needs no copy: the rows are forgotten, their entries lie past every reader's
position until a new row at that position overwrites them, and reads never look past the reader.

Every read covers the buffer's whole length, with a mask, so that a row's attention has the same
shape whichever rows share its call (README, "Exact in every precision"). Each buffer has one
column past the capacity, the scratch column: idle lanes of a call (position -1) write there and
nobody else can see it.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Step:
    """What one P / R / C call needs at every layer, built once per call by KVCache.prepare."""
    col: torch.Tensor            # [N] column each row writes: its position, or scratch for idle lanes
    visible: torch.Tensor        # [N, columns] keys each row may read
    depth: torch.Tensor = None   # [N] per-row depth (decode), or None: all rows at one depth (prefill)
    depth0: int = 0              # that one depth


class KVCache:
    def __init__(self, model, capacity, num_steps=None, per_depth=True):
        a = model.args
        self.n_core, self.num_steps, self.capacity = a.n_core, num_steps or model.num_steps, capacity
        self.scratch = capacity
        # slot of looped layer j at depth d: d * n_core + j; prelude and coda layers after them
        self.depth_slots = self.num_steps * a.n_core if per_depth else 0
        n_slots = self.depth_slots + a.n_prelude + a.n_coda
        shape = (n_slots, a.n_kv_heads, capacity + 1, a.head_dim)
        self.k = torch.zeros(shape, device=model.device, dtype=model.dtype)
        self.v = torch.zeros_like(self.k)

    def buffers(self):
        return [t for t in vars(self).values() if torch.is_tensor(t)]

    @property
    def nbytes(self):
        return sum(t.nbytes for t in self.buffers())

    def check(self, pos):
        """Before a call, on the host (pos: int64 [N], -1 for idle lanes): no device sync."""
        top = int(pos.max())
        if top >= self.capacity:
            raise IndexError(f"position {top} is past the KV cache's capacity of {self.capacity} positions")

    def prepare(self, pos, depth):
        """Once per call, on the device: device work only, so that a compiled call takes it in.
        pos: int64 [N], -1 for idle lanes; depth: an int (every row) or an int64 tensor [N] (one per row)."""
        col = torch.where(pos < 0, self.scratch, pos)
        keys = torch.arange(self.capacity + 1, device=col.device)
        visible = keys[None] <= col[:, None]  # idle lanes see everything: finite, and dropped
        if torch.is_tensor(depth):
            return Step(col, visible, depth=depth)
        return Step(col, visible, depth0=depth)

    def attend(self, step, layer, q, k, v):
        """Write this call's keys and values, then attend each row (q [N, H, hd]) to the visible
        keys of its slot."""
        if layer >= self.n_core:  # prelude and coda: one slot for every row
            slot = self.depth_slots + layer - self.n_core
        elif step.depth is None:
            slot = step.depth0 * self.n_core + layer
        else:  # rows at different depths (the wavefront): each row reads its own slot
            slots = step.depth * self.n_core + layer                        # [N]
            self.k[slots, :, step.col], self.v[slots, :, step.col] = k, v    # k, v [N, Hkv, hd]
            return attend_slots(q, self.k, self.v, slots, step.visible)
        # every row at one slot: heads first, [H, N, hd] against the slot's [Hkv, columns, hd]
        self.k[slot][:, step.col], self.v[slot][:, step.col] = k.transpose(0, 1), v.transpose(0, 1)
        y = F.scaled_dot_product_attention(q.transpose(0, 1), self.k[slot], self.v[slot],
                                           attn_mask=step.visible, enable_gqa=True)
        return y.transpose(0, 1)


def attend_slots(q, k, v, slots, visible):
    """Each row's one query (q [N, H, hd]) against the visible keys (visible [N, columns]) of its own
    slot (slots [N], into k, v [slots, Hkv, columns, hd]). Eager: SDPA over a copy of the rows' slots
    gathered into one batch. Compiled: the sums written out, which inductor fuses into one loop that
    reads each row's slot where it lies; there the copy would cost more than the attention (README,
    "Compiled decoding"), while eager the sums would build the products [N, H, columns, hd] in memory."""
    if not torch.compiler.is_compiling():
        y = F.scaled_dot_product_attention(q[:, :, None], k.index_select(0, slots), v.index_select(0, slots),
                                           attn_mask=visible[:, None, None], enable_gqa=True)  # [N, H, 1, hd]
        return y[:, :, 0]
    n, heads, hd = q.shape
    qg = q.float().view(n, k.shape[1], -1, hd) * hd ** -0.5                # [N, Hkv, group, hd]
    scores = (qg[:, :, :, None] * k[slots][:, :, None].float()).sum(-1)   # [N, Hkv, group, columns]
    weights = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
    y = (weights[..., None] * v[slots][:, :, None].float()).sum(-2)       # [N, Hkv, group, hd]
    return y.to(q.dtype).view(n, heads, hd)


def cache_bytes(model, capacity, num_steps, window=None):
    """The bytes make_cache would allocate, from the buffers' shapes alone (generate checks them
    against free memory before allocating)."""
    a = model.args
    column = 2 * a.n_kv_heads * a.head_dim * model.dtype.itemsize  # k and v of one position of one slot
    if window is None:
        return (num_steps * a.n_core + a.n_prelude + a.n_coda) * (capacity + 1) * column
    ring = min(max(window, 2 * window - 2), capacity)
    return ((a.n_prelude + a.n_coda + a.n_core) * (capacity + 1) + num_steps * a.n_core * (ring + 1)) * column


def make_cache(model, capacity, num_steps, window=None):
    """A full per-depth cache, or with a window the shared one."""
    return (KVCache(model, capacity, num_steps) if window is None else
            SharedKVCache(model, capacity, num_steps, window))


class SharedKVCache(KVCache):
    """Cross-recurrence KV sharing that stays exact with respect to its own AR (README, "Exact
    cross-recurrence KV sharing"): after the prompt, a row at position p and depth d reads the
    depth-d KV of positions p - window < q <= p, from a ring of max(window, 2 * window - 2) entries,
    and the final-depth KV of every older position."""

    def __init__(self, model, capacity, num_steps, window):
        super().__init__(model, capacity, num_steps, per_depth=False)  # prelude and coda slots only
        a = model.args
        self.window = window
        self.ring = min(max(window, 2 * window - 2), capacity)
        final = (a.n_core, a.n_kv_heads, capacity + 1, a.head_dim)
        ring = (self.num_steps, a.n_core, a.n_kv_heads, self.ring + 1, a.head_dim)  # + a scratch entry
        self.final_k = torch.zeros(final, device=model.device, dtype=model.dtype)
        self.final_v = torch.zeros_like(self.final_k)
        self.ring_k = torch.zeros(ring, device=model.device, dtype=model.dtype)
        self.ring_v = torch.zeros_like(self.ring_k)

    def attend(self, step, layer, q, k, v):
        if layer >= self.n_core:
            return super().attend(step, layer, q, k, v)
        ring_k, ring_v = self.ring_k[:, layer], self.ring_v[:, layer]  # [T, Hkv, ring + 1, hd]
        if step.depth is None:
            # the prefill: every prompt position at one depth, reading that depth only
            n, d = len(step.col), step.depth0
            last = slice(max(0, n - self.ring), None)  # the ring keeps the latest
            ring_k[d][:, step.col[last] % self.ring] = k[last].transpose(0, 1)
            ring_v[d][:, step.col[last] % self.ring] = v[last].transpose(0, 1)
            if d == self.num_steps - 1:
                self.final_k[layer][:, step.col], self.final_v[layer][:, step.col] = k.transpose(0, 1), v.transpose(0, 1)
            y = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, enable_gqa=True)
            return y.transpose(0, 1)
        col, d, idle = step.col, step.depth, step.col == self.scratch
        # every row writes its ring entry and, at the last depth, its final entry; the rest go to scratch
        ring_col = torch.where(idle, self.ring, col % self.ring)
        ring_k[d, :, ring_col], ring_v[d, :, ring_col] = k, v
        final_col = torch.where(d == self.num_steps - 1, col, self.scratch)
        self.final_k[layer][:, final_col], self.final_v[layer][:, final_col] = k.transpose(0, 1), v.transpose(0, 1)
        # keys: the whole final-depth buffer, shared by all rows and read once, visible up to
        # p - window; then each row's own window (p - window, p] at its depth, from the ring
        n, heads, hd = q.shape
        qg = q.view(n, k.shape[1], heads // k.shape[1], hd) * hd ** -0.5  # [N, Hkv, group, hd]
        fk, fv = self.final_k[layer], self.final_v[layer]                 # [Hkv, capacity + 1, hd]
        wpos = col[:, None] + torch.arange(1 - self.window, 1, device=q.device)  # [N, window]
        wk = ring_k[d[:, None], :, wpos % self.ring].transpose(1, 2)       # [N, Hkv, window, hd]
        wv = ring_v[d[:, None], :, wpos % self.ring].transpose(1, 2)
        scores = torch.cat([torch.einsum("nkgd,ksd->nkgs", qg, fk), torch.einsum("nkgd,nkwd->nkgw", qg, wk)], -1)
        keys = torch.arange(self.capacity + 1, device=q.device)
        visible = torch.cat([keys[None] <= col[:, None] - self.window, wpos >= 0], -1)  # [N, keys]
        scores = scores.float() if scores.element_size() < 4 else scores
        weights = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1).to(q.dtype)
        y = (torch.einsum("nkgs,ksd->nkgd", weights[..., :fk.shape[1]], fv)
             + torch.einsum("nkgw,nkwd->nkgd", weights[..., fk.shape[1]:], wv))
        return y.reshape(n, heads, hd)
