"""Why a prompt stopped matching the cache: a pure, model-free decision.

The worker knows *where* (a token position) the prompt left the best cached prefix and
which store held it; the front end, which rendered the prompt, knows *what* sits at that
point. This module maps a character offset of the rendered prompt to the message it
falls in and names a likely cause. The rules are data (``CAUSE_RULES``), so a reader can
see every decision in one table and a test can check each one without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

Cause = Literal[
    "system prompt changed",
    "tool list or order changed",
    "template kwargs changed",
    "an image changed",
    "history edited",
]

#: characters of each side shown in a report
EXCERPT_CHARS = 40


@dataclass(frozen=True)
class Span:
    """A region ``[start, end)`` of the rendered prompt's characters."""

    start: int
    end: int

    def __contains__(self, offset: object) -> bool:
        return isinstance(offset, int) and self.start <= offset < self.end


@dataclass(frozen=True)
class MessageSpan:
    """Where one message's rendering lies in the prompt text.

    ``span`` covers the message's whole rendering (its role header included);
    ``images`` the image placeholders inside it.
    """

    index: int
    role: str
    span: Span
    images: tuple[Span, ...] = ()


@dataclass(frozen=True)
class PromptLayout:
    """The rendered prompt's regions, kept by the front end when it renders.

    ``tools`` is where the tool declarations were rendered (None without tools);
    ``kwargs_changed`` says the template keyword arguments differ from the last call of
    this conversation (the front end compares a hash; no rendering is repeated).
    """

    text: str
    messages: tuple[MessageSpan, ...]
    tools: Span | None = None
    kwargs_changed: bool = False


@dataclass(frozen=True)
class MissPoint:
    """Where the prompt left the cached prefix, in the rendered prompt's terms."""

    message_index: int | None  # None: in text the template wrote outside any message
    role: str | None
    offset: int  # characters into that message (into the prompt when message_index is None)
    prompt_offset: int  # characters into the whole prompt
    in_tools: bool
    in_image: bool
    last_message: int  # index of the prompt's last message


def locate(layout: PromptLayout, offset: int) -> MissPoint:
    """The message (and region) holding character ``offset`` of the rendered prompt."""
    last = layout.messages[-1].index if layout.messages else -1
    in_tools = layout.tools is not None and offset in layout.tools
    for message in layout.messages:
        if offset in message.span:
            return MissPoint(
                message_index=message.index,
                role=message.role,
                offset=offset - message.span.start,
                prompt_offset=offset,
                in_tools=in_tools,
                in_image=any(offset in image for image in message.images),
                last_message=last,
            )
    return MissPoint(None, None, offset, offset, in_tools, False, last)


#: (test, cause), first match wins; each test reads only the located point and layout
CAUSE_RULES: tuple[tuple[Callable[[MissPoint, PromptLayout], bool], Cause], ...] = (
    (lambda p, _: p.in_image, "an image changed"),
    (lambda p, _: p.in_tools, "tool list or order changed"),
    (lambda _, layout: layout.kwargs_changed, "template kwargs changed"),
    (lambda p, _: p.role in ("system", "developer"), "system prompt changed"),
    (lambda p, _: p.message_index is None, "template kwargs changed"),
    (
        lambda p, _: p.message_index is not None and p.message_index < p.last_message,
        "history edited",
    ),
)


def likely_cause(point: MissPoint, layout: PromptLayout) -> Cause | None:
    """The first rule of ``CAUSE_RULES`` that holds, or None (a new turn: no miss)."""
    for test, cause in CAUSE_RULES:
        if test(point, layout):
            return cause
    return None


def excerpt(text: str, offset: int, chars: int = EXCERPT_CHARS) -> str:
    """A short window of ``text`` from ``offset``, for a human to compare both sides."""
    return text[offset : offset + chars]


def miss_report(
    layout: PromptLayout,
    offset: int,
    cached_text: str,
    *,
    source: str,
    cached_tokens: int,
    prompt_tokens: int,
) -> dict[str, object]:
    """The ``response_metadata["cache"]`` entry for a prompt that left the cache at
    character ``offset``; ``cached_text`` is the cached candidate's text from there."""
    point = locate(layout, offset)
    return {
        "cached_tokens": cached_tokens,
        "prompt_tokens": prompt_tokens,
        "source": source,
        "miss": {
            "message_index": point.message_index,
            "role": point.role,
            "offset": point.offset,
            "prompt_offset": point.prompt_offset,
            "cached": excerpt(cached_text, 0),
            "prompt": excerpt(layout.text, offset),
            "cause": likely_cause(point, layout),
        },
    }


def common_prefix_chars(a: str, b: str) -> int:
    """How many leading characters two strings share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def spans_from_renders(prefixes: Sequence[str]) -> tuple[Span, ...]:
    """Message spans from the lengths of the prompt rendered with 0, 1, ... n messages:
    message ``i`` runs from where prefix ``i`` ends to where prefix ``i+1`` ends."""
    return tuple(Span(len(prefixes[i]), len(prefixes[i + 1])) for i in range(len(prefixes) - 1))
