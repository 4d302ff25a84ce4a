"""Shared pieces of the tool-call parsers: call records, JSON helpers, schema-aware values."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.utils.json import parse_partial_json

#: the ``<think>`` block most families (and every classic one) reason in
THINK = ("<think>", "</think>")

# --------------------------------------------------------------------------- helpers


@dataclass
class ParsedCall:
    """One call read from model output (the hand-written parsers' and the auto-parser's)."""

    name: str | None
    args: dict[str, Any] | None
    raw: str
    id: str | None = None
    error: str | None = None
    complete: bool = True
    opener: str = ""  # the marker the call's text follows (part of an invalid call's raw text)


def json_arguments(value: Any) -> dict[str, Any] | None:
    """Arguments as a dict: objects pass, JSON strings of objects are decoded."""
    if isinstance(value, dict):
        return value
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            decoded = json.loads(value) if value.strip() else {}
        except (ValueError, RecursionError):
            return None
        return decoded if isinstance(decoded, dict) else None
    return None


def call_from_obj(
    obj: Any, raw: str, keys: tuple[str, ...] = ("arguments", "parameters")
) -> ParsedCall:
    if not isinstance(obj, dict):
        return ParsedCall(None, None, raw, error="tool call is not a JSON object")
    fn = obj.get("function") if isinstance(obj.get("function"), dict) else None
    src = fn or obj
    name = src.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall(None, None, raw, error="tool call has no name")
    args_val: Any = {}
    for k in keys:
        if k in src:
            args_val = src[k]
            break
    args = json_arguments(args_val)
    cid = obj.get("id") or obj.get("tool_call_id")
    if args is None:
        return ParsedCall(
            name, None, raw, id=str(cid) if cid else None, error="arguments are not a JSON object"
        )
    return ParsedCall(name, args, raw, id=str(cid) if cid else None)


#: why a call whose JSON nests deeper than Python's reader goes is invalid
TOO_DEEP = "invalid JSON: nested too deep to read (Python's JSON reader stops near 1,000 levels)"


def loads_lenient(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"invalid JSON: {exc}"
    except RecursionError:
        return None, TOO_DEEP


def json_prefix(text: str) -> tuple[Any, int] | None:
    """Decode one JSON value at the start of ``text``; (value, end) or None."""
    try:
        return json.JSONDecoder().raw_decode(text)
    except (ValueError, RecursionError):
        return None


_FENCE = re.compile(r"^```(?:json|JSON)?\s*\n?(.*?)\n?```\s*$", re.S)


def unfence(text: str) -> str:
    m = _FENCE.match(text.strip())
    return m.group(1).strip() if m else text.strip()


def scan_regions(
    text: str,
    start: str,
    end: str | None,
    body: Any,
    final: bool,
    found_open: list[OpenRegion] | None = None,
) -> tuple[list[str], list[ParsedCall], int]:
    """Split ``text`` at ``start...end`` regions parsed by ``body(region) -> [calls]``.

    Returns content pieces, calls and how much of ``text`` is settled (the rest is an
    unfinished region, held back while streaming); ``found_open`` collects that region.
    """
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        i = text.find(start, pos)
        if i < 0:
            content.append(text[pos:])
            return content, calls, len(text)
        content.append(text[pos:i])
        j = text.find(end, i + len(start)) if end else -1
        if j < 0:
            region = text[i + len(start) :]
            if not final:
                if found_open is not None:
                    found_open.append(OpenRegion(len(region), body, len(calls)))
                partial = body(region, False)
                calls.extend(partial)
                return content, calls, i
            found = body(region, True)
            for c in found:
                c.opener = c.opener or start
            for c in found:
                if c.error is None and end is not None:
                    c.error = f"unterminated tool call (no {end})"
                    c.args = None
                c.raw = c.raw or region
            calls.extend(
                found
                or [ParsedCall(None, None, region, error=f"unterminated tool call (no {end})")]
            )
            return content, calls, len(text)
        for c in body(text[i + len(start) : j], True):
            c.opener = c.opener or start
            calls.append(c)
        pos = j + len(end)


@functools.lru_cache(maxsize=256)
def _marker_info(markers: tuple[str, ...]) -> tuple[int, frozenset[str]]:
    return max((len(m) for m in markers), default=0), frozenset(m[0] for m in markers if m)


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that could start one of ``markers``: what a
    stream holds back, as it may be a half-written marker."""
    if not text or not markers:
        return 0
    markers = tuple(markers)
    longest, firsts = _marker_info(markers)
    if longest < 2:
        return 0
    tail = text[-(longest - 1) :]
    for j, ch in enumerate(tail):
        if ch in firsts:
            rest = tail[j:]
            if any(len(m) > len(rest) and m.startswith(rest) for m in markers):
                return len(rest)
    return 0


