"""Wavefront decoding (WFD) of looped LMs, beside autoregressive decoding (AR) and draft-then-verify
(DtV): the schedules, the bookkeeping they share, and a plain loop that runs them on the model.

A looped LM (models.py) is driven through three calls: P starts a row (a token at a position, at
depth 0), R takes rows one recurrence deeper, C reads a token out of a row; T is the full depth, k
the draft's. A row at depth d attends to earlier positions' depth-d keys, so rows at different
positions and depths share one R call (matmuls one batch, attention per depth: kv.KVCache.attend).

A schedule is a generator that never touches the model (the engine runs the same ones); Loop.run
makes its calls: a `wavefront` tick is `yield Advance(rows)` (Loop.advance: P of the rows started
since the last one, one R call) and `out = yield Read(rows)` (Loop.read: one C call, its Readouts).
At T = 4, k = 2, from the first tick after the prefill (one row, at p = len(prompt)): each R call's
rows as position:depth after it; p+2's input token, the draft, is wrong:

    R call 1  p:1
    R call 2  p:2          C reads p: the draft, p+1's input token
    R call 3  p:3 p+1:1    (p+1's P call runs first, in the same Loop.advance)
    R call 4  p:4 p+1:2    C reads p (its read equals p+1's input token: commit it) and p+1 (draft)
    R call 5  p+1:3 p+2:1
    R call 6  p+1:4 p+2:2  C reads p+1 and p+2: p+1's read is not p+2's input token: commit the
                           read, drop p+2 and the draft just read from it
    R call 7  p+2:1        p+2 restarts from depth 0, with p+1's read as its input token
    R call 8  p+2:2        C reads p+2: a draft
    R call 9  p+2:3 p+3:1
    R call 10 p+2:4 p+3:2  C reads p+2, p+3; p+2 commits T = 4 calls after p+1, p+1 k = 2 after p
"""
import numbers
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, NamedTuple

import torch

from kv import KVCache, SharedKVCache


@dataclass(eq=False)  # hashed by identity, to key Loop.state: equal fields are still two rows
class Row:
    """One position at one depth: the unit a schedule moves. Its state lives with the executor."""
    pos: int                 # the position of its input token; its read chooses pos + 1's
    token: int               # the token it reads in: committed, or a draft
    depth: int = 0           # R calls done, 0..T


class Advance(NamedTuple):
    """What a schedule yields for an R call: its rows, each one recurrence deeper after it."""
    rows: list


class Read(NamedTuple):
    """What a schedule yields for a C call: the rows to read; the yield returns their Readouts."""
    rows: list


class Readout(NamedTuple):
    """What a C call read from a row."""
    token: int               # the token its logits choose for the next position
    logits: torch.Tensor     # those logits [V] (float32)


@dataclass
class Generation:
    tokens: list             # new tokens, the one from the prefill first, EOS included when hit
    stats: dict = field(default_factory=dict)
    logits: list = None      # with keep_logits: the full-depth logits [V] that chose each token


class Sequence:
    """One prompt in flight: its committed tokens and counters, and the verbs of the schedules."""

    def __init__(self, prompt, max_new_tokens, num_steps, stop=frozenset(), draft_hook=None,
                 on_token=None, keep_logits=False):
        self.prompt, self.max_new_tokens, self.num_steps = prompt, max_new_tokens, num_steps
        self.stop, self.draft_hook, self.on_token = stop, draft_hook, on_token
        # the last row: a row at p reads p + 1's token; the N new tokens end at len(prompt) + N - 1
        self.last_pos = len(prompt) + max_new_tokens - 2
        self.tokens, self.logits = [], ([] if keep_logits else None)
        self.starting = []  # the rows its next P call starts
        # drafted: rows started from a read at depth k; verified: drafts checked, accepted or not
        self.stats = dict(r_calls=0, rows=0, c_calls=0, drafted=0, verified=0, accepted=0,
                          rejected=0, stop_token=None)

    def start(self, pos, token):
        """A new row at depth 0, only noted: its P call runs at the next Advance, before that R call
        (Loop.advance), so P needs no yield, and the rows started in a tick share one P call."""
        row = Row(pos, token)
        self.starting.append(row)
        return row

    def draft(self, row, out):
        """The draft: the token that `row`'s logits, read at a shallow depth, choose for the next
        position. draft_hook(pos, token) may replace it (tests force wrong drafts so)."""
        self.stats["drafted"] += 1
        return self.draft_hook(row.pos + 1, out.token) if self.draft_hook else out.token

    def verify(self, row, target):
        """The verify: `row` was started from a draft; target: the previous row's full-depth
        Readout, AR's token. True: the draft was AR's; else the caller drops `row` and all after."""
        ok = row.token == target.token
        self.stats["verified"] += 1
        self.stats["accepted" if ok else "rejected"] += 1
        return ok

    def commit(self, out):
        """Append a token read at full depth (AR's); True when generation is over."""
        self.tokens.append(out.token)
        if self.logits is not None:
            self.logits.append(out.logits)
        if self.on_token:
            self.on_token(out.token)
        if out.token in self.stop:
            self.stats["stop_token"] = out.token
            return True
        return len(self.tokens) >= self.max_new_tokens


