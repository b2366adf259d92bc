"""Every natural draft is the model's own shallow prediction (issue 60). A draft for position p+1 is
read from the row at p, whose context holds the committed tokens and the drafts still in flight
before it; this file rebuilds that context from what the run reports (the draft hook, the committed
tokens, and for the second proposal the engine's trace) and computes the token again, apart from
the schedule: the model's plain forward over the context (no cache, causal attention), run to the
read's depth (LoopFormer on the clock of the schedule's T), read out through C, in float64.

What C's coda attends to at a draft read is the coda's keys of the positions before it, which are
written by the last read of each row there: full depth T for the positions whose next token is
committed (the prefill, the verifies), the read's own depth for the rows still in flight (k, or m
for a row already read at the second depth). The expected read gives each position that state.
Sampled drafts add the Gumbel noise of docs/sampling.md for their position and seed, computed here
from the hash (layers/noise.py), not by the engine's sampler."""
import os
import random
from typing import NamedTuple, Optional

import pytest
import torch

import engine
import models
import wfd
from conftest import TESTDATA
from layers import noise

torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDENS = ["ouro_A", "huginn_A", "parcae_A", "loopformer_A", "raven_A"]
SAMPLED = dict(temperature=0.8, seed=7)


@pytest.fixture(scope="module", params=GOLDENS + ["demo"])
def model(request):
    """A golden checkpoint or the demo in float64, Huginn's, Parcae's and the retrofit's initial
    state drawn at random (per seed and position: the same in the schedule and the plain
    forward, since both run this instance)."""
    folder = os.path.join(ROOT, "demo") if request.param == "demo" else os.path.join(
        TESTDATA, request.param)
    return models.load(folder, dtype=torch.float64)


def prompt_for(model, seed):
    if model.tokenizer is not None:
        return model.tokenizer.encode("def fibonacci(n):\n    ").ids
    rng = random.Random(seed)
    return [rng.randrange(model.args.vocab_size) for _ in range(5)]


# -- what a run reports ----------------------------------------------------------------------------

class Drafted(NamedTuple):
    pos: int                 # the position of the drafted token
    token: int
    depth: Optional[int]     # None: the draft depth k; else the second depth m
    tick: Optional[int]      # len(trace) at the call: its R call is trace[tick - 1]


class Committed(NamedTuple):
    token: int
    tick: Optional[int]


class Recorder:
    """The identity draft hook and an on_token that record, in order, each draft and each commit."""

    def __init__(self, trace=None):
        self.events, self.trace = [], trace

    def tick(self):
        return None if self.trace is None else len(self.trace)

    def draft(self, pos, token, depth=None):
        self.events.append(Drafted(pos, token, depth, self.tick()))
        return token

    def commit(self, token):
        self.events.append(Committed(token, self.tick()))


class Read(NamedTuple):
    """A draft's read as the plain forward redoes it: the tokens at positions 0..q (q the row
    read), the depth each position's coda key comes from (len(tokens) entries; Ouro and LoopFormer
    have no coda and read the last alone), and what the run drafted there."""
    tokens: list
    depths: list
    pos: int                 # q + 1
    token: int


def chain_reads(prompt, events, k, T):
    """The reads of a schedule whose rows in flight form one chain (WFD, DtV): a draft for p+1 is
    read from the row at p, whose context is the committed tokens and, past them, the drafts in
    flight; a commit that differs from the draft at its position drops that draft and every one
    after it (the rows built on it)."""
    committed, drafts, reads = list(prompt), {}, []
    for ev in events:
        if isinstance(ev, Committed):
            p = len(committed)
            if drafts.get(p, ev.token) != ev.token:
                drafts = {q: t for q, t in drafts.items() if q < p}
            committed.append(ev.token)
            continue
        q, last = ev.pos - 1, len(committed) - 1
        assert q >= last and ev.depth is None
        tokens = committed + [drafts[j] for j in range(len(committed), q + 1)]
        reads.append(Read(tokens[:q + 1], [T] * last + [k] * (q - last + 1), ev.pos, ev.token))
        drafts[ev.pos] = ev.token
    return reads


class Node(NamedTuple):
    pos: int
    token: int
    parent: Optional[int]    # its parent's serial; None: a row started from a committed token


