"""Why a prompt stopped matching the cache: a pure, model-free decision.

The worker knows *where* (a token position) the prompt left the best cached prefix and
which store held it; the front end, which rendered the prompt, knows *what* sits at that
point. This module maps a character offset of the rendered prompt to the message it
falls in and names a likely cause. The rules are data (``CAUSE_RULES``), so a reader can
see every decision in one table and a test can check each one without a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

logger = logging.getLogger(__name__)

Cause = Literal[
    "system prompt changed",
    "tool list or order changed",
    "template kwargs changed",
    "an image changed",
    "an audio clip changed",
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
    ``images`` and ``audio`` the media placeholders inside it (an image's, an audio
    clip's: both render as mtmd's one marker, told apart by their parts' order).
    """

    index: int
    role: str
    span: Span
    images: tuple[Span, ...] = ()
    audio: tuple[Span, ...] = ()


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
    in_audio: bool = False


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
                in_audio=any(offset in clip for clip in message.audio),
            )
    return MissPoint(None, None, offset, offset, in_tools, False, last)


#: (test, cause), first match wins; each test reads only the located point and layout
CAUSE_RULES: tuple[tuple[Callable[[MissPoint, PromptLayout], bool], Cause], ...] = (
    (lambda p, _: p.in_image, "an image changed"),
    (lambda p, _: p.in_audio, "an audio clip changed"),
    (lambda p, _: p.in_tools, "tool list or order changed"),
    # the template's own text around the tool list (a "# Tools" heading) before it
    (
        lambda p, layout: (
            p.message_index is None
            and layout.tools is not None
            and p.prompt_offset < layout.tools.end
        ),
        "tool list or order changed",
    ),
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
    *,
    source: str,
    cached_tokens: int,
    prompt_tokens: int,
) -> dict[str, object]:
    """The ``response_metadata["cache"]`` entry for a prompt that left the cache at
    character ``offset``: read from the caller's own prompt only (the cached side may be
    another caller's conversation)."""
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


MEDIA = "<__media__>"  # how an image or audio clip shows in the rendered prompt (mtmd's)


def media_kinds(messages: Sequence[dict[str, Any]]) -> list[str]:
    """``"image"`` or ``"audio"`` for each media part of ``messages``, in prompt order:
    the order in which the prompt's media markers and media positions stand for them."""
    return [
        part["type"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in ("image", "audio")
    ]


def _content_texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if isinstance(content, str):
        return [content] if content else []
    out: list[str] = []
    for part in content or ():
        if isinstance(part, dict) and part.get("type") == "text" and part.get("text"):
            out.append(str(part["text"]))
        elif isinstance(part, str) and part:
            out.append(part)
    return out


def message_layout(
    text: str, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] = ()
) -> PromptLayout:
    """Each message's span in the rendered ``text``, found by its content in order: a
    message runs from the start of its content to the start of the next one's (what
    the template writes after a content, tool declarations in a system block included,
    belongs to that message); text before the first content is the template's. Tool
    declarations span from the first to the last tool name found before the last
    message."""
    starts: list[tuple[int, int, str]] = []  # (message index, content start, role)
    pos = 0
    for i, message in enumerate(messages):
        first = -1
        for piece in _content_texts(message):
            at = text.find(piece, pos)
            if at < 0:
                continue
            if first < 0:
                first = at
            pos = at + len(piece)
        if first >= 0:
            starts.append((i, first, str(message.get("role", ""))))
    kinds = media_kinds(messages)
    spans: list[MessageSpan] = []
    for k, (i, start, role) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) else len(text)
        found: dict[str, list[Span]] = {"image": [], "audio": []}
        at = text.find(MEDIA, start)
        while 0 <= at < end:
            nth = text.count(MEDIA, 0, at)
            kind = kinds[nth] if nth < len(kinds) else "image"
            found[kind].append(Span(at, at + len(MEDIA)))
            at = text.find(MEDIA, at + 1)
        spans.append(
            MessageSpan(i, role, Span(start, end), tuple(found["image"]), tuple(found["audio"]))
        )
    tool_span = None
    limit = spans[-1].span.start if spans else len(text)
    hits = []
    for tool in tools:
        fn = tool.get("function", tool)
        name = str(fn.get("name", "")) if isinstance(fn, dict) else ""
        at = text.find(name, 0, limit) if name else -1
        if at >= 0:
            hits.append((at, at + len(name)))
    if hits:
        tool_span = Span(min(a for a, _ in hits), max(b for _, b in hits))
    return PromptLayout(text, tuple(spans), tools=tool_span)


def _is_media(entry: object) -> bool:
    return isinstance(entry, tuple) and bool(entry) and entry[0] == "media"


def _text_of(entries: Sequence[Any], piece: Callable[[int], bytes]) -> str:
    out = bytearray()
    for e in entries:
        if _is_media(e):
            if e[2] == 0:
                out += MEDIA.encode()
        elif isinstance(e, int):
            out += piece(e)
    return out.decode("utf-8", errors="replace")


