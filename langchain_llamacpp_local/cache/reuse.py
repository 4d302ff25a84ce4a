"""Reuse of cached chunks after a history edit (llama.cpp's ``--cache-reuse``): the decision.

When a conversation's history is edited (its oldest turns dropped or summarised, a
tool result cleared), the prompt leaves the cached one early, yet most of what follows
is token for token what the cache holds at later positions. llama.cpp's server then
looks, past the common prefix, for chunks of at least ``n_min`` tokens that match and
moves their KV entries to their new positions (``llama_memory_seq_rm`` of the gap, then
``llama_memory_seq_add``, which re-rotates the keys) instead of decoding them again.

The entries moved were computed while they attended to the old history, so what the
model reads is not exactly what a fresh read would give: llama.cpp's own trade, and the
reason the setting is off by default. Pure functions over plain sequences, tested
without a model; :class:`~.slot_memory.SlotMemory` applies the plan.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from langchain_llamacpp_local.llama.probes import MemoryKind

#: Why reuse was on but moved nothing, in the cache report's words.
ReuseOff = Literal[
    "deterministic",  # moved entries differ from a fresh read: never in bit-exact mode
    "recurrent",  # a recurrent state summarises every token: nothing to move
    "hybrid",  # its recurrent part cannot be trimmed to a chunk's edge
    "sliding_window",  # the window already dropped what a moved chunk attends to
    "mrope",  # positions are several numbers per entry: llama.cpp cannot shift them
    "cannot_shift",  # the memory refuses a shift for another reason
    "media",  # the matching chunks hold image or audio positions
    "other_conversation",  # the cached entries are not this conversation's own turns
]


@dataclass(frozen=True)
class Move:
    """Cached positions ``[src_start, src_end)`` go to ``src_start + shift`` onward."""

    src_start: int
    src_end: int
    shift: int

    @property
    def n(self) -> int:
        return self.src_end - self.src_start

    @property
    def dst_start(self) -> int:
        return self.src_start + self.shift


@dataclass(frozen=True)
class ReusePlan:
    """The moves, in order, and the entries the sequence keeps after them."""

    moves: tuple[Move, ...]
    n_past: int
    """Entries kept: the common prefix plus every moved chunk (the prompt's first
    ``n_past`` entries)."""
    media_blocked: bool = False
    """A chunk of at least ``n_min`` equal entries stopped at image or audio positions."""

    @property
    def moved(self) -> int:
        """Entries moved rather than read."""
        return sum(m.n for m in self.moves)


def memory_blocker(
    *,
    memory_kind: MemoryKind,
    is_recurrent: bool,
    is_hybrid: bool,
    mrope: bool,
    can_shift: bool,
    deterministic: bool,
) -> ReuseOff | None:
    """Why this model's memory cannot move cached chunks (None: it can). Checked in
    this order so the report names the most telling reason."""
    if deterministic:
        return "deterministic"
    if is_hybrid:
        return "hybrid"
    if is_recurrent:
        return "recurrent"
    if memory_kind is MemoryKind.SWA:
        return "sliding_window"
    if mrope:
        return "mrope"
    if not can_shift or memory_kind is not MemoryKind.PARTIAL:
        return "cannot_shift"
    return None


def _next_media(spans: Sequence[tuple[int, int]], p: int) -> tuple[int, int] | None:
    """The first image/audio span ``(start, stop)`` of the prompt that ends after ``p``."""
    for start, stop in spans:
        if stop > p:
            return start, stop
    return None


def _find(cached: Sequence[Hashable], entry: Hashable, start: int) -> int:
    """The first position from ``start`` where ``cached`` holds ``entry`` (-1: none);
    list.index runs in C."""
    try:
        return cached.index(entry, start)
    except ValueError:
        return -1


def _extend(
    cached: Sequence[Hashable], prompt: Sequence[Hashable], c: int, p: int, n: int, end_p: int
) -> int:
    """A match of ``n`` entries at ``cached[c]``/``prompt[p]`` grown as far as both agree
    (the prompt cut at ``end_p``), in blocks compared in C."""
    limit = min(len(cached) - c, end_p - p)
    for step in (256, 16, 1):
        while n + step <= limit and cached[c + n : c + n + step] == prompt[p + n : p + n + step]:
            n += step
    return n


def plan_reuse(
    cached: Sequence[Hashable],
    prompt: Sequence[Hashable],
    n_past: int,
    n_min: int,
    *,
    media: Sequence[tuple[int, int]] = (),
    pinned: int = 0,
) -> ReusePlan:
    """llama.cpp server's chunk reuse: from the common prefix ``n_past`` on, walk the
    cached entries; each run of at least ``n_min`` entries equal to the prompt's next
    ones is moved there, a shorter one is skipped (one cached entry at a time).

    ``media``: the prompt's image/audio spans ``(start, n_pos)``: no chunk holds one
    (mtmd evaluates them whole, and a moved chunk must end where the next read
    starts), so the walk ends at the first one. ``pinned``: cached positions below it
    are cells another sequence shares (a unified pool's copied prefix); a shift would
    move them for it too, so no chunk starts there. The prompt's last entry is never
    covered: sampling needs its logits. ``n_min`` <= 0: off.

    Cost: each cached entry is compared with at most ``n_min`` prompt entries (slices,
    in C), and each moved entry once more; Python steps only where an entry recurs."""
    if type(cached) is not type(prompt):  # a tuple's slice never equals a list's
        cached, prompt = list(cached), list(prompt)
    if n_min <= 0 or n_past >= len(prompt) - 1:
        return ReusePlan((), n_past)
    spans = sorted((start, start + n) for start, n in media if n > 0)
    end_prompt = len(prompt) - 1
    head_c = max(n_past, pinned)
    head_p = n_past
    moves: list[Move] = []
    blocked = False
    while head_c < len(cached) and head_p < end_prompt:
        span = _next_media(spans, head_p)
        if span is not None and span[0] <= head_p:
            # the prompt goes on with an image: nothing after it can be kept before it
            # is evaluated (is the same one cached further on?)
            blocked = _find(cached, prompt[head_p], head_c) >= 0
            break
        end_p = end_prompt if span is None else span[0]
        head_c = _find(cached, prompt[head_p], head_c)
        if head_c < 0:
            break
        n = min(n_min, end_p - head_p)
        if cached[head_c : head_c + n] != prompt[head_p : head_p + n]:
            head_c += 1
            continue
        n_match = _extend(cached, prompt, head_c, head_p, n, end_p)
        if n_match < n_min:  # a short run cut by an image: the same image cached after it?
            if head_p + n_match == end_p and end_p < end_prompt:
                c = head_c + n_match
                blocked = blocked or (c < len(cached) and cached[c] == prompt[end_p])
            head_c += 1
            continue
        moves.append(Move(head_c, head_c + n_match, head_p - head_c))
        head_c += n_match
        head_p += n_match
    return ReusePlan(tuple(moves), head_p, media_blocked=blocked)


def pinned_end(
    own: Sequence[tuple[int, int, int]], others: Sequence[Sequence[tuple[int, int, int]]]
) -> int:
    """The first position from which none of a sequence's cells (its pool runs
    ``(start, end, group)``, :meth:`~.slots.Slot.runs`) is also another sequence's."""
    end = 0
    for a, b, g in own:
        for runs in others:
            for a2, b2, g2 in runs:
                if g2 == g and a2 < b and a < b2:
                    end = max(end, min(b, b2))
    return end


__all__ = ["Move", "ReuseOff", "ReusePlan", "memory_blocker", "pinned_end", "plan_reuse"]
