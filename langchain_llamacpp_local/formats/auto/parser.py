"""Parsing model output with a learned :class:`TemplateAnalysis`.

The Python counterpart of the parsers llama.cpp's ``chat-auto-parser-generator.cpp``
builds from an analysis: reasoning, content wrappers and the three tool-call
layouts (whole JSON, tag + JSON arguments, tag + tagged arguments), one-shot or
on a stream so far. Never raises on model output.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_llamacpp_local.formats.auto.call_scanner import (
    bare_call_prefix,
    flex,
    get_path,
    scan_tagged,
)
from langchain_llamacpp_local.formats.auto.probes import TemplateAnalysis
from langchain_llamacpp_local.formats.base import (
    ParsedCall,
    held_suffix,
    json_arguments,
    think_body_start,
)

logger = logging.getLogger(__name__)

# =========================================================================== the parser


@dataclass
class AnalysisParse:
    """A generation (or the stream so far) split with a :class:`TemplateAnalysis`.

    ``held``/``reasoning_held``: trailing characters of ``content``/``reasoning``
    that may be a half-written marker and must not be streamed yet. ``settled``
    is False while the tail is an unfinished call or reasoning block.
    """

    content: str
    reasoning: str | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    held: int = 0
    reasoning_held: int = 0
    settled: bool = True


def _json_call(a: TemplateAnalysis, obj: Any, raw: str) -> list[ParsedCall]:
    """Calls from one decoded JSON value of a JSON_NATIVE template."""
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for o in items:
        r = json.dumps(o, ensure_ascii=False) if isinstance(obj, list) else raw
        if not isinstance(o, dict):
            out.append(ParsedCall(None, None, r, error="tool call is not a JSON object"))
            continue
        if a.fun_name_is_key:
            if len(o) == 1:
                ((name, args_val),) = o.items()
                args = json_arguments(args_val)
                out.append(
                    ParsedCall(
                        name,
                        args,
                        r,
                        error=None if args is not None else "arguments are not a JSON object",
                    )
                )
            else:
                out.append(ParsedCall(None, None, r, error="expected one {name: arguments} pair"))
            continue
        name_field, args_field = a.name_field, a.args_field
        if a.function_field and a.function_field != "function" and "." not in name_field:
            name_field, args_field = (
                f"{a.function_field}.{name_field}",
                f"{a.function_field}.{args_field}",
            )
        name = get_path(o, name_field)
        args_val = get_path(o, args_field)
        if name is None:  # the usual spellings, for models that drift from their template
            src = o.get("function") if isinstance(o.get("function"), dict) else o
            name = src.get("name")
            args_val = next((src[k] for k in ("arguments", "parameters") if k in src), None)
        cid = get_path(o, a.id_field) if a.id_field else None
        if cid is None and a.gen_id_field:
            cid = get_path(o, a.gen_id_field)
        if not isinstance(name, str) or not name:
            out.append(ParsedCall(None, None, r, error="tool call has no name"))
            continue
        args = json_arguments(args_val)
        err = None if args is not None else "arguments are not a JSON object"
        out.append(ParsedCall(name, args, r, id=str(cid) if cid is not None else None, error=err))
    return out


def _scan_json_native(
    a: TemplateAnalysis, text: str, final: bool
) -> tuple[list[ParsedCall], int, bool]:
    """(calls, end of the tool region, complete) for JSON calls starting at 0."""
    calls: list[ParsedCall] = []
    pos = 0
    dec = json.JSONDecoder()
    sec_s, sec_e = flex(a.section_start), flex(a.section_end)
    call_s, call_e = flex(a.per_call_start), flex(a.per_call_end)

    def ws(p: int) -> int:
        while p < len(text) and (text[p].isspace() or text[p] in ",;"):
            p += 1
        return p

    if sec_s:
        m = re.compile(sec_s).match(text, ws(pos))
        if not m:
            return calls, 0, True
        pos = m.end()
    while True:
        p = ws(pos)
        if call_s:
            m = re.compile(call_s).match(text, p)
            if not m:
                if not final and a.per_call_start.strip().startswith(text[p:]) and p < len(text):
                    return calls, pos, False
                break
            p = ws(m.end())
        if p >= len(text):
            if not final:  # the stream ends inside the tool region: more may come
                return calls, pos, False
            if call_s and final and p > pos:
                calls.append(
                    ParsedCall(None, None, text[pos:].strip(), error="unterminated tool call")
                )
                return calls, len(text), True
            break
        if text[p] not in "{[":
            if call_s and p > pos:
                calls.append(
                    ParsedCall(None, None, text[p:].strip(), error="tool call is not JSON")
                )
                return calls, len(text), True
            break
        try:
            obj, end = dec.raw_decode(text, p)
        except ValueError:
            if not final:
                return calls, pos, False
            raw = text[p:]
            stop = re.compile(call_e or sec_e).search(raw) if (call_e or sec_e) else None
            raw = raw[: stop.start()] if stop else raw
            calls.append(ParsedCall(None, None, raw.strip(), error="invalid JSON in tool call"))
            return calls, len(text), True
        calls.extend(_json_call(a, obj, text[p:end]))
        pos = end
        if call_e:
            m = re.compile(call_e).match(text, ws(pos))
            if m:
                pos = m.end()
            elif ws(pos) >= len(text):
                if not final:
                    return calls, pos, False
                for c in calls[-1:]:
                    c.error = c.error or f"unterminated tool call (no {a.per_call_end.strip()})"
                    c.args = None if c.error else c.args
                return calls, len(text), True
        if not call_s and not a.tools_array_wrapped:
            # bare JSON calls: keep reading while another object follows
            q = ws(pos)
            if q >= len(text) or text[q] != "{":
                break
    if sec_e:
        m = re.compile(sec_e).match(text, ws(pos))
        if m:
            pos = m.end()
        elif ws(pos) >= len(text) and not final:
            return calls, pos, False
    return calls, pos, True


def _tool_start(a: TemplateAnalysis, text: str, start: int = 0) -> int:
    """Where a tool-call region starts in ``text`` (-1 if nowhere)."""
    if a.tool_format == "none":
        return -1
    pats = [p for p in (flex(a.trigger), flex(bare_call_prefix(a))) if p]
    if not pats:
        return -1
    m = re.compile("|".join(f"(?:{p})" for p in pats)).search(text, start)
    return m.start() if m else -1


def _split_reasoning(
    text: str, a: TemplateAnalysis, reasoning: bool | None, think_open: bool, final: bool
) -> tuple[str | None, str, bool]:
    """(reasoning, rest, finished) for the reasoning block at the start of the output."""
    start, end = a.reasoning_start.strip(), a.reasoning_end.strip()
    if reasoning is None or a.reasoning_mode == "none" or not end:
        return None, text, True
    # a prompt that opened the block, said or not
    found = think_body_start(text, start, think_open or text.lstrip().startswith(end), final)
    if found == -1:
        return "", "", False  # a half-written opening marker
    if found is not None:
        body = found
    elif start:
        return None, text, True
    else:  # delimiter style: reasoning is everything before the end marker
        j = text.find(end)
        if j >= 0:
            return text[:j], text[j + len(end) :], True
        if final:
            return None, text, True
        return None, "", False
    j = text.find(end, body)
    if j >= 0:
        return text[body:j], text[j + len(end) :], True
    # Unterminated: a model may call a tool straight from its thoughts. Until the
    # end marker shows up (it may: a call can be quoted in the thoughts), a call
    # there is held back; at the end it is a call.
    k = _tool_start(a, text, body)
    if k >= 0:
        if final:
            return text[body:k], text[k:], True
        return text[body:k], "", False
    return text[body:], "", False


def _strip_content_markers(text: str, a: TemplateAnalysis) -> str:
    for m in (a.content_start, a.content_end):
        if m.strip():
            text = text.replace(m.strip(), "")
    return text


def _parse(
    text: str,
    a: TemplateAnalysis,
    final: bool,
    reasoning: bool | None,
    think_open: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    read_calls: bool = True,
) -> AnalysisParse:
    r, rest, r_done = _split_reasoning(text, a, reasoning, think_open, final)
    markers = a.markers
    r_held = 0
    if r is not None and not r_done and not final:
        # the end marker, or a call the model writes straight from its thoughts
        r_held = held_suffix(
            r, [m for m in (a.reasoning_end.strip(), a.trigger, bare_call_prefix(a)) if m]
        )
    if not r_done and not final:
        return AnalysisParse("", r, [], 0, r_held, settled=False)
    if r is not None and not r.strip() and r_done:
        r = None if not r else ""  # an empty think block (e.g. prefilled ``<think></think>``)
    calls: list[ParsedCall] = []
    trigger = a.trigger
    settled = True
    content = rest
    if a.tool_format != "none" and read_calls:
        if trigger or bare_call_prefix(a):
            i = _tool_start(a, rest)
        else:
            opener = "[" if a.tools_array_wrapped else "{"
            i = rest.find(opener)
        if i >= 0:
            region = rest[i:]
            if a.tool_format == "json":
                if not trigger and not final:
                    calls, end, complete = [], 0, False
                else:
                    calls, end, complete = _scan_json_native(a, region, final)
            else:
                calls, end, complete = scan_tagged(a, region, final, tools)
            if not trigger and final and (not calls or any(c.name is None for c in calls)):
                calls, end, complete = [], 0, True  # bare JSON that is not a call: plain content
                content = rest
            elif not complete:
                content = rest[:i]
                settled = False
            elif calls or end > 0:
                content = rest[:i] + region[end:]
            else:
                content = rest
    content = _strip_content_markers(content, a)
    turn_end = a.turn_end.strip()
    if turn_end and content.rstrip().endswith(turn_end):
        content = content.rstrip()[: -len(turn_end)]
    hold = (*markers, trigger, turn_end) if trigger else (*markers, turn_end)
    held = 0 if final else held_suffix(content, [m for m in hold if m])
    return AnalysisParse(content, r, calls, held, r_held, settled)


def parse_with_analysis(
    text: str,
    analysis: TemplateAnalysis,
    *,
    final: bool,
    reasoning: bool | None,
    think_open: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    generation_prompt: str | None = None,
    calls: bool = True,
) -> AnalysisParse:
    """Split model output into content, reasoning and tool calls with a learned format.

    ``final=False`` parses a stream so far: an unfinished call or reasoning block
    makes ``settled`` False and is left out of ``content``; ``held`` trailing
    characters of ``content`` may be a half-written marker. ``reasoning=None``
    leaves think blocks in the content; otherwise a leading block is returned as
    reasoning (also when thinking was disabled but the model thought anyway, as
    llama.cpp does). ``think_open``: the prompt already opened the block; or pass
    the ``generation_prompt`` (what the template appended for
    ``add_generation_prompt``) and the parser sees what llama.cpp's does: the
    reasoning block it opened, boilerplate included, is parsed with the output.
    ``tools`` (OpenAI tool dicts) make tagged values schema-typed: a ``string``
    parameter stays a string. ``calls=False`` (no tools bound) reads no calls: their
    markup stays in the content. Never raises.
    """
    try:
        if generation_prompt is not None:
            prefill = analysis.reasoning_prefill(generation_prompt)
        elif think_open and analysis.reasoning_mode != "none":
            prefill = analysis.reasoning_start
        else:
            prefill = ""
        if prefill.strip():
            text, think_open = prefill + text, False
        return _parse(text, analysis, final, reasoning, think_open, tools, calls)
    except Exception:  # defensive: model output must never crash a request
        logger.exception("analysis-driven parse failed; returning the text as content")
        return AnalysisParse(text, None, [], 0, 0, final)
