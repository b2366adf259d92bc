"""The CUDA path run before a GPU (docs/compiling.md): on a CPU the `imitation` fixture sends every
generation down the path that CUDA takes, compiled calls through torch.compile's mode
"reduce-overhead" and `compiling.replay` (on a CPU inductor skips only the graph capture; a
stand-in pool overwrites each replay's outputs at the next), the staging ring of several chunks on
a stand-in stream whose copies land only when their events are waited on, and the CUDA-graph
counters. Under it every family gives compiled AR's tokens and logits, bit for bit, and eager
AR's tokens, greedy, sampled, with the second proposal, batched with refill and with shared KV.
With WFD_TEST_DEVICE=cuda (gpu_check.sh) the same tests run on the GPU for real: CUDA graphs,
pinned staging, CUDA events."""
import functools

import pytest
import torch

import engine
from cli import args
from engine import checks, compiling, kv_cache, memory, model_runner, siblings, staging
from formats import devices
from host_reads import HostReads
from test_batch import prompts_for
from test_siblings import FAMILIES, model_of
from test_engine import DEVICE, same_logits


class CopyStream:
    """The stream that the staging's copies run on. On a CPU a stand-in that keeps a GPU's order:
    a copy is in flight from its issue until an event recorded after it is waited on (copies land
    in order, whatever the tick's reads do); the calls read what it copied, as on a GPU, where they
    run after it on its stream. It notes in `faults` a host chunk copied again while its last copy
    was in flight: the host had written it, and on a GPU that copy, run late, would carry the new
    contents to the call before (wrong tokens, with no error). It notes too a wait for a copy past
    the chunk's own: on a GPU the host would then wait for the device at every call, where the ring
    lets it run `ring - 1` copies ahead. On CUDA: the real copies and events, the waits counted."""

    def __init__(self, cuda):
        self.cuda, self.devices, self.waits, self.faults = cuda, [], 0, []
        self.issued, self.landed = [], 0  # the host chunks copied, in order; the copies landed
        self.last = {}  # a host chunk's address: the index of its last copy

    def copy(self, device_chunk, host_chunk):
        if self.cuda:
            return staging.copy_async(device_chunk, host_chunk)
        n, last = len(self.issued), self.last.get(host_chunk.data_ptr())
        if last is not None and last >= self.landed:
            self.faults.append(f"copy {n}: its chunk was written while copy {last} was in flight")
        elif last is not None and self.landed > last + 1:
            self.faults.append(f"copy {n}: the host waited for copy {self.landed - 1}, past its "
                               f"chunk's copy {last}")
        device_chunk.copy_(host_chunk)
        self.issued.append(host_chunk)  # kept alive: no later chunk takes its address
        self.last[host_chunk.data_ptr()] = n

    def record(self, device):
        """An event after the copies issued so far: waited on, they have landed."""
        self.devices.append(device)
        stream, event = self, staging.cuda_event(device) if self.cuda else len(self.issued)

        class Event:
            def synchronize(self):
                stream.waits += 1
                if stream.cuda:
                    return event.synchronize()
                stream.landed = max(stream.landed, event)
        return Event()


class GraphMemory:
    """CUDA graphs' output memory, on a CPU: a graph compiled for CUDA graphs (mode
    "reduce-overhead") hands out its outputs in memory of the graphs' pool, which the next replay
    of any graph overwrites (cudagraph trees share one pool). Here it fills every output handed
    out before with NaN (-1: integers, True: bools) as a replay begins, so that an output read
    after the next replay, not copied out first (compiling.replay), reads garbage."""
    handed = []  # the outputs of the last replay

    @classmethod
    def compile(cls, compile):
        """torch.compile, its graphs for CUDA graphs handing out their outputs as above."""
        def compile_graph(fn, *args, options=None, **kwargs):
            compiled = compile(fn, *args, options=options, **kwargs)
            return cls.graph(compiled) if (options or {}).get("triton.cudagraphs") else compiled
        return compile_graph

    @classmethod
    def graph(cls, compiled):
        def replayed(*args, **kwargs):
            for t in cls.handed:
                t.fill_(float("nan") if t.is_floating_point() else -1)
            out = compiled(*args, **kwargs)
            # the pool's copies: an output of inductor's may be an input of the call
            pooled = tuple(None if t is None else t.clone()
                           for t in (out if isinstance(out, tuple) else [out]))
            cls.handed = [t for t in pooled if t is not None]
            return pooled if isinstance(out, tuple) else pooled[0]
        return replayed


