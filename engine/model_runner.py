"""The model runner: how the schedules' calls (wfd.py) become the model's P, R and C calls.

It runs the calls of several sequences together, in lanes of one fixed shape, so that a row computes
the same bits in every schedule and beside any other rows (docs/exactness.md); it stages what the
host sends each call without blocking the device, so that a tick reads the device once (the C
call's tokens: docs/compiling.md); and it keeps the branch columns of the second proposal
(siblings.BranchColumns, docs/siblings.md). The call bodies that compiled decoding compiles whole
are here too: P with its rows' entry into their lanes (start_body), R with the idle lanes' states
kept (recur_body), C with the choice of tokens (read_body).
"""
import time
import types
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from engine import compiling, memory
from engine.sampling import Sampling, choose
from engine.siblings import BranchColumns, Branches
from engine.staging import Staging, fetch
from layers.noise import M32, mix32


@dataclass
class LaneReadout:
    """What a C call read from a row: its token, and, for the rows whose logits are kept or
    digested, their place in the read."""
    token: int               # the token this row's logits choose for the next position
    finite: bool             # no NaN or inf among them
    logits: torch.Tensor     # the read's logits [lanes, V], on the model's device
    lane: int                # this row's among them
    digest: int = None       # the hash of this row's logits' bits (read_body), when digested


# -- the calls ------------------------------------------------------------------------------------

class Call(NamedTuple):
    """A call as the model's bodies read it (models.Call's fields: pos, depth, cache, clock), and
    what the engine reads of it besides: its lanes' positions with the idle ones, the key blocks its
    rows can see (KVCache.span), whether it runs compiled, the rows' branch columns
    (siblings.Branches), and, eager, the rows as the host stages them, which then attend one by one
    (engine/kv_cache.py: KVCache.prepare)."""
    lanes: torch.Tensor  # [N] each lane's row's position, -1 for an idle lane
    depth: Optional[torch.Tensor]  # [N] each lane's depth (R), or an int for every row (the
                                   # prefill's R); None in P and C
    cache: object
    clock: Optional[torch.Tensor] = None
    busy: bool = False  # every lane holds a row, as the host knows: no idle lane's state to keep
    span: Optional[int] = None
    compiled: bool = False
    branches: Optional[Branches] = None
    rows: Optional[list] = None

    @property
    def pos(self):
        """The positions the model's bodies look up (RoPE rows, learned positions, s0), an idle
        lane's as position 0's: its outputs are kept nowhere. Made where a body reads it, so that
        a call clamps no more often than its bodies look positions up."""
        return self.lanes.clamp(min=0)

    def given(self, rows, branches=None):
        """The call with the host's rows and its branches; busy when the rows fill every lane."""
        return self._replace(rows=rows, branches=branches,
                             busy=self.busy or rows is not None and len(rows) == len(self.lanes))


def to_device(model, pos, depth, cache, compiled=False, top=None):
    """A call's inputs as a Call on the device, its key blocks checked against the cache: with
    `top`, the furthest row's position known on the host, pos and depth are on the device already
    (staged); without, they are read (for the key blocks and Call.busy) and copied there."""
    if top is not None:
        return Call(pos, depth, cache, span=cache.span(top, bucket=compiled), compiled=compiled)
    at = pos.tolist()  # one read, not one per element
    span = cache.span(max(at), prefill=at[0] == 0, bucket=compiled)
    move = lambda t: t.to(model.device) if torch.is_tensor(t) else t
    return Call(move(pos), move(depth), cache, busy=min(at) >= 0, span=span, compiled=compiled)


def recur(model, s, e, call):
    """R: one recurrence of every row of the call, compiled or not (LoopFormer's clock runs on the
    cache's full depth)."""
    if model.clock is not None:
        call = call._replace(clock=model.clock_table(call.cache.num_steps))
    body = compiling.compiled(model, recur_body) if call.compiled else recur_body
    return body(model, s, e, call)


# -- the call bodies ------------------------------------------------------------------------------

def recur_body(model, s, e, call):
    """R, and the idle lanes' states kept (position -1: no row), in one function, so that compiled
    decoding compiles them into one graph: the new s."""
    s_new = model.r_body(s, e, call)
    return s_new if call.busy else torch.where(call.lanes[:, None] >= 0, s_new, s)


