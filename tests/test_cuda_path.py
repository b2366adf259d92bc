"""The CUDA path run before a GPU (docs/compiling.md): on a CPU the `imitation` fixture sends every
generation down the path that CUDA takes, compiled calls through torch.compile's mode
"reduce-overhead" and `compiling.replay` (on a CPU inductor skips only the graph capture), the
staging ring of several chunks with stand-in events, and the CUDA-graph counters. Under it every
family gives compiled AR's tokens and logits, bit for bit, and eager AR's tokens, greedy, sampled,
with the second proposal, batched with refill and with shared KV. With WFD_TEST_DEVICE=cuda
(gpu_check.sh) the same tests run on the GPU for real: CUDA graphs, pinned staging, CUDA events."""
import functools
import random

import pytest
import torch

from engine import kv_cache
import engine
from cli import args
from engine import checks, compiling, memory, model_runner, siblings, staging
from formats import devices
from test_batch import prompts_for
from test_siblings import FAMILIES, model_of
from test_engine import DEVICE, same_logits


class Waits:
    """The staging events of the generations under the imitation: each one made for a device, and
    the waits on them (a chunk filled again before a read let the host catch up). On CUDA real
    events, counted."""

    def __init__(self, record):
        self.record, self.devices, self.count = record, [], 0

    def __call__(self, device):
        self.devices.append(device)
        waits, event = self, self.record(device)

        class Counted:
            def synchronize(self):
                waits.count += 1
                return event and event.synchronize()
        return Counted()


class StandInManager:
    """cudagraph trees' manager as the CUDA-graph counters read it: no graph re-recorded."""
    num_rerecord = {}


@pytest.fixture
def imitation(monkeypatch):
    """The CUDA path on this device: on a CPU, the path's device check passes for "cpu" too, and
    cudagraph trees' manager is a stand-in; the staging ring holds 2 chunks (fewer than the calls
    between two reads of every schedule here, so that a chunk waits on its event), its events
    counted (Waits). The replays are counted: yields (Waits, replays)."""
    if DEVICE != "cuda":
        from torch._inductor import cudagraph_trees
        monkeypatch.setattr(staging, "CUDA_PATH", staging.CUDA_PATH | {"cpu"})
        monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists:
                            StandInManager())
    waits = Waits(staging.Staging.record if DEVICE == "cuda" else lambda device: None)
    monkeypatch.setattr(staging.Staging, "ring", 2)
    monkeypatch.setattr(staging.Staging, "record", staticmethod(waits))
    # replay begins each call with a step mark, looked up as it runs: counted even in a graph
    # compiled in an earlier test (family_model)
    replays, mark = [], torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin",
                        lambda: replays.append(1) or mark())
    yield waits, replays


def test_replay_copies_every_tensor_and_passes_none_through():
    """start_body's output in a family without e (Ouro, LoopFormer) is (s, None): each tensor
    copied out of the graph's memory, the None kept (a clone of it raised AttributeError)."""
    s, e = torch.ones(2), torch.zeros(2)
    for out in ((s, None), (s, e), s):
        copy = compiling.replay(lambda: out)
        for a, b in zip(copy if isinstance(copy, tuple) else [copy],
                        out if isinstance(out, tuple) else [out]):
            assert (a is None) == (b is None) and (a is None or (torch.equal(a, b) and a is not b))


@functools.cache
def family_model(kind):
    """One model per family in the process: a second model of the same shapes would share the
    first one's graphs that read no KV cache (dynamo guards the caches' addresses, not the
    weights'), and on CUDA re-record their CUDA graphs for its own weights (docs/compiling.md)."""
    return model_of(kind, FAMILIES.index(kind), torch.float32)


CASES = ["greedy", "sampled", "second", "batched", "shared"]
# the quick suite: one case per family, each case in some family
QUICK = dict(ouro="greedy", huginn="sampled", parcae="batched", loopformer="second",
             llama="shared", olmo2="greedy")


