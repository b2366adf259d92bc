"""Decoding of looped LMs: autoregressive (AR), draft-then-verify (DtV) and the wavefront (WFD),
with or without its second proposal (wavefront_siblings).

All of them give AR's tokens, greedy or sampled (`choose`). They differ in how they schedule rows, a
row being one token position at one depth, through the model's three calls P (start a row), R
(advance rows by one recurrence) and C (read a token out of a row). A schedule is a generator over
one Sequence that yields the calls it needs; the Decoder runs the calls of all its sequences
together, in lanes of fixed shape, so that a row computes the same bits in every schedule.
"""
import hashlib
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Generator, NamedTuple, Union

import torch
from torch._dynamo.utils import counters

from kv import Branches, cache_bytes

from runtime import checks, compiling, memory
from runtime.sampling import M32, Sampling, choose, mix32, seed_key
from runtime.transfers import Staging, fetch


# -- what a schedule works with --------------------------------------------------------------

@dataclass(eq=False)
class Row:
    pos: int                 # the position this row computes (its token sits there)
    token: int
    depth: int = 0           # completed recurrences; the state itself lives in its lane
    lane: int = None         # the lane that holds its state, given by its P call (Decoder.start)
    # the second proposal (wavefront_siblings): the row it was proposed from, while that is in
    # flight, the rows proposed from it, and the branch whose columns hold its keys when it is the
    # second row at its position (Decoder.start; None: its position's own)
    parent: "Row" = None
    children: list = field(default_factory=list)
    branch: int = None

    def redirects(self):
        """(position, branch) of this row and of its ancestors in flight whose keys lie in a
        branch: where it reads those positions' keys."""
        row = self
        while row is not None:
            if row.branch is not None:
                yield row.pos, row.branch
            row = row.parent


@dataclass
class Readout:
    """What a C call read from a row: its token, and, for the rows whose logits are kept or
    digested, their place in the read (Decoder.read)."""
    token: int               # the token this row's logits choose for the next position
    finite: bool             # no NaN or inf among them
    logits: torch.Tensor     # the read's logits [lanes, V], on the model's device
    lane: int                # this row's among them
    digest: int = None       # the hash of this row's logits' bits (read_body), when digested


class Advance(NamedTuple):
    """What a schedule yields for an R call: its rows, each one recurrence deeper after it."""
    rows: list


class Read(NamedTuple):
    """What a schedule yields for a C call: the rows to read; the yield returns their Readouts."""
    rows: list


@dataclass
class Generation:
    tokens: list             # new tokens, the one from the prefill first, EOS included when hit
    stats: dict = field(default_factory=dict)
    logits: list = None      # with keep_logits: the full-depth logits [V] that chose each token


