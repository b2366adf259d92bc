"""Tests of the second proposal (engine/siblings.py, docs/siblings.md): every row read at the
draft depth k and again at the second depth m, a sibling started where the two disagree, each
sibling's keys in a branch column. Tokens and logits equal AR's at the same width, bit for bit, in
every family and dtype, greedy and sampled, with drafts and second proposals forced wrong, EOS
among siblings, batched with refill, with shared KV, and compiled."""
import random

import pytest
import torch

import engine
from engine import kv_cache, model_runner
from layers.transformer import VE_GATE_CHANNELS, value_gate
from test_batch import prompts_for
from test_families import KINDS, tiny_family
from test_engine import DTYPES, quick, same_logits, tiny_model

torch.set_num_threads(1)

FAMILIES = ["ouro", "huginn", "parcae"] + KINDS  # KINDS: LoopFormer and the retrofits' layouts


def model_of(kind, seed, dtype):
    """A tiny model of the family with T >= 3 (a second depth needs k < m < T)."""
    make = tiny_model if kind in ("ouro", "huginn", "parcae") else tiny_family
    for s in range(seed, seed + 20):
        model = make(kind, s, dtype)
        if model.num_steps >= 3:
            return model
    raise AssertionError(f"no tiny {kind} model with T >= 3")


def depths(T, every=False):
    """(k, m) pairs, 1 <= k < m < T: all of them, or the extremes."""
    pairs = [(k, m) for k in range(1, T - 1) for m in range(k + 1, T)]
    return pairs if every else sorted({pairs[0], pairs[-1], (1, T - 1)})


def siblings(model, prompt, n_new, k, m, **kw):
    """The second proposal's output, checked against AR at its width through the same calls, and
    (not compiled) against plain AR at that width."""
    out = engine.generate(model, prompt, n_new, draft_steps=k, second_depth=m, keep_logits=True,
                          **kw)
    kw.pop("draft_hook", None)
    kw.pop("width", None)
    ref = engine.generate(model, prompt, n_new, method="ar", draft_steps=k, second_depth=m,
                          width=out.stats["width"], keep_logits=True, **kw)
    assert same_logits(out, ref), (k, m, model.dtype, kw)
    if not kw.get("compile"):
        plain = engine.generate(model, prompt, n_new, method="ar", draft_steps=k,
                                width=out.stats["width"], keep_logits=True, **kw)
        assert same_logits(out, plain), (k, m, model.dtype, kw)
    return out


def forced(reference, prompt, V):
    """A hook forcing, by position, every case of a verify: the draft right; the draft wrong and
    the second proposal right (a rescue); both wrong, apart (a sibling that loses too) and alike
    (no sibling); the draft right and the second proposal wrong (a sibling that loses)."""
    def hook(pos, token, depth=None):
        want, case = reference[pos - len(prompt)], pos % 5
        if depth is None:
            return (want + 1) % V if case in (1, 2, 3) else want
        return {1: want, 2: (want + 2) % V, 3: (want + 1) % V, 4: (want + 3) % V}.get(case, want)
    return hook


@pytest.mark.parametrize("kind,dtype", quick([(k, d) for k in FAMILIES for d in DTYPES],
                                             ("ouro", torch.bfloat16), ("huginn", torch.float16),
                                             ("parcae", torch.bfloat16),
                                             ("loopformer", torch.float16),
                                             ("olmo2", torch.bfloat16)), ids=str)
