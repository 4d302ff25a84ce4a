"""The parse loop: reasoning split, per-format tool-call scanning, streaming.

``parse`` and :class:`StreamParser` scan the whole text so far on every delta (as
llama.cpp's server re-parses the whole generation) and emit only what can no longer
change: a half-written marker, an unfinished call or a header still being written is
held back. Each format's record (:mod:`.registry`) says what to read: the classic
formats (``hermes``, ``llama3_json``, ``pythonic``, ``granite``, ``functionary_v3_2``,
``deepseek_r1``, ``generic``, ``content``, no spec) are read here; the families with a
:class:`~.families.Spec` (markers + body readers from :mod:`.families`) by the region
scanner; ``gpt_oss`` (harmony messages) by :func:`_gpt_oss`; ``auto`` by the template
analysis. Anything malformed becomes an ``invalid_tool_calls`` entry with the
raw text and a reason, never an exception.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages.tool import InvalidToolCall, ToolCall, invalid_tool_call, tool_call

from langchain_llamacpp_local.formats.auto.parser import parse_with_analysis
from langchain_llamacpp_local.formats.base import (
    Options,
    _Call,
    _call_from_obj,
    _held_suffix,
    _json_prefix,
    _loads,
    _scan_regions,
    _unfence,
    checked,
    invalid_args,
    think_body_start,
)
from langchain_llamacpp_local.formats.families import Spec, _py_literal, reads
from langchain_llamacpp_local.formats.registry import FAMILIES

if TYPE_CHECKING:
    from langchain_llamacpp_local.formats.auto.analyzer import TemplateAnalysis

logger = logging.getLogger(__name__)

#: Every format :func:`parse` reads: the families' records, and ``auto`` (learned from the
#: template by :mod:`.auto`, needs ``analysis=``).
FORMATS: tuple[str, ...] = (*FAMILIES, "auto")

THINK = ("<think>", "</think>")
_DS = {
    "calls_begin": "<｜tool▁calls▁begin｜>",
    "calls_end": "<｜tool▁calls▁end｜>",
    "call_begin": "<｜tool▁call▁begin｜>",
    "call_end": "<｜tool▁call▁end｜>",
    "sep": "<｜tool▁sep｜>",
}
_DS_CALLS = "<｜tool▁calls｜>"
#: Formats whose tool calls are the whole output (a JSON/list document): their
#: content cannot be streamed until it is clear the output is not a call.
_WHOLE_OUTPUT = {"llama3_json", "pythonic", "generic"}


@dataclass
class ParsedOutput:
    """A generation split into its parts."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


@dataclass
class StreamDelta:
    """One streamed piece: content or reasoning text, or a tool-call chunk."""

    kind: Literal["content", "reasoning", "tool_call"]
    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    args: str = ""
    #: the log-probabilities of the tokens sampled since the previous piece (set by
    #: the worker when the request asks for them)
    logprobs: list[dict[str, Any]] | None = None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------- per format


def _hermes_body(region: str, final: bool) -> list[_Call]:
    s = region.strip()
    m = re.match(r"^<function=([^>\s]+)>\s*(.*?)\s*(</function>)?\s*$", s, re.S)
    if m:
        if not final and not m.group(3):
            return [_Call(m.group(1), None, s, complete=False)]
        args, err = _loads(m.group(2) or "{}")
        if err or not isinstance(args, dict):
            return [
                _Call(
                    m.group(1),
                    None,
                    s,
                    error=err or "arguments are not a JSON object",
                    complete=final,
                )
            ]
        return [_Call(m.group(1), args, s)]
    if not final:
        name = re.match(r'^\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', s)
        return [_Call(json.loads(f'"{name.group(1)}"') if name else None, None, s, complete=False)]
    obj, err = _loads(_unfence(s))
    if err:
        name = re.match(r'^\{\s*"name"\s*:\s*"([\w.\-]+)"', s)
        return [_Call(name.group(1) if name else None, None, region.strip(), error=err)]
    if isinstance(obj, list):
        return [_call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in obj]
    return [_call_from_obj(obj, region.strip())]


def _list_body(
    region: str, final: bool, keys: tuple[str, ...] = ("arguments", "parameters")
) -> list[_Call]:
    if not final:
        return []
    s = _unfence(region.strip())
    obj, err = _loads(s)
    if err:
        return [_Call(None, None, s, error=err)]
    items = obj if isinstance(obj, list) else [obj]
    return [_call_from_obj(o, json.dumps(o, ensure_ascii=False), keys) for o in items]


def _pythonic_calls(text: str) -> list[_Call] | None:
    """``[f(a=1), g()]`` as calls, or None when the text is not such a list."""
    s = text.strip()
    if not (s.startswith("[") and s.endswith("]")):
        return None
    try:
        tree = ast.parse(s, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[_Call] = []
    for el in tree.body.elts:
        if not isinstance(el, ast.Call):
            return None
        raw = ast.get_source_segment(s, el) or ""
        name_node = el.func
        parts = []
        while isinstance(name_node, ast.Attribute):
            parts.append(name_node.attr)
            name_node = name_node.value
        if not isinstance(name_node, ast.Name):
            calls.append(_Call(None, None, raw, error="call target is not a name"))
            continue
        name = ".".join([name_node.id, *reversed(parts)])
        try:
            args = {kw.arg: _py_literal(kw.value) for kw in el.keywords if kw.arg}
            if el.args:
                raise ValueError("positional arguments")
            if any(kw.arg is None for kw in el.keywords):
                raise ValueError("**kwargs")
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError) as exc:
            calls.append(_Call(name, None, raw, error=f"arguments are not literals: {exc}"))
            continue
        calls.append(_Call(name, args, raw))
    return calls


def _builtin_call(code: str) -> list[_Call]:
    """Llama 3.1 built-in tools after ``<|python_tag|>``: ``name.call(k=v)``, else Python code."""
    s = code.strip()
    m = re.match(r"^([A-Za-z_][\w]*)\.call\((.*)\)\s*;?$", s, re.S)
    if m:
        found = _pythonic_calls(f"[{m.group(1)}({m.group(2)})]")
        if found:
            return found
    return [_Call("python", {"code": s}, s)]


def _llama3_calls(text: str) -> list[_Call] | None:
    s = text.strip()
    if s.startswith("<|python_tag|>"):
        s = s[len("<|python_tag|>") :].strip()
        if not s.startswith("{"):
            return _builtin_call(s)
    if not s.startswith("{"):
        return None
    calls: list[_Call] = []
    pos = 0
    while pos < len(s):
        parsed = _json_prefix(s[pos:])
        if parsed is None:
            if calls:
                calls.append(_Call(None, None, s[pos:], error="invalid JSON after tool calls"))
                return calls
            return None
        obj, end = parsed
        if not isinstance(obj, dict) or "name" not in obj:
            return None
        calls.append(_call_from_obj(obj, s[pos : pos + end], ("parameters", "arguments")))
        pos += end
        while pos < len(s) and s[pos] in " \t\r\n;":
            pos += 1
    return calls


