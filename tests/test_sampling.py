"""Tests of sampling (sampling.choose): the hashed noise, the distribution it draws from, and every
schedule token-exact against AR sampling with the same seed."""
import json
import os

import pytest
import torch

import bench
import models
import run
import engine
from engine import sampling
from layers import noise
from test_engine import CASES, GOLDEN, exact, quick, tiny_config, tiny_model

torch.set_num_threads(1)

M32 = 0xFFFFFFFF
# each case samples under one of these, so that plain temperature and both filters are all covered
SETTINGS = [dict(temperature=0.8, seed=11), dict(temperature=1.3, top_k=5, seed=2),
            dict(temperature=1.0, top_k=20, top_p=0.8, seed=3 * 2**70)]


# bfloat16 rows computed in batches of different shapes may round differently and flip a token: the
# fixed-shape calls of spec section 8 make them exact
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def settings(seed):
    return SETTINGS[seed % len(SETTINGS)]


# -- the noise -------------------------------------------------------------------------------------

def lowbias32(x):
    """The hash in plain Python integers, which never overflow: what noise.mix32 must compute."""
    x ^= x >> 16
    x = x * 0x7FEB352D & M32
    x ^= x >> 15
    x = x * 0x846CA68B & M32
    return x ^ x >> 16


def test_mix32_is_lowbias32_on_the_whole_32_bit_range():
    xs = ([0, 1, 2, 0x7FFFFFFF, 0x80000000, 0x80000001, M32 - 1, M32]
          + list(range(12345, 2**32, 2**32 // 1000)))
    assert noise.mix32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]


def test_noise_is_a_function_of_seed_position_and_token_alone():
    for vocab in (37, 2048, 50257):
        pos = torch.tensor([0, 5, 6, 130, 2**31 - 1])
        batch = sampling.gumbel(noise.seed_key(4), pos, vocab)
        # bit for bit whichever batch the row comes in, and wherever in it
        for i in range(len(pos)):
            assert torch.equal(sampling.gumbel(noise.seed_key(4), pos[i:i + 1], vocab)[0], batch[i])
            assert torch.equal(
                sampling.gumbel(noise.seed_key(4), pos.flip(0), vocab)[len(pos) - 1 - i], batch[i])
        assert torch.equal(sampling.gumbel(noise.seed_key(4), pos, vocab + 5)[:, :vocab], batch)
        logits = torch.randn(len(pos), vocab, generator=torch.Generator().manual_seed(vocab))
        for s in SETTINGS:
            both = sampling.choose(logits, pos, sampling.Sampling(**s))
            alone = [int(sampling.choose(logits[i:i + 1], pos[i:i + 1], sampling.Sampling(**s))[0])
                     for i in range(len(pos))]
            assert both.tolist() == alone


def test_noise_uniforms_are_uniform_and_independent():
    pos = torch.arange(64)
    g = sampling.gumbel(noise.seed_key(0), pos, 2048)
    u = torch.exp(-torch.exp(-g))  # back to the hash's uniforms
    assert 0 < u.min() and u.max() < 1
    counts = torch.bincount((u * 100).long().flatten(), minlength=100)
    assert chi_square_p(counts, torch.full((100,), 0.01, dtype=torch.float64)) > 1e-6
    corr = lambda a, b: torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs()
    others = [u[:, 1:], u[1:, :]] + [
        torch.exp(-torch.exp(-sampling.gumbel(noise.seed_key(s), pos, 2048))) for s in (1, 2**40)]
    # neighbouring tokens, neighbouring positions, other seeds (a large one too)
    for other in others:
        assert corr(u[:other.shape[0], :other.shape[1]], other) < 0.02
    keys = [0, 1, 2**32, 2**32 + 1, 2**64, 2**40]  # large seeds do not wrap onto small ones
    draws = [sampling.gumbel(noise.seed_key(s), pos, 2048) for s in keys]
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1:])


# -- the distribution -----------------------------------------------------------------------------

def chi_square_p(counts, probs):
    """Pearson's chi-square p-value of observed counts against probabilities (all > 0)."""
    n = counts.sum()
    expected = n * probs
    x = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64),
                                         x / 2))


def expected_probs(logits, temperature, top_k=None, top_p=None):
    """softmax(logits / temperature) over the tokens the filters keep, written out plainly."""
    z = logits.double() / temperature
    order = sorted(range(len(z)), key=lambda v: -float(z[v]))
    kept = order[:top_k] if top_k else order
    p = torch.softmax(z[kept], 0)
    if top_p:
        total, n = 0.0, 0
        while total < top_p:
            total, n = total + float(p[n]), n + 1
        kept, p = kept[:n], torch.softmax(z[kept[:n]], 0)
    probs = torch.zeros(len(z), dtype=torch.float64)
    probs[kept] = p
    return probs


