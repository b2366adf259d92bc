"""Compiled decoding (generate(compile=True), README "Compiled decoding"): every schedule gives the
tokens and logits of AR compiled at the same width, greedy and sampled, and runs AR's graphs. There
is no skip: a machine without the C compiler that torch.compile needs on a CPU fails here."""
import gc
import random
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

import models
import engine
from test_engine import DEVICE, GOLDEN, poison_masked_columns, same_logits, tiny_config, tiny_model
from engine import compiling, model_runner, memory


def test_compiled_calls_are_kept_per_model_and_let_it_go():
    """compiling.compiled makes a call's compiled version once per model (later generations
    reuse it) and keeps no model alive: its store is keyed weakly by the model."""
    a, b = tiny_model("ouro", 0), tiny_model("ouro", 1)
    fn = compiling.compiled(a, model_runner.recur_body)  # made, not yet traced
    assert compiling.compiled(a, model_runner.recur_body) is fn
    assert compiling.compiled(b, model_runner.recur_body) is not fn
    gone = weakref.ref(a)
    del a, fn
    gc.collect()
    assert gone() is None and b in compiling.COMPILED


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_wfd_and_dtv_equal_compiled_ar(dtype):
    model = tiny_model("huginn", 0, dtype)  # a prelude and a coda: P, R and C all compiled
    T, prompt, n_new = model.num_steps, [3, 1, 4], 14  # positions up to 15: one key block, then two
    # one width and capacity for every run, so that one set of graphs serves them all
    # (compiling is slow)
    width, capacity = T, len(prompt) + n_new

    def run(method, k, **kw):
        return engine.generate(model, prompt, n_new, method=method, draft_steps=k,
                               draft_len=1 + k % (width - 1), width=width, capacity=capacity,
                               keep_logits=True, compile=True, **kw)

    graphs = counters["stats"]["unique_graphs"]
    greedy = run("ar", T)
    # it compiled, and did not fall back to eager
    assert counters["stats"]["unique_graphs"] > graphs
    for sampling in (dict(), dict(temperature=0.9, seed=1)):
        ar = run("ar", T, **sampling)  # sampled: a read graph of its own (for every seed)
        compiled = counters["stats"]["unique_graphs"]
        for k in range(1, T + 1):
            for method in ("wfd", "dtv"):
                out = run(method, k, **sampling)
                assert same_logits(out, ar) and out.stats["compiled"], (method, k, sampling)
        # no recompiles: every run found AR's graphs
        assert counters["stats"]["unique_graphs"] == compiled
    if dtype == torch.float32:  # the compiled calls compute the eager model, up to rounding
        eager = engine.generate(model, prompt, n_new, method="ar", width=width, keep_logits=True)
        assert eager.tokens == greedy.tokens
        assert torch.allclose(torch.stack(eager.logits), torch.stack(greedy.logits), atol=1e-4)


@pytest.mark.slow
def test_cuda_graph_wrapping_runs_on_cpu(monkeypatch):
    """The CUDA path's Python side (mode "reduce-overhead", replay copying every output, the read's
    tuple too) in a whole generation. On a CPU inductor skips the graphs themselves, so what a GPU
    adds (graph capture over the static KV buffers) is left to gpu_check.sh."""
    replays, replay = [], compiling.replay
    monkeypatch.setattr(compiling, "replay",
                        lambda *args, **kw: replays.append(1) or replay(*args, **kw))
    # no prelude: P stays eager, R and the read are graphed; 4 heads in 2 KV groups
    # (kv.block_attention's groups)
    model = models.from_config(dict(tiny_config("ouro", 7), num_key_value_heads=2), device=DEVICE,
                               init_seed=7)
    assert model.args.n_heads == 4 and model.args.n_kv_heads == 2
    compiling.COMPILED[model] = {fn: compiling.compile_call(fn, graphs=True)
                                 for fn in (model_runner.recur_body, model_runner.read_body)}
    T, prompt, n_new = model.num_steps, [3, 1, 4], 12

    def run(method, k, compile):
        return engine.generate(model, prompt, n_new, method=method, draft_steps=k, width=T,
                               capacity=15, keep_logits=True, compile=compile, temperature=0.8,
                               seed=2)

    ar = run("ar", T, True)
    del replays[:]
    out = run("wfd", 1, True)
    assert same_logits(out, ar)
    # every R and C call after the prefill went through replay
    assert len(replays) == out.stats["r_calls"] - T + out.stats["c_calls"] - 1
    eager = run("ar", T, False)
    assert eager.tokens == ar.tokens
    assert torch.allclose(torch.stack(eager.logits), torch.stack(ar.logits), atol=1e-4)


@pytest.mark.slow
def test_graphs_and_caches_do_not_grow_with_prompts_and_samplers(monkeypatch):
    """One process, compiled WFD over 6 prompt lengths greedily and 6 seeds x 2 temperatures
    sampled: a handful of graphs (R, a greedy read, a sampled read) and one static cache, not one
    set per length or per sampler setting."""
    monkeypatch.undo()  # the real kv.BLOCK (conftest shrinks it), which holds every prompt here
    model = models.load(GOLDEN["ouro_A"])
    graphs = counters["stats"]["unique_graphs"]
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(model.args.vocab_size) for _ in range(n)]
    runs = [dict(prompt_ids=prompt(n)) for n in (2, 5, 9, 14, 20, 31)]
    runs += [dict(prompt_ids=prompt(4), seed=seed, temperature=t)
             for seed in range(6) for t in (0.7, 1.3)]
    for run in runs:
        out = engine.generate(model, max_new_tokens=6, compile=True, **run)
        assert len(out.tokens) == 6 and out.stats["compiled"]
    assert counters["stats"]["unique_graphs"] - graphs <= 8
    assert len(memory.STATIC_CACHES[model]) == 1
    memory.free_static_caches(model)
    assert model not in memory.STATIC_CACHES