def _generic_calls(text: str) -> tuple[list[_Call], str] | None:
    s = _unfence(text)
    if not s.startswith("{"):
        return None
    obj, err = _loads(s)
    if err or not isinstance(obj, dict):
        return None
    if "tool_calls" in obj and isinstance(obj["tool_calls"], list):
        return [_call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in obj["tool_calls"]], ""
    if "tool_call" in obj:
        return [
            _call_from_obj(obj["tool_call"], json.dumps(obj["tool_call"], ensure_ascii=False))
        ], ""
    if "response" in obj:
        resp = obj["response"]
        return [], resp if isinstance(resp, str) else json.dumps(resp, ensure_ascii=False)
    return None


def _functionary_body(text: str, final: bool) -> tuple[list[str], list[_Call], int]:
    """``>>>name\n{json}`` blocks; ``>>>all\n`` blocks are content."""
    if ">>>" not in text:
        return [text], [], len(text)
    first = text.find(">>>")
    content: list[str] = [text[:first]]
    calls: list[_Call] = []
    parts = text[first:].split(">>>")[1:]
    offset = first
    for n, part in enumerate(parts):
        last = n == len(parts) - 1
        head, newline, body = part.partition("\n")
        name = head.strip()
        if last and not final:
            if not newline:
                return content, calls, offset  # the name line is still being written
            if name == "all":
                content.append(body)
                return content, calls, len(text)
            calls.append(_Call(name, None, body, complete=False))
            return content, calls, offset
        if name == "all":
            content.append(body)
        elif name == "python" and not body.lstrip().startswith("{"):
            calls.append(_Call("python", {"code": body}, body))  # raw code, as llama.cpp reads it
        else:
            obj, err = _loads(body.strip() or "{}")
            if err or not isinstance(obj, dict):
                calls.append(
                    _Call(
                        name or None,
                        None,
                        body.strip(),
                        error=err or "arguments are not a JSON object",
                    )
                )
            else:
                calls.append(_Call(name, obj, body.strip()))
        offset += 3 + len(part)
    return content, calls, len(text)


def _deepseek_body(region: str, final: bool) -> list[_Call]:
    out: list[_Call] = []
    for m in re.finditer(
        re.escape(_DS["call_begin"]) + r"(.*?)(" + re.escape(_DS["call_end"]) + r"|$)", region, re.S
    ):
        inner, closed = m.group(1), bool(m.group(2))
        head, _, rest = inner.partition(_DS["sep"])
        name, newline, body = rest.partition("\n")
        if not closed and not final:
            # the name is known once its line is complete
            out.append(_Call(name.strip() if newline else None, None, inner, complete=False))
            continue
        obj, err = _loads(_unfence(body))
        if not closed:
            err = err or "unterminated tool call"
        if err or not isinstance(obj, dict):
            out.append(
                _Call(
                    name.strip() or None,
                    None,
                    inner,
                    error=err or "arguments are not a JSON object",
                )
            )
        else:
            out.append(_Call(name.strip(), obj, inner))
    return out


# --------------------------------------------------------------------------- core parse


@dataclass
class _Scan:
    reasoning: str | None
    content: str
    calls: list[_Call]
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


@dataclass(frozen=True)
class _Ctx:
    """What a scan that starts part-way through a generation knows about the part before."""

    head: bool = True  # no content has been read yet (rules on the whole output apply)
    had_calls: bool = False  # calls were read before


@dataclass
class _Reasoning:
    text: str | None  # extracted reasoning (None: none, or not extracting)
    raw: str  # the think block as written (with the prompt's opening marker)
    rest: str  # what follows the think block
    done: bool  # the block is closed (or there is none)
    held: bool = False  # a half-written opening marker (streaming)
    stopped: bool = False  # ended by a call written inside it, not by its end marker


def _spec(fmt: str) -> Spec | None:
    """The format's markers and body readers (None: the classic formats, read here)."""
    family = FAMILIES.get(fmt)
    return family.spec if family is not None else None


def _think_markers(fmt: str) -> tuple[str, str] | None:
    spec = _spec(fmt)
    return spec.think if spec is not None else THINK


def _split_reasoning(text: str, fmt: str, opts: Options, final: bool) -> _Reasoning:
    """The leading think block (opened by the model or already by the prompt)."""
    markers = _think_markers(fmt)
    if markers is None:
        return _Reasoning(None, "", text, True)
    start, end = markers
    spec = _spec(fmt)
    lead = spec.reasoning_lead if spec is not None else ""
    think_stops = spec.think_stops if spec is not None else ()
    opened = opts.think_open or (opts.opened(start) if start else bool(lead) and opts.opened(lead))
    found = think_body_start(text, start, opened, final)
    raw_open = ""
    if opened:
        raw_open = (
            opts.prefill[opts.prefill.rfind(start) :] if start and start in opts.prefill else ""
        )
    elif found == -1:
        return _Reasoning("", "", "", False, held=True)
    elif found is None:
        # a family that may skip the opener (MiniMax M3) marks a turn without thoughts by
        # a bare end marker at the start; text before an end marker is not reasoning
        # (llama.cpp: optional(block | THINK_END)), so a stream never takes content back
        implicit = spec is not None and spec.think_implicit
        head = text.lstrip()
        if implicit and not final and head and end.startswith(head) and head != end:
            return _Reasoning("", "", "", False, held=True)
        if not (implicit and head.startswith(end)):
            return _Reasoning(None, "", text, True)
        found = len(text) - len(head)
    body_start = found
    j = text.find(end, body_start)
    end_len = len(end)
    for stop in think_stops:
        k = text.find(stop, body_start)
        if k >= 0 and (j < 0 or k < j):
            j, end_len = k, 0
    if j < 0:
        body, rest, done, raw = text[body_start:], "", False, raw_open + text
    elif end_len == 0:  # ended by a call, not by its end marker: the prompt's opener stays out
        body, rest, done, raw = text[body_start:j], text[j:], True, text[:j]
    else:
        body, rest, done, raw = (
            text[body_start:j],
            text[j + end_len :],
            True,
            raw_open + text[: j + end_len],
        )
    if opts.reasoning is None:
        settled_body = body
        if not done and not final:  # the end (or a stop marker) may be half-written
            stops = (end, *think_stops)
            settled_body = body[: len(body) - _held_suffix(body, stops)]
            if raw_open and len(stops) > 1:
                # ended by a call, the block leaves out the prompt's opener: not yet known
                return _Reasoning(None, "", rest, done)
        return _Reasoning(None, raw if settled_body.strip() or not opened else "", rest, done)
    if lead and opened:
        body = lead + body
    return _Reasoning(body if body.strip() else None, raw, rest, done, stopped=done and not end_len)


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


