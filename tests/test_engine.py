"""Tests of the engine (engine/): every schedule equals AR at the same width, token for token and
logit for logit, in every dtype, on tiny random models and the goldens; shared KV; attention by
blocks. The goldens' fixtures and helpers here serve tests/test_models.py and the other files."""
import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

import engine
import models
from engine import kv_cache, model_runner
from kv import KVCache

torch.set_num_threads(1)  # the test models are tiny: a second thread only adds overhead

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
GOLDEN = {name: os.path.join(HERE, "tests", "testdata", name)
          for name in ("huginn_A", "ouro_A", "parcae_A")}


def golden(name):
    with open(os.path.join(GOLDEN[name], "golden.json")) as f:
        meta = json.load(f)
    return meta, load_file(os.path.join(GOLDEN[name], "golden.safetensors"))


def close(a, b, atol, rtol=1e-4):
    return torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol)


def cached_greedy(model, prompt, n_new, num_steps):
    """Greedy decode through the KV cache by hand (P, R x T, C per token): the logits that chose
    each token, for comparison with the official cached generation."""
    cache = KVCache(model, len(prompt) + n_new, num_steps)
    ids, pos = torch.tensor(prompt), torch.arange(len(prompt))
    out_logits, tokens = [], []
    for _ in range(n_new):
        s, e = model.P(ids, pos, cache)
        for d in range(num_steps):
            s = model.R(s, e, pos, d, cache)
        logits = model.C(s, e, pos, cache)[-1]
        out_logits.append(logits)
        tokens.append(int(logits.argmax()))
        ids, pos = torch.tensor(tokens[-1:]), pos[-1:] + 1
    return tokens, torch.stack(out_logits)


# -- parity with the official implementations ----------------------------------------------------

TOL = {"huginn_A": 2e-4, "ouro_A": 1e-4, "parcae_A": 1e-4}  # testdata/README.md: forward tensors
GENERATION = {  # golden: (T, greedy tokens, cached logits, no-cache logits, their tolerance)
    "huginn_A": (8, "tokens_generated", "gen_logits_cached_steps8", "gen_logits_nocache_steps8",
                 1e-3),
    "ouro_A": (4, "gen_cached_tokens", "gen_cached_logits", "gen_nocache_logits", 1e-4),
    "parcae_A": (4, "gen_tokens", "gen_logits_cached", "gen_logits_nocache", 1e-4),
}


def loaded(request, name):
    """The module's loaded golden model of that name (huginn_A -> the huginn fixture)."""
    return request.getfixturevalue(name.split("_")[0])


def recurrence_states(model, ids, steps, s0=None):
    """Per recurrence (the core's input, the raw state after it) through the P / R calls,
    without cache."""
    pos = torch.arange(len(ids))
    s, e = model.P(torch.tensor(ids), pos)
    s = s if s0 is None else s0
    inputs, states = [], []
    for d in range(steps):
        inputs.append(model.inject(s, e))
        s = model.R(s, e, pos, d)
        states.append(s)
    return e, torch.stack(inputs), torch.stack(states)


# -- decoding: every schedule equals greedy AR -----------------------------------------------------

# Parcae's (P, R, C, T, mean_backprop_depth): value embeddings in the core and the coda, as
# released; in the core only, the coda's table and gate left without each other; in each group,
# T = 3; T = 5
PARCAE_LAYOUTS = [(1, 2, 1, 4, 2), (1, 1, 2, 4, 2), (2, 2, 2, 3, 1), (1, 1, 2, 5, 2)]


