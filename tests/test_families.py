"""Tests of LoopFormer and the Raven retrofits: parity with the official code (tests/testdata/
loopformer_A and raven_A, see its README's sections 4 and 5), every schedule exact against AR
(tokens and logits, bit for bit) in every dtype, and a second layout of each family built with
random weights, saved in the hub's format, reloaded and checked against a reference forward
from the specs."""
import json
import math
import os
import random
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer, models as tok_models
from tokenizers.pre_tokenizers import Whitespace

import engine
import models
from engine import kv_cache
from formats import checkpoints, configs
from layers import transformer
from host_reads import HostReads
from test_batch import check_against_batched_ar, prompts_for
from test_engine import (DEVICE, DTYPES, cached_greedy, close, exact, quick, same_logits,
                         tiny_model)

torch.set_num_threads(1)

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = {name: os.path.join(HERE, "testdata", name) for name in ("loopformer_A", "raven_A")}


def golden(name):
    with open(os.path.join(GOLDEN[name], "golden.json")) as f:
        meta = json.load(f)
    return meta, load_file(os.path.join(GOLDEN[name], "golden.safetensors"))


@pytest.fixture(scope="module")
def loopformer():
    return models.load(GOLDEN["loopformer_A"])


@pytest.fixture(scope="module")
def raven():
    return models.load(GOLDEN["raven_A"], state_init="zero")


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# -- LoopFormer: parity with the official code -----------------------------------------------------

def clock_times(model, n):
    """t of the full-depth schedule's first n iterations, summed in the model's dtype (as R's)."""
    dt = torch.full((1,), 1 / model.args.num_steps, dtype=model.dtype)
    ts = [torch.zeros_like(dt)]
    for _ in range(n - 1):
        ts.append(ts[-1] + dt)
    return torch.cat(ts), dt.expand(n)


def run_schedule(model, ids, steps):
    """LoopFormer's forward over any list of step sizes (t the sum of the earlier ones): the logits
    after each iteration. R serves the full-depth schedule only; this reads the blocks directly."""
    pos = torch.arange(len(ids))
    x, _ = model.P(torch.tensor(ids), pos)
    t, out = torch.zeros(1), []
    for dt in steps:
        mod = model.modulation(t, torch.tensor([dt]))[0]  # [L, 4D]
        x = model._layers(model.core, x, models.Call(pos, None), mod=mod)
        t = t + dt
        out.append(model.C(x, None, pos))
    return out


def test_loopformer_forward_matches_golden(loopformer):
    meta, g = golden("loopformer_A")
    m, ids, T = loopformer, meta["prompt_ids"], meta["max_model_loops"]
    tol = dict(atol=1e-4)  # README 4: states, conditioning, modulation allclose; logits max abs
    assert m.num_steps == T == 8 and m.eos_token_ids == ()  # no tokenizer here: no stop id
    pos = torch.arange(len(ids))
    x0, _ = m.P(torch.tensor(ids), pos)
    assert close(x0, g["embed"], **tol)
    t, dt = clock_times(m, T)
    assert close(m.clock.time(m.clock.features(t)), g["time_emb_per_step"], **tol)
    assert close(m.clock.step(m.clock.features(dt[:1]))[0], g["dt_emb"], **tol)
    assert close(m.clock(t, dt), g["cond_per_step"], **tol)
    table = m.clock_table(T)
    assert close(table.unflatten(-1, (4, -1)), g["modulation_per_step"], **tol)
    block0 = m.core[0](x0, *m.rope(pos), kv_cache.causal_attention, None, table[0, 0])
    assert close(block0, g["block0_step1_out"], **tol)
    s, states, logits = x0, [], []
    for d in range(T):
        s = m.R(s, None, pos, d)
        states.append(s)
        logits.append(m.C(s, None, pos))
    assert close(torch.stack(states), g["state_per_step"], **tol)
    assert max_err(torch.stack(logits), g["logits_per_step"]) < 1e-4
    assert max_err(m.logits(ids), g["logits"]) < 1e-4  # the default depth: max_model_loops
    assert max_err(m.logits(ids), g["logits_default_forward"]) < 1e-4
    assert close(transformer.rms_norm(states[-1], m.norm, None), g["final_hidden"], **tol)
    # the model run at another depth k: its clock takes k steps of 1/k (the elastic budget), as
    # the official forward run at k iterations
    for k in range(1, T + 1):
        assert max_err(m.logits(ids, num_steps=k), g["logits_elastic"][k - 1]) < 1e-4, k
        assert max_err(run_schedule(m, ids, [1 / k] * k)[-1], g["logits_elastic"][k - 1]) < 1e-4, k
    custom = run_schedule(m, ids, meta["custom_trajectory"])[-1]
    assert max_err(custom, g["logits_custom_trajectory"]) < 1e-4


# -- the Raven retrofits: parity with the official code --------------------------------------------

