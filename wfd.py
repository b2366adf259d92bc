"""Greedy decoding of looped LMs: autoregressive (AR), draft-then-verify (DtV) and the wavefront (WFD).

All three produce greedy AR's tokens. They differ in how they schedule rows, a row being one token
position at one depth, through the model's three calls P (start a row), R (advance rows by one
recurrence) and C (read a token out of a row). See README.md, "The method in the code".
"""
import numbers
import time
from dataclasses import dataclass, field
from math import ceil
from typing import Callable, Optional

import torch

from kv import KVCache, SharedKVCache


@dataclass
class Row:
    pos: int                 # the position this row computes (its token sits there)
    token: int
    depth: int               # completed recurrences
    s: torch.Tensor          # state [1, D]
    e: Optional[torch.Tensor]  # Huginn's injection [1, D]; None for Ouro


@dataclass
class Generation:
    tokens: list             # new tokens, the one from the prefill first, EOS included when hit
    stats: dict = field(default_factory=dict)
    logits: list = None      # with keep_logits: the full-depth logits [V] that chose each token


class Decoder:
    """One generation in flight: the model, its cache, the committed tokens and the counters.
    Every schedule is written in terms of start / advance / read / commit."""

    def __init__(self, model, prompt, max_new_tokens, num_steps, window, eos_token_id, draft_hook,
                 on_token, trace, keep_logits):
        self.model, self.prompt, self.num_steps = model, prompt, num_steps
        self.max_new_tokens, self.eos_token_id, self.draft_hook = max_new_tokens, eos_token_id, draft_hook
        self.on_token, self.trace = on_token, trace
        # the last token is never fed back, so the cache holds positions up to the one before it
        self.last_pos = len(prompt) + max_new_tokens - 2
        self.cache = (KVCache(model, self.last_pos + 1, num_steps) if window is None else
                      SharedKVCache(model, self.last_pos + 1, num_steps, window, len(prompt)))
        self.tokens, self.logits = [], [] if keep_logits else None
        self.stats = dict(r_calls=0, rows=0, c_calls=0, drafted=0, accepted=0, rejected=0)

    def start(self, pos, token):
        """P: a new row at depth 0."""
        e, s = self.model.P(torch.tensor([token]), torch.tensor([pos]), self.cache)
        return Row(pos, token, 0, s, e)

    def advance(self, rows):
        """R: one batched call moves every row one recurrence deeper, each at its own depth."""
        pos = torch.tensor([r.pos for r in rows])
        depths = {r.depth for r in rows}
        depth = depths.pop() if len(depths) == 1 else torch.tensor([r.depth for r in rows])
        e = None if rows[0].e is None else torch.cat([r.e for r in rows])
        s = self.model.R(torch.cat([r.s for r in rows]), e, pos, depth, self.cache)
        for i, r in enumerate(rows):
            r.s, r.depth = s[i:i + 1], r.depth + 1
        if self.trace is not None:  # one entry per R call: (position, depth reached) of each row
            self.trace.append(dict(rows=[(r.pos, r.depth) for r in rows]))
        self.stats["r_calls"] += 1
        self.stats["rows"] += len(rows)

    def read(self, rows):
        """C: the logits after each row, in one call."""
        pos = torch.tensor([r.pos for r in rows])
        self.stats["c_calls"] += 1
        return self.model.C(torch.cat([r.s for r in rows]), pos, self.cache)

    def draft(self, row, logits):
        """The greedy token read from `row` at the draft depth: a draft for the next position."""
        self.stats["drafted"] += 1
        token = int(logits.argmax())
        if self.draft_hook:
            token = self.draft_hook(row.pos + 1, token)
        if self.trace is not None:
            self.trace[-1].update(drafted=row.pos + 1, draft=token)
        return token

    def verify(self, row, logits):
        """Is the draft that `row` carries the greedy token of the full-depth logits before it?"""
        ok = row.token == int(logits.argmax())
        self.stats["accepted" if ok else "rejected"] += 1
        if self.trace is not None:
            self.trace[-1]["accepted" if ok else "rejected"] = row.pos
        return ok

    def commit(self, logits):
        """Append the greedy token of full-depth logits; True when generation is over."""
        if not torch.isfinite(logits).all():  # argmax would quietly pick token 0
            raise ValueError(f"the logits for position {len(self.prompt) + len(self.tokens)} are not finite "
                             "(fp16 overflow or damaged weights)")
        token = int(logits.argmax())
        self.tokens.append(token)
        if self.logits is not None:
            self.logits.append(logits)
        if self.on_token:
            self.on_token(token)
        return len(self.tokens) >= self.max_new_tokens or token == self.eos_token_id

    def prefill(self):
        """The whole prompt at full depth, all KV slots written; commits the first new token."""
        n = len(self.prompt)
        pos = torch.arange(n)
        e, s = self.model.P(torch.tensor(self.prompt), pos, self.cache)
        for d in range(self.num_steps):
            s = self.model.R(s, e, pos, d, self.cache)
        self.stats["r_calls"] += self.num_steps
        self.stats["rows"] += n * self.num_steps
        self.stats["c_calls"] += 1
        return self.commit(self.model.C(s, pos, self.cache, rows=[n - 1])[0])