def tiny_config(kind, seed):
    """A random small config of any family, in the official config.json format."""
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    if kind == "parcae":  # a vocabulary padded from 61 to 64
        P, R, C, T, depth = PARCAE_LAYOUTS[seed % len(PARCAE_LAYOUTS)]
        return dict(_class_name="ParcaeConfig", n_embd=32,
                    num_attention_heads=heads, num_key_value_heads=heads,
                    intermediate_size=64, recurrent_embedding_dimension=32,
                    recurrent_intermediation_embedding_dimension=48, vocab_size=61,
                    padding_multiple=16, n_layers_in_prelude=P, n_layers_in_recurrent_block=R,
                    n_layers_in_coda=C, mean_recurrence=T, mean_backprop_depth=depth, block_size=96,
                    norm_eps=1e-5, qk_norm=True, prelude_norm=True,
                    tie_embeddings=True, injection_type="diagonal", state_init="like-init",
                    rope_settings=dict(use_rope=True, rope_condense_ratio=1, rope_base=50000))
    if kind == "ouro":
        return dict(model_type="ouro", hidden_size=32, num_attention_heads=heads,
                    num_key_value_heads=rng.choice([1, heads]), head_dim=8, intermediate_size=48,
                    vocab_size=rng.choice([37, 64]), num_hidden_layers=rng.choice([1, 2]),
                    total_ut_steps=rng.choice([3, 4, 6]), rope_theta=10000.0, rms_norm_eps=1e-6,
                    max_position_embeddings=96, tie_word_embeddings=False)
    return dict(model_type="huginn_raven", n_embd=32, n_heads=heads, intermediate_size=48,
                vocab_size=64, padded_vocab_size=64, n_layers_in_prelude=1,
                n_layers_in_recurrent_block=rng.choice([1, 2]), n_layers_in_coda=1,
                mean_recurrence=rng.choice([4, 5, 8]), rope_base=50000.0, norm_eps=1e-6,
                block_size=96, qk_bias=True, tie_embeddings=True)


# WFD_TEST_DEVICE=cuda builds the decoding tests' models on a GPU (gpu_check.sh); the golden files
# stay on the CPU
DEVICE = os.environ.get("WFD_TEST_DEVICE", "cpu")


def tiny_model(kind, seed, dtype=torch.float64):
    return models.from_config(tiny_config(kind, seed), device=DEVICE, dtype=dtype,
                              state_init="random", seed=seed, init_seed=seed)


CASES = [(kind, seed) for kind in ("ouro", "huginn", "parcae") for seed in (0, 1, 2)]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def quick(params, *chosen):
    """A parametrize list with every entry but the chosen ones marked slow: the quick suite checks a
    claim on a few cases (each family, each reduced precision somewhere), the whole suite on all."""
    return [p if p in chosen
            else pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=pytest.mark.slow)
            for p in params]


def same_logits(a, b):
    """Tokens, and the logits behind them, bit for bit: a wrong KV read or a different rounding
    often leaves the greedy token unchanged."""
    return a.tokens == b.tokens and torch.equal(torch.stack(a.logits), torch.stack(b.logits))


def exact(model, prompt, n_new, method, k, draft_len=4, **kw):
    """A schedule's output, checked against its exact reference: AR at the same width (and, for
    shared KV, the same window)."""
    out = engine.generate(model, prompt, n_new, method=method, draft_steps=k, draft_len=draft_len,
                          keep_logits=True, **kw)
    kw.pop("draft_hook", None)
    ref = engine.generate(model, prompt, n_new, method="ar", draft_steps=k,
                          width=out.stats["width"],
                          keep_logits=True, **kw)
    assert same_logits(out, ref), (method, k, model.dtype)
    return out


@pytest.mark.parametrize("kind,seed,dtype", quick(
    [(kind, seed, torch.float64) for kind, seed in CASES]
    + [(kind, seed, dtype) for kind, seed in CASES[::2] for dtype in DTYPES[1:]],
    ("ouro", 2, torch.float16), ("huginn", 1, torch.bfloat16),
    ("parcae", 2, torch.bfloat16)), ids=str)
def test_wfd_and_dtv_equal_ar_at_every_draft_depth(kind, seed, dtype):
    model = tiny_model(kind, seed, dtype)
    T = model.num_steps
    rng = random.Random(seed)
    for n_prompt, n_new in [(1, 1), (1, 2), (rng.randint(2, 9), 30)]:
        prompt = [rng.randrange(model.args.vocab_size) for _ in range(n_prompt)]
        ar = engine.generate(model, prompt, n_new, method="ar", width=1)
        assert len(ar.tokens) == n_new and ar.stats["r_calls"] == T * n_new
        for k in range(1, T + 1):
            for method in ("wfd", "dtv"):
                out = exact(model, prompt, n_new, method, k, draft_len=1 + k % 3)
                # rounding too small to flip a token: 1-row AR's tokens too
                if dtype == torch.float64:
                    assert out.tokens == ar.tokens, (method, k, n_prompt)


