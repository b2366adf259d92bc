"""The engine's KV cache (the block manager): kv.py's slots, one per (depth, layer), and its rule
(a row reads columns 0..pos of its own depth's slot; a rejected draft needs no rollback), laid out
for batches and read by key blocks of fixed shape, so that a row's bits never depend on its call.

The buffers hold `batch` sequences (one per slot of batched decoding), (sequence, slot) as one first
dimension, so that a call writes the buffer itself, in place, and reads it with one index_select. A
call of N lanes over B sequences gives each sequence N / B consecutive lanes; a lane reads and
writes its own sequence only, and a slot's next prompt overwrites what it reads.

A call reads the keys in blocks of BLOCK columns, each with the same shapes in every call, and only
the blocks some row of the call can see (`span`), so attention costs what the rows read, not the
capacity; a row's result depends on its own keys only (`attend_blocks`). One column past the blocks,
the scratch column, takes the writes of idle lanes (position -1); no block holds it. The wavefront's
second proposal adds branch columns after it, for the keys of a second row at a position
(siblings.Branches, docs/siblings.md).
"""
import copy
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.compiling import sums_written_out
from engine.siblings import Patch, redirect
from layers.transformer import causal_attention

BLOCK = 256  # keys per attention block: a GPU's split-KV tile, and enough for a short CPU run


@dataclass
class Step:
    """What one P / R / C call's attention needs at every layer, built once per call (prepare)."""
    col: torch.Tensor     # [N] the column each row writes: its position, its branch column (a
                          # second row at a position), or scratch for idle lanes
    at: torch.Tensor      # [N] its position, or scratch for idle lanes (which see every key)
    span: int             # key blocks the call reads; 0: the prefill, causal among its own rows
    blocks: list          # per key block read: (k, v, its Mask, how to read it) (key_blocks)
    depth: torch.Tensor   # [N] each row's depth (0 in a call without looped layers)
    first: torch.Tensor   # [N] each row's sequence's first buffer row
    looped: torch.Tensor  # [N] first + depth * n_core: its row of looped layer 0 (layer j: + j)
    sums: bool            # compiled on a CPU: attention written out as sums (block_attention)


