"""Decoding of looped LMs: autoregressive (AR), draft-then-verify (DtV) and the wavefront (WFD).

All three produce AR's tokens, greedy or sampled (`choose`). They differ in how they schedule rows,
a row being one token position at one depth, through the model's three calls P (start a row), R
(advance rows by one recurrence) and C (read a token out of a row). See README.md, "The method in the
code", "Batched decoding" and "Sampling".
"""
import hashlib
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, NamedTuple, Optional

import torch
from torch._dynamo.utils import counters

import kv
import checks


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0: greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0

    def on(self, device):
        """The settings as tensors on `device`: a compiled read takes them as inputs, so that one
        graph serves every seed, temperature, k and p; only greedy or not, and which filters are on,
        shape the graph."""
        t = lambda x, dtype: torch.tensor(x, dtype=dtype, device=device)
        return Sampler(self.temperature == 0, t(self.temperature, torch.float64),
                       None if self.top_k is None else t(self.top_k, torch.int64),
                       None if self.top_p is None or self.top_p >= 1 else t(self.top_p, torch.float64),
                       t(seed_key(self.seed), torch.int64))


class Sampler(NamedTuple):
    greedy: bool
    temperature: torch.Tensor    # float64 []
    top_k: Optional[torch.Tensor]  # int64 []
    top_p: Optional[torch.Tensor]  # float64 []
    key: torch.Tensor            # int64 []: the seed folded to 32 bits (seed_key)


M32 = 0xFFFFFFFF


