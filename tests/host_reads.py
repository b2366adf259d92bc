"""The tests' count of a generation's blocking transfers after its prefill (docs/compiling.md):
every way a device tensor's values reach the host, and every tensor made of the host's data, seen
at the dispatcher, where `item`, `bool`, `int`, `float`, `if t:`, `torch.equal`, `nonzero`, a
boolean mask, and on a GPU `.cpu()`, `.to("cpu")` and `tolist` all arrive as aten ops, whichever
Python spelling made them.

On a CPU, the tests' device, every tensor that the engine touches after the prefill is the
device's: the host keeps its values in Python numbers and numpy arrays (engine.staging.Staging
fills numpy views of the tensors that the calls read). There a copy to the host dispatches nothing,
since the tensor is there already: `.to("cpu")` and `.cpu()` return it, and `tolist`, `numpy` and
`__array__` read its memory with no op that reads (numpy dispatches a detach alone). So on a CPU,
and only there, the counter also hooks those methods (`.to` when it names the CPU by name)."""
import functools
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import model_runner

aten = torch.ops.aten

# the ops whose result on the host is made of tensors' values, tagged data_dependent_output:
# `_local_scalar_dense` (item, bool, int, float, index, `if t:`, is_nonzero), `equal`, `allclose`;
# and those whose output's shape depends on the values, tagged dynamic_output_shape: nonzero,
# masked_select, unique, bincount, repeat_interleave, ... On a GPU each waits for the device's queue
DATA_DEPENDENT = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
# indexing by a mask reads it (the positions of its ones: nonzero on a GPU); an integer index
# reads nothing on the host
INDEXING = {aten.index, aten.index_put, aten.index_put_}


@functools.cache
def role(func):
    """What the op `func` may do that the counter counts: "reads" (its result on the host is made
    of tensors' values), "indexing" (reads when its index is a mask), "copy" (between devices, when
    its tensors are on two), "lift" (makes a tensor of host data: torch.tensor, torch.as_tensor,
    torch.from_numpy, a Python number assigned into a tensor), or None: every other op, the
    device's own work. Cached: the counter asks it of every op that a generation runs."""
    if func.overloadpacket in INDEXING:
        return "indexing"
    if any(tag in func.tags for tag in DATA_DEPENDENT):
        return "reads"
    if func in (aten._to_copy.default, aten.copy_.default):
        return "copy"
    return "lift" if func is aten.lift_fresh.default else None


def masked(indices):
    """Whether an index (aten.index's, aten.index_put's) holds a mask."""
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


class Copy(NamedTuple):
    """A copy: its source tensor, its destination's device, and whether it was asked not to block
    the host."""
    source: torch.Tensor
    destination: torch.device
    non_blocking: bool

    @staticmethod
    def of(func, args, kwargs):
        """The copy that `_to_copy` (.to, .cpu, .cuda, tolist of a CUDA tensor) or `copy_` makes."""
        if func is aten._to_copy.default:
            source = args[0]
            return Copy(source, torch.device(kwargs.get("device") or source.device),
                        kwargs.get("non_blocking", False))
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return Copy(args[1], args[0].device, non_blocking)

    def to_host(self):
        return self.source.device.type != "cpu" and self.destination.type == "cpu"

    def blocking_send(self):
        """A copy from the host to a device that blocks the host: any but one from pinned memory
        with non_blocking=True (engine.staging's)."""
        return (self.source.device.type == "cpu" and self.destination.type != "cpu"
                and not (self.non_blocking and self.source.is_pinned()))


def names_the_host(*args, device=None, **kwargs):
    """Whether Tensor.to's arguments name the host by its name, `.to("cpu")`. On a CPU a
    torch.device, or a tensor, names the device as well as the host (the engine's moves to the
    device, `.to(logits.device)`, copy nothing there, nor on a GPU): those are not counted."""
    target = args[0] if device is None and args else device
    return isinstance(target, str) and torch.device(target).type == "cpu"


