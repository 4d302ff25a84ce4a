"""A family's thinking markers as the worker's token ids (see runtime/thinking.py).

The worker counts generated tokens inside the thinking block and, under a
``reasoning_budget``, forces the family's own end marker (after an optional closing
message) once the block reaches it; here the markers are looked up in the format
registry and tokenized.
"""

from __future__ import annotations

from typing import Any

from langchain_llamacpp_local.formats.registry import FAMILIES
from langchain_llamacpp_local.runtime.thinking import ThinkPlan

#: families whose thinking is not a marker pair of their spec: (start, end, forced end)
_CHANNELS: dict[str, tuple[str, str, str]] = {
    # gpt-oss: the analysis channel, closed and followed by the final channel
    "gpt_oss": (
        "<|channel|>analysis<|message|>",
        "<|end|>",
        "<|end|><|start|>assistant<|channel|>final<|message|>",
    ),
}


def markers(fmt: str | None) -> tuple[str, str, str] | None:
    """(start, end, what to force to end it) of ``fmt``'s thinking block, or None when the
    family has no thinking block we know."""
    if fmt in _CHANNELS:
        return _CHANNELS[fmt]
    family = FAMILIES.get(fmt or "")
    spec = family.spec if family is not None else None
    think = ("<think>", "</think>") if spec is None else spec.think
    if think is None or not think[0] or not think[1]:
        return None
    start, end = think
    return start, end, end


def plan(
    eng: Any, fmt: str | None, prefill: str, budget: int | None, message: str | None
) -> ThinkPlan | None:
    """The worker's :class:`ThinkPlan` for a prompt whose rendered end is ``prefill``."""
    found = markers(fmt)
    if found is None:
        return None
    start, end, close = found

    def ids(text: str) -> tuple[int, ...]:
        return tuple(eng.tokenize(text, add_special=False, parse_special=True))

    forced = ids((message or "") + close)
    return ThinkPlan(
        start=ids(start),
        end=ids(end),
        open=prefill.rstrip().endswith(start),
        budget=budget,
        forced=forced,
    )
