"""torch.compile's plumbing for compiled decoding (docs/compiling.md): each call's device work
compiled at fixed shapes, the recompile limit raised to fit the graphs a generation may add, CUDA
graphs replayed with their outputs copied out (a decoder's graphs are made before they are timed
by model_runner.Decoder.warm_up)."""
import weakref
from functools import partial

import torch
from torch._dynamo.utils import counters

from engine import staging

COMPILED = weakref.WeakKeyDictionary()  # model -> {function: its compiled version}


def compiled(model, fn, room=0):
    """fn, device work of the model, compiled once for every later generation: on CUDA a CUDA graph
    per shape, on a CPU a C++ wrapper (quicker to enter). room: the graphs fn may still add in the
    caller's generation."""
    versions = COMPILED.setdefault(model, {})
    if fn not in versions:
        versions[fn] = compile_call(fn, graphs=model.device.type in staging.CUDA_PATH)
    if room:
        make_room(fn, room)
    return versions[fn]


def compile_call(fn, graphs):
    """fn compiled by torch.compile at fixed shapes; with graphs, each call replays a CUDA graph
    (mode "reduce-overhead"), in inductor's deterministic mode: each Triton reduction's block
    sizes, and so its order of additions, follow from its shapes, not from timing its first
    calls, which may choose differently for the same sums in two graphs (two key buckets)."""
    if graphs:
        graphed = torch.compile(fn, fullgraph=True, dynamic=False,
                                options={"triton.cudagraphs": True, "deterministic": True})
        return partial(replay, graphed)
    return torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})


def sums_written_out(device):
    """Whether compiled attention on `device` writes its products and sums out
    (kv_cache.block_attention's sums) rather than calling einsum and SDPA. On a CPU inductor's C++
    loops sum in an order set by the shapes alone, so every graph sums a row alike, and the fused
    loop reads each row's keys where they lie. On the CUDA path each graph's Triton kernels fuse
    those sums with their neighbours, which differ between a graph of one key bucket and of another:
    on an H200 a row's bits then depended on its call's bucket (deterministic mode or not). einsum
    and SDPA are aten kernels, the same in every graph."""
    return device.type not in staging.CUDA_PATH


def make_room(fn, graphs):
    """Under fullgraph, a compile past dynamo's recompile limit raises: raise the limit, before a
    generation, above the graphs fn has plus those the generation may add. Their number is bounded
    by the calls' shapes (widths, caches, kv_cache.KVCache.span's powers of two, the sampler's
    filters)."""
    config, n = torch._dynamo.config, len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn))
    config.recompile_limit = max(config.recompile_limit, n + graphs)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, n + graphs)


def replay(graphed, *args, **kwargs):
    """A call of a CUDA-graphed function: its outputs live in memory that the next replay
    overwrites, so the caller gets copies (a tuple's tensors each; its Nones, such as start_body's
    e in a family without one, as they are)."""
    torch.compiler.cudagraph_mark_step_begin()  # the last call's outputs are dead: copied out
    out = graphed(*args, **kwargs)
    if isinstance(out, tuple):
        return tuple(None if t is None else t.clone() for t in out)
    return out.clone()


def cuda_graph_counts(device):
    """CUDA graphs re-recorded and skipped so far in this process (0 and inductor's skip count
    off CUDA): cudagraph trees re-record a graph whose static inputs moved (a KV cache at a new
    address, where it is not guarded), and inductor skips graphs it cannot take (they run
    without CUDA graphs). Both must stay 0 while a compiled generation runs."""
    skipped = counters["inductor"]["cudagraph_skips"]
    if device.type not in staging.CUDA_PATH:
        return 0, skipped
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    rerecorded = 0 if manager is None else sum(
        n for per_node in manager.num_rerecord.values() for n in per_node.values())
    return rerecorded, skipped
