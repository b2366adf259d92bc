"""Tests of the reference (wfd.py, kv.py, models.py), on the official code's goldens: its AR gives
the official greedy tokens and logits, and every schedule gives its AR's tokens, with forced wrong
drafts, EOS in the middle of a wave, every draft depth and shared KV; its calls run as wfd.py traces
a tick; the engine (engine/) gives the reference's tokens on every family; WFD's and DtV's R and
C calls per token are those their schedules' definitions give. The engine's own tests are in
tests/ (the demo's counts: tests/test_speedup.py)."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import engine
import models
import wfd

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "testdata")
DEVICE = os.environ.get("WFD_TEST_DEVICE", "cpu")  # cuda: scripts/gpu_check.sh
FAMILIES = ["ouro_A", "huginn_A", "parcae_A", "loopformer_A", "raven_A"]
# golden: (T, greedy tokens, cached logits, their tolerance) of the official cached generation
GENERATION = {"huginn_A": (8, "tokens_generated", "gen_logits_cached_steps8", 1e-3),
              "ouro_A": (4, "gen_cached_tokens", "gen_cached_logits", 1e-4),
              "parcae_A": (4, "gen_tokens", "gen_logits_cached", 1e-4)}
STATE = dict(huginn_A="zero", parcae_A="zero")  # the goldens' initial state
N_NEW = 24
slow = lambda *values: pytest.param(*values, marks=pytest.mark.slow)  # the whole suite's alone


def load(name, dtype=None):
    return models.load(os.path.join(TESTDATA, name), device=DEVICE, dtype=dtype,
                       state_init=STATE.get(name, "random"))


def golden(name):
    with open(os.path.join(TESTDATA, name, "golden.json")) as f:
        return json.load(f), load_file(os.path.join(TESTDATA, name, "golden.safetensors"))


def prompt_of(name):
    return golden(name)[0]["prompt_ids"] if name in GENERATION else [3, 1, 4, 1, 5, 9, 2, 6]


def same_as(out, ar, dtype):
    """The schedule's tokens are AR's; in float64 its logits too, to float64's rounding (a row may
    be computed in a call of other rows, whose attention sums it in another order)."""
    assert out.tokens == ar.tokens
    if dtype == torch.float64:
        assert torch.allclose(torch.stack(out.logits), torch.stack(ar.logits), rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", GENERATION)
def test_reference_ar_is_the_official_cached_generation(name):
    model, (meta, g) = load(name), golden(name)
    T, tokens, logits, atol = GENERATION[name]
    out = wfd.generate(model, meta["prompt_ids"], N_NEW, method="ar", num_steps=T,
                       keep_logits=True)
    assert out.tokens == g[tokens].tolist()
    assert torch.allclose(torch.stack(out.logits).cpu(), g[logits], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("name,dtype", [("ouro_A", torch.float64), ("huginn_A", torch.float64),
                                        ("huginn_A", torch.float32),
                                        slow("ouro_A", torch.float32)], ids=str)
def test_every_schedule_gives_ar_at_every_draft_depth(name, dtype):
    """WFD and DtV at every k in 1..T (k = T: no drafts), for lengths 1, 2 and 24."""
    model, prompt = load(name, dtype), prompt_of(name)
    T = model.num_steps
    for n_new in (1, 2, N_NEW):
        ar = wfd.generate(model, prompt, n_new, method="ar", keep_logits=True)
        assert len(ar.tokens) == n_new and ar.stats["r_calls"] == T * n_new
        for k in range(1, T + 1):
            for method, kw in (("wfd", {}), ("dtv", dict(draft_len=1 + k % 3))):
                out = wfd.generate(model, prompt, n_new, method=method, draft_steps=k,
                                   keep_logits=True, **kw)
                same_as(out, ar, dtype)


def wrong_at(ar, prompt, vocab, chosen):
    """A draft hook: the draft for each position in `chosen` replaced by a token AR did not take
    there, every other draft made right."""
    at = lambda pos: ar.tokens[pos - len(prompt)]
    return lambda pos, token: (at(pos) + 1) % vocab if chosen(pos) else at(pos)


@pytest.mark.parametrize("name", ["ouro_A", slow("huginn_A")])
def test_forced_wrong_drafts_are_corrected(name):
    """Every draft wrong, or every third: the tokens stay AR's, every wrong draft is rejected by
    its verify, every right one accepted."""
    model, prompt = load(name, torch.float64), prompt_of(name)
    V, T = model.args.vocab_size, model.num_steps
    ar = wfd.generate(model, prompt, N_NEW, method="ar", keep_logits=True)
    every = wrong_at(ar, prompt, V, lambda pos: True)
    third = wrong_at(ar, prompt, V, lambda pos: pos % 3 == 0)
    wrong = sum(pos % 3 == 0 for pos in range(len(prompt) + 1, len(prompt) + N_NEW))
    for k in range(1, T):
        for method in ("wfd", "dtv"):
            out = wfd.generate(model, prompt, N_NEW, method=method, draft_steps=k,
                               draft_hook=every, keep_logits=True)
            same_as(out, ar, torch.float64)
            assert out.stats["accepted"] == 0 and out.stats["rejected"] > 0
            out = wfd.generate(model, prompt, N_NEW, method=method, draft_steps=k,
                               draft_hook=third, keep_logits=True)
            same_as(out, ar, torch.float64)
            assert out.stats["accepted"] > 0
            if method == "wfd":  # the wavefront verifies every draft: each wrong one is caught
                assert out.stats["rejected"] == wrong


@pytest.mark.parametrize("name", ["ouro_A", "huginn_A"])
def test_eos_in_the_middle_of_a_wave(name):
    """A stop token committed while rows past it are in flight: generation ends there, with AR's
    tokens up to it, at every draft depth."""
    model, prompt = load(name, torch.float64), prompt_of(name)
    ar = wfd.generate(model, prompt, N_NEW, method="ar")
    eos = ar.tokens[5]
    end = ar.tokens.index(eos) + 1
    for k in range(1, model.num_steps + 1):
        for method in ("wfd", "dtv"):
            out = wfd.generate(model, prompt, N_NEW, method=method, draft_steps=k,
                               eos_token_id=eos)
            assert out.tokens == ar.tokens[:end] and out.stats["stop_token"] == eos


@pytest.mark.parametrize("name", ["ouro_A", slow("huginn_A")])
def test_shared_kv_wfd_gives_shared_ar(name):
    """kv.SharedKVCache: WFD gives AR's tokens under the same sharing, at every window from the
    wavefront's width; a window over every position is the full cache."""
    model, prompt = load(name, torch.float64), prompt_of(name)
    T = model.num_steps
    full = wfd.generate(model, prompt, N_NEW, method="ar")
    whole = wfd.generate(model, prompt, N_NEW, method="ar", kv="shared", window=100)
    assert whole.tokens == full.tokens
    for k in range(1, T):
        wave = -(-T // k)
        for window in (wave, wave + 2):
            ar = wfd.generate(model, prompt, N_NEW, method="ar", kv="shared", window=window,
                              keep_logits=True)
            out = wfd.generate(model, prompt, N_NEW, method="wfd", draft_steps=k, kv="shared",
                               window=window, keep_logits=True)
            same_as(out, ar, torch.float64)
    with pytest.raises(ValueError, match="a window of at least"):
        wfd.generate(model, prompt, 4, method="wfd", draft_steps=1, kv="shared", window=T - 1)


def test_shared_kv_ring_holds_what_a_restarted_row_reads():
    """At T = 3, k = 1 the wave is 3 rows: when p's draft fails, the dropped row at p + 1 wrote
    depth 0 of p + 1, and the row restarted at p reads depth 0 of p - 2: a ring of W = 3 entries
    would hold one over the other, max(W, 2W - 2) = 4 keeps both. WFD gives shared AR's tokens
    and logits, and rejects drafts here (random weights), so the restart is run."""
    model, prompt = load("ouro_A", torch.float64), prompt_of("ouro_A")
    kw = dict(num_steps=3, kv="shared", window=3, keep_logits=True)
    ar = wfd.generate(model, prompt, N_NEW, method="ar", **kw)
    out = wfd.generate(model, prompt, N_NEW, method="wfd", draft_steps=1, **kw)
    assert out.stats["verified"] > out.stats["accepted"]
    same_as(out, ar, torch.float64)


@pytest.mark.parametrize("name", ["ouro_A", "huginn_A"])
def test_kv_bytes_count_what_each_cache_keeps(name):
    """generate's kv_bytes, from the layout alone: a column (one position's keys and values in one
    slot) is Hkv x hd x 2 x itemsize bytes; the full cache keeps T x L + Lp + Lc slots of C
    columns (C = the positions its rows compute), the shared one L + Lp + Lc slots of C columns
    and (T - 1) x L rings of max(W, 2W - 2) columns."""
    model, prompt = load(name, torch.float64), prompt_of(name)
    a, T, C = model.args, model.num_steps, len(prompt) + N_NEW - 1
    column = a.n_kv_heads * a.head_dim * 2 * 8
    edges = a.n_prelude + a.n_coda
    full = wfd.generate(model, prompt, N_NEW, method="ar")
    assert full.stats["kv_bytes"] == (T * a.n_core + edges) * C * column
    for window, ring in ((2, 2), (3, 4)):
        shared = wfd.generate(model, prompt, N_NEW, method="ar", kv="shared", window=window)
        rings = (T - 1) * a.n_core * ring
        assert shared.stats["kv_bytes"] == ((a.n_core + edges) * C + rings) * column


class CallLog:
    """A stand-in for a looped LM that logs its P, R and C calls (the positions of their rows, and
    R's depths); a row's logits choose the token pos + 1, so every draft is accepted."""
    device = "cpu"

    def __init__(self):
        self.calls = []

    def P(self, tokens, pos, cache):
        self.calls.append(("P", pos.tolist()))
        return torch.zeros(len(pos), 1), None

    def R(self, s, e, pos, depth, cache):
        self.calls.append(("R", pos.tolist(), depth.tolist() if torch.is_tensor(depth) else depth))
        assert len(self.calls) < 100, "the schedule runs on"  # a broken one fails, never hangs
        return s

    def C(self, s, e, pos, cache):
        self.calls.append(("C", pos.tolist()))
        return torch.nn.functional.one_hot(pos + 1, 8).float()


def test_the_calls_run_as_wfd_py_traces_a_tick():
    """wfd.py's trace, T = 4, k = 2, p = 1, p+2's draft forced wrong: one R call over the rows in
    flight, then one C call reading the oldest (at T) and the newest (at k); a drafted row's P call
    comes at the next Advance, just before the R call that takes it to depth 1. The log is written
    out by hand; the numbers are the trace's R calls."""
    model = CallLog()
    seq = wfd.Sequence([0], max_new_tokens=5, num_steps=4,
                       draft_hook=lambda pos, token: 0 if pos == 3 else token)
    loop = wfd.Loop(model, cache=None)
    loop.prefill(seq)
    loop.run(seq, wfd.wavefront(seq, k=2))
    assert model.calls == [
        ("P", [0]), ("R", [0], 0), ("R", [0], 1), ("R", [0], 2), ("R", [0], 3), ("C", [0]),
        ("P", [1]), ("R", [1], [0]),  # 1
        ("R", [1], [1]), ("C", [1]),  # 2: the draft for 2
        ("P", [2]), ("R", [1, 2], [2, 0]),  # 3
        ("R", [1, 2], [3, 1]), ("C", [1, 2]),  # 4: 1 verifies 2's draft, 2 drafts for 3
        ("P", [3]), ("R", [2, 3], [2, 0]),  # 5
        ("R", [2, 3], [3, 1]), ("C", [2, 3]),  # 6: 3's draft is wrong
        ("P", [3]), ("R", [3], [0]),  # 7: 3 restarts
        ("R", [3], [1]), ("C", [3]),
        ("P", [4]), ("R", [3, 4], [2, 0]),
        ("R", [3, 4], [3, 1]), ("C", [3]),  # 4 is last_pos: no draft
        ("R", [4], [2]), ("R", [4], [3]), ("C", [4])]
    assert seq.tokens == [1, 2, 3, 4, 5] and seq.starting == []
    assert (seq.stats["accepted"], seq.stats["rejected"]) == (2, 1)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_engine_gives_the_references_tokens(name):
    """Every family in float64: the engine's AR and WFD (in lanes, key blocks, staged calls) give
    the tokens of the reference's AR."""
    model, prompt = load(name, torch.float64), prompt_of(name)
    want = wfd.generate(model, prompt, 16, method="ar").tokens
    for method in ("ar", "wfd"):
        assert engine.generate(model, prompt, 16, method=method).tokens == want, method


def test_bad_arguments_are_named():
    model = load("ouro_A")
    for kw, message in ((dict(method="beam"), "method must be 'ar', 'wfd' or 'dtv'"),
                        (dict(draft_steps=5), "draft depth 5 is out of range"),
                        (dict(kv="paged"), "kv must be 'full' or 'shared'"),
                        (dict(method="dtv", kv="shared"),
                         "kv='shared' is exact for AR, and for WFD")):
        with pytest.raises(ValueError, match=message):
            wfd.generate(model, [1, 2], 4, **kw)
    for prompt, n in (([], 4), ([1, 2], 0)):
        with pytest.raises(ValueError, match="give a prompt of at least one token"):
            wfd.generate(model, prompt, n)


# -- the sharing against its definition; the reference's edges ----------------------------------

SHARED = [("ouro_A", 2), ("ouro_A", 3), ("huginn_A", 2), ("huginn_A", 3)]  # (golden, window)


def lm_head_outputs(model, run):
    """run()'s result, and every output of the model's lm_head meanwhile, in the model's dtype (C
    casts its logits to float32; these are the float64 ones)."""
    outs = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: outs.append(out))
    try:
        return run(), outs
    finally:
        hook.remove()