def start_body(model, ids, call, s, e):
    """P, and its rows' e and s0 into their lanes (pos >= 0) of the lanes' s and e, in one function,
    so that compiled decoding compiles them into one graph: the new (s, e)."""
    s_new, e_new = model.p_body(ids, call)
    if call.busy:  # every lane starts a row
        return s_new, e_new
    started = call.lanes[:, None] >= 0
    return torch.where(started, s_new, s), None if e is None else torch.where(started, e_new, e)


def read_body(model, s, e, call, sampling, rows=None, salt=None):
    """C and the tokens its logits choose, in one function, so that compiled decoding compiles them
    into one graph: logits [n, V] of `rows` (default all), and int64 [2, n] holding the token each
    chooses for the position after its row and 1 where all its logits are finite; with the salt
    (digest_salt), a third line, each row's digest."""
    h = model.c_state(s, e, call)
    logits = model.head(h if rows is None else h[rows])  # the head on the rows read alone
    nxt = None if sampling.greedy else (call.lanes if rows is None else call.lanes[rows]) + 1
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
    each lane's row's position (-1: an idle lane); the second line, named depth in an R call and
    token in a P call: its depth or its token, 0 when idle. With branch columns: branch, the column
    the row writes (-1: its position's); q, j [lanes, width], its redirects: the positions (-1:
    none) whose keys it reads from branch j."""
    pos: object
    depth: object
    token: object
    branch: Optional[object] = None
    q: Optional[object] = None
    j: Optional[object] = None

    @staticmethod
    def rows(width, branching):
        """The rows of a staged chunk: pos, depth or token; with branches, branch, then q and j."""
        return 3 + 2 * width if branching else 2

    @staticmethod
    def named(chunk, width, branching):
        """A staged chunk [rows, lanes] (numpy on the host, a tensor on the device) as Lines of
        views of it."""
        if not branching:
            return Lines(chunk[0], chunk[1], chunk[1])
        q, j = chunk[3:3 + width], chunk[3 + width:]
        return Lines(chunk[0], chunk[1], chunk[1], chunk[2], q.T, j.T)


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

    The schedules' calls come as runs: each a sequence (`run.seq`, a sequence.Sequence) and the
    call it waits for (`run.waits.rows`)."""

    def __init__(self, model, slots, capacity, *, num_steps, width, window=None,
                 sampling=Sampling(), compile=False, digest=False, branching=False):
        self.model, self.slots, self.num_steps, self.width = model, slots, num_steps, width
        self.compiled, self.lanes = compile, slots * width
        allocate = memory.static_cache if compile else memory.new_cache
        self.cache = allocate(model, capacity, num_steps, window, slots, width * branching)
        self.branches = BranchColumns(self.cache, width) if branching else None
        # P with the rows' entry into their lanes, and C with the choice of tokens (R: recur)
        self.start_call, self.read_call = start_body, read_body
        if compile:  # each call may meet every power of two of the key blocks (KVCache.span)
            room = len(self.cache.buckets())
            self.start_call, self.read_call, _ = (
                compiling.compiled(model, fn, room) for fn in (start_body, read_body, recur_body))
            if model.clock is not None:  # LoopFormer: CUDA graphs read its clock table in place
                torch._dynamo.mark_static_address(model.clock_table(num_steps), guard=True)
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
        call = to_device(self.model, torch.arange(n), None, cache)  # span 0: causal, no blocks
        s, e = self.model.p_body(torch.tensor(seq.prompt, device=self.model.device), call)
        for d in range(self.num_steps):
            s = recur(self.model, s, e, call._replace(depth=d))
        seq.stats["r_calls"] += self.num_steps
        seq.stats["rows"] += n * self.num_steps
        seq.stats["c_calls"] += 1
        sampler = self.sampler._replace(key=self.keys[slot * self.width])
        logits, chosen = read_body(self.model, s, e, call, sampler, [n - 1], self.salt)
        token, finite, *digest = fetch(chosen[:, 0])
        return seq.commit(LaneReadout(token, bool(finite), logits, 0, *digest))

    def stage(self, rows, value=None):
        """A call's Lines, filled from its rows and sent to the device, and the call itself: its
        siblings.Branches (or None) and its furthest position. value(row): the second line's value
        of a row (its depth, its token)."""
        lines = self.staging.next()
        lines.pos.fill(-1)
        lines.depth.fill(0)
        lowest = self.cache.scratch  # the first redirected position (scratch: none)
        if self.branches:
            for line in (lines.branch, lines.q, lines.j):
                line.fill(-1)
        for r in rows:
            lines.pos[r.lane] = r.pos
            if value:
                lines.depth[r.lane] = value(r)
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
            branches = Branches(sent.branch, sent.q, sent.j, gather)
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

    def rows_alone(self, rows):
        """An eager call's rows, (lane, position, depth, branch, redirects) each, for their
        attention (Call.rows): on a CPU, or in one lane."""
        if self.compiled or self.lanes > 1 and self.model.device.type != "cpu":
            return None
        moved = self.branches.redirects if self.branches else lambda r: ()
        return [(r.lane, r.pos, r.depth, r.branch, tuple(moved(r))) for r in rows]

    def call(self, sent, top, branches, rows=(), depth=None):
        """The Call of staged lines; depth: an R call's, on the device (sent.depth)."""
        return to_device(self.model, sent.pos, depth, self.cache, self.compiled, top).given(
            self.rows_alone(rows), branches)

    def warm_up(self):
        """Every graph a compiled generation of this decoder can meet: P, R and C once for each
        number of key blocks a call can read (KVCache.buckets), as a call whose furthest row
        reaches them; three calls each (on CUDA the first warms up and the second records the CUDA
        graph). Their writes land in the static cache, which every generation zeroes."""
        for blocks in self.cache.buckets():
            top = min(blocks * self.cache.block, self.cache.capacity) - 1
            if top < 1:  # position 0 is the prefill's
                continue
            sent, branches, _ = self.probe(top)  # its token and its depth: zeros
            call = self.call(sent, top, branches)
            for _ in range(3):
                self.start_call(self.model, sent.token, call, self.s, self.e)
                recur(self.model, self.s, self.e, call._replace(depth=sent.depth))
                self.read_call(self.model, self.s, self.e, call, self.sampler, salt=self.salt)

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
        sent, branches, top = self.stage(starting, value=lambda r: r.token)
        for run in runs:
            run.seq.starting = []
        self.s, self.e = self.start_call(self.model, sent.token,
                                         self.call(sent, top, branches, starting), self.s, self.e)

    def advance(self, runs):
        """R: one call moves every row of every sequence one recurrence deeper, each at its own
        depth (after the P call of the rows they started, when any). The other lanes keep their
        state (draft-then-verify's rows waiting for the verify pass)."""
        starting = [run for run in runs if run.seq.starting]
        if starting:
            self.start(starting)
        rows = [r for run in runs for r in run.waits.rows]
        sent, branches, top = self.stage(rows, value=lambda r: r.depth)
        call = self.call(sent, top, branches, rows, depth=sent.depth)
        for r in rows:  # the row's depth, raised here: after this call it is one recurrence deeper
            r.depth += 1
        t0 = time.perf_counter()
        self.s = recur(self.model, self.s, self.e, call)
        seconds = time.perf_counter() - t0
        for run in runs:
            seq, rows = run.seq, run.waits.rows
            if seq.trace is not None:  # one entry per R call: (position, depth reached, serial,
                # token) of each row, and the marks of its tick (Sequence.mark)
                index = {"index": seq.index} if seq.batched else {}
                seq.entry = dict(rows=[(r.pos, r.depth, r.serial, r.token) for r in rows], **index)
                seq.trace.append(seq.entry)
            seq.stats["r_calls"] += 1
            seq.stats["rows"] += len(rows)
            seq.stats["r_seconds"] += seconds

    def read(self, runs):
        """C: each running row's logits and the token they choose, in one call and one transfer to
        the host. Returns each run's LaneReadouts. A row read at full depth retires: a winner in a
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
            out.append([LaneReadout(tokens[r.lane], bool(finite[r.lane]), logits, r.lane,
                                    *(d[r.lane] for d in digests)) for r in run.waits.rows])
        return out
