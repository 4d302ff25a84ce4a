"""Prefix reuse bookkeeping: which cached entries a new prompt can keep.

Pure functions and plain data, testable without a model. A :class:`Slot` mirrors
one llama.cpp sequence: ``entries[i]`` is what sits at position ``i`` of the KV
cache (a token id today; image chunks can be added as hashable entries later
without changing the comparison).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from langchain_llamacpp_local.cache.checkpoints import CheckpointStore


def common_prefix_len(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common prefix of two entry sequences."""
    n = min(len(a), len(b))
    if type(a) is not type(b):  # a tuple's slice never equals a list's
        a, b = list(a[:n]), list(b[:n])
    i = 0
    # Compare slices (in C), from blocks of 256 entries down to single ones: long shared
    # histories are the common case, and each finer step runs at most 3 times.
    for step in (256, 64, 16, 4, 1):
        while i + step <= n and a[i : i + step] == b[i : i + step]:
            i += step
    return i


#: Names for the cells a sequence decodes itself (see :mod:`~.pool`): a fresh one whenever
#: a slot's later positions stop being the cells it shared before (trimmed, cleared).
_groups = itertools.count()


def new_group() -> int:
    """A name no cells have yet."""
    return next(_groups)


@dataclass
class Slot:
    """One cached conversation: a sequence id plus what its KV cache holds."""

    seq_id: int
    entries: list[Hashable] = field(default_factory=list)
    last_used: int = 0
    #: leading entries decoded as prompt pieces on the fixed grid (see :mod:`chunking`):
    #: the part a later request may reuse and still match a fresh decode bit for bit
    exact: int = 0
    checkpoints: CheckpointStore = field(default_factory=CheckpointStore)
    #: leading entries that were the last request's prompt (the rest: its reply); the
    #: cache report calls a prompt leaving the cache inside them a miss
    n_prompt: int = 0
    #: the cells of the leading positions that are another sequence's too (a prefix
    #: ``seq_cp`` shared in a unified pool), as :mod:`~.pool` runs; the positions after
    #: them are cells of this slot's own ``group``
    shared: tuple[tuple[int, int, int], ...] = ()
    group: int = field(default_factory=new_group)
    #: the conversation whose request last filled it (the front end's key; None: not
    #: known, as after a restore): only its own entries are moved to new positions,
    #: since a moved entry carries what it attended to before
    owner: str | None = None
    #: the first position holding an entry moved by chunk reuse (None: none): it was
    #: computed attending to another history, so only its ``owner``'s requests that
    #: asked for reuse may keep it; others, and parked copies, stop before it
    moved_at: int | None = None

    def reusable_exact(self, own: bool) -> int:
        """Leading entries a request may keep as they are: :attr:`exact`, capped before
        the first moved entry unless the request is ``own`` (its owner's, reuse on)."""
        if own or self.moved_at is None:
            return self.exact
        return min(self.exact, self.moved_at)

    @property
    def n_past(self) -> int:
        return len(self.entries)

    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """The cells the sequence holds, as :mod:`~.pool` runs ``(start, end, group)``."""
        n = self.n_past
        out = [(a, min(b, n), g) for a, b, g in self.shared if a < n]
        start = out[-1][1] if out else 0
        if n > start:
            out.append((start, n, self.group))
        return tuple(out)

    def share(self, runs: Sequence[tuple[int, int, int]]) -> None:
        """The sequence now holds ``runs`` (another's cells, copied), and decodes on after
        them into cells of its own."""
        self.shared = tuple(runs)
        self.group = new_group()

    def truncate(self, n: int) -> None:
        """Forget entries from position ``n`` on (after the memory was trimmed)."""
        if n < self.n_past:
            # positions decoded from ``n`` on are new cells, not the ones another
            # sequence may still share from before the trim
            self.shared = tuple((a, min(b, n), g) for a, b, g in self.runs() if a < n)
            self.group = new_group()
        del self.entries[n:]
        if self.moved_at is not None and self.moved_at >= n:
            self.moved_at = None
        self.exact = min(self.exact, n)
        self.n_prompt = min(self.n_prompt, n)
        self.checkpoints.drop_after(n)

    def clear(self) -> None:
        """Forget everything (after the sequence was removed from the memory)."""
        self.entries.clear()
        self.exact = 0
        self.n_prompt = 0
        self.checkpoints.clear()
        self.shared = ()
        self.group = new_group()
        self.owner = None
        self.moved_at = None