def _scan_multi(
    text: str, regions: tuple[tuple[str, str | None, Any], ...], opts: Options, final: bool
) -> tuple[list[str], list[_Call], int]:
    """Split ``text`` at the tool-call regions ``(start, end, body)`` (earliest start first).

    Returns the content pieces, the calls and how much of ``text`` is settled (the rest
    is an unfinished region, held back while streaming). A region's end marker inside
    one of its quoted values does not end it.
    """
    content: list[str] = []
    calls: list[_Call] = []
    pos = 0

    def add(found: list[_Call], start: str) -> None:
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
                found or [_Call(None, None, region, error=f"unterminated tool call (no {end})")],
                start,
            )
            return content, calls, len(text)
        region = text[i + len(start) : j]
        found = body(region, True, opts)
        if not found and region.strip():  # a region no call could be read from is reported
            found = [_Call(None, None, region, error=f"cannot read a tool call in {start}…{end}")]
        add(found, start)
        pos = j + len(end)


def _scan_spec(
    rest: str, fmt: str, opts: Options, final: bool
) -> tuple[str, list[_Call], bool, bool]:
    """(content, calls, settled, whether the content's end is held back while streaming)."""
    spec = FAMILIES[fmt].spec
    assert spec is not None
    calls: list[_Call] = []
    if opts.calls and fmt == "functionary_v3_1" and "<|python_tag|>" in rest:
        i = rest.index("<|python_tag|>")
        code = rest[i + len("<|python_tag|>") :]
        rest = rest[:i]
        calls.append(_Call("python", {"code": code}, code, complete=final))
    # no tools bound: call markup is content, only turn and channel markup goes
    regions = spec.regions if opts.calls else ()
    strip = (*spec.strip, *spec.section) if opts.calls else spec.strip
    pieces, found, settled_at = _scan_multi(rest, regions, opts, final)
    content = "".join(pieces)
    trimmed = False
    if not final and strip:
        # a stripped marker may be the start of a longer one: settle only what cannot grow
        held = _held_suffix(content, strip)
        content, trimmed = content[: len(content) - held], held > 0
    for m in strip:
        content = content.replace(m, "")
    if spec.strip_re:
        if not final:  # a header still being written is held back
            cut = max(content.rfind("to="), content.rfind("<|start|>"))
            if cut >= 0 and "<|message|>" not in content[cut:]:
                content, trimmed = content[:cut], True
        content = re.sub(spec.strip_re, "", content)
    return content, found + calls, settled_at >= len(rest), trimmed


_HERMES_TAGS = ("tool_call", "function_call", "tool", "tools", "response", "json", "xml", "JSON")


@reads("json")
def _hermes_json(region: str, final: bool, opts: Options) -> list[_Call]:
    return _hermes_body(region, final)


@reads("json")
def _hermes_fn(region: str, final: bool, opts: Options) -> list[_Call]:
    """``<function=NAME>{json}</function>`` or ``<function name="NAME">{json}</function>``."""
    m = re.match(r'^(?:=([^>\s]+)|\s+name="([^"]*)")>(.*)$', region, re.S)
    if not m:
        return (
            [_Call(None, None, region, complete=False)]
            if not final
            else [_Call(None, None, region, error="cannot read the <function> call")]
        )
    name = m.group(1) or m.group(2)
    if not final:
        return [_Call(name, None, region, complete=False)]
    args, err = _loads(m.group(3).strip() or "{}")
    if err or not isinstance(args, dict):
        return [
            _Call(name, None, m.group(3).strip(), error=err or "arguments are not a JSON object")
        ]
    return [_Call(name, args, m.group(3).strip())]


_HERMES_REGIONS: tuple[tuple[str, str | None, Any], ...] = (
    *((f"<{t}>", f"</{t}>", _hermes_json) for t in _HERMES_TAGS),
    ("<function", "</function>", _hermes_fn),
)


def _bare_call(text: str) -> list[_Call] | None:
    """A whole output that is one ``{"name", "arguments"}`` object (maybe fenced)."""
    s = _unfence(text)
    if not s.startswith("{"):
        return None
    obj, err = _loads(s)
    if (
        err
        or not isinstance(obj, dict)
        or "name" not in obj
        or not ({"arguments", "parameters"} & obj.keys())
    ):
        return None
    return [_call_from_obj(obj, s)]


_EMPTY_FENCE = re.compile(r"```(?:xml|json|JSON)?[ \t]*\n\s*```[ \t]*\n?")
#: a fence at the end of the text so far that may still open a call (its language half-written)
_OPEN_FENCE = re.compile(r"```(?:[A-Za-z]{0,3}|xml|json|JSON)[ \t]*(?:\n\s*(?:`{0,2}|<[^\n>]*))?$")


def _legacy_plain(
    rest: str, fmt: str, opts: Options, final: bool
) -> tuple[str, list[_Call], bool] | None:
    """A classic format's output when no tools are bound: its wrappers go, calls stay text."""
    if fmt == "granite":
        return _granite_unwrap(rest), [], True
    if fmt == "functionary_v3_2":
        # the generation prompt ends with ">>>": plain text is the "all" recipient's message
        text = rest if opts.opened(">>>") else rest.removeprefix(">>>")
        if not final and len(text) < len(_ALL) and _ALL.startswith(text):
            return None
        return text.removeprefix(_ALL), [], True
    return rest, [], True


_ALL = "all\n"


def _granite_unwrap(text: str) -> str:
    """Granite's answer without its ``<response>`` wrapper (with or without tools)."""
    return text.replace("<response>", "").replace("</response>", "")


def _hermes_rest(
    rest: str, opts: Options, final: bool, ctx: _Ctx
) -> tuple[str, list[_Call], bool, bool] | None:
    """Hermes content and calls, and whether the content's end is held back (a fence)."""
    pieces, calls, settled_at = _scan_multi(rest, _HERMES_REGIONS, opts, final)
    content = "".join(pieces)
    if (
        calls or ctx.had_calls
    ):  # a call wrapped in a ```xml / ```json fence leaves no empty fence behind
        content = _EMPTY_FENCE.sub("", content)
    trimmed = False
    if not final:  # a fence that may open a call is held back until it is known
        m = _OPEN_FENCE.search(content)
        if m is not None:
            content, trimmed = content[: m.start()], True
    if not calls and not ctx.had_calls and ctx.head:
        s = content.strip()
        if not final and (s.startswith("{") or s.startswith("```")):
            return None
        bare = _bare_call(content) if final else None
        if bare is not None:
            return "", bare, True, False
    return content, calls, settled_at >= len(rest), trimmed