def test_siblings_equal_ar_greedy_sampled_and_forced(kind, dtype):
    """Every (k, m) (the whole suite; the quick one: the extremes), greedy, sampled with a seed, and
    with every case of a verify forced (rescues counted: each one a sibling that won); in float64
    also 1-row AR's tokens."""
    seed = FAMILIES.index(kind) + DTYPES.index(dtype)
    model = model_of(kind, seed, dtype)
    T, V, rng = model.num_steps, model.args.vocab_size, random.Random(seed)
    prompt, n_new = [rng.randrange(V) for _ in range(rng.randint(2, 7))], 20
    plain = engine.generate(model, prompt, n_new, method="ar", width=1)
    for k, m in depths(T, every=dtype == torch.float64):
        out = siblings(model, prompt, n_new, k, m)
        if dtype == torch.float64:
            assert out.tokens == plain.tokens, (k, m)
        siblings(model, prompt, n_new, k, m, temperature=0.9, top_k=20, seed=seed)
        hook = forced(out.tokens, prompt, V)
        siblings(model, prompt, n_new, k, m, draft_hook=hook)  # the default lanes: some rows wait
        out = siblings(model, prompt, n_new, k, m, draft_hook=hook, width=2 * T)  # room for all
        assert out.stats["rescued"] > 0 and out.stats["rejected"] > 0, (k, m, out.stats)
        assert out.stats["proposed"] >= out.stats["rescued"]


def test_each_verify_is_counted_by_the_depth_its_kept_token_came_from():
    """drafted: rows from the draft depth k; proposed: from the second depth m; a verify keeps a
    draft (accepted), a second proposal (rescued) or neither (rejected); acceptance = accepted /
    verified drafts. With every draft forced wrong and every second proposal right, nothing is
    accepted, even where the lanes were full at depth k and a row's only child came from depth m
    (Huginn's T = 4, k = 1, m = 2, 5 lanes); with every draft right, every verify accepts one."""
    model = tiny_model("huginn", 0)
    T, V, prompt, n_new = model.num_steps, model.args.vocab_size, [3, 1, 4, 1, 5], 40
    assert T == 4
    ref = engine.generate(model, prompt, n_new, method="ar").tokens
    for right in (False, True):
        calls = {None: 0, 2: 0}

        def hook(pos, token, depth=None):
            calls[depth] += 1
            want = ref[pos - len(prompt)]
            return want if right or depth else (want + 1) % V
        out = engine.generate(model, prompt, n_new, draft_steps=1, second_depth=2, width=5,
                              draft_hook=hook)
        st, verifies = out.stats, n_new - 2  # every committed token but the prefill's and the last
        assert out.tokens == ref and st["drafted"] == calls[None]
        assert st["accepted"] + st["rescued"] + st["rejected"] == verifies, st
        if right:
            assert st["accepted"] == st["verified"] == verifies and st["acceptance"] == 1, st
            assert st["proposed"] == st["rescued"] == 0, st
        else:
            assert st["accepted"] == 0 == st["acceptance"] and st["rescued"] == verifies, st
            assert 0 < st["verified"] < verifies and st["proposed"] == calls[2], st


@pytest.mark.parametrize("kind,dtype", quick([(k, d) for k in FAMILIES[:3]
                                              for d in (torch.float64, torch.float16)],
                                             ("huginn", torch.float16)), ids=str)
def test_siblings_stop_at_eos_wherever_it_lies(kind, dtype):
    """A stop token committed from a draft, from a rescued sibling and from a restart: the
    output stops where AR's does."""
    model = model_of(kind, 1, dtype)
    T, V, prompt = model.num_steps, model.args.vocab_size, [5, 6, 7]
    k, m = 1, T - 1
    ref = engine.generate(model, prompt, 30, method="ar").tokens
    for i in (1, 6, 11, 17):
        eos = ref[i]
        out = siblings(model, prompt, 30, k, m, eos_token_id=eos,
                       draft_hook=forced(ref, prompt, V))
        assert out.tokens == ref[:ref.index(eos) + 1], i


@pytest.mark.parametrize("kind,dtype", quick([(k, d) for k in FAMILIES[:3]
                                              for d in (torch.float64, torch.bfloat16)],
                                             ("parcae", torch.bfloat16)), ids=str)
