"""The KV cache of a looped LM, one slot per (depth, layer) (SharedKVCache: fewer), and its reads.

A looped layer j runs at every depth d, and a row at depth d attends to the depth-d keys of the
positions before it, so each (d, j) has a slot of its own. The prelude's and the coda's layers are
attention layers too, one slot each: a P call writes its position's prelude keys, and a C call (a
draft read or the verify) writes its position's coda keys and attends over earlier positions' coda
keys. Every slot is a static buffer written by absolute position:

    k, v  [slots, kv heads, capacity, head dim]      (L = the looped layers, T = the full depth)
    slot 0 .. T*L-1             looped layer j at depth d: d * L + j (depth = R calls done; the
                                R call from d to d + 1 uses slot d, so depth T has none)
    slot T*L .. T*L+Lp-1        the Lp prelude layers
    slot T*L+Lp ..              the coda layers
    column p                    position p's key, written by the row at position p

Why reading this cache gives every schedule AR's result, with no rollback. A row at p reads columns
0..p of its slots, some written by rows not yet verified; but a row survives only if every row
before it was accepted, so (by induction over positions) what a surviving row read is AR's. The
wavefront runs a row at depth d after the rows before it wrote their depth-d keys: in earlier R
calls (deeper on the diagonal), or in its own, whose keys `attend` writes before any row reads. A
wrong draft at p drops the rows at p and after, which wrote only at columns >= p; the row that
restarts at p starts before every later row, so it rewrites column p of each depth before a later
row reads it. In wfd.py's trace (p+2's draft wrong):
    R calls 5, 6  the row at p+2 writes column p+2 of depths 0 and 1, from the wrong token
    after call 6  the verify rejects it: it is dropped (with the draft read from it: no row at p+3)
    R calls 7, 8  the restarted row at p+2 rewrites column p+2 of depths 0 and 1
    R calls 9, 10 the row at p+3 reads them (at depths 0 and 1): the rewritten keys
Ouro has no prelude or coda. The prelude's column p: a restarted row's P call rewrites it first. The
coda's: a draft read of p writes depth-k coda keys, which only draft reads see before p's full-depth
read rewrites them (full-depth reads go in position order).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from layers.transformer import causal_attention


class Group(NamedTuple):
    """The rows of a call that read the same slots: one depth (R), or the whole call (P, C)."""
    depth: int          # their depth, or None in a call without looped layers
    index: torch.Tensor  # [n] their places in the call
    pos: torch.Tensor    # [n] their positions
    max_pos: int        # the last of their positions: they read columns 0..max_pos


class KVCache:
    def __init__(self, model, capacity, num_steps=None, depths=None):
        a = model.args
        self.n_core, self.num_steps = a.n_core, num_steps or model.num_steps
        self.depth_slots = (depths or self.num_steps) * a.n_core  # depths with a slot: T, or 1
        shape = (self.depth_slots + a.n_prelude + a.n_coda, a.n_kv_heads, capacity, a.head_dim)
        self.k = torch.zeros(shape, device=model.device, dtype=model.dtype)
        self.v = torch.zeros_like(self.k)

    @property
    def nbytes(self):  # every tensor's: generate's kv_bytes
        return sum(t.nbytes for t in vars(self).values() if torch.is_tensor(t))

    def prepare(self, call):
        """A models.Call's rows grouped by depth (R: a group per depth; P, C: one), once a call
        (models.LoopedLM._layers) for every layer's `attend`: one device-to-host read a call."""
        pos = call.pos.tolist()
        depth = [None] * len(pos) if call.depth is None else call.depth.tolist()  # None: P, C
        groups = {}
        for i, (p, d) in enumerate(zip(pos, depth)):
            groups.setdefault(d, []).append(i)
        return [Group(d, torch.tensor(index, device=call.pos.device), call.pos[index],
                      max(pos[i] for i in index)) for d, index in groups.items()]

    def attend(self, groups, layer, q, k, v):
        """Write the call's keys and values (k, v [N, Hkv, hd]) at their rows' positions in their
        depth's slot; after all writes (rows of one call see each other's: the prefill, DtV's
        verify), attend each row (q [N, H, hd]) to its slot's columns 0..pos, an SDPA call a group
        (a depth): in a wavefront R call, whose rows sit k depths apart, an SDPA call a row."""
        for g in groups:
            s = self.slot(layer, g.depth)
            self.k[s, :, g.pos] = k[g.index].transpose(0, 1)
            self.v[s, :, g.pos] = v[g.index].transpose(0, 1)
        y = torch.empty_like(q)
        for g in groups:  # a lone row sees every column it reads (0..its position): no mask
            s, n = self.slot(layer, g.depth), g.max_pos + 1
            seen = None if len(g.pos) == 1 else torch.arange(n, device=q.device) <= g.pos[:, None]
            y[g.index] = attention(q[g.index], self.k[s, :, :n], self.v[s, :, :n], seen)
        return y

    def slot(self, layer, depth):
        """The slot of layer id `layer` (Block.layer_id: the looped layers 0..L-1, L = n_core, then
        the prelude's, then the coda's) at `depth` (None in P and C)."""
        if layer < self.n_core:
            return depth * self.n_core + layer
        return self.depth_slots + layer - self.n_core


