"""The KV cache of a looped LM: static buffers written by absolute position, read by blocks.

A looped layer applied at depth d has its own slot, because a row at depth d attends to the depth-d
keys of earlier positions. Huginn's prelude and coda layers have one slot each. Rolling back a
rejected draft needs no copy: the rows are forgotten, their entries lie past every reader's
position until a new row at that position overwrites them, and reads never look past the reader.

Every buffer holds `batch` sequences side by side (the first dimension), one per slot of batched
decoding. A decode call of N lanes over B sequences gives each sequence N / B consecutive lanes, and
each lane reads and writes its own sequence only; a slot's next prompt overwrites the entries it
reads, and its stale ones lie past its rows like a rejected draft's.

A call reads its keys in blocks of BLOCK columns, each computed with the same shapes whatever the
call, and only the blocks that some row of the call can see (`span`, from the host's positions), so
attention costs what the rows read, not the capacity. A row's result depends on its own keys only
(README, "Exact in every precision"): see `attend_blocks`. Each buffer has one column past its
blocks, the scratch column: idle lanes of a call (position -1) write there and no block holds it.

A cache is allocated only when it fits in free memory (`new_cache`); compiled decoding keeps its
caches per model and setting (`static_cache`), because a CUDA graph replays on their addresses.
"""
import copy
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 256  # keys per attention block: a GPU's split-KV tile, and enough for a short CPU generation


@dataclass
class Step:
    """What one P / R / C call needs at every layer, built once per call by KVCache.prepare."""
    col: torch.Tensor            # [N] column each row writes: its position, or scratch for idle lanes
    span: int                    # key blocks the call reads; 0: the prefill, causal within its own keys
    blocks: list = ()            # per key block the call reads: (k, v, visible [N, block])
    first: object = 0            # each row's sequence's first slot in the buffers: 0, or [N]
    at_depth: object = None      # each row's first looped slot at its depth in the buffers: an int, or [N]
    depth: torch.Tensor = None   # [N] per-row depth (decode), or None: all rows at one depth
    depth0: int = 0              # that one depth
    seq: torch.Tensor = None     # [N] each row's sequence, or None: all rows in the first