class StandInManager:
    """cudagraph trees' manager as the CUDA-graph counters read it: no graph re-recorded."""
    num_rerecord = {}


@pytest.fixture
def imitation(monkeypatch):
    """The CUDA path on this device: on a CPU, the path's device check passes for "cpu" too, the
    staging copies on a stand-in stream (CopyStream), torch.compile's CUDA-graph outputs live in
    a stand-in pool (GraphMemory), and cudagraph trees' manager is a stand-in. The staging ring
    holds 2 chunks (fewer than the calls between two reads of every schedule here, so that a
    chunk waits on its event). The replays are counted: yields (CopyStream, replays)."""
    stream = CopyStream(cuda=DEVICE == "cuda")
    if DEVICE != "cuda":
        from torch._inductor import cudagraph_trees
        monkeypatch.setattr(staging, "CUDA_PATH", staging.CUDA_PATH | {"cpu"})
        monkeypatch.setattr(cudagraph_trees, "get_manager", lambda index, create_if_none_exists:
                            StandInManager())
        monkeypatch.setattr(torch, "compile", GraphMemory.compile(torch.compile))
    monkeypatch.setattr(staging.Staging, "ring", 2)
    monkeypatch.setattr(staging.Staging, "copy", staticmethod(stream.copy))
    monkeypatch.setattr(staging.Staging, "record", staticmethod(stream.record))
    # replay begins each call with a step mark, looked up as it runs: counted even in a graph
    # compiled in an earlier test (family_model)
    replays, mark = [], torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin",
                        lambda: replays.append(1) or mark())
    yield stream, replays


def test_the_staging_writes_a_chunk_only_after_its_copy_and_waits_for_no_later_one(monkeypatch):
    """A ring of 3 chunks sent 10 times on the stand-in stream, with no read between: each chunk
    is written again only once its last copy has landed (its event waited on, an event recorded
    after the copy), and no later copy is waited for, so that 2 copies stay in flight; each call
    reads what its chunk was filled with."""
    stream = CopyStream(cuda=False)
    monkeypatch.setattr(staging, "CUDA_PATH", {"cuda", "cpu"})
    monkeypatch.setattr(staging.Staging, "ring", 3)
    monkeypatch.setattr(staging.Staging, "copy", staticmethod(stream.copy))
    monkeypatch.setattr(staging.Staging, "record", staticmethod(stream.record))
    ring = staging.Staging(torch.device("cpu"), 2, 4)
    for n in range(10):
        for line in ring.next():
            line[:] = n
        assert all(torch.equal(line, torch.full((4,), n)) for line in ring.send())
        assert stream.faults == [] and stream.landed == max(0, n - 2)
    assert stream.waits == 7 and set(stream.devices) == {
        torch.device("cpu")}


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
# the quick suite: one case per family, each case in some family; the whole suite adds a second
# such round on a CPU (the imitation), and on CUDA (scripts/gpu_check.sh) every pair
QUICK = dict(ouro="greedy", huginn="sampled", parcae="batched", loopformer="second",
             llama="shared", olmo2="greedy")
SECOND = dict(ouro="shared", huginn="batched", parcae="second", loopformer="sampled",
              llama="greedy", olmo2="sampled")


def matrix():
    return [(kind, case) if QUICK[kind] == case
            else pytest.param(kind, case, marks=pytest.mark.slow)
            for kind in FAMILIES for case in CASES
            if DEVICE == "cuda" or case in (QUICK[kind], SECOND[kind])]


@pytest.mark.parametrize("kind,case", matrix())
def test_the_cuda_path_equals_ar(kind, case, imitation):
    """WFD (DtV too, greedy) through the CUDA path, drafts forced wrong at every fourth position:
    compiled AR's tokens and logits at the same width, bit for bit, and eager AR's tokens."""
    stream, replays = imitation
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
    assert replays and stream.waits > 0 and stream.faults == []
    assert set(stream.devices) == {model.device}


