"""Host-RAM cache of serialized conversations evicted from the live slots.

When a slot must be reused for another conversation, its full sequence state
(``llama_state_seq_get_data``) is parked here with its entries and checkpoints;
a later request that continues that conversation restores it instead of reading
the history again. The same idea as llama.cpp server's ``--cache-ram``: LRU
under a byte budget, an entry that is a prefix of a newer one is dropped, and a
restored entry is moved out (it lives in the slot again).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from langchain_llamacpp_local.cache.checkpoints import Checkpoint
from langchain_llamacpp_local.cache.slots import common_prefix_len

logger = logging.getLogger(__name__)


@dataclass
class CachedPrompt:
    entries: tuple[Hashable, ...]
    data: bytes
    checkpoints: list[Checkpoint] = field(default_factory=list)
    exact: int = 0  # see Slot.exact
    n_prompt: int | None = None  # see Slot.n_prompt (None: not known, a file's state)

    @property
    def size(self) -> int:
        return len(self.data) + sum(c.size for c in self.checkpoints)


#: Default byte budget of the host-RAM prompt cache (``prompt_cache_bytes``).
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024


@dataclass
class PromptCache:
    """LRU list of :class:`CachedPrompt` bounded by ``max_bytes`` (0 disables it)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    items: list[CachedPrompt] = field(default_factory=list)  # oldest first

    @property
    def total_bytes(self) -> int:
        return sum(i.size for i in self.items)

    def put(self, item: CachedPrompt) -> bool:
        """Store ``item``; returns whether the cache holds its conversation afterwards
        (stored, or already covered by a longer one): False when it is disabled, the
        item is empty or bigger than the whole budget."""
        if self.max_bytes <= 0 or not item.entries or item.size > self.max_bytes:
            return False
        n = len(item.entries)
        for other in self.items:
            if len(other.entries) >= n and other.entries[:n] == item.entries:
                return True  # already covered by a longer conversation
        self.items = [
            o
            for o in self.items
            if not (len(o.entries) <= n and item.entries[: len(o.entries)] == o.entries)
        ]
        self.items.append(item)
        while self.total_bytes > self.max_bytes and len(self.items) > 1:
            self.items.pop(0)
        logger.debug(
            "prompt cache: stored %d entries (%.1f MiB); %d held, %.1f MiB",
            n,
            item.size / 2**20,
            len(self.items),
            self.total_bytes / 2**20,
        )
        return True

    def best(self, prompt: Sequence[Hashable]) -> tuple[CachedPrompt | None, int]:
        """The entry sharing the longest prefix with ``prompt`` and that length."""
        best: CachedPrompt | None = None
        best_n = 0
        # the entries are tuples: compared with a tuple, no copy per entry
        key = tuple(prompt)
        for item in self.items:
            n = common_prefix_len(item.entries, key)
            if n > best_n:
                best, best_n = item, n
        return best, best_n

    def take(self, item: CachedPrompt) -> bool:
        """Move ``item`` out of the cache; False if it was evicted meanwhile."""
        for i, other in enumerate(self.items):
            if other is item:
                del self.items[i]
                return True
        return False