class KVCache:
    def __init__(self, model, capacity, num_steps=None, per_depth=True, device=None, batch=1):
        a = model.args
        self.device, self.batch = device or model.device, batch
        self.n_core, self.num_steps, self.capacity = a.n_core, num_steps or model.num_steps, capacity
        self.block = min(BLOCK, capacity)  # a small cache is one block, of its own size
        self.scratch = -(-capacity // self.block) * self.block  # the blocks end where scratch begins
        # slot of looped layer j at depth d: d * n_core + j; prelude and coda layers after them
        self.depth_slots = self.num_steps * a.n_core if per_depth else 0
        # (sequence, slot) as one first dimension: sequence b's slots are rows b * seq_slots.. of it,
        # so a call writes the buffer itself (compiled: in place; written through a view, inductor
        # copied the whole buffer back at every call) and reads it with one index_select
        self.seq_slots = self.depth_slots + a.n_prelude + a.n_coda
        shape = (batch * self.seq_slots, a.n_kv_heads, self.scratch + 1, a.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=model.dtype)
        self.v = torch.zeros_like(self.k)

    def buffers(self):
        return [t for t in vars(self).values() if torch.is_tensor(t)]

    def slot(self, b):
        """The cache of the sequence in slot b alone, for its prefill: views, so its writes land here."""
        view = copy.copy(self)
        one = lambda t: t.view(self.batch, t.shape[0] // self.batch, *t.shape[1:])[b]  # [sequences * X, ...] -> [X, ...]
        view.__dict__.update({name: one(t) for name, t in vars(self).items() if torch.is_tensor(t)}, batch=1)
        return view

    @property
    def nbytes(self):
        return sum(t.nbytes for t in self.buffers())

    def span(self, pos, bucket=False):
        """On the host, before a call (pos: int64 [N], -1 for idle lanes; no device sync): the key
        blocks its rows can see, or 0 for the prefill (the only call holding position 0). bucket: rounded
        up to a power of two, so that compiled decoding makes one graph per power, not per block."""
        pos = pos.tolist()  # one read, not one per element
        top = max(pos)
        if top >= self.capacity:
            raise IndexError(f"position {top} is past the KV cache's capacity of {self.capacity} positions")
        if pos[0] == 0:
            return 0
        n = top // self.block + 1
        return min(1 << (n - 1).bit_length(), self.scratch // self.block) if bucket else n

    def buckets(self):
        """Every value span(bucket=True) can take: the powers of two below the number of blocks, and it."""
        n = self.scratch // self.block
        return [1 << i for i in range((n - 1).bit_length())] + [n]

    def prepare(self, pos, depth, span):
        """Once per call, on the device: device work only, so that a compiled call takes it in.
        pos: int64 [N], -1 for idle lanes; depth: an int (every row) or an int64 tensor [N] (one per row).
        The views and indices every layer reads are made here, once, not at every layer."""
        lanes = pos.shape[0]
        if lanes % self.batch:
            raise ValueError(f"a call of {lanes} lanes cannot split evenly over {self.batch} sequences")
        col = torch.where(pos < 0, self.scratch, pos)
        blocks = []
        if span:  # idle lanes (col: scratch) see every key: finite, and dropped
            visible = torch.arange(span * self.block, device=pos.device)[None] <= col[:, None]
            blocks = [(self.k.narrow(2, lo, self.block), self.v.narrow(2, lo, self.block), vis)
                      for lo, vis in zip(range(0, span * self.block, self.block),
                                         visible.split(self.block, 1) if span > 1 else [visible])]
        per_row = torch.is_tensor(depth)
        step = Step(col, span, blocks, at_depth=None if depth is None else depth * self.n_core,
                    depth=depth if per_row else None, depth0=None if per_row else depth)
        if self.batch > 1:  # lane i's sequence: i // (lanes per sequence); its slots begin at seq * slots
            step.seq = torch.arange(lanes, device=pos.device) // (lanes // self.batch)
            step.first = step.seq * self.seq_slots
            step.at_depth = None if depth is None else step.at_depth + step.first
        return step

    def attend(self, step, layer, q, k, v):
        """Write this call's keys and values, then attend each row (q [N, H, hd]) to the visible
        keys of its sequence's slot for this layer at the row's depth."""
        if layer < self.n_core:
            at = step.at_depth + layer
        else:  # prelude and coda: one slot for every depth
            at = step.first + self.depth_slots + layer - self.n_core
        # one index_put on the buffer itself, whatever the rows: written through a view (self.k[at]),
        # compiled decoding copied the whole slot back at every call
        rows = at if torch.is_tensor(at) else torch.full_like(step.col, at)
        self.k[rows, :, step.col], self.v[rows, :, step.col] = k, v  # k, v [N, Hkv, hd]
        if step.span == 0:
            return causal_attention(q, k, v)
        if torch.is_tensor(at):  # each row its own keys: one index_select over (sequence, slot)
            return attend_blocks(q, [(bk.index_select(0, at), bv.index_select(0, at), visible)
                                     for bk, bv, visible in step.blocks])
        return attend_blocks(q, [(bk[at:at + 1], bv[at:at + 1], visible) for bk, bv, visible in step.blocks])  # keys all rows share


def causal_attention(q, k, v):
    """Attention of positions 0..N-1 among themselves (q, k, v [..., N, heads, hd]): the prefill,
    and the full forward without a cache. 4-D, so that SDPA's fused kernels take it."""
    q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]).transpose(1, 2) for t in (q, k, v))  # [batch, heads, N, hd]
    y = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    return y.transpose(1, 2).reshape(q.shape)


def wide(dtype):
    """The precision of attention's sums: float32, or the input's when wider."""
    return torch.promote_types(dtype, torch.float32)


def block_attention(q, k, v, visible, need_lse):
    """q [N, H, hd] against one block: k, v [N, Hkv, B, hd] (each row its own keys) or [1, Hkv, B, hd]
    (keys all rows share), visible [N, B]. Returns the output [N, H, hd], normalized within the block,
    and with need_lse its log-sum-exp [N, H] in at least float32 (-inf where the row sees nothing)."""
    n, heads, hd = q.shape
    shared = k.shape[0] == 1 and n > 1
    # compiled, each row's own keys: the sums written out, which inductor fuses into one loop that
    # reads each row's slot where it lies; eager, SDPA over the gathered block costs less (README,
    # "Compiled decoding")
    sums = torch.compiler.is_compiling() and not shared
    lse = None
    if need_lse or sums:
        acc = wide(q.dtype)
        qg = q.to(acc).view(n, k.shape[1], -1, hd) * hd ** -0.5  # [N, Hkv, group, hd]
        if sums:  # products and sums, not a matmul, which would want the rows' keys copied out first
            scores = (qg[:, :, :, None] * k[:, :, None].to(acc)).sum(-1)
        else:
            scores = torch.einsum("nkgd,kbd->nkgb" if shared else "nkgd,nkbd->nkgb", qg, (k[0] if shared else k).to(acc))
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))  # [N, Hkv, group, B]
        lse = scores.logsumexp(-1, keepdim=True)
    if sums:
        y = ((scores - lse).exp()[..., None] * v[:, :, None].to(acc)).sum(-2).to(q.dtype).view(n, heads, hd)
    elif shared:
        y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=visible[None, None],
                                           enable_gqa=True)[0].transpose(0, 1)  # [1, H, N, hd] -> [N, H, hd]
    else:
        y = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible[:, None, None],
                                           enable_gqa=True)[:, :, 0]             # [N, H, 1, hd] -> [N, H, hd]
    return y, (lse.view(n, heads) if need_lse else None)


