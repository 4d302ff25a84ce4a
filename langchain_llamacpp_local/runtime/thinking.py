"""Counting and bounding a thinking block on the worker, token by token.

The front end knows the family's markers and puts them in the request as token ids
(:class:`ThinkPlan`); the worker feeds every generated token to a :class:`ThinkCounter`,
which counts the tokens inside the block and, once the budget is reached, hands out the
tokens to force (an optional closing message, then the end marker) as if they had been
sampled, as llama.cpp's ``--reasoning-budget`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ThinkPlan:
    """What marks a family's thinking block, as token ids."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    #: the prompt already opened the block (the template's generation prompt ends in it)
    open: bool = False
    #: most tokens generated inside the block; None: unbounded (only counted)
    budget: int | None = None
    #: forced once the budget is reached: a closing message's tokens, then ``end``
    forced: tuple[int, ...] = ()


@dataclass
class ThinkCounter:
    """The state of one request's thinking (see module docstring)."""

    plan: ThinkPlan
    inside: bool = False
    n: int = 0  # generated tokens inside thinking blocks, markers excluded
    queue: list[int] = field(default_factory=list)
    _tail: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.inside = self.plan.open
        self._check_budget()

    def next_forced(self) -> int | None:
        """The token to emit instead of sampling, or None."""
        return self.queue.pop(0) if self.queue else None

    @property
    def forcing(self) -> bool:
        return bool(self.queue)

    def feed(self, tok: int) -> None:
        """Count one generated (or forced) token."""
        p = self.plan
        self._tail.append(tok)
        keep = max(len(p.start), len(p.end))
        if len(self._tail) > keep:
            del self._tail[: len(self._tail) - keep]
        if self.inside:
            self.n += 1
            if p.end and self._tail[-len(p.end) :] == list(p.end):
                self.n -= len(p.end)
                self.inside = False
                self.queue.clear()
                self._tail.clear()
                return
        elif p.start and self._tail[-len(p.start) :] == list(p.start):
            self.inside = True
            self._tail.clear()
        self._check_budget()

    def _check_budget(self) -> None:
        budget = self.plan.budget
        if self.inside and budget is not None and not self.queue and self.n >= budget:
            self.queue = list(self.plan.forced)
