"""The classic families' readers: what follows the reasoning block, one :class:`Reader` each.

Hermes (tagged JSON, bare JSON, fenced), Llama 3.x JSON and ``<|python_tag|>``, pythonic
lists, Granite, Functionary v3.2 (``>>>recipient``), DeepSeek R1, the generic JSON
document and plain content: formats whose calls are not regions a
:class:`~.families.Spec` describes (a call may be the whole output, only the first block
is read, a recipient line starts it). Each family's record (:mod:`.registry`) holds its
reader, so the parse loop and the stream need no code of their own for it.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from langchain_llamacpp_local.formats.arg_stream.core import rewriting
from langchain_llamacpp_local.formats.arg_stream.json_calls import objects, sep_json
from langchain_llamacpp_local.formats.arg_stream.python_calls import py_calls
from langchain_llamacpp_local.formats.base import (
    OpenRegion,
    Options,
    ParseContext,
    ParsedCall,
    RegionScan,
    call_from_obj,
    json_prefix,
    loads_lenient,
    scan_multi,
    scan_regions,
    unfence,
)
from langchain_llamacpp_local.formats.families import DS_CALL, DS_CALLS, DS_SEP
from langchain_llamacpp_local.formats.syntax import NAMED_ARGUMENTS, reads
from langchain_llamacpp_local.formats.values import py_literal

_DS = {
    "calls_begin": DS_CALLS[0],
    "calls_end": DS_CALLS[1],
    "call_begin": DS_CALL[0],
    "call_end": DS_CALL[1],
    "sep": DS_SEP,
}
_DS_CALLS = "<｜tool▁calls｜>"


def _hermes_body(region: str, final: bool) -> list[ParsedCall]:
    s = region.strip()
    m = re.match(r"^<function=([^>\s]+)>\s*(.*?)\s*(</function>)?\s*$", s, re.S)
    if m:
        if not final and not m.group(3):
            return [ParsedCall(m.group(1), None, s, complete=False)]
        args, err = loads_lenient(m.group(2) or "{}")
        if err or not isinstance(args, dict):
            return [
                ParsedCall(
                    m.group(1),
                    None,
                    s,
                    error=err or "arguments are not a JSON object",
                    complete=final,
                )
            ]
        return [ParsedCall(m.group(1), args, s)]
    if not final:
        name = re.match(r'^\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', s)
        return [
            ParsedCall(json.loads(f'"{name.group(1)}"') if name else None, None, s, complete=False)
        ]
    obj, err = loads_lenient(unfence(s))
    if err:
        name = re.match(r'^\{\s*"name"\s*:\s*"([\w.\-]+)"', s)
        return [ParsedCall(name.group(1) if name else None, None, region.strip(), error=err)]
    if isinstance(obj, list):
        return [call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in obj]
    return [call_from_obj(obj, region.strip())]


_GRANITE_WRAP = (("<response>", ""), ("</response>", ""))


@reads(stream=rewriting(objects(fenced=True), _GRANITE_WRAP))
def _list_body(
    region: str, final: bool, keys: tuple[str, ...] = ("arguments", "parameters")
) -> list[ParsedCall]:
    if not final:
        return []
    s = unfence(region.strip())
    obj, err = loads_lenient(s)
    if err:
        return [ParsedCall(None, None, s, error=err)]
    items = obj if isinstance(obj, list) else [obj]
    return [call_from_obj(o, json.dumps(o, ensure_ascii=False), keys) for o in items]


#: a source's lines with their ends, as :mod:`ast` counts them (no form feed break)
_LINES = re.compile(r"[^\r\n]*(?:\r\n|\r|\n|$)")


def _segment(lines: list[str], node: ast.expr) -> str:
    """``ast.get_source_segment`` on lines split once (it splits the source per call, in
    Python, which costs more than the parse on a long argument)."""
    if node.end_lineno is None or node.end_col_offset is None:
        return ""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return head + "".join(lines[first + 1 : last]) + tail


@reads(stream=py_calls)
def _pythonic_calls(text: str) -> list[ParsedCall] | None:
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
    calls: list[ParsedCall] = []
    lines = _LINES.findall(s)
    for el in tree.body.elts:
        if not isinstance(el, ast.Call):
            return None
        raw = _segment(lines, el)
        name_node = el.func
        parts = []
        while isinstance(name_node, ast.Attribute):
            parts.append(name_node.attr)
            name_node = name_node.value
        if not isinstance(name_node, ast.Name):
            calls.append(ParsedCall(None, None, raw, error="call target is not a name"))
            continue
        name = ".".join([name_node.id, *reversed(parts)])
        try:
            args = {kw.arg: py_literal(kw.value) for kw in el.keywords if kw.arg}
            if el.args:
                raise ValueError("positional arguments")
            if any(kw.arg is None for kw in el.keywords):
                raise ValueError("**kwargs")
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError) as exc:
            calls.append(ParsedCall(name, None, raw, error=f"arguments are not literals: {exc}"))
            continue
        calls.append(ParsedCall(name, args, raw))
    return calls


def _builtin_call(code: str) -> list[ParsedCall]:
    """Llama 3.1 built-in tools after ``<|python_tag|>``: ``name.call(k=v)``, else Python code."""
    s = code.strip()
    m = re.match(r"^([A-Za-z_][\w]*)\.call\((.*)\)\s*;?$", s, re.S)
    if m:
        found = _pythonic_calls(f"[{m.group(1)}({m.group(2)})]")
        if found:
            return found
    return [ParsedCall("python", {"code": s}, s)]


@reads(stream=objects(lines=True, seps=";", args=("parameters", "arguments")))
def _llama3_calls(text: str) -> list[ParsedCall] | None:
    s = text.strip()
    if s.startswith("<|python_tag|>"):
        s = s[len("<|python_tag|>") :].strip()
        if not s.startswith("{"):
            return _builtin_call(s)
    if not s.startswith("{"):
        return None
    calls: list[ParsedCall] = []
    pos = 0
    while pos < len(s):
        parsed = json_prefix(s[pos:])
        if parsed is None:
            if calls:
                calls.append(ParsedCall(None, None, s[pos:], error="invalid JSON after tool calls"))
                return calls
            return None
        obj, end = parsed
        if not isinstance(obj, dict) or "name" not in obj:
            return None
        calls.append(call_from_obj(obj, s[pos : pos + end], ("parameters", "arguments")))
        pos += end
        while pos < len(s) and s[pos] in " \t\r\n;":
            pos += 1
    return calls


@reads(stream=objects(document=True, fenced=True))
def _generic_calls(text: str) -> tuple[list[ParsedCall], str] | None:
    s = unfence(text)
    if not s.startswith("{"):
        return None
    obj, err = loads_lenient(s)
    if err or not isinstance(obj, dict):
        return None
    if "tool_calls" in obj and isinstance(obj["tool_calls"], list):
        return [call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in obj["tool_calls"]], ""
    if "tool_call" in obj:
        return [
            call_from_obj(obj["tool_call"], json.dumps(obj["tool_call"], ensure_ascii=False))
        ], ""
    if "response" in obj:
        resp = obj["response"]
        return [], resp if isinstance(resp, str) else json.dumps(resp, ensure_ascii=False)
    return None


def _functionary_body(text: str, final: bool) -> tuple[list[str], list[ParsedCall], int]:
    """``>>>name\n{json}`` blocks; ``>>>all\n`` blocks are content."""
    if ">>>" not in text:
        return [text], [], len(text)
    first = text.find(">>>")
    content: list[str] = [text[:first]]
    calls: list[ParsedCall] = []
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
            calls.append(ParsedCall(name, None, body, complete=False))
            return content, calls, offset
        if name == "all":
            content.append(body)
        elif name == "python" and not body.lstrip().startswith("{"):
            calls.append(
                ParsedCall("python", {"code": body}, body)
            )  # raw code, as llama.cpp reads it
        else:
            obj, err = loads_lenient(body.strip() or "{}")
            if err or not isinstance(obj, dict):
                calls.append(
                    ParsedCall(
                        name or None,
                        None,
                        body.strip(),
                        error=err or "arguments are not a JSON object",
                    )
                )
            else:
                calls.append(ParsedCall(name, obj, body.strip()))
        offset += 3 + len(part)
    return content, calls, len(text)


def _r1_name(head: str) -> tuple[str, str | None] | None:
    _, found, name = head.partition(_DS["sep"])
    return (name.strip(), None) if found and name.strip() else None


#: DeepSeek R1's reader rewrites its text before reading it: so does its stream
_R1_REWRITE = ((_DS_CALLS, _DS["calls_begin"] + _DS["call_begin"]), (_DS["calls_end"], ""))


@reads(
    stream=rewriting(
        sep_json(_r1_name, "\n", begin=DS_CALL[0], end=DS_CALL[1], fenced=True, begin_splits=False),
        _R1_REWRITE,
    )
)
def _deepseek_body(region: str, final: bool) -> list[ParsedCall]:
    out: list[ParsedCall] = []
    for m in re.finditer(
        re.escape(_DS["call_begin"]) + r"(.*?)(" + re.escape(_DS["call_end"]) + r"|$)", region, re.S
    ):
        inner, closed = m.group(1), bool(m.group(2))
        head, _, rest = inner.partition(_DS["sep"])
        name, newline, body = rest.partition("\n")
        if not closed and not final:
            # the name is known once its line is complete
            out.append(ParsedCall(name.strip() if newline else None, None, inner, complete=False))
            continue
        obj, err = loads_lenient(unfence(body))
        if not closed:
            err = err or "unterminated tool call"
        if err or not isinstance(obj, dict):
            out.append(
                ParsedCall(
                    name.strip() or None,
                    None,
                    inner,
                    error=err or "arguments are not a JSON object",
                )
            )
        else:
            out.append(ParsedCall(name.strip(), obj, inner))
    return out


_HERMES_TAGS = ("tool_call", "function_call", "tool", "tools", "response", "json", "xml", "JSON")


@reads("json", stream=objects(fenced=True))
def _hermes_json(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    return _hermes_body(region, final)


_HERMES_FN = re.compile(r'=([^>\s]+)|\s+name="([^"]*)"')


def _hermes_fn_name(head: str) -> tuple[str, str | None] | None:
    m = _HERMES_FN.fullmatch(head)
    name = m and (m.group(1) or m.group(2))
    return (name, None) if name else None


@reads("json", stream=sep_json(_hermes_fn_name, ">"))
def _hermes_fn(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<function=NAME>{json}</function>`` or ``<function name="NAME">{json}</function>``."""
    m = re.match(r'^(?:=([^>\s]+)|\s+name="([^"]*)")>(.*)$', region, re.S)
    if not m:
        return (
            [ParsedCall(None, None, region, complete=False)]
            if not final
            else [ParsedCall(None, None, region, error="cannot read the <function> call")]
        )
    name = m.group(1) or m.group(2)
    if not final:
        return [ParsedCall(name, None, region, complete=False)]
    args, err = loads_lenient(m.group(3).strip() or "{}")
    if err or not isinstance(args, dict):
        return [
            ParsedCall(
                name, None, m.group(3).strip(), error=err or "arguments are not a JSON object"
            )
        ]
    return [ParsedCall(name, args, m.group(3).strip())]


