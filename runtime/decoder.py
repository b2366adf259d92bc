"""The Decoder: how the schedules' calls (wfd.py) become the model's P, R and C calls.

It runs the calls of several sequences together, in lanes of one fixed shape, so that a row computes
the same bits in every schedule and beside any other rows (docs/exactness.md); it stages what the
host sends each call without blocking the device, so that a tick reads the device once (the C
call's tokens: docs/compiling.md); and it keeps the branch columns of the second proposal
(BranchColumns, docs/siblings.md). The call bodies that compiled decoding compiles whole are here
too: P with its rows' entry into their lanes (start_body), C with the choice of tokens (read_body).
"""
import time
import types
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

import kv
from runtime import compiling, memory
from runtime.sampling import M32, Sampling, choose, mix32
from runtime.transfers import Staging, fetch


@dataclass
class Readout:
    """What a C call read from a row: its token, and, for the rows whose logits are kept or
    digested, their place in the read."""
    token: int               # the token this row's logits choose for the next position
    finite: bool             # no NaN or inf among them
    logits: torch.Tensor     # the read's logits [lanes, V], on the model's device
    lane: int                # this row's among them
    digest: int = None       # the hash of this row's logits' bits (read_body), when digested


# -- the call bodies ------------------------------------------------------------------------------

def start_body(model, ids, call, s, e):
    """P, and its rows' e and s0 into their lanes (pos >= 0) of the lanes' s and e, in one function,
    so that compiled decoding compiles them into one graph: the new (s, e)."""
    e_new, s_new = model.p_body(ids, call)
    if call.busy:  # every lane starts a row
        return s_new, e_new
    started = call.pos[:, None] >= 0
    return torch.where(started, s_new, s), None if e is None else torch.where(started, e_new, e)


def read_body(model, s, e, call, sampling, rows=None, salt=None):
    """C and the tokens its logits choose, in one function, so that compiled decoding compiles them
    into one graph: logits [n, V] of `rows` (default all), and int64 [2, n] holding the token each
    chooses for the position after its row and 1 where all its logits are finite; with the salt
    (digest_salt), a third line, each row's digest."""
    logits = model.c_body(s, e, call, rows)
    nxt = None if sampling.greedy else (call.pos if rows is None else call.pos[rows]) + 1
    # a NaN or an inf carries into the float64 sum, which finite float32 logits never overflow
    finite = logits.sum(-1, dtype=torch.float64).isfinite()
    chosen = [choose(logits, nxt, sampling), finite.long()]
    if salt is not None:
        chosen.append(digest(logits, salt))
    return logits, torch.stack(chosen)


def digest_salt(vocab, device):
    """Each vocabulary entry's salt for digest, [2, V] int64: a 32-bit mask, and an odd multiplier
    below 2^31, both hashed from the entry's index."""
    h = mix32(torch.arange(2 * vocab, device=device)).view(2, vocab)
    return torch.stack([h[0], h[1] >> 1 | 1])


def digest(logits, salt):
    """Each row's hash [n] (int64) of the bits of its float32 logits [n, V]: the sum over v of
    (bits_v xor mask_v) * multiplier_v mod 2^32, exact in int64 (each product is below 2^63, the sum
    below V * 2^32). Each term is a bijection of its logit's 32 bits (xor, then a product by an odd
    number mod 2^32), so a change of any one logit changes the hash; several changes cancel out
    with a chance of about 2^-32. Made on the device, so that digested logits never cross to the
    host. (bits sign-extended to int64 keep their low 32 bits, all that the sum reads.)"""
    h = logits.view(torch.int32).long()
    h ^= salt[0]
    h *= salt[1]
    return h.bitwise_and_(M32).sum(-1)


# -- what the host sends a call --------------------------------------------------------------------