def attend_blocks(q, blocks):
    """q [N, H, hd] against a list of blocks (k, v, visible: see block_attention), merged by their
    log-sum-exps in a fixed order. Why a row's result does not depend on the other rows of its call:
    every block has the same shapes in every call, and a block the row cannot see has lse -inf, so
    its weight exp(lse - total) is exactly 0 (its output, NaN for an empty softmax, is dropped), and
    logaddexp(total, -inf) is exactly total: the row gets the bits of a call of its own blocks only.
    One block needs no merge: its weight would be exp(0) = 1."""
    if len(blocks) == 1:
        return block_attention(q, *blocks[0], need_lse=False)[0]
    outs = [block_attention(q, k, v, visible, need_lse=True) for k, v, visible in blocks]
    total = outs[0][1]
    for _, lse in outs[1:]:
        total = torch.logaddexp(total, lse)
    y = 0
    for o, lse in outs:
        w = (lse - total).exp()[..., None]  # [N, H, 1]
        y = y + torch.where(w > 0, o.to(w.dtype), 0) * w
    return y.to(q.dtype)


class SharedKVCache(KVCache):
    """Cross-recurrence KV sharing that stays exact with respect to its own AR (README, "Exact
    cross-recurrence KV sharing"): after the prompt, a row at position p and depth d reads the
    depth-d KV of positions p - window < q <= p, from a ring of max(window, 2 * window - 2) entries,
    and the final-depth KV of every older position."""

    def __init__(self, model, capacity, num_steps, window, device=None, batch=1):
        super().__init__(model, capacity, num_steps, per_depth=False, device=device, batch=batch)  # prelude and coda slots only
        a = model.args
        self.window = window
        self.ring = min(max(window, 2 * window - 2), capacity)
        # one first dimension, as in KVCache (written in place): final row of (sequence s, layer j):
        # s * n_core + j; ring row of (s, depth d, j): (s * T + d) * n_core + j
        final = (batch * a.n_core, a.n_kv_heads, self.scratch + 1, a.head_dim)
        ring = (batch * self.num_steps * a.n_core, a.n_kv_heads, self.ring + 1, a.head_dim)  # + a scratch entry
        self.final_k = torch.zeros(final, device=self.device, dtype=model.dtype)
        self.final_v = torch.zeros_like(self.final_k)
        self.ring_k = torch.zeros(ring, device=self.device, dtype=model.dtype)
        self.ring_v = torch.zeros_like(self.ring_k)

    def attend(self, step, layer, q, k, v):
        if layer >= self.n_core:
            return super().attend(step, layer, q, k, v)
        last_depth = self.num_steps - 1
        if step.depth is None:
            # the prefill of one sequence (a slot's view: sequence 0): every prompt position at one
            # depth, reading that depth only
            n, ring_row = len(step.col), step.depth0 * self.n_core + layer
            last = slice(max(0, n - self.ring), None)  # the ring keeps the latest
            self.ring_k[ring_row][:, step.col[last] % self.ring] = k[last].transpose(0, 1)
            self.ring_v[ring_row][:, step.col[last] % self.ring] = v[last].transpose(0, 1)
            if step.depth0 == last_depth:
                self.final_k[layer][:, step.col] = k.transpose(0, 1)
                self.final_v[layer][:, step.col] = v.transpose(0, 1)
            return causal_attention(q, k, v)
        col, d, idle = step.col, step.depth, step.col == self.scratch
        seq = torch.zeros_like(col) if step.seq is None else step.seq  # each row's sequence, a tensor:
        final_row = seq * self.n_core + layer                          # so that every write is one
        ring_row = (seq * self.num_steps + d) * self.n_core + layer     # index_put on the buffer itself
        # every row writes its ring entry and, at the last depth, its final entry; the rest go to scratch
        ring_col = torch.where(idle, self.ring, col % self.ring)
        self.ring_k[ring_row, :, ring_col], self.ring_v[ring_row, :, ring_col] = k, v
        final_col = torch.where(d == last_depth, col, self.scratch)
        self.final_k[final_row, :, final_col], self.final_v[final_row, :, final_col] = k, v
        # first each row's own window (p - window, p] at its depth, from the ring (never empty: it holds
        # p), then the final-depth blocks, visible up to p - window (shared by all rows of one sequence)
        wpos = col[:, None] + torch.arange(1 - self.window, 1, device=q.device)  # [N, window]
        window = (self.ring_k[ring_row[:, None], :, wpos % self.ring].transpose(1, 2),  # [N, Hkv, window, hd]
                  self.ring_v[ring_row[:, None], :, wpos % self.ring].transpose(1, 2), wpos >= 0)
        visible = torch.arange(step.span * self.block, device=q.device)[None] <= col[:, None] - self.window
        final = (lambda t: t[layer:layer + 1]) if step.seq is None else (lambda t: t.index_select(0, final_row))
        blocks = [(final(self.final_k.narrow(2, lo, self.block)), final(self.final_v.narrow(2, lo, self.block)),
                   visible[:, lo:lo + self.block]) for lo in range(0, step.span * self.block, self.block)]
        return attend_blocks(q, [window] + blocks)


