"""The wavefront's second proposal (docs/siblings.md): every row is read again at a second depth m
(k < m < T), and where that token differs from its draft, a sibling row starts at the same position
with it, so that a wrong draft is often rescued instead of restarted. Its schedule, the verify that
keeps one of several children, and what a second row at a position needs of the KV cache: a branch
column of its own (BranchColumns on the host, Branches on the device, read by kv_cache.py)."""
from typing import NamedTuple, Optional

import torch

from wfd import Advance, Read


def wavefront_siblings(seq, k, m):
    """The wavefront with a second proposal: every row is read at the draft depth k, its draft
    starting its first child at the next position, as in wavefront, and again at the second depth m
    (k < m < T): where that token differs from the first child's, a sibling starts at the same
    position with it. The rows in flight form a tree under the oldest; when the oldest reaches
    depth T, its full-depth token keeps the child that carries it, the draft or its sibling (a
    rescue), and drops the other with every row built on it; with neither, the position starts
    again. A row starts only while the lanes hold it (seq.width), drafts before siblings."""
    T, prompt = seq.num_steps, len(seq.prompt)
    oldest = seq.start(prompt, seq.tokens[-1])
    rows = [oldest]  # in flight, each after its parent

    def drop(row):
        rows.remove(row)
        for child in row.children:
            drop(child)

    while True:
        yield Advance(rows)
        verifying = oldest.depth == T
        drafting = [r for r in rows if r.depth == k and r.pos < seq.last_pos]
        proposing = [r for r in rows if r.depth == m and r.pos < seq.last_pos]
        reading = [oldest] * verifying + drafting + proposing
        out = dict(zip(reading, (yield Read(reading)))) if reading else {}
        if verifying:
            rows.remove(oldest)
            kept = keep(seq, oldest, out[oldest])
            for child in oldest.children:
                if child is not kept:
                    drop(child)
            if seq.commit(out[oldest]):
                return
            oldest = kept or seq.start(oldest.pos + 1, seq.tokens[-1])
            oldest.parent = None
            if not kept:
                rows.append(oldest)
        for r in drafting:
            if r in rows and len(rows) < seq.width:
                rows.append(seq.start(r.pos + 1, seq.draft(r, out[r]), parent=r))
        for r in proposing:
            if r in rows and len(rows) < seq.width:
                token = seq.draft(r, out[r], depth=m)
                if token not in [c.token for c in r.children]:
                    rows.append(seq.start(r.pos + 1, token, parent=r, sibling=True))


def keep(seq, parent, target):
    """verify for a row with several children: the child that reads in the token of its
    full-depth logits, or None. Kept: its draft (accepted), or a second proposal (rescued);
    rejected when no child carries it."""
    kept = next((c for c in parent.children if c.token == target.token), None)
    if parent.children:
        seq.stats["verified"] += any(not c.sibling for c in parent.children)
        how = "rejected" if kept is None else "rescued" if kept.sibling else "accepted"
        seq.stats[how] += 1
        if kept is not None:
            seq.mark(how, kept)
    seq.mark("rejected", *[c for c in parent.children if c is not kept])
    return kept


class BranchColumns:
    """The host's bookkeeping of the branch columns (the second proposal, docs/siblings.md). A row
    started at a position where a row of its sequence is in flight writes its keys to a branch
    column of its own (place); the rows built on it read that position's keys there (redirects);
    when it retires having won, read at full depth, its keys move to its position's column, where
    the rows after it read them (settle). Invariant, which has every row read its own ancestors'
    keys and no other row's:
    - a column is held by at most one row in flight of its sequence;
    - every ancestor in flight that holds a column is redirected, up to the oldest row;
    - a winner settles in the C call that retires it, before the next call is staged."""

    def __init__(self, cache, width):
        self.cache, self.width = cache, width

    def place(self, row, in_flight):
        """Give `row`, just given its lane, the lowest column its sequence's rows in flight leave
        free, when another of them holds its position."""
        if any(r.pos == row.pos and r.lane is not None and r is not row for r in in_flight):
            held = {r.branch for r in in_flight if r.branch is not None}
            row.branch = min(set(range(self.width)) - held)

    @staticmethod
    def redirects(row):
        """(position, column) of this row and of its ancestors in flight that hold a column: where
        it reads those positions' keys."""
        while row is not None:
            if row.branch is not None:
                yield row.pos, row.branch
            row = row.parent

    def settle(self, slot, rows, full_depth):
        """The rows of slot's sequence read at full depth and holding a column: the winners."""
        for r in rows:
            if r.branch is not None and r.depth == full_depth:
                self.cache.settle(slot, r.branch, r.pos)


class Branches(NamedTuple):
    """What a call's rows need of the branch columns (the second proposal), on the device: each
    row's branch [N] (-1: none, it writes its position's column), and its redirects q, j [N, R]:
    the positions q (-1: none) whose keys it reads from branch j's column, its own and its
    ancestors' in flight; gather: the first key block holding any q, from which the blocks are
    gathered column by column (eager), or None: every block patched (compiled, so that one graph
    serves every call)."""
    branch: torch.Tensor
    q: torch.Tensor
    j: torch.Tensor
    gather: Optional[int]


class Patch(NamedTuple):
    """How compiled decoding reads a block with branches: the block as it lies, and one column
    more, a spare; each row's redirected positions then written over with their branch columns'
    keys. at [N, R]: the block's column of row n's redirect r (B, the spare, for one outside the
    block or none); cols [N, R]: the branch columns."""
    at: torch.Tensor
    cols: torch.Tensor


def redirect(cols, positions, branches, base):
    """cols [N, B], the columns of the positions [N, B], with each row's redirected positions read
    from the column base + j of their branch instead."""
    for r in range(branches.q.shape[1]):
        cols = torch.where(positions == branches.q[:, r, None], base + branches.j[:, r, None],
                           cols)
    return cols