def autoregressive(dec: Decoder):
    """P, T x R, C per token."""
    while True:
        row = dec.start(len(dec.prompt) + len(dec.tokens) - 1, dec.tokens[-1])
        for _ in range(dec.num_steps):
            dec.advance([row])
        if dec.commit(dec.read([row])[0]):
            return


def wavefront(dec: Decoder, k: int):
    """Rows in flight sit on a diagonal over (position, depth). Each tick is one R call over all of
    them and one C call that verifies the oldest row (at depth T) and drafts from the newest (at
    depth k). A draft starts a row at the next position right away, so one token commits every k
    ticks while drafts are accepted; a rejected draft drops every row after it."""
    T = dec.num_steps
    rows = [dec.start(len(dec.prompt), dec.tokens[-1])]
    while True:
        dec.advance(rows)
        oldest, newest = rows[0], rows[-1]
        verifying = oldest.depth == T
        drafting = newest.depth == k and not (verifying and newest is oldest) and newest.pos < dec.last_pos
        out = dec.read([oldest] * verifying + [newest] * drafting) if verifying or drafting else []
        if verifying:
            target = out[0]
            rows.pop(0)
            if rows and not dec.verify(rows[0], target):
                rows, drafting = [], False   # the draft and everything built on it
            if dec.commit(target):
                return
            if not rows:
                rows.append(dec.start(oldest.pos + 1, dec.tokens[-1]))
        if drafting:
            rows.append(dec.start(newest.pos + 1, dec.draft(newest, out[-1])))


def draft_then_verify(dec: Decoder, k: int, draft_len: int):
    """Phase-separated rounds: draft up to draft_len tokens one after another from depth k, bring all
    the round's rows from depth k to T together, keep the longest verified prefix plus the
    full-depth token after it (a correction, or a bonus when every draft matched)."""
    T = dec.num_steps
    while True:
        rows, token = [], dec.tokens[-1]
        while True:
            rows.append(dec.start(len(dec.prompt) + len(dec.tokens) - 1 + len(rows), token))
            for _ in range(k):
                dec.advance(rows[-1:])
            if len(rows) > draft_len or rows[-1].pos == dec.last_pos:
                break
            token = dec.draft(rows[-1], dec.read(rows[-1:])[0])
        for _ in range(T - k):
            dec.advance(rows)
        for row, nxt, target in zip(rows, rows[1:] + [None], dec.read(rows)):
            rejected = nxt is not None and not dec.verify(nxt, target)
            if dec.commit(target):
                return
            if rejected:
                break


def default_draft_steps(model, num_steps=None):
    """The draft depth k the checkpoint recommends for its own T (the demo has one), else the paper's
    max(1, T // 8)."""
    if num_steps in (None, model.num_steps) and model.config.get("wfd_draft_steps"):
        return model.config["wfd_draft_steps"]
    return max(1, (num_steps or model.num_steps) // 8)


def prompt_list(prompt_ids):
    """The prompt as a list of Python ints. Takes a list or tuple of ints, a 1-D integer tensor or
    array, or the one row of a [1, n] one; refuses what would otherwise be silently reinterpreted
    (text, floats and bools cast to ids, several prompts run as one)."""
    if hasattr(prompt_ids, "ids"):
        raise TypeError("the prompt is a tokenizers Encoding: pass its .ids")
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError("the prompt must be token ids, not text: encode it with the model's tokenizer")
    ids = torch.as_tensor(prompt_ids)
    if ids.dim() == 2 and len(ids) == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"the prompt must be one sequence of token ids (shape [n] or [1, n]), not shape "
                         f"{list(ids.shape)}: generate decodes one prompt at a time")
    if ids.numel() and (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex()):
        raise TypeError(f"prompt token ids must be integers, not {str(ids.dtype).replace('torch.', '')}")
    return ids.tolist()


