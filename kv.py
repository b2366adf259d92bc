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

Why reading this cache gives every schedule AR's result. A row at position p reads columns 0..p of
its slots and nothing past p. The wavefront runs a row at p at depth d only after the rows before it
wrote their depth-d keys, in earlier R calls (they started earlier, deeper on the diagonal). A row
at p survives only if every row before it was accepted, so (by induction over positions) those rows
are AR's, and what a surviving row read at columns < p is what AR's rows wrote there. A rejected
draft's row at p wrote wrong keys at column p of the depths it reached; no row reads them, since the
rows after it were dropped with it, and the row that restarts at p overwrites each depth before any
later row reads it. No rollback.
The prelude's slots (its layers run before the loop, by P) and the coda's (its layers run after
the loop, by C) follow the same rule:
- a restarted row's P call rewrites prelude column p before any later row's P call;
- coda column p over time (full-depth reads go in position order):
    the draft read of p: writes p's depth-k coda keys there
    a draft read of p + 1: may read them; only the draft's quality changes, not exactness
    p's full-depth read (which checks p+1's draft): rewrites them at full depth, in its C call
    before its read, and before any full-depth read after p
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F


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
        """Once per call (models.LoopedLM._layers; call: a models.Call, the rows' positions and
        depths: one per row (R), or None (P, C)): its rows grouped by depth, the host reading
        their positions and depths once."""
        pos = call.pos.tolist()
        depth = call.depth.tolist() if torch.is_tensor(call.depth) else [call.depth] * len(pos)
        groups = {}
        for i, (p, d) in enumerate(zip(pos, depth)):
            groups.setdefault(d, []).append(i)
        device = call.pos.device
        return [Group(d, torch.tensor(index, device=device), call.pos[index],
                      max(pos[i] for i in index)) for d, index in groups.items()]

    def attend(self, groups, layer, q, k, v):
        """Write the call's keys and values (k, v [N, Hkv, hd]) at their rows' positions in their
        depth's slot, then attend each row (q [N, H, hd]) to its slot's columns 0..pos, one SDPA
        call per group (`prepare`), after all writes: rows of one call see each other's keys (DtV's
        verify, the prefill). A wavefront R call: one batch for the matmuls, but ceil(T / k) rows
        at different depths, one SDPA call each (the engine's one: engine/kv_cache.py)."""
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
        """The slot of layer id `layer` at `depth` (None in P and C). Layer ids, assigned in
        models.LoopedLM.__init__: the looped layers 0..L-1 (L = n_core), then prelude, then coda."""
        if layer < self.n_core:
            return depth * self.n_core + layer
        return self.depth_slots + layer - self.n_core


class SharedKVCache(KVCache):
    """Cross-recurrence sharing by this project's rule, not the paper's (lossy r mod s; both in
    docs/shared-kv.md). A row at position p >= `prompt` and depth d reads the depth-d keys of the
    W = `window` positions p - W < q <= p and the last depth's (T - 1) before; the prompt's rows,
    prefilled a depth at a time, read their own depth. WFD under it is AR under it (another model
    than the full cache's): the window holds every position unfinished when p starts (W >=
    ceil(T / k), which generate checks); older ones are finished, as AR leaves them.
    It keeps per looped layer the last depth at every position (slot(j, 0)), and per depth d < T - 1
    a ring of max(W, 2W - 2) entries (a restarted row at p reads back to p - W + 1, the dropped rows
    wrote up to p + W - 2); depth T - 1 needs none (a row runs R from T - 1 after its draft was
    checked, and is never dropped then). Bytes: ((L + Lp + Lc) * C + (T - 1) * L * ring) * Hkv * hd
    * 2 * itemsize (C = capacity): on README's demo run (C = 136, L = 2, T = 4, W = 2, Hkv = 2,
    hd = 64, float32) 290,816, `KV 0.3 MiB` (KVCache: 1,114,112, `KV 1.1 MiB`)."""

    def __init__(self, model, capacity, num_steps, window, prompt):
        super().__init__(model, capacity, num_steps, depths=1)
        self.window, self.prompt, self.ring = window, prompt, max(window, 2 * window - 2)
        ring = ((num_steps - 1) * self.n_core, self.k.shape[1], self.ring, self.k.shape[3])
        self.ring_k = self.k.new_zeros(ring)  # ring_k[d * L + j]: looped layer j at depth d
        self.ring_v = torch.zeros_like(self.ring_k)

    def attend(self, groups, layer, q, k, v):
        """KVCache.attend by the rule at a looped layer: the prefill's group (positions 0..n-1)
        attends causally over its own keys, writing the ring's last `ring` positions (no entry
        twice); a decode row (one a group) reads last-depth columns 0..p - W, ring p - W + 1..p."""
        if layer >= self.n_core:  # the prelude's and coda's slots
            return super().attend(groups, layer, q, k, v)
        last, T = self.slot(layer, 0), self.num_steps
        for g in groups:
            keys, values = k[g.index].transpose(0, 1), v[g.index].transpose(0, 1)
            if g.depth == T - 1:
                self.k[last, :, g.pos], self.v[last, :, g.pos] = keys, values
            else:
                r, kept = g.depth * self.n_core + layer, slice(-self.ring, None)
                self.ring_k[r, :, g.pos[kept] % self.ring] = keys[:, kept]
                self.ring_v[r, :, g.pos[kept] % self.ring] = values[:, kept]
        if groups[0].max_pos < self.prompt:  # the prefill: one group, positions 0..n-1
            return causal_attention(q, k, v)
        y = torch.empty_like(q)
        for g in groups:
            p = g.max_pos
            keys, values = self.k[last, :, :p + 1], self.v[last, :, :p + 1]
            if g.depth < T - 1:
                edge, r = max(p - self.window + 1, 0), g.depth * self.n_core + layer
                ring = torch.arange(edge, p + 1, device=q.device) % self.ring
                keys = torch.cat([keys[:, :edge], self.ring_k[r, :, ring]], dim=1)
                values = torch.cat([values[:, :edge], self.ring_v[r, :, ring]], dim=1)
            y[g.index] = attention(q[g.index], keys, values)
        return y


def attention(q, keys, values, seen=None):
    """q [n, H, hd] against keys and values [Hkv, columns, hd]; seen: a mask [n, columns]."""
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                          attn_mask=seen, enable_gqa=True)[0].transpose(0, 1)


def causal_attention(q, k, v):
    """Attention of positions 0..N-1 among themselves (q, k, v [..., N, heads, hd]): the full
    forward without a cache, and the engine's prefill. 4-D, so that SDPA's fused kernels take it."""
    q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]).transpose(1, 2) for t in (q, k, v))  # [B, H, N, hd]
    y = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    return y.transpose(1, 2).reshape(q.shape)
