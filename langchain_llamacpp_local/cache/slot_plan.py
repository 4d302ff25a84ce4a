"""Which slot a request takes and how it is filled: the decision, as data.

Pure functions over plain numbers (what each slot holds that the request can keep, how
recently it was used), following llama.cpp's server slot selection: the free slot
sharing the longest prefix wins when it is similar enough (``slot_prompt_similarity``
0.1); a slot that would lose most of what it holds is parked in host RAM first; a
shared prefix is copied from another slot, or a parked conversation restored, when
that keeps more than the target slot holds. :class:`~.slot_memory.SlotMemory` applies
the plans to llama.cpp's memory; these functions never touch it, so they are tested
without a model.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Literal

#: Shortest conversation worth a file in the disk cache, and worth restoring from one.
DISK_MIN_ENTRIES = 32


@dataclass(frozen=True)
class SlotState:
    """One slot as the decision sees it."""

    seq_id: int
    n_past: int
    """Entries (tokens, image positions) its memory holds."""
    last_used: int
    """Logical clock of its last use (least recently used = smallest)."""
    reusable: int
    """Entries of it the request may keep: the common prefix, capped where the slot's
    contents stop being exactly reproducible."""


@dataclass(frozen=True)
class SlotChoice:
    """The slot a request takes."""

    target: int
    """Its sequence id."""
    park_first: bool
    """Save its conversation to host RAM before anything else: most of it is about to
    be trimmed."""
    in_place: bool = False
    """Taken in place of a fork that does not fit (``choose_slot(fork_fits=False)``):
    it keeps its own cells up to the prefix, its tail cut."""


@dataclass(frozen=True)
class FillPlan:
    """How the chosen slot gets the longest prefix the request can reuse.

    ``restore``: park the target and load the cached conversation into it; ``copy``:
    park the target and copy ``n_copy`` entries from slot ``source``; ``park``: keep
    a copy of the target's conversation (most of it will be trimmed) and reuse what
    it shares; ``keep``: reuse what the target shares as it is.
    """

    action: Literal["restore", "copy", "park", "keep"]
    source: int | None = None
    n_copy: int = 0


def best_match(slots: Sequence[SlotState], busy: Set[int]) -> SlotState | None:
    """The free slot whose prefix the request keeps most of (the least recently used of
    equals), or None when every slot is busy."""
    free = [s for s in slots if s.seq_id not in busy]
    return max(free, key=lambda s: (s.reusable, -s.last_used), default=None)


def choose_slot(
    slots: Sequence[SlotState],
    busy: Set[int],
    n_tokens: int,
    *,
    can_copy: bool,
    fork_fits: bool = True,
) -> SlotChoice:
    """The free slot for a request of ``n_tokens`` entries (llama.cpp server's choice).

    ``can_copy``: the memory lets a prefix be copied between sequences (attention KV).
    With a copy possible, a request whose best match would cut a longer conversation
    short takes an empty slot instead ("fork"), keeping the other conversation whole.
    ``fork_fits`` False (a unified pool beside running requests that cannot hold that
    conversation whole beside the fork): the request takes the best match itself, its
    tail cut, when the tail is the shorter part; parking the conversation to make room
    and restoring it into the empty slot would copy its whole state twice to keep it.
    """
    free = [s for s in slots if s.seq_id not in busy]
    best = best_match(free, ())
    if best is None:
        raise ValueError("no free slot: the scheduler admits a request only to a free one")
    empty = [s for s in free if s.n_past == 0]
    if can_copy and empty and 0 < best.reusable < best.n_past:
        if fork_fits or best.reusable * 2 < best.n_past:
            return SlotChoice(empty[0].seq_id, park_first=False)
        return SlotChoice(best.seq_id, park_first=False, in_place=True)
    if best.reusable > 0 and (best.reusable * 10 >= n_tokens or len(free) == 1):
        return SlotChoice(best.seq_id, park_first=best.reusable * 2 < best.n_past)
    target = empty[0] if empty else min(free, key=lambda s: s.last_used)
    return SlotChoice(target.seq_id, park_first=False)


def plan_solo_parking(
    slots: Sequence[SlotState], busy: Set[int], target: int, *, waiting: int, attention: bool
) -> tuple[int, ...]:
    """The idle slots to park in host RAM before slot ``target`` decodes alone.

    A unified KV cache is one pool of cells, and a decode step attends over the pool up
    to its highest cell in use, other conversations' cells masked but still computed
    (flash attention on the CPU still walks them). Idle conversations kept beside the
    one being decoded slow each of its tokens and prompt chunks; parked (one copy each,
    restored on their next turn) they leave the request the short pool llama.cpp has
    when it decodes one conversation. Only when nothing else runs or waits (``busy``
    slots, ``waiting`` requests): parking beside running requests stalls them, and their
    cells set the span anyway. Recurrent memory (``attention`` False) has no span.
    """
    if not attention or waiting or busy - {target}:
        return ()
    return tuple(s.seq_id for s in slots if s.seq_id != target and s.n_past > 0)


#: Prompt tokens an arriving request must read beside running ones for the pool to be
#: rewritten from its first cell first (:func:`plan_compaction`): its attention then
#: dominates the steps.
COMPACT_ABOVE = 1024
#: The most cells the pool may hold for the rewrite: each is copied out and back (about
#: 5 ms for a few hundred cells of a small model on two CPU cores).
COMPACT_MAX_CELLS = 1024


def plan_compaction(*, n_read: int, copied: int, fits_apart: bool) -> bool:
    """Whether to rewrite a unified pool from its first cell before an arriving request
    reads ``n_read`` prompt tokens beside running ones, where every row attends up to
    the highest cell in use (the pool holds ``copied`` cells counted per sequence).

    A conversation parked to make room, or a tail cut, leaves a hole; requests decoding
    above it keep the span, so each of the arriving prompt's rows and each of their own
    tokens attends over the hole too (the arrival's pieces then cost their time over
    thousands of empty cells). Where llama.cpp put each cell depends on every earlier
    call, which its C API does not tell: rewritten, the pool spans exactly what it
    holds, and the cost model knows it. Only for a long prompt (:data:`COMPACT_ABOVE`),
    a cheap copy (:data:`COMPACT_MAX_CELLS`) and a pool that still holds everything with
    shared prefixes counted apart (``fits_apart``: a sequence put back holds its copy of
    a shared prefix in cells of its own)."""
    return n_read >= COMPACT_ABOVE and copied <= COMPACT_MAX_CELLS and fits_apart


def usable_cached(n_match: int, exact: int, n_tokens: int, n_entries: int) -> int:
    """Entries a cached conversation can give a request: its common prefix, capped where
    it stops being exact and before the prompt's last token (sampling needs that one's
    logits); 0 when most of it would be trimmed (restoring it is not worth the copy)."""
    n = min(n_match, exact, n_tokens - 1)
    return 0 if n * 4 < n_entries else max(n, 0)


def disk_beats(n_usable: int, best_elsewhere: int) -> bool:
    """Whether a disk record is worth loading: it restores more than any slot or host-RAM
    entry would give, and enough to beat decoding it."""
    return n_usable > best_elsewhere and n_usable >= DISK_MIN_ENTRIES


def plan_fill(
    slots: Sequence[SlotState], target: int, n_cached: int, *, can_copy: bool
) -> FillPlan:
    """How slot ``target`` gets the longest reusable prefix; ``n_cached`` is what the best
    parked conversation (host RAM or disk) would give, 0 for none."""
    by_id = {s.seq_id: s for s in slots}
    chosen = by_id[target]
    source = max(slots, key=lambda s: s.reusable)
    if n_cached > max(chosen.reusable, source.reusable):
        return FillPlan("restore")
    if source.reusable > chosen.reusable and source.seq_id != target and can_copy:
        return FillPlan("copy", source.seq_id, source.reusable)
    if chosen.n_past and chosen.reusable * 2 < chosen.n_past:
        return FillPlan("park")
    return FillPlan("keep")