def reference_ar(model, prompt, **kv):
    """The reference's AR (kv: generate's kv and window): its Generation, and the float64 logits of
    each committed token [N_NEW, V] (the prefill's last row, then one C call per token)."""
    out, logits = lm_head_outputs(model, lambda: wfd.generate(model, prompt, N_NEW, method="ar",
                                                              keep_logits=True, **kv))
    return out, torch.cat([logits[0][-1:]] + logits[1:])


class SharedRule:
    """docs/shared-kv.md's rule, written here alone: every position's keys and values kept per
    (layer, depth), each row's keys picked from them by the doc's words and attended by a plain
    softmax. A row at position p >= the prompt's length, at depth d, reads the depth-d keys of the
    positions p - window < q <= p and the last depth's (T - 1) of every older position; a prompt
    row reads its own depth's at every position; a prelude or coda layer (no depth) has one set.
    The model calls prepare once per P / R / C call (one row here) and attend once per layer."""

    def __init__(self, model, prompt_len, window):
        self.args, self.T = model.args, model.num_steps
        self.prompt_len, self.window = prompt_len, window
        self.kv = {}  # (layer, depth or None, position) -> (k, v), each [Hkv, hd]

    def prepare(self, call):
        return call

    def depth_read(self, layer, depth, p, q):
        """The depth whose keys of position q a row at (p, depth) reads at `layer`."""
        if layer >= self.args.n_core:
            return None
        return depth if p < self.prompt_len or q > p - self.window else self.T - 1

    def attend(self, call, layer, q, k, v):
        (p,), a = call.pos.tolist(), self.args
        depth = int(call.depth[0]) if layer < a.n_core else None  # R's depth: a tensor [1]
        self.kv[layer, depth, p] = k[0], v[0]
        keys, values = (torch.stack(t) for t in zip(*(
            self.kv[layer, self.depth_read(layer, depth, p, c), c] for c in range(p + 1))))
        group = a.n_heads // a.n_kv_heads  # query head h reads kv head h // group
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        weights = torch.softmax(torch.einsum("hd,chd->hc", q[0], keys) / a.head_dim ** 0.5, -1)
        return torch.einsum("hc,chd->hd", weights, values)[None]  # [1, H, hd]


