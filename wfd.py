"""Decoding of looped LMs: autoregressive (AR), draft-then-verify (DtV) and the wavefront (WFD),
with or without its second proposal (wavefront_siblings).

All of them give AR's tokens, greedy or sampled (runtime/sampling.py). They differ in how they
schedule rows, a row being one token position at one depth, through the model's three calls P
(start a row), R (advance rows by one recurrence) and C (read a token out of a row). A schedule is
a generator over one Sequence that yields the calls it needs, and reads like the algorithm; decode
runs every sequence's schedule, and runtime/decoder.py's Decoder turns their calls into the model's,
in lanes of fixed shape, so that a row computes the same bits in every schedule.

One tick of the wavefront, in order: `wavefront` yields Advance (the Decoder's `advance`: a P call
for the rows just started, then one R call over every row in flight), then Read (`read`: one C
call, one transfer of its tokens); back in `wavefront`, Sequence.verify and commit, and the draft
that starts the next row.
"""
import hashlib
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Generator, NamedTuple, Union

import torch
from torch._dynamo.utils import counters

from kv import cache_bytes
from runtime import checks, compiling
from runtime.decoder import Decoder, Readout
from runtime.sampling import seed_key


# -- what a schedule works with --------------------------------------------------------------

@dataclass(eq=False)
class Row:
    pos: int                 # the position this row computes (its token sits there)
    token: int               # the token it reads in: committed, or a draft
    depth: int = 0           # completed recurrences; the state itself lives in its lane
    lane: int = None         # the lane that holds its state, given by its P call (Decoder.start)
    # the second proposal (wavefront_siblings): the row it was proposed from, while that is in
    # flight; the rows proposed from it; whether its token came from the read at the second
    # depth; the branch column holding its keys when it is the second row at its position
    # (runtime.decoder.BranchColumns; None: its position's own)
    parent: "Row" = None
    children: list = field(default_factory=list)
    second: bool = False
    branch: int = None


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
        # blocking transfers after the prefill (reads of its C calls' tokens: one per tick at most).
        # drafted: rows started from a read at the draft depth k; proposed: from the second depth
        # m (wavefront_siblings). A verify ends one way: accepted (it keeps the draft), rescued (a
        # second proposal) or rejected (neither); verified: the verifies that met a draft.
        # acceptance = accepted / verified: of the drafts verified, those right (generate)
        self.stats = dict(index=index, r_calls=0, rows=0, c_calls=0, drafted=0, proposed=0,
                          verified=0, accepted=0, rescued=0, rejected=0, stop_token=None,
                          r_seconds=0.0, host_syncs=0)

    def start(self, pos, token, parent=None, second=False):
        """P: a new row at depth 0, made by the next call (before the R call that advances it);
        parent: the row it is proposed from (wavefront_siblings); second: its token came from the
        read at the second depth."""
        row = Row(pos, token, parent=parent, second=second)
        if second:
            self.stats["proposed"] += 1
            self.mark("proposed", parent)
        if parent is not None:
            parent.children.append(row)
        self.starting.append(row)
        return row

    def mark(self, what, *rows):
        """The trace's note of this tick: what happened to which rows (for draw_wavefront)."""
        if self.entry is not None:
            self.entry.setdefault(what, []).extend(id(r) for r in rows)

    def draft(self, row, out: Readout, depth=None):
        """The token read from `row` for the next position: at the draft depth, a draft that the
        caller starts a row with; at the second depth (depth m), a second proposal's token (the
        draft hook is told)."""
        token = out.token
        if self.draft_hook:
            token = (self.draft_hook(row.pos + 1, token) if depth is None
                     else self.draft_hook(row.pos + 1, token, depth=depth))
        if depth is None:
            self.stats["drafted"] += 1
            self.mark("drafted", row)
        return token

    def verify(self, row, target: Readout):
        """Is the draft that `row` reads in the token that the full-depth logits of the row
        before it chose? Then `row` computes AR's row at its position and goes on; else it is
        dropped."""
        ok = row.token == target.token
        self.stats["verified"] += 1
        self.stats["accepted" if ok else "rejected"] += 1
        self.mark("accepted" if ok else "rejected", row)
        return ok

    def keep(self, parent, target: Readout):
        """verify for a row with several children: the child that reads in the token of its
        full-depth logits, or None. Kept: its draft (accepted), or a second proposal (rescued);
        rejected when no child carries it."""
        kept = next((c for c in parent.children if c.token == target.token), None)
        if parent.children:
            self.stats["verified"] += any(not c.second for c in parent.children)
            how = "rejected" if kept is None else "rescued" if kept.second else "accepted"
            self.stats[how] += 1
            if kept is not None:
                self.mark(how, kept)
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
                    rows.append(seq.start(r.pos + 1, token, parent=r, second=True))


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


@dataclass
class Running:
    """A sequence in its slot: its schedule, and the call the schedule waits for."""
    seq: Sequence
    schedule: Generator
    waits: Union[Advance, Read] = None


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
        verified = stats["verified"]
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