def autoregressive(seq):
    """P, T x R, C per token."""
    while True:
        row = seq.start(len(seq.prompt) + len(seq.tokens) - 1, seq.tokens[-1])
        for _ in range(seq.num_steps):
            yield Advance([row])
        if seq.commit((yield Read([row]))[0]):
            return


def wavefront(seq, k):
    """The tick: one R call over every row in flight, then one C call that reads the oldest row if
    at depth T (AR's next token: it checks the next row's draft and is committed) and the newest if
    at depth k, to draft: both, one or neither. A row starts as the one before it reaches depth k:
    the rows lie on a diagonal, k depths apart (T, T - k, ... >= 1 when the oldest reaches T), at
    most ceil(T / k). A row commits k ticks after the one before it if its draft is accepted (rate
    a), else T (the trace): a*k + (1-a)*T R calls a token."""
    # the prefill committed tokens[0], read at the prompt's last position
    rows = [seq.start(len(seq.prompt), seq.tokens[-1])]  # in flight, oldest first
    while True:
        yield Advance(rows)  # the executor raises every row's depth by one (Loop.advance)
        oldest, newest = rows[0], rows[-1]
        verifying = oldest.depth == seq.num_steps
        # k = T: the depth-k read is the verify's own; a row after last_pos computes no kept token
        drafting = k < seq.num_steps and newest.depth == k and newest.pos < seq.last_pos
        # one C call: out[0] the verify's read, out[-1] the draft's (made before the verify decides,
        # dropped on a rejection)
        reading = ([oldest] if verifying else []) + ([newest] if drafting else [])
        out = (yield Read(reading)) if reading else []
        if verifying:
            target = out[0]  # the verify's read
            rows.pop(0)  # rows[0], if any, is now the row drafted from `oldest`
            if rows and not seq.verify(rows[0], target):
                # the correction: drop the draft's row and all after it (kv.py: no rollback)
                rows, drafting = [], False
            if seq.commit(target):
                return
            if not rows:  # after a rejection, or at k = T (no drafts): the next position, depth 0
                rows.append(seq.start(oldest.pos + 1, target.token))
        if drafting:
            rows.append(seq.start(newest.pos + 1, seq.draft(newest, out[-1])))


def draft_then_verify(seq, k, draft_len):
    """Rounds: draft up to draft_len tokens one by one from depth k, take the round's rows from k
    to T together, keep the verified prefix and the full-depth token after it (a fix or a bonus)."""
    while True:
        rows, token = [], seq.tokens[-1]
        while True:
            rows.append(seq.start(len(seq.prompt) + len(seq.tokens) - 1 + len(rows), token))
            for _ in range(k):
                yield Advance(rows[-1:])
            if len(rows) > draft_len or rows[-1].pos == seq.last_pos:
                break
            token = seq.draft(rows[-1], (yield Read(rows[-1:]))[0])
        for _ in range(seq.num_steps - k):
            yield Advance(rows)
        for row, nxt, target in zip(rows, rows[1:] + [None], (yield Read(rows))):
            rejected = nxt is not None and not seq.verify(nxt, target)
            if seq.commit(target):
                return
            if rejected:
                break


class Loop:
    """Runs one sequence's schedule on the model, call by call, reading greedily. state: row ->
    (s, e), weak-keyed so that a dropped row's goes with it: s its state at its depth; e what R
    re-reads of its token, made by P (Huginn's prelude output, Parcae's injection; else None)."""

    def __init__(self, model, cache):
        self.model, self.cache, self.state = model, cache, weakref.WeakKeyDictionary()

    def tensor(self, values):
        return torch.tensor(values, device=self.model.device)

    def prefill(self, seq):
        """The prompt at full depth, every position in each call; commits the first new token."""
        pos = self.tensor(range(len(seq.prompt)))
        s, e = self.model.P(self.tensor(seq.prompt), pos, self.cache)
        for d in range(seq.num_steps):
            s = self.model.R(s, e, pos, d, self.cache)
        seq.stats.update(r_calls=seq.num_steps, rows=len(pos) * seq.num_steps, c_calls=1)
        logits = self.model.C(s, e, pos, self.cache)[-1]
        return seq.commit(Readout(int(logits.argmax()), logits))

    def advance(self, seq, rows):
        """P of the rows started since the last R call (why here: Sequence.start), then one R
        call on `rows`' states stacked into one [N, D] batch, each row with its position and depth:
        model.R -> r_body -> _layers runs each block's matmuls on the N rows at once, its attention
        through kv.KVCache.attend (each row's keys written in its depth's slot; SDPA per depth)."""
        if seq.starting:
            s, e = self.model.P(self.tensor([r.token for r in seq.starting]),
                                self.tensor([r.pos for r in seq.starting]), self.cache)
            for i, row in enumerate(seq.starting):
                self.state[row] = (s[i], None if e is None else e[i])
            seq.starting = []
        s, e = self.stacked(rows)
        s = self.model.R(s, e, self.tensor([r.pos for r in rows]),
                         self.tensor([r.depth for r in rows]), self.cache)
        for i, row in enumerate(rows):
            self.state[row] = (s[i], self.state[row][1])
            row.depth += 1
        seq.stats["r_calls"] += 1
        seq.stats["rows"] += len(rows)

    def read(self, seq, rows):
        """One C call over `rows`: each row's logits and their greedy token."""
        s, e = self.stacked(rows)
        logits = self.model.C(s, e, self.tensor([r.pos for r in rows]), self.cache)
        seq.stats["c_calls"] += 1
        return [Readout(int(x.argmax()), x) for x in logits]

    def stacked(self, rows):
        s, e = zip(*(self.state[r] for r in rows))
        return torch.stack(s), None if e[0] is None else torch.stack(e)

    def run(self, seq, schedule):
        """Makes each call the schedule yields, and sends its result back, until it returns."""
        call = next(schedule)
        while True:
            out = (self.advance if isinstance(call, Advance) else self.read)(seq, call.rows)
            try:
                call = schedule.send(out)
            except StopIteration:
                return