class Lines(NamedTuple):
    """A call's int64 lines over its lanes, as the host fills them and the device reads them: pos,
    each lane's row's position (-1: an idle lane); second, its depth (R) or its token (P), 0 when
    idle. With branch columns: branch, the column the row writes (-1: its position's); q, j
    [lanes, width], its redirects: the positions (-1: none) whose keys it reads from branch j."""
    pos: object
    second: object
    branch: Optional[object] = None
    q: Optional[object] = None
    j: Optional[object] = None

    @staticmethod
    def rows(width, branching):
        """The rows of a staged chunk: pos and second; with branches, branch, then q and j."""
        return 3 + 2 * width if branching else 2

    @staticmethod
    def named(chunk, width, branching):
        """A staged chunk [rows, lanes] (numpy on the host, a tensor on the device) as Lines of
        views of it."""
        if not branching:
            return Lines(chunk[0], chunk[1])
        q, j = chunk[3:3 + width], chunk[3 + width:]
        return Lines(chunk[0], chunk[1], chunk[2], q.T, j.T)


class BranchColumns:
    """The host's bookkeeping of the branch columns (the second proposal, docs/siblings.md). A row
    started at a position where a row of its sequence is in flight writes its keys to a branch
    column of its own (place); the rows built on it read that position's keys there (redirects);
    when it retires having won, read at full depth, its keys move to its position's column, where
    the rows after it read them (settle). Invariant, which has every row read its own ancestors'
    keys and no other row's:
    - a column is held by at most one row in flight of its sequence;
    - every ancestor in flight that holds a column is redirected, up to the oldest row;
    - a winner settles in the C call that retires it, before the next call is staged."""

    def __init__(self, cache, width):
        self.cache, self.width = cache, width

    def place(self, row, in_flight):
        """Give `row`, just given its lane, the lowest column its sequence's rows in flight leave
        free, when another of them holds its position."""
        if any(r.pos == row.pos and r.lane is not None and r is not row for r in in_flight):
            held = {r.branch for r in in_flight if r.branch is not None}
            row.branch = min(set(range(self.width)) - held)

    @staticmethod
    def redirects(row):
        """(position, column) of this row and of its ancestors in flight that hold a column: where
        it reads those positions' keys."""
        while row is not None:
            if row.branch is not None:
                yield row.pos, row.branch
            row = row.parent

    def settle(self, slot, rows, full_depth):
        """The rows of slot's sequence read at full depth and holding a column: the winners."""
        for r in rows:
            if r.branch is not None and r.depth == full_depth:
                self.cache.settle(slot, r.branch, r.pos)


# -- the Decoder -----------------------------------------------------------------------------------