class Sequence:
    """One prompt in flight: its committed tokens, counters and schedule state, and the schedule's
    verbs start / draft / verify / commit."""

    def __init__(self, index, prompt, max_new_tokens, num_steps, *, key, stop, batched, width,
                 draft_hook=None, on_token=None, trace=None, keep_logits=False,
                 digest_logits=False):
        self.index, self.prompt, self.max_new_tokens = index, prompt, max_new_tokens
        self.num_steps, self.key, self.stop, self.batched = num_steps, key, stop, batched
        self.width = width  # the rows in flight its lanes hold
        self.draft_hook, self.on_token, self.trace = draft_hook, on_token, trace
        # the last token is never fed back, so the cache holds positions up to the one before it
        self.last_pos = len(prompt) + max_new_tokens - 2
        self.tokens, self.logits = [], [] if keep_logits else None
        self.digest = hashlib.blake2b(digest_size=16) if digest_logits else None  # committed rows'
        self.starting = []  # the rows its next P call starts
        self.entry = None  # its latest trace entry
        self.slot, self.t0 = None, None  # set by its prefill
        # r_seconds: host time in its R calls after the prefill (bench.py); host_syncs: the
        # blocking transfers after the prefill (reads of its C calls' tokens: one per tick at most)
        # proposed, rescued: second proposals started, and those that won (wavefront_siblings)
        self.stats = dict(index=index, r_calls=0, rows=0, c_calls=0, drafted=0, accepted=0,
                          rejected=0, proposed=0, rescued=0, stop_token=None, r_seconds=0.0,
                          host_syncs=0)

    def start(self, pos, token, parent=None):
        """P: a new row at depth 0, made by the next call (before the R call that advances it);
        parent: the row it is proposed from (wavefront_siblings), whose second child it may be."""
        row = Row(pos, token, parent=parent)
        if parent is not None:
            if parent.children:  # a second proposal
                self.stats["proposed"] += 1
                self.mark("proposed", parent)
            parent.children.append(row)
        self.starting.append(row)
        return row

    def mark(self, what, *rows):
        """The trace's note of this tick: what happened to which rows (for draw_wavefront)."""
        if self.entry is not None:
            self.entry.setdefault(what, []).extend(id(r) for r in rows)

    def draft(self, row, out: Readout, depth=None):
        """The token read from `row` at the draft depth: a draft for the next position. depth: the
        second depth, for a second proposal's token (the draft hook is told)."""
        self.stats["drafted"] += depth is None
        token = out.token
        if self.draft_hook:
            token = (self.draft_hook(row.pos + 1, token) if depth is None
                     else self.draft_hook(row.pos + 1, token, depth=depth))
        if depth is None:
            self.mark("drafted", row)
        return token

    def verify(self, row, target: Readout):
        """Is the draft that `row` carries the token of the full-depth logits before it?"""
        ok = row.token == target.token
        self.stats["accepted" if ok else "rejected"] += 1
        self.mark("accepted" if ok else "rejected", row)
        return ok

    def keep(self, parent, target: Readout):
        """The child of `parent` that carries the token of its full-depth logits, or None: its
        draft (accepted), or its second proposal (rescued); rejected when neither does."""
        kept = next((c for c in parent.children if c.token == target.token), None)
        first = parent.children[:1] == [kept]
        if parent.children:
            self.stats["accepted" if first else "rescued" if kept else "rejected"] += 1
        if kept is not None:
            self.mark("accepted" if first else "rescued", kept)
        self.mark("rejected", *[c for c in parent.children if c is not kept])
        return kept

    def commit(self, out: Readout):
        """Append the token of full-depth logits; True when generation is over."""
        if not out.finite:  # argmax would quietly pick token 0
            where = f"prompt {self.index}: " if self.batched else ""
            pos = len(self.prompt) + len(self.tokens)
            raise ValueError(f"{where}the logits for position {pos} are not finite (fp16 overflow "
                             "or damaged weights)")
        self.tokens.append(out.token)
        if self.logits is not None:  # a copy of the row: a view would keep the read's [lanes, V]
            self.logits.append(out.logits[out.lane].clone())
        if self.digest is not None:  # the row's hash, computed on the device (read_body)
            self.digest.update(out.digest.to_bytes(8, "little"))
        if self.on_token:
            self.on_token(out.token)
        if out.token in self.stop:
            self.stats["stop_token"] = out.token
            return True
        return len(self.tokens) >= self.max_new_tokens


# -- the schedules ---------------------------------------------------------------------------

def autoregressive(seq: Sequence):
    """P, T x R, C per token."""
    while True:
        row = seq.start(len(seq.prompt) + len(seq.tokens) - 1, seq.tokens[-1])
        for _ in range(seq.num_steps):
            yield Advance([row])
        if seq.commit((yield Read([row]))[0]):
            return