LOGITS = torch.linspace(-2.0, 1.5, 10)[
    torch.randperm(10, generator=torch.Generator().manual_seed(0))]
DRAWS = 3000


def first_tokens(sampling_args):
    """The token at one fixed position, drawn with seeds 0..DRAWS-1."""
    pos = torch.tensor([7])
    return torch.tensor([int(sampling.choose(LOGITS[None], pos,
                                        sampling.Sampling(**sampling_args, seed=s))[0])
                         for s in range(DRAWS)])


def sample_fits(tokens, probs):
    """No token outside the allowed set, and frequencies that fit `probs` by chi-square."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    allowed = probs > 0
    return (bool(counts[~allowed].sum() == 0)
            and chi_square_p(counts[allowed], probs[allowed]) > 1e-6)


@pytest.mark.parametrize("args", [dict(temperature=1.0), dict(temperature=0.6),
                                  dict(temperature=1.7), dict(temperature=1.0, top_k=4),
                                  dict(temperature=0.8, top_p=0.7),
                                  dict(temperature=1.2, top_k=6, top_p=0.8)])
def test_sampler_draws_from_the_filtered_softmax(args):
    probs = expected_probs(LOGITS, **args)
    assert sample_fits(first_tokens(args), probs)


def test_the_chi_square_check_catches_wrong_samplers(monkeypatch):
    assert not sample_fits(first_tokens(dict(temperature=1.0)),
                           expected_probs(LOGITS, 0.6))  # temperature ignored
    assert not sample_fits(first_tokens(dict(temperature=1.0)),
                           expected_probs(LOGITS, 1.0, top_k=4))  # no filter
    gumbel = sampling.gumbel
    monkeypatch.setattr(sampling, "gumbel",
                        lambda *a: torch.exp(-torch.exp(-gumbel(*a))))  # uniform noise
    assert not sample_fits(first_tokens(dict(temperature=1.0)), expected_probs(LOGITS, 1.0))


def test_temperature_zero_is_greedy_and_a_seed_gives_its_tokens():
    model = tiny_model("ouro", 3, torch.float32)
    prompt = [1, 2, 3]
    greedy = engine.generate(model, prompt, 30, keep_logits=True)
    assert greedy.tokens == [int(x.argmax()) for x in greedy.logits]
    assert engine.generate(model, prompt, 30, temperature=0.0, seed=5).tokens == greedy.tokens
    logits = torch.stack(greedy.logits)
    assert torch.equal(sampling.choose(logits, torch.arange(30), sampling.Sampling()),
                       logits.argmax(-1))
    runs = [engine.generate(model, prompt, 30, temperature=1.0, seed=s).tokens for s in (0, 0, 1)]
    assert runs[0] == runs[1] and runs[0] != runs[2] and runs[0] != greedy.tokens


def test_filters_never_emit_a_filtered_token():
    model = tiny_model("huginn", 4, torch.float32)
    prompt = [9, 9, 2]
    for seed in range(3):
        out = engine.generate(model, prompt, 40, temperature=2.0, top_k=3, seed=seed,
                              keep_logits=True)
        for tok, z in zip(out.tokens, out.logits):
            assert z[tok] >= z.topk(3).values[-1]
        out = engine.generate(model, prompt, 40, temperature=1.5, top_p=0.3, seed=seed,
                              keep_logits=True)
        assert any(int(z.argmax()) != t for t, z in zip(out.tokens, out.logits))  # it does sample
        for tok, z in zip(out.tokens, out.logits):
            assert expected_probs(z, 1.5, top_p=0.3)[tok] > 0


# -- every schedule gives AR's sampled tokens ------------------------------------------------------

@pytest.mark.parametrize("kind,seed,dtype", quick([(kind, seed, dtype) for kind, seed in CASES
                                                   for dtype in DTYPES],
                                                  ("ouro", 1, torch.bfloat16),
                                                  ("huginn", 0, torch.float16),
                                                  ("parcae", 2, torch.float32)), ids=str)
def test_sampled_wfd_and_dtv_equal_sampled_ar(kind, seed, dtype):
    """Every k, against sampled AR at the same width (tokens and logits); in float64 also the
    tokens of AR at its own width."""
    model = tiny_model(kind, seed, dtype)
    s, prompt, n_new = settings(seed), [4, 5, 6, 7][:1 + seed], 24
    ar = engine.generate(model, prompt, n_new, method="ar", **s)
    assert ar.stats["temperature"] == s["temperature"] and ar.stats["seed"] == s["seed"]
    for k in range(1, model.num_steps + 1):
        for method in ("wfd", "dtv"):
            out = exact(model, prompt, n_new, method, k, draft_len=1 + k % 3, **s)
            if dtype == torch.float64:
                assert out.tokens == ar.tokens, (method, k)


@pytest.mark.parametrize("kind,seed", quick(CASES[::2], ("ouro", 2)))
def test_sampled_forced_drafts_still_give_ar(kind, seed):
    model = tiny_model(kind, seed)
    s, prompt, n_new = settings(seed), [1, 2, 3, 4], 25
    ref = engine.generate(model, prompt, n_new, method="ar", **s).tokens
    at = lambda pos: ref[pos - len(prompt)]
    V, T = model.args.vocab_size, model.num_steps
    for k in range(1, T):
        for method in ("wfd", "dtv"):
            right = engine.generate(model, prompt, n_new, method=method, draft_steps=k,
                                    draft_hook=lambda p, t: at(p), **s)
            assert right.tokens == ref and right.stats["rejected"] == 0
            wrong = engine.generate(model, prompt, n_new, method=method, draft_steps=k,
                                    draft_hook=lambda p, t: (at(p) + 1) % V, **s)
            assert (wrong.tokens == ref and wrong.stats["accepted"] == 0
                    and wrong.stats["rejected"] > 0)
            some = engine.generate(model, prompt, n_new, method=method, draft_steps=k,
                                   draft_hook=lambda p, t: (at(p) + 1) % V if p % 3 == 0 else at(p),
                                   **s)
            assert some.tokens == ref and some.stats["accepted"] > 0 and some.stats["rejected"] > 0


@pytest.mark.parametrize("kind,seed", quick(CASES[1::2], ("ouro", 1)))
def test_sampled_eos_in_the_middle_of_a_wave(kind, seed):
    model = tiny_model(kind, seed)
    s, prompt = settings(seed), [5, 6, 7]
    ref = engine.generate(model, prompt, 30, method="ar", **s).tokens
    at = lambda pos: ref[pos - len(prompt)]
    for i in (0, 1, 7, 15):
        stop = ref.index(ref[i])
        for k in range(1, model.num_steps + 1):
            for method, hook in (("wfd", None), ("wfd", lambda p, t: at(p)),
                                 ("dtv", lambda p, t: at(p))):
                out = engine.generate(model, prompt, 30, method=method, draft_steps=k,
                                      eos_token_id=ref[i], draft_hook=hook, **s)
                assert out.tokens == ref[:stop + 1], (method, k, i)


@pytest.mark.parametrize("kind,seed,dtype", quick(
    [(kind, seed, dtype) for kind, seed in CASES[:2] + CASES[3:4] + CASES[6:7] for dtype in DTYPES],
    ("ouro", 1, torch.bfloat16)), ids=str)
def test_sampled_shared_kv_wfd_equals_shared_ar(kind, seed, dtype):
    model = tiny_model(kind, seed, dtype)
    s, prompt, n_new = settings(seed), [3, 1, 4, 1, 5][:1 + seed * 2], 24
    V = model.args.vocab_size
    for k in range(1, model.num_steps + 1):
        ar = engine.generate(model, prompt, n_new, method="ar", kv="shared", draft_steps=k, **s)
        at = lambda pos: ar.tokens[pos - len(prompt)]
        for hook in (None, lambda p, t: (at(p) + 1) % V,
                     lambda p, t: at(p) if p % 3 else (at(p) + 1) % V):
            out = engine.generate(model, prompt, n_new, kv="shared", draft_steps=k,
                                  draft_hook=hook, **s)
            assert out.tokens == ar.tokens, k


@pytest.mark.parametrize("name,steps,s", quick([("huginn_A", 8, SETTINGS[2]),
                                                 ("ouro_A", 4, SETTINGS[0]),
                                                 ("ouro_A", 4, SETTINGS[1]),
                                                 ("parcae_A", 4, SETTINGS[1])],
                                                ("ouro_A", 4, SETTINGS[0])))
def test_sampled_float32_goldens_every_method_and_depth(name, steps, s):
    model = models.load(GOLDEN[name])
    with open(os.path.join(GOLDEN[name], "golden.json")) as f:
        prompt = json.load(f)["prompt_ids"]
    ar = engine.generate(model, prompt, 24, method="ar", num_steps=steps, **s)
    for k in range(1, steps + 1):
        for method in ("wfd", "dtv"):
            out = engine.generate(model, prompt, 24, method=method, num_steps=steps,
                                  draft_steps=k, **s)
            assert out.tokens == ar.tokens, (method, k)


def test_sampling_arguments_are_checked():
    model = tiny_model("ouro", 0)
    cases = [(dict(temperature=-0.1), "temperature must be a finite number >= 0"),
             (dict(temperature=float("nan")), "temperature must be"),
             (dict(temperature=1.0, top_k=0), "top_k must be None or an integer >= 1"),
             (dict(temperature=1.0, top_k=2.5), "top_k must be"),
             (dict(temperature=1.0, top_p=0.0), r"top_p must be None or in \(0, 1\]"),
             (dict(temperature=1.0, top_p=1.5), "top_p must be"),
             (dict(top_k=5), "top_k and top_p need temperature > 0"),
             (dict(top_p=0.9), "top_k and top_p need temperature > 0"),
             (dict(temperature=1.0, seed=-1), "seed must be an integer >= 0"),
             (dict(temperature=1.0, seed=1.5), "seed must be")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate(model, [1, 2], 5, **kwargs)
    # the initial state's seed, folded by the same seed_key, whose shifts never end on a negative
    with pytest.raises(ValueError, match="seed must be an integer >= 0, not -1"):
        models.from_config(tiny_config("ouro", 0), seed=-1)


def test_logits_that_are_not_finite_are_refused():
    """A NaN or an inf in any one logit of a row read at full depth (the last entry's, the first's
    or another's), at the prefill or in the decode loop, stops generation with an error naming its
    position, greedy or sampled, rather than a token chosen from them."""
    vocab = tiny_model("ouro", 0).args.vocab_size
    for entry, value in ((vocab - 1, float("nan")), (0, float("inf")), (vocab // 3, -1e300)):
        model = tiny_model("ouro", 0)  # float64: -1e300 overflows the float32 logits to -inf
        model.lm_head.weight.data[entry] = 0
        model.lm_head.weight.data[entry, 0] = value
        for method, kwargs in (("ar", {}), ("wfd", dict(temperature=1.0, top_k=5, seed=3))):
            with pytest.raises(ValueError, match="the logits for position 2 are not finite"):
                engine.generate(model, [1, 2], 5, method=method, **kwargs)
    # in the decode loop: a NaN in the last logit of every read of the rows at position 4
    model = tiny_model("ouro", 0)
    c_state, head, lanes = model.c_state, model.head, []

    def reading(s, e, call):  # the positions of the read's lanes, for damaged
        lanes.append(call.lanes)
        return c_state(s, e, call)

    def damaged(h):  # in a decode read, every lane's logits (the prefill reads its last row alone)
        logits = head(h)
        if len(logits) == len(lanes[-1]):
            logits[lanes[-1] == 4, -1] = float("nan")
        return logits

    model.c_state, model.head = reading, damaged
    for method, kwargs in (("ar", {}), ("dtv", {}), ("wfd", dict(temperature=1.0, seed=3))):
        with pytest.raises(ValueError, match="the logits for position 5 are not finite"):
            engine.generate(model, [1, 2], 8, method=method, **kwargs)


# -- the command lines -----------------------------------------------------------------------------

def test_run_py_samples_the_same_text_with_every_method(capsys):
    run.main(["--model", GOLDEN["ouro_A"], "--prompt-ids", "1,2,3", "--max-new-tokens", "16",
              "--method", "all", "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95",
              "--seed", "7", "--json"])
    outs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(outs) == 5 and all(o["tokens"] == outs[0]["tokens"] for o in outs)
    assert all((o["stats"]["temperature"], o["stats"]["top_k"], o["stats"]["top_p"],
                o["stats"]["seed"]) == (0.9, 40, 0.95, 7) for o in outs)


def test_bench_py_samples_with_emulated_acceptance(capsys):
    bench.main(["--model", GOLDEN["ouro_A"], "--num-prompts", "2", "--prompt-len", "5",
                "--max-new-tokens", "12", "--warmup", "0", "--acceptance", "0.7",
                "--temperature", "1.0", "--top-p", "0.9", "--out", "", "--threads", "1"])
    text = capsys.readouterr().out
    assert "sampled at temperature 1.0, top-p 0.9, seed 0" in text
    table = [line for line in text[text.index("### overall"):].splitlines()
             if line.startswith("| ")][2:]
    assert table and all(line.split("|")[-3].strip() == "100%" for line in table)  # identical