def ar_reference(model, prompt, n_new, k=None):
    """AR's tokens (at the width of draft depth k), and a lookup of AR's token at an
    absolute position."""
    ref = engine.generate(model, prompt, n_new, method="ar", draft_steps=k).tokens
    return ref, lambda pos: ref[pos - len(prompt)]


@pytest.mark.parametrize("kind,seed,dtype", quick([(kind, seed, dtype) for kind, seed in CASES[::2]
                                                   for dtype in (torch.float64, torch.float16)],
                                                  ("ouro", 2, torch.float16)), ids=str)
def test_forced_wrong_drafts_still_give_ar(kind, seed, dtype):
    model = tiny_model(kind, seed, dtype)
    prompt, n_new = [1, 2, 3, 4], 25
    V, T = model.args.vocab_size, model.num_steps
    for k in range(1, T):
        ref, at = ar_reference(model, prompt, n_new, k)
        every = lambda pos, tok: (at(pos) + 1) % V                      # every draft wrong
        some = lambda pos, tok: ((at(pos) + 1) % V if pos % 3 == 0      # wrong at chosen positions
                                 else at(pos))
        for method in ("wfd", "dtv"):
            out = exact(model, prompt, n_new, method, k, draft_hook=every)
            assert out.stats["accepted"] == 0 and out.stats["rejected"] > 0
            out = exact(model, prompt, n_new, method, k, draft_hook=some)
            assert out.stats["accepted"] > 0 and out.stats["rejected"] > 0
            wrong = sum(1 for p in range(len(prompt) + 1, len(prompt) + n_new) if p % 3 == 0)
            if method == "wfd":  # every wrong draft is verified and caught
                assert out.stats["rejected"] == wrong


@pytest.mark.parametrize("kind", quick(["ouro", "huginn", "parcae"], "ouro"))
def test_r_calls_match_the_schedule_at_both_extremes(kind):
    model = tiny_model(kind, 5)
    prompt, M = [7, 8, 9], 20
    ref, at = ar_reference(model, prompt, M)
    V, T = model.args.vocab_size, model.num_steps
    for k in range(1, T + 1):
        right = engine.generate(model, prompt, M, draft_steps=k, draft_hook=lambda pos,
                                tok: at(pos))
        # prefill T; the first decoded token after T ticks, then one every k ticks
        assert right.tokens == ref and right.stats["r_calls"] == T + T + (M - 2) * k
        assert right.stats["acceptance"] == 1.0 or k == T
        wrong = engine.generate(model, prompt, M, draft_steps=k,
                                draft_hook=lambda pos, tok: (at(pos) + 1) % V)
        # every draft rejected: a restart per token, T ticks each, as AR
        assert wrong.tokens == ref and wrong.stats["r_calls"] == T * M
    ar = engine.generate(model, prompt, M, method="ar")
    full = engine.generate(model, prompt, M, draft_steps=T)  # draft depth T is AR
    assert full.tokens == ar.tokens and full.stats["r_calls"] == ar.stats["r_calls"] == T * M


@pytest.mark.parametrize("kind,seed,dtype", quick([(kind, seed, dtype) for kind, seed in CASES[1::2]
                                                   for dtype in (torch.float64, torch.float16)],
                                                  ("ouro", 1, torch.float16)), ids=str)
def test_eos_in_the_middle_of_a_wave(kind, seed, dtype):
    model = tiny_model(kind, seed, dtype)
    prompt = [5, 6, 7]
    for k in range(1, model.num_steps + 1):
        ref, at = ar_reference(model, prompt, 30, k)
        for i in (0, 1, 7, 15):
            eos = ref[i]
            stop = ref.index(eos)  # AR stops at the first occurrence
            for method, hook in (("wfd", None), ("wfd", lambda pos, tok: at(pos)),
                                 ("dtv", lambda pos, tok: at(pos))):
                out = exact(model, prompt, 30, method, k, draft_len=3, eos_token_id=eos,
                            draft_hook=hook)
                assert out.tokens == ref[:stop + 1], (method, k, i)