def think_body_start(text: str, start: str, opened: bool, final: bool) -> int | None:
    """Where the body of a think block at the start of ``text`` begins: 0 when the prompt
    already opened it, after ``start`` when the text opens it; -1 while ``start`` is still
    being written (streaming); None when the text opens no block."""
    if opened:
        return 0
    stripped = text.lstrip()
    if start and stripped.startswith(start):
        return len(text) - len(stripped) + len(start)
    if start and not final and stripped and start.startswith(stripped):
        return -1
    return None


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Options:
    """What the parser knows besides the text: reasoning mode, bound tools, prompt end.

    ``reasoning``: None leaves think blocks in the content (llama.cpp's
    ``reasoning_format=none``); True or False extracts them (a model that thinks
    uninvited still gets its thoughts returned as reasoning, as llama.cpp does).
    ``prefill`` is the end of the rendered prompt (the template's generation prompt):
    a think block or a recipient marker (``>>>``) it opens is known to be open.
    ``calls`` is False when the request bound no tools: as in llama.cpp, nothing is then
    a call (call markup stays in the content as written), while reasoning and the
    family's turn and channel markup are still handled.
    """

    reasoning: bool | None = None
    think_open: bool = False
    schemas: Mapping[str, Any] = field(default_factory=dict)
    prefill: str = ""
    calls: bool = True

    @classmethod
    def make(
        cls,
        reasoning: bool | None,
        think_open: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        prefill: str,
    ) -> Options:
        calls = tools is None or len(tools) > 0  # an empty list: the request bound none
        return cls(reasoning, think_open, tool_schemas(tools), prefill or "", calls)

    def opened(self, marker: str) -> bool:
        """Whether the prompt ends inside ``marker`` (e.g. a prefilled ``<think>``)."""
        return bool(marker) and self.prefill.rstrip().endswith(marker.rstrip())

    def param_types(self, tool: str | None, param: str) -> set[str] | None:
        """JSON types the bound tool's schema allows for ``param`` (None: unknown)."""
        schema = self.schemas.get(tool or "")
        if not isinstance(schema, Mapping):
            return None
        props = schema.get("properties")
        if not isinstance(props, Mapping) or param not in props:
            return None
        return schema_types(props[param])


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """Tool name -> its parameters' JSON schema (OpenAI tool dicts or bare functions)."""
    schemas: dict[str, Any] = {}
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            schemas[fn["name"]] = fn.get("parameters") or {}
    return schemas


def schema_types(schema: Any) -> set[str] | None:
    if not isinstance(schema, Mapping):
        return None
    out: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        out.add(t)
    elif isinstance(t, list):
        out.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            sub_types = schema_types(sub)
            if sub_types is None:
                return None
            out |= sub_types
    if "enum" in schema and not out:
        vals = schema["enum"]
        if isinstance(vals, list) and vals and all(isinstance(v, str) for v in vals):
            out.add("string")
    if "const" in schema and not out and isinstance(schema["const"], str):
        out.add("string")
    return out or None


_JSON_TYPES = {
    dict: "object",
    list: "array",
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
}


_PY_LITERALS = {"True": True, "False": False, "None": None}


