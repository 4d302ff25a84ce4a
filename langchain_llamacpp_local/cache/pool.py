"""How many cells of the unified KV pool requests hold: the admission count, as data.

In llama.cpp's unified KV cache a cell holds one position for a set of sequences:
``seq_cp`` adds the destination sequence to the source's cells, so a prefix copied
from one conversation to another is held once for both (SGLang's radix cache and
vLLM's prefix caching count shared blocks once the same way). A sequence's cells are
described here as *runs*: ``(start, end, group)``, positions ``[start, end)`` whose
cells belong to ``group``; two sequences hold the same cells where their runs name
the same group and positions (:meth:`~.slots.Slot.runs` keeps them).

Admission then counts what the pool will hold: the union of the running sequences'
cells and the new request's, plus each request's own growth until it ends (the rest
of its prompt and ``max_tokens``, always cells of its own). Per-slot KV streams
(``kv_unified=False``) copy a whole stream, nothing is shared: the count is the sum.
Pure functions over plain numbers, tested without a model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Run = tuple[int, int, int]
"""``(start, end, group)``: positions ``[start, end)`` held in ``group``'s cells."""


@dataclass(frozen=True)
class Footprint:
    """One sequence as the count sees it: the cells it holds now and where it may end."""

    runs: tuple[Run, ...]
    """Its cells now (positions from 0, as :meth:`~.slots.Slot.runs` gives them)."""
    final: int
    """Positions it may hold before it ends (prompt plus ``max_tokens``); 0 for an idle
    conversation, which holds its cells but does not grow."""

    @property
    def held(self) -> int:
        return sum(end - start for start, end, _ in self.runs)

    @property
    def growth(self) -> int:
        """Cells it may still add, each its own (decoded after what it holds)."""
        return max(0, self.final - self.held)


def cells_in_use(seqs: Iterable[Sequence[Run]], *, shared: bool = True) -> int:
    """Cells the sequences' runs take together: with ``shared`` (a unified pool) each
    ``(group, position)`` once, else every sequence's own."""
    if not shared:
        return sum(end - start for runs in seqs for start, end, _ in runs)
    by_group: dict[int, list[tuple[int, int]]] = {}
    for runs in seqs:
        for start, end, group in runs:
            if end > start:
                by_group.setdefault(group, []).append((start, end))
    total = 0
    for spans in by_group.values():
        spans.sort()
        lo, hi = spans[0]
        for start, end in spans[1:]:
            if start > hi:
                total += hi - lo
                lo, hi = start, end
            else:
                hi = max(hi, end)
        total += hi - lo
    return total


def pool_need(running: Sequence[Footprint], *, shared: bool = True) -> int:
    """Cells ``running`` may take at most before they end: the union of what they hold
    and every one's own growth."""
    return cells_in_use((f.runs for f in running), shared=shared) + sum(f.growth for f in running)


def admits(
    n_cells: int, running: Sequence[Footprint], new: Footprint, *, shared: bool = True
) -> bool:
    """Whether ``new`` (its runs: the prefix it will hold once its slot is filled) fits
    in a pool of ``n_cells`` beside ``running`` until they all end; idle conversations
    are not counted: they can be parked to make the room (:func:`idle_to_park`)."""
    return pool_need([*running, new], shared=shared) <= n_cells


#: Prompt positions a request would read itself that a running request is about to read
#: (the same tokens, further on in its prompt) before it waits for them instead.
SHARE_WAIT = 256


def waits_for_prefix(shared_later: int, shared_now: int) -> bool:
    """Whether a request waits until a running request has read the prefix they share
    (``shared_later`` positions of its prompt; ``shared_now`` of them held already), to
    copy it then: read once and held once, where starting now would read the rest of it
    a second time into cells of its own."""
    return shared_later - shared_now >= SHARE_WAIT


def idle_to_park(
    n_cells: int,
    running: Sequence[Footprint],
    idle: Sequence[tuple[int, Sequence[Run]]],
    *,
    shared: bool = True,
) -> tuple[int, ...] | None:
    """The idle conversations (``(seq_id, runs)``, least recently used first) to take out
    of the pool so that ``running`` (the new request included) fit, in that order; None
    when even an empty rest of the pool leaves too little room. Cells an idle one shares
    with a running one free nothing when it goes, and are not counted as its."""
    need = pool_need(running, shared=shared)
    if need > n_cells:
        return None
    base = [f.runs for f in running]
    kept = list(idle)
    out: list[int] = []
    while kept:
        held = cells_in_use([*base, *(runs for _, runs in kept)], shared=shared)
        if held - cells_in_use(base, shared=shared) + need <= n_cells:
            break
        seq_id, _ = kept.pop(0)
        out.append(seq_id)
    return tuple(out)