def test_compiled_attention_on_the_cuda_path_runs_on_aten_kernels(monkeypatch):
    """A compiled call attends through einsum and SDPA on the CUDA path, through sums written out
    (kv_cache.block_attention) on a CPU. On an H200 the sums' Triton kernels summed a row in an
    order that depended on the graph, so that compiled WFD and AR parted at the first call across
    two key blocks (compiling.sums_written_out)."""
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


def test_cudas_sync_check_is_on_after_the_prefill_but_in_fetch(monkeypatch):
    """HostReads(sync_debug=True), CUDA's own check of synchronizing calls, on a CPU with a
    stand-in for torch.cuda.set_sync_debug_mode: two prompts through one slot (the second's
    prefill after the first's decoding); each prompt's prefill (its T R calls and its fetch) and
    every fetch run under "default", every other R call under "error", and the generation ends
    under "default"."""
    mode, seen = ["default"], []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__(0, m))
    recur, fetch = model_runner.recur, model_runner.fetch
    monkeypatch.setattr(model_runner, "recur", lambda *a: seen.append(("R", mode[0])) or recur(*a))
    monkeypatch.setattr(model_runner, "fetch",  # the counter's fetch calls this one
                        lambda t: seen.append(("fetch", mode[0])) or fetch(t))
    model = family_model("ouro")
    T, counter = model.num_steps, HostReads(monkeypatch, model.device, sync_debug=True)
    with counter:
        outs = engine.generate(model, [[3, 1, 4], [2, 7]], 6, batch_size=1)
    for out in outs:
        n = out.stats["r_calls"] + 1 + out.stats["host_syncs"]  # its prefill's fetch, then ticks'
        events, seen[:n] = seen[:n], []
        assert events[:T + 1] == [("R", "default")] * T + [("fetch", "default")]
        assert sorted(events[T + 1:]) == sorted([("R", "error")] * (out.stats["r_calls"] - T)
                                                + [("fetch", "default")] * out.stats["host_syncs"])
    assert seen == [] and mode == ["default"]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA's own check of synchronizing calls")
@pytest.mark.parametrize("compiled", [False, True])
def test_decoding_makes_no_synchronizing_cuda_call_after_the_prefill(compiled, monkeypatch):
    """On CUDA, decoding after the prefill runs under torch.cuda.set_sync_debug_mode("error") but
    in fetch, the tick's one transfer (a copy to pageable host memory: a synchronizing call), so
    that any other synchronizing call (a read of a tensor's values, a blocking copy either way, a
    stream's synchronize) raises; the staging's waits on its events are not such calls (copies
    long done). Eager, every family, counted at the dispatcher too: greedy WFD, one prompt and two
    batched, and sampled WFD with the second proposal. Compiled (CUDA's default: CUDA graphs
    replayed), Huginn's sampled WFD after compile_graphs made its graphs (the settings of its
    quick case above, whose graphs it shares in one process)."""
    counter = HostReads(monkeypatch, DEVICE, dispatch=not compiled, sync_debug=True)
    sampled = dict(temperature=0.8, top_k=20, seed=5)
    for kind in ["huginn"] if compiled else FAMILIES:
        model = family_model(kind)
        runs = [([3, 1, 4], sampled)] if compiled else [
            ([3, 1, 4], {}), ([[3, 1, 4], [2, 7]], {}),
            ([5, 9], dict(sampled, second_depth=model.num_steps - 1))]
        for prompts, kw in runs:
            kw = dict(kw, draft_steps=1, capacity=8, compile=compiled)
            if compiled:
                engine.compile_graphs(model, prompts, 5, **kw)
            with counter:
                outs = engine.generate(model, prompts, 5, **kw)
            assert counter.reads == [] and counter.sent == [], (kind, kw, counter.reads)
            assert compiled or all(len(reads) == 1 for reads in counter.fetches)
            for out in outs if isinstance(outs, list) else [outs]:
                assert out.stats["host_syncs"] > 0 and out.stats["graphs_compiled"] == 0


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