def default_draft_steps(model, num_steps=None):
    """k: the checkpoint's own at its own T (the demo has one), else the paper's max(1, T // 8)."""
    if num_steps in (None, model.num_steps) and model.config.get("wfd_draft_steps"):
        return model.config["wfd_draft_steps"]
    return max(1, (num_steps or model.num_steps) // 8)


def generate(model, prompt_ids, max_new_tokens, *, method="wfd", num_steps=None, draft_steps=None,
             draft_len=4, eos_token_id=None, kv="full", window=None,
             draft_hook: Callable[[int, int], int] = None, on_token: Callable[[int], None] = None,
             keep_logits=False):
    """Greedy decoding of one prompt (token ids) by `method`: Generation(tokens, stats, logits).
    T = num_steps, k = draft_steps; eos_token_id: one id or several; kv="shared": kv.SharedKVCache,
    its `window` by default ceil(T / k); draft_hook: Sequence.draft; on_token(token) at each commit.
    Every method gives its AR's tokens (tested in float64 and float32; float32's logits: README)."""
    T = model.num_steps if num_steps is None else num_steps
    k = default_draft_steps(model, num_steps) if draft_steps is None else draft_steps
    if method not in ("ar", "wfd", "dtv"):
        raise ValueError(f"method must be 'ar', 'wfd' or 'dtv', not {method!r}")
    if T < 1:
        raise ValueError(f"num_steps must be at least 1, not {T}")
    if not 1 <= k <= T:
        raise ValueError(f"draft depth {k} is out of range: it must be in 1..{T}")
    wave = -(-T // k)  # the wavefront's rows in flight
    window = wave if window is None else window
    if kv not in ("full", "shared"):
        raise ValueError(f"kv must be 'full' or 'shared', not {kv!r}")
    # DtV's verify pass writes final-depth KV of positions it may reject, which rows would read
    if kv == "shared" and (method == "dtv" or window < (wave if method == "wfd" else 1)):
        raise ValueError("kv='shared' is exact for AR, and for WFD with a window of at least "
                         f"ceil(T / k) = {wave} positions (AR: 1): not {method}, window {window}")
    prompt = list(prompt_ids)
    if not prompt or max_new_tokens < 1:
        raise ValueError("give a prompt of at least one token and max_new_tokens >= 1")
    if len(prompt) + max_new_tokens > model.args.max_seq_len:  # the engine's rule
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the model's context of {model.args.max_seq_len} positions")
    capacity = len(prompt) + max_new_tokens - 1  # the positions its rows compute
    stop = {eos_token_id} if isinstance(eos_token_id, numbers.Integral) else set(eos_token_id or ())
    seq = Sequence(prompt, max_new_tokens, T, stop, draft_hook, on_token, keep_logits)
    cache = (KVCache(model, capacity, T) if kv == "full"
             else SharedKVCache(model, capacity, T, window, len(prompt)))
    schedule = dict(ar=autoregressive, wfd=partial(wavefront, k=k),
                    dtv=partial(draft_then_verify, k=k, draft_len=draft_len))[method]
    loop, t0 = Loop(model, cache), time.perf_counter()
    with torch.no_grad():
        if not loop.prefill(seq):
            loop.run(seq, schedule(seq))
    verified, n, wall = seq.stats["verified"], len(seq.tokens), time.perf_counter() - t0
    seq.stats.update(method=method, num_steps=T, draft_steps=k if method != "ar" else T, kv=kv,
                     window=window if kv == "shared" else None, kv_bytes=cache.nbytes, tokens=n,
                     r_calls_per_token=seq.stats["r_calls"] / n, wall_s=wall, tokens_per_s=n / wall,
                     acceptance=seq.stats["accepted"] / verified if verified else float("nan"))
    return Generation(seq.tokens, seq.stats, seq.logits)