def wavefront(seq: Sequence, k: int):
    """Rows in flight sit on a diagonal over (position, depth). Each tick is one R call over all of
    them and one C call that verifies the oldest row (at depth T) and drafts from the newest (at
    depth k). A draft starts a row at the next position right away, so one token commits every k
    ticks while drafts are accepted; a rejected draft drops every row after it."""
    T = seq.num_steps
    rows = [seq.start(len(seq.prompt), seq.tokens[-1])]
    while True:
        yield Advance(rows)
        oldest, newest = rows[0], rows[-1]
        verifying = oldest.depth == T
        drafting = (newest.depth == k and not (verifying and newest is oldest)
                    and newest.pos < seq.last_pos)
        reading = [oldest] * verifying + [newest] * drafting
        out = (yield Read(reading)) if reading else []
        if verifying:
            target = out[0]
            rows.pop(0)
            if rows and not seq.verify(rows[0], target):
                rows, drafting = [], False   # the draft and everything built on it
            if seq.commit(target):
                return
            if not rows:
                rows.append(seq.start(oldest.pos + 1, seq.tokens[-1]))
        if drafting:
            rows.append(seq.start(newest.pos + 1, seq.draft(newest, out[-1])))


def wavefront_siblings(seq: Sequence, k: int, m: int):
    """The wavefront with a second proposal: every row is read at the draft depth k, its draft
    starting its first child at the next position, as in wavefront, and again at the second depth m
    (k < m < T): where that token differs from the first child's, a sibling starts at the same
    position with it. The rows in flight form a tree under the oldest; when the oldest reaches
    depth T, its full-depth token keeps the child that carries it, the draft or its sibling (a
    rescue), and drops the other with every row built on it; with neither, the position starts
    again. A row starts only while the lanes hold it (seq.width), drafts before siblings."""
    T, prompt = seq.num_steps, len(seq.prompt)
    oldest = seq.start(prompt, seq.tokens[-1])
    rows = [oldest]  # in flight, each after its parent

    def drop(row):
        rows.remove(row)
        for child in row.children:
            drop(child)

    while True:
        yield Advance(rows)
        verifying = oldest.depth == T
        drafting = [r for r in rows if r.depth == k and r.pos < seq.last_pos]
        proposing = [r for r in rows if r.depth == m and r.pos < seq.last_pos]
        reading = [oldest] * verifying + drafting + proposing
        out = dict(zip(reading, (yield Read(reading)))) if reading else {}
        if verifying:
            rows.remove(oldest)
            kept = seq.keep(oldest, out[oldest])
            for child in oldest.children:
                if child is not kept:
                    drop(child)
            if seq.commit(out[oldest]):
                return
            oldest = kept or seq.start(oldest.pos + 1, seq.tokens[-1])
            oldest.parent = None
            if not kept:
                rows.append(oldest)
        for r in drafting:
            if r in rows and len(rows) < seq.width:
                rows.append(seq.start(r.pos + 1, seq.draft(r, out[r]), parent=r))
        for r in proposing:
            if r in rows and len(rows) < seq.width:
                token = seq.draft(r, out[r], depth=m)
                if token not in [c.token for c in r.children]:
                    rows.append(seq.start(r.pos + 1, token, parent=r))


def draft_then_verify(seq: Sequence, k: int, draft_len: int):
    """Phase-separated rounds: draft up to draft_len tokens one after another from depth k, bring
    all the round's rows from depth k to T together, keep the longest verified prefix plus the
    full-depth token after it (a correction, or a bonus when every draft matched)."""
    T = seq.num_steps
    while True:
        rows, token = [], seq.tokens[-1]
        while True:
            rows.append(seq.start(len(seq.prompt) + len(seq.tokens) - 1 + len(rows), token))
            for _ in range(k):
                yield Advance(rows[-1:])
            if len(rows) > draft_len or rows[-1].pos == seq.last_pos:
                break
            token = seq.draft(rows[-1], (yield Read(rows[-1:]))[0])
        for _ in range(T - k):
            yield Advance(rows)
        for row, nxt, target in zip(rows, rows[1:] + [None], (yield Read(rows))):
            rejected = nxt is not None and not seq.verify(nxt, target)
            if seq.commit(target):
                return
            if rejected:
                break


# -- the calls -------------------------------------------------------------------------------