@pytest.mark.parametrize("kind,seed", [("ouro", 0), ("huginn", 1)])
def test_a_collection_of_stop_ids_stops_at_the_first_of_them(kind, seed):
    """Real checkpoints stop at several ids (end of text, end of turn): every method stops where AR
    does, at the first of them, whichever row of a wave commits it, and exactly
    (tokens and logits)."""
    model = tiny_model(kind, seed, torch.float32)
    prompt, V = [5, 6, 7], model.args.vocab_size
    for k in (1, model.num_steps - 1):  # the widest wave, and one of two rows
        ref, at = ar_reference(model, prompt, 20, k)
        # its own AR
        shared = engine.generate(model, prompt, 20, method="ar", draft_steps=k, kv="shared").tokens
        absent = next(t for t in range(V) if t not in ref + shared)
        for (i, j), form in zip(((0, 3), (12, 4), (16, 7)), (list, tuple, set)):
            for method, hook, sharing, want in (("ar", None, "full", ref),
                                           ("wfd", None, "full", ref),
                                           ("wfd", lambda p, t: at(p), "full", ref),
                                           ("dtv", lambda p, t: at(p), "full", ref),
                                           ("wfd", None, "shared", shared)):
                eos = form([absent, want[i], want[j]])
                first = min(p for p, t in enumerate(want) if t in eos)
                out = exact(model, prompt, 20, method, k, draft_len=3, eos_token_id=eos,
                            draft_hook=hook, kv=sharing)
                assert (out.tokens == want[:first + 1]
                        and out.stats["stop_token"] == want[first]), (method, k, eos)
    out = engine.generate(model, prompt, 20, draft_steps=k, eos_token_id=absent)
    assert (out.tokens == ref and out.stats["stop_token"] is None
            and out.stats["eos_token_ids"] == [absent])


@pytest.mark.parametrize("name,steps", quick([("huginn_A", 8), ("huginn_A", 4), ("ouro_A", 4),
                                              ("parcae_A", 4), ("parcae_A", 6)],
                                             ("huginn_A", 4), ("ouro_A", 4), ("parcae_A", 4)))
def test_float32_goldens_every_method_and_depth(name, steps, request):
    model, (meta, g) = loaded(request, name), golden(name)
    T, tokens = GENERATION[name][:2]
    ar = engine.generate(model, meta["prompt_ids"], 24, method="ar", num_steps=steps)
    if steps == T:
        assert ar.tokens == g[tokens].tolist()
    for k in range(1, steps + 1):
        for method in ("wfd", "dtv"):
            out = engine.generate(model, meta["prompt_ids"], 24, method=method, num_steps=steps,
                                  draft_steps=k)
            assert out.tokens == ar.tokens, (method, k)