def _legacy_body(
    rest: str, fmt: str, opts: Options, final: bool, ctx: _Ctx = _Ctx()
) -> tuple[str, list[_Call], bool] | None:
    """Content and calls of the classic formats; None: hold everything back (streaming).

    ``ctx`` says what came before ``rest`` when a stream reads on from a settled point:
    the rules on the whole output (a bare JSON call, a pythonic list) then no longer apply.
    """
    if not opts.calls:
        return _legacy_plain(rest, fmt, opts, final)
    if fmt == "hermes":
        read = _hermes_rest(rest, opts, final, ctx)
        return None if read is None else read[:3]
    if fmt == "granite":
        c = _granite_unwrap(rest)
        pieces, calls, settled_at = _scan_regions(c, "<|tool_call|>", None, _list_body, final)
        return "".join(pieces), calls, settled_at >= len(c)
    if fmt == "functionary_v3_2":
        text = ">>>" + rest if opts.opened(">>>") else rest
        pieces, calls, settled_at = _functionary_body(text, final)
        return "".join(pieces), calls, settled_at >= len(text)
    if fmt == "deepseek_r1":
        # "<｜tool▁calls｜>" opens the calls and the first call at once (an R1 variant)
        c = rest.replace(_DS_CALLS, _DS["calls_begin"] + _DS["call_begin"])
        c = c.replace(_DS["calls_end"], "")
        pieces, calls, settled_at = _scan_regions(
            c, _DS["calls_begin"], None, _deepseek_body, final
        )
        return "".join(pieces), calls, settled_at >= len(c)
    if fmt == "pythonic":
        if ctx.had_calls:  # only the first call block is read: the rest is text
            return rest, [], True
        m = re.search(r"<\|tool_call_start\|>(.*?)(<\|tool_call_end\|>|$)", rest, re.S)
        if m:
            if not m.group(2) and not final:
                named = re.match(r"\s*\[\s*([\w.\-]+)\(", m.group(1))
                return (
                    rest[: m.start()],
                    [_Call(named and named.group(1), None, m.group(1), complete=False)],
                    False,
                )
            found = _pythonic_calls(m.group(1))
            calls = (
                found
                if found is not None
                else [_Call(None, None, m.group(1), error="not a list of calls")]
            )
            return rest[: m.start()] + rest[m.end() :], calls, True
        if not final and ctx.head and rest.lstrip().startswith("["):
            return None
        found = _pythonic_calls(rest) if final and ctx.head else None
        return ("", found, True) if found is not None else (rest, [], True)
    if fmt == "llama3_json":
        s = rest.strip()
        if not final and (
            "<|python_tag|>" in s
            or ctx.head
            and (s.startswith("{") or s and "<|python_tag|>".startswith(s))
        ):
            return None
        found = _llama3_calls(rest) if final and ctx.head else None
        if found is not None:
            return "", found, True
        if final and "<|python_tag|>" in rest:
            i = rest.index("<|python_tag|>")
            return rest[:i], _llama3_calls(rest[i:]) or [], True
        return rest, [], True
    if fmt == "generic":
        s = rest.strip()
        if not final and ctx.head and (s.startswith("{") or s.startswith("`")):
            return None
        generic = _generic_calls(rest) if final and ctx.head else None
        if generic is not None:
            return generic[1], generic[0], True
        return rest, [], True
    return rest, [], True  # content


def _scan_auto(
    text: str, opts: Options, final: bool, analysis: TemplateAnalysis, rest: bool = False
) -> _Scan:
    """A format learned from the template (llama.cpp's auto-parser route); ``rest``: the
    text follows the reasoning block and no call before it."""
    gen = analysis.reasoning_prefill(opts.prefill) or None
    out = parse_with_analysis(
        text,
        analysis,
        final=final,
        reasoning=None if rest else opts.reasoning,
        think_open=False if rest else opts.think_open,
        tools=[{"function": {"name": k, "parameters": v}} for k, v in opts.schemas.items()] or None,
        generation_prompt=None if rest else gen,
        calls=opts.calls,
    )
    content = out.content[: len(out.content) - out.held] if not final and out.held else out.content
    sc = _Scan(out.reasoning, content, out.calls, out.settled)
    turn_end = analysis.turn_end.strip()
    if (
        out.settled
        and not out.calls
        and not out.held
        and text.strip()
        and not (turn_end and text.rstrip().endswith(turn_end))
    ):
        sc.stage = "rest"  # past the reasoning, before any call: plain text so far
    elif not out.settled and (rest or opts.reasoning is None) and _json_call_open(text, analysis):
        sc.stage, sc.open = "rest", True  # a call being written: read again where it may end
        sc.wake = (tuple(m for m in analysis.markers if m), frozenset(">]}"))
    return sc


def _json_call_open(text: str, a: TemplateAnalysis) -> bool:
    """Whether ``text`` ends inside the JSON of a learned format's call (its reading can
    only change where a bracket closes or a marker is written)."""
    if a.tool_format != "json" or not a.trigger:
        return False
    starts = [m for m in (a.trigger.strip(), a.per_call_start.strip()) if m]
    k, marker = max((text.rfind(m), m) for m in starts)
    return k >= 0 and text[k + len(marker) :].lstrip()[:1] in ("{", "[")


def _scan(
    text: str, fmt: str, opts: Options, final: bool, analysis: TemplateAnalysis | None = None
) -> _Scan:
    """The whole generation so far (or at its end) split into its parts."""
    if fmt == "auto":
        if analysis is None:
            raise ValueError("format 'auto' needs the template's analysis (analysis=...)")
        return _scan_auto(text, opts, final, analysis)
    if fmt == "gpt_oss":
        return _gpt_oss(text, opts, final)
    if fmt == "muse_glimmer":
        return _muse(text, opts, final)
    r = _split_reasoning(text, fmt, opts, final)
    if r.held:
        return _Scan(None, "", [], False)
    prefix = r.raw if opts.reasoning is None else ""
    if not r.done:
        # inside the think block: a stream reads on from here once what it holds is known
        # to be reasoning (or, kept as text, content)
        stage = "think" if opts.reasoning is not None or prefix else ""
        return _Scan(r.text, prefix, [], final, stage=stage)
    reasoning = r.text
    end = (_think_markers(fmt) or ("", ""))[1]
    if r.stopped and opts.reasoning is not None and end:
        # calls written inside the think block: what follows them up to its end marker
        # is still reasoning (Kimi K2 thinking); until that marker or the end of the
        # generation it is not known to be content
        k = r.rest.rfind(end)
        if k >= 0:
            pre, calls_pre, _, _ = _scan_spec(r.rest[:k], fmt, opts, True)
            content, calls, settled, _ = _scan_spec(r.rest[k + len(end) :], fmt, opts, final)
            reasoning = (reasoning or "") + pre if pre.strip() else reasoning
            calls = calls_pre + calls
        else:
            content, calls, settled, _ = _scan_spec(r.rest, fmt, opts, final)
            if not final:
                content, settled = "", False
        if fmt == "glm45" and "<think>" in content:
            content, more, open_block = _later_thoughts(content, final)
            reasoning = "\n".join(t for t in (reasoning, *more) if t) or reasoning
            settled = settled and not open_block
        return _Scan(reasoning, prefix + content, calls, settled and all(c.complete for c in calls))
    sc = _scan_rest(r.rest, fmt, opts, final, _Ctx())
    if sc.reasoning is not None:  # thoughts between calls (GLM)
        sc.reasoning = "\n".join(t for t in (reasoning, sc.reasoning) if t) or reasoning
    else:
        sc.reasoning = reasoning
    sc.content = prefix + sc.content
    if not text.strip():
        sc.stage = ""  # a think block may still open after the whitespace
    return sc