def test_batched_siblings_with_refill_equal_batched_ar(kind, dtype):
    """Five prompts through two slots, each prompt's tokens and logits batched AR's through the same
    calls, verifies forced in one prompt."""
    model = model_of(kind, 2, dtype)
    T, V = model.num_steps, model.args.vocab_size
    prompts = prompts_for(model, 5, 3)
    refs = engine.generate(model, prompts, 14, method="ar", batch_size=2, keep_logits=True)
    hook = lambda i, pos, token, depth=None: (forced(refs[1].tokens, prompts[1], V)(pos, token,
                                                                                   depth)
                                              if i == 1 else token)
    outs = engine.generate(model, prompts, 14, draft_steps=1, second_depth=T - 1, batch_size=2,
                           draft_hook=hook, keep_logits=True)
    same = engine.generate(model, prompts, 14, method="ar", draft_steps=1, second_depth=T - 1,
                           batch_size=2, width=outs[0].stats["width"], keep_logits=True)
    assert all(same_logits(o, r) for o, r in zip(outs, same))
    assert outs[1].stats["rescued"] > 0
    if dtype == torch.float64:
        assert [o.tokens for o in outs] == [r.tokens for r in refs]


# every family in float32, the first three in bfloat16 too
@pytest.mark.parametrize("kind,dtype", quick(
    [(k, torch.float32) for k in FAMILIES] + [(k, torch.bfloat16) for k in FAMILIES[:3]],
    ("huginn", torch.bfloat16)), ids=str)
def test_shared_kv_siblings_equal_shared_ar(kind, dtype):
    """With cross-recurrence KV sharing: a sibling's ring entries in its branch, its final-depth
    keys at its position once it won; against shared AR at the same width and window."""
    model = model_of(kind, 3, dtype)
    T, V, prompt = model.num_steps, model.args.vocab_size, [3, 1, 4, 1, 5]
    for k, m in depths(T):
        ref = engine.generate(model, prompt, 24, method="ar", draft_steps=k, kv="shared").tokens
        for hook in (None, forced(ref, prompt, V)):
            out = siblings(model, prompt, 24, k, m, kv="shared", draft_hook=hook)
            if hook:
                assert out.stats["rescued"] > 0


def test_a_branch_the_rows_built_on_it_read_and_a_winner_settles():
    """The branch columns at work: a sibling's keys land in its branch's column, not its
    position's, the rows built on it read them there, and when it retires having won they move to
    its position's column, where later rows read them (a wrong redirect or a missed settle changes
    the logits: the mutations of siblings.redirect and KVCache.settle fail here)."""
    model = model_of("huginn", 0, torch.float64)
    T, V, prompt = model.num_steps, model.args.vocab_size, [2, 7, 1, 8]
    ref = engine.generate(model, prompt, 24, method="ar").tokens
    settled, settle = [], kv_cache.KVCache.settle

    def counting(self, slot, branch, pos):
        settled.append((branch, pos))
        return settle(self, slot, branch, pos)
    kv_cache.KVCache.settle = counting
    try:
        out = siblings(model, prompt, 24, 1, T - 1, draft_hook=forced(ref, prompt, V))
    finally:
        kv_cache.KVCache.settle = settle
    assert out.tokens == ref and settled and out.stats["rescued"] >= len(settled) > 0


@pytest.mark.parametrize("kind,dtype", quick([(k, d) for k in FAMILIES for d in DTYPES[1:]],
                                             ("parcae", torch.float32), ("ouro", torch.bfloat16),
                                             ("loopformer", torch.float16)), ids=str)
def test_a_rows_bits_do_not_depend_on_its_lane(kind, dtype, monkeypatch):
    """What the second proposal rests on: a sibling computes in another lane than AR's row at its
    position, so a row's bits must not depend on its lane within a call of fixed shape. AR and WFD
    with every row moved on by 1 to 11 lanes give the same tokens and logits. 12 lanes, so that a
    call's per-lane tensors (12 rows x 4 heads) end in a part the CPU's vector loops take another
    way, over prompts that cross key blocks. (Parcae's value-embedding gate as a matmul, its
    sigmoid, and the blocks' merge by logaddexp each failed it.)"""
    model = model_of(kind, 4, dtype)
    T, prompt = model.num_steps, [3, 1, 4, 1, 5, 9]
    run = lambda method: engine.generate(model, prompt, 16, method=method, draft_steps=1, width=12,
                                         keep_logits=True)
    refs = {method: run(method) for method in ("ar", "wfd")}
    for shift in (1, 4, 7, 11):
        monkeypatch.setattr(model_runner.Decoder, "lane_of", lambda self,
                            pos: (pos + shift) % self.width)
        for method, ref in refs.items():
            assert same_logits(run(method), ref), (method, shift)