def test_bad_input_gives_clear_errors(ouro):
    with pytest.raises(ValueError, match=r"draft depth 0 is out of range: it must be in 1\.\.4"):
        engine.generate(ouro, [1, 2], 5, draft_steps=0)
    with pytest.raises(ValueError, match=r"draft depth 5 is out of range"):
        engine.generate(ouro, [1, 2], 5, method="dtv", draft_steps=5)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        engine.generate(ouro, [1, 2], 0)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate(ouro, [], 5)
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        engine.generate(ouro, [1] * 200, 57)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(ouro, [1, 128], 5)
    with pytest.raises(ValueError,
                       match="width 1 is too small: wfd needs at least 4 rows per call"):
        engine.generate(ouro, [1], 5, draft_steps=1, width=1)
    with pytest.raises(ValueError,
                       match="width 4 is too small: dtv needs at least 5 rows per call"):
        engine.generate(ouro, [1], 5, method="dtv", width=4)
    with pytest.raises(ValueError, match=r"capacity 5 must hold the prompt and the new tokens "
                       r"but the last \(6\)"):
        engine.generate(ouro, [1, 2], 5, capacity=5)
    with pytest.raises(ValueError, match="method must be"):
        engine.generate(ouro, [1], 5, method="beam")
    for settings, message in ((dict(kv="paged"), "kv must be 'full' or 'shared', not 'paged'"),
                              (dict(method="dtv", draft_len=0), "draft_len must be at least 1"),
                              (dict(draft_steps=1, second_depth=4), r"second depth 4 is out of "
                               r"range: it must lie between the draft depth 1 and the full "
                               r"depth 4 \(k < m < T\)"),
                              (dict(method="dtv", draft_steps=1, second_depth=2),
                               "second_depth is the wavefront's second proposal"),
                              (dict(compile=1), "compile must be True or False, not 1")):
        with pytest.raises(ValueError, match=message):
            engine.generate(ouro, [1], 5, **settings)
    with pytest.raises(ValueError, match="state_init must be 'random' or 'zero', not 'ones'"):
        models.load(GOLDEN["ouro_A"], state_init="ones")
    with pytest.raises(ValueError, match="257 positions exceed the model's context of 256"):
        ouro.logits([1] * 257)
    with pytest.raises(ValueError, match="an explicit initial state is only defined for Huginn"):
        ouro.logits([1, 2], state=torch.zeros(2, 64))
    with pytest.raises(ValueError, match="a call of 3 lanes cannot split evenly over 2 sequences"):
        kv_cache.make_cache(ouro, 8, 4, batch=2).prepare(
            model_runner.Call(torch.tensor([0, 1, 2]), 0, None, span=1))
    for eos, message in (("2", "not '2'"), (2.0, "not 2.0"), ([1, "2"], "holds '2'"),
                         ([True], "holds True"),
                         ([1, 128], "eos_token_id 128 is outside the vocabulary"),
                         (-1, "eos_token_id -1 is outside")):
        with pytest.raises(ValueError, match=message):
            engine.generate(ouro, [1], 5, eos_token_id=eos)
    with pytest.raises(ValueError, match=r"state has shape \(3, 64\), expected \(2, 64\)"):
        models.load(GOLDEN["huginn_A"]).logits([1, 2], state=torch.zeros(3, 64))
    cache = kv_cache.KVCache(ouro, capacity=4)
    with pytest.raises(IndexError, match="position 4 is past the KV cache's capacity of 4"):
        model_runner.to_device(ouro, torch.tensor([4]), 0, cache)


def test_prompt_forms(ouro):
    want = engine.generate(ouro, [1, 2, 3], 4).tokens
    for prompt in ((1, 2, 3), torch.tensor([1, 2, 3]), torch.tensor([[1, 2, 3]]),
                   np.array([1, 2, 3])):
        assert engine.generate(ouro, prompt, np.int64(4)).tokens == want
    refused = [("abc", TypeError, "not text"), ([1.0, 2.0], TypeError, "integers, not float"),
               ([True, False], TypeError, "integers, not bool"),
               (torch.tensor([[1, 2], [3, 4]]), ValueError, r"shape \[2, 2\]"),
               (5, ValueError, "one sequence of token ids"),
               (Tokenizer.from_file(os.path.join(HERE, "demo", "tokenizer.json")).encode("x"),
                TypeError, r"Encoding: pass its \.ids")]
    for prompt, error, message in refused:
        with pytest.raises(error, match=message):
            engine.generate(ouro, prompt, 4)
    with pytest.raises(TypeError, match="max_new_tokens must be an integer"):
        engine.generate(ouro, [1, 2], 4.0)


def test_non_finite_logits_are_refused():
    model = tiny_model("ouro", 0)
    model.lm_head.weight[5] = float("inf")
    for method in ("ar", "wfd", "dtv"):
        with pytest.raises(ValueError, match="logits for position 3 are not finite"):
            engine.generate(model, [1, 2, 3], 4, method=method)


# -- exact cross-recurrence KV sharing -------------------------------------------------------------

@pytest.mark.parametrize("kind,seed,dtype", quick(
    [(kind, seed, torch.float64) for kind, seed in CASES if seed < 2]
    + [(kind, seed, dtype) for kind, seed in CASES[1::2] for dtype in DTYPES[2:]],
    ("ouro", 1, torch.bfloat16)), ids=str)
