"""Prefix reuse bookkeeping: which cached entries a new prompt can keep.

Pure functions and plain data, testable without a model. A :class:`Slot` mirrors
one llama.cpp sequence: ``entries[i]`` is what sits at position ``i`` of the KV
cache (a token id today; image chunks can be added as hashable entries later
without changing the comparison).
"""

from __future__ import annotations

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

    @property
    def n_past(self) -> int:
        return len(self.entries)

    def truncate(self, n: int) -> None:
        """Forget entries from position ``n`` on (after the memory was trimmed)."""
        del self.entries[n:]
        self.exact = min(self.exact, n)
        self.n_prompt = min(self.n_prompt, n)
        self.checkpoints.drop_after(n)

    def clear(self) -> None:
        """Forget everything (after the sequence was removed from the memory)."""
        self.entries.clear()
        self.exact = 0
        self.n_prompt = 0
        self.checkpoints.clear()