def test_raven_forward_matches_golden(raven):
    meta, g = golden("raven_A")
    m, ids, tol = raven, meta["prompt_ids"], dict(atol=1e-4)
    a = m.args
    assert (m.kind, m.num_steps, a.n_kv_heads) == ("retrofit", 4, 2)
    assert a.in_norm and not a.sandwich and not a.qk_proj_norm  # the Llama layout
    assert m.lm_head.weight is not m.embed.weight  # untied
    assert m.eos_token_ids == ()  # the config's stale 65505 dropped, and no tokenizer here
    pos = torch.arange(len(ids))
    assert close(m.embed(torch.tensor(ids)) * m.args.embed_scale, g["embed"], **tol)
    for s0, states, logits in [
            (None, "state_per_step", "logits_per_step"),
            (g["init_state_random"], "state_per_step_random_init", "logits_per_step_random_init")]:
        s, e = m.P(torch.tensor(ids), pos)
        s = s if s0 is None else s0
        inputs, ours = [], []
        for d in range(4):
            inputs.append(m.inject(s, e))
            s = m.R(s, e, pos, d)
            ours.append(s)
        assert close(e, g["prelude_out"], **tol)
        if s0 is None:
            assert close(torch.stack(inputs), g["adapter_out_per_step"], **tol)
        assert close(torch.stack(ours), g[states], **tol)
        assert close(torch.stack([m.C(s, e, pos) for s in ours]), g[logits], **tol)
    random_s0 = m.logits(ids, num_steps=4, state=g["init_state_random"])
    assert close(random_s0, g["logits_random_init"], **tol)
    for k in range(1, 5):
        assert close(m.logits(ids, num_steps=k), g["logits_per_step"][k - 1], **tol), k
    assert close(m.logits(ids), g["logits"], **tol)  # the default depth: mean_recurrence
    assert close(m.logits(ids), g["logits_default_steps"], **tol)
    assert torch.equal(m.logits(ids, num_steps=0), g["logits_steps0"])  # 0: no ln_f before the coda
    s, e = m.P(torch.tensor(ids), pos)
    for d in range(4):
        s = m.R(s, e, pos, d)
    assert close(s, g["latent_final"], **tol)
    coda = m._layers(m.coda, s, models.Call(pos, None))
    assert close(coda, g["coda_out"], **tol)
    assert close(transformer.rms_norm(coda, m.norm, m.args.norm_eps), g["final_hidden"], **tol)
    # RoPE: rotate-half pairs at the Llama-3-scaled frequencies (one kept, one blended, six divided)
    inv_freq = torch.tensor(meta["checks"]["rope_inv_freq"])
    for p in (1, 7, 50):
        assert torch.allclose(m.rope_cos[p], (p * inv_freq).cos(), atol=1e-6)
        assert torch.allclose(m.rope_sin[p], (p * inv_freq).sin(), atol=1e-6)


# -- both families: generation against the goldens -------------------------------------------------

@pytest.mark.parametrize("name,tolerance", [("loopformer_A", 2e-4), ("raven_A", 1e-4)])
def test_generation_matches_golden(name, tolerance, request):
    """24 greedy tokens through the cache, and each token's logits without it (README tolerances)."""
    model = request.getfixturevalue(name.split("_")[0])
    meta, g = golden(name)
    ids, want = meta["prompt_ids"], g["gen_tokens"].tolist()
    got, logits = cached_greedy(model, ids, 24, model.num_steps)
    assert got == want and max_err(logits, g["gen_logits_cached"]) < tolerance
    full = torch.stack([model.logits(ids + want[:i])[-1] for i in range(24)])
    assert full.argmax(-1).tolist() == want and max_err(full, g["gen_logits_nocache"]) < tolerance
    assert engine.generate(model, ids, 24, method="ar").tokens == want


def test_raven_random_initial_state_is_seeded_by_position():
    m = models.load(GOLDEN["raven_A"], state_init="random", seed=3)
    a, b = m.initial_state(torch.tensor([5, 6, 7])), m.initial_state(torch.tensor([7]))
    assert torch.equal(a[2], b[0]) and not torch.equal(a[0], a[1])
    bound = 3 * m.args.init_std * m.args.embed_scale  # init_values.std as stored, embed_scale 1
    assert m.args.embed_scale == 1.0 and a.abs().max() <= bound + 1e-6
    assert 0.9 * bound < golden("raven_A")[1]["init_state_random"].abs().max() <= bound + 1e-6


# The goldens must catch the classic mistakes (the specs' traps): each variant below is wrong.

