"""Body readers of the tool-call syntaxes beyond the classic ones (DeepSeek V3.x, Kimi K2,
Gemma 4, Mistral, the JSON ones, ...); the markup ones are in :mod:`.markup_bodies`.

Each body function reads the inside of one tool-call region (between the family's start
and end markers) into call records, and its record (:func:`~.syntax.reads`) names the
stream of its arguments; a :class:`Spec` says which markers open reasoning and tool
calls and which wrapper markers are dropped from content. The specs themselves are
part of each family's record (:mod:`.registry`). The syntaxes follow llama.cpp 0.3.36's
parsers (``common/parsers/*.cpp`` and the auto-parser's tests).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from langchain_llamacpp_local.formats.arg_stream.gemma import gemma_args
from langchain_llamacpp_local.formats.arg_stream.json_calls import objects, plain_name, sep_json
from langchain_llamacpp_local.formats.arg_stream.markup import Tags, minimax_m3
from langchain_llamacpp_local.formats.base import (
    Options,
    ParsedCall,
    call_from_obj,
    json_prefix,
    loads_lenient,
    unfence,
)
from langchain_llamacpp_local.formats.syntax import Body, reads
from langchain_llamacpp_local.formats.values import (
    MM_MARKER,
    MM_PARAM,
    gemma_value,
    mm_value,
)


@dataclass(frozen=True)
class Spec:
    """One format: reasoning markers, tool-call region markers and its body reader."""

    think: tuple[str, str] | None = ("<think>", "</think>")
    regions: tuple[tuple[str, str | None, Body], ...] = ()
    strip: tuple[str, ...] = ()  # turn and channel wrapper markers removed from content
    #: call-section markers removed from content when calls are read (with no tools
    #: bound they are call markup like the rest and stay)
    section: tuple[str, ...] = ()
    #: text the template's generation prompt puts before the reasoning (kept in reasoning)
    reasoning_lead: str = ""
    held: tuple[str, ...] = field(default=())  # extra markers held back while streaming
    think_stops: tuple[str, ...] = ()  # markers that also end reasoning (left in place)
    #: reasoning may start without its opening marker (the model is always thinking first)
    think_implicit: bool = False
    strip_re: str | None = None  # a pattern of header markup removed from content
    #: ``<think>`` blocks between calls are reasoning too (GLM thinks again between calls)
    rethinks: bool = False
    #: Python code follows this marker to the end: a call to ``python`` (Functionary v3.1)
    code_tag: str = ""


def _args_obj(text: str, name: str | None, raw: str) -> ParsedCall:
    obj, err = loads_lenient(text.strip() or "{}")
    if err or not isinstance(obj, dict):
        return ParsedCall(name, None, raw, error=err or "arguments are not a JSON object")
    return ParsedCall(name, obj, raw)


# --------------------------------------------------------------------------- JSON bodies


@reads("json", stream=objects(fenced=True))
def json_list_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """A JSON list (or object) of ``{"name", "arguments"}`` calls."""
    if not final:
        return [ParsedCall(None, None, region, complete=False)] if region.strip() else []
    s = unfence(region.strip())
    parsed = json_prefix(s)
    if parsed is None:
        return [ParsedCall(None, None, s, error="invalid JSON in the tool calls")]
    obj = parsed[0]
    items = obj if isinstance(obj, list) else [obj]
    return [call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in items]


@reads("json", stream=objects(lines=True))
def json_lines_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """One ``{"name", "arguments"}`` object per line (MiniMax M1)."""
    if not final:
        return [ParsedCall(None, None, region, complete=False)] if region.strip() else []
    out: list[ParsedCall] = []
    s = region.strip()
    pos = 0
    while pos < len(s):
        parsed = json_prefix(s[pos:])
        if parsed is None:
            out.append(ParsedCall(None, None, s[pos:], error="invalid JSON in the tool calls"))
            break
        obj, end = parsed
        out.append(call_from_obj(obj, s[pos : pos + end]))
        pos += end
        while pos < len(s) and s[pos] in " \t\r\n,":
            pos += 1
    return out


@reads("json", stream=objects(name_key=True))
def apertus_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``[{"name": {args}}, ...]`` (Apertus)."""
    if not final:
        return [ParsedCall(None, None, region, complete=False)] if region.strip() else []
    obj, err = loads_lenient(region.strip())
    if err or not isinstance(obj, list):
        return [
            ParsedCall(None, None, region.strip(), error=err or "tool calls are not a JSON list")
        ]
    out = []
    for item in obj:
        raw = json.dumps(item, ensure_ascii=False)
        if isinstance(item, dict) and len(item) == 1:
            ((name, args),) = item.items()
            if isinstance(args, dict):
                out.append(ParsedCall(name, args, raw))
                continue
        out.append(ParsedCall(None, None, raw, error="not a {name: {arguments}} object"))
    return out