def start_body(model, ids, call, s, e):
    """P, and its rows' e and s0 into their lanes (pos >= 0) of the lanes' s and e, in one function,
    so that compiled decoding compiles them into one graph: the new (s, e)."""
    e_new, s_new = model.p_body(ids, call)
    started = call.pos[:, None] >= 0
    return torch.where(started, s_new, s), None if e is None else torch.where(started, e_new, e)


def read_body(model, s, e, call, sampling, rows=None, salt=None):
    """C and the tokens its logits choose, in one function, so that compiled decoding compiles them
    into one graph: logits [n, V] of `rows` (default all), and int64 [2, n] holding the token each
    chooses for the position after its row and 1 where all its logits are finite; with the salt
    (digest_salt), a third line, each row's digest."""
    logits = model.c_body(s, e, call, rows)
    nxt = (call.pos if rows is None else call.pos[rows]) + 1
    chosen = [choose(logits, nxt, sampling), logits.isfinite().all(-1).long()]
    if salt is not None:
        chosen.append(digest(logits, salt))
    return logits, torch.stack(chosen)


def digest_salt(vocab, device):
    return mix32(torch.arange(vocab, device=device))


def digest(logits, salt):
    """Each row's hash [n] (int64) of the bits of its float32 logits [n, V]: the sum over v of
    mix32(bits_v xor salt_v), exact in int64 (V * 2^32 < 2^63). A change of any one logit changes
    it (mix32 is a bijection); several changes cancel out with a chance of about 2^-32. Made on
    the device, so that digested logits never cross to the host."""
    bits = logits.view(torch.int32).long() & M32
    return mix32(bits ^ salt).sum(-1)


@dataclass
class Running:
    """A sequence in its slot: its schedule, and the call the schedule waits for."""
    seq: Sequence
    schedule: Generator
    waits: Union[Advance, Read] = None