def tree_reads(prompt, events, trace, k, m, T, last_pos):
    """The reads of the second proposal, whose rows in flight form a tree. A tick's reads are
    those of its R call's rows (its trace entry, in order) at depth k, then at m, but for the rows
    its verify dropped (those not under the child that carries the committed token) and the rows
    at last_pos; each draft is read from the next of them (two rows at a position may have one
    depth: cousins), until the lanes are full. The rows a tick starts (depth 1 in the next
    entry, by serial) are its restart, if any, then a child per draft at k, then a sibling per
    second proposal that no child of its parent carries. The context of a read walks up the
    parents to the committed tokens; a row in flight gives its coda key from its last read, at m
    once it has reached m, else at k."""
    committed, nodes, reads, by_tick = list(prompt), {}, [], {}
    for ev in events:
        by_tick.setdefault(ev.tick, []).append(ev)

    def up_to(serial, pos):  # the row's ancestor (or itself) at pos
        while nodes[serial].pos > pos:
            serial = nodes[serial].parent
        return serial

    for tick, evs in sorted(by_tick.items()):
        calls = [ev for ev in evs if isinstance(ev, Drafted)]
        if tick == 0:  # the prefill's token
            committed += [ev.token for ev in evs]
            assert not calls
            continue
        entry = trace[tick - 1]
        depth = {serial: d for _, d, serial, _ in entry["rows"]}
        for pos, _, serial, token in entry["rows"]:
            nodes.setdefault(serial, Node(pos, token, None))
        live = list(depth)
        for ev in evs:
            if isinstance(ev, Committed):  # the verify: keep the rows under the right child
                committed.append(ev.token)
                last = len(committed) - 1
                live = [s for s in live if nodes[s].pos >= last
                        and nodes[up_to(s, last)].token == ev.token]
        waiting = {d: [s for s in live if depth[s] == d] for d in (k, m)}
        parents, started = [], []
        for ev in calls:
            d = ev.depth or k
            while waiting[d] and nodes[waiting[d][0]].pos == last_pos:  # it drafts nothing
                waiting[d].pop(0)
            assert waiting[d] and nodes[waiting[d][0]].pos == ev.pos - 1, (
                f"tick {tick}: position {ev.pos} drafted from no row at depth {d}")
            parent = waiting[d].pop(0)
            parents.append(parent)
            tokens, depths, row = [], [], parent
            while True:  # up to the oldest row in flight, at the last committed token
                tokens.append(nodes[row].token)
                depths.append(d if row == parent else m if depth[row] >= m else k)
                if nodes[row].pos == len(committed) - 1:
                    break
                row = nodes[row].parent
            assert tokens[-1] == committed[-1]
            reads.append(Read(committed[:-1] + tokens[::-1],
                              [T] * (len(committed) - 1) + depths[::-1], ev.pos, ev.token))
            children = [n.token for n in nodes.values() if n.parent == parent]
            if ev.depth is None or ev.token not in children:
                started.append(Node(ev.pos, ev.token, parent))
        drafted = [p for p, ev in zip(parents, calls) if ev.depth is None]
        assert entry.get("drafted", []) == drafted
        assert entry.get("proposed", []) == [n.parent for n in started[len(drafted):]]
        new = [] if tick == len(trace) else sorted(
            (serial, pos, token) for pos, d, serial, token in trace[tick]["rows"] if d == 1)
        restarts = len(new) - len(started)
        assert restarts in (0, 1)
        for (serial, pos, token), node in zip(new[restarts:], started):
            assert (pos, token) == node[:2]
            nodes[serial] = node
    return reads


# -- the reads, computed again ---------------------------------------------------------------------

def gumbel(seed, pos, vocab):
    """docs/sampling.md's noise for the token at position pos: g = -log(-log u), u the uniforms of
    the hash of (the seed folded to 32 bits, pos, v)."""
    u = noise.uniforms(noise.seed_key(seed), torch.tensor([pos]), vocab)[0]
    return -(-u.log()).log()


class PlainForward:
    """The model's plain forward over a token sequence, no cache, causal: each depth's states. A
    position's states depend on the tokens up to it alone, so a run over a sequence serves every
    prefix of it (the reads of one chain of drafts)."""

    def __init__(self, model, T):
        self.model, self.T, self.runs = model, T, {}  # tokens -> (e, states by depth 0..T)

    def states(self, tokens):
        n, tokens = len(tokens), tuple(tokens)
        for key, (e, states) in self.runs.items():
            if key[:n] == tokens:
                return None if e is None else e[:n], [s[:n] for s in states]
        ids, pos = torch.tensor(tokens), torch.arange(n)
        s, e = self.model.P(ids, pos)
        states = [s]
        for d in range(self.T):  # LoopFormer's clock: the schedule's T
            states.append(self.model.R(states[-1], e, pos, d, num_steps=self.T))
        self.runs[tokens] = e, states
        return e, states

    def token(self, read, temperature=0.0, seed=0):
        """The token C chooses for read.pos from the last row, each position's coda input taken
        at the depth read.depths gives it."""
        e, states = self.states(read.tokens)
        mixed = torch.stack([states[d][i] for i, d in enumerate(read.depths)])
        logits = self.model.C(mixed, e, torch.arange(len(mixed)))[-1].double()
        if temperature:
            logits = logits / temperature + gumbel(seed, read.pos, len(logits))
        return int(logits.argmax())