def test_shared_kv_wfd_equals_shared_ar(kind, seed, dtype):
    model = tiny_model(kind, seed, dtype)
    prompt, n_new = [3, 1, 4, 1, 5][:1 + seed * 2], 30
    V = model.args.vocab_size
    for k in range(1, model.num_steps + 1):
        ar = engine.generate(model, prompt, n_new, method="ar", kv="shared", draft_steps=k,
                             keep_logits=True)
        at = lambda pos: ar.tokens[pos - len(prompt)]
        # natural drafts, all wrong, wrong at chosen positions
        hooks = [None, lambda pos, tok: (at(pos) + 1) % V,
                 lambda pos, tok: at(pos) if pos % 3 else (at(pos) + 1) % V]
        for hook in hooks:
            out = engine.generate(model, prompt, n_new, kv="shared", draft_steps=k, draft_hook=hook,
                                  keep_logits=True)
            assert same_logits(out, ar), (k, hook)
        eos = ar.tokens[n_new // 2]
        stop = ar.tokens.index(eos)
        out = engine.generate(model, prompt, n_new, kv="shared", draft_steps=k, eos_token_id=eos,
                              draft_hook=lambda pos, tok: at(pos))
        assert out.tokens == ar.tokens[:stop + 1]


@pytest.mark.parametrize("kind", ["ouro", "huginn", "parcae"])
def test_shared_kv_with_a_window_over_everything_is_full_kv(kind):
    model = tiny_model(kind, 7)
    prompt, n_new = [9, 8, 7], 25
    full = engine.generate(model, prompt, n_new, method="ar", keep_logits=True)
    for method in ("ar", "wfd"):
        out = engine.generate(model, prompt, n_new, method=method, kv="shared",
                              window=len(prompt) + n_new, keep_logits=True)
        assert out.tokens == full.tokens
        assert torch.allclose(torch.stack(out.logits), torch.stack(full.logits), atol=1e-9)


@pytest.mark.parametrize("name,steps",
                         quick([("huginn_A", 8), ("ouro_A", 4), ("parcae_A", 4)], ("ouro_A", 4)))
def test_shared_kv_float32_goldens(name, steps, request):
    model, (meta, _) = loaded(request, name), golden(name)
    for k in range(1, steps + 1):
        ar = engine.generate(model, meta["prompt_ids"], 24, method="ar", num_steps=steps,
                             draft_steps=k, kv="shared")
        out = engine.generate(model, meta["prompt_ids"], 24, num_steps=steps, draft_steps=k,
                              kv="shared")
        assert out.tokens == ar.tokens, k


def test_shared_kv_memory_is_at_least_10x_smaller():
    config = dict(tiny_config("huginn", 0), mean_recurrence=32, block_size=2048)
    model = models.from_config(config, init_seed=0)
    full = kv_cache.KVCache(model, capacity=1024, num_steps=32)
    shared = kv_cache.SharedKVCache(model, capacity=1024, num_steps=32, window=8)
    allocated = lambda c: sum(t.nbytes for t in vars(c).values() if torch.is_tensor(t))
    assert allocated(full) == full.nbytes and allocated(shared) == shared.nbytes
    assert full.nbytes >= 10 * shared.nbytes


def test_shared_kv_refuses_what_it_cannot_do_exactly(ouro):
    with pytest.raises(ValueError, match="not exact for draft-then-verify"):
        engine.generate(ouro, [1, 2], 5, method="dtv", kv="shared")
    with pytest.raises(ValueError,
                       match=r"window 1 is narrower than the wavefront \(ceil\(T/k\) = 4 rows\)"):
        engine.generate(ouro, [1, 2], 5, kv="shared", draft_steps=1, window=1)
    with pytest.raises(ValueError, match="window only applies to kv='shared'"):
        engine.generate(ouro, [1, 2], 5, window=3)


# -- attention by blocks ---------------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 3], ids=["full", "shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blocks_only_other_rows_see_change_no_bit(window, dtype):
    """A row's attention alone, and beside a row that sees 5 more key blocks, bit for bit: at a
    looped layer (per-depth slots, or the shared cache's window and final blocks) and at the coda
    (one slot for all rows). The row sees 6 blocks, so that their merge adds more than two terms
    (a sum over a stacked block dimension adds them in an order that depends on the call's 6 or 11
    blocks: it fails this test in float32)."""
    model = tiny_model("huginn", 1, dtype)
    a, B = model.args, kv_cache.BLOCK
    cache = kv_cache.make_cache(model, 12 * B, model.num_steps, window)
    p = 5 * B + 3  # the row sees six blocks

    def first_row(other, layer, depth):
        pos = torch.tensor([p, other])
        span = cache.span(max(p, other))
        step = cache.prepare(model_runner.Call(pos, depth, cache, span=span))
        return cache.attend(step, layer, q, k, v)[0], span

    for trial in range(8):
        g = torch.Generator().manual_seed(trial)
        for t in cache.buffers():
            t.copy_(torch.randn(t.shape, generator=g))
        q = torch.randn(2, a.n_heads, a.head_dim, generator=g).to(dtype)
        k, v = (torch.randn(2, a.n_kv_heads, a.head_dim, generator=g).to(dtype) for _ in range(2))
        for layer, depth in [(0, torch.tensor([2, 1])), (a.n_core, None)]:
            alone, span = first_row(-1, layer, depth)  # beside an idle lane
            beside, wider = first_row(p + 5 * B, layer, depth)
            assert (span, wider) == (6, 11) and torch.equal(alone, beside), (trial, layer)


@pytest.mark.parametrize("sums", [False, True], ids=["eager", "sums"])
def test_merging_blocks_costs_bfloat16_no_accuracy(sums):
    """The merge runs in float32 whatever the blocks' dtype: in bfloat16, attention read in 6 blocks
    is within 3x the error (against float64, from the same inputs) of one SDPA call over every key.
    A merge in bfloat16 stays exact against AR but lands 4x-12x off."""
    B, blocks = 8, 6
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        q = (2 * torch.randn(4, 4, 16, generator=g)).bfloat16()  # 4 rows, 4 heads on 2 kv heads
        k, v = (torch.randn(4, 2, blocks * B, 16, generator=g).bfloat16() for _ in range(2))
        last = torch.tensor([[blocks * B - 1], [blocks * B - 5], [3 * B + 2], [B + 1]])
        visible = torch.arange(blocks * B)[None] <= last
        kd, vd = (t.double().repeat_interleave(2, 1) for t in (k, v))
        scores = torch.einsum("nhd,nhbd->nhb", q.double(), kd) * 16 ** -0.5
        probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
        truth = torch.einsum("nhb,nhbd->nhd", probs, vd)
        error = lambda y: (y.double() - truth).abs().max()
        one_call = kv_cache.block_attention(q, k, v, kv_cache.mask(visible, k.dtype),
                                            need_lse=False,
                                      sums=False)[0]
        merged = kv_cache.attend_blocks(q, [(k[:, :, lo:lo + B], v[:, :, lo:lo + B],
                                       kv_cache.mask(visible[:, lo:lo + B], k.dtype))
                                      for lo in range(0, blocks * B, B)], sums)
        assert error(merged) <= 3 * error(one_call), seed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_masked_columns_add_nothing_whatever_they_hold(dtype):
    """Each row's output, eager (SDPA) and compiled's sums, one block and merged blocks, is bit for
    bit the same whether the columns it cannot see hold zeros, inf or NaN, keys and values alike:
    what they hold differs between schedules (a dropped draft's key, another row's, stale KV), and
    0 * inf would be NaN."""
    B, blocks, g = 8, 3, torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, 16, generator=g).to(dtype)  # 4 rows, 4 heads on 2 kv heads
    k, v = (torch.randn(4, 2, blocks * B, 16, generator=g).to(dtype) for _ in range(2))
    # rows that see different columns: what one row cannot see, another can
    last = torch.tensor([[blocks * B - 1], [B + 2], [3], [2 * B]])
    visible = torch.arange(blocks * B)[None] <= last
    hidden = ~visible[:, None, :, None]

    def attend(fill_k, fill_v, sums):
        kk, vv = k.masked_fill(hidden, fill_k), v.masked_fill(hidden, fill_v)
        one = kv_cache.block_attention(q, kk, vv, kv_cache.mask(visible, dtype), need_lse=True,
                                       sums=sums)
        merged = kv_cache.attend_blocks(q, [(kk[:, :, lo:lo + B], vv[:, :, lo:lo + B],
                                       kv_cache.mask(visible[:, lo:lo + B], dtype))
                                      for lo in range(0, blocks * B, B)], sums)
        return one[0], one[1], merged

    for sums in (False, True):
        clean = attend(0.0, 0.0, sums)
        assert all(t.isfinite().all() for t in clean)
        for fill_k, fill_v in ((float("inf"), float("nan")), (float("nan"), float("inf")),
                               (float("-inf"), float("inf"))):
            got = attend(fill_k, fill_v, sums)
            assert all(torch.equal(a, b) for a, b in zip(got, clean)), (sums, fill_k, fill_v)