#: DeepSeek's markers (R1 and V3.1 write the same): calls begin/end, a call begin/end, the
#: separator after the name
DS_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DS_CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
DS_SEP = "<｜tool▁sep｜>"
KIMI_CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
_KIMI_ARGS = "<|tool_call_argument_begin|>"


def _name_sep_json(region: str, final: bool, sep: str, name_prefix: str = "") -> list[ParsedCall]:
    head, found, body = region.partition(sep)
    name = head.strip()
    if name_prefix and name.startswith(name_prefix):
        name = name[len(name_prefix) :]
    if not found:
        if final:
            return [ParsedCall(name or None, None, region, error="no arguments")]
        return [ParsedCall(None, None, region, complete=False)]
    if not final:
        return [ParsedCall(name or None, None, region, complete=False)]
    return [_args_obj(unfence(body), name or None, body.strip())]


def split_calls(
    region: str, begin: str, end: str, final: bool, one: Callable[[str, bool], list[ParsedCall]]
) -> list[ParsedCall]:
    out: list[ParsedCall] = []
    # a call ends at its end marker, or (a model that skips it) where the next call begins;
    # while streaming, a call whose text so far ends with a newline is still open (\Z)
    for m in re.finditer(
        re.escape(begin)
        + r"(.*?)("
        + re.escape(end)
        + r"|(?="
        + re.escape(begin)
        + (r")|$)" if final else r")|\Z)"),
        region,
        re.S,
    ):
        closed = bool(m.group(2)) or m.end() < len(region)
        calls = one(m.group(1), closed or final)
        if not closed:
            for c in calls:
                if final and c.error is None and c.args is None:
                    c.error = "unterminated tool call"
        out.extend(calls)
    return out


@reads(
    "json",
    (DS_CALL[1], DS_CALL[0]),
    stream=sep_json(plain_name, DS_SEP, begin=DS_CALL[0], end=DS_CALL[1]),
)
def deepseek_v3_1_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`` (DeepSeek V3.1)."""
    return split_calls(
        region, DS_CALL[0], DS_CALL[1], final, lambda s, f: _name_sep_json(s, f, DS_SEP)
    )


def _kimi_short(full: str) -> str:
    """Kimi K2's call name from its id (``functions.NAME:IDX``)."""
    name = full.split(":", 1)[0]
    return name[len("functions.") :] if name.startswith("functions.") else name


def _kimi_name(head: str) -> tuple[str, str | None] | None:
    full = head.strip()
    name = _kimi_short(full)
    return (name, full) if name else None


@reads(
    "json",
    (KIMI_CALL[1], KIMI_CALL[0]),
    stream=sep_json(_kimi_name, _KIMI_ARGS, begin=KIMI_CALL[0], end=KIMI_CALL[1]),
)
def kimi_k2_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``."""

    def one(s: str, fin: bool) -> list[ParsedCall]:
        calls = _name_sep_json(s, fin, _KIMI_ARGS)
        for c in calls:
            if c.name:
                full = c.name
                c.name, c.id = _kimi_short(full), full
        return calls

    return split_calls(region, KIMI_CALL[0], KIMI_CALL[1], final, one)


@reads("json", stream=sep_json(plain_name, ">"))
def functionary_v3_1_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``NAME>{json}`` after ``<function=`` (Functionary v3.1)."""
    name, found, body = region.partition(">")
    if not found:
        return (
            [ParsedCall(None, None, region, complete=False)]
            if not final
            else [ParsedCall(None, None, region, error="bad call")]
        )
    if not final:
        return [ParsedCall(name.strip(), None, region, complete=False)]
    return [_args_obj(body, name.strip(), body.strip())]