def swapped_features(orig):
    return lambda self, tau: orig(self, tau).roll(transformer.CLOCK_FEATURES // 2, -1)


@pytest.mark.parametrize("mutation", [
    "sines first", "scale, not 1 + scale", "gates and scales swapped", "no step embedding",
    "clock frozen", "tanh gelu", "norm eps 1e-6", "no norm_f weight", "dt 1/8 of 16 steps",
    "dt of the checkpoint's T at another depth"])
def test_loopformer_golden_catches_wrong_variants(mutation, monkeypatch):
    m = models.load(GOLDEN["loopformer_A"])
    meta, g = golden("loopformer_A")
    clock, table = models.Clock.forward, models.LoopedLM.clock_table
    modulation = models.LoopedLM.modulation
    D = m.args.dim
    time_only = lambda self, t, dt: self.time(self.features(t))
    frozen = lambda self, t, dt: clock(self, torch.zeros_like(t), dt)
    if mutation == "sines first":
        monkeypatch.setattr(models.Clock, "features", swapped_features(models.Clock.features))
    elif mutation == "no step embedding":
        monkeypatch.setattr(models.Clock, "forward", time_only)
    elif mutation == "clock frozen":
        monkeypatch.setattr(models.Clock, "forward", frozen)
    elif mutation == "tanh gelu":
        monkeypatch.setitem(transformer.MLPS, "gelu", partial(F.gelu, approximate="tanh"))
    elif mutation == "norm eps 1e-6":
        m.args.norm_eps = 1e-6
    elif mutation == "no norm_f weight":
        m.norm.data.fill_(1.0)
    elif mutation == "dt 1/8 of 16 steps":  # the first 8 iterations of dt = 1/16
        monkeypatch.setattr(models.LoopedLM, "clock_table", lambda self, T: table(self, 2 * T)[:T])
    elif mutation == "dt of the checkpoint's T at another depth":  # the prefix of dt = 1/8 at T = 4
        monkeypatch.setattr(models.LoopedLM, "clock_table", lambda self, T: table(self, 8)[:T])
        assert max_err(m.logits(meta["prompt_ids"], num_steps=4), g["logits_elastic"][3]) > 1e-4
        return
    elif mutation == "scale, not 1 + scale":
        monkeypatch.setattr(models.LoopedLM, "modulation",
                            lambda self, t, dt: modulation(self, t, dt)
                            - torch.cat([torch.zeros(2 * D), torch.ones(2 * D)]))
    elif mutation == "gates and scales swapped":
        monkeypatch.setattr(models.LoopedLM, "modulation",
                            lambda self, t, dt: modulation(self, t, dt).roll(2 * D, -1))
    assert max_err(m.logits(meta["prompt_ids"], num_steps=8), g["logits"]) > 1e-4


@pytest.mark.parametrize("mutation", ["interleaved rope", "no rope scaling", "ln_f before the coda",
                                      "adapter input swapped", "norm eps 1e-6", "kv heads tiled"])
def test_raven_golden_catches_wrong_variants(mutation, monkeypatch):
    m = models.load(GOLDEN["raven_A"], state_init="zero")
    if mutation == "interleaved rope":
        m.args.interleaved_rope = True
    elif mutation == "no rope scaling":
        m.rope_cos, m.rope_sin = transformer.rope_table(replace(m.args, rope_scaling=None))
    elif mutation == "ln_f before the coda":
        m.args.norm_before_coda = True
    elif mutation == "adapter input swapped":  # concat(e, s)
        w = m.adapter.weight
        w.data = torch.cat([w[:, w.shape[1] // 2:], w[:, :w.shape[1] // 2]], 1)
    elif mutation == "norm eps 1e-6":
        m.args.norm_eps = 1e-6
    elif mutation == "kv heads tiled":  # query head h reading kv head h % Hkv, not h // (H / Hkv)
        tile = lambda q, t: t.repeat(1, q.shape[-2] // t.shape[-2], 1)
        monkeypatch.setattr(models, "causal_attention",
                            lambda q, k, v: kv_cache.causal_attention(q, tile(q, k), tile(q, v)))
    meta, g = golden("raven_A")
    got = m.logits(meta["prompt_ids"], state=g["init_state_random"])
    assert not close(got, g["logits_random_init"], atol=1e-4)


# -- loading: families told apart, configs without sizes or iteration counts, stop ids -----------

def test_the_families_of_huginn_raven_are_told_apart_by_their_tensors():
    for name, kind in (("huginn_A", "huginn"), ("raven_A", "retrofit")):
        folder = os.path.join(HERE, "testdata", name)
        keys = checkpoints.Weights(folder).keys()
        config = checkpoints.read_json(os.path.join(folder, "config.json"))
        assert models.ModelArgs.from_config(config, keys).kind == kind
        # a config alone: only a retrofit's has rope_theta
        assert models.ModelArgs.from_config(config).kind == kind
    config = checkpoints.read_json(os.path.join(GOLDEN["raven_A"], "config.json"))
    keys = {"transformer.core_block.0.attn.q_norm.weight"}
    assert configs.raven_layout(config, keys) == "olmo2"
    assert configs.raven_layout(config, set()) == "llama"
    assert configs.raven_layout(dict(config, wfd_layout="olmo2"), None) == "olmo2"
    with pytest.raises(ValueError, match="does not support: wfd_layout='gemma'"):
        models.ModelArgs.from_config(dict(config, wfd_layout="gemma"))
    with pytest.raises(ValueError, match="does not support: rope_scaling="):
        models.ModelArgs.from_config(dict(config, rope_scaling=dict(rope_type="yarn", factor=4.0)))


def param_count(config):
    """Parameters of models.from_config on the meta device (nothing allocated); a tied head once."""
    return sum(p.numel() for p in models.from_config(config, device="meta").parameters())


def test_real_configs_build_at_their_sizes():
    """The hub's LoopFormer config.json names no size: the official defaults, 278,169,600 parameters
    (tied head once); configs/ holds it with the sizes written out, and a Llama-3.2 retrofit's."""
    hub = dict(architectures=["LoopFormerGPTForCausalLM"], model_type="loopformer",
               torch_dtype="bfloat16")
    lf = checkpoints.read_json(os.path.join(os.path.dirname(HERE), "configs",
                                            "loopformer-3block-8iterations.json"))
    assert param_count(hub) == param_count(lf) == 278_169_600
    a = models.ModelArgs.from_config(hub)
    sizes = (a.dim, a.n_heads, a.head_dim, a.hidden_dim, a.n_core, a.num_steps, a.vocab_size)
    assert sizes == (2048, 32, 64, 5120, 3, 8, 50304) and a.max_seq_len == 1024
    rf = os.path.join(os.path.dirname(HERE), "configs",
                      "recurrent-llama-3.2-train-recurrence-32.json")
    rf = checkpoints.read_json(rf)
    a = models.ModelArgs.from_config(rf)
    assert (a.kind, a.n_heads, a.n_kv_heads, a.head_dim, a.num_steps) == ("retrofit", 32, 8, 64, 32)
    assert a.norm_eps == 1e-5 and not a.tie_embeddings and a.max_seq_len == 131072
    assert a.rope_scaling == (32.0, 1.0, 4.0, 8192.0)
    D, V, I, H, Hkv, hd, layers = 2048, 128256, 8192, 32, 8, 64, 4 + 6 + 4
    per_layer = (H + 2 * Hkv) * hd * D + H * hd * D + 3 * D * I + 2 * D
    assert param_count(rf) == layers * per_layer + 2 * V * D + 2 * D * D + D == 1_385_228_288
    assert models.from_config(rf, device="meta").rope_cos.shape == (131072, 32)


def tokenizer_with(folder, tokens, config=None):
    """A tokenizer.json of a few words, and tokenizer_config.json when given."""
    tok = Tokenizer(tok_models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tok.pre_tokenizer = Whitespace()
    tok.save(os.path.join(folder, "tokenizer.json"))
    if config is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f)


def test_stop_ids_come_from_the_tokenizer(tmp_path):
    """The retrofits' config.json and generation_config.json carry huginn-0125's 65505; LoopFormer's
    name no eos: both take the tokenizer's end of text."""
    import shutil
    raven, lf = tmp_path / "raven", tmp_path / "lf"
    shutil.copytree(GOLDEN["raven_A"], raven)
    tokenizer_with(raven, ["<unk>", "a", "<|begin_of_text|>", "<|end_of_text|>"],
                   {"eos_token": "<|end_of_text|>"})
    assert models.load(str(raven)).eos_token_ids == (3,)
    shutil.copytree(GOLDEN["loopformer_A"], lf)
    tokenizer_with(lf, ["<unk>", "b", "<|endoftext|>"])  # no tokenizer_config.json: GPT-2's eos
    assert models.load(str(lf)).eos_token_ids == (2,)
    tokenizer_with(lf, ["<unk>", "b", "<|endoftext|>", "</s>"], {"eos_token": {"content": "</s>"}})
    assert models.load(str(lf)).eos_token_ids == (3,)


def test_run_py_on_both_families(tmp_path, capsys):
    """run.py --model on a LoopFormer folder and a retrofit folder, each with its tokenizer (beside
    the weights, or by --tokenizer), stops at the tokenizer's eos; a retrofit without a tokenizer,
    or with one that names no eos, is refused in one line (unless --eos names the stop ids)."""
    import shutil
    import run
    words = ["<unk>"] + [f"w{i}" for i in range(1, 127)] + ["<|endoftext|>"]  # ids 0..127
    lf, raven = tmp_path / "LoopFormer-1block-8iterations", tmp_path / "raven"
    shutil.copytree(GOLDEN["loopformer_A"], lf)
    shutil.copytree(GOLDEN["raven_A"], raven)
    tokenizer_with(lf, words)
    outs = {}
    for folder, extra in ((lf, []), (raven, ["--tokenizer", str(lf / "tokenizer.json")])):
        run.main(["--model", str(folder), "--prompt", "w1 w2 w3", "--max-new-tokens", "6",
                  "--json"] + extra)
        (line,) = capsys.readouterr().out.splitlines()
        outs[folder.name] = json.loads(line)
        assert (outs[folder.name]["stats"]["eos_token_ids"] == [127]
                and len(outs[folder.name]["tokens"]) >= 1)
    assert outs[lf.name]["prompt_ids"] == [1, 2, 3]
    for extra, message in (([], "has no tokenizer.json: give --tokenizer"),
                           (["--tokenizer", str(tmp_path / "t.json")],
                            "has a tokenizer without an eos token")):
        Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words[:-1])},
                                       unk_token="<unk>")).save(str(tmp_path / "t.json"))
        with pytest.raises(SystemExit) as exit:
            run.main(["--model", str(raven), "--prompt-ids", "1,2", "--max-new-tokens", "2"]
                     + extra)
        err = capsys.readouterr().err
        assert exit.value.code == 2 and err.count("\n") == 1 and message in err, err
    run.main(["--model", str(raven), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--eos", "5",
              "--json"])
    assert json.loads(capsys.readouterr().out)["stats"]["eos_token_ids"] == [5]


# -- decoding: every schedule equals AR, bit for bit --------------------------------------------

KINDS = ["loopformer", "llama", "olmo2"]  # LoopFormer; the retrofits' two block layouts


def family_config(kind, seed):
    """A random small config in the official config.json format (the retrofits': huginn-0125's)."""
    rng = random.Random(seed)
    if kind == "loopformer":
        return dict(model_type="loopformer", n_embd=32, n_head=rng.choice([2, 4]),
                    n_layer=rng.choice([1, 2]), intermediate_dim=80, vocab_size=64, block_size=96,
                    bias=False, dropout=0.0, max_model_loops=rng.choice([3, 5, 6]))
    heads = rng.choice([2, 4])
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=16)
    return dict(model_type="huginn_raven", wfd_layout=kind, n_embd=32, n_heads=heads,
                num_key_value_heads=rng.choice([1, heads]), head_dim=rng.choice([8, 12]),
                intermediate_size=48, vocab_size=64, padded_vocab_size=64, n_layers_in_prelude=1,
                n_layers_in_recurrent_block=rng.choice([1, 2]), n_layers_in_coda=1,
                mean_recurrence=rng.choice([3, 4, 5]), rope_theta=10000.0,
                rope_scaling=llama3 if kind == "llama" else None, max_position_embeddings=96,
                block_size=96, norm_eps=1e-5, tie_embeddings=False, qk_bias=False, bias=False,
                init_values=dict(std=0.1, embed_scale=1.0), bos_token_id=65504, eos_token_id=65505)