def _scan_rest(
    rest: str,
    fmt: str,
    opts: Options,
    final: bool,
    ctx: _Ctx,
    analysis: TemplateAnalysis | None = None,
) -> _Scan:
    """What follows the reasoning block (all of it, or from a settled point on: ``ctx``).

    The scan's ``reasoning`` is that of the think blocks inside the content (GLM), or None.
    """
    if fmt == "gpt_oss":
        return _gpt_oss(rest, opts, final, blank=True)
    if fmt == "muse_glimmer":
        return _muse(rest, opts, final)
    if fmt == "auto":
        assert analysis is not None
        return _scan_auto(rest, opts, final, analysis, rest=True)
    trimmed = False
    wake: tuple[tuple[str, ...], frozenset[str]] | None = None
    if _spec(fmt) is not None:
        content, calls, settled, trimmed = _scan_spec(rest, fmt, opts, final)
        region = not settled
    else:
        body = (
            _hermes_rest(rest, opts, final, ctx)
            if fmt == "hermes" and opts.calls
            else _legacy_body(rest, fmt, opts, final, ctx)
        )
        if body is None:
            return _Scan(None, "", [], False, stage="rest", hold=_held_until(rest, fmt))
        content, calls, settled = body[:3]
        trimmed = len(body) > 3 and bool(body[3])  # type: ignore[misc]
        # the classic formats whose unsettled end is a call region (the rest is a name
        # line or a half-written marker, read again on every delta)
        region = not settled and fmt in ("hermes", "granite", "deepseek_r1", "pythonic")
        if fmt == "functionary_v3_2" and not settled and opts.calls:
            # a call whose name line is written ends where the next recipient begins
            region = "\n" in rest[max(rest.rfind(">>>"), 0) :]
            wake = ((">>>",), frozenset[str]()) if region else None
    rest_blank = not content.strip()
    more: str | None = None
    if fmt == "glm45" and opts.reasoning is not None and "<think>" in content:
        content, thoughts, open_block = _later_thoughts(content, final)
        more = "\n".join(t for t in thoughts if t) or None
        settled = settled and not open_block
        region = region and not open_block
    # Functionary v3.2 streams text as the "all" recipient's message (or before any
    # recipient): the text that follows is read as that message's
    resume = ("" if opts.opened(">>>") else ">>>") + _ALL if fmt == "functionary_v3_2" else ""
    return _Scan(
        more,
        content,
        calls,
        settled and all(c.complete for c in calls),
        stage="rest",
        open=region,
        rest_blank=rest_blank,
        trimmed=trimmed,
        resume=resume,
        wake=wake,
    )


def _scan_think(text: str, fmt: str, opts: Options) -> _Scan:
    """A stream's text from a point inside the think block on (streaming only)."""
    end = (_think_markers(fmt) or ("", ""))[1]
    spec = _spec(fmt)
    j = text.find(end) if end else -1
    end_len = len(end)
    for stop in spec.think_stops if spec is not None else ():
        k = text.find(stop)
        if k >= 0 and (j < 0 or k < j):
            j, end_len = k, 0
    if j < 0:
        if opts.reasoning is None:
            return _Scan(None, text, [], False, stage="think")
        return _Scan(text, "", [], False, stage="think")
    if end_len == 0:
        return _Scan(None, "", [], False)  # ended by a call: read from the start again
    sc = _scan_rest(text[j + end_len :], fmt, opts, False, _Ctx())
    if opts.reasoning is None:
        sc.content = text[: j + end_len] + sc.content
    else:
        body = text[:j]
        sc.reasoning = body + "\n" + sc.reasoning if sc.reasoning is not None else body
    return sc


def _held_until(rest: str, fmt: str) -> tuple[str, ...] | None:
    """The markers a classic format's held-back output waits for (None: any text may
    release it, ``()``: only the end of generation)."""
    s = rest.strip()
    if fmt == "hermes":
        return tuple(start for start, _, _ in _HERMES_REGIONS)
    if fmt == "llama3_json":
        return () if s.startswith("{") or "<|python_tag|>" in s else None
    if fmt == "pythonic":
        return ("<|tool_call_start|>",)
    if fmt == "generic":
        return ()
    return None


def _later_thoughts(content: str, final: bool) -> tuple[str, list[str], bool]:
    """``<think>`` blocks in the middle of the content (GLM thinks again between calls):
    (content without them, their texts, whether one is still open)."""
    out: list[str] = []
    thoughts: list[str] = []
    pos = 0
    while True:
        i = content.find("<think>", pos)
        if i < 0:
            out.append(content[pos:])
            return "".join(out), thoughts, False
        out.append(content[pos:i])
        j = content.find("</think>", i + len("<think>"))
        if j < 0:
            if final:
                thoughts.append(content[i + len("<think>") :])
            return "".join(out), thoughts, not final
        thoughts.append(content[i + len("<think>") : j])
        pos = j + len("</think>")


# --------------------------------------------------------------------------- Muse Glimmer

_MUSE_HEADER = re.compile(r"\s*(?:<\|start\|>assistant)?\s*to=([^\s<]+)\s*<\|message\|>")
_MUSE_END = re.compile(r"<\|eot\|>|<\|eom\|>")


def _muse(text: str, opts: Options, final: bool) -> _Scan:
    """Muse Glimmer messages: ``[<|start|>assistant] to=R<|message|>body<|eom|>`` / ``<|eot|>``.

    ``to=self`` is reasoning, ``to=user`` content (call markup quoted in it stays
    text), any other recipient a message whose ``<atem:function_calls>`` are calls (as
    llama.cpp's Muse parser reads them). The generation prompt ends with
    ``<|start|>assistant``, so the output starts at `` to=``.
    """
    regions = FAMILIES["muse_glimmer"].spec.regions  # type: ignore[union-attr]
    content: list[str] = []
    thought: list[str] = []
    calls: list[_Call] = []
    settled = True
    pos, n = 0, len(text)
    m: re.Match[str] | None = None
    e: re.Match[str] | None = None
    resume: str | None = None
    wake: tuple[tuple[str, ...], frozenset[str]] | None = None
    while pos < n:
        m = _MUSE_HEADER.match(text, pos)
        if m is None:
            tail = text[pos:]
            head = tail.lstrip()
            partial = "<|message|>" not in tail and (
                "<|start|>assistant to=".startswith(head[:22])
                or head.startswith(("<|start|>", "to="))
            )
            if partial and not final:
                settled = False  # a header still being written
            elif not partial or not re.fullmatch(r"\s*(<\|start\|>\w*)?\s*(to=\S*)?\s*", tail):
                content.append(_MUSE_END.sub("", tail))  # text without a header
            break
        recipient = m.group(1)
        e = _MUSE_END.search(text, m.end())
        body = text[m.end() : e.start() if e else n]
        pos = e.end() if e else n
        resume, wake = None, None
        if recipient == "self":
            (thought if opts.reasoning is not None else content).append(body)
            resume = m.group(0)
        elif recipient == "user":
            content.append(body)
            resume = m.group(0)
        else:
            done = e is not None or final
            pieces, found, at = _scan_multi(body, regions if opts.calls else (), opts, done)
            calls.extend(found)
            content.append("".join(pieces).strip())
            if not done:
                settled = False
                if at < len(body):  # an open call: read again where it may end
                    strings, chars = _region_wake("muse_glimmer")
                    wake = ((*strings, "<|eom|>", "<|eot|>"), chars)
    reasoning = "".join(thought) if thought else None
    sc = _Scan(reasoning, "".join(content), calls, settled, wake=wake, open=wake is not None)
    if pos == n and m is not None and e is None and resume is not None:
        sc.stage, sc.resume = "rest", resume  # the text ends inside a message's text
    elif wake is not None:
        sc.stage = "rest"
    return sc