def poison_masked_columns(monkeypatch):
    """Before every R and C call after the prefill (of one sequence), the key columns past every
    row in flight, up to the end of the blocks the call reads, hold inf in the keys and NaN in the
    values, in every layer and slot: no row sees them before a row there writes them. (The rows in
    flight lie within `width` positions, the call's lanes, from the call's first row.)"""
    to_device = model_runner.to_device

    def poisoned(model, pos, depth, cache, compiled=False, top=None):
        call = to_device(model, pos, depth, cache, compiled, top)
        if call.span and len(pos) > 1:
            start, end = int(pos[pos >= 0].min()) + len(pos), call.span * cache.block
            for name, fill in (("k", "inf"), ("v", "nan"), ("final_k", "inf"),
                               ("final_v", "nan")):
                if hasattr(cache, name):
                    getattr(cache, name)[:, :, start:end] = float(fill)
        return call
    monkeypatch.setattr(model_runner, "to_device", poisoned)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_poisoned_masked_columns_still_give_ar(dtype, monkeypatch):
    """The columns no row of a call can see hold inf and NaN at every call: every schedule still
    gives clean AR's tokens and logits (Huginn: prelude, core and coda attend; full and shared KV;
    wrong drafts forced, so that dropped rows leave their keys behind)."""
    model = tiny_model("huginn", 1, dtype)
    prompt, n_new, T, V = [3, 1, 4, 1, 5], 20, model.num_steps, model.args.vocab_size
    runs = [dict(method="wfd", draft_steps=k, draft_hook=lambda pos, tok: (tok + pos % 2) % V)
            for k in (1, T // 2)] + [dict(method="dtv", draft_steps=1, draft_len=2),
                                     dict(method="wfd", draft_steps=2, kv="shared")]
    clean = [engine.generate(model, prompt, n_new, keep_logits=True, **run) for run in runs]
    refs = [engine.generate(model, prompt, n_new, method="ar", keep_logits=True,
                            draft_steps=run["draft_steps"], width=out.stats["width"],
                            kv=run.get("kv", "full")) for run, out in zip(runs, clean)]
    poison_masked_columns(monkeypatch)
    for run, ref in zip(runs, refs):
        out = engine.generate(model, prompt, n_new, keep_logits=True, **run)
        assert same_logits(out, ref), run


@pytest.mark.parametrize("kind", quick(["ouro", "huginn", "parcae"], "huginn"))
def test_eager_decoding_runs_on_fused_attention_kernels_alone(kind):
    """Every attention call takes SDPA's fused kernels (4-D inputs; the prefill is_causal), none the
    math path that builds the score matrix: flash alone on a CPU, flash and memory-efficient
    on CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fused = [SDPBackend.FLASH_ATTENTION] + ([SDPBackend.EFFICIENT_ATTENTION] if DEVICE == "cuda"
                                            else [])
    model = tiny_model(kind, 0, torch.float32)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    runs = [dict(method=m) for m in ("ar", "wfd", "dtv")] + [dict(kv="shared")]
    refs = [engine.generate(model, prompt, 20, keep_logits=True, **run) for run in runs]
    with sdpa_kernel(fused):
        outs = [engine.generate(model, prompt, 20, keep_logits=True, **run) for run in runs]
        logits = model.logits(prompt)
    assert all(same_logits(out, ref) for out, ref in zip(outs, refs))
    assert torch.equal(logits, model.logits(prompt))
