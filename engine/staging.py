"""The host's data for each call of decoding, sent to the device without blocking it, and the one
blocking read a tick makes.

On a GPU a copy from pageable host memory, and any read of a device tensor, make the host wait for
the device to finish all it was given; then the device idles while the host prepares the next call.
So decoding sends its per-call inputs (token ids, positions, depths) through `Staging`, pinned
memory copied without blocking, and reads back once per tick (`fetch`: the tokens a C call chose),
counting it."""
import torch

# the device types that take the CUDA path: staging through a ring of chunks with events (below),
# compiled calls replaying CUDA graphs (engine/compiling.py). The tests' imitation of that path on a
# CPU (tests/test_cuda_path.py) adds "cpu"; the CPU path is otherwise never told from it.
CUDA_PATH = {"cuda"}


def cuda_event(device):
    """An event recorded, now, on `device`'s current stream: the stream that a copy to that device
    just issued runs on, whichever device is current."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def copy_async(device_chunk, host_chunk):
    """host_chunk copied to device_chunk without blocking the host: issued on the device's current
    stream, it runs when the device reaches it, before the calls issued after it."""
    device_chunk.copy_(host_chunk, non_blocking=True)


class Staging:
    """Per-call int64 inputs for the device: `next()` hands out a chunk of host arrays (numpy) for
    the host to fill, `send()` returns it on the device, both as views(chunk) (default: a tuple of
    its lines). On the CUDA path the host arrays are a ring of `ring` chunks (pinned memory on
    CUDA) copied with non_blocking=True; a chunk is filled again only after its copy has run (the
    event `record(device)` made as it was issued), since the device may be several calls behind.
    On a CPU the host array is the device tensor itself, used by the call before the next one is
    filled. `copy` and `record` are seams for the tests' stand-in stream
    (tests/test_cuda_path.py)."""
    ring = 64
    copy = staticmethod(copy_async)
    record = staticmethod(cuda_event)

    def __init__(self, device, rows, size, views=tuple):
        self.cuda = device.type in CUDA_PATH
        ring = self.ring if self.cuda else 1
        self.host = torch.zeros(ring, rows, size, dtype=torch.int64,
                                pin_memory=device.type == "cuda")
        # each chunk's views, on the host to fill and on the device to read, made once: views
        # cost microseconds of host time
        self.filling = [views(chunk) for chunk in self.host.numpy()]
        self.device = torch.empty_like(self.host, device=device) if self.cuda else self.host
        self.lines = [views(chunk) for chunk in self.device]
        self.events = [None] * ring
        self.i = 0

    def next(self):
        """The next chunk's host arrays (numpy, int64, views of its [rows, size]), to fill before
        send()."""
        self.i = (self.i + 1) % len(self.filling)
        if self.events[self.i] is not None:
            self.events[self.i].synchronize()  # a copy issued `ring` calls ago: long done
        return self.filling[self.i]

    def send(self):
        """The chunk filled since next(), on the device, as views(chunk)."""
        if self.cuda:  # stream-ordered: the calls that read this chunk's last copy came before
            self.copy(self.device[self.i], self.host[self.i])
            self.events[self.i] = self.record(self.device.device)
        return self.lines[self.i]


def fetch(t):
    """A device tensor's values on the host, as lists: a blocking transfer (the device's work so
    far finishes first)."""
    return t.tolist()
