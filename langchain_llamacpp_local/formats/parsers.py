"""The parse loop: reasoning split and per-format tool-call scanning.

:func:`parse` reads a whole generation; :class:`~.stream_parser.StreamParser` reads one
as it is generated with the same scans (:func:`scan`, :func:`scan_rest`,
:func:`scan_think`), and its result is :func:`parse`'s. Each format's record (:mod:`.registry`) says how to read
it: a :class:`~.families.Spec` (markers + body readers from :mod:`.families`) read by
the region scanner, a classic :class:`~.classic.Reader`, or a message scanner
(:mod:`.messages`); ``auto`` by the template analysis. Anything malformed becomes an
``invalid_tool_calls`` entry with the raw text and a reason, never an exception.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from langchain_core.messages.tool import InvalidToolCall, ToolCall, invalid_tool_call, tool_call

from langchain_llamacpp_local.formats.auto.parser import parse_with_analysis
from langchain_llamacpp_local.formats.base import (
    THINK,
    OpenRegion,
    Options,
    ParseContext,
    ParsedCall,
    RegionScan,
    checked,
    held_suffix,
    invalid_args,
    scan_multi,
    think_body_start,
)
from langchain_llamacpp_local.formats.classic import CONTENT, Reader
from langchain_llamacpp_local.formats.families import Spec
from langchain_llamacpp_local.formats.registry import FAMILIES

if TYPE_CHECKING:
    from langchain_llamacpp_local.formats.auto.analyzer import TemplateAnalysis

logger = logging.getLogger(__name__)

#: Every format :func:`parse` reads: the families' records, and ``auto`` (learned from the
#: template by :mod:`.auto`, needs ``analysis=``).
FORMATS: tuple[str, ...] = (*FAMILIES, "auto")


@dataclass
class ParsedOutput:
    """A generation split into its parts."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------- core parse


@dataclass
class _Reasoning:
    text: str | None  # extracted reasoning (None: none, or not extracting)
    raw: str  # the think block as written (with the prompt's opening marker)
    rest: str  # what follows the think block
    done: bool  # the block is closed (or there is none)
    held: bool = False  # a half-written opening marker (streaming)
    stopped: bool = False  # ended by a call written inside it, not by its end marker


def spec_of(fmt: str) -> Spec | None:
    """The format's markers and body readers (None: the classic formats, read here)."""
    family = FAMILIES.get(fmt)
    return family.spec if family is not None else None


def think_markers(fmt: str) -> tuple[str, str] | None:
    """The think block's opening and closing markers of ``fmt`` (None: it has none)."""
    spec = spec_of(fmt)
    return spec.think if spec is not None else THINK


def _split_reasoning(text: str, fmt: str, opts: Options, final: bool) -> _Reasoning:
    """The leading think block (opened by the model or already by the prompt)."""
    markers = think_markers(fmt)
    if markers is None:
        return _Reasoning(None, "", text, True)
    start, end = markers
    spec = spec_of(fmt)
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
            settled_body = body[: len(body) - held_suffix(body, stops)]
            if raw_open and len(stops) > 1:
                # ended by a call, the block leaves out the prompt's opener: not yet known
                return _Reasoning(None, "", rest, done)
        return _Reasoning(None, raw if settled_body.strip() or not opened else "", rest, done)
    if lead and opened:
        body = lead + body
    return _Reasoning(body if body.strip() else None, raw, rest, done, stopped=done and not end_len)


def _scan_spec(
    rest: str, fmt: str, opts: Options, final: bool, found_open: list[OpenRegion] | None = None
) -> tuple[str, list[ParsedCall], bool, bool]:
    """(content, calls, settled, whether the content's end is held back while streaming);
    ``found_open`` collects the call region the text ends inside."""
    spec = FAMILIES[fmt].spec
    assert spec is not None
    calls: list[ParsedCall] = []
    if opts.calls and spec.code_tag and spec.code_tag in rest:
        i = rest.index(spec.code_tag)
        code = rest[i + len(spec.code_tag) :]
        rest = rest[:i]
        calls.append(ParsedCall("python", {"code": code}, code, complete=final))
    # no tools bound: call markup is content, only turn and channel markup goes
    regions = spec.regions if opts.calls else ()
    strip = (*spec.strip, *spec.section) if opts.calls else spec.strip
    pieces, found, settled_at = scan_multi(rest, regions, opts, final, found_open)
    content = "".join(pieces)
    trimmed = False
    if not final and strip:
        # a stripped marker may be the start of a longer one: settle only what cannot grow
        held = held_suffix(content, strip)
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


def _scan_auto(
    text: str, opts: Options, final: bool, analysis: TemplateAnalysis, rest: bool = False
) -> RegionScan:
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
    sc = RegionScan(out.reasoning, content, out.calls, out.settled)
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


