"""The host's data for each call of decoding, sent to the device without blocking it, and the one
blocking read a tick makes.

On a GPU a copy from pageable host memory, and any read of a device tensor, make the host wait for
the device to finish all it was given; then the device idles while the host prepares the next call.
So decoding sends its per-call inputs (token ids, positions, depths) through `Staging`, pinned
memory copied without blocking, and reads back once per tick (`fetch`: the tokens a C call chose),
counting it."""
import torch


class Staging:
    """Per-call int64 inputs for the device: `next()` hands out a chunk of host arrays (numpy) for
    the host to fill, `send()` returns it on the device, both as views(chunk) (default: a tuple of
    its lines). On CUDA the host arrays are pinned memory, a
    ring of `ring` chunks copied with non_blocking=True; a chunk is filled again only after its copy
    has run (its event), since the device may be several calls behind. On a CPU the host array
    is the device tensor itself, used by the call before the next one is filled."""

    def __init__(self, device, rows, size, ring=64, views=tuple):
        self.cuda = device.type == "cuda"
        ring = ring if self.cuda else 1
        self.host = torch.zeros(ring, rows, size, dtype=torch.int64, pin_memory=self.cuda)
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
            self.device[self.i].copy_(self.host[self.i], non_blocking=True)
            self.events[self.i] = torch.cuda.Event()
            self.events[self.i].record()
        return self.lines[self.i]


def fetch(t):
    """A device tensor's values on the host, as lists: a blocking transfer (the device's work so
    far finishes first)."""
    return t.tolist()
