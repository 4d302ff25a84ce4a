"""State checkpoints for memory that cannot be trimmed (recurrent, hybrid, SWA).

A checkpoint is the serialized non-trimmable part of one sequence's state
(``llama_state_seq_get_data_ext`` with ``PARTIAL_ONLY``) taken after the first
``n_tokens`` entries were decoded. Restoring the newest checkpoint at or before a
divergence point lets a request re-decode only from there, as llama.cpp's server
does with its context checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    n_tokens: int  # entries decoded when the state was saved
    pos_min: int
    pos_max: int
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)


#: Default bounds of one sequence's checkpoints (``checkpoint_max_count``/``_bytes``).
DEFAULT_MAX_COUNT = 16
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass
class CheckpointStore:
    """Checkpoints of one sequence, ordered by ``n_tokens`` and bounded in count and bytes."""

    max_count: int = DEFAULT_MAX_COUNT
    max_bytes: int = DEFAULT_MAX_BYTES
    items: list[Checkpoint] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(c.size for c in self.items)

    def add(self, ck: Checkpoint, *, keep: frozenset[int] = frozenset()) -> None:
        """Insert ``ck`` (replacing one at the same length) and evict to stay in bounds.

        Eviction drops the oldest (shortest-prefix) checkpoints first, but never
        one whose ``n_tokens`` is in ``keep`` (the points the current request
        needs), nor the one just added.
        """
        self.items = [c for c in self.items if c.n_tokens != ck.n_tokens]
        self.items.append(ck)
        self.items.sort(key=lambda c: c.n_tokens)
        while len(self.items) > 1 and (
            len(self.items) > self.max_count or self.total_bytes > self.max_bytes
        ):
            victim = next(
                (c for c in self.items if c is not ck and c.n_tokens not in keep),
                None,
            )
            if victim is None:
                break
            self.items.remove(victim)
        logger.debug(
            "checkpoint at %d tokens (%.1f KiB); %d held, %.1f MiB",
            ck.n_tokens,
            ck.size / 1024,
            len(self.items),
            self.total_bytes / 2**20,
        )

    def best_for(self, n_keep: int, reach: int = 0) -> Checkpoint | None:
        """The newest checkpoint usable to resume at or before ``n_keep`` entries.

        ``reach`` also accepts one taken up to that many entries later: a sliding-window
        state holds the window of its last entry, so it can resume one entry back.
        """
        for ck in reversed(self.items):
            if ck.n_tokens <= n_keep + reach:
                return ck
        return None

    def drop_after(self, n_tokens: int) -> None:
        """Forget checkpoints taken past ``n_tokens`` (that history is gone)."""
        self.items = [c for c in self.items if c.n_tokens <= n_tokens]

    def clear(self) -> None:
        self.items.clear()


def checkpoint_targets(
    n_start: int,
    n_prompt: int,
    *,
    n_ubatch: int,
    min_step: int,
    boundaries: tuple[int, ...] = (),
    last_at: int | None = None,
    tail: bool = True,
) -> list[int]:
    """Positions (entry counts) at which to save a checkpoint while prefilling.

    Like llama.cpp's server: at message boundaries (e.g. the start of the last
    user message), ``n_ubatch + 4`` and ``4`` entries before the end of the
    prompt (before the generation prompt, where templates rewrite history), plus
    every ``min_step`` entries so re-decoding after an edit is bounded by the
    spacing. Periodic points closer than ``min_step`` to another point are
    skipped; the special points are always kept. Only points strictly inside
    ``(n_start, n_prompt)`` are returned: the end of the prompt is saved
    separately once it is decoded. ``tail=False`` leaves out the two points before
    the end (a sliding-window cache checkpoints the end instead, see slot_memory).
    """
    special = {b for b in boundaries}
    if tail:
        special.add(n_prompt - 4 - n_ubatch)
        special.add(n_prompt - 4)
    special = {p for p in special if n_start < p < n_prompt}
    points = set(special)
    prev = last_at if last_at is not None else 0
    if min_step > 0:
        p = (n_start // min_step + 1) * min_step
        while p < n_prompt:
            if all(abs(p - s) >= min_step for s in special) and p - prev >= min_step:
                points.add(p)
                prev = p
            p += min_step
    return sorted(points)