class Decoder:
    """The calls of `slots` sequences decoded together, and what they share: the model, the KV
    cache (a sequence per slot) and the lanes. A prompt's prefill is a call of its own; after it
    every P, R and C call runs `slots x width` lanes: slot b's lanes come b-th, a row in the lane
    its P call gave it (its position mod width, unless a row of its sequence's call holds that
    lane: then the first one free), idle lanes at position -1. A row thus meets the same lanes and
    call shapes in every schedule whose rows in flight lie within `width` positions (AR, DtV, WFD),
    so a schedule computes AR's bits at the same batch and width, in any dtype
    (docs/exactness.md), whoever shares the call. branching (the second proposal): a row started
    at a position where a row of its sequence is in flight writes its keys to a branch's columns,
    and the rows built on it read them there (docs/siblings.md).

    What the host sends a call (ids, positions, depths, branches) goes through pinned memory
    without blocking (runtime.transfers.Staging), and a C call's tokens are the one read back, so
    that a tick makes one blocking transfer (docs/compiling.md)."""

    def __init__(self, model, slots, capacity, *, num_steps, width, window=None,
                 sampling=Sampling(), compile=False, digest=False, branching=False):
        self.model, self.slots, self.num_steps, self.width = model, slots, num_steps, width
        self.compiled, self.lanes, self.branching = compile, slots * width, branching
        allocate = memory.static_cache if compile else memory.new_cache
        self.cache = allocate(model, capacity, num_steps, window, slots, width * branching)
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
        # a call's int64 lines: positions, depths or ids; branching: branch, q and j of Branches
        lines = lambda c: (c[0], c[1], c[2], c[3:3 + width].T, c[3 + width:].T)
        self.staging = Staging(model.device, 3 + 2 * width if branching else 2, self.lanes,
                               views=lines if branching else tuple)

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
        """A call's lines, filled from its rows and sent to the device: (positions, the second
        line, its Branches or None, the furthest position). second(row): the second line's value
        of a row (its depth, its token), 0 in idle lanes."""
        lines, width = self.staging.next(), self.width
        lines[0].fill(-1)
        lines[1].fill(0)
        if self.branching:  # each row's branch, and the (q, j) of its redirects: -1 for none
            lines[2:].fill(-1)
        lowest = self.cache.scratch  # the first redirected position (scratch: none)
        for r in rows:
            lines[0, r.lane] = r.pos
            if second:
                lines[1, r.lane] = second(r)
            if self.branching:
                lines[2, r.lane] = -1 if r.branch is None else r.branch
                for i, (q, j) in enumerate(r.redirects()):
                    lines[3 + i, r.lane], lines[3 + width + i, r.lane] = q, j
                    lowest = min(lowest, q)
        sent, branches = self.staging.send(), None
        if self.branching:
            # compiled: every block patched, one graph; eager: those from the first redirected
            # (from scratch's block: none)
            gather = None if self.compiled else lowest // self.cache.block
            branches = Branches(*sent[2:], gather)
        return sent[0], sent[1], branches, max(r.pos for r in rows)

    def probe(self, top):
        """The staged lines of a call with one row, at position top with depth and token 0, the
        other lanes idle: what compiling.warm_up runs each graph on, staged as every call is, so
        that the decode meets the graphs it made (shapes, strides, Branches)."""
        return self.stage([Row(top, 0, lane=0)])

    def lane_of(self, pos):
        """The lane, within its slot's, of a row at position pos, unless a row of its sequence's
        call holds it."""
        return pos % self.width

    def start(self, runs):
        """P: the rows the sequences started, each in its lane (the other lanes idle, and kept), a
        second row at its position in a branch of its own."""
        for run in runs:
            rows, first = run.waits.rows, run.seq.slot * self.width
            taken = {r.lane for r in rows if r.lane is not None}
            for row in run.seq.starting:
                row.lane = first + self.lane_of(row.pos)
                if row.lane in taken:
                    row.lane = min(set(range(first, first + self.width)) - taken)
                taken.add(row.lane)
                if self.branching and any(r.pos == row.pos and r.lane is not None
                                          and r is not row for r in rows):
                    row.branch = min(set(range(self.width))
                                     - {r.branch for r in rows if r.branch is not None})
        starting = [row for run in runs for row in run.seq.starting]
        pos, ids, branches, top = self.stage(starting, second=lambda r: r.token)
        for run in runs:
            run.seq.starting = []
        call = self.model.to_device(pos, None, self.cache, self.compiled, top)
        call = call._replace(branches=branches)
        self.s, self.e = self.start_call(self.model, ids, call, self.s, self.e)

    def advance(self, runs):
        """R: one call moves every row of every sequence one recurrence deeper, each at its own
        depth (after the P call of the rows they started, when any). The other lanes keep their
        state (draft-then-verify's rows waiting for the verify pass)."""
        starting = [run for run in runs if run.seq.starting]
        if starting:
            self.start(starting)
        rows = [r for run in runs for r in run.waits.rows]
        pos, depth, branches, top = self.stage(rows, second=lambda r: r.depth)
        for r in rows:
            r.depth += 1
        t0 = time.perf_counter()
        self.s = self.model.R(self.s, self.e, pos, depth, self.cache, self.compiled, top=top,
                              branches=branches)
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
        the host. Returns each run's Readouts. A row read at full depth retires: from a branch, its
        keys move to its position's columns (kv.KVCache.settle)."""
        pos, _, branches, top = self.stage([r for run in runs for r in run.waits.rows])
        call = self.model.to_device(pos, None, self.cache, self.compiled, top)
        call = call._replace(branches=branches)
        logits, chosen = self.read_call(self.model, self.s, self.e, call, self.sampler,
                                        salt=self.salt)
        for run in runs:
            for r in run.waits.rows:
                if r.branch is not None and r.depth == self.num_steps:
                    self.cache.settle(run.seq.slot, r.branch, r.pos)
        tokens, finite, *digests = fetch(chosen)  # the tick's one blocking transfer
        out = []
        for run in runs:
            run.seq.stats["c_calls"] += 1
            run.seq.stats["host_syncs"] += 1
            out.append([Readout(tokens[r.lane], bool(finite[r.lane]), logits, r.lane,
                                *(d[r.lane] for d in digests)) for r in run.waits.rows])
        return out