@reads(
    "json",
    stream=objects(names=("tool_name",), args=("parameters",), ids=("tool_call_id",), fenced=True),
)
def command_r_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``[{"tool_call_id", "tool_name", "parameters"}]`` (Command R7B / R+ / Cohere2)."""
    if not final:
        names = re.findall(r'"tool_name"\s*:\s*"([^"\\]*)"', region)
        ids = re.findall(r'"tool_call_id"\s*:\s*"([^"\\]*)"', region)
        if not names:
            return [ParsedCall(None, None, region, complete=False)] if region.strip() else []
        return [
            ParsedCall(n, None, region, id=ids[k] if k < len(ids) else None, complete=False)
            for k, n in enumerate(names)
        ]
    s = unfence(region.strip())
    parsed = json_prefix(s)
    if parsed is None:
        return [ParsedCall(None, None, s, error="invalid JSON in the action")]
    obj = parsed[0]
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for o in items:
        if isinstance(o, dict) and "tool_name" in o:
            o = {
                "name": o.get("tool_name"),
                "parameters": o.get("parameters", {}),
                "id": o.get("tool_call_id"),
            }
        calls.append(
            call_from_obj(o, json.dumps(o, ensure_ascii=False), ("parameters", "arguments"))
        )
    return calls


# --------------------------------------------------------------------------- Gemma 4


#: the end of Gemma 4's call region
GEMMA_END = "<tool_call|>"


@reads("gemma", stream=gemma_args(GEMMA_END))
def gemma4_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``call:NAME{key:<|"|>value<|"|>,...}`` (Gemma 4)."""
    s = region.strip()
    m = re.match(r"call:([\w.\-]+)", s)
    if not m:
        if not final:
            return [ParsedCall(None, None, region, complete=False)]
        return [ParsedCall(None, None, s, error="not a call:NAME{...} tool call")]
    name = m.group(1)
    if not final:
        named = m.end() < len(s) and s[m.end()] == "{"
        return [ParsedCall(name if named else None, None, region, complete=False)]
    try:
        args = gemma_value(s[m.end() :].strip() or "{}")
    except ValueError as exc:
        return [ParsedCall(name, None, s, error=f"cannot read the arguments: {exc}")]
    if not isinstance(args, dict):
        return [ParsedCall(name, None, s, error="arguments are not an object")]
    return [ParsedCall(name, args, s)]


# --------------------------------------------------------------------------- more families


#: MiniMax M3's call tags (each maybe after its marker); a parameter is ``<k>v</k>``
MM3 = Tags.quoted('<invoke name="', "</invoke>", "<", "", strip_name=False)
_MMQ = re.escape(MM_MARKER)