_HERMES_REGIONS: tuple[tuple[str, str | None, Any], ...] = (
    *((f"<{t}>", f"</{t}>", _hermes_json) for t in _HERMES_TAGS),
    ("<function", "</function>", _hermes_fn),
)


@reads(stream=objects(fenced=True))
def _bare_call(text: str) -> list[ParsedCall] | None:
    """A whole output that is one ``{"name", "arguments"}`` object (maybe fenced)."""
    s = unfence(text)
    if not s.startswith("{"):
        return None
    obj, err = loads_lenient(s)
    if (
        err
        or not isinstance(obj, dict)
        or "name" not in obj
        or not ({"arguments", "parameters"} & obj.keys())
    ):
        return None
    return [call_from_obj(obj, s)]


_EMPTY_FENCE = re.compile(r"```(?:xml|json|JSON)?[ \t]*\n\s*```[ \t]*\n?")
#: a fence at the end of the text so far that may still open a call (its language half-written)
_OPEN_FENCE = re.compile(r"```(?:[A-Za-z]{0,3}|xml|json|JSON)[ \t]*(?:\n\s*(?:`{0,2}|<[^\n>]*))?$")


_ALL = "all\n"


def _granite_unwrap(text: str) -> str:
    """Granite's answer without its ``<response>`` wrapper (with or without tools)."""
    for marker, by in _GRANITE_WRAP:
        text = text.replace(marker, by)
    return text


