"""Memory: what a new allocation can take, the weights and the KV cache refused in one line when
they do not fit (a generation asking for 90 GiB would otherwise die in the middle of allocating it),
and the KV caches of compiled decoding, kept per model and setting because a CUDA graph replays on
their addresses."""
import weakref

import torch

import kv


def free_memory(device):
    """Bytes a new allocation on `device` can take: on CUDA the device's free memory plus what
    torch's caching allocator holds unused; on a CPU MemAvailable (None where /proc/meminfo
    is missing)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_device(device):
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) has no CUDA or "
                         "sees no GPU; use the CPU")


def check_weights_fit(model, device, dtype):
    """Refuse, before anything is allocated, weights (of a model on the meta device) that do
    not fit."""
    need = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    free = free_memory(device)
    if free is not None and need > free:
        raise ValueError(f"the weights need {need / 2**30:.2f} GiB in "
                         f"{str(dtype).replace('torch.', '')}, but {device} has {free / 2**30:.2f} "
                         "GiB free: try a smaller dtype (--dtype bfloat16 halves float32), or a "
                         "device with more memory")


def new_cache(model, capacity, num_steps, window, slots=1, branches=0):
    """make_cache, refused in one line when the cache does not fit in free memory: a generation
    asking for 90 GiB would otherwise die in the middle of allocating it."""
    need, free = (kv.cache_bytes(model, capacity, num_steps, window, slots, branches),
                  free_memory(model.device))
    if free is not None and need > free:
        low, high = 0, capacity  # the largest capacity that fits: the bytes grow with the capacity
        while low < high:
            mid = (low + high + 1) // 2
            fits = kv.cache_bytes(model, mid, num_steps, window, slots, branches) <= free
            low, high = (mid, high) if fits else (low, mid - 1)
        batch = f"{slots} sequences of " if slots > 1 else ""
        raise ValueError(f"the KV cache for {batch}{capacity} positions needs {need} bytes "
                         f"({need / 2**30:.2f} GiB), but {model.device} has {free} bytes free: at "
                         f"most {low} positions (prompt + max_new_tokens - 1) fit; ask for fewer "
                         f"new tokens{', a smaller batch_size' if slots > 1 else ''}, or use "
                         "kv='shared' or a smaller dtype")
    return kv.make_cache(model, capacity, num_steps, window, batch=slots, branches=branches)


STATIC_CACHES = weakref.WeakKeyDictionary()  # model -> {cache settings: KV cache}, the latest last
KEEP_STATIC_CACHES = 2


def static_cache(model, capacity, num_steps, window, slots=1, branches=0):
    """The KV cache of compiled decoding, kept per model and setting and zeroed for each generation:
    a CUDA graph replays on its buffers' addresses (marked static: the graph writes them). The
    KEEP_STATIC_CACHES latest settings are kept; free_static_caches(model) drops them all."""
    key = (capacity, num_steps, window, slots, branches, kv.BLOCK, model.device, model.dtype)
    caches = STATIC_CACHES.setdefault(model, {})
    if key not in caches:
        while len(caches) >= KEEP_STATIC_CACHES:
            del caches[next(iter(caches))]
        caches[key] = new_cache(model, capacity, num_steps, window, slots, branches)
        for t in caches[key].buffers():  # guarded: a new address recompiles, never re-records
            torch._dynamo.mark_static_address(t, guard=True)
    caches[key] = caches.pop(key)  # the latest last
    for t in caches[key].buffers():
        # nothing of an earlier generation can be read, but stale NaN times a 0 weight is NaN
        t.zero_()
    return caches[key]


def free_static_caches(model):
    STATIC_CACHES.pop(model, None)