@torch.no_grad()
def shared_ar_by_the_rule(model, prompt, window):
    """AR under SharedRule, one position at a time through P, T x R and C (the prompt's positions
    too, instead of a prefill), greedy: the new tokens and the float64 logits that chose them."""
    rule, ids, n = SharedRule(model, len(prompt), window), list(prompt), len(prompt)

    def run():
        for p in range(n + N_NEW - 1):
            pos = torch.tensor([p], device=model.device)
            s, e = model.P(torch.tensor(ids[p:p + 1], device=model.device), pos, rule)
            for d in range(model.num_steps):
                s = model.R(s, e, pos, d, rule)
            logits = model.C(s, e, pos, rule)[0]
            if p >= n - 1:
                ids.append(int(logits.argmax()))

    _, logits = lm_head_outputs(model, run)
    return ids[n:], torch.cat(logits[n - 1:])


@pytest.mark.parametrize("name,window", SHARED)
def test_shared_kv_reference_ar_is_the_engines(name, window):
    """The reference's AR under kv.SharedKVCache and the engine's under its ring
    (engine/kv_cache.py) give the same tokens and the same logits, bit for bit."""
    model, prompt = load(name, torch.float64), prompt_of(name)
    ref = wfd.generate(model, prompt, N_NEW, method="ar", kv="shared", window=window,
                       keep_logits=True)
    eng = engine.generate(model, prompt, N_NEW, method="ar", kv="shared", window=window,
                          keep_logits=True)
    assert len(ref.tokens) == N_NEW and ref.tokens == eng.tokens
    assert torch.equal(torch.stack(ref.logits), torch.stack(eng.logits))