# --------------------------------------------------------------------------- gpt-oss (harmony)

_HARMONY_END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
#: how a message header starts (the generation prompt ends with <|start|>assistant)
_HARMONY_HEAD = re.compile(r"\s*(assistant\b|<\||to=|$)")


def _gpt_oss(text: str, opts: Options, final: bool, blank: bool = False) -> _Scan:
    """Harmony messages: ``[<|start|>assistant][ to=R]<|channel|>C[ to=R][<|constrain|>x]<|message|>body<|end|>``.

    ``analysis`` is reasoning; ``final`` and recipient-less ``commentary`` are content; a
    ``to=functions.NAME`` recipient makes the body a call's JSON arguments; other
    recipients (built-in tools such as ``python``, ``container.exec``) are not function
    calls and are dropped, like llama.cpp does; with no tools bound, so are messages to
    ``functions.*``. The end of generation (``<|call|>`` is an
    end-of-generation token) ends the last message.
    """
    content: list[str] = []
    thought: list[str] = []
    calls: list[_Call] = []
    settled = True
    resume: str | None = None
    wake: tuple[str, ...] | None = None
    pos = 0
    n = len(text)
    while pos < n:
        in_header = pos > 0
        if text.startswith("<|start|>", pos):
            pos += len("<|start|>")
            in_header = True
        k = text.find("<|message|>", pos)
        if k < 0:
            tail = text[pos:]
            harmony = in_header or "<|" in tail or "to=" in tail
            if not harmony:
                content.append(tail)  # plain text with no harmony header
            elif not final:
                settled = False  # a header still being written
            elif not _HARMONY_HEAD.match(tail) or not tail.strip():
                content.append(tail)
            break
        header = text[pos:k]
        if not in_header and not _HARMONY_HEAD.match(header):
            # text that no header starts is the model's plain text, a <|message|> in it
            # included: a stream has already sent it before the marker came
            content.append(text[pos:])
            break
        body_start = k + len("<|message|>")
        m = _HARMONY_END.search(text, body_start)
        body = text[body_start : m.start() if m else n]
        end = m.end() if m else n
        chan = re.findall(r"<\|channel\|>\s*(\w+)", header)
        channel = chan[-1] if chan else ""
        to = [t for t in re.findall(r"to=([^\s<]+)", header) if t != "assistant"]
        recipient = to[-1] if to else None
        if recipient is not None and not opts.calls:
            # no tools bound: a message to any recipient is consumed, as llama.cpp's
            # harmony parser consumes "unsolicited" calls (its recorded cases expect it)
            if final:
                logger.info("gpt-oss addressed a message to %s with no tools bound", recipient)
        elif recipient is not None:
            if recipient.startswith("functions."):
                name = recipient[len("functions.") :]
                if not m and not final:
                    calls.append(_Call(name, None, body, complete=False))
                    settled = False
                else:
                    obj, err = _loads(body.strip() or "{}")
                    if err or not isinstance(obj, dict):
                        calls.append(
                            _Call(
                                name,
                                None,
                                body.strip(),
                                error=err or "arguments are not a JSON object",
                            )
                        )
                    else:
                        calls.append(_Call(name, obj, body.strip()))
        elif channel == "analysis":
            if opts.reasoning is None:
                content.append(text[pos:end].removeprefix("assistant"))
            else:
                thought.append(body)
        else:
            content.append(body)
        if not m and not final:
            settled = settled and recipient is None
            if recipient is None and (channel != "analysis" or opts.reasoning is not None):
                resume = "<|start|>" + header + "<|message|>"  # a message's text goes on
            elif recipient is not None and recipient.startswith("functions.") and opts.calls:
                wake = ("<|end|>", "<|call|>", "<|return|>")  # a call's arguments go on
        pos = end
    reasoning = "".join(thought) if thought and opts.reasoning is not None else None
    if not blank and not (reasoning and reasoning.strip()):
        reasoning = None  # (``blank``: a stream's text after a settled point keeps it)
    sc = _Scan(reasoning, "".join(content), calls, settled)
    if resume is not None:
        sc.stage, sc.resume = "rest", resume
    elif wake is not None:
        sc.stage, sc.open, sc.wake = "rest", True, (wake, frozenset())
    return sc


# --------------------------------------------------------------------------- public API


def _finish_calls(
    calls: list[_Call], ids: list[str] | None = None
) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    good: list[ToolCall] = []
    bad: list[InvalidToolCall] = []
    for n, c in enumerate(calls):
        checked(c)
        cid = ids[n] if ids is not None and n < len(ids) else (c.id or new_call_id())
        if c.error is None and c.name and c.args is not None:
            good.append(tool_call(name=c.name, args=c.args, id=cid))
        else:
            bad.append(
                invalid_tool_call(
                    name=c.name,
                    args=invalid_args(c),
                    id=cid,
                    error=c.error or "malformed tool call",
                )
            )
    return good, bad


def _check_fmt(fmt: str, analysis: TemplateAnalysis | None = None) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "auto" and analysis is None:
        raise ValueError("tool-call format 'auto' needs the template's analysis (analysis=...)")


def parse(
    text: str,
    fmt: str,
    *,
    reasoning: bool | None = None,
    think_open: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    prefill: str = "",
    partial: bool = False,
    analysis: TemplateAnalysis | None = None,
) -> ParsedOutput:
    """Split a generation into content, reasoning and tool calls (never raises on the text).

    ``tools`` (OpenAI tool dicts) type tagged arguments by their schema; ``prefill`` is the
    end of the rendered prompt (what it already opened); ``partial`` parses a generation
    still under way (unfinished calls are left out); ``analysis`` (from
    :func:`~langchain_llamacpp_local.formats.auto.analyze_template`) is the learned
    syntax that format ``"auto"`` parses.
    """
    _check_fmt(fmt, analysis)
    opts = Options.make(reasoning, think_open, tools, prefill)
    try:
        sc = _scan(text, fmt, opts, final=not partial, analysis=analysis)
    except Exception:  # defensive: model output must never crash a request
        logger.exception("tool-call parser failed on model output; returning it as content")
        return ParsedOutput(content=text.strip())
    calls = sc.calls
    if partial:  # a call still being written is reported once its name is known
        calls = [c for c in calls if c.complete or c.name]
        for c in calls:
            if not c.complete:
                c.error = c.error or "tool call still being written"
    good, bad = _finish_calls(calls)
    return ParsedOutput(
        content=sc.content.strip(),
        reasoning=sc.reasoning.strip() if sc.reasoning is not None else None,
        tool_calls=good,
        invalid_tool_calls=bad,
    )