def tiny_family(kind, seed, dtype=torch.float64):
    return models.from_config(family_config(kind, seed), device=DEVICE, dtype=dtype,
                              state_init="random", seed=seed, init_seed=seed)


@pytest.mark.parametrize("kind,dtype", quick([(k, d) for k in KINDS for d in DTYPES],
                                             ("loopformer", torch.bfloat16),
                                             ("olmo2", torch.float16)), ids=str)
def test_every_schedule_equals_ar_at_every_draft_depth(kind, dtype):
    """WFD and DtV against AR at the same width (tokens and logits, torch.equal): greedy, sampled
    with a seed, with forced wrong drafts; WFD with the shared KV against shared AR; in float64 each
    also gives 1-row AR's tokens."""
    seed = KINDS.index(kind) + DTYPES.index(dtype)
    model = tiny_family(kind, seed, dtype)
    T, V, rng = model.num_steps, model.args.vocab_size, random.Random(seed)
    prompt, n_new = [rng.randrange(V) for _ in range(rng.randint(2, 7))], 12
    ar = engine.generate(model, prompt, n_new, method="ar", width=1)
    for k in range(1, T + 1):
        for method in ("wfd", "dtv"):
            out = exact(model, prompt, n_new, method, k, draft_len=1 + k % 3)
            if dtype == torch.float64:
                assert out.tokens == ar.tokens, (method, k)
            exact(model, prompt, n_new, method, k, temperature=0.9, top_k=20, seed=seed)
            at = lambda pos, tokens=out.tokens: tokens[pos - len(prompt)]
            some_wrong = lambda pos, tok: at(pos) if pos % 3 else (at(pos) + 1) % V
            exact(model, prompt, n_new, method, k, draft_hook=some_wrong)
        shared = dict(kv="shared", draft_steps=k, keep_logits=True)
        ar_shared = engine.generate(model, prompt, n_new, method="ar", **shared)
        for hook in (None, lambda pos, tok: (tok + 1) % V):
            out = engine.generate(model, prompt, n_new, draft_hook=hook, **shared)
            assert same_logits(out, ar_shared), (k, hook)