@pytest.mark.parametrize("name,window", SHARED)
def test_shared_kv_reference_ar_is_the_docs_rule(name, window):
    """The reference's AR under kv.SharedKVCache gives the tokens of SharedRule's forward, and its
    float64 logits to float64's rounding (the two sum attention in other orders); the sharing
    moves them from the full cache's, so the agreement is the rule's."""
    model, prompt = load(name, torch.float64), prompt_of(name)
    ref, ref_logits = reference_ar(model, prompt, kv="shared", window=window)
    tokens, logits = shared_ar_by_the_rule(model, prompt, window)
    assert ref.tokens == tokens
    assert torch.allclose(ref_logits, logits, rtol=0, atol=1e-12)
    _, full_logits = reference_ar(model, prompt)
    assert (full_logits - logits).abs().max() > 1e-3


def test_generate_refuses_its_edges_in_one_line():
    """0 or less for num_steps, draft_steps or window, and a prompt past the model's context, are
    refused by name (None keeps meaning the default); the last position the context holds is
    taken (huginn_A's context: 64 positions)."""
    model = load("huginn_A")
    for kw, message in ((dict(num_steps=0), "num_steps must be at least 1, not 0"),
                        (dict(num_steps=-2), "num_steps must be at least 1, not -2"),
                        (dict(draft_steps=0), "draft depth 0 is out of range"),
                        (dict(draft_steps=-1), "draft depth -1 is out of range"),
                        (dict(method="ar", kv="shared", window=0), "not ar, window 0"),
                        (dict(kv="shared", window=-1), "not wfd, window -1")):
        with pytest.raises(ValueError, match=message):
            wfd.generate(model, [1, 2], 4, **kw)
    out = wfd.generate(model, [1, 2], 2, kv="shared")
    assert [out.stats[s] for s in ("num_steps", "draft_steps", "window")] == [4, 1, 4]
    assert len(wfd.generate(model, [1] * 60, 4, method="wfd").tokens) == 4  # 64 tokens in all
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_new_tokens \(5\) "
                                         "exceeds the model's context of 64 positions"):
        wfd.generate(model, [1] * 60, 5)