class SharedKVCache(KVCache):
    """Cross-recurrence sharing by this project's rule (docs/shared-kv.md). The paper's, not here:
    depth r reads and writes slot r mod s; at s = 1 (one slot), T = 4, k = 1, a row at depth 0 finds
    there the depth-1 keys of the position before it, in flight (WFD), where AR finds its depth-3
    keys: WFD is not AR under it.
    This rule: a row at p >= `prompt_len` and depth d reads depth d's keys at the W = `window`
    positions p - W < q <= p, and the last slot's (depth T - 1, the last R call's) before them (the
    prompt's rows read their own depth). WFD under it is AR under it: the rows in flight, ceil(T /
    k) <= W (generate checks it), lie within W of p and, deeper, have written depth d; older
    positions are finished, as in AR. It is another model than the full cache's: before the window
    it reads depth T - 1 where that reads d.
    Memory, per looped layer: the last slot at every position (self.k, one looped slot a layer:
    depths=1), and per depth d < T - 1 a ring of max(W, 2W - 2) entries, q at q % ring: a row
    restarted at p reads [p - W + 1, p], and the rows dropped with it wrote (p, p + W - 2]: 2W - 2
    positions, an entry each (T = 3, k = 1, W = 3: a ring of 3 would put p + 1's depth-0 keys where
    the restart reads p - 2's). Depth T - 1 needs no ring: a row runs R from T - 1 after its draft
    was checked, never dropped then. README's demo run (L = 2 looped layers, 2 kv heads x 64,
    float32: 1,024 bytes a column of a slot, k and v; capacity 136, W = 2): (2 x 136 + 3 x 2 x 2) x
    1,024 = 290,816 bytes, `KV 0.3 MiB`; KVCache: 8 x 136 x 1,024 = 1,114,112."""

    def __init__(self, model, capacity, num_steps, window, prompt_len):
        super().__init__(model, capacity, num_steps, depths=1)
        self.window, self.prompt_len, self.ring = window, prompt_len, max(window, 2 * window - 2)
        ring = ((num_steps - 1) * self.n_core, self.k.shape[1], self.ring, self.k.shape[3])
        self.ring_k = self.k.new_zeros(ring)  # ring_k[d * L + j]: looped layer j at depth d
        self.ring_v = torch.zeros_like(self.ring_k)

    def attend(self, groups, layer, q, k, v):
        """KVCache.attend by the rule at a looped layer: the prefill's group (positions 0..n-1)
        attends causally over its own keys and writes the ring's last `ring` positions (one write
        names an entry once); a decode group is one row (the wavefront's are at distinct depths):
        it reads the last slot's columns 0..p - W, its ring's the rest."""
        if layer >= self.n_core:  # the prelude's and coda's slots
            return super().attend(groups, layer, q, k, v)
        # self.k's looped slots are one a layer (depths=1): slot `layer` holds depth T - 1
        last_slot, T, ring_of = layer, self.num_steps, lambda depth: depth * self.n_core + layer
        for g in groups:
            keys, values = k[g.index].transpose(0, 1), v[g.index].transpose(0, 1)
            if g.depth == T - 1:
                self.k[last_slot, :, g.pos], self.v[last_slot, :, g.pos] = keys, values
            else:
                r, tail = ring_of(g.depth), slice(-self.ring, None)  # the last `ring` positions
                self.ring_k[r, :, g.pos[tail] % self.ring] = keys[:, tail]
                self.ring_v[r, :, g.pos[tail] % self.ring] = values[:, tail]
        if groups[0].max_pos < self.prompt_len:  # the prefill (decode rows start at prompt_len)
            return causal_attention(q, k, v)
        y = torch.empty_like(q)
        for g in groups:
            assert len(g.index) == 1, "a decode group of the shared cache is one row"
            p = g.max_pos
            keys, values = self.k[last_slot, :, :p + 1], self.v[last_slot, :, :p + 1]
            if g.depth < T - 1:
                edge, r = max(p - self.window + 1, 0), ring_of(g.depth)
                ring = torch.arange(edge, p + 1, device=q.device) % self.ring
                keys = torch.cat([keys[:, :edge], self.ring_k[r, :, ring]], dim=1)
                values = torch.cat([values[:, :edge], self.ring_v[r, :, ring]], dim=1)
            y[g.index] = attention(q[g.index], keys, values)
        return y


def attention(q, keys, values, seen=None):
    """q [n, H, hd] against keys and values [Hkv, columns, hd]; seen: a mask [n, columns]."""
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                          attn_mask=seen, enable_gqa=True)[0].transpose(0, 1)