def check(model, reads, temperature=0.0, seed=0):
    """Every read's token is the plain forward's (the longest contexts first, so that the runs
    over them serve their prefixes)."""
    plain = PlainForward(model, model.num_steps)
    for read in sorted(reads, key=lambda r: -len(r.tokens)):
        want = plain.token(read, temperature, seed)
        assert read.token == want, (f"the draft for position {read.pos} after {read.tokens} is "
                                    f"{read.token}, the plain forward's read {want}")


# -- the runs --------------------------------------------------------------------------------------

def chain_run(generate, model, prompt, n_new, method, k, **kw):
    """One run of WFD or DtV through `generate` (wfd's or the engine's), every draft checked;
    returns its stats."""
    rec = Recorder()
    out = generate(model, prompt, n_new, method=method, draft_steps=k, draft_hook=rec.draft,
                   on_token=rec.commit, **kw)
    reads = chain_reads(prompt, rec.events, k, model.num_steps)
    assert len(reads) == out.stats["drafted"] > 0
    check(model, reads, **kw)
    return out.stats


def tree_run(model, prompt, n_new, k, m, **kw):
    """One run of the second proposal, every draft and second proposal checked; returns its
    stats."""
    trace = []
    rec = Recorder(trace)
    out = engine.generate(model, prompt, n_new, draft_steps=k, second_depth=m, trace=trace,
                          draft_hook=rec.draft, on_token=rec.commit, **kw)
    reads = tree_reads(prompt, rec.events, trace, k, m, model.num_steps,
                       len(prompt) + n_new - 2)
    second = sum(ev.depth == m for ev in rec.events if isinstance(ev, Drafted))
    assert len(reads) == out.stats["drafted"] + second and second > 0
    check(model, reads, **kw)
    return out.stats


def rejected(runs):
    """Some draft was rejected: the rows after it dropped and its position restarted."""
    assert sum(stats["rejected"] for stats in runs) > 0


# -- the tests -------------------------------------------------------------------------------------

def test_reference_drafts_are_the_plain_forward_at_depth_k(model):
    """wfd.generate: WFD at k = 1 and T / 2, DtV at T / 2."""
    T, prompt = model.num_steps, prompt_for(model, 1)
    rejected([chain_run(wfd.generate, model, prompt, 16, "wfd", k) for k in (1, T // 2)]
             + [chain_run(wfd.generate, model, prompt, 16, "dtv", T // 2)])


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_engine_drafts_are_the_plain_forward_at_depth_k(model, sampling):
    """engine.generate, greedy and sampled: WFD at k = 1 and T / 2, DtV at 1."""
    T, prompt = model.num_steps, prompt_for(model, 2)
    rejected([chain_run(engine.generate, model, prompt, 16, "wfd", k, **sampling)
              for k in (1, T // 2)]
             + [chain_run(engine.generate, model, prompt, 16, "dtv", 1, **sampling)])


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_second_proposals_are_the_plain_forward_at_depth_m(model, sampling):
    """The engine's second proposal at k = 1, m = T / 2: the drafts at depth k, the second
    proposals at depth m."""
    T = model.num_steps
    rejected([tree_run(model, prompt_for(model, 3), 16, 1, T // 2, **sampling)])


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_every_draft_depth(model, sampling):
    """Every k < T, WFD and DtV, the reference (greedy) and the engine; every (k, m)."""
    T, prompt, runs = model.num_steps, prompt_for(model, 4), []
    for k in range(1, T):
        for method in ("wfd", "dtv"):
            if not sampling:
                runs.append(chain_run(wfd.generate, model, prompt, 24, method, k))
            runs.append(chain_run(engine.generate, model, prompt, 24, method, k, **sampling))
        for m in range(k + 1, T):
            runs.append(tree_run(model, prompt, 24, k, m, **sampling))
    rejected(runs)
