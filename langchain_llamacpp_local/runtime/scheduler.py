"""What one worker step decodes: the decision, as data.

As vLLM v1's ``Scheduler.schedule()`` returns a ``SchedulerOutput`` that the model
runner executes, :func:`plan_step` returns a :class:`StepPlan` that the worker applies:
which generating requests share each ``llama_decode`` and which verify a speculative
draft (a call of their own). It never touches llama.cpp, so the order and grouping are
tested without a model. After these calls the worker decodes one prompt piece of the
oldest request still reading its prompt; that request is chosen then, not here, since a
failed generation step may send a request back to reading its prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from langchain_llamacpp_local.cache.chunking import balanced_groups
from langchain_llamacpp_local.runtime.lora import plan_adapter_groups

T = TypeVar("T")


@dataclass(frozen=True)
class StepPlan(Generic[T]):
    """One worker step, in the order it runs."""

    decode_groups: tuple[tuple[T, ...], ...]
    """Generating requests whose next token shares a ``llama_decode``, one call per group."""
    verify: tuple[T, ...]
    """Requests verifying a draft, each in its own call (rows roll back on rejection)."""


def row_limit(n_generating: int, *, deterministic: bool, kv_unified: bool, exact_rows: int) -> int:
    """The most generation rows one call may carry.

    All of them by default, as llama.cpp's server; in deterministic mode with per-slot
    KV streams, no more than the kernels keep bit-identical (probed at load)."""
    if kv_unified or not deterministic:
        return max(1, n_generating)
    return exact_rows


def plan_step(
    generating: Sequence[T],
    *,
    drafting: Callable[[T], bool],
    limit: int,
    lora_of: Callable[[T], Hashable],
    turn: int,
) -> StepPlan[T]:
    """Plan one step for ``generating`` (in slot order), of which those ``drafting``
    says carry a draft to verify. Requests with different LoRA sets never share a call (the adapters are set
    per context); ``turn`` rotates which set goes first; each set's requests are split
    into the fewest calls of at most ``limit`` rows."""
    plain = [r for r in generating if not drafting(r)]
    groups = tuple(
        tuple(group)
        for part in plan_adapter_groups(plain, lora_of, turn)
        for group in balanced_groups(part, limit)
    )
    verify = tuple(r for r in generating if drafting(r))
    return StepPlan(groups, verify)