def scan(
    text: str, fmt: str, opts: Options, final: bool, analysis: TemplateAnalysis | None = None
) -> RegionScan:
    """The whole generation so far (or at its end) split into its parts."""
    if fmt == "auto":
        if analysis is None:
            raise ValueError("format 'auto' needs the template's analysis (analysis=...)")
        return _scan_auto(text, opts, final, analysis)
    family = FAMILIES[fmt]
    if family.scanner is not None:
        return family.scanner(text, family.spec, opts, final, False)
    r = _split_reasoning(text, fmt, opts, final)
    if r.held:
        return RegionScan(None, "", [], False)
    prefix = r.raw if opts.reasoning is None else ""
    if not r.done:
        # inside the think block: a stream reads on from here once what it holds is known
        # to be reasoning (or, kept as text, content)
        stage = "think" if opts.reasoning is not None or prefix else ""
        return RegionScan(r.text, prefix, [], final, stage=stage)
    reasoning = r.text
    end = (think_markers(fmt) or ("", ""))[1]
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
        spec = spec_of(fmt)
        if spec is not None and spec.rethinks and "<think>" in content:
            content, more, open_block = _later_thoughts(content, final)
            reasoning = "\n".join(t for t in (reasoning, *more) if t) or reasoning
            settled = settled and not open_block
        return RegionScan(
            reasoning, prefix + content, calls, settled and all(c.complete for c in calls)
        )
    sc = scan_rest(r.rest, fmt, opts, final, ParseContext())
    if sc.reasoning is not None:  # thoughts between calls (GLM)
        sc.reasoning = "\n".join(t for t in (reasoning, sc.reasoning) if t) or reasoning
    else:
        sc.reasoning = reasoning
    sc.content = prefix + sc.content
    if not text.strip():
        sc.stage = ""  # a think block may still open after the whitespace
    return sc


def scan_rest(
    rest: str,
    fmt: str,
    opts: Options,
    final: bool,
    ctx: ParseContext,
    analysis: TemplateAnalysis | None = None,
) -> RegionScan:
    """What follows the reasoning block (all of it, or from a settled point on: ``ctx``).

    The scan's ``reasoning`` is that of the think blocks inside the content (GLM), or None.
    """
    if fmt == "auto":
        assert analysis is not None
        return _scan_auto(rest, opts, final, analysis, rest=True)
    family = FAMILIES[fmt]
    if family.scanner is not None:
        return family.scanner(rest, family.spec, opts, final, True)
    spec = spec_of(fmt)
    if spec is None:
        reader = reader_of(fmt)
        sc = (reader.read if opts.calls else reader.plain)(rest, opts, final, ctx)
        sc.rest_blank = not sc.content.strip()
        sc.settled = sc.settled and all(c.complete for c in sc.calls)
        return sc
    found_open: list[OpenRegion] = []
    content, calls, settled, trimmed = _scan_spec(rest, fmt, opts, final, found_open)
    rest_blank = not content.strip()
    more: str | None = None
    region = not settled
    if spec.rethinks and opts.reasoning is not None and "<think>" in content:
        content, thoughts, open_block = _later_thoughts(content, final)
        more = "\n".join(t for t in thoughts if t) or None
        settled = settled and not open_block
        region = region and not open_block
    return RegionScan(
        more,
        content,
        calls,
        settled and all(c.complete for c in calls),
        stage="rest",
        open=region,
        rest_blank=rest_blank,
        trimmed=trimmed,
        open_region=found_open[-1] if found_open else None,
    )


def reader_of(fmt: str) -> Reader:
    """The classic reader of ``fmt`` (a format without a :class:`~.families.Spec`)."""
    family = FAMILIES.get(fmt)
    return family.reader if family is not None and family.reader is not None else CONTENT


def scan_think(text: str, fmt: str, opts: Options) -> RegionScan:
    """A stream's text from a point inside the think block on (streaming only)."""
    end = (think_markers(fmt) or ("", ""))[1]
    spec = spec_of(fmt)
    j = text.find(end) if end else -1
    end_len = len(end)
    for stop in spec.think_stops if spec is not None else ():
        k = text.find(stop)
        if k >= 0 and (j < 0 or k < j):
            j, end_len = k, 0
    if j < 0:
        if opts.reasoning is None:
            return RegionScan(None, text, [], False, stage="think")
        return RegionScan(text, "", [], False, stage="think")
    if end_len == 0:
        return RegionScan(None, "", [], False)  # ended by a call: read from the start again
    sc = scan_rest(text[j + end_len :], fmt, opts, False, ParseContext())
    if opts.reasoning is None:
        sc.content = text[: j + end_len] + sc.content
    else:
        body = text[:j]
        sc.reasoning = body + "\n" + sc.reasoning if sc.reasoning is not None else body
    return sc


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


# --------------------------------------------------------------------------- public API


def finish_calls(
    calls: list[ParsedCall], ids: list[str] | None = None
) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    """Parsed calls as LangChain's valid and invalid tool calls (``ids``: the ones a
    stream already sent, else each call's own or a new one)."""
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


def canonical_json(value: Any) -> str:
    """``value`` as JSON with sorted keys: equal values, equal text."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def check_format(fmt: str, analysis: TemplateAnalysis | None = None) -> None:
    """Refuse an unknown format, or ``auto`` without its template analysis."""
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
    check_format(fmt, analysis)
    opts = Options.make(reasoning, think_open, tools, prefill)
    try:
        sc = scan(text, fmt, opts, final=not partial, analysis=analysis)
    except Exception:  # defensive: model output must never crash a request
        logger.exception("tool-call parser failed on model output; returning it as content")
        return ParsedOutput(content=text.strip())
    calls = sc.calls
    if partial:  # a call still being written is reported once its name is known
        calls = [c for c in calls if c.complete or c.name]
        for c in calls:
            if not c.complete:
                c.error = c.error or "tool call still being written"
    good, bad = finish_calls(calls)
    return ParsedOutput(
        content=sc.content.strip(),
        reasoning=sc.reasoning.strip() if sc.reasoning is not None else None,
        tool_calls=good,
        invalid_tool_calls=bad,
    )