@pytest.mark.slow
def test_static_buffers_stay_and_cuda_graphs_are_taken():
    """A CUDA graph replays on the addresses it recorded: the static KV buffers must not move
    between generations, and inductor must not skip the graphs (on a GPU: gpu_check.sh runs this
    on cuda)."""
    model = tiny_model("huginn", 3, torch.float32)
    skips = counters["inductor"]["cudagraph_skips"]
    ptrs = []
    for prompt in ([1, 2, 3], [4, 5, 6, 7]):  # two prompt lengths, one capacity
        out = engine.generate(model, prompt, 6, capacity=16, compile=True)
        assert len(out.tokens) == 6
        # on a GPU the counts of cudagraph trees and inductor; on a CPU none are taken
        assert out.stats["cuda_graphs_rerecorded"] == out.stats["cuda_graphs_skipped"] == 0
        (cache,) = memory.STATIC_CACHES[model].values()
        ptrs.append([t.data_ptr() for t in cache.buffers()])
    assert ptrs[0] == ptrs[1]
    if DEVICE == "cuda":
        assert counters["inductor"]["cudagraph_skips"] == skips


@pytest.mark.slow
def test_compiled_batched_wfd_equals_compiled_batched_ar():
    """Four prompts through two slots, compiled: each prompt's tokens and logits are compiled
    batched AR's, wrong drafts forced in one prompt; and the prompts as if alone, up to rounding."""
    model = tiny_model("huginn", 1, torch.bfloat16)
    prompts, n_new = [[3, 1, 4], [1, 5], [9, 2, 6, 5, 3], [5]], 10
    width, T = 4, model.num_steps

    def run(method, k, **kw):
        return engine.generate(model, prompts, n_new, method=method, draft_steps=k, width=width,
                               batch_size=2, capacity=16, keep_logits=True, compile=True, **kw)

    ar = run("ar", T)
    for k in (2, T // 2):
        outs = run("wfd", k, draft_hook=lambda i, pos, token: token + 1 if i == 1 else token)
        assert all(same_logits(out, ref) for out, ref in zip(outs, ar)), k
        assert outs[1].stats["accepted"] == 0 and all(o.stats["compiled"] for o in outs)


def test_compiled_schedules_compile_nothing_and_equal_compiled_ar(monkeypatch):
    """The quick suite's compiled check: after wfd.compile_graphs, compiled AR, WFD and DtV at one
    width give the same tokens and logits in bfloat16 across 1, 2 and 4 key blocks (the calls of a
    wave's rows cross from one bucket's graphs to the next at different ticks than AR's) and
    compile no graph while decoding; without it, a generation compiles. The same with inf and NaN
    in the columns no row can see, wrong drafts forced."""
    model = models.from_config(tiny_config("ouro", 7), dtype=torch.bfloat16, device=DEVICE,
                               init_seed=7)
    prompt, n_new, width = [5, 6, 7], 27, 2  # positions up to 28 of 32: 1, 2, 4 key blocks of 8
    run = lambda method, n=n_new, **kw: engine.generate(model, prompt, n, method=method,
                                                        width=width,
                                                        capacity=32, keep_logits=True,
                                                        compile=True, **kw)
    assert run("ar", 4).stats["graphs_compiled"] > 0  # one key block's graphs
    assert engine.compile_graphs(model, prompt, n_new, method="ar", width=width,
                                 capacity=32) > 0  # 2 and 4 blocks
    ar = run("ar")
    for method, k in (("wfd", -(-model.num_steps // width)), ("dtv", 1), ("dtv", 2)):
        out = run(method, draft_steps=k, draft_len=1)
        assert same_logits(out, ar) and out.stats["graphs_compiled"] == 0, (method, k)
    assert ar.stats["graphs_compiled"] == 0
    poison_masked_columns(monkeypatch)
    V = model.args.vocab_size
    out = run("wfd", draft_steps=2, draft_hook=lambda pos, tok: (tok + pos % 2) % V)
    assert same_logits(out, ar) and out.stats["rejected"] > 0


@pytest.mark.slow
def test_compiled_wfd_equals_compiled_ar_across_every_key_bucket():
    """Compiled WFD against compiled AR at one width in bfloat16, over 1, 2, 4 and 8 key blocks
    (the 2 -> 4 and 4 -> 8 crossings too), Huginn (P, R and C compiled), greedy with some drafts
    forced wrong, and sampled."""
    model = tiny_model("huginn", 2, torch.bfloat16)
    T, V, prompt, n_new = model.num_steps, model.args.vocab_size, [3, 1, 4], 60  # positions to 62
    run = lambda method, k, **kw: engine.generate(model, prompt, n_new, method=method,
                                                  draft_steps=k,
                                                  width=T, capacity=64, keep_logits=True,
                                                  compile=True, **kw)
    for sampling in (dict(), dict(temperature=0.8, seed=3)):
        ar = run("ar", T, **sampling)
        for k in (1, 2):
            hook = lambda pos, tok: (tok + 1) % V if pos % 5 == 0 else tok
            out = run("wfd", k, draft_hook=hook, **sampling)
            assert same_logits(out, ar) and out.stats["graphs_compiled"] == 0, (k, sampling)