class HostReads(TorchDispatchMode):
    """Counts, in each generation run under `with counter:`, every read of a device tensor's values
    by the host after the prefill: `reads`, those outside model_runner.fetch (the ops' names);
    `fetches`, for each call of fetch after the prefill (the tick's one blocking transfer), the
    reads it made; and `sent`, the tensors made of host data (aten.lift_fresh) and the copies
    from the host to a CUDA device that block it. The prefill reads freely: the count runs from
    the end of each call of Decoder.prefill to the start of the next, or the generation's end.

    dispatch=False: nothing counted at the dispatcher, for a compiled generation (under a dispatch
    mode dynamo runs compiled functions eagerly), so that only fetch (and on a CPU the methods
    hooked) are seen. sync_debug (CUDA): CUDA's own check too,
    torch.cuda.set_sync_debug_mode("error") wherever reads are counted, outside fetch, so that
    any synchronizing CUDA call there raises; "default" in the prefill and in fetch, whose read of
    the chosen tokens (a copy to pageable host memory) is one.

    It patches Decoder.prefill and fetch (on a CPU, Tensor's tolist, numpy, cpu and to too) with
    `monkeypatch`, for the test's duration: make one counter in a test, and enter it for each
    generation."""

    def __init__(self, monkeypatch, device, dispatch=True, sync_debug=False):
        super().__init__()
        self.dispatch, self.sync_debug = dispatch, sync_debug
        self.decoding = self.fetching = False
        self.reads, self.fetches, self.sent = [], [], []
        prefill, fetch = model_runner.Decoder.prefill, model_runner.fetch

        def counted_prefill(decoder, *args):
            self.mark(decoding=False)
            try:
                return prefill(decoder, *args)
            finally:
                self.mark(decoding=True)

        def counted_fetch(t):
            if not self.decoding:
                return fetch(t)
            self.fetches.append([])
            self.mark(fetching=True)
            try:
                return fetch(t)
            finally:
                self.mark(fetching=False)
        monkeypatch.setattr(model_runner.Decoder, "prefill", counted_prefill)
        monkeypatch.setattr(model_runner, "fetch", counted_fetch)
        if torch.device(device).type == "cpu":  # numpy: __array__ (np.asarray) calls it
            for name, reads in dict(tolist=None, numpy=None, cpu=None, to=names_the_host).items():
                method = getattr(torch.Tensor, name)

                def hooked(t, *args, method=method, name=name, reads=reads, **kwargs):
                    if reads is None or reads(*args, **kwargs):
                        self.note(f"Tensor.{name}")
                    return method(t, *args, **kwargs)
                monkeypatch.setattr(torch.Tensor, name, hooked)

    def mark(self, decoding=None, fetching=None):
        """Where the generation is: decoding (after a prefill), fetching (in fetch); with
        sync_debug, CUDA's check set to match."""
        self.decoding = self.decoding if decoding is None else decoding
        self.fetching = self.fetching if fetching is None else fetching
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode(
                "error" if self.decoding and not self.fetching else "default")

    def note(self, name):
        """A read of a device tensor's values by the host, by the op or method `name`."""
        if self.fetching:
            self.fetches[-1].append(name)
        elif self.decoding:
            self.reads.append(name)

    def __enter__(self):
        del self.reads[:], self.fetches[:], self.sent[:]
        self.mark(decoding=False, fetching=False)  # a generation begins with a prefill
        return super().__enter__() if self.dispatch else self

    def __exit__(self, *exc):
        self.mark(decoding=False)
        if self.dispatch:
            super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        does = role(func)
        if does is not None:
            copy = Copy.of(func, args, kwargs) if does == "copy" else None
            if does == "reads" or does == "indexing" and masked(args[1]) or copy and copy.to_host():
                self.note(str(func))
            elif self.decoding and (does == "lift" or copy and copy.blocking_send()):
                self.sent.append(str(func))
        return func(*args, **kwargs)
