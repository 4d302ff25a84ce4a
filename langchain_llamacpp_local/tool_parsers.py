"""Tool-call and reasoning parsing for the output formats of the major model families.

Pure functions (no model needed), ported from the ideas of llama.cpp's
``common/chat.cpp`` legacy parsers:

- ``detect_format(chat_template)`` picks the format from the template's text;
- ``parse(text, fmt)`` splits a finished generation into content, reasoning,
  tool calls and invalid tool calls;
- ``StreamParser`` does the same incrementally while tokens arrive, never
  letting a half-written marker through as content.

Formats: ``hermes`` (Hermes 2 Pro, Qwen 2.5/3: ``<tool_call>{json}</tool_call>``),
``qwen3_coder`` (``<function=..><parameter=..>``), ``llama3_json``
(``{"name", "parameters"}``, ``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS][...]``
and ``[TOOL_CALLS]name[ARGS]{...}``), ``pythonic`` (``[f(a=1), g()]``),
``granite`` (``<|tool_call|>[...]``), ``functionary_v3_2`` (``>>>name``),
``deepseek_r1`` (``<｜tool▁calls▁begin｜>``), ``command_r7b``
(``<|START_ACTION|>``), ``gpt_oss`` (harmony ``to=functions.x``), ``generic``
(``{"tool_call": ...}``/``{"tool_calls": [...]}``/``{"response": ...}``) and
``content`` (no tool calls; reasoning only).

Parsing never raises on model output: anything malformed becomes an
``invalid_tool_calls`` entry with the raw text, never lost.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.messages.tool import InvalidToolCall, ToolCall, invalid_tool_call, tool_call

FORMATS: tuple[str, ...] = (
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "mistral",
    "pythonic",
    "granite",
    "functionary_v3_2",
    "deepseek_r1",
    "command_r7b",
    "gpt_oss",
    "generic",
    "content",
)

THINK = ("<think>", "</think>")
_DS = {
    "calls_begin": "<｜tool▁calls▁begin｜>",
    "calls_end": "<｜tool▁calls▁end｜>",
    "call_begin": "<｜tool▁call▁begin｜>",
    "call_end": "<｜tool▁call▁end｜>",
    "sep": "<｜tool▁sep｜>",
}
#: Markers that open a tool-call region or are removed from content, per format
#: (held back while half-written so they never leak into streamed content).
START_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "<function="),
    "qwen3_coder": ("<tool_call>", "<function="),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]",),
    "pythonic": ("<|tool_call_start|>",),
    "granite": ("<|tool_call|>", "<response>", "</response>"),
    "functionary_v3_2": (">>>",),
    "deepseek_r1": (_DS["calls_begin"], _DS["call_begin"], _DS["calls_end"]),
    "command_r7b": (
        "<|START_ACTION|>",
        "<|START_RESPONSE|>",
        "<|END_RESPONSE|>",
        "<|START_THINKING|>",
    ),
    "gpt_oss": ("<|channel|>", "<|start|>", "<|end|>", "<|call|>", "<|return|>", "<|message|>"),
    "generic": (),
    "content": (),
}
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


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------- detection


def detect_format(chat_template: str) -> str:
    """The tool-call format a chat template teaches its model (llama.cpp's order)."""
    t = chat_template or ""
    if _DS["calls_begin"] in t:
        return "deepseek_r1"
    if "<|START_ACTION|>" in t:
        return "command_r7b"
    if "<|tool_call|>" in t:
        return "granite"
    if "<tool_call>" in t and "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "<|channel|>" in t:
        return "gpt_oss"
    if ">>>all" in t:
        return "functionary_v3_2"
    if "<|start_header_id|>ipython<|end_header_id|>" in t or "<|python_tag|>" in t:
        return "llama3_json"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|tool_call_start|>" in t or "[func_name1(" in t or "func_name1(params_name1" in t:
        return "pythonic"
    if "<|start_header_id|>" in t and "tools" in t:
        return "llama3_json"
    return "generic"


# --------------------------------------------------------------------------- helpers


@dataclass
class _Call:
    name: str | None
    args: dict[str, Any] | None
    raw: str
    id: str | None = None
    error: str | None = None
    complete: bool = True


def _json_args(value: Any) -> dict[str, Any] | None:
    """Arguments as a dict: objects pass, JSON strings of objects are decoded."""
    if isinstance(value, dict):
        return value
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            decoded = json.loads(value) if value.strip() else {}
        except ValueError:
            return None
        return decoded if isinstance(decoded, dict) else None
    return None


def _call_from_obj(obj: Any, raw: str, keys: tuple[str, ...] = ("arguments", "parameters")) -> _Call:
    if not isinstance(obj, dict):
        return _Call(None, None, raw, error="tool call is not a JSON object")
    fn = obj.get("function") if isinstance(obj.get("function"), dict) else None
    src = fn or obj
    name = src.get("name")
    if not isinstance(name, str) or not name:
        return _Call(None, None, raw, error="tool call has no name")
    args_val: Any = {}
    for k in keys:
        if k in src:
            args_val = src[k]
            break
    args = _json_args(args_val)
    cid = obj.get("id") or obj.get("tool_call_id")
    if args is None:
        return _Call(name, None, raw, id=str(cid) if cid else None, error="arguments are not a JSON object")
    return _Call(name, args, raw, id=str(cid) if cid else None)


def _loads(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"invalid JSON: {exc}"


def _json_prefix(text: str) -> tuple[Any, int] | None:
    """Decode one JSON value at the start of ``text``; (value, end) or None."""
    try:
        return json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None


_FENCE = re.compile(r"^```(?:json|JSON)?\s*\n?(.*?)\n?```\s*$", re.S)


def _unfence(text: str) -> str:
    m = _FENCE.match(text.strip())
    return m.group(1).strip() if m else text.strip()


# --------------------------------------------------------------------------- reasoning


def _split_reasoning(
    text: str, reasoning: bool | None, think_open: bool, markers: tuple[str, str] = THINK
) -> tuple[str | None, str, bool]:
    """(reasoning text, rest, reasoning finished) for a leading think block."""
    if reasoning is None:
        return None, text, True
    open_m, close_m = markers
    body_start = 0
    if not think_open:
        stripped = text.lstrip()
        if not stripped.startswith(open_m):
            if open_m.startswith(stripped) and stripped:
                return "", "", False  # a half-written opening marker
            return None, text, True
        body_start = len(text) - len(stripped) + len(open_m)
    end = text.find(close_m, body_start)
    if end < 0:
        return text[body_start:], "", False
    return text[body_start:end], text[end + len(close_m) :], True


def _strip_think_anywhere(text: str) -> str:
    return re.sub(r"<think>.*?(</think>|$)", "", text, flags=re.S)


# --------------------------------------------------------------------------- per format


def _scan_regions(
    text: str, start: str, end: str | None, body: Any, final: bool
) -> tuple[list[str], list[_Call], int]:
    """Split ``text`` at ``start...end`` regions parsed by ``body(region) -> [calls]``.

    Returns content pieces, calls and how much of ``text`` is settled (the rest is an
    unfinished region, held back while streaming).
    """
    content: list[str] = []
    calls: list[_Call] = []
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
                partial = body(region, False)
                calls.extend(partial)
                return content, calls, i
            found = body(region, True)
            for c in found:
                if c.error is None and end is not None:
                    c.error = f"unterminated tool call (no {end})"
                    c.args = None
                c.raw = c.raw or region
            calls.extend(found or [_Call(None, None, region, error=f"unterminated tool call (no {end})")])
            return content, calls, len(text)
        calls.extend(body(text[i + len(start) : j], True))
        pos = j + len(end)


def _hermes_body(region: str, final: bool) -> list[_Call]:
    s = region.strip()
    m = re.match(r"^<function=([^>\s]+)>\s*(.*?)\s*(</function>)?\s*$", s, re.S)
    if m:
        if not final and not m.group(3):
            return [_Call(m.group(1), None, s, complete=False)]
        args, err = _loads(m.group(2) or "{}")
        if err or not isinstance(args, dict):
            return [_Call(m.group(1), None, s, error=err or "arguments are not a JSON object", complete=final)]
        return [_Call(m.group(1), args, s)]
    if not final:
        name = re.match(r'^\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"', s)
        return [_Call(json.loads(f'"{name.group(1)}"') if name else None, None, s, complete=False)]
    obj, err = _loads(_unfence(s))
    if err:
        return [_Call(None, None, region.strip(), error=err)]
    if isinstance(obj, list):
        return [_call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in obj]
    return [_call_from_obj(obj, region.strip())]


def _parse_value(text: str) -> Any:
    t = text.strip("\n")
    try:
        return json.loads(t)
    except ValueError:
        return t


def _qwen3_coder_body(region: str, final: bool) -> list[_Call]:
    s = region.strip()
    out: list[_Call] = []
    for m in re.finditer(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", s, re.S):
        name, inner = m.group(1).strip(), m.group(2)
        args: dict[str, Any] = {}
        for p in re.finditer(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", inner, re.S):
            args[p.group(1).strip()] = _parse_value(p.group(2))
        closed = "</function>" in m.group(0)
        if not closed and final:
            out.append(_Call(name, None, m.group(0), error="unterminated <function> block"))
        else:
            out.append(_Call(name, args if closed else None, m.group(0), complete=closed))
    if not out:
        return _hermes_body(region, final)
    return out


def _list_body(region: str, final: bool, keys: tuple[str, ...] = ("arguments", "parameters")) -> list[_Call]:
    if not final:
        return []
    s = _unfence(region.strip())
    obj, err = _loads(s)
    if err:
        return [_Call(None, None, s, error=err)]
    items = obj if isinstance(obj, list) else [obj]
    return [_call_from_obj(o, json.dumps(o, ensure_ascii=False), keys) for o in items]


def _mistral_body(region: str, final: bool) -> list[_Call]:
    s = region.strip()
    if s.startswith("[") or s.startswith("{") or not final:
        if not final:
            return []
        parsed = _json_prefix(s)
        if parsed is None:
            return [_Call(None, None, s, error="invalid JSON in [TOOL_CALLS]")]
        obj, _end = parsed
        items = obj if isinstance(obj, list) else [obj]
        return [_call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in items]
    m = re.match(r"^([\w.\-]+)(?:\[CALL_ID\]([^\[]*))?\[ARGS\](.*)$", s, re.S)
    if not m:
        return [_Call(None, None, s, error="cannot read [TOOL_CALLS] name[ARGS]{...}")]
    args, err = _loads(m.group(3).strip())
    if err or not isinstance(args, dict):
        return [_Call(m.group(1), None, s, error=err or "arguments are not a JSON object")]
    return [_Call(m.group(1), args, s, id=m.group(2) or None)]


def _pythonic_calls(text: str) -> list[_Call] | None:
    """``[f(a=1), g()]`` as calls, or None when the text is not such a list."""
    s = text.strip()
    if not (s.startswith("[") and s.endswith("]")):
        return None
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
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
            args = {kw.arg: ast.literal_eval(kw.value) for kw in el.keywords if kw.arg}
            if el.args:
                raise ValueError("positional arguments")
        except (ValueError, SyntaxError, TypeError) as exc:
            calls.append(_Call(name, None, raw, error=f"arguments are not literals: {exc}"))
            continue
        calls.append(_Call(name, args, raw))
    return calls


def _llama3_calls(text: str) -> list[_Call] | None:
    s = text.strip()
    if s.startswith("<|python_tag|>"):
        s = s[len("<|python_tag|>") :].strip()
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
        return [_call_from_obj(obj["tool_call"], json.dumps(obj["tool_call"], ensure_ascii=False))], ""
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
        else:
            obj, err = _loads(body.strip() or "{}")
            if err or not isinstance(obj, dict):
                calls.append(_Call(name or None, None, body.strip(), error=err or "arguments are not a JSON object"))
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
            out.append(_Call(name.strip() or None, None, inner, error=err or "arguments are not a JSON object"))
        else:
            out.append(_Call(name.strip(), obj, inner))
    return out


def _command_r7b_body(region: str, final: bool) -> list[_Call]:
    if not final:
        return []
    obj, err = _loads(region.strip())
    if err:
        return [_Call(None, None, region.strip(), error=err)]
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for o in items:
        if isinstance(o, dict) and "tool_name" in o:
            o = {"name": o.get("tool_name"), "parameters": o.get("parameters", {}), "id": o.get("tool_call_id")}
        calls.append(_call_from_obj(o, json.dumps(o, ensure_ascii=False), ("parameters", "arguments")))
    return calls


# --------------------------------------------------------------------------- core parse


@dataclass
class _Scan:
    reasoning: str | None
    content: str
    calls: list[_Call]
    settled: bool  # False: the tail is an unfinished call/marker (streaming only)


def _gpt_oss(text: str, reasoning: bool | None, final: bool) -> _Scan:
    """Harmony: ``<|channel|>analysis|commentary|final ... <|message|>body<|end|>``."""
    if "<|channel|>" not in text:
        s = text.lstrip()
        if not final and s.startswith("<|"):
            return _Scan(None, "", [], False)  # a header still being written
        return _Scan(None, text, [], True)
    content: list[str] = []
    thought: list[str] = []
    calls: list[_Call] = []
    settled = True
    pat = re.compile(
        r"(?:<\|start\|>assistant)?(?P<head>[^<]*?)<\|channel\|>(?P<chan>\w+)(?P<hdr>[^<]*?)"
        r"(?:<\|constrain\|>\w+)?<\|message\|>(?P<body>.*?)(?P<end><\|end\|>|<\|call\|>|<\|return\|>|$)",
        re.S,
    )
    pos = 0
    for m in pat.finditer(text):
        if m.start() == m.end():
            break
        pre = text[pos : m.start()]
        if pre.strip():
            content.append(pre)
        pos = m.end()
        chan, body, end = m.group("chan"), m.group("body"), m.group("end")
        to = re.search(r"to=functions\.([\w.\-]+)", (m.group("head") or "") + (m.group("hdr") or ""))
        if to:
            if not end and not final:
                calls.append(_Call(to.group(1), None, body, complete=False))
                settled = False
                continue
            obj, err = _loads(body.strip() or "{}")
            if not end:
                err = err or "unterminated tool call"
            if err or not isinstance(obj, dict):
                calls.append(
                    _Call(to.group(1), None, body.strip(), error=err or "arguments are not a JSON object")
                )
            else:
                calls.append(_Call(to.group(1), obj, body.strip()))
        elif chan == "analysis" and reasoning is not None:
            thought.append(body)
        else:
            content.append(body)
        if not end:
            settled = False
    if pos < len(text):
        if final:
            content.append(text[pos:])
        else:
            settled = False  # the next header is still being written
    r: str | None = "".join(thought) if thought and reasoning else None
    return _Scan(r, "".join(content), calls, settled)


def _scan(text: str, fmt: str, reasoning: bool | None, think_open: bool, final: bool) -> _Scan:
    if fmt == "gpt_oss":
        return _gpt_oss(text, reasoning, final)
    markers = ("<|START_THINKING|>", "<|END_THINKING|>") if fmt == "command_r7b" else THINK
    r, rest, r_done = _split_reasoning(text, reasoning, think_open, markers)
    if reasoning is False:
        r = None
        if not r_done:
            return _Scan(None, "", [], final)
        rest = _strip_think_anywhere(rest)
    if not r_done and not final:
        return _Scan(r, "", [], False)
    calls: list[_Call] = []
    settled_at = len(rest)
    pieces: list[str]
    if fmt in ("hermes", "qwen3_coder"):
        body = _qwen3_coder_body if fmt == "qwen3_coder" else _hermes_body
        pieces, calls, settled_at = _scan_regions(rest, "<tool_call>", "</tool_call>", body, final)
        if not calls and "<function=" in rest and fmt == "hermes":
            pieces, calls, settled_at = _scan_regions(
                rest,
                "<function=",
                "</function>",
                lambda reg, fin: _hermes_body("<function=" + reg + ("</function>" if fin else ""), fin),
                final,
            )
        content = "".join(pieces)
    elif fmt == "granite":
        c = rest.replace("<response>", "").replace("</response>", "")
        pieces, calls, settled_at = _scan_regions(c, "<|tool_call|>", None, _list_body, final)
        content = "".join(pieces)
        rest = c
    elif fmt == "mistral":
        i = rest.find("[TOOL_CALLS]")
        if i < 0:
            content = rest
        else:
            content = rest[:i]
            if final:
                for seg in rest[i:].split("[TOOL_CALLS]")[1:]:
                    calls.extend(_mistral_body(seg, True))
            else:
                settled_at = i
                m = re.match(r"\[TOOL_CALLS\]\s*([\w.\-]+)\[ARGS\]", rest[i:])
                if m:
                    calls.append(_Call(m.group(1), None, "", complete=False))
    elif fmt == "functionary_v3_2":
        pieces, calls, settled_at = _functionary_body(rest, final)
        content = "".join(pieces)
    elif fmt == "deepseek_r1":
        c = rest.replace(_DS["calls_end"], "")
        pieces, calls, settled_at = _scan_regions(c, _DS["calls_begin"], None, _deepseek_body, final)
        content = "".join(pieces)
        rest = c
    elif fmt == "command_r7b":
        c = rest.replace("<|START_RESPONSE|>", "").replace("<|END_RESPONSE|>", "")
        pieces, calls, settled_at = _scan_regions(c, "<|START_ACTION|>", "<|END_ACTION|>", _command_r7b_body, final)
        content = "".join(pieces)
        rest = c
    elif fmt == "pythonic":
        s = rest
        m = re.search(r"<\|tool_call_start\|>(.*?)(<\|tool_call_end\|>|$)", s, re.S)
        if m:
            if not m.group(2) and not final:
                return _Scan(r, s[: m.start()], [], False)
            found = _pythonic_calls(m.group(1))
            calls = found if found is not None else [_Call(None, None, m.group(1), error="not a list of calls")]
            content = s[: m.start()] + s[m.end() :]
        else:
            found = _pythonic_calls(s) if final else None
            if found is not None:
                calls, content = found, ""
            elif not final and s.lstrip().startswith("["):
                return _Scan(r, "", [], False)
            else:
                content = s
    elif fmt == "llama3_json":
        s = rest.strip()
        if not final and (s.startswith("{") or s.startswith("<|python_tag|>") or "<|python_tag|>".startswith(s) and s):
            return _Scan(r, "", [], False)
        found = _llama3_calls(rest) if final else None
        if found is not None:
            calls, content = found, ""
        elif "<|python_tag|>" in rest:
            i = rest.find("<|python_tag|>")
            content = rest[:i]
            body = rest[i + len("<|python_tag|>") :]
            calls = [_Call(None, None, body.strip(), error="cannot read the <|python_tag|> call")]
        else:
            content = rest
    elif fmt == "generic":
        s = rest.strip()
        if not final and (s.startswith("{") or s.startswith("`")):
            return _Scan(r, "", [], False)
        found = _generic_calls(rest) if final else None
        if found is not None:
            calls, content = found
        else:
            content = rest
    else:  # content
        content = rest
    settled = settled_at >= len(rest) and all(c.complete for c in calls)
    return _Scan(r, content, calls, settled)


def _finish_calls(calls: list[_Call], ids: list[str] | None = None) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    good: list[ToolCall] = []
    bad: list[InvalidToolCall] = []
    for n, c in enumerate(calls):
        cid = ids[n] if ids is not None and n < len(ids) else (c.id or new_call_id())
        if c.error is None and c.name and c.args is not None:
            good.append(tool_call(name=c.name, args=c.args, id=cid))
        else:
            bad.append(invalid_tool_call(name=c.name, args=c.raw, id=cid, error=c.error or "malformed tool call"))
    return good, bad


def _check_fmt(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; use one of {', '.join(FORMATS)}")


def parse(text: str, fmt: str, *, reasoning: bool | None = None, think_open: bool = False) -> ParsedOutput:
    """Split a finished generation into content, reasoning and tool calls (never raises)."""
    _check_fmt(fmt)
    try:
        sc = _scan(text, fmt, reasoning, think_open, final=True)
    except Exception:  # defensive: model output must never crash a request
        return ParsedOutput(content=text.strip())
    good, bad = _finish_calls(sc.calls)
    return ParsedOutput(
        content=sc.content.strip(),
        reasoning=sc.reasoning.strip() if sc.reasoning is not None else None,
        tool_calls=good,
        invalid_tool_calls=bad,
    )


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that could start one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


class StreamParser:
    """Incremental :func:`parse`: feed text deltas, get content/reasoning/tool-call deltas.

    The aggregate of the deltas equals ``parse(all_text)``: content and reasoning
    texts concatenate to the parsed ones, each call's argument fragments join to
    its JSON arguments, and the call ids are the same as in :attr:`result`.
    """

    def __init__(
        self,
        fmt: str,
        *,
        reasoning: bool | None = None,
        think_open: bool = False,
        id_prefix: str = "call_",
    ) -> None:
        _check_fmt(fmt)
        self.fmt = fmt
        self.reasoning = reasoning
        self.think_open = think_open
        self.id_prefix = id_prefix
        self._buf = ""
        self._sent_content = 0
        self._sent_reasoning = 0
        self._calls_named = 0  # calls whose name delta was sent
        self._calls_done = 0  # calls whose arguments were sent
        self._ids: list[str] = []
        self._result: ParsedOutput | None = None
        self._markers = (*START_MARKERS.get(fmt, ()), *THINK)

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
        self._buf += delta
        try:
            sc = _scan(self._buf, self.fmt, self.reasoning, self.think_open, final=False)
        except Exception:
            return []
        return self._emit(sc, final=False)

    def _emit(self, sc: _Scan, final: bool) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        if sc.reasoning is not None:
            text = sc.reasoning.lstrip()
            if final:
                keep = len(text.rstrip())
            else:
                keep = len(text) - _held_suffix(text, ("</think>", "<|END_THINKING|>", *self._markers))
                keep = len(text[:keep].rstrip())
            if keep > self._sent_reasoning:
                out.append(StreamDelta("reasoning", text[self._sent_reasoning : keep]))
                self._sent_reasoning = keep
        content = sc.content.lstrip()
        if final:
            keep = len(content.rstrip())
        else:
            keep = len(content) - _held_suffix(content, self._markers)
            keep = min(keep, len(content[:keep].rstrip()))
            if self.fmt in _WHOLE_OUTPUT and not sc.settled:
                keep = min(keep, self._sent_content)
        if keep > self._sent_content:
            out.append(StreamDelta("content", content[self._sent_content : keep]))
            self._sent_content = keep
        for n, c in enumerate(sc.calls):
            if n >= self._calls_named and c.name:
                out.append(StreamDelta("tool_call", index=n, id=self._id(n, c.id), name=c.name))
                self._calls_named = n + 1
            if n >= self._calls_done and (c.complete or final):
                if n >= self._calls_named:  # an invalid call without a name
                    out.append(StreamDelta("tool_call", index=n, id=self._id(n, c.id), name=c.name))
                    self._calls_named = n + 1
                args = json.dumps(c.args, ensure_ascii=False) if c.error is None and c.args is not None else c.raw
                out.append(StreamDelta("tool_call", index=n, args=args))
                self._calls_done = n + 1
        return out

    def finish(self) -> list[StreamDelta]:
        try:
            sc = _scan(self._buf, self.fmt, self.reasoning, self.think_open, final=True)
        except Exception:
            sc = _Scan(None, self._buf, [], True)
        out = self._emit(sc, final=True)
        ids = [self._id(n, c.id) for n, c in enumerate(sc.calls)]
        good, bad = _finish_calls(sc.calls, ids)
        self._result = ParsedOutput(
            content=sc.content.strip(),
            reasoning=sc.reasoning.strip() if sc.reasoning is not None else None,
            tool_calls=good,
            invalid_tool_calls=bad,
        )
        return out