def decode(dec: Decoder, queues, schedule, on_finish):
    """Every sequence through `schedule`, slot b taking queues[b]'s prompts one after another
    (refill). A turn runs one R call over the sequences that wait for one, then one C call over
    those that wait to read; a sequence that finishes frees its slot for the next prompt at once."""
    running = {}  # slot -> Running

    def admit(slot):
        while queues[slot]:
            seq = queues[slot].pop(0)
            if dec.prefill(seq, slot):  # done at its first token
                on_finish(seq)
                continue
            run = running[slot] = Running(seq, schedule(seq))
            run.waits = next(run.schedule)
            return

    def resume(run, out):
        """The call's result back to the schedule, which then waits for its next call or is done."""
        try:
            run.waits = run.schedule.send(out)
        except StopIteration:
            del running[run.seq.slot]
            on_finish(run.seq)
            admit(run.seq.slot)

    for slot in range(len(queues)):
        admit(slot)
    while running:
        advancing = [run for run in running.values() if isinstance(run.waits, Advance)]
        if advancing:
            dec.advance(advancing)
            for run in advancing:
                resume(run, None)
        reading = [run for run in running.values() if isinstance(run.waits, Read)]
        if reading:
            for run, out in zip(reading, dec.read(reading)):
                resume(run, out)


# -- the API ---------------------------------------------------------------------------------

def compile_graphs(model, prompt_ids, max_new_tokens, **settings):
    """Compile every graph that generate(model, prompt_ids, max_new_tokens, compile=True,
    **settings) can meet (runtime.compiling.warm_up), so that a timed generation compiles none;
    settings: generate's, the callbacks aside. Returns the graphs compiled (0: they all existed)."""
    digest = settings.pop("digest_logits", False)
    p = checks.plan(model, prompt_ids, max_new_tokens, **dict(settings, compile=True))
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        compiling.warm_up(Decoder(model, p.slots, p.capacity, num_steps=p.num_steps, width=p.width,
                                  window=p.window, sampling=p.sampling, compile=True,
                                  digest=digest,
                                  branching=settings.get("second_depth") is not None))
    return counters["stats"]["unique_graphs"] - graphs