def _markers(fmt: str) -> tuple[str, ...]:
    spec = _spec(fmt)
    out = list(FAMILIES[fmt].markers)
    if spec is not None:
        out += (
            [r[0] for r in spec.regions] + list(spec.strip) + list(spec.section) + list(spec.held)
        )
        if spec.think is not None:
            out += [m for m in spec.think if m]
    else:
        out += list(THINK)
    if fmt == "hermes":
        out += [r[0] for r in _HERMES_REGIONS] + ["```"]  # a fence may wrap a call
    return tuple(dict.fromkeys(m for m in out if m))


#: Formats a stream reads from its start on every delta (their scanners keep no state a
#: later scan could start from).
_NO_RESTART: frozenset[str] = frozenset()
#: Characters that end the markers inside a call region (``</function>``, ``[ARGS]``,
#: ``<｜tool▁call▁end｜>``): an open region is read again only when one is written.
_REGION_ENDS = frozenset(">]")


def _restart_markers(fmt: str) -> tuple[str, ...]:
    """Every string a scan of ``fmt`` looks for outside a call region: a stream settles
    its text only where none of them may be half-written."""
    family = FAMILIES.get(fmt)
    out = [*_markers(fmt), *THINK]
    if family is not None:
        out += family.markers
        spec = family.spec
        if spec is not None:
            for start, end, _ in spec.regions:
                out += [start, end or ""]
            out += [*spec.strip, *spec.section, *spec.held, *spec.think_stops]
            out += list(spec.think or ())
    if fmt == "hermes":
        out += [m for start, end, _ in _HERMES_REGIONS for m in (start, end or "")]
    out += [*_DS.values(), _DS_CALLS, "<|python_tag|>", "<|tool_call_start|>"]
    out += ["<|tool_call_end|>", "<|tool_call|>", "<response>", "</response>"]
    return tuple(dict.fromkeys(m for m in out if m))