def explain_miss(
    prepared_text: str,
    tokens: Sequence[Any],
    at: int,
    piece: Callable[[int], bytes],
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    kwargs_changed: bool = False,
) -> dict[str, Any]:
    """The miss part of the report: the prompt left its cached candidate at token
    ``at``; ``piece`` is the vocabulary's detokenizer. Everything comes from the caller's
    own prompt: the candidate may hold another caller's conversation, so nothing of it
    (text, token ids) is read. Runs on a miss only: it detokenizes the prompt up to
    ``at``."""
    full = _text_of(tokens, piece)
    # a token the renderer did not write (a BOS added by the tokenizer) shifts offsets
    shift = max(0, len(full) - len(prepared_text))
    offset = min(max(0, len(_text_of(tokens[:at], piece)) - shift), len(prepared_text))
    layout = replace(message_layout(prepared_text, messages, tools), kwargs_changed=kwargs_changed)
    point = locate(layout, offset)
    if at < len(tokens) and _is_media(tokens[at]):
        # the how-manieth media item it is, counted by each item's first position
        nth = sum(1 for e in tokens[:at] if _is_media(e) and e[2] == 0)
        kinds = media_kinds(messages)
        audio = nth < len(kinds) and kinds[nth] == "audio"
        point = replace(point, in_image=not audio, in_audio=audio)
    return {
        "message_index": point.message_index,
        "role": point.role,
        "offset": point.offset,
        "prompt_offset": point.prompt_offset,
        "token": at,
        "prompt": excerpt(prepared_text, offset),
        "cause": likely_cause(point, layout),
    }


#: conversations remembered per model instance for the miss warning (oldest forgotten)
WARNED_CONVERSATIONS = 1024


def conversation_key(messages: Sequence[dict[str, Any]]) -> str:
    """What identifies a conversation across its calls: its first message that is not
    a system/developer one (the opening user turn), else its first message.

    The system prompt, the tools and the template arguments are left out on purpose:
    they are what a miss usually changed, and a changed one must not make the same
    conversation look new (and warn again on every call)."""
    chosen: dict[str, Any] | None = None
    for message in messages:
        if message.get("role") not in ("system", "developer"):
            chosen = message
            break
    if chosen is None and messages:
        chosen = messages[0]
    text = json.dumps(
        [chosen.get("role"), chosen.get("content")] if chosen is not None else None,
        sort_keys=True,
        default=_identity,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _identity(obj: Any) -> Any:
    """What stands for a non-JSON value in a key: a decoded image by its pixel digest
    (its repr would spell out megabytes of pixels, holding the GIL meanwhile), bytes by
    their hash, anything else by its repr."""
    digest = getattr(obj, "digest", None)
    if isinstance(digest, str):
        return {"digest": digest}
    if isinstance(obj, bytes | bytearray | memoryview):
        return hashlib.sha256(obj).hexdigest()
    return repr(obj)


class MissWarnings:
    """Which conversations already had their miss warning: a bounded LRU of keys, so a
    long-lived model that serves many conversations keeps a fixed amount of memory."""

    def __init__(self, limit: int = WARNED_CONVERSATIONS) -> None:
        self.limit = limit
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def first(self, key: str) -> bool:
        """True the first time ``key`` is seen (then remembered), False after."""
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return False
            self._seen[key] = None
            while len(self._seen) > self.limit:
                self._seen.popitem(last=False)
            return True


class LastKwargs:
    """The template arguments each conversation (:func:`conversation_key`) was last
    rendered with, as a hash: a bounded LRU, so a miss can say the arguments changed
    even where the text they changed lies inside a message."""

    def __init__(self, limit: int = WARNED_CONVERSATIONS) -> None:
        self.limit = limit
        self._last: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def changed(self, conversation: str, kwargs: str) -> bool:
        """Record ``kwargs`` for ``conversation``; True if it last rendered with others."""
        with self._lock:
            before = self._last.pop(conversation, None)
            self._last[conversation] = kwargs
            while len(self._last) > self.limit:
                self._last.popitem(last=False)
            return before is not None and before != kwargs


def kwargs_key(*options: Any) -> str:
    """A hash of what a request gives the template besides its messages and tools."""
    text = json.dumps(options, sort_keys=True, default=_identity)
    return hashlib.sha256(text.encode()).hexdigest()


def job_kwargs_key(job: Any) -> str:
    """:func:`kwargs_key` of a chat job: its template and the arguments that reach it."""
    return kwargs_key(
        job.chat_template,
        job.chat_template_kwargs,
        job.reasoning,
        job.reasoning_effort,
        job.reasoning_budget == 0,
    )


def reread_tokens(cache: dict[str, Any] | None, usage: dict[str, Any]) -> int:
    """Prompt tokens a call read again because it left the cached prompt (0: no miss)."""
    if not cache or not cache.get("missed"):
        return 0
    cached = usage.get("input_token_details", {}).get("cache_read", 0)
    return int(usage.get("input_tokens", 0)) - int(cached)


def warn_on_miss(
    cache: dict[str, Any] | None,
    usage: dict[str, Any],
    threshold: int | None,
    messages: Sequence[dict[str, Any]],
    warned: MissWarnings,
) -> bool:
    """Log a warning when a call missed the cache and read more than ``threshold``
    prompt tokens, once per conversation (:func:`conversation_key`); True if it did."""
    if threshold is None:
        return False
    reread = reread_tokens(cache, usage)
    if reread <= threshold or not warned.first(conversation_key(messages)):
        return False
    assert cache is not None
    miss = cache.get("miss") or {}
    logger.warning(
        "prompt cache miss: re-read %d prompt tokens (threshold %d) from message %s "
        "(%s), offset %s: cause %s; prompt %r. Not repeated for this "
        "conversation; response_metadata['cache'] has the details (docs/cache.md).",
        reread,
        threshold,
        miss.get("message_index"),
        miss.get("role"),
        miss.get("offset"),
        miss.get("cause") or "unknown",
        miss.get("prompt"),
    )
    return True
