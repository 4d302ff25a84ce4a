"""Speculative decoding: who proposes draft tokens, and how long a draft should be.

A :class:`Proposer` guesses the next few tokens of a sequence; the worker verifies
the guess with the target model in one decode and keeps the longest prefix its own
sampler agrees with, so the output is what one-token-at-a-time decoding gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


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