def moved(n, lane):
    """A permutation of n lanes that swaps lane 0 and `lane`."""
    perm = torch.arange(n)
    perm[0], perm[lane] = lane, 0
    return perm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_per_lane_ops_give_every_lane_the_same_bits(dtype):
    """The ops of a call that work on small per-lane tensors, at shapes whose last elements the
    CPU's vector loops take another way: the merge of the key blocks (6 lanes x 8 heads, 2 and 3
    blocks, eager) and Parcae's value-embedding gate (24 lanes x 2 heads): a row gives
    the same bits in every lane."""
    g = torch.Generator().manual_seed(0)
    n, heads, hd, b = 6, 8, 16, 16
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    for blocks in (2, 3):
        for trial in range(4):
            q = rand(n, heads, hd)
            ks, vs = rand(blocks, n, 4, b, hd), rand(blocks, n, 4, b, hd)
            last = torch.randint(0, blocks * b, (n, 1), generator=g)
            seen = torch.arange(blocks * b)[None] <= last
            call = lambda perm: kv_cache.attend_blocks(q[perm], [
                (ks[i][perm], vs[i][perm], kv_cache.mask(seen[perm, i * b:(i + 1) * b], dtype))
                for i in range(blocks)])
            ref = call(torch.arange(n))
            for lane in range(1, n):
                assert torch.equal(call(moved(n, lane))[lane], ref[0]), (blocks, lane)
    for trial in range(20):
        h, w = rand(24, VE_GATE_CHANNELS), rand(2, VE_GATE_CHANNELS)
        ref = value_gate(h, w)
        for lane in range(1, 24):
            assert torch.equal(value_gate(h[moved(24, lane)], w)[lane], ref[0]), (trial, lane)


@pytest.mark.parametrize("kind,dtype,capacity", quick(
    [("ouro", torch.bfloat16, 16), ("ouro", torch.bfloat16, 32), ("huginn", torch.float16, 32),
     ("parcae", torch.float32, 32)], ("ouro", torch.bfloat16, 16)), ids=str)
def test_compiled_siblings_compile_nothing_and_equal_compiled_ar(kind, dtype, capacity):
    """Compiled, after wfd.compile_graphs: the second proposal gives the tokens and logits of
    compiled AR through the same calls (every key block gathered through the branch columns, so
    that one set of graphs serves both), across 1 and 2 key blocks (and 4), verifies forced,
    greedy and sampled; the timed runs compile no graph."""
    model = model_of(kind, 7, dtype)
    T, V, prompt, n_new = model.num_steps, model.args.vocab_size, [5, 6, 7], capacity - 5
    k, m = 1, T - 1
    run = lambda method, **kw: engine.generate(model, prompt, n_new, method=method, draft_steps=k,
                                               second_depth=m, capacity=capacity, keep_logits=True,
                                               compile=True, **kw)
    assert engine.compile_graphs(model, prompt, n_new, method="ar", draft_steps=k, second_depth=m,
                                 capacity=capacity) > 0
    ref = run("ar")
    assert ref.stats["graphs_compiled"] == 0
    for sampling in (dict(), dict(temperature=0.8, seed=2)):
        ar = run("ar", **sampling) if sampling else ref
        out = run("wfd", draft_hook=forced(ref.tokens, prompt, V), **sampling)
        assert same_logits(out, ar) and out.stats["graphs_compiled"] == 0, sampling
        assert out.stats["rescued"] > 0 or sampling

    def at_block_starts(pos, token, depth=None):
        """Drafts wrong and second proposals right at a key block's first column, right
        elsewhere: the winning sibling there reads its own keys through its block's patch."""
        want = ref.tokens[pos - len(prompt)]
        return (want + 1) % V if pos % kv_cache.BLOCK == 0 and depth is None else want
    out = run("wfd", draft_hook=at_block_starts)
    assert same_logits(out, ref) and out.stats["rescued"] > 0
