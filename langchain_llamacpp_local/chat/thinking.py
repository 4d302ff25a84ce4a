"""A family's thinking markers as the worker's token ids (see runtime/thinking.py).

The worker counts generated tokens inside the thinking block and, under a
``reasoning_budget``, forces the family's own end marker (after an optional closing
message) once the block reaches it; here the markers are looked up in the format
registry and tokenized.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

from langchain_llamacpp_local.formats.registry import FAMILIES, budget_markers
from langchain_llamacpp_local.runtime.thinking import ThinkPlan


def markers(fmt: str | None) -> tuple[str, str, str] | None:
    """(start, end, what to force to end it) of ``fmt``'s thinking block, or None when the
    family has no thinking block we know (its record says: :func:`budget_markers`)."""
    return budget_markers(fmt)


def plan(
    tokenize: Callable[[str], Sequence[int]],
    fmt: str | None,
    prefill: str,
    budget: int | None,
    message: str | None,
    tokenize_text: Callable[[str], Sequence[int]] | None = None,
) -> ThinkPlan | None:
    """The worker's :class:`ThinkPlan` for a prompt whose rendered end is ``prefill``;
    ``tokenize``: a text's tokens, control-token texts parsed, nothing added (for the
    markers); ``tokenize_text``: the same with control-token texts kept as plain text,
    for the caller's ``message`` (``"</s>"`` in it must not end the reply)."""
    found = markers(fmt)
    if found is None:
        return None
    start, end, close = found

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenize(text))

    said: tuple[int, ...] = ()
    if message:
        said = tuple((tokenize_text or tokenize)(message))
    forced = said + ids(close)
    return ThinkPlan(
        start=ids(start),
        end=ids(end),
        open=prefill.rstrip().endswith(start.rstrip()),
        budget=budget,
        forced=forced,
    )


def _lit(text: str) -> str:
    """A GBNF string literal (JSON escapes are GBNF's)."""
    return json.dumps(text)


def _char(c: str) -> str:
    return f"\\u{ord(c):04X}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08X}"


def _excluding(end: str) -> str:
    """GBNF for one step of text that does not spell ``end`` (``body ::= step*``)."""
    rule = f"[^{_char(end[-1])}]"
    for c in reversed(end[:-1]):
        rule = f"[^{_char(c)}] | {_lit(c)} ({rule})"
    return rule


def can_think_first(fmt: str | None) -> bool:
    """Whether :func:`grammar_after_thinking` can put ``fmt``'s thinking block before a
    grammar: the family has one we know, and no markup between it and the answer."""
    found = markers(fmt)
    family = FAMILIES.get(fmt or "")
    return found is not None and not (
        family is not None and family.channel_markup and found[1] == found[2]
    )


def grammar_after_thinking(grammar: str, fmt: str | None, prefill: str) -> str:
    """``grammar`` (root rule ``root``) preceded by ``fmt``'s thinking block, so a request
    that reasons can think before its constrained answer and a forced end of thinking is
    grammatical: the block is optional, or must be closed when the prompt opened it.
    ``grammar`` unchanged for families that write markup between the block and the
    answer (their answer header is not part of the block's end)."""
    found = markers(fmt)
    if found is None or not can_think_first(fmt):
        return grammar
    start, _end, close = found
    renamed = re.sub(r"(?<![\w-])root(?![\w-])", "answer-root", grammar)
    block = f"think-body {_lit(close)} [ \\t\\n]*"
    if prefill.rstrip().endswith(start.rstrip()):
        root = f"root ::= {block} answer-root"
    else:
        root = f"root ::= ({_lit(start)} {block})? answer-root"
    return "\n".join(
        [root, "think-body ::= think-step*", f"think-step ::= {_excluding(close)}", renamed]
    )