def cache_bytes(model, capacity, num_steps, window=None, batch=1):
    """The bytes make_cache would allocate, from its buffers built on the meta device (generate
    checks them against free memory before allocating)."""
    return make_cache(model, capacity, num_steps, window, device="meta", batch=batch).nbytes


def make_cache(model, capacity, num_steps, window=None, device=None, batch=1):
    """A full per-depth cache, or with a window the shared one (on the model's device by default),
    for `batch` sequences of `capacity` positions each."""
    return (KVCache(model, capacity, num_steps, device=device, batch=batch) if window is None else
            SharedKVCache(model, capacity, num_steps, window, device, batch))


def free_memory(device):
    """Bytes a new allocation on `device` can take: on CUDA the device's free memory plus what torch's
    caching allocator holds unused; on a CPU MemAvailable (None where /proc/meminfo is missing)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def new_cache(model, capacity, num_steps, window, slots=1):
    """make_cache, refused in one line when the cache does not fit in free memory: a generation
    asking for 90 GiB would otherwise die in the middle of allocating it."""
    need, free = cache_bytes(model, capacity, num_steps, window, slots), free_memory(model.device)
    if free is not None and need > free:
        low, high = 0, capacity  # the largest capacity that fits: the bytes grow with the capacity
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if cache_bytes(model, mid, num_steps, window, slots) <= free else (low, mid - 1)
        batch = f"{slots} sequences of " if slots > 1 else ""
        raise ValueError(f"the KV cache for {batch}{capacity} positions needs {need} bytes ({need / 2**30:.2f} GiB), but "
                         f"{model.device} has {free} bytes free: at most {low} positions (prompt + max_new_tokens "
                         "- 1) fit; ask for fewer new tokens{', a smaller batch_size' if slots > 1 else ''}, or use kv='shared' or a smaller dtype")
    return make_cache(model, capacity, num_steps, window, batch=slots)


STATIC_CACHES = weakref.WeakKeyDictionary()  # model -> {cache settings: KV cache}, the latest last
KEEP_STATIC_CACHES = 2


def static_cache(model, capacity, num_steps, window, slots=1):
    """The KV cache of compiled decoding, kept per model and setting and zeroed for each generation:
    a CUDA graph replays on its buffers' addresses (marked static: the graph writes them). The
    KEEP_STATIC_CACHES latest settings are kept; free_static_caches(model) drops them all."""
    key = (capacity, num_steps, window, slots, BLOCK, model.device, model.dtype)
    caches = STATIC_CACHES.setdefault(model, {})
    if key not in caches:
        while len(caches) >= KEEP_STATIC_CACHES:
            del caches[next(iter(caches))]
        caches[key] = new_cache(model, capacity, num_steps, window, slots)
        for t in caches[key].buffers():
            torch._dynamo.mark_static_address(t)
    caches[key] = caches.pop(key)  # the latest last
    for t in caches[key].buffers():
        t.zero_()  # nothing of an earlier generation can be read, but stale NaN times a 0 weight is NaN
    return caches[key]


def free_static_caches(model):
    STATIC_CACHES.pop(model, None)
