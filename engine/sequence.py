"""The engine's rows and sequences: wfd.py's, with what running them in lanes, batches and traces
adds. The schedules (wfd.py, engine/siblings.py) call the same verbs on them."""
import hashlib
from dataclasses import dataclass, field

import wfd


@dataclass(eq=False)
class Row(wfd.Row):
    serial: int = 0          # its number among its sequence's rows, in the order they started
    lane: int = None         # the lane that holds its state, given by its P call (Decoder.start)
    # the second proposal (engine/siblings.py): the row it was proposed from, while that is in
    # flight; the rows proposed from it; whether its token came from the read at the second depth
    # (a sibling); the branch column holding its keys when it is the second row at its position
    # (siblings.BranchColumns; None: its position's own)
    parent: "Row" = None
    children: list = field(default_factory=list)
    sibling: bool = False
    branch: int = None


class Sequence(wfd.Sequence):
    """One prompt in flight in the engine: wfd.Sequence, and its place among the batch (index,
    slot), its sampling key, its trace, its kept or digested logits, its callbacks."""

    def __init__(self, index, prompt, max_new_tokens, num_steps, *, key, stop, batched, width,
                 draft_hook=None, on_token=None, trace=None, keep_logits=False,
                 digest_logits=False):
        super().__init__(prompt, max_new_tokens, num_steps, stop, draft_hook, on_token,
                         keep_logits)
        self.index, self.key, self.batched = index, key, batched
        self.width = width  # the rows in flight its lanes hold
        self.trace = trace
        self.digest = hashlib.blake2b(digest_size=16) if digest_logits else None  # committed rows'
        self.entry = None  # its latest trace entry
        self.slot, self.t0 = None, None  # set by its prefill
        self.serials = 0  # rows started so far
        # r_seconds: host time in its R calls after the prefill (bench.py); host_syncs: the
        # blocking transfers after the prefill (reads of its C calls' tokens: one per tick at most).
        # proposed: rows started from a read at the second depth m (engine/siblings.py), whose
        # verify may end rescued (a second proposal kept) besides accepted or rejected
        self.stats = dict(index=index, **self.stats, proposed=0, rescued=0, r_seconds=0.0,
                          host_syncs=0)

    def start(self, pos, token, parent=None, sibling=False):
        """wfd.Sequence.start; parent: the row it is proposed from (engine/siblings.py); sibling:
        its token came from the read at the second depth."""
        self.serials += 1
        row = Row(pos, token, serial=self.serials, parent=parent, sibling=sibling)
        if sibling:
            self.stats["proposed"] += 1
            self.mark("proposed", parent)
        if parent is not None:
            parent.children.append(row)
        self.starting.append(row)
        return row

    def mark(self, what, *rows):
        """The trace's note of this tick: what happened to which rows (for draw_wavefront)."""
        if self.entry is not None:
            self.entry.setdefault(what, []).extend(r.serial for r in rows)

    def draft(self, row, out, depth=None):
        """wfd.Sequence.draft; with depth (the second depth m), a second proposal's token, which the
        draft hook is told of by its depth."""
        if depth is None:
            self.mark("drafted", row)
            return super().draft(row, out)
        if self.draft_hook:
            return self.draft_hook(row.pos + 1, out.token, depth=depth)
        return out.token

    def verify(self, row, target):
        ok = super().verify(row, target)
        self.mark("accepted" if ok else "rejected", row)
        return ok

    def commit(self, out):
        """wfd.Sequence.commit of a LaneReadout (engine/model_runner.py), its logits refused when
        not finite, kept as a copy of the row or digested."""
        if not out.finite:  # argmax would quietly pick token 0
            where = f"prompt {self.index}: " if self.batched else ""
            pos = len(self.prompt) + len(self.tokens)
            raise ValueError(f"{where}the logits for position {pos} are not finite (fp16 overflow "
                             "or damaged weights)")
        if self.digest is not None:  # the row's hash, computed on the device (read_body)
            self.digest.update(out.digest.to_bytes(8, "little"))
        # a copy of the row: a view would keep the read's [lanes, V]
        kept = None if self.logits is None else out.logits[out.lane].clone()
        return super().commit(wfd.Readout(out.token, kept))