def test_generate_takes_numpy_stop_ids():
    """eos_token_id as a numpy integer, or a collection of them, stops where the int does."""
    model, prompt = load("ouro_A", torch.float64), prompt_of("ouro_A")
    ar = wfd.generate(model, prompt, N_NEW, method="ar")
    eos = ar.tokens[5]
    end = ar.tokens.index(eos) + 1
    for stop in (np.int64(eos), [np.int32(eos)], (np.uint8(eos), np.int64(0))):
        out = wfd.generate(model, prompt, N_NEW, eos_token_id=stop)
        assert out.tokens == ar.tokens[:end] and out.stats["stop_token"] == eos


# -- the schedules' calls per token --------------------------------------------------------------

def wavefront_r_calls(T, k, accepted, rejected):
    """wfd.wavefront's R calls for n = accepted + rejected + 2 tokens (k < T, no stop token). The
    prefill's T give token 1. Row j (j = 0 .. n - 2) computes token j + 2: it starts in R call
    s_j (s_0 = 1) and is read at depth T after R call s_j + T - 1, when its token commits. Row
    j + 1 starts at s_j + k when row j's draft was right (read at depth k after call s_j + k - 1,
    its row joins the next call), at s_j + T when it was wrong (the restart follows the verify).
    So the last token commits after T + s_{n-2} + T - 1 = 2 T + a k + r T R calls, a and r the
    drafts accepted and rejected: 2 T + (n - 2) k with every draft right, n T (AR's) with none."""
    return 2 * T + accepted * k + rejected * T


