"""Memory: the KV cache refused in one line when it does not fit (a generation asking for 90 GiB
would otherwise die in the middle of allocating it; the weights are checked as they load:
formats/devices.py), and the KV caches of compiled decoding, kept per model and setting because a
CUDA graph replays on their addresses."""
import weakref

import torch

from engine import kv_cache
from formats import devices


def new_cache(model, capacity, num_steps, window, slots=1, branches=0):
    """make_cache, refused in one line when the cache does not fit in free memory: a generation
    asking for 90 GiB would otherwise die in the middle of allocating it."""
    need, free = (kv_cache.cache_bytes(model, capacity, num_steps, window, slots, branches),
                  devices.free_memory(model.device))
    if free is not None and need > free:
        low, high = 0, capacity  # the largest capacity that fits: the bytes grow with the capacity
        while low < high:
            mid = (low + high + 1) // 2
            fits = kv_cache.cache_bytes(model, mid, num_steps, window, slots, branches) <= free
            low, high = (mid, high) if fits else (low, mid - 1)
        batch = f"{slots} sequences of " if slots > 1 else ""
        raise ValueError(f"the KV cache for {batch}{capacity} positions needs {need} bytes "
                         f"({need / 2**30:.2f} GiB), but {model.device} has {free} bytes free: at "
                         f"most {low} positions (prompt + max_new_tokens - 1) fit; ask for fewer "
                         f"new tokens{', a smaller batch_size' if slots > 1 else ''}, or use "
                         "kv='shared' or a smaller dtype")
    return kv_cache.make_cache(model, capacity, num_steps, window, batch=slots, branches=branches)


STATIC_CACHES = weakref.WeakKeyDictionary()  # model -> {cache settings: KV cache}, the latest last
KEEP_STATIC_CACHES = 2


def static_cache(model, capacity, num_steps, window, slots=1, branches=0):
    """The KV cache of compiled decoding, kept per model and setting and zeroed for each generation:
    a CUDA graph replays on its buffers' addresses (marked static: the graph writes them). The
    KEEP_STATIC_CACHES latest settings are kept; free_static_caches(model) drops them all."""
    key = (capacity, num_steps, window, slots, branches, kv_cache.BLOCK, model.device, model.dtype)
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