def typed_value(raw: str, types: set[str] | None) -> Any:
    """A tagged argument's text as the schema wants it (llama.cpp's schema-aware typing).

    A ``string``-only parameter keeps its text verbatim; a non-string one is read as JSON;
    a union tries JSON for its non-string types first and falls back to the text.
    Without a schema, JSON if it parses, else the text. A value that cannot be a string
    may also be written as a Python literal (``True``, ``None``: a template that prints
    the value instead of ``tojson``).
    """
    if types is not None and types <= {"string"}:
        return raw
    try:
        value = json.loads(raw)
    except RecursionError:
        return raw
    except ValueError:
        literal = raw.strip()
        if literal in _PY_LITERALS and (types is None or "string" not in types):
            return _PY_LITERALS[literal]
        return raw
    if types is None:
        return value
    kind = "null" if value is None else _JSON_TYPES.get(type(value), "")
    if kind in types or kind == "integer" and "number" in types:
        return value
    return raw if "string" in types else value


def json_safe(value: Any) -> Any:
    """``value`` if it is plain JSON data (finite numbers, string keys), else ValueError.

    Model output decoded by ``ast.literal_eval`` can hold complex numbers, sets, bytes or
    tuple keys, which must become an invalid call, never an exception later on.
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite number {value!r}")
        return value
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"non-string key {k!r}")
            out[k] = json_safe(v)
        return out
    raise ValueError(f"{type(value).__name__} value {value!r} is not JSON")


def checked(call: ParsedCall) -> ParsedCall:
    """The call, or an invalid one when its arguments cannot be sent as JSON."""
    if call.error is None and call.args is not None:
        try:
            call.args = json_safe(call.args)
            json.dumps(call.args, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, RecursionError) as exc:
            call.error = f"arguments are not JSON data: {exc}"[:500]
            call.args = None
    return call


def read_as_arguments(text: str) -> bool:
    """Whether LangChain would read ``text``, given as a tool-call chunk's arguments, as a
    call: its chunk merging parses partial JSON (``{"a": "b`` is ``{"a": "b"}``), its
    streaming protocol any complete JSON value, and empty arguments are ``{}``. Text
    nested too deep for Python's JSON reader is no call to LangChain either (its chunk
    merging files the ``RecursionError`` under invalid calls)."""
    if not text.strip():
        return True
    try:
        json.loads(text)
        return True
    except RecursionError:
        return False
    except ValueError:
        pass
    try:
        return isinstance(parse_partial_json(text), dict)
    except Exception:
        return False


def invalid_args(call: ParsedCall) -> str:
    """The raw text an invalid call reports, never readable as arguments.

    A truncated ``{"name": "f", "arguments": {"a": "b`` streamed as a tool-call chunk
    would be merged by LangChain into a valid-looking call; with the marker the model
    wrote before it (``<tool_call>``) it stays the raw text of an invalid call.
    """
    raw = call.raw if isinstance(call.raw, str) else str(call.raw)
    if not read_as_arguments(raw):
        return raw
    if call.opener and not read_as_arguments(call.opener + raw):
        return call.opener + raw
    # no marker before it: name what it is, so no reader takes it for arguments
    return f"(invalid tool call) {raw}"


Body = Callable[[str, bool], list[ParsedCall]]


# --------------------------------------------------------------------------- scanning


@dataclass(frozen=True)
class OpenRegion:
    """The call region a scan's text ends inside (streaming): its body is the last
    ``tail`` characters of the text, read by ``body``; ``before`` calls of the scan come
    before it (``name``: the call's name where the scanner knows it from a header)."""

    tail: int
    body: Any
    before: int
    name: str | None = None
    end: str | None = None  # the region's end marker


@dataclass
class RegionScan:
    reasoning: str | None
    content: str
    calls: list[ParsedCall]
    settled: bool  # False: the tail is an unfinished call/marker (streaming only)
    #: where the text ends, for a stream that goes on from there without reading it
    #: again: ``"rest"`` past the reasoning block, ``"think"`` inside it, ``""`` at no
    #: point a scan can restart from
    stage: str = ""
    #: the text ends inside a call region: content and reasoning cannot change until
    #: a marker is written
    open: bool = False
    #: the output is held back until one of these strings is written (or the end)
    hold: tuple[str, ...] | None = None
    #: the content read past the reasoning block is all whitespace so far
    rest_blank: bool = True
    #: the end of the content is held back (it may be a marker still being written)
    trimmed: bool = False
    #: what a scan of the text that follows starts with to read it as this one would
    #: (the header of the message the text ends in)
    resume: str = ""
    #: what may change how an open call reads (None: the family's call regions say)
    wake: tuple[tuple[str, ...], frozenset[str]] | None = None
    #: the call region the text ends inside (None: none, or not known to the scanner)
    open_region: OpenRegion | None = None


@dataclass(frozen=True)
class ParseContext:
    """What a scan that starts part-way through a generation knows about the part before."""

    head: bool = True  # no content has been read yet (rules on the whole output apply)
    had_calls: bool = False  # calls were read before


@functools.lru_cache(maxsize=128)
def _end_pattern(end: str, syntax: str) -> re.Pattern[str]:
    if syntax == "json":
        quoted = r'"(?:[^"\\]|\\.)*(?P<close>")?'
    else:
        quoted = r'<\|"\|>(?:(?!<\|"\|>).)*(?P<close><\|"\|>)?'
    return re.compile(quoted + "|(?P<end>" + re.escape(end) + ")", re.S)


def _find_end(text: str, end: str, start: int, syntax: str | None, final: bool) -> int:
    """The first ``end`` at or after ``start`` that is not inside a quoted value.

    At the end of generation a body whose quotes never close (malformed) ends at the
    first ``end`` as written, so the text after it is not swallowed into the call.
    """
    j = text.find(end, start)
    if j < 0 or syntax is None:
        return j
    pos = start
    if syntax == "json":
        m = re.compile(r"[{\[]").search(text, start)
        if m is None or m.start() > j:
            return j
        pos = m.start()
    for m in _end_pattern(end, syntax).finditer(text, pos):
        if m.group("end") is not None:
            return m.start()
        if m.group("close") is None:
            break  # a quoted value still open: the end has not come yet
    return j if final else -1


def scan_multi(
    text: str,
    regions: tuple[tuple[str, str | None, Any], ...],
    opts: Options,
    final: bool,
    found_open: list[OpenRegion] | None = None,
) -> tuple[list[str], list[ParsedCall], int]:
    """Split ``text`` at the tool-call regions ``(start, end, body)`` (earliest start first).

    Returns the content pieces, the calls and how much of ``text`` is settled (the rest
    is an unfinished region, held back while streaming). A region's end marker inside
    one of its quoted values does not end it. ``found_open`` collects the region the
    text ends inside (streaming), for a stream of its arguments.
    """
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0

    def add(found: list[ParsedCall], start: str) -> None:
        for c in found:
            c.opener = c.opener or start
        calls.extend(found)

    while True:
        best: tuple[int, str, str | None, Any] | None = None
        for start, end, body in regions:
            i = text.find(start, pos)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, start, end, body)
        if best is None:
            content.append(text[pos:])
            return content, calls, len(text)
        i, start, end, body = best
        content.append(text[pos:i])
        j = (
            _find_end(text, end, i + len(start), getattr(body, "string_syntax", None), final)
            if end
            else -1
        )
        if j < 0:
            region = text[i + len(start) :]
            if not final:
                if found_open is not None:
                    found_open.append(OpenRegion(len(region), body, len(calls), end=end))
                add(body(region, False, opts), start)
                return content, calls, i
            found = body(region, True, opts)
            # a call that closed itself stays a call when only its section's end is
            # missing (as it was streamed); the one still being written is cut off
            whole = [c.complete for c in body(region, False, opts)] if end is not None else []
            for n, c in enumerate(found):
                if c.error is None and end is not None and not (n < len(whole) and whole[n]):
                    c.error = f"unterminated tool call (no {end})"
                    c.args = None
            add(
                found
                or [ParsedCall(None, None, region, error=f"unterminated tool call (no {end})")],
                start,
            )
            return content, calls, len(text)
        region = text[i + len(start) : j]
        found = body(region, True, opts)
        if not found and region.strip():  # a region no call could be read from is reported
            found = [
                ParsedCall(None, None, region, error=f"cannot read a tool call in {start}…{end}")
            ]
        add(found, start)
        pos = j + len(end)