class Decoder:
    """The calls of `slots` sequences decoded together, and what they share: the model, the KV
    cache (a sequence per slot) and the lanes. A prompt's prefill is a call of its own; after it
    every P, R and C call runs `slots x width` lanes: slot b's lanes come b-th, a row in the lane
    its P call gave it (its position mod width, unless a row of its sequence's call holds that
    lane: then the first one free), idle lanes at position -1. A row thus meets the same lanes and
    call shapes in every schedule whose rows in flight lie within `width` positions (AR, DtV, WFD),
    so a schedule computes AR's bits at the same batch and width, in any dtype
    (docs/exactness.md), whoever shares the call. branching: the second proposal's branch columns
    (BranchColumns).

    The schedules' calls come as runs: each a sequence (`run.seq`, a wfd.Sequence) and the call it
    waits for (`run.waits.rows`)."""

    def __init__(self, model, slots, capacity, *, num_steps, width, window=None,
                 sampling=Sampling(), compile=False, digest=False, branching=False):
        self.model, self.slots, self.num_steps, self.width = model, slots, num_steps, width
        self.compiled, self.lanes = compile, slots * width
        allocate = memory.static_cache if compile else memory.new_cache
        self.cache = allocate(model, capacity, num_steps, window, slots, width * branching)
        self.branches = BranchColumns(self.cache, width) if branching else None
        # P with the rows' entry into their lanes, and C with the choice of tokens (R: model.R)
        self.start_call, self.read_call = start_body, read_body
        if compile:  # each call may meet every power of two of the key blocks (kv.KVCache.span)
            room = len(self.cache.buckets())
            self.start_call, self.read_call, _ = (
                compiling.compiled(model, fn, room) for fn in (start_body, read_body, model.r_body))
        lanes = lambda dim: torch.zeros(self.lanes, dim, device=model.device, dtype=model.dtype)
        self.s = lanes(model.args.dim)  # [lanes, D]: the rows' states
        self.e = lanes(model.inject_dim) if model.inject_dim else None  # P's output for the rows
        self.keys = torch.zeros(self.lanes, dtype=torch.int64, device=model.device)  # seed keys
        self.sampler = sampling.on(model.device)._replace(key=self.keys)
        self.salt = digest_salt(model.args.vocab_size, model.device) if digest else None
        self.staging = Staging(model.device, Lines.rows(width, branching), self.lanes,
                               views=lambda chunk: Lines.named(chunk, width, branching))

    def prefill(self, seq, slot):
        """The whole prompt at full depth into its slot's cache, in a call of its own; commits the
        first new token (True when that ends the sequence)."""
        seq.slot, seq.t0 = slot, time.perf_counter()
        self.keys[slot * self.width:(slot + 1) * self.width].fill_(seq.key)
        n, cache = len(seq.prompt), self.cache.slot(slot)
        pos = torch.arange(n)
        e, s = self.model.P(torch.tensor(seq.prompt), pos, cache)
        for d in range(self.num_steps):
            s = self.model.R(s, e, pos, d, cache)
        seq.stats["r_calls"] += self.num_steps
        seq.stats["rows"] += n * self.num_steps
        seq.stats["c_calls"] += 1
        sampler = self.sampler._replace(key=self.keys[slot * self.width])
        call = self.model.to_device(pos, None, cache)
        logits, chosen = read_body(self.model, s, e, call, sampler, [n - 1], self.salt)
        token, finite, *digest = fetch(chosen[:, 0])
        return seq.commit(Readout(token, bool(finite), logits, 0, *digest))

    def stage(self, rows, second=None):
        """A call's Lines, filled from its rows and sent to the device, and the call itself: its
        kv.Branches (or None) and its furthest position. second(row): the second line's value of a
        row (its depth, its token)."""
        lines = self.staging.next()
        lines.pos.fill(-1)
        lines.second.fill(0)
        lowest = self.cache.scratch  # the first redirected position (scratch: none)
        if self.branches:
            for line in (lines.branch, lines.q, lines.j):
                line.fill(-1)
        for r in rows:
            lines.pos[r.lane] = r.pos
            if second:
                lines.second[r.lane] = second(r)
            if self.branches:
                lines.branch[r.lane] = -1 if r.branch is None else r.branch
                for i, (q, j) in enumerate(self.branches.redirects(r)):
                    lines.q[r.lane, i], lines.j[r.lane, i] = q, j
                    lowest = min(lowest, q)
        sent, branches = self.staging.send(), None
        if self.branches:
            # compiled: every block patched, one graph; eager: those from the first redirected
            # (from scratch's block: none)
            gather = None if self.compiled else lowest // self.cache.block
            branches = kv.Branches(sent.branch, sent.q, sent.j, gather)
        return sent, branches, max(r.pos for r in rows)

    def probe(self, top):
        """The call of one row, at position top with depth and token 0, the other lanes idle: what
        compiling.warm_up runs each graph on, staged as every call is, so that the decode meets
        the graphs it made (shapes, strides, Branches)."""
        return self.stage([types.SimpleNamespace(pos=top, lane=0, branch=None, parent=None)])

    def lane_of(self, pos):
        """The lane, within its slot's, of a row at position pos, unless a row of its sequence's
        call holds it."""
        return pos % self.width

    def rows_alone(self, rows, depth=lambda r: 0):
        """An eager call's rows, (lane, position, depth, branch, redirects) each, for their
        attention (models.Call): on a CPU, or in one lane."""
        if self.compiled or self.lanes > 1 and self.model.device.type != "cpu":
            return None
        moved = self.branches.redirects if self.branches else lambda r: ()
        return [(r.lane, r.pos, depth(r), r.branch, tuple(moved(r))) for r in rows]

    def call(self, sent, top, branches, rows=()):
        return self.model.to_device(sent.pos, None, self.cache, self.compiled, top).given(
            self.rows_alone(rows), branches)

    def start(self, runs):
        """P: the rows the sequences started, each in its lane (the other lanes idle, and kept), a
        second row at its position in a branch column of its own."""
        for run in runs:
            rows, first = run.waits.rows, run.seq.slot * self.width
            taken = {r.lane for r in rows if r.lane is not None}
            for row in run.seq.starting:
                row.lane = first + self.lane_of(row.pos)
                if row.lane in taken:
                    row.lane = min(set(range(first, first + self.width)) - taken)
                taken.add(row.lane)
                if self.branches:
                    self.branches.place(row, rows)
        starting = [row for run in runs for row in run.seq.starting]
        sent, branches, top = self.stage(starting, second=lambda r: r.token)
        for run in runs:
            run.seq.starting = []
        self.s, self.e = self.start_call(self.model, sent.second,
                                         self.call(sent, top, branches, starting), self.s, self.e)

    def advance(self, runs):
        """R: one call moves every row of every sequence one recurrence deeper, each at its own
        depth (after the P call of the rows they started, when any). The other lanes keep their
        state (draft-then-verify's rows waiting for the verify pass)."""
        starting = [run for run in runs if run.seq.starting]
        if starting:
            self.start(starting)
        rows = [r for run in runs for r in run.waits.rows]
        sent, branches, top = self.stage(rows, second=lambda r: r.depth)
        alone = self.rows_alone(rows, lambda r: r.depth)
        for r in rows:
            r.depth += 1
        t0 = time.perf_counter()
        self.s = self.model.R(self.s, self.e, sent.pos, sent.second, self.cache, self.compiled,
                              top=top, branches=branches, rows=alone)
        seconds = time.perf_counter() - t0
        for run in runs:
            seq, rows = run.seq, run.waits.rows
            if seq.trace is not None:  # one entry per R call: (position, depth reached, identity,
                # token) of each row, and the marks of its tick (Sequence.mark)
                index = {"index": seq.index} if seq.batched else {}
                seq.entry = dict(rows=[(r.pos, r.depth, id(r), r.token) for r in rows], **index)
                seq.trace.append(seq.entry)
            seq.stats["r_calls"] += 1
            seq.stats["rows"] += len(rows)
            seq.stats["r_seconds"] += seconds

    def read(self, runs):
        """C: each running row's logits and the token they choose, in one call and one transfer to
        the host. Returns each run's Readouts. A row read at full depth retires: a winner in a
        branch column settles (BranchColumns.settle)."""
        rows = [r for run in runs for r in run.waits.rows]
        sent, branches, top = self.stage(rows)
        logits, chosen = self.read_call(self.model, self.s, self.e,
                                        self.call(sent, top, branches, rows), self.sampler,
                                        salt=self.salt)
        if self.branches:
            for run in runs:
                self.branches.settle(run.seq.slot, run.waits.rows, self.num_steps)
        tokens, finite, *digests = fetch(chosen)  # the tick's one blocking transfer
        out = []
        for run in runs:
            run.seq.stats["c_calls"] += 1
            run.seq.stats["host_syncs"] += 1
            out.append([Readout(tokens[r.lane], bool(finite[r.lane]), logits, r.lane,
                                *(d[r.lane] for d in digests)) for r in run.waits.rows])
        return out