def generate(model, prompt_ids, max_new_tokens, *, method="wfd", num_steps=None, draft_steps=None,
             draft_len=4, width=None, capacity=None, eos_token_id=None, kv="full", window=None,
             temperature=0.0, top_k=None, top_p=None, seed=0, batch_size=None,
             draft_hook: Callable[..., int] = None, on_token: Callable = None,
             on_finish: Callable = None, trace: list = None, keep_logits=False, digest_logits=False,
             compile=False, second_depth=None):
    """Greedy or sampled decoding of one prompt, returning Generation(tokens, stats, logits), or of
    a list of prompts (docs/batching.md: batch_size slots, one per prompt by default, refilled as
    they finish), returning one Generation per prompt, in order.

    T = num_steps, k = draft_steps, width: rows per R / C call (docs/exactness.md); capacity: the
    KV positions per sequence; eos_token_id: an id or a collection of them (stats["stop_token"]
    says which ended it); kv="shared" and window: docs/shared-kv.md; temperature, top_k, top_p,
    seed (a list of them for several prompts): docs/sampling.md. draft_hook(pos, token) -> token may
    replace each draft (the output must not change); on_token(token) as each token commits (both
    take the prompt's index first when there are several); on_finish(i, generation) as prompt i
    finishes. trace: a list that receives one dict per R call. keep_logits: the committed logits in
    Generation.logits; digest_logits: a digest of their bits, hashed on the device, in
    stats["logits_digest"] (equal digests: bit-equal logits, but for a chance of about 2^-32).
    compile: docs/compiling.md; stats["graphs_compiled"] counts the graphs made during the
    generation (none after compile_graphs), stats["cuda_graphs_rerecorded"] and
    ["cuda_graphs_skipped"] the CUDA graphs re-recorded and skipped (none).

    second_depth m (k < m < T): the wavefront's second proposal (wavefront_siblings,
    docs/siblings.md); draft_hook(pos, token, depth=m) is then called for the second proposals too.
    With method "ar" it runs AR through the same calls (branch columns and all), the reference of
    the second proposal at its width."""
    p = checks.plan(model, prompt_ids, max_new_tokens, method=method, num_steps=num_steps,
                    draft_steps=draft_steps, draft_len=draft_len, width=width, capacity=capacity,
                    eos_token_id=eos_token_id, kv=kv, window=window, temperature=temperature,
                    top_k=top_k, top_p=top_p, seed=seed, batch_size=batch_size, compile=compile,
                    second_depth=second_depth)
    T, k, m = p.num_steps, p.draft_steps, second_depth
    schedule = dict(ar=autoregressive,
                    wfd=partial(wavefront, k=k) if m is None else partial(wavefront_siblings, k=k,
                                                                            m=m),
                    dtv=partial(draft_then_verify, k=k, draft_len=draft_len))[method]
    own = (lambda f, i: f and partial(f, i)) if p.batched else (lambda f, i: f)  # prompt i's
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    dec = Decoder(model, p.slots, p.capacity, num_steps=T, width=p.width, window=p.window,
                  sampling=p.sampling, compile=compile, digest=digest_logits,
                  branching=m is not None)
    settings = dict(method=method, num_steps=T, draft_steps=k if method != "ar" else T, kv=kv,
                    window=p.window, width=p.width, batch_size=p.slots, temperature=temperature,
                    top_k=top_k, top_p=top_p, compiled=compile, eos_token_ids=sorted(p.stop),
                    kv_bytes=dec.cache.nbytes, second_depth=m,
                    branch_kv_bytes=dec.cache.nbytes - cache_bytes(model, p.capacity, T, p.window,
                                                                   p.slots))
    graphs, generations = counters["stats"]["unique_graphs"], [None] * len(p.prompts)
    cuda_graphs = compiling.cuda_graph_counts(model.device)

    def finish(seq):
        """A sequence's Generation as it finishes (graphs and peak memory: the counts so far)."""
        stats, n, wall = seq.stats, len(seq.tokens), time.perf_counter() - seq.t0
        verified = stats["accepted"] + stats["rescued"] + stats["rejected"]
        stats.update(settings, tokens=n, r_calls_per_token=stats["r_calls"] / n, wall_s=wall,
                     acceptance=stats["accepted"] / verified if verified else float("nan"),
                     tokens_per_s=n / wall, slot=seq.slot, seed=p.seeds[seq.index],
                     graphs_compiled=counters["stats"]["unique_graphs"] - graphs,
                     **dict(zip(("cuda_graphs_rerecorded", "cuda_graphs_skipped"), (
                         now - before for now, before in zip(
                             compiling.cuda_graph_counts(model.device), cuda_graphs)))),
                     peak_memory_bytes=torch.cuda.max_memory_allocated(model.device) if cuda
                     else None,
                     logits_digest=seq.digest and seq.digest.hexdigest())
        generations[seq.index] = Generation(seq.tokens, stats, seq.logits)
        if on_finish:
            on_finish(seq.index, generations[seq.index])

    with torch.no_grad():
        seqs = [Sequence(i, prompt, p.max_new_tokens, T, key=seed_key(p.seeds[i]), stop=p.stop,
                         batched=p.batched, width=p.width, draft_hook=own(draft_hook, i),
                         on_token=own(on_token, i), trace=trace, keep_logits=keep_logits,
                         digest_logits=digest_logits)
                for i, prompt in enumerate(p.prompts)]
        decode(dec, [seqs[b::p.slots] for b in range(p.slots)], schedule, finish)
    return generations if p.batched else generations[0]