def check_args(model, prompt_ids, max_new_tokens, method="wfd", num_steps=None, draft_steps=None, draft_len=4,
               kv="full", window=None):
    """generate()'s arguments checked and normalized: (prompt as a list of ints, max_new_tokens as an
    int, T, k, window). run.py calls it too, so that bad input is refused before anything is printed."""
    prompt = prompt_list(prompt_ids)
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool):
        raise TypeError(f"max_new_tokens must be an integer, not {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    T = model.num_steps if num_steps is None else num_steps
    k = default_draft_steps(model, num_steps) if draft_steps is None else draft_steps
    if method not in ("ar", "wfd", "dtv"):
        raise ValueError(f"method must be 'ar', 'wfd' or 'dtv', not {method!r}")
    if kv not in ("full", "shared"):
        raise ValueError(f"kv must be 'full' or 'shared', not {kv!r}")
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not 0 <= t < model.args.vocab_size]
    if bad:
        raise ValueError(f"prompt token {bad[0]} is outside the vocabulary (0..{model.args.vocab_size - 1})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, not {max_new_tokens!r}")
    if T < 1:
        raise ValueError(f"num_steps must be at least 1, not {T}")
    if not 1 <= k <= T:
        raise ValueError(f"draft depth {k} is out of range: it must be in 1..{T} (the full depth)")
    if draft_len < 1:
        raise ValueError(f"draft_len must be at least 1, not {draft_len}")
    if kv == "full" and window is not None:
        raise ValueError("window only applies to kv='shared'")
    if kv == "shared":
        if method == "dtv":
            raise ValueError("kv='shared' is not exact for draft-then-verify: its verify pass writes the "
                             "final-depth KV of positions it may then reject, which rows in flight read; "
                             "use kv='full'")
        width = ceil(T / k)
        window = width if window is None else window
        if window < (width if method == "wfd" else 1):
            raise ValueError(f"window {window} is narrower than the wavefront (ceil(T/k) = {width} rows): "
                             "its rows would read final-depth KV that is not written yet")
    if len(prompt) + max_new_tokens > model.args.max_seq_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {model.args.max_seq_len} positions")
    return prompt, max_new_tokens, T, k, window


def generate(model, prompt_ids, max_new_tokens, method="wfd", num_steps=None, draft_steps=None,
             draft_len=4, eos_token_id=None, kv="full", window=None, draft_hook: Callable[[int, int], int] = None,
             on_token: Callable[[int], None] = None, trace: list = None, keep_logits=False):
    """Greedy decoding. Returns Generation(tokens, stats, logits).

    num_steps: full depth T (default: the model's). draft_steps: draft depth k in 1..T (default:
    default_draft_steps). draft_len: drafts per DtV round. kv: "full" (a KV slot per depth) or "shared"
    (kv.SharedKVCache: rows read the per-depth KV of the last `window` positions and the final-depth
    KV of older ones; window defaults to the wavefront width ceil(T / k), also for AR, so that
    AR and WFD with the same k compute the same thing). draft_hook(pos, token) -> token may replace
    each draft (tests force wrong drafts with it; the output must not change). on_token(token) is
    called as each token commits. trace, a list, receives one dict per R call: the rows it advanced
    as (position, depth reached), and the positions drafted (with the draft token), accepted or
    rejected after it."""
    prompt, max_new_tokens, T, k, window = check_args(model, prompt_ids, max_new_tokens, method, num_steps,
                                                      draft_steps, draft_len, kv, window)

    t0 = time.perf_counter()
    with torch.no_grad():
        dec = Decoder(model, prompt, max_new_tokens, T, window, eos_token_id, draft_hook, on_token, trace,
                      keep_logits)
        if not dec.prefill():
            if method == "ar":
                autoregressive(dec)
            elif method == "wfd":
                wavefront(dec, k)
            else:
                draft_then_verify(dec, k, draft_len)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    st = dec.stats
    verified = st["accepted"] + st["rejected"]
    st.update(method=method, num_steps=T, draft_steps=k if method != "ar" else T, tokens=len(dec.tokens),
              acceptance=st["accepted"] / verified if verified else float("nan"),
              r_calls_per_token=st["r_calls"] / len(dec.tokens), wall_s=wall,
              tokens_per_s=len(dec.tokens) / wall, kv_bytes=dec.cache.nbytes, kv=kv, window=window)
    return Generation(dec.tokens, st, dec.logits)