@pytest.mark.parametrize("kind,dtype", quick([(k, d) for k in KINDS for d in DTYPES[::2]],
                                             ("loopformer", torch.float64)), ids=str)
def test_batched_with_refill_equals_batched_ar(kind, dtype):
    """Four prompts through two slots (two of them refills), every k, wrong drafts in one prompt, a
    stop token, sampled too; shared KV batched."""
    model = tiny_family(kind, 7, dtype)
    prompts = prompts_for(model, 4, 7)
    plain = engine.generate(model, prompts, 12, method="ar", batch_size=2)
    eos = plain[0].tokens[5]

    def wrong_in_one(i, pos, token):
        right = plain[i].tokens[pos - len(prompts[i])]
        return (right + 1) % model.args.vocab_size if i == 2 else token
    for k in range(1, model.num_steps + 1):
        for method in ("wfd", "dtv"):
            outs = check_against_batched_ar(model, prompts, 12, method, k, batch_size=2,
                                            eos_token_id=eos, draft_hook=wrong_in_one)
            assert [o.stats["slot"] for o in outs] == [0, 1, 0, 1] and outs[0].tokens[-1] == eos
        check_against_batched_ar(model, prompts, 12, "wfd", k, batch_size=3, temperature=0.8,
                                 seed=[1, 2, 3, 4])
        check_against_batched_ar(model, prompts, 12, "wfd", k, batch_size=2, kv="shared")
    if dtype == torch.float64:  # each prompt as if alone
        for prompt, out in zip(prompts, plain):
            assert engine.generate(model, prompt, 12, method="ar", width=1).tokens == out.tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", GOLDEN)
def test_float32_goldens_every_method_and_depth(name, request):
    model = request.getfixturevalue(name.split("_")[0])
    meta, g = golden(name)
    ids, want = meta["prompt_ids"], g["gen_tokens"].tolist()
    for k in range(1, model.num_steps + 1):
        for method in ("wfd", "dtv"):  # AR's at the method's width, and the official tokens
            assert exact(model, ids, 24, method, k).tokens == want, (method, k)
        shared = dict(kv="shared", draft_steps=k, keep_logits=True)
        ar_shared = engine.generate(model, ids, 24, method="ar", **shared)
        assert same_logits(engine.generate(model, ids, 24, **shared), ar_shared), k


@pytest.mark.slow
def test_compiled_wfd_equals_compiled_ar():
    """Compiled decoding (R and the read compiled; LoopFormer's modulations gathered by depth inside
    the graph), greedy and sampled, against compiled AR at the same width."""
    for kind in ("loopformer", "olmo2"):
        model = tiny_family(kind, 3, torch.float32)
        T, prompt, n_new = model.num_steps, [3, 1, 4], 10

        def run(method, k, compile=True, **kw):
            return engine.generate(model, prompt, n_new, method=method, draft_steps=k, width=T,
                                   capacity=len(prompt) + n_new, keep_logits=True, compile=compile,
                                   **kw)
        for sampling in (dict(), dict(temperature=0.9, seed=1)):
            ar = run("ar", T, **sampling)
            for k in (1, 2):
                out = run("wfd", k, **sampling)
                assert same_logits(out, ar) and out.stats["compiled"], (kind, k, sampling)
        greedy, eager = run("ar", T), run("ar", T, compile=False)  # the eager model, up to rounding
        assert eager.tokens == greedy.tokens
        assert torch.allclose(torch.stack(eager.logits), torch.stack(greedy.logits), atol=1e-4)


