"""Body readers of the tool-call syntaxes beyond the classic ones (GLM, Kimi, DeepSeek V3.x, ...).

Each body function reads the inside of one tool-call region (between the family's start
and end markers) into call records; a :class:`Spec` says which markers open reasoning and
tool calls and which wrapper markers are dropped from content. The specs themselves are
part of each family's record (:mod:`.registry`). The syntaxes follow llama.cpp 0.3.36's
parsers (``common/parsers/*.cpp`` and the auto-parser's tests).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from langchain_llamacpp_local.formats.base import (
    Options,
    ParsedCall,
    call_from_obj,
    json_prefix,
    json_safe,
    loads_lenient,
    typed_value,
    unfence,
)

#: body(region, final, opts) -> calls
Body = Callable[[str, bool, Options], list[ParsedCall]]
_B = TypeVar("_B", bound=Body)


def reads(syntax: str | None = None, closers: tuple[str, ...] = ()) -> Callable[[_B], _B]:
    """What a body reader's record says about its syntax.

    ``syntax``: its values are quoted strings that may spell the region's closing marker
    (``"json"``, Gemma 4's ``"gemma"``), so the region ends only at a marker outside them.
    ``closers``: the markers whose writing completes one of its calls while the region is
    still open (a stream reads an open region again only when one of them, or the
    region's end, is written).
    """

    def mark(body: _B) -> _B:
        body.string_syntax = syntax  # type: ignore[attr-defined]
        body.closers = closers  # type: ignore[attr-defined]
        return body

    return mark


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


def _tagged_args(
    inner: str,
    pattern: re.Pattern[str],
    name: str | None,
    opts: Options,
    raw: str,
    closed: bool,
    final: bool,
) -> ParsedCall:
    """Arguments written as tagged key/value pairs, typed by the tool's schema."""
    args: dict[str, object] = {}
    for m in pattern.finditer(inner):
        key, value = m.group("k").strip(), m.group("v")
        if value.startswith("<![CDATA[") and value.endswith("]]>"):
            value = value[len("<![CDATA[") : -len("]]>")]
        if m.groupdict().get("s") is not None:  # DSML: string="true|false"
            args[key] = value if m.group("s") == "true" else typed_value(value, None)
        else:
            args[key] = typed_value(value, opts.param_types(name, key))
    if not closed:
        if final:
            return ParsedCall(name, None, raw, error="unterminated tool call")
        return ParsedCall(name, None, raw, complete=False)
    return ParsedCall(name, args, raw)


# --------------------------------------------------------------------------- XML-ish bodies

_GLM_ARG = re.compile(r"<arg_key>(?P<k>.*?)</arg_key>\s*<arg_value>(?P<v>.*?)</arg_value>", re.S)


@reads()
def glm_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``NAME<arg_key>k</arg_key><arg_value>v</arg_value>...`` (GLM 4.5+, Ling, Laguna)."""
    m = re.match(r"\s*([^<\n]+?)\s*(?=<arg_key>|\n|$)", region)
    name = m.group(1) if m else None
    named = m is not None and (final or m.end() < len(region))
    if not final:
        return [ParsedCall(name if named else None, None, region, complete=False)]
    if not name:
        return [ParsedCall(None, None, region, error="tool call has no name")]
    return [_tagged_args(region, _GLM_ARG, name, opts, region, True, final)]


def _xml_function_calls(
    region: str,
    final: bool,
    opts: Options,
    open_re: str,
    close: str,
    arg: re.Pattern[str],
) -> list[ParsedCall]:
    out: list[ParsedCall] = []
    for m in re.finditer(
        open_re + r"(?P<body>.*?)(?P<close>" + re.escape(close) + r"|$)", region, re.S
    ):
        name = m.group("name").strip()
        closed = bool(m.group("close"))
        if (
            not closed
            and not final
            and not m.group("body").strip()
            and not m.group(0).endswith(">")
        ):
            out.append(ParsedCall(None, None, m.group(0), complete=False))
            continue
        out.append(_tagged_args(m.group("body"), arg, name, opts, m.group(0), closed, final))
    if not out and region.strip():
        if final:
            out.append(ParsedCall(None, None, region.strip(), error="cannot read the tool call"))
        else:
            out.append(ParsedCall(None, None, region, complete=False))
    return out


_QWEN_PARAM = re.compile(r"<parameter=(?P<k>[^>\n]+)>\n?(?P<v>.*?)\n?</parameter>", re.S)


@reads(closers=("</function>",))
def qwen3_coder_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<function=NAME>\\n<parameter=k>\\nv\\n</parameter>\\n</function>`` (Qwen3-Coder, Qwen3.5, Seed-OSS)."""
    return _xml_function_calls(
        region, final, opts, r"<function=(?P<name>[^>\n]+)>", "</function>", _QWEN_PARAM
    )


_SEED_PARAM = re.compile(r"<parameter=(?P<k>[^>\n]+)>(?P<v>.*?)</parameter>", re.S)


@reads(closers=("</function>",))
def seed_oss_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """Seed-OSS: like Qwen3-Coder, but parameter values are verbatim (no newline framing)."""
    return _xml_function_calls(
        region, final, opts, r"<function=(?P<name>[^>\n]+)>", "</function>", _SEED_PARAM
    )


_MINIMAX_PARAM = re.compile(r'<parameter name="(?P<k>[^"]*)">(?P<v>.*?)</parameter>', re.S)


@reads(closers=("</invoke>",))
def minimax_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<invoke name="X"><parameter name="k">v</parameter></invoke>`` (MiniMax M2)."""
    return _xml_function_calls(
        region, final, opts, r'<invoke name="(?P<name>[^"]*)">', "</invoke>", _MINIMAX_PARAM
    )


DSML_MARKER = "｜DSML｜"
_DSML_PARAM = re.compile(
    rf'<{DSML_MARKER}parameter name="(?P<k>[^"]*)"(?: string="(?P<s>true|false)")?>(?P<v>.*?)</{DSML_MARKER}parameter>',
    re.S,
)


@reads(closers=(f"</{DSML_MARKER}invoke>",))
def dsml_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """DeepSeek V3.2/V4 DSML: ``<｜DSML｜invoke name="X"><｜DSML｜parameter name="k" string="true">v...``."""
    return _xml_function_calls(
        region,
        final,
        opts,
        rf'<{DSML_MARKER}invoke name="(?P<name>[^"]*)">',
        f"</{DSML_MARKER}invoke>",
        _DSML_PARAM,
    )


_MINICPM_PARAM = re.compile(
    r'<param name="(?P<k>[^"]*)">(?P<v><!\[CDATA\[.*?\]\]>|.*?)</param>', re.S
)


@reads(closers=("</function>",))
def minicpm5_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<function name="X"><param name="k">v</param></function>`` (MiniCPM5)."""
    return _xml_function_calls(
        "<function" + region,
        final,
        opts,
        r'<function name="(?P<name>[^"]*)">',
        "</function>",
        _MINICPM_PARAM,
    )


# --------------------------------------------------------------------------- JSON bodies


@reads("json")
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


@reads("json")
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


@reads("json")
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


_DS_SEP = "<｜tool▁sep｜>"


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


def _split_calls(
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


@reads("json", ("<｜tool▁call▁end｜>", "<｜tool▁call▁begin｜>"))
def deepseek_v3_1_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`` (DeepSeek V3.1)."""
    return _split_calls(
        region,
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        final,
        lambda s, f: _name_sep_json(s, f, _DS_SEP),
    )


@reads("json", ("<|tool_call_end|>", "<|tool_call_begin|>"))
def kimi_k2_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>``."""

    def one(s: str, fin: bool) -> list[ParsedCall]:
        calls = _name_sep_json(s, fin, "<|tool_call_argument_begin|>")
        for c in calls:
            if c.name:
                full = c.name
                name = full.split(":", 1)[0]
                c.name = name[len("functions.") :] if name.startswith("functions.") else name
                c.id = full
        return calls

    return _split_calls(region, "<|tool_call_begin|>", "<|tool_call_end|>", final, one)


@reads("json")
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


@reads("json")
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


_GEMMA_STR = '<|"|>'


def _gemma_value(text: str) -> object:
    """Gemma 4's argument notation: ``{key:<|"|>str<|"|>, n:1, l:[...]}`` -> Python data."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith(_GEMMA_STR, i):
            j = text.find(_GEMMA_STR, i + len(_GEMMA_STR))
            if j < 0:
                raise ValueError("unterminated string")
            out.append(json.dumps(text[i + len(_GEMMA_STR) : j], ensure_ascii=False))
            i = j + len(_GEMMA_STR)
            continue
        m = re.match(r"([A-Za-z_][\w.\-]*)\s*:", text[i:])
        if m and (not out or out[-1].rstrip().endswith(("{", ","))):
            out.append(json.dumps(m.group(1)) + ":")
            i += m.end()
            continue
        out.append(text[i])
        i += 1
    return json.loads("".join(out))


@reads("gemma")
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
        args = _gemma_value(s[m.end() :].strip() or "{}")
    except ValueError as exc:
        return [ParsedCall(name, None, s, error=f"cannot read the arguments: {exc}")]
    if not isinstance(args, dict):
        return [ParsedCall(name, None, s, error="arguments are not an object")]
    return [ParsedCall(name, args, s)]


# --------------------------------------------------------------------------- pythonic


def py_literal(node: ast.AST) -> object:
    """``ast.literal_eval`` that also reads JSON's ``true``/``false``/``null``."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.List):
        return [py_literal(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return [py_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("dict unpacking")
        return {py_literal(k): py_literal(v) for k, v in zip(node.keys, node.values, strict=False)}  # type: ignore[arg-type]
    return json_safe(ast.literal_eval(node))


# --------------------------------------------------------------------------- more families

MM_MARKER = "]<]minimax[>["
_MMQ = re.escape(MM_MARKER)
_MM_PARAM = re.compile(rf"(?:{_MMQ})?<(?P<k>[\w.\-]+)>(?P<v>.*?)(?:{_MMQ})?</(?P=k)>", re.S)


def mm_value(text: str, types: set[str] | None) -> object:
    """A MiniMax M3 value: text, or nested ``<k>v</k>`` tags (``<item>`` ones make a list)."""
    if types is not None and "string" in types:
        return text  # a string-typed value stays text even when it looks structured
    children = list(_MM_PARAM.finditer(text)) if "<" in text else []  # (a tag needs "<")
    if not children:
        return typed_value(text.strip(), types)
    if all(c.group("k") == "item" for c in children):
        return [mm_value(c.group("v"), None) for c in children]
    return {c.group("k"): mm_value(c.group("v"), None) for c in children}


@reads(closers=("</invoke>",))
def minimax_m3_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``]<]minimax[>[<invoke name="X">]<]minimax[>[<k>v]<]minimax[>[</k>...`` (MiniMax M3)."""
    out: list[ParsedCall] = []
    pat = (
        rf'(?:{_MMQ})?<invoke name="(?P<name>[^"]*)">(?P<body>.*?)(?P<close>(?:{_MMQ})?</invoke>|$)'
    )
    for m in re.finditer(pat, region, re.S):
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
        args = {
            p.group("k"): mm_value(p.group("v"), opts.param_types(name, p.group("k")))
            for p in _MM_PARAM.finditer(m.group("body"))
        }
        out.append(ParsedCall(name, args, m.group(0)))
    if not out and final and region.strip():
        out.append(ParsedCall(None, None, region, error="cannot read the tool call"))
    return out


_K3_ARG = re.compile(
    r'<\|open\|>argument key="(?P<k>[^"]*)"(?: type="(?P<t>[^"]*)")?<\|sep\|>(?P<v>.*?)<\|close\|>argument<\|sep\|>',
    re.S,
)


@reads(closers=("<|close|>call<|sep|>",))
def kimi_k3_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<|open|>call tool="X" index="1"<|sep|><|open|>argument key="k" type="number"<|sep|>v<|close|>argument<|sep|>``."""
    out: list[ParsedCall] = []
    pat = r'<\|open\|>call tool="(?P<name>[^"]*)"[^<]*<\|sep\|>(?P<body>.*?)(?P<close><\|close\|>call<\|sep\|>|$)'
    for m in re.finditer(pat, region, re.S):
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
        args: dict[str, object] = {}
        for a in _K3_ARG.finditer(m.group("body")):
            t = a.group("t")
            types = (
                {"string"}
                if t == "string"
                else opts.param_types(name, a.group("k"))
                if t is None
                else {t, "integer"}
            )
            args[a.group("k")] = typed_value(a.group("v"), types)
        out.append(ParsedCall(name, args, m.group(0)))
    if not out and final and region.strip():
        out.append(ParsedCall(None, None, region, error="cannot read the tool call"))
    return out


@reads("json")
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


_ATEM_PARAM = re.compile(r'<atem:parameter name="(?P<k>[^"]*)">(?P<v>.*?)</atem:parameter>', re.S)


@reads(closers=("</atem:invoke>",))
def muse_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<atem:invoke name="X"><atem:parameter name="k">v</atem:parameter></atem:invoke>`` (Muse Glimmer)."""
    return _xml_function_calls(
        region, final, opts, r'<atem:invoke name="(?P<name>[^"]*)">', "</atem:invoke>", _ATEM_PARAM
    )


HY_MARKER = ":opensource"
_HY_ARG = re.compile(
    rf"<arg_key{HY_MARKER}>(?P<k>.*?)</arg_key{HY_MARKER}>\s*<arg_value{HY_MARKER}>(?P<v>.*?)</arg_value{HY_MARKER}>",
    re.S,
)


@reads(closers=(f"</tool_call{HY_MARKER}>", f"<tool_call{HY_MARKER}>"))
def hy3_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<tool_call:opensource>NAME<tool_sep:opensource><arg_key:...>k</arg_key:...><arg_value:...>v...``."""

    def one(s: str, fin: bool) -> list[ParsedCall]:
        head, found, body = s.partition(f"<tool_sep{HY_MARKER}>")
        if not found:
            return [ParsedCall(None, None, s, error="no tool name" if fin else None, complete=fin)]
        return [_tagged_args(body, _HY_ARG, head.strip(), opts, s, fin, fin)]

    return _split_calls(region, f"<tool_call{HY_MARKER}>", f"</tool_call{HY_MARKER}>", final, one)


@reads("json")
def solar_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``ID<|tool_call:name|>NAME<|tool_call:args|>{json}`` (Solar Open)."""
    cid, _, rest = region.partition("<|tool_call:name|>")
    calls = _name_sep_json(rest, final, "<|tool_call:args|>")
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


@reads()
def mistral_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """Everything after the first ``[TOOL_CALLS]``: a JSON list, or ``name[CALL_ID]id[ARGS]{...}`` segments."""
    calls: list[ParsedCall] = []
    for seg in region.split("[TOOL_CALLS]"):
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


# --------------------------------------------------------------------------- specs


def rewrap(prefix: str, suffix: str, body: Body) -> Body:
    """A body that gets its region back with the start (and, once closed, end) marker.

    It completes calls at the same markers; its region ends at the first closing marker.
    """

    def wrapped(region: str, final: bool, opts: Options) -> list[ParsedCall]:
        return body(prefix + region + (suffix if final else ""), final, opts)

    wrapped.inner = body  # type: ignore[attr-defined]  # (a stream of arguments reads
    wrapped.prefix = prefix  # type: ignore[attr-defined]  # the region as the body does)
    return reads(None, body.closers)(wrapped)  # type: ignore[attr-defined]