@reads(closers=(MM3.call_close,), stream=minimax_m3(MM3))
def minimax_m3_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``]<]minimax[>[<invoke name="X">]<]minimax[>[<k>v]<]minimax[>[</k>...`` (MiniMax M3)."""
    pat = rf'(?:{_MMQ})?{re.escape(MM3.call_open)}(?P<name>[^"]*)">(?P<body>.*?)(?P<close>(?:{_MMQ})?{re.escape(MM3.call_close)}|$)'

    def args_of(name: str, body: str) -> dict[str, object]:
        return {
            p.group("k"): mm_value(p.group("v"), opts.param_types(name, p.group("k")))
            for p in MM_PARAM.finditer(body)
        }

    return invoke_calls(region, final, pat, args_of)


def invoke_calls(
    region: str, final: bool, pattern: str, args_of: Callable[[str, str], dict[str, object]]
) -> list[ParsedCall]:
    """The calls ``pattern`` (groups ``name``, ``body``, ``close``) finds in a region, a
    closed one's arguments read from its body by ``args_of(name, body)``; one not closed
    is incomplete while streaming and unterminated at the end."""
    out: list[ParsedCall] = []
    for m in re.finditer(pattern, region, re.S):
        name, closed = m.group("name"), bool(m.group("close"))
        if not closed:
            out.append(
                ParsedCall(
                    name,
                    None,
                    m.group(0),
                    error="unterminated tool call" if final else None,
                    complete=final,
                )
            )
            continue
        out.append(ParsedCall(name, args_of(name, m.group("body")), m.group(0)))
    if not out and final and region.strip():
        out.append(ParsedCall(None, None, region, error="cannot read the tool call"))
    return out


@reads("json", stream=objects())
def json_call_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """One ``{"name", "arguments"}`` object (GigaChat)."""
    if not final:
        m = re.match(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', region)
        return (
            [ParsedCall(m.group(1) if m else None, None, region, complete=False)]
            if region.strip()
            else []
        )
    parsed = json_prefix(region.strip())
    if parsed is None:
        return [ParsedCall(None, None, region.strip(), error="invalid JSON in the tool call")]
    return [call_from_obj(parsed[0], region.strip())]


SOLAR_NAME, SOLAR_ARGS = "<|tool_call:name|>", "<|tool_call:args|>"


def _solar_name(head: str) -> tuple[str, str | None] | None:
    cid, found, rest = head.partition(SOLAR_NAME)
    name = rest.strip()
    return (name, cid.strip() or None) if found and name else None


@reads("json", stream=sep_json(_solar_name, SOLAR_ARGS))
def solar_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``ID<|tool_call:name|>NAME<|tool_call:args|>{json}`` (Solar Open)."""
    cid, _, rest = region.partition(SOLAR_NAME)
    calls = _name_sep_json(rest, final, SOLAR_ARGS)
    for c in calls:
        c.id = cid.strip() or None
    return calls


# --------------------------------------------------------------------------- Mistral


def _mistral_segment(region: str, final: bool) -> list[ParsedCall]:
    """One ``[TOOL_CALLS]`` segment: a JSON list, or ``name[CALL_ID]id[ARGS]{...}``."""
    s = region.strip()
    if s.startswith("[") or s.startswith("{") or not final:
        if not final:
            return []
        parsed = json_prefix(s)
        if parsed is None:
            return [ParsedCall(None, None, s, error="invalid JSON in [TOOL_CALLS]")]
        obj, _end = parsed
        items = obj if isinstance(obj, list) else [obj]
        return [call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in items]
    m = re.match(r"^([\w.\-]+)(?:\[CALL_ID\]([^\[]*))?\[ARGS\](.*)$", s, re.S)
    if not m:
        return [ParsedCall(None, None, s, error="cannot read [TOOL_CALLS] name[ARGS]{...}")]
    args, err = loads_lenient(m.group(3).strip())
    if err or not isinstance(args, dict):
        return [ParsedCall(m.group(1), None, s, error=err or "arguments are not a JSON object")]
    return [ParsedCall(m.group(1), args, s, id=m.group(2) or None)]


MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_HEAD = re.compile(r"\s*([\w.\-]+)(?:\[CALL_ID\]([^\[]*))?")


def _mistral_name(head: str) -> tuple[str, str | None] | None:
    m = _MISTRAL_HEAD.fullmatch(head)
    return (m.group(1), m.group(2) or None) if m else None


@reads(stream=sep_json(_mistral_name, "[ARGS]", begin=MISTRAL_CALLS, first=True))
def mistral_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """Everything after the first ``[TOOL_CALLS]``: a JSON list, or ``name[CALL_ID]id[ARGS]{...}`` segments."""
    calls: list[ParsedCall] = []
    for seg in region.split(MISTRAL_CALLS):
        if final:
            calls.extend(_mistral_segment(seg, True))
            continue
        m = re.match(r"\s*([\w.\-]+)(?:\[CALL_ID\]([^\[]*)\[ARGS\]|\[ARGS\])", seg)
        calls.append(
            ParsedCall(
                m.group(1) if m else None, None, seg, id=m.group(2) if m else None, complete=False
            )
        )
    return calls