# --------------------------------------------------------------------------- readers

Read = Callable[[str, Options, bool, ParseContext], RegionScan]
"""read(rest, opts, final, ctx) -> the scan of ``rest`` (``ctx``: what came before it)."""


def _text(content: str, settled: bool = True, **kw: Any) -> RegionScan:
    return RegionScan(None, content, [], settled, stage="rest", **kw)


def _as_text(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    return _text(rest)


@dataclass(frozen=True)
class Reader:
    """How a classic family reads what follows its reasoning block.

    ``read`` with tools bound, ``plain`` without (its wrappers go, call markup stays
    text). ``markers``: every string it looks for (a stream holds them back while
    half-written and settles no text before one); ``held``: those it holds back in
    streamed content beyond the record's; ``wake``: the markers that end or complete
    an open call; ``whole_output``: a call may be the whole output, so content is not
    streamed until it is clear it is not one; ``bodies``: the call syntaxes of the
    regions it reports open (each names the stream of its arguments).
    """

    read: Read
    plain: Read = _as_text
    markers: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    wake: tuple[str, ...] = ()
    whole_output: bool = False
    bodies: tuple[Any, ...] = ()


def hermes_read(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    found_open: list[OpenRegion] = []
    pieces, calls, settled_at = scan_multi(rest, _HERMES_REGIONS, opts, final, found_open)
    content = "".join(pieces)
    if calls or ctx.had_calls:  # a call in a ```xml / ```json fence leaves no empty fence
        content = _EMPTY_FENCE.sub("", content)
    trimmed = False
    if not final:  # a fence that may open a call is held back until it is known
        m = _OPEN_FENCE.search(content)
        if m is not None:
            content, trimmed = content[: m.start()], True
    if not calls and not ctx.had_calls and ctx.head:
        s = content.strip()
        if not final and (s.startswith("{") or s.startswith("```")):
            sc = _text("", False, hold=tuple(start for start, _, _ in _HERMES_REGIONS))
            # the bare call (it starts the output), for a stream of its arguments
            sc.open_region = OpenRegion(len(rest.lstrip()), _bare_call, 0)
            return sc
        bare = _bare_call(content) if final else None
        if bare is not None:
            return RegionScan(None, "", bare, True, stage="rest")
    settled = settled_at >= len(rest)
    return RegionScan(
        None,
        content,
        calls,
        settled,
        stage="rest",
        open=not settled,
        trimmed=trimmed,
        open_region=found_open[-1] if found_open else None,
    )


def _granite_read(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    c = _granite_unwrap(rest)
    # (a region is followed as written only where no wrapper tag was taken out)
    found_open: list[OpenRegion] | None = [] if c == rest else None
    pieces, calls, settled_at = scan_regions(
        c, "<|tool_call|>", None, _list_body, final, found_open
    )
    settled = settled_at >= len(c)
    sc = RegionScan(None, "".join(pieces), calls, settled, stage="rest", open=not settled)
    sc.open_region = found_open[-1] if found_open else None
    return sc


def _granite_plain(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    return _text(_granite_unwrap(rest))


def _functionary_resume(opts: Options) -> str:
    """Text streams as the "all" recipient's message (or before any recipient): what
    follows is read as that message's."""
    return ("" if opts.opened(">>>") else ">>>") + _ALL


def _functionary_read(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    text = ">>>" + rest if opts.opened(">>>") else rest
    pieces, calls, settled_at = _functionary_body(text, final)
    settled = settled_at >= len(text)
    # a call whose name line is written ends where the next recipient begins
    open_call = not settled and "\n" in rest[max(rest.rfind(">>>"), 0) :]
    sc = RegionScan(None, "".join(pieces), calls, settled, stage="rest", open=open_call)
    sc.resume = _functionary_resume(opts)
    if open_call:
        sc.wake = ((">>>",), frozenset())
        last = calls[-1] if calls else None
        if last is not None and not last.complete:  # its body runs to the end of the text
            sc.open_region = OpenRegion(len(last.raw), NAMED_ARGUMENTS, len(calls) - 1, last.name)
    return sc


def _functionary_plain(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    # the generation prompt ends with ">>>": plain text is the "all" recipient's message
    text = rest if opts.opened(">>>") else rest.removeprefix(">>>")
    if not final and len(text) < len(_ALL) and _ALL.startswith(text):
        return _text("", False)
    return _text(text.removeprefix(_ALL), resume=_functionary_resume(opts))


def _deepseek_r1_read(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    # "<｜tool▁calls｜>" opens the calls and the first call at once (an R1 variant)
    c = rest
    for marker, by in _R1_REWRITE:
        c = c.replace(marker, by)
    found_open: list[OpenRegion] | None = [] if c == rest else None  # (as written)
    pieces, calls, settled_at = scan_regions(
        c, _DS["calls_begin"], None, _deepseek_body, final, found_open
    )
    settled = settled_at >= len(c)
    sc = RegionScan(None, "".join(pieces), calls, settled, stage="rest", open=not settled)
    sc.open_region = found_open[-1] if found_open else None
    return sc


def pythonic_read(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    if ctx.had_calls:  # only the first call block is read: the rest is text
        return _text(rest)
    m = re.search(r"<\|tool_call_start\|>(.*?)(<\|tool_call_end\|>|$)", rest, re.S)
    if m:
        if not m.group(2) and not final:
            named = re.match(r"\s*\[\s*([\w.\-]+)\(", m.group(1))
            call = ParsedCall(named and named.group(1), None, m.group(1), complete=False)
            sc = RegionScan(None, rest[: m.start()], [call], False, stage="rest", open=True)
            sc.open_region = OpenRegion(len(m.group(1)), _pythonic_calls, 0)
            return sc
        found = _pythonic_calls(m.group(1))
        calls = (
            found
            if found is not None
            else [ParsedCall(None, None, m.group(1), error="not a list of calls")]
        )
        return RegionScan(None, rest[: m.start()] + rest[m.end() :], calls, True, stage="rest")
    if not final and ctx.head and rest.lstrip().startswith("["):
        sc = _text("", False, hold=("<|tool_call_start|>",))
        sc.open_region = OpenRegion(len(rest.lstrip()), _pythonic_calls, 0)  # (the list)
        return sc
    found = _pythonic_calls(rest) if final and ctx.head else None
    if found is not None:
        return RegionScan(None, "", found, True, stage="rest")
    return _text(rest)


def _llama3_read(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    s = rest.strip()
    if not final and (
        "<|python_tag|>" in s
        or ctx.head
        and (s.startswith("{") or s and "<|python_tag|>".startswith(s))
    ):
        forever = s.startswith("{") or "<|python_tag|>" in s
        sc = _text("", False, hold=() if forever else None)
        # the calls' JSON, for a stream of their arguments: from the output's start, or
        # after the tag
        start = rest.index("{") if s.startswith("{") and ctx.head else -1
        if start < 0 and "<|python_tag|>" in rest:
            start = rest.index("<|python_tag|>") + len("<|python_tag|>")
        if start >= 0:
            sc.open_region = OpenRegion(len(rest) - start, _llama3_calls, 0)
        return sc
    found = _llama3_calls(rest) if final and ctx.head else None
    if found is not None:
        return RegionScan(None, "", found, True, stage="rest")
    if final and "<|python_tag|>" in rest:
        i = rest.index("<|python_tag|>")
        return RegionScan(None, rest[:i], _llama3_calls(rest[i:]) or [], True, stage="rest")
    return _text(rest)


def _generic_read(rest: str, opts: Options, final: bool, ctx: ParseContext) -> RegionScan:
    s = rest.strip()
    if not final and ctx.head and (s.startswith("{") or s.startswith("`")):
        sc = _text("", False, hold=())
        # the document, for a stream of its calls' arguments
        sc.open_region = OpenRegion(len(rest.lstrip()), _generic_calls, 0)
        return sc
    generic = _generic_calls(rest) if final and ctx.head else None
    if generic is not None:
        return RegionScan(None, generic[1], generic[0], True, stage="rest")
    return _text(rest)


_HERMES_MARKERS = tuple(start for start, _, _ in _HERMES_REGIONS)

HERMES = Reader(
    hermes_read,
    markers=(*(m for start, end, _ in _HERMES_REGIONS for m in (start, end or "") if m), "```"),
    held=(*_HERMES_MARKERS, "```"),  # a fence may wrap a call
    wake=tuple(end for _, end, _ in _HERMES_REGIONS if end),
    bodies=(*dict.fromkeys(body for _, _, body in _HERMES_REGIONS), _bare_call),
)
LLAMA3_JSON = Reader(
    _llama3_read, markers=("<|python_tag|>",), whole_output=True, bodies=(_llama3_calls,)
)
PYTHONIC = Reader(
    pythonic_read,
    markers=("<|tool_call_start|>", "<|tool_call_end|>"),
    wake=("<|tool_call_end|>",),
    whole_output=True,
    bodies=(_pythonic_calls,),
)
GRANITE = Reader(
    _granite_read,
    _granite_plain,
    markers=("<|tool_call|>", *(marker for marker, _ in _GRANITE_WRAP)),
    bodies=(_list_body,),
)
FUNCTIONARY_V3_2 = Reader(
    _functionary_read, _functionary_plain, markers=(">>>",), bodies=(NAMED_ARGUMENTS,)
)
DEEPSEEK_R1 = Reader(
    _deepseek_r1_read,
    markers=(*_DS.values(), _DS_CALLS),
    wake=(_DS["call_end"],),
    bodies=(_deepseek_body,),
)
GENERIC = Reader(_generic_read, whole_output=True, bodies=(_generic_calls,))
CONTENT = Reader(_as_text)