def matrix():
    return [(kind, case) if QUICK[kind] == case
            else pytest.param(kind, case, marks=pytest.mark.slow)
            for kind in FAMILIES for case in CASES]


@pytest.mark.parametrize("kind,case", matrix())
def test_the_cuda_path_equals_ar(kind, case, imitation):
    """WFD (DtV too, greedy) through the CUDA path, drafts forced wrong at every fourth position:
    compiled AR's tokens and logits at the same width, bit for bit, and eager AR's tokens."""
    waits, replays = imitation
    model = family_model(kind)
    T, V = model.num_steps, model.args.vocab_size
    batched, quick = case == "batched", QUICK[kind] == case
    prompts = prompts_for(model, 3, 1, longest=3) if batched else [3, 1, 4]
    # positions up to 15, one key block then two; quick: up to 7, one (half the graphs to compile)
    k, n_new, capacity = 1, 5 if quick else 11, 8 if quick else 16
    kw = dict(capacity=capacity, draft_steps=k, keep_logits=True,
              **dict(greedy={}, sampled=dict(temperature=0.8, top_k=20, seed=5),
                     second=dict(second_depth=T - 1), batched=dict(batch_size=2),
                     shared=dict(kv="shared"))[case])
    wrong = lambda pos, token, depth=None: (token + 1) % V if pos % 4 == 0 else token
    hook = (lambda i, *a, **d: wrong(*a, **d)) if batched else wrong
    run = lambda method, **more: engine.generate(model, prompts, n_new, method=method,
                                              compile=True, **kw, **more)
    outs = {"wfd": run("wfd", draft_hook=hook)}
    width = (outs["wfd"][0] if batched else outs["wfd"]).stats["width"]
    if case == "greedy":
        outs["dtv"] = run("dtv", draft_hook=hook, width=width, draft_len=width - 1)
    ar = run("ar", width=width)
    kw.pop("second_depth", None)
    eager = engine.generate(model, prompts, n_new, method="ar", **kw)
    listed = lambda o: o if batched else [o]
    for method, out in outs.items():
        for o, a, e in zip(listed(out), listed(ar), listed(eager)):
            assert same_logits(o, a) and o.tokens == e.tokens, (method, o.stats["index"])
            assert o.stats["compiled"] and o.stats["cuda_graphs_rerecorded"] == 0
            if DEVICE == "cuda":
                assert o.stats["cuda_graphs_skipped"] == 0
    assert replays and waits.count > 0
    assert set(waits.devices) == {model.device}


def test_compiled_attention_on_the_cuda_path_runs_on_aten_kernels(monkeypatch):
    """A compiled call attends through einsum and SDPA on the CUDA path, through sums written out
    (kv_cache.block_attention) on a CPU. On an H200 the sums' Triton kernels summed a row in an order
    that depended on the graph, so that compiled WFD and AR parted at the first call across two
    key blocks (compiling.sums_written_out)."""
    model = model_of("ouro", 0, torch.float32)
    cache, sums = kv_cache.make_cache(model, 16, model.num_steps), []
    written_out = kv_cache.sums_written_out  # what the compiled call's prepare asks
    monkeypatch.setattr(kv_cache, "sums_written_out",
                        lambda device: sums.append(written_out(device)) or sums[-1])
    pos, depth = torch.tensor([9], device=DEVICE), torch.tensor([0], device=DEVICE)
    s = torch.zeros(1, model.args.dim, device=DEVICE)
    for cuda_path in ({"cuda"}, {"cuda", "cpu"}):
        monkeypatch.setattr(staging, "CUDA_PATH", cuda_path)
        model.r_body(s, None, model_runner.to_device(model, pos, depth, cache, compiled=True,
                                                    top=9))
    assert sums == ([False, False] if DEVICE == "cuda" else [True, False])