def mix32(x):
    """lowbias32 (C. Wellons' hash prospector), on 32-bit values held in int64. Every product stays
    below 2^63, so CPU and GPU compute the same integers: an int64 overflow would be undefined."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x046CA68B + ((x & 1) << 31)) & M32  # x * 0x846CA68B, its top bit's product added apart
    return x ^ (x >> 16)


def seed_key(seed):
    """Any seed >= 0 folded into 32 bits, 32 bits at a time, on the host."""
    key = 0
    while True:
        key, seed = mix32((key + (seed & M32) + 0x9E3779B9) & M32), seed >> 32
        if not seed:
            return key


def gumbel(key, pos, vocab):
    """Gumbel noise g(key, pos, v) [n, vocab], float64, on pos's device: a function of the three
    integers alone, whichever batch a row comes in. key: seed_key(seed), an int or an int64 tensor."""
    row = mix32(pos ^ key)  # positions are far below 2^32
    h = mix32((row[:, None] + mix32(torch.arange(vocab, device=pos.device))) & M32)
    u = (h.double() + 0.5) * 2.0 ** -32  # in (0, 1): never 0 or 1, so both logs are finite
    return u.log_().neg_().log_().neg_()


def choose(logits, pos, sampling):
    """The tokens at positions `pos` [n] from the logits [n, V] of the rows before them, int64 [n] on
    the logits' device, without a host sync. sampling: a Sampling, or its tensors (Sampling.on).
    Temperature 0: argmax. Else the Gumbel-max rule: argmax over the allowed tokens of logits /
    temperature + gumbel(seed, pos, v), an exact sample of the filtered softmax. Drafts and full depth
    use it alike, so a draft is right iff it equals AR's token. Filters: top-k keeps the logits >= the
    k-th largest (ties included); then top-p keeps the tokens whose probability (softmax of logits /
    temperature) is >= that of the last token of the shortest prefix, in descending order, whose
    probabilities sum to top_p (ties included again)."""
    s = sampling.on(logits.device) if isinstance(sampling, Sampling) else sampling
    if s.greedy:
        return logits.argmax(-1)
    z = logits.double() / s.temperature
    if s.top_k is not None:  # the k-th largest by a sort, since topk takes k as a Python int only
        kth = (s.top_k.clamp(max=z.shape[-1]) - 1).expand(len(z), 1)
        z = z.masked_fill(z < z.sort(-1, descending=True).values.gather(-1, kth), -math.inf)
    if s.top_p is not None:
        probs = z.softmax(-1)
        ranked = probs.sort(descending=True).values
        above = ranked.cumsum(-1) - ranked  # probability of the tokens ranked before each; 0 for the first
        last = (above < s.top_p).sum(-1, keepdim=True) - 1
        z = z.masked_fill(probs < ranked.gather(-1, last), -math.inf)
    return (z + gumbel(s.key, pos.to(z.device), z.shape[-1])).argmax(-1)


def read_body(model, s, e, pos, depth, cache, span, sampling, rows=None):
    """C and the tokens its logits choose, in one function, so that compiled decoding compiles them
    into one graph: logits [n, V] of `rows` (default all), and int64 [2, n] holding the token each
    chooses for the position after its row and 1 where all its logits are finite."""
    logits = model.c_body(s, e, pos, depth, cache, span, rows)
    nxt = (pos if rows is None else pos[rows]) + 1
    return logits, torch.stack([choose(logits, nxt, sampling), logits.isfinite().all(-1).long()])


@dataclass
class Row:
    pos: int                 # the position this row computes (its token sits there)
    token: int
    depth: int = 0           # completed recurrences; the state itself lives in lane pos % width


@dataclass
class Readout:
    token: int               # the token this row's logits choose for the next position
    logits: torch.Tensor     # [V], on the model's device
    finite: bool             # no NaN or inf among them


def readouts(logits, chosen):
    """A read's logits [n, V] and choices [2, n] as a function from a row's index to its Readout,
    the choices of all n in one transfer."""
    tokens, finite = chosen.tolist()
    return lambda i: Readout(tokens[i], logits[i], bool(finite[i]))


@dataclass
class Generation:
    tokens: list             # new tokens, the one from the prefill first, EOS included when hit
    stats: dict = field(default_factory=dict)
    logits: list = None      # with keep_logits: the full-depth logits [V] that chose each token


def compiled_capacity(model, positions):
    """Compiled decoding's default capacity: a power of two of at least one key block, so that prompts
    of many lengths share a few caches and their graphs (attention reads only the written blocks)."""
    return min(model.args.max_seq_len, max(kv.BLOCK, 1 << (positions - 1).bit_length()))


class Advance(NamedTuple):
    """What a schedule yields for an R call: its rows, each one recurrence deeper after it."""
    rows: list


class Read(NamedTuple):
    """What a schedule yields for a C call: the rows to read; the yield returns their Readouts."""
    rows: list


class Sequence:
    """One prompt in flight: its committed tokens, counters and schedule state. A schedule is a
    generator over one Sequence, written in its verbs start / draft / verify / commit, that yields
    each call it needs (Advance, Read); the Decoder runs the calls of all its sequences together."""

    def __init__(self, index, prompt, max_new_tokens, num_steps, *, key, stop, batched, draft_hook=None,
                 on_token=None, trace=None, keep_logits=False, digest_logits=False):
        self.index, self.prompt, self.max_new_tokens, self.num_steps = index, prompt, max_new_tokens, num_steps
        self.key, self.stop, self.batched = key, stop, batched  # key: seed_key of its seed
        self.draft_hook, self.on_token, self.trace = draft_hook, on_token, trace
        # the last token is never fed back, so the cache holds positions up to the one before it
        self.last_pos = len(prompt) + max_new_tokens - 2
        self.tokens, self.logits = [], [] if keep_logits else None
        self.digest = hashlib.blake2b(digest_size=16) if digest_logits else None  # of every committed row
        self.starting, self.entry = None, None  # the row its next P call starts; its latest trace entry
        self.slot, self.t0 = None, None  # set by its prefill
        self.stats = dict(index=index, r_calls=0, rows=0, c_calls=0, drafted=0, accepted=0, rejected=0,
                          stop_token=None, r_seconds=0.0)  # host time in its R calls after the prefill (bench.py)

    def start(self, pos, token):
        """P: a new row at depth 0, computed by the next call (before the R call that advances it)."""
        assert self.starting is None, "one P row per sequence per call"
        self.starting = Row(pos, token)
        return self.starting

    def draft(self, row, out: Readout):
        """The token read from `row` at the draft depth: a draft for the next position."""
        self.stats["drafted"] += 1
        token = self.draft_hook(row.pos + 1, out.token) if self.draft_hook else out.token
        if self.entry is not None:
            self.entry.update(drafted=row.pos + 1, draft=token)
        return token

    def verify(self, row, target: Readout):
        """Is the draft that `row` carries the token of the full-depth logits before it?"""
        ok = row.token == target.token
        self.stats["accepted" if ok else "rejected"] += 1
        if self.entry is not None:
            self.entry["accepted" if ok else "rejected"] = row.pos
        return ok

    def commit(self, out: Readout):
        """Append the token of full-depth logits; True when generation is over."""
        if not out.finite:  # argmax would quietly pick token 0
            raise ValueError(f"{f'prompt {self.index}: ' if self.batched else ''}the logits for position "
                             f"{len(self.prompt) + len(self.tokens)} are not finite (fp16 overflow or damaged weights)")
        self.tokens.append(out.token)
        if self.logits is not None:  # a copy of the row: a view would keep the read's whole [lanes, V]
            self.logits.append(out.logits.clone())
        if self.digest is not None:  # the bytes of the row: equal digests, bit-equal logits
            self.digest.update(out.logits.cpu().numpy().tobytes())
        if self.on_token:
            self.on_token(out.token)
        if out.token in self.stop:
            self.stats["stop_token"] = out.token
            return True
        return len(self.tokens) >= self.max_new_tokens


class Decoder:
    """The calls of `slots` sequences decoded together, and what they share: the model, the KV cache
    (a sequence per slot) and the lanes. A prompt's prefill is a call of its own; after it every P call
    runs one row per slot, and every R and C call `slots x width` lanes: slot b's lanes come b-th, its
    row p in lane p % width, idle lanes at position -1. A row thus meets the same lanes and call shapes
    in every schedule, so a schedule computes AR's bits at the same batch and width, in any dtype
    (README, "Exact in every precision"), whoever shares the call."""

    def __init__(self, model, slots, capacity, *, num_steps, width, window=None, sampling=Sampling(), compile=False):
        self.model, self.slots, self.num_steps, self.width = model, slots, num_steps, width
        self.compiled = compile
        self.cache = (kv.static_cache if compile else kv.new_cache)(model, capacity, num_steps, window, slots)
        self.read_call = read_body  # C and the choice of tokens
        if compile:  # each call may meet every power of two of the key blocks (kv.KVCache.span)
            room = (self.cache.scratch // self.cache.block).bit_length()
            self.read_call = model.compiled(read_body, room)
            for fn in (model.p_body, model.r_body):
                model.compiled(fn, room)
        lanes = lambda dim: torch.zeros(slots * width, dim, device=model.device, dtype=model.dtype)
        self.s = lanes(model.args.dim)  # [slots * width, D]: the rows' states
        self.e = lanes(model.inject_dim) if model.inject_dim else None  # what P made of each row's token
        self.keys = torch.zeros(slots * width, dtype=torch.int64, device=model.device)  # each lane's seed key
        self.sampler = sampling.on(model.device)._replace(key=self.keys)

    def lane(self, seq, row):
        return seq.slot * self.width + row.pos % self.width

    def warm_up(self):
        """Compiled: P, R and the read once per number of key blocks a call can read (kv.KVCache.buckets),
        each as a call whose furthest row reaches that many blocks, so that every graph a generation of
        this decoder can meet is compiled (three calls each: on CUDA the first warms up and the second
        records the CUDA graph). The rows' writes land in the static cache, which every generation
        zeroes before it starts."""
        for blocks in self.cache.buckets():
            top = min(blocks * self.cache.block, self.cache.capacity) - 1
            if top < 1:  # position 0 is always the prefill's
                continue
            pos = torch.tensor([top] + [-1] * (self.slots * self.width - 1))
            for _ in range(3):
                if self.model.args.inject:
                    self.model.P(torch.zeros(self.slots, dtype=torch.int64), pos[:self.slots], self.cache,
                                 compiled=True)
                self.model.R(self.s, self.e, pos, torch.zeros_like(pos), self.cache, compiled=True)
                self.read_call(self.model, self.s, self.e, *self.model.to_device(pos, None, self.cache, True),
                               self.sampler)

    def lanes(self, calls):
        """Lists [slots * width]: each (sequence, rows) row's position and depth in its lane, -1 and 0
        in the idle lanes."""
        pos, depth = [-1] * self.slots * self.width, [0] * self.slots * self.width
        for seq, rows in calls:
            for r in rows:
                lane = self.lane(seq, r)
                pos[lane], depth[lane] = r.pos, r.depth
        return pos, depth

    def prefill(self, seq, slot):
        """The whole prompt at full depth into its slot's cache, in a call of its own; commits the
        first new token (True when that ends the sequence)."""
        seq.slot, seq.t0 = slot, time.perf_counter()
        self.keys[slot * self.width:(slot + 1) * self.width] = seq.key
        n, cache = len(seq.prompt), self.cache.slot(slot)
        pos = torch.arange(n)
        e, s = self.model.P(torch.tensor(seq.prompt), pos, cache)
        for d in range(self.num_steps):
            s = self.model.R(s, e, pos, d, cache)
        seq.stats["r_calls"] += self.num_steps
        seq.stats["rows"] += n * self.num_steps
        seq.stats["c_calls"] += 1
        logits, chosen = read_body(self.model, s, e, *self.model.to_device(pos, None, cache),
                                   self.sampler._replace(key=self.keys[slot * self.width]), rows=[n - 1])
        return seq.commit(readouts(logits, chosen)(0))

    def start(self, seqs):
        """P: the rows the sequences started, one row per slot (idle slots at position -1)."""
        ids, pos = [0] * self.slots, [-1] * self.slots
        for seq in seqs:
            ids[seq.slot], pos[seq.slot] = seq.starting.token, seq.starting.pos
        e, s = self.model.P(torch.tensor(ids), torch.tensor(pos), self.cache, compiled=self.compiled)
        for seq in seqs:
            lane = self.lane(seq, seq.starting)
            self.s[lane] = s[seq.slot]
            if e is not None:
                self.e[lane] = e[seq.slot]
            seq.starting = None

    def advance(self, calls):
        """R: one call moves every row of every sequence one recurrence deeper, each at its own depth.
        The other lanes keep their state (draft-then-verify's rows waiting for the verify pass)."""
        starting = [seq for seq, _ in calls if seq.starting is not None]
        if starting:  # most ticks start no row: no P call then
            self.start(starting)
        pos, depth = map(torch.tensor, self.lanes(calls))
        t0 = time.perf_counter()
        self.s = self.model.R(self.s, self.e, pos, depth, self.cache, compiled=self.compiled)
        seconds = time.perf_counter() - t0
        for seq, rows in calls:
            for r in rows:
                r.depth += 1
            if seq.trace is not None:  # one entry per R call: (position, depth reached) of each row
                seq.entry = dict(rows=[(r.pos, r.depth) for r in rows], **{"index": seq.index} if seq.batched else {})
                seq.trace.append(seq.entry)
            seq.stats["r_calls"] += 1
            seq.stats["rows"] += len(rows)
            seq.stats["r_seconds"] += seconds
        return [None] * len(calls)

    def read(self, calls):
        """C: each row's logits and the token they choose, in one call and one read to the host."""
        pos = torch.tensor(self.lanes(calls)[0])
        logits, chosen = self.read_call(self.model, self.s, self.e, *self.model.to_device(pos, None, self.cache, self.compiled),
                                        self.sampler)
        for seq, _ in calls:
            seq.stats["c_calls"] += 1
        out = readouts(logits, chosen)
        return [[out(self.lane(seq, r)) for r in rows] for seq, rows in calls]


def decode(dec: Decoder, queues, schedule, on_finish):
    """Every sequence through `schedule`, slot b taking queues[b]'s prompts one after another (refill).
    Each turn runs one R call over the sequences that ask for one, then one C call over those that
    ask to read; a sequence that finishes frees its slot for the next prompt's prefill at once."""
    active = {}  # slot -> [sequence, its schedule, the call it waits for]

    def admit(slot):
        while queues[slot]:
            seq = queues[slot].pop(0)
            if dec.prefill(seq, slot):  # done at its first token
                on_finish(seq)
            else:
                active[slot] = [seq, schedule(seq)]
                active[slot].append(next(active[slot][1]))
                return

    for slot in range(len(queues)):
        admit(slot)
    while active:
        for kind, call in ((Advance, dec.advance), (Read, dec.read)):
            waiting = [(slot, entry) for slot, entry in active.items() if isinstance(entry[2], kind)]
            if not waiting:
                continue
            for (slot, entry), out in zip(waiting, call([(entry[0], entry[2].rows) for _, entry in waiting])):
                try:
                    entry[2] = entry[1].send(out)
                except StopIteration:
                    del active[slot]
                    on_finish(entry[0])
                    admit(slot)


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
        drafting = newest.depth == k and not (verifying and newest is oldest) and newest.pos < seq.last_pos
        out = (yield Read([oldest] * verifying + [newest] * drafting)) if verifying or drafting else []
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


def draft_then_verify(seq: Sequence, k: int, draft_len: int):
    """Phase-separated rounds: draft up to draft_len tokens one after another from depth k, bring all
    the round's rows from depth k to T together, keep the longest verified prefix plus the
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


class Plan(NamedTuple):
    """generate's arguments resolved: what its Decoder and Sequences are built from."""
    prompts: list            # lists of ids
    batched: bool            # prompt_ids was a list of prompts
    max_new_tokens: int
    num_steps: int
    draft_steps: int
    width: int
    window: Optional[int]
    stop: frozenset
    seeds: list              # one per prompt
    slots: int
    capacity: int


def plan(model, prompt_ids, max_new_tokens, *, capacity=None, seed=0, batch_size=None, compile=False, **kw):
    """checks.check_args, then the slots and the KV capacity generate runs with."""
    prompts, max_new_tokens, T, k, width, window, stop = checks.check_args(
        model, prompt_ids, max_new_tokens, capacity=capacity, seed=seed, batch_size=batch_size, compile=compile,
        **kw)
    batched = isinstance(prompts[0], list)
    prompts = prompts if batched else [prompts]
    seeds = seed if isinstance(seed, (list, tuple)) else [seed] * len(prompts)
    slots = min(batch_size or len(prompts), len(prompts))
    positions = max(map(len, prompts)) + max_new_tokens - 1
    capacity = capacity or (compiled_capacity(model, positions) if compile else positions)
    return Plan(prompts, batched, max_new_tokens, T, k, width, window, stop, seeds, slots, capacity)


def compile_graphs(model, prompt_ids, max_new_tokens, *, method="wfd", num_steps=None, draft_steps=None,
                   draft_len=4, width=None, capacity=None, kv="full", window=None, temperature=0.0,
                   top_k=None, top_p=None, batch_size=None):
    """Compile every graph that generate(..., compile=True) with these arguments can meet, so that a
    timed generation compiles nothing: each call at each power of two of key blocks (Decoder.warm_up).
    Returns the number of graphs compiled (0 when they all existed)."""
    p = plan(model, prompt_ids, max_new_tokens, method=method, num_steps=num_steps, draft_steps=draft_steps,
             draft_len=draft_len, width=width, capacity=capacity, kv=kv, window=window, temperature=temperature,
             top_k=top_k, top_p=top_p, batch_size=batch_size, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        Decoder(model, p.slots, p.capacity, num_steps=p.num_steps, width=p.width, window=p.window,
                sampling=Sampling(temperature, top_k, top_p), compile=True).warm_up()
    return counters["stats"]["unique_graphs"] - graphs


def generate(model, prompt_ids, max_new_tokens, *, method="wfd", num_steps=None, draft_steps=None,
             draft_len=4, width=None, capacity=None, eos_token_id=None, kv="full", window=None,
             temperature=0.0, top_k=None, top_p=None, seed=0, batch_size=None,
             draft_hook: Callable[..., int] = None, on_token: Callable = None, on_finish: Callable = None,
             trace: list = None, keep_logits=False, digest_logits=False, compile=False):
    """Greedy or sampled decoding of one prompt, returning Generation(tokens, stats, logits), or of a
    list of prompts, returning a list of them in the prompts' order.

    T = num_steps, k = draft_steps (default: checks.default_draft_steps); width: rows per R / C call (README,
    "Exact in every precision"); capacity: the KV cache's positions per sequence, refused when they do
    not fit in free memory; eos_token_id: a token id or a collection of them, each of which ends the
    generation (stats["stop_token"] says which did, None when it ran to max_new_tokens); kv="shared"
    with its window (README, "Exact cross-recurrence KV sharing"); temperature, top_k, top_p, seed:
    `choose` (README, "Sampling"). draft_hook(pos, token) -> token may replace each draft (tests force
    wrong drafts with it: the output must not change); on_token(token) is called as each token commits;
    trace, a list, receives one dict per R call (run.py draws it). keep_logits: the committed logits
    in Generation.logits; digest_logits: a digest of their bytes in stats["logits_digest"] instead (equal
    digests, bit-equal logits; nothing kept). compile: the P, R and C calls after the prefill run
    compiled (README, "Compiled decoding"); stats["graphs_compiled"] counts the graphs compiled
    during the generation (compile_graphs beforehand makes it 0).

    Several prompts (README, "Batched decoding"): batch_size slots (default: one per prompt) decode
    together, prompt i in slot i % batch_size after the prompts before it there; seed may be a list,
    one per prompt; the callbacks take the prompt's index first: draft_hook(i, pos, token),
    on_token(i, token), on_finish(i, generation) as each prompt finishes; trace entries carry "index"."""
    p = plan(model, prompt_ids, max_new_tokens, method=method, num_steps=num_steps, draft_steps=draft_steps,
             draft_len=draft_len, width=width, capacity=capacity, eos_token_id=eos_token_id, kv=kv, window=window,
             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, batch_size=batch_size, compile=compile)
    T, k = p.num_steps, p.draft_steps
    own = (lambda f, i: f and partial(f, i)) if p.batched else (lambda f, i: f)  # a callback for prompt i
    schedule = dict(ar=autoregressive, wfd=partial(wavefront, k=k),
                    dtv=partial(draft_then_verify, k=k, draft_len=draft_len))[method]
    cuda = model.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(model.device)
    generations, graphs = [None] * len(p.prompts), counters["stats"]["unique_graphs"]

    def finish(seq, dec):
        stats, n = seq.stats, len(seq.tokens)
        wall = time.perf_counter() - seq.t0
        verified = stats["accepted"] + stats["rejected"]
        stats.update(method=method, num_steps=T, draft_steps=k if method != "ar" else T, tokens=n,
                     acceptance=stats["accepted"] / verified if verified else float("nan"),
                     r_calls_per_token=stats["r_calls"] / n, wall_s=wall, tokens_per_s=n / wall,
                     slot=seq.slot, kv_bytes=dec.cache.nbytes, kv=kv, window=p.window, width=p.width,
                     batch_size=p.slots, temperature=temperature, top_k=top_k, top_p=top_p,
                     seed=p.seeds[seq.index], compiled=compile, eos_token_ids=sorted(p.stop),
                     graphs_compiled=counters["stats"]["unique_graphs"] - graphs,  # so far, as the peak:
                     peak_memory_bytes=torch.cuda.max_memory_allocated(model.device) if cuda else None,
                     logits_digest=seq.digest and seq.digest.hexdigest())
        generations[seq.index] = Generation(seq.tokens, stats, seq.logits)
        if on_finish:
            on_finish(seq.index, generations[seq.index])

    with torch.no_grad():
        dec = Decoder(model, p.slots, p.capacity, num_steps=T, width=p.width, window=p.window,
                      sampling=Sampling(temperature, top_k, top_p), compile=compile)
        seqs = [Sequence(i, prompt, p.max_new_tokens, T, key=seed_key(p.seeds[i]), stop=p.stop, batched=p.batched,
                         draft_hook=own(draft_hook, i), on_token=own(on_token, i), trace=trace,
                         keep_logits=keep_logits, digest_logits=digest_logits) for i, prompt in enumerate(p.prompts)]
        decode(dec, [seqs[b::p.slots] for b in range(p.slots)], schedule, partial(finish, dec=dec))
    return generations if p.batched else generations[0]