@pytest.mark.parametrize("T", [4, pytest.param(11, marks=pytest.mark.slow)])
def test_loopformer_decodes_at_another_depth_on_that_depths_clock(T):
    """A decode at T other than the checkpoint's 8 runs the clock of T iterations (dt = 1/T), as the
    official model run at T iterations: the prefill's logits are the official elastic forward's at
    T = 4 (the golden) and a float64 reference's from the spec at T = 11; every schedule gives AR's
    tokens and logits at that T."""
    m, (meta, g) = models.load(GOLDEN["loopformer_A"]), golden("loopformer_A")
    ids = meta["prompt_ids"]
    if T == 4:
        out = engine.generate(m, ids, 1, num_steps=T, keep_logits=True)
        assert max_err(out.logits[0], g["logits_elastic"][T - 1][-1]) < 1e-4
    else:
        m64 = models.load(GOLDEN["loopformer_A"], dtype=torch.float64)
        out = engine.generate(m64, ids, 1, num_steps=T, keep_logits=True)
        w = {k: v.double() for k, v in load_file(
            os.path.join(GOLDEN["loopformer_A"], "model.safetensors")).items()}
        want = loopformer_reference(w, m.config, ids, T, T)[-1][-1]
        assert torch.allclose(out.logits[0].double(), want, rtol=1e-6, atol=1e-6)
    for k in range(1, T):
        exact(m, ids, 12, "wfd", k, num_steps=T)


# -- a second layout of each family: random weights, saved, reloaded, against a spec reference -----

def rms(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def loopformer_reference(w, c, ids, steps, T=None):
    """LoopFormer's forward from spec/loopformer.md, in float64 (the sinusoid in fp32, as the
    official code): the logits after each of `steps` iterations of the schedule of T iterations
    (dt = 1 / T; default T: the checkpoint's)."""
    D, H, eps = c["n_embd"], c["n_head"], torch.finfo(torch.float64).eps
    T = T or c["max_model_loops"]
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)

    def embedder(name, tau):
        angles = torch.tensor([tau], dtype=torch.float64).float() * freqs
        h = torch.cat([angles.cos(), angles.sin()]).double()
        p = f"gpt.{name}.mlp."
        h = F.silu(F.linear(h, w[p + "0.weight"], w[p + "0.bias"]))
        return F.linear(h, w[p + "2.weight"], w[p + "2.bias"])
    x = w["gpt.transformer.wte.weight"][ids] + w["gpt.transformer.wpe.weight"][:len(ids)]
    t, out = 0.0, []
    for _ in range(steps):
        c_ = F.silu(embedder("time_embedder", t) + embedder("dt_embedder", 1 / T))
        for j in range(c["n_layer"]):
            p = f"gpt.transformer.h.blocks.{j}."
            g_attn, g_mlp, s_attn, s_mlp = F.linear(c_, w[p + "adaLN_modulation.1.weight"],
                                                    w[p + "adaLN_modulation.1.bias"]).chunk(4)
            h = rms(x, None, eps) * (1 + s_attn)
            q, k, v = (h @ w[p + "attn.c_attn.weight"].T).split(D, -1)
            q, k, v = (z.unflatten(-1, (H, -1)).transpose(0, 1) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).flatten(1)
            x = x + g_attn * (y @ w[p + "attn.c_proj.weight"].T)
            h = F.gelu(rms(x, None, eps) * (1 + s_mlp) @ w[p + "mlp.c_fc.weight"].T)
            x = x + g_mlp * (h @ w[p + "mlp.c_proj.weight"].T)
        t += 1 / T
        head = w["gpt.transformer.wte.weight"]  # tied
        out.append(rms(x, w["gpt.transformer.norm_f.weight"], eps) @ head.T)
    return out


