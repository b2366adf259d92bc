"""The KV cache of a looped LM, one slot per (depth, layer), and the attention that reads it.

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
    def __init__(self, model, capacity, num_steps=None):
        a = model.args
        self.n_core, self.num_steps = a.n_core, num_steps or model.num_steps
        self.depth_slots = self.num_steps * a.n_core
        shape = (self.depth_slots + a.n_prelude + a.n_coda, a.n_kv_heads, capacity, a.head_dim)
        self.k = torch.zeros(shape, device=model.device, dtype=model.dtype)
        self.v = torch.zeros_like(self.k)

    def slot(self, layer, depth):
        """The slot of layer id `layer` at `depth` (None in P and C). Layer ids, assigned in
        models.LoopedLM.__init__: the looped layers 0..L-1 (L = n_core), then prelude, then coda."""
        if layer < self.n_core:
            return depth * self.n_core + layer
        return self.depth_slots + layer - self.n_core

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
        call per group (`prepare`). All writes come first, so rows of one call see each other's
        keys (DtV's verify pass, the prefill). A wavefront R call's rows all sit at different
        depths: one batch for the matmuls, but one SDPA call per row, ceil(T / k) per layer (the
        engine attends them all at once, each over its own depth's keys: engine/kv_cache.py)."""
        for g in groups:
            s = self.slot(layer, g.depth)
            self.k[s, :, g.pos] = k[g.index].transpose(0, 1)
            self.v[s, :, g.pos] = v[g.index].transpose(0, 1)
        y = torch.empty_like(q)
        for g in groups:
            keys, values, seen = self.visible(layer, g)
            y[g.index] = F.scaled_dot_product_attention(
                q[g.index].transpose(0, 1)[None], keys[None], values[None], attn_mask=seen,
                enable_gqa=True)[0].transpose(0, 1)
        return y

    def visible(self, layer, g):
        """The keys and values [Hkv, columns, hd] a group reads, and the mask [n, columns] of the
        columns each row sees; a lone row sees every column read (0..its position): no mask."""
        s = self.slot(layer, g.depth)
        keys, values = self.k[s, :, :g.max_pos + 1], self.v[s, :, :g.max_pos + 1]
        cols = torch.arange(g.max_pos + 1, device=g.pos.device)
        return keys, values, None if len(g.pos) == 1 else cols <= g.pos[:, None]


class SharedKVCache(KVCache):
    """Cross-recurrence sharing by this project's rule, not the paper's (docs/shared-kv.md). This
    class shows the rule and saves no memory; the engine's cache saves it (Memory, below).

    The rule: a row at position p >= `prompt` and depth d reads the depth-d keys of the `window`
    positions p - window < q <= p and, for every older position, the keys of the last depth
    (T - 1). The prompt's rows read their own depth, as in KVCache: the prefill runs them all at
    each depth in turn, so none has a last depth yet.

    Why exact (WFD under it gives AR under it; the proof: docs/shared-kv.md): each key a row at p
    reads is already written, as AR writes it. The window's keys are at p's own depth d, which the
    positions before p reached in earlier R calls. The older ones are finished: rows start k or more
    ticks apart and finish T ticks after they start, so those unfinished when p starts lie at most
    ceil(T / k) - 1 positions before p, in a window >= ceil(T / k) (generate checks it). At T = 4,
    k = 2: when p starts, p - 2 has finished and p - 1 is at depth 2 of 4, inside a window of 2.
    The paper's rule (recurrence r reads and writes slot r mod s, s < T slots a layer) is lossy and
    breaks this. At T = 4, s = 2, k = 1, p's recurrence 0 reads slot 0:
        AR:        p - 1's recurrences 0..3 wrote slots 0,1,0,1: slot 0's last write is recurrence 2
        wavefront: p - 1 runs recurrence 1 in the same R call: slot 0 holds its recurrence-0 keys
    Still a model other than the full cache's: on the demo, shared AR agrees with full AR on the
    first token only (no test holds it: compare `python run.py --method ar` with `--kv shared`).

    Memory: this class keeps every depth. The engine's (engine/kv_cache.py) keeps per looped layer
    one last-depth slot plus, per depth, a ring of the last max(W, 2W - 2) positions (W = window;
    2W - 2: a restarted row at p reads back to p - W + 1, the dropped rows wrote up to p + W - 2):
    `python run.py --prompt "def fibonacci(n):"` ends on `KV 1.1 MiB`; with `--kv shared`, on
    `KV 0.3 MiB (shared, window 2)` (docs/shared-kv.md counts the bytes)."""

    def __init__(self, model, capacity, num_steps, window, prompt):
        super().__init__(model, capacity, num_steps)
        self.window, self.prompt = window, prompt

    def visible(self, layer, g):
        if g.depth is None or layer >= self.n_core:
            return super().visible(layer, g)
        last, own = self.slot(layer, self.num_steps - 1), self.slot(layer, g.depth)
        n = g.max_pos + 1
        cols = torch.arange(n, device=g.pos.device)
        # the window's lower edge: a prompt row's is -1 (it reads its own depth everywhere)
        edge = torch.where(g.pos >= self.prompt, g.pos - self.window, -1)[:, None]
        # keys: columns 0..n-1 of the last-depth slot, then 0..n-1 of the own-depth slot; a row at
        # p sees the first's columns 0..edge and the second's edge+1..p
        seen = torch.cat([cols <= edge, (cols > edge) & (cols <= g.pos[:, None])], dim=1)
        keys = torch.cat([self.k[last, :, :n], self.k[own, :, :n]], dim=1)
        values = torch.cat([self.v[last, :, :n], self.v[own, :, :n]], dim=1)
        return keys, values, seen


def causal_attention(q, k, v):
    """Attention of positions 0..N-1 among themselves (q, k, v [..., N, heads, hd]): the full
    forward without a cache, and the engine's prefill. 4-D, so that SDPA's fused kernels take it."""
    q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]).transpose(1, 2) for t in (q, k, v))  # [B, H, N, hd]
    y = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    return y.transpose(1, 2).reshape(q.shape)