class KVCache:
    """branches: columns past the scratch one, per sequence, for the keys of second rows at a
    position (the wavefront's second proposal, docs/siblings.md): a row there writes its branch's
    column, the rows built on it read that column for its position (prepare's redirects), and when
    it retires having won, its keys move to its position's column (settle)."""

    def __init__(self, model, capacity, num_steps=None, per_depth=True, device=None, batch=1,
                 branches=0):
        a = model.args
        self.device, self.batch, self.branches = device or model.device, batch, branches
        self.n_core, self.num_steps = a.n_core, num_steps or model.num_steps
        self.capacity, self.block = capacity, min(BLOCK, capacity)  # a small cache: one block
        self.scratch = -(-capacity // self.block) * self.block  # where the blocks end
        # a sequence's slots: looped layer j at depth d is d * n_core + j; prelude and coda after
        self.depth_slots = self.num_steps * a.n_core if per_depth else 0
        self.seq_slots = self.depth_slots + a.n_prelude + a.n_coda
        shape = (batch * self.seq_slots, a.n_kv_heads, self.scratch + 1 + branches, a.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=model.dtype)
        self.v = torch.zeros_like(self.k)

    def buffers(self):
        return [t for t in vars(self).values() if torch.is_tensor(t)]

    @property
    def nbytes(self):
        return sum(t.nbytes for t in self.buffers())

    def slot(self, b):
        """The cache of the sequence in slot b alone, for its prefill: views (writes land here)."""
        view = copy.copy(self)
        one = lambda t: t.view(self.batch, -1, *t.shape[1:])[b]  # [B * X, ...] -> [X, ...]
        view.__dict__.update({k: one(t) for k, t in vars(self).items() if torch.is_tensor(t)})
        view.batch = 1
        return view

    def span(self, top, prefill=False, bucket=False):
        """On the host, before a call whose furthest row is at position `top`: the key blocks its
        rows can see, or 0 for the prefill. bucket: rounded up to a power of two, so that compiled
        decoding makes a graph per power, not per block."""
        if top >= self.capacity:
            raise IndexError(f"position {top} is past the KV cache's capacity of {self.capacity} "
                             "positions")
        if prefill:
            return 0
        n = top // self.block + 1
        return min(1 << (n - 1).bit_length(), self.scratch // self.block) if bucket else n

    def buckets(self):
        """The values span(bucket=True) can take: the powers of two below the blocks, and theirs."""
        n = self.scratch // self.block
        return [1 << i for i in range((n - 1).bit_length())] + [n]

    def prepare(self, call):
        """Once per call, on the device (so that a compiled call takes it in), from the call
        (model_runner.Call): lanes (here pos), each lane's position, int64 [N], -1 for idle; depth
        int64 [N], or an int for every row, or None (no looped layer); span (KVCache.span);
        branches: the call's Branches, or None. rows (model_runner.Call.rows): after the prefill
        each row attends alone, as a plain forward does, over its slot's columns 0..pos (views;
        redirects gathered), unmasked: none past it is read, and its bits are its keys' alone
        (docs/exactness.md)."""
        pos, depth, span, branches, rows = (call.lanes, call.depth, call.span, call.branches,
                                            call.rows)
        sums = call.compiled and sums_written_out(pos.device)
        n = pos.shape[0]
        if n % self.batch:
            raise ValueError(f"a call of {n} lanes cannot split evenly over {self.batch} sequences")
        if rows is not None and span:  # each row's first buffer row, write column, read columns
            return [(lane, lane // (n // self.batch) * self.seq_slots, d,
                     p if b is None else self.scratch + 1 + b, self.columns(p, dict(moved)))
                    for lane, p, d, b, moved in rows]
        at = torch.where(pos < 0, self.scratch, pos)
        col = at if branches is None else torch.where(branches.branch >= 0,
                                                      self.scratch + 1 + branches.branch, at)
        if not torch.is_tensor(depth):
            depth = torch.full_like(pos, depth or 0)
        first = torch.arange(n, device=pos.device) // (n // self.batch) * self.seq_slots  # lane i's
        looped = torch.add(first, depth, alpha=self.n_core)
        blocks = self.key_blocks(at.unsqueeze(1), span, branches=branches)
        return Step(col, at, span, blocks, depth, first, looped, sums)

    def key_blocks(self, last, span, buffers=None, branches=None):
        """The blocks a call reads, (k, v, Mask, redirected): a key is visible to a row up to the
        column `last` [N, 1] (idle lanes, col scratch, see all, and are dropped). With branches,
        the blocks that may hold a redirected position come with how to read them (read):
        eager, from branches.gather on, cols [N, B], each row's column for each position of the
        block (its own, or for a redirected one its branch's); compiled, every block, a Patch."""
        (k, v), n = buffers or (self.k, self.v), self.block
        visible = torch.arange(span * n, device=last.device).unsqueeze(0) <= last
        blocks = []
        for b, lo in enumerate(range(0, span * n, n)):
            seen = mask(visible if span == 1 else visible[:, lo:lo + n], k.dtype)
            how, wide = None, 0
            if branches is not None and branches.gather is None:  # and a spare column (read)
                inside = (branches.q >= lo) & (branches.q < lo + n)
                how, wide = Patch(torch.where(inside, branches.q - lo, n),
                                  self.scratch + 1 + branches.j), 1
            elif branches is not None and b >= branches.gather:
                cols = torch.arange(lo, lo + n, device=last.device).expand(len(last), n)
                how = redirect(cols, cols, branches, self.scratch + 1)
            blocks.append((k.narrow(2, lo, n + wide), v.narrow(2, lo, n + wide), seen, how))
        return blocks

    def attend(self, step, layer, q, k, v):
        """Write this call's keys and values (k, v [N, Hkv, hd]), then attend each row (q [N, H,
        hd]) to the visible keys of its sequence's slot for this layer at the row's depth."""
        if isinstance(step, list):  # each row's own (prepare's rows)
            return self.attend_rows(step, layer, q, k, v)
        rows = step.looped + layer if layer < self.n_core else step.first + (
            self.depth_slots + layer - self.n_core)
        self.k[rows, :, step.col], self.v[rows, :, step.col] = k, v  # one index_put each
        if step.span == 0:
            return causal_attention(q, k, v)
        return attend_blocks(q, [(read(bk, self.k, rows, how), read(bv, self.v, rows, how), seen)
                                 for bk, bv, seen, how in step.blocks], step.sums)

    def columns(self, pos, moved):
        """Columns 0..pos, those in moved (position: branch) their branch's: slice or tensor."""
        cols = torch.arange(pos + 1, device=self.device) if moved else slice(0, pos + 1)
        for c, b in moved.items():  # fill_ takes the value as the kernel's argument, where an
            cols[c].fill_(self.scratch + 1 + b)  # assignment copies a host tensor (a CUDA sync)
        return cols

    def attend_rows(self, rows, layer, q, k, v):
        """attend, each row over its columns (prepare's rows); idle lanes get 0."""
        q4, reads = q.unsqueeze(2), {}  # [N, H, 1, hd]
        for lane, first, depth, col, cols in rows:  # every row's keys written before any row reads
            row = first + (depth * self.n_core + layer if layer < self.n_core else
                           self.depth_slots + layer - self.n_core)
            self.k[row, :, col], self.v[row, :, col] = k[lane], v[lane]
            reads[lane] = slice(row, row + 1), slice(None), cols  # [1, Hkv, columns, hd]
        y = [F.scaled_dot_product_attention(q4[i:i + 1], self.k[reads[i]], self.v[reads[i]],
                                            enable_gqa=True)
             if i in reads else q4.new_zeros(q4[:1].shape) for i in range(len(q))]
        return (torch.cat(y) if len(y) > 1 else y[0]).squeeze(2)

    def settle(self, slot, branch, pos):
        """A second row that won its position, retiring: its keys and values, in every slot of its
        sequence, from its branch's column to its position's, where the rows after it read them."""
        rows = slice(slot * self.seq_slots, (slot + 1) * self.seq_slots)
        for t in (self.k, self.v):
            t[rows, :, pos] = t[rows, :, self.scratch + 1 + branch]


def read(block, buffer, rows, how):
    """Each row's keys (or values) of a block: block [S, Hkv, B, hd] is the block's view of the
    whole buffer (with a Patch, B + 1 columns), rows [N] each row's buffer row; how
    (key_blocks): None, the block as it lies; cols [N, B], each row's columns of the buffer, laid
    out as index_select lays them out (contiguous, so that the attention computes the same bits);
    a Patch. [N, Hkv, B, hd]."""
    if how is None:
        return block.index_select(0, rows)
    if torch.is_tensor(how):
        return buffer[rows[:, None], :, how].transpose(1, 2).contiguous()
    out = block.index_select(0, rows)  # [N, Hkv, B + 1, hd]: the last column a spare
    lane = torch.arange(len(rows), device=rows.device)[:, None]
    out[lane, :, how.at] = buffer[rows[:, None], :, how.cols]  # [N, R, Hkv, hd]; no two alike
    return out[:, :, :-1]  # but in the spare


class Mask(NamedTuple):
    """Which columns of a key block each row of a call sees: visible [N, B], as SDPA's mask [N, 1, 1,
    B], and keep [N, 1, B, 1], the same as the bits to AND a key's or value's bits with (all ones
    where seen, zeros where not; the signed integer of the cache dtype's width), made once per
    call."""
    visible: torch.Tensor
    attn_mask: torch.Tensor
    keep: torch.Tensor


BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float dtype's width -> its integer


def mask(visible, dtype):
    keep = torch.where(visible, -1, 0).to(BITS[dtype.itemsize])
    return Mask(visible, visible.unsqueeze(1).unsqueeze(1), keep.unsqueeze(1).unsqueeze(-1))


def hide(x, keep):
    """x [N, Hkv, B, hd] with every column its row cannot see made +0.0, whatever it held (a
    dropped draft's key, another row's, a stale or overflowed value, where 0 * inf would be NaN),
    and every other element's bits kept: a bitwise AND, several times quicker than torch.where
    on a CPU."""
    return (x.view(keep.dtype) & keep).view(x.dtype)


def block_attention(q, k, v, seen, need_lse, sums):
    """q [N, H, hd] against one block of each row's own keys: k, v [N, Hkv, B, hd], seen: their
    Mask. Returns the output [N, H, hd], normalized within the block, and with need_lse its
    log-sum-exp [N, H] in at least float32 (-inf where the row sees nothing). A column the row
    cannot see adds exactly nothing, whatever it holds: its score is -inf and its value 0 (hide).
    sums (compiled on a CPU: compiling.sums_written_out): the products and sums written
    out, which inductor fuses into one loop that reads every row's slot where it lies; eager and on
    CUDA, einsum and SDPA over the gathered block."""
    n, heads, hd = q.shape
    # inductor vectorizes a select but not a bitcast: the same +0.0 where unseen, the same bits
    v = torch.where(seen.visible[:, None, :, None], v, 0) if sums else hide(v, seen.keep)
    lse = None
    if need_lse or sums:
        acc = torch.promote_types(q.dtype, torch.float32)  # the sums' precision: at least float32
        qg = q.to(acc).view(n, k.shape[1], -1, hd) * hd ** -0.5  # [N, Hkv, group, hd]
        if sums:
            scores = (qg[:, :, :, None] * k[:, :, None].to(acc)).sum(-1)
        else:
            scores = torch.einsum("nkgd,nkbd->nkgb", qg, k.to(acc))
        scores = scores.masked_fill(~seen.attn_mask, float("-inf"))  # [N, Hkv, group, B]
        lse = scores.logsumexp(-1, keepdim=True)
    if sums:
        y = ((scores - lse).exp()[..., None] * v[:, :, None].to(acc)).sum(-2)
        y = y.to(q.dtype).view(n, heads, hd)
    else:  # [N, H, 1, hd] -> [N, H, hd]; SDPA adds its mask to the scores, so the keys are hidden
        # too (NaN - inf is NaN)
        y = F.scaled_dot_product_attention(q.unsqueeze(2), hide(k, seen.keep), v,
                                           attn_mask=seen.attn_mask, enable_gqa=True).squeeze(2)
    return y, (lse.view(n, heads) if need_lse else None)


def attend_blocks(q, blocks, sums=False):
    """q [N, H, hd] against a list of blocks (k, v, Mask: see block_attention), merged by their
    log-sum-exps in a fixed order. Why a row's result does not depend on the other rows of its call:
    every block has the same shapes in every call, and a block the row cannot see has lse -inf, so
    its weight exp(-inf - total) is exactly 0 (its output, NaN for an empty softmax, is dropped),
    and it adds exactly 0 to the sum in total: the row gets the bits of a call of its own blocks
    only. One block needs no merge: its weight would be 1."""
    if len(blocks) == 1:
        return block_attention(q, *blocks[0], need_lse=False, sums=sums)[0]
    outs = [block_attention(q, k, v, seen, need_lse=True, sums=sums) for k, v, seen in blocks]
    # the blocks' weights exp(lse_b - total), computed so that every lane gets the same bits and
    # blocks a row cannot see change nothing: eager, total = top + log(sum_b exp(lse_b - top)) of
    # elementwise ops and a max (exact in any order) over the stacked blocks, the sum added block
    # by block (the CPU's logaddexp takes a call's last lanes another way, and a sum over the
    # stacked blocks adds in an order that depends on the call's block count: docs/exactness.md);
    # with sums (compiled on a CPU), by logaddexp, which inductor fuses alike for every lane
    if sums:
        total = outs[0][1]
        for _, lse in outs[1:]:
            total = torch.logaddexp(total, lse)
        weights = [(lse - total).exp() for _, lse in outs]
    else:
        lses = torch.stack([lse for _, lse in outs], -1)  # [N, H, blocks]
        top = lses.amax(-1, keepdim=True)
        mass, *rest = (lses - top).exp().unbind(-1)
        for m in rest:
            mass = mass + m
        weights = (lses - (top + mass.log()[..., None])).exp().unbind(-1)
    y = 0
    for (o, _), w in zip(outs, weights):
        w = w[..., None]  # [N, H, 1]
        y = y + torch.where(w > 0, o.to(w.dtype), 0) * w
    return y.to(q.dtype)


@dataclass
class SharedStep(Step):
    """Step, and what the shared cache's looped layers read and write (SharedKVCache.prepare)."""
    seq: torch.Tensor = None         # [N] each row's sequence
    ring_col: torch.Tensor = None    # [N] each row's ring entry (its scratch entry: none)
    final_col: torch.Tensor = None   # [N] each row's final-depth column (at depth T - 1; scratch)
    window_col: torch.Tensor = None  # [N, window] the ring entries of positions p - window < q <= p
    window_seen: Mask = None         # which of them are positions (>= 0)
    older: list = ()                 # key_blocks of the final-depth keys up to p - window


class SharedKVCache(KVCache):
    """Cross-recurrence KV sharing that stays exact with respect to its own AR (docs/shared-kv.md):
    after the prompt, a row at position p and depth d reads the depth-d KV of positions p - window
    < q <= p, from a ring of max(window, 2 * window - 2) entries (with branches, the rows in flight
    may reach `branches` positions: max(window, branches + window - 2)), and the final-depth KV of
    every older position. Prelude and coda layers keep a slot each, as in KVCache. A second row at
    a position has ring entries of its branch past the ring's scratch entry; only a row that won
    its position reaches the final depth, which it writes at its position."""

    def __init__(self, model, capacity, num_steps, window, device=None, batch=1, branches=0):
        super().__init__(model, capacity, num_steps, per_depth=False, device=device, batch=batch,
                         branches=branches)
        a = model.args
        self.window = window
        self.ring = min(max(window, 2 * window - 2, branches + window - 2), capacity)
        # one first dimension, as in KVCache: final row of (sequence s, layer j) s * n_core + j;
        # ring row of (s, depth d, j) (s * T + d) * n_core + j; each ring row with a scratch entry
        # and the branches' entries
        final = (batch * a.n_core, a.n_kv_heads, self.scratch + 1, a.head_dim)
        ring = (batch * self.num_steps * a.n_core, a.n_kv_heads, self.ring + 1 + branches,
                a.head_dim)
        self.final_k = torch.zeros(final, device=self.device, dtype=model.dtype)
        self.final_v = torch.zeros_like(self.final_k)
        self.ring_k = torch.zeros(ring, device=self.device, dtype=model.dtype)
        self.ring_v = torch.zeros_like(self.ring_k)

    def prepare(self, call):
        step = super().prepare(call._replace(rows=None))  # rows or not: the windows' Step
        span, branches = call.span, call.branches
        at, idle = step.at, step.at == self.scratch
        ring_col = torch.where(idle, self.ring, at % self.ring)
        if branches is not None:
            ring_col = torch.where(branches.branch >= 0, self.ring + 1 + branches.branch,
                                   ring_col)
        if span == 0:  # the prefill: the ring keeps the latest positions, the older go to scratch
            ring_col = torch.where(at < len(at) - self.ring, self.ring, ring_col)
        window = at[:, None] + torch.arange(1 - self.window, 1, device=at.device)  # [N, window]
        window_col = window % self.ring
        if branches is not None:
            window_col = redirect(window_col, window, branches, self.ring + 1)
        final_col = torch.where(step.depth == self.num_steps - 1, at, self.scratch)
        older = self.key_blocks(window[:, :1] - 1, span, (self.final_k, self.final_v))  # p - W
        seq = torch.arange(len(at), device=at.device) // (len(at) // self.batch)
        # Step's fields by name, not vars(step): torch 2.11's dynamo cannot trace a __dict__
        return SharedStep(**{f: getattr(step, f) for f in Step.__dataclass_fields__}, seq=seq,
                          ring_col=ring_col, final_col=final_col, window_col=window_col,
                          window_seen=mask(window >= 0, self.k.dtype), older=older)

    def attend(self, step, layer, q, k, v):
        if layer >= self.n_core:
            return super().attend(step, layer, q, k, v)
        final_row = step.seq * self.n_core + layer
        ring_row = (step.seq * self.num_steps + step.depth) * self.n_core + layer
        self.ring_k[ring_row, :, step.ring_col], self.ring_v[ring_row, :, step.ring_col] = k, v
        self.final_k[final_row, :, step.final_col] = k
        self.final_v[final_row, :, step.final_col] = v
        if step.span == 0:  # the prefill reads its own keys, at its one depth
            return causal_attention(q, k, v)
        # first each row's own window at its depth, from the ring (never empty: it holds p), then
        # the older final-depth blocks
        ring = lambda t: t[ring_row[:, None], :, step.window_col].transpose(1, 2)  # [N, Hkv, W, hd]
        older = [(bk.index_select(0, final_row), bv.index_select(0, final_row), seen)
                 for bk, bv, seen, _ in step.older]
        window = (ring(self.ring_k), ring(self.ring_v), step.window_seen)
        return attend_blocks(q, [window] + older, step.sums)

    def settle(self, slot, branch, pos):
        super().settle(slot, branch, pos)  # prelude and coda
        per_sequence = self.num_steps * self.n_core
        rows = slice(slot * per_sequence, (slot + 1) * per_sequence)
        for t in (self.ring_k, self.ring_v):
            t[rows, :, pos % self.ring] = t[rows, :, self.ring + 1 + branch]


def cache_bytes(model, capacity, num_steps, window=None, batch=1, branches=0):
    """The bytes make_cache would allocate, from its buffers built on the meta device."""
    return make_cache(model, capacity, num_steps, window, "meta", batch, branches).nbytes


def make_cache(model, capacity, num_steps, window=None, device=None, batch=1, branches=0):
    """A full per-depth cache, or with a window the shared one (on the model's device by default),
    for `batch` sequences of `capacity` positions each, and `branches` branch columns each."""
    if window is None:
        return KVCache(model, capacity, num_steps, device=device, batch=batch, branches=branches)
    return SharedKVCache(model, capacity, num_steps, window, device, batch, branches)