def raven_reference(w, c, ids, steps, olmo2):
    """A retrofit's forward from spec/raven.md, in float64 from a zero state: the logits after each
    number of recurrences 1..steps. Llama blocks x + f(norm(x)); OLMo-2's x + norm(f(x)), with q and
    k normed over the whole projection before RoPE; rotate-half RoPE, Llama-3 scaling, GQA."""
    H, Hkv, hd, eps = c["n_heads"], c["num_key_value_heads"], c["head_dim"], c["norm_eps"]
    inv_freq = 1.0 / c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)
    if c.get("rope_scaling"):
        r = c["rope_scaling"]
        f, lo, hi = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
        L = r["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (L / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_freq / f + smooth * inv_freq
        inv_freq = torch.where(wavelen > L / lo, inv_freq / f,
                               torch.where(wavelen < L / hi, inv_freq, smoothed))
    angles = torch.arange(len(ids), dtype=torch.float32)[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], -1)  # the halves layout; cos and sin in fp32, then cast
    cos, sin = angles.cos().double(), angles.sin().double()
    half = lambda z: torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1)  # rotate_half
    rot = lambda z: z * cos + half(z) * sin  # z [heads, N, hd]

    def block(p, x):
        h = x if olmo2 else rms(x, w[p + "norm_1.weight"], eps)
        q, k, v = (h @ w[p + "attn.Wqkv.weight"].T).split([H * hd, Hkv * hd, Hkv * hd], -1)
        if olmo2:
            q = rms(q, w[p + "attn.q_norm.weight"], eps)
            k = rms(k, w[p + "attn.k_norm.weight"], eps)
        q, k, v = (z.unflatten(-1, (-1, hd)).transpose(0, 1) for z in (q, k, v))
        k, v = (z.repeat_interleave(H // Hkv, 0) for z in (k, v))  # head h: kv head h // group
        y = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        y = y.transpose(0, 1).flatten(1)
        y = y @ w[p + "attn.proj.weight"].T
        x = x + (rms(y, w[p + "norm_1.weight"], eps) if olmo2 else y)
        h = x if olmo2 else rms(x, w[p + "norm_2.weight"], eps)
        gate, up = (h @ w[p + "mlp.fc.weight"].T).chunk(2, -1)
        y = (F.silu(gate) * up) @ w[p + "mlp.proj.weight"].T
        return x + (rms(y, w[p + "norm_2.weight"], eps) if olmo2 else y)
    e = w["transformer.wte.weight"][ids] * c["init_values"]["embed_scale"]
    for i in range(c["n_layers_in_prelude"]):
        e = block(f"transformer.prelude.{i}.", e)
    s, out = torch.zeros_like(e), []
    for _ in range(steps):
        s = torch.cat([s, e], -1) @ w["transformer.adapter.weight"].T
        for j in range(c["n_layers_in_recurrent_block"]):
            s = block(f"transformer.core_block.{j}.", s)
        x = s
        for i in range(c["n_layers_in_coda"]):
            x = block(f"transformer.coda.{i}.", x)
        out.append(rms(x, w["transformer.ln_f.weight"], eps) @ w["lm_head.weight"].T)
    return out


def rewrite_config(folder, drop):
    """The saved config.json without `drop`, as the hub's (LoopFormer's has no iteration count, a
    retrofit's no layout)."""
    path = os.path.join(folder, "config.json")
    config = checkpoints.read_json(path)
    del config[drop]
    with open(path, "w") as f:
        json.dump(config, f)
    return config


def depth_logits(model, ids, k):
    """The logits after k recurrences of the model's full-depth schedule: a draft's read at depth k
    (LoopFormer's clock of T iterations; model.logits(ids, k) runs the model at depth k)."""
    pos = torch.arange(len(ids))
    s, e = model.P(torch.tensor(ids), pos)
    for d in range(k):
        s = model.R(s, e, pos, d)
    return model.C(s, e, pos)


def check_b_layout(built, folder, config, reference, n_keys):
    """The reloaded model: the built one's logits at every depth, bit for bit; in float64 the spec
    reference's; and every schedule exact against AR."""
    T, ids = built.num_steps, [5, 1, 17, 33, 2, 8, 40]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    assert len(tensors) == n_keys
    again = models.load(folder, state_init="zero")
    assert again.args == built.args
    for k in range(1, T + 1):
        assert torch.equal(depth_logits(again, ids, k), depth_logits(built, ids, k)), k
    m64 = models.load(folder, dtype=torch.float64, state_init="zero")
    ref = reference({n: t.double() for n, t in tensors.items()}, config, ids, T)
    for k in range(1, T + 1):  # logits come out in float32: its rounding of the float64 result only
        got = depth_logits(m64, ids, k).double()
        assert torch.allclose(got, ref[k - 1], rtol=1e-6, atol=1e-6), k
    for k in range(1, T + 1):
        for method in ("wfd", "dtv"):
            exact(again, ids, 16, method, k, draft_len=2)
    check_against_batched_ar(again, prompts_for(again, 3, 1), 8, "wfd", 1, batch_size=2)


def test_loopformer_b_layout(tmp_path):
    """Other heads (6 of 8 channels), 2 blocks, 5 iterations (dt = 0.2, not a binary fraction);
    saved in the hub's format (`gpt.` keys, no head) with the count left out of config.json, as on
    the hub: it comes from the folder's name."""
    config = dict(architectures=["LoopFormerGPTForCausalLM"], model_type="loopformer", n_embd=48,
                  n_head=6, n_layer=2, intermediate_dim=120, vocab_size=96, block_size=40,
                  bias=False, dropout=0.0, max_model_loops=5)
    built = models.from_config(config, init_seed=11)
    folder = str(tmp_path / "LoopFormer-2block-5iterations")
    models.save(built, folder)
    rewrite_config(folder, "max_model_loops")
    keys = load_file(os.path.join(folder, "model.safetensors"))
    assert all(k.startswith("gpt.") and "lm_head" not in k for k in keys)
    check_b_layout(built, folder, config, loopformer_reference, 6 * 2 + 11)


@pytest.mark.parametrize("layout", ["olmo2", "llama"])
def test_raven_b_layout(tmp_path, layout):
    """OLMo-2 post-norm blocks with q/k norms (or Llama pre-norm ones), 6 query heads on 2 kv heads
    of 12 channels (head_dim * heads != n_embd), 2 / 1 / 2 layers, 3 recurrences; saved without the
    layout key, which the tensors then tell."""
    config = checkpoints.read_json(os.path.join(GOLDEN["raven_A"], "config.json"))
    config.update(wfd_layout=layout, n_embd=48, n_heads=6, num_key_value_heads=2, head_dim=12,
                  intermediate_size=72, vocab_size=80, padded_vocab_size=80, n_layers_in_prelude=2,
                  n_layers_in_recurrent_block=1, n_layers_in_coda=2, n_layers=5, mean_recurrence=3,
                  rope_theta=10000.0, norm_eps=1e-6, max_position_embeddings=40, block_size=40)
    config["rope_scaling"] = None if layout == "olmo2" else dict(
        config["rope_scaling"], factor=8.0, original_max_position_embeddings=12)
    built = models.from_config(config, init_seed=12, state_init="zero")
    olmo2 = layout == "olmo2"
    a = built.args
    assert (a.qk_proj_norm, a.in_norm, a.sandwich) == (olmo2, not olmo2, olmo2)
    folder = str(tmp_path / layout)
    models.save(built, folder)
    rewrite_config(folder, "wfd_layout")
    n_keys = (8 if olmo2 else 6) * 5 + 4
    check_b_layout(built, folder, config, partial(raven_reference, olmo2=olmo2), n_keys)


# -- every family: one blocking transfer per tick -------------------------------------------------

# each a read of a tensor's values by the host: on a GPU, a wait for the device's queue
HOST_READS = dict(
    equal=lambda t: torch.equal(t, t), allclose=lambda t: torch.allclose(t, t),
    to_cpu=lambda t: t.to("cpu"), cpu=lambda t: t.cpu(), numpy=lambda t: t.numpy(),
    asarray=lambda t: np.asarray(t), bool=lambda t: bool(t[0]), if_t=lambda t: 1 if t[0] else 0,
    int=lambda t: int(t[0]), float=lambda t: float(t[0]), index=lambda t: [0, 1, 2][t[0]],
    item=lambda t: t[0].item(), tolist=lambda t: t.tolist(), nonzero=lambda t: t.nonzero(),
    mask=lambda t: t[t > 1], mask_assigned=lambda t: t.clone().__setitem__(t > 1, t[0]),
    unique=lambda t: t.unique(), repr=lambda t: repr(t))
# each a tensor made of host data (on a GPU, a blocking copy to the device)
HOST_DATA = dict(tensor=lambda t: torch.tensor([1, 2]), as_tensor=lambda t: torch.as_tensor([1]),
                 from_numpy=lambda t: torch.from_numpy(np.zeros(2)),
                 number_assigned=lambda t: t.clone().__setitem__(0, 5))
# neither: the device's own work, or a move to the device
NEITHER = dict(add=lambda t: t + 1, to_device=lambda t: t.to(t.device),
               to_dtype=lambda t: t.to(torch.float64), gather=lambda t: t[t.argmax()[None]],
               where=lambda t: torch.where(t > 1, t, 0), fill=lambda t: t.clone()[0].fill_(5))


@pytest.mark.parametrize("name", [*HOST_READS, *HOST_DATA, *NEITHER])
def test_the_transfer_counter_sees_every_read_of_a_tensors_values(name, monkeypatch):
    """host_reads.HostReads, as decoding after the prefill on a CPU (the tests' imitation of a
    device): each spelling of a read of a tensor's values is counted, and of a tensor made of host
    data, and nothing else."""
    counter, t = HostReads(monkeypatch, "cpu"), torch.tensor([2, 0, 1])
    with counter:
        counter.mark(decoding=True)
        {**HOST_READS, **HOST_DATA, **NEITHER}[name](t)
    assert (bool(counter.reads), bool(counter.sent)) == (name in HOST_READS, name in HOST_DATA)


@pytest.mark.parametrize("kind", ["ouro", "huginn", "parcae", "loopformer", "llama"])
def test_one_blocking_transfer_per_tick_on_every_family(kind, monkeypatch):
    """After the prefill a generation reads the device once per tick at most, the tokens its C
    call chose (stats["host_syncs"] counts them), and makes no tensor of host data for the device
    (on a GPU a blocking copy): every other read of a tensor's values (item, bool, torch.equal,
    nonzero, .cpu(), tolist, ...) and every tensor made of host data after the prefill is counted
    here at the dispatcher (host_reads.HostReads), and there are none. Greedy and sampled,
    digested, one prompt and two batched, WFD (with the second proposal too) and DtV."""
    model = tiny_model(kind, 0) if kind in ("ouro", "huginn", "parcae") else tiny_family(kind, 0)
    T, counter = model.num_steps, HostReads(monkeypatch, model.device)
    listed = lambda outs: outs if isinstance(outs, list) else [outs]
    runs = [([3, 1, 4], "wfd", {}), ([[3, 1, 4], [2, 7]], "wfd", {}),
            ([5, 9], "dtv", dict(temperature=0.8, seed=1))]
    if T >= 3:  # the second proposal: its branches staged with the positions
        runs.append(([3, 1, 4], "wfd", dict(second_depth=T - 1)))
    for prompts, method, sampling in runs:
        run = partial(engine.generate, model, prompts, 12, method=method, draft_steps=1,
                      digest_logits=True, **sampling)
        with counter:
            outs = listed(run())
        assert counter.reads == [] and counter.sent == [], (kind, method, counter.reads)
        assert all(len(reads) == 1 for reads in counter.fetches), (kind, method, counter.fetches)
        syncs = [out.stats["host_syncs"] for out in outs]
        for out in outs:
            ticks = out.stats["r_calls"] - T
            assert 0 < out.stats["host_syncs"] <= ticks, (kind, method, out.stats)
        # a fetch reads for each sequence it serves: for one of them at least, all at most
        assert max(syncs) <= len(counter.fetches) <= sum(syncs), (kind, method, syncs)
    # the last run's tokens and logits, bit for bit, without the counter
    assert [(o.tokens, o.stats["logits_digest"]) for o in outs] == [
        (o.tokens, o.stats["logits_digest"]) for o in listed(run())]