def wavefront_c_calls(T, k, n, every_draft_right):
    """wfd.wavefront's C calls for n >= 2 tokens (k < T, no stop token) at the two extremes: the
    prefill's, then one per tick with a read, a draft's at depth k and a verify's at T sharing one
    when they fall together (with s_j as in wavefront_r_calls).
    Every draft right: s_j = 1 + j k; row j's draft is read at tick (j + 1) k (rows 0 .. n - 3:
    the row at the last position drafts nothing) and its verify at j k + T: 2 n - 3 reads, less
    the ticks they share: where k divides T, the verify of row j and the draft of row
    j + T / k - 1 (j <= n - 2 - T / k).
    Every draft wrong: s_j = 1 + j T, rounds of T ticks. In round j the fresh row j and the wrong
    rows drafted one from the other read drafts at its ticks k, 2 k, ... (counted from 1), d_j =
    min(T // k, n - 2 - j) of them (up to the verify's tick T, and to the row at the last
    position), and the verify one; the d_j-th draft shares the verify's call when d_j k = T."""
    if every_draft_right:
        shared = max(0, n - 1 - T // k) if T % k == 0 else 0
        return 1 + 2 * n - 3 - shared
    drafts = [min(T // k, n - 2 - j) for j in range(n - 1)]
    return 1 + sum(1 + d - (d * k == T) for d in drafts)


def draft_then_verify_calls(T, k, n, draft_len, every_draft_right):
    """wfd.draft_then_verify's (R calls, C calls) for n tokens (no stop token): the prefill's T
    and 1, then rounds. A round of j rows (j - 1 drafts) runs each row k R calls alone, each draft
    read in a C call of its own, then T - k R calls over all j rows and one C call that verifies:
    j k + T - k R calls and j C calls. A round starting after c tokens holds j = min(draft_len + 1,
    n - c) rows (no row computes a position past the last token's). Every draft right: it commits
    its j tokens (the bonus included), so the rounds take the n - 1 tokens draft_len + 1 at a time:
    T + (n - 1) k + ceil((n - 1) / (draft_len + 1)) (T - k) R calls, n C calls. Every draft
    wrong: it commits 1 token (the correction), n - 1 rounds. With k = T every draft is read at
    full depth, AR's token: right, and the counts are AR's, n T and n."""
    if every_draft_right:
        rounds = -(-(n - 1) // (draft_len + 1))
        return T + (n - 1) * k + rounds * (T - k), n
    rows = [min(draft_len + 1, n - c) for c in range(1, n)]
    return T + sum(j * k + T - k for j in rows), 1 + sum(rows)


@pytest.mark.parametrize("name,lengths", [("ouro_A", (2, 13)), slow("huginn_A", (2, 3, 13))])
def test_calls_per_token_follow_the_schedules(name, lengths, one_thread):
    """WFD's and DtV's R and C calls against the formulas above, with every draft forced right
    (draft_hook: AR's token), every draft forced wrong, and every third wrong (WFD's R calls), at
    every k < T; and at k = T, where no draft is made (WFD) or every draft is read at full depth
    (DtV): AR's counts. A schedule that keeps AR's tokens but computes them later (a row that
    joins the wavefront a call late, a correction a call late) fails here."""
    model, prompt = load(name, torch.float64), prompt_of(name)
    V, T = model.args.vocab_size, model.num_steps
    for n in lengths:
        ar = wfd.generate(model, prompt, n, method="ar")
        right = wrong_at(ar, prompt, V, lambda pos: False)
        wrong = wrong_at(ar, prompt, V, lambda pos: True)
        third = wrong_at(ar, prompt, V, lambda pos: pos % 3 == 0)
        for k in range(1, T):
            for hook, every_right in ((right, True), (wrong, False)):
                out = wfd.generate(model, prompt, n, method="wfd", draft_steps=k, draft_hook=hook)
                a, r = (n - 2, 0) if every_right else (0, n - 2)
                assert (out.stats["accepted"], out.stats["rejected"]) == (a, r)
                assert out.stats["r_calls"] == wavefront_r_calls(T, k, a, r), (n, k, every_right)
                assert out.stats["c_calls"] == wavefront_c_calls(T, k, n, every_right), (n, k)
                out = wfd.generate(model, prompt, n, method="dtv", draft_steps=k, draft_len=3,
                                   draft_hook=hook)
                assert (out.stats["r_calls"], out.stats["c_calls"]) == draft_then_verify_calls(
                    T, k, n, 3, every_right), (n, k, every_right)
            out = wfd.generate(model, prompt, n, method="wfd", draft_steps=k, draft_hook=third)
            wrong_drafts = sum(pos % 3 == 0 for pos in range(len(prompt) + 1, len(prompt) + n - 1))
            assert out.stats["rejected"] == wrong_drafts
            assert out.stats["r_calls"] == wavefront_r_calls(T, k, n - 2 - wrong_drafts,
                                                             wrong_drafts)
        out = wfd.generate(model, prompt, n, method="wfd", draft_steps=T)
        assert (out.stats["r_calls"], out.stats["c_calls"], out.stats["drafted"]) == (n * T, n, 0)
        out = wfd.generate(model, prompt, n, method="dtv", draft_steps=T, draft_len=3)
        assert (out.stats["r_calls"], out.stats["c_calls"]) == (n * T, n)
        drafts = n - 1 - -(-(n - 1) // 4)  # a round's rows but its first, n - 1 in rounds of 4
        assert (out.stats["accepted"], out.stats["rejected"], out.stats["drafted"]) == (drafts, 0,
                                                                                      drafts)