def test_a_staging_event_is_recorded_on_the_models_device(monkeypatch):
    """A copy to cuda:1 runs on cuda:1's stream whichever device is current (cuda:0 here): its
    event must be recorded there, or the wait on it waits for another device's work."""
    recorded = []

    class Event:
        def record(self, stream=None):
            recorded.append(stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    staging.cuda_event(torch.device("cuda", 1))
    assert recorded == ["stream of cuda:1"]


@pytest.mark.parametrize("device,flags,compiled", [
    ("cuda", [], True), ("cuda:0", [], True), ("cuda:1", [], True), ("cuda:0", ["--eager"], False),
    ("cpu", [], False), ("cpu", ["--compile"], True)])
def test_every_cuda_device_compiles_by_default(device, flags, compiled):
    p = args.Parser()
    args.add_decoding_args(p, "", "", "")
    parsed = p.parse_args(flags)
    parsed.device = device  # --device names its choices; the rule takes any CUDA device
    args.resolve_compile(parsed)
    assert parsed.compile == compiled
    assert args.compiling_line(3, 1.25, torch.device(device)).endswith(
        ", CUDA graphs; --eager runs without)" if "cuda" in device else "s (torch.compile)")
    with pytest.raises(ValueError, match="--compile and --eager contradict each other"):
        args.resolve_compile(p.parse_args(["--compile", "--eager"]))


# -- the rest of engine/ that the quick suite's decoding does not reach -------------------------

def test_static_caches_keep_the_latest_two_settings_and_free_memory_without_meminfo(monkeypatch):
    model = model_of("ouro", 0, torch.float32)
    caches = [memory.static_cache(model, capacity, model.num_steps, None)
              for capacity in (8, 16, 8, 32)]
    assert caches[0] is caches[2] and caches[1] is not caches[3]  # 8 was used again: kept
    assert list(memory.STATIC_CACHES[model].values()) == [caches[2], caches[3]]
    memory.free_static_caches(model)
    assert model not in memory.STATIC_CACHES
    # compiled decoding's default capacity: a power of two, one key block at least, the context
    # at most
    assert [checks.compiled_capacity(model, n) for n in (1, 9, 17, 1000)] == [
        8, 16, 32, model.args.max_seq_len]

    def missing(*args, **kw):
        raise FileNotFoundError("/proc/meminfo")
    monkeypatch.setattr(devices, "open", missing, raising=False)  # devices' alone
    assert devices.free_memory(torch.device("cpu")) is None


def test_compile_graphs_at_a_capacity_of_one_position_compiles_nothing(imitation):
    """Position 0 is the prefill's: a capacity of 1 leaves no call to warm up."""
    model = model_of("ouro", 0, torch.float32)
    assert engine.compile_graphs(model, [1], 1, capacity=1) == 0


def test_a_patched_block_reads_what_a_gathered_block_does():
    """Compiled decoding reads the branch columns through a Patch of every key block (one graph
    for every call), eager through each row's gathered columns: the same keys, with redirects at a
    block's first and last columns. (Compiled, these lines run only inside dynamo's trace, where
    coverage sees none.)"""
    model = model_of("ouro", 0, torch.float64)
    cache = kv_cache.make_cache(model, 16, model.num_steps, batch=1, branches=3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(0),
                              dtype=cache.k.dtype))
    lanes = lambda *rows: torch.tensor(rows)
    q = lanes([8, 3, -1], [15, 7, 0], [-1, -1, -1])  # positions read from a branch: -1 none
    j = lanes([0, 1, -1], [2, 0, 1], [-1, -1, -1])  # their branches
    last, rows = lanes([9], [15], [12]), lanes(0, 1, 2)
    blocks = {gather: cache.key_blocks(last, 2,
                                       branches=siblings.Branches(lanes(0, 1, -1), q, j, gather))
              for gather in (None, 0)}
    for patched, gathered in zip(blocks[None], blocks[0]):
        assert isinstance(patched[3], siblings.Patch) and torch.is_tensor(gathered[3])
        assert torch.equal(kv_cache.read(patched[0], cache.k, rows, patched[3]),
                           kv_cache.read(gathered[0], cache.k, rows, gathered[3]))
