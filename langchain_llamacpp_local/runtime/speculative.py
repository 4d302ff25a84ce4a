"""Speculative decoding: who proposes draft tokens, and how long a draft should be.

A :class:`Proposer` guesses the next few tokens of a sequence; the worker verifies
the guess with the target model in one decode and keeps the longest prefix its own
sampler agrees with, so the output is what one-token-at-a-time decoding gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Proposer(Protocol):
    """Source of draft tokens for one loaded model (n-gram lookup or a draft model)."""

    def propose(self, seq_id: int, history: Sequence[int], n_max: int) -> list[int]:
        """Up to ``n_max`` draft tokens that may follow ``history`` (every token of the
        sequence so far, prompt + generated, ending with the last sampled, not yet
        decoded token)."""
        ...

    def forget(self, seq_id: int) -> None:
        """The slot's contents changed in a way the proposer cannot follow (reset/reuse)."""
        ...

    def close(self) -> None:
        """Free what the proposer holds (a draft model's context)."""
        ...


# --------------------------------------------------------------------------- n-gram lookup

#: n-gram sizes tried, longest first (a 1-gram match is mostly noise in prose).
NGRAM_MAX = 4
NGRAM_MIN = 2


def ngram_draft(
    history: Sequence[int],
    n_max: int,
    *,
    ngram_max: int = NGRAM_MAX,
    ngram_min: int = NGRAM_MIN,
) -> list[int]:
    """Prompt-lookup draft: the continuation of the longest recent n-gram match.

    The last ``n`` tokens of ``history`` (``n`` from ``ngram_max`` down to
    ``ngram_min``) are looked up earlier in ``history``; the most recent earlier
    occurrence of the longest one that matches proposes the up to ``n_max`` tokens
    that followed it. Empty when nothing matches.
    """
    size = len(history)
    if n_max <= 0 or size < ngram_min + 1:
        return []
    h = np.asarray(history, dtype=np.int64)
    # candidate ends: earlier positions holding the last token (the last one excluded)
    ends = np.flatnonzero(h[:-1] == h[-1])
    if ends.size == 0:
        return []
    # length of the suffix each candidate shares with the end of history (up to ngram_max)
    match = np.ones(ends.size, dtype=np.int64)
    for k in range(1, min(ngram_max, size - 1)):
        ok = (match == k) & (ends >= k)
        ok[ok] = h[ends[ok] - k] == h[size - 1 - k]
        if not ok.any():
            break
        match[ok] = k + 1
    best = int(match.max())
    if best < ngram_min:
        return []
    start = int(ends[np.flatnonzero(match == best)[-1]]) + 1  # the most recent one
    return [int(t) for t in h[start : start + n_max]]


class NgramProposer:
    """Draft-free speculation: :func:`ngram_draft` over the sequence's own tokens.

    Stateless (the whole history comes with each call), so ``forget`` and ``close``
    have nothing to do.
    """

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, seq_id: int, history: Sequence[int], n_max: int) -> list[int]:
        return ngram_draft(history, n_max, ngram_max=self.ngram_max, ngram_min=self.ngram_min)

    def forget(self, seq_id: int) -> None:
        return None

    def close(self) -> None:
        return None


# --------------------------------------------------------------------------- draft length


@dataclass
class DraftController:
    """Per-request draft length: grow on full acceptance, shrink on rejection, and
    pause speculation while acceptance stays low.

    On a CPU a verify step of k tokens costs much more than one token (Gemma 3 270M:
    k=2 1.7x, k=4 2.7x, k=8 5.2x a single step), so a draft that is mostly rejected
    slows generation down. After each verified draft the acceptance rate of the
    recent drafts (exponential average) is checked; below ``min_rate`` speculation
    pauses for ``pause`` steps, twice as long each time it pauses again.
    """

    n_max: int
    n_min: int = 1
    min_rate: float = 0.35
    decay: float = 0.7
    pause_steps: int = 8
    length: int = 0
    rate: float = 1.0
    drafted: int = 0
    accepted: int = 0
    paused: int = 0  # steps left without speculation
    pauses: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.n_min <= self.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {self.n_min}, {self.n_max}")
        self.length = self.length or self.n_max

    def want(self) -> int:
        """How many draft tokens to ask for this step (0: skip speculation now)."""
        if self.paused > 0:
            self.paused -= 1
            if self.paused == 0:
                self.length = self.n_min  # try again, carefully
                self.rate = self.min_rate
            return 0
        return self.length

    def update(self, n_drafted: int, n_accepted: int) -> None:
        """Record one verified draft of ``n_drafted`` tokens, ``n_accepted`` kept."""
        if n_drafted <= 0:
            return
        self.drafted += n_drafted
        self.accepted += n_accepted
        frac = n_accepted / n_drafted
        self.rate = self.decay * self.rate + (1 - self.decay) * frac
        if n_accepted == n_drafted:
            self.length = min(self.n_max, max(self.length, n_drafted) * 2)
        else:
            self.length = max(self.n_min, n_accepted + 1 if n_accepted else self.length // 2)
        if self.rate < self.min_rate:
            self.pauses += 1
            self.paused = self.pause_steps << min(self.pauses - 1, 6)


@dataclass
class Speculation:
    """A speculating request's proposer, draft-length controller and token history."""

    kind: str
    proposer: Proposer | None  # None: speculation is off for this request (see limit)
    controller: DraftController
    limit: int  # most draft tokens per verify step (exactness, n_batch)
    history: list[int]  # text tokens of the sequence (after its last image), pending last
    drafted: int = 0  # totals reported in the metadata
    accepted: int = 0