def _region_wake(fmt: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """What may change how an open call region of ``fmt`` reads: the regions' ends and
    the markers that complete a call inside them (a body reader that names none is
    read again at every character that may end a marker)."""
    family = FAMILIES.get(fmt)
    if fmt == "hermes":
        regions: tuple[tuple[str, str | None, Any], ...] = _HERMES_REGIONS
    elif family is not None and family.spec is not None:
        regions = family.spec.regions
    else:
        regions = ()
    wake = {
        "deepseek_r1": (_DS["call_end"],),
        "pythonic": ("<|tool_call_end|>",),
    }.get(fmt, ())
    chars: frozenset[str] = frozenset()
    for _, end, body in regions:
        closers = getattr(body, "closers", None)
        if closers is None:
            chars = _REGION_ENDS
        wake += (end or "", *(closers or ()))
    return tuple(dict.fromkeys(m for m in wake if m)), chars


@dataclass
class _Text:
    """One streamed text (content or reasoning) as the stream has sent it.

    ``sent`` counts what was sent of the whole text (leading whitespace stripped);
    ``pending`` is the settled text not sent yet (trailing whitespace, which is sent
    only when more text follows); ``started`` says something was sent; ``epoch`` is
    how much of the text read since the last settled point has been sent.
    """

    sent: int = 0
    pending: str = ""
    started: bool = False
    epoch: int = 0
    view: str = ""  # pending + the text read since the settled point, as last read

    def read(self, text: str) -> str:
        view = self.pending + text
        self.view = view if self.started else view.lstrip()
        return self.view

    def send(self, keep: int, kind: Literal["content", "reasoning"]) -> list[StreamDelta]:
        if keep <= self.epoch:
            return []
        piece = self.view[self.epoch : keep]
        self.epoch = keep
        self.sent += len(piece)
        return [StreamDelta(kind, piece)]

    def settled(self) -> bool:
        return not self.view[self.epoch :].strip()

    def settle(self) -> None:
        self.pending = self.view[self.epoch :]
        self.started = self.started or self.epoch > 0
        self.epoch = 0
        self.view = self.pending


class StreamParser:
    """Incremental :func:`parse`: feed text deltas, get content/reasoning/tool-call deltas.

    The aggregate of the deltas equals ``parse(all_text)``: content and reasoning
    texts concatenate to the parsed ones, each call's argument fragments join to
    its JSON arguments, and the call ids are the same as in :attr:`result`.

    Each delta costs the same however long the generation is: the stream reads only
    the text since its last settled point (a point outside any call region with no
    half-written marker before it, past or inside the think block, everything before it
    sent), so text it has settled is never read again; an open call region is read
    again only when a character that may end one of its markers is written. The
    finished generation is parsed once more by :func:`parse` for :attr:`result`.
    """

    def __init__(
        self,
        fmt: str,
        *,
        reasoning: bool | None = None,
        think_open: bool = False,
        id_prefix: str = "call_",
        tools: Sequence[Mapping[str, Any]] | None = None,
        prefill: str = "",
        analysis: TemplateAnalysis | None = None,
    ) -> None:
        _check_fmt(fmt, analysis)
        self._analysis = analysis
        self.fmt = fmt
        self.reasoning = reasoning
        self.think_open = think_open
        self.id_prefix = id_prefix
        self._opts = Options.make(reasoning, think_open, tools, prefill)
        self._parts: list[str] = []  # the whole generation, parsed once more at the end
        self._tail = ""  # the text since the last settled point
        #: how that text is read: "start" (from the beginning), "think" (inside the
        #: think block), "rest" (past it) or "full" (the whole text on every delta)
        self._state = "start" if fmt not in _NO_RESTART else "full"
        self._ctx = _Ctx()
        self._content = _Text()
        self._thought = _Text()
        self._thought_any = False  # the settled reasoning is a non-empty string
        self._calls_base = 0  # calls read before the settled point
        self._calls_done = 0  # calls sent (each in one chunk)
        #: while set, the text is read again only when one of these strings or
        #: characters is written (an open call region, output held to the end)
        self._wait: tuple[tuple[str, ...], frozenset[str]] | None = None
        self._ids: list[str] = []
        self._result: ParsedOutput | None = None
        self._markers = (
            _markers(fmt) if analysis is None else tuple(m for m in analysis.markers if m)
        )
        think = _think_markers(fmt) if fmt not in ("gpt_oss", "auto") else None
        self._think_end = tuple(m for m in (think or ()) if m)
        if analysis is not None:
            a = analysis
            learned = (a.trigger, a.turn_end, a.reasoning_start, a.reasoning_end, a.content_start)
            self._restart = tuple(m for m in (*a.markers, *(x.strip() for x in learned)) if m)
        else:
            self._restart = _restart_markers(fmt) if fmt not in _NO_RESTART else ()
        self._replay = ""  # what the text since the settled point is read after
        self._region_wake = _region_wake(fmt)
        self._longest = max((len(m) for m in (*self._restart, *self._region_wake[0])), default=0)

    @property
    def result(self) -> ParsedOutput:
        if self._result is None:
            raise RuntimeError("call finish() first")
        return self._result

    def _id(self, n: int, own: str | None) -> str:
        while len(self._ids) <= n:
            self._ids.append("")
        if not self._ids[n]:
            self._ids[n] = own or (self.id_prefix + uuid.uuid4().hex[:24])
        return self._ids[n]

    def feed(self, delta: str) -> list[StreamDelta]:
        self._parts.append(delta)
        self._tail += delta
        if self._wait is not None and not self._woken(delta):
            return []
        self._wait = None
        try:
            if self._state == "full":
                text = "".join(self._parts)
                sc = _scan(text, self.fmt, self._opts, final=False, analysis=self._analysis)
                return self._emit(sc, final=False)
            return self._read_tail()
        except Exception:  # model output must never crash a request: finish() decides
            logger.exception("tool-call parser failed on partial model output")
            return []

    def _woken(self, delta: str) -> bool:
        """Whether ``delta`` may change what the held text reads as."""
        strings, chars = self._wait  # type: ignore[misc]
        if not chars.isdisjoint(delta):
            return True
        # a marker written now ends in the delta
        window = self._tail[-(len(delta) + self._longest - 1) :]
        first = len(window) - len(delta) + 1
        return any(window.find(m, max(0, first - len(m))) >= 0 for m in strings)

    def _read_tail(self) -> list[StreamDelta]:
        tail = self._tail
        if self._state == "start":
            sc = _scan(tail, self.fmt, self._opts, final=False, analysis=self._analysis)
        elif self._state == "think":
            sc = _scan_think(tail, self.fmt, self._opts)
            if not sc.stage:  # ended by a call: read as a whole from now on
                self._state = "full"
                text = "".join(self._parts)
                sc = _scan(text, self.fmt, self._opts, final=False, analysis=self._analysis)
                return self._emit(sc, final=False)
        else:
            text = self._replay + tail
            sc = _scan_rest(text, self.fmt, self._opts, False, self._ctx, self._analysis)
        out: list[StreamDelta] = []
        thought = sc.reasoning
        if self.fmt == "glm45" and self._state == "rest" and thought and self._thought_any:
            thought = "\n" + thought  # thoughts between calls join the earlier ones
        if thought is not None or self._thought.pending:
            text = self._thought.read(thought or "")
            keep = len(text) - _held_suffix(text, (*self._think_end, *self._markers))
            out += self._thought.send(len(text[:keep].rstrip()), "reasoning")
        text = self._content.read(sc.content)
        keep = len(text) - _held_suffix(text, self._markers)
        keep = min(keep, len(text[:keep].rstrip()))
        if self.fmt in _WHOLE_OUTPUT and not sc.settled:
            keep = min(keep, self._content.epoch)
        out += self._content.send(keep, "content")
        out += self._send_calls(sc.calls, self._calls_base, final=False)
        self._settle(sc)
        return out

    def _settle(self, sc: _Scan) -> None:
        """Forget the text read so far when nothing in it can change any more."""
        n_calls = self._calls_base + len(sc.calls)
        cut = (
            sc.stage == "think"
            or sc.stage == "rest"
            and sc.settled
            and not sc.trimmed
            and self._calls_done == n_calls
        )
        cut = (
            cut
            and self._content.settled()
            and self._thought.settled()
            and not _held_suffix(self._tail, self._restart)
        )
        if not cut:
            if sc.stage == "rest" and sc.open:
                self._wait = sc.wake or self._region_wake
            elif sc.stage == "rest" and sc.hold is not None:
                self._wait = (sc.hold, frozenset())
            return
        if sc.reasoning:
            self._thought_any = True
        if sc.stage == "rest":
            self._ctx = _Ctx(
                head=self._ctx.head and sc.rest_blank,
                had_calls=self._ctx.had_calls or bool(sc.calls),
            )
        self._state = "think" if sc.stage == "think" else "rest"
        self._replay = sc.resume
        self._calls_base = n_calls
        self._tail = ""
        self._content.settle()
        self._thought.settle()

    def _send_calls(self, calls: list[_Call], base: int, final: bool) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        for k, c in enumerate(calls):
            n = base + k
            # a call is sent whole (id, name and arguments in one chunk) once it can no
            # longer change: LangChain reads merged chunks as calls, so a name sent ahead
            # or a cut-off call's JSON would show as a valid-looking call
            if n < self._calls_done or not (c.complete or final):
                continue
            if n > self._calls_done:  # an earlier call is still being written
                break
            checked(c)
            valid = c.error is None and c.name and c.args is not None
            args = json.dumps(c.args, ensure_ascii=False) if valid else invalid_args(c)
            out.append(
                StreamDelta("tool_call", index=n, id=self._id(n, c.id), name=c.name, args=args)
            )
            self._calls_done = n + 1
        return out

    def _emit(self, sc: _Scan, final: bool) -> list[StreamDelta]:
        """The deltas of a scan of the whole text (its content and reasoning whole)."""
        out: list[StreamDelta] = []
        if sc.reasoning is not None:
            text = sc.reasoning.lstrip()
            if final:
                keep = len(text.rstrip())
            else:
                keep = len(text) - _held_suffix(text, (*self._think_end, *self._markers))
                keep = len(text[:keep].rstrip())
            sent = self._thought.sent
            if keep > sent:
                out.append(StreamDelta("reasoning", text[sent:keep]))
                self._thought.sent = keep
        content = sc.content.lstrip()
        sent = self._content.sent
        if final:
            keep = len(content.rstrip())
        else:
            keep = len(content) - _held_suffix(content, self._markers)
            keep = min(keep, len(content[:keep].rstrip()))
            if self.fmt in _WHOLE_OUTPUT and not sc.settled:
                keep = min(keep, sent)
        if keep > sent:
            out.append(StreamDelta("content", content[sent:keep]))
            self._content.sent = keep
        return out + self._send_calls(sc.calls, 0, final)

    def finish(self) -> list[StreamDelta]:
        """End of generation: settle everything still held back."""
        # its own counters: a copy of a stream may be finished while the stream goes on
        self._content, self._thought = copy.copy(self._content), copy.copy(self._thought)
        text = "".join(self._parts)
        try:
            sc = _scan(text, self.fmt, self._opts, final=True, analysis=self._analysis)
        except Exception:
            logger.exception("tool-call parser failed on model output; returning it as content")
            sc = _Scan(None, text, [], True)
        try:
            out = self._emit(sc, final=True)
        except Exception:
            logger.exception("tool-call parser failed to emit its result")
            sc, out = _Scan(None, text, [], True), []
        ids = [self._id(n, c.id) for n, c in enumerate(sc.calls)]
        good, bad = _finish_calls(sc.calls, ids)
        self._result = ParsedOutput(
            content=sc.content.strip(),
            reasoning=sc.reasoning.strip() if sc.reasoning is not None else None,
            tool_calls=good,
            invalid_tool_calls=bad,
        )
        return out
