"""The scheduler: which sequences' calls run together. Every sequence runs its schedule (wfd.py,
engine/siblings.py); a turn gathers the sequences that wait for an R call into one R call, then
those that wait to read into one C call (model_runner.Decoder), and hands each its result. A
sequence that finishes frees its slot for the next prompt at once (refill: docs/batching.md).

The tick of the wavefront, as the engine runs it: wfd.wavefront yields Advance; Decoder.advance
runs a P call for the rows just started, then one R call over every row of every sequence; the
schedule yields Read; Decoder.read runs one C call and one transfer of its tokens; back in the
schedule, the verify, the commit, and the draft that starts the next row."""
from dataclasses import dataclass
from typing import Generator, Union

from wfd import Advance, Read


@dataclass
class Running:
    """A sequence in its slot: its schedule, and the call the schedule waits for."""
    seq: object  # an engine.sequence.Sequence
    schedule: Generator
    waits: Union[Advance, Read] = None


def decode(dec, queues, schedule, on_finish):
    """Every sequence through `schedule`, slot b taking queues[b]'s prompts one after another
    (refill). A turn runs one R call over the sequences that wait for one, then one C call over
    those that wait to read; a sequence that finishes frees its slot for the next prompt at once."""
    running = {}  # slot -> Running

    def admit(slot):
        while queues[slot]:
            seq = queues[slot].pop(0)
            if dec.prefill(seq, slot):  # done at its first token
                on_finish(seq)
                continue
            run = running[slot] = Running(seq, schedule(seq))
            run.waits = next(run.schedule)
            return

    def resume(run, out):
        """The call's result back to the schedule, which then waits for its next call or is done."""
        try:
            run.waits = run.schedule.send(out)
        except StopIteration:
            del running[run.seq.slot]
            on_finish(run.seq)
            admit(run.seq.slot)

    for slot in range(len(queues)):
        admit(slot)
    while running:
        advancing = [run for run in running.values() if isinstance(run.waits, Advance)]
        if advancing:
            dec.advance(advancing)
            for run in advancing:
                resume(run, None)
        reading = [run for run in running.values() if isinstance(run.waits, Read)]
        if reading:
            for run, out in zip(reading, dec.read(reading)):
                resume(run, out)
