"""The parse loop: reasoning split, per-format tool-call scanning, streaming.

:func:`parse` reads a whole generation; :class:`StreamParser` reads one as it is
generated, with the same work per token however long it grows (it reads only the text
since its last settled point and an open call only where it may end), and emits only
what can no longer change: a half-written marker, an unfinished call or a header still
being written is held back. Each format's record (:mod:`.registry`) says how to read
it: a :class:`~.families.Spec` (markers + body readers from :mod:`.families`) read by
the region scanner, a classic :class:`~.classic.Reader`, or a message scanner
(:mod:`.messages`); ``auto`` by the template analysis. Anything malformed becomes an
``invalid_tool_calls`` entry with the raw text and a reason, never an exception.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages.tool import InvalidToolCall, ToolCall, invalid_tool_call, tool_call

from langchain_llamacpp_local.formats.arg_stream import Fragment, Tracked, arg_stream, spoiler
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


# --------------------------------------------------------------------------- core parse


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


def _scan(
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
        spec = _spec(fmt)
        if spec is not None and spec.rethinks and "<think>" in content:
            content, more, open_block = _later_thoughts(content, final)
            reasoning = "\n".join(t for t in (reasoning, *more) if t) or reasoning
            settled = settled and not open_block
        return RegionScan(
            reasoning, prefix + content, calls, settled and all(c.complete for c in calls)
        )
    sc = _scan_rest(r.rest, fmt, opts, final, ParseContext())
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
    spec = _spec(fmt)
    if spec is None:
        reader = _reader(fmt)
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


def _reader(fmt: str) -> Reader:
    family = FAMILIES.get(fmt)
    return family.reader if family is not None and family.reader is not None else CONTENT


def _scan_think(text: str, fmt: str, opts: Options) -> RegionScan:
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
            return RegionScan(None, text, [], False, stage="think")
        return RegionScan(text, "", [], False, stage="think")
    if end_len == 0:
        return RegionScan(None, "", [], False)  # ended by a call: read from the start again
    sc = _scan_rest(text[j + end_len :], fmt, opts, False, ParseContext())
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


def _finish_calls(
    calls: list[ParsedCall], ids: list[str] | None = None
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


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


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


def stream_markers(fmt: str) -> tuple[str, ...]:
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
        out += _reader(fmt).held
    return tuple(dict.fromkeys(m for m in out if m))


#: Characters that end the markers inside a call region (``</function>``, ``[ARGS]``,
#: ``<｜tool▁call▁end｜>``): an open region is read again only when one is written.
_REGION_ENDS = frozenset(">]")


def _restart_markers(fmt: str) -> tuple[str, ...]:
    """Every string a scan of ``fmt`` looks for outside a call region: a stream settles
    its text only where none of them may be half-written."""
    family = FAMILIES.get(fmt)
    out = [*stream_markers(fmt), *THINK]
    if family is not None:
        out += family.markers
        spec = family.spec
        if spec is not None:
            for start, end, _ in spec.regions:
                out += [start, end or ""]
            out += [*spec.strip, *spec.section, *spec.held, *spec.think_stops]
            out += list(spec.think or ())
        else:
            out += _reader(fmt).markers
    return tuple(dict.fromkeys(m for m in out if m))


def _region_wake(fmt: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """What may change how an open call region of ``fmt`` reads: the regions' ends and
    the markers that complete a call inside them (a body reader that names none is
    read again at every character that may end a marker)."""
    family = FAMILIES.get(fmt)
    regions: tuple[tuple[str, str | None, Any], ...] = ()
    if family is not None and family.spec is not None:
        regions = family.spec.regions
    wake = _reader(fmt).wake if family is None or family.spec is None else ()
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
        stream_args: bool = False,
    ) -> None:
        _check_fmt(fmt, analysis)
        self._analysis = analysis
        #: send argument fragments while a call is written (:mod:`.arg_stream`)
        self.stream_args = stream_args
        self._n = 0  # characters fed
        self._track: Tracked | None = None  # the open call region whose arguments stream
        self._streamed: dict[int, list[str]] = {}  # call index -> argument text sent
        self._stream_names: dict[int, str] = {}
        #: call index -> merged arguments of a streamed call that ended invalid
        self._spoiled: dict[int, str] = {}
        self.fmt = fmt
        self.reasoning = reasoning
        self.think_open = think_open
        self.id_prefix = id_prefix
        self._opts = Options.make(reasoning, think_open, tools, prefill)
        self._parts: list[str] = []  # the whole generation, parsed once more at the end
        self._tail = ""  # the text since the last settled point
        #: how that text is read: "start" (from the beginning), "think" (inside the
        #: think block), "rest" (past it) or "full" (the whole text on every delta)
        self._state = "start"
        self._ctx = ParseContext()
        self._content = _Text()
        self._thought = _Text()
        self._thought_any = False  # the settled reasoning is a non-empty string
        self._calls_base = 0  # calls read before the settled point
        self._calls_done = 0  # calls sent (each in one chunk)
        #: while set, the text is read again only when one of these strings or
        #: characters is written (an open call region, output held to the end)
        self._wait: tuple[tuple[str, ...], frozenset[str]] | None = None
        self._waiting: list[str] = []  # the deltas written while waiting
        self._recent = ""  # the last characters before them (a marker may span the delta)
        self._ids: list[str] = []
        self._result: ParsedOutput | None = None
        self.stream_markers = (
            stream_markers(fmt) if analysis is None else tuple(m for m in analysis.markers if m)
        )
        think = _think_markers(fmt) if fmt not in ("gpt_oss", "auto") else None
        self._think_end = tuple(m for m in (think or ()) if m)
        if analysis is not None:
            a = analysis
            learned = (a.trigger, a.turn_end, a.reasoning_start, a.reasoning_end, a.content_start)
            self._restart = tuple(m for m in (*a.markers, *(x.strip() for x in learned)) if m)
        else:
            self._restart = _restart_markers(fmt)
        self._replay = ""  # what the text since the settled point is read after
        spec = _spec(fmt) if analysis is None else None
        self._rethinks = spec is not None and spec.rethinks
        #: a call may be the whole output: content waits until it is known not to be one
        self._whole = analysis is None and _spec(fmt) is None and _reader(fmt).whole_output
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
        self._n += len(delta)
        if self._track is None:
            return self._read(delta)
        try:  # the open call's arguments first (this delta may also complete the call)
            early = self._args_deltas(self._track.stream.feed(delta))
        except Exception:  # model output must never crash a request: sent whole
            logger.exception("argument stream failed on partial model output")
            self._track, early = None, []
        return early + self._read(delta)

    def _read(self, delta: str) -> list[StreamDelta]:
        if self._wait is not None:
            # the held text is joined only when it is read again (an open call may be long)
            self._waiting.append(delta)
            window = self._recent + delta
            self._recent = window[max(0, len(window) - self._longest + 1) :]
            if not self._woken(window, delta):
                return []
            self._tail += "".join(self._waiting)
            self._waiting = []
        else:
            self._tail += delta
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

    def _woken(self, window: str, delta: str) -> bool:
        """Whether ``delta`` (the end of ``window``) may change what the held text reads as."""
        strings, chars = self._wait  # type: ignore[misc]
        if not chars.isdisjoint(delta):
            return True
        # a marker written now ends in the delta
        first = len(window) - len(delta) + 1
        return any(window.find(m, max(0, first - len(m))) >= 0 for m in strings)

    def _read_tail(self) -> list[StreamDelta]:
        tail = self._tail
        if self._state == "plain":  # the rest of the generation is content, as written
            sc = RegionScan(None, tail, [], True, stage="plain")
        elif self._state == "start":
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
        if self._rethinks and self._state == "rest" and thought and self._thought_any:
            thought = "\n" + thought  # thoughts between calls join the earlier ones
        if thought is not None or self._thought.pending:
            text = self._thought.read(thought or "")
            keep = len(text) - held_suffix(text, (*self._think_end, *self.stream_markers))
            out += self._thought.send(len(text[:keep].rstrip()), "reasoning")
        text = self._content.read(sc.content)
        keep = len(text) - held_suffix(text, self.stream_markers)
        keep = min(keep, len(text[:keep].rstrip()))
        if self._whole and not sc.settled:
            keep = min(keep, self._content.epoch)
        out += self._content.send(keep, "content")
        base = self._calls_base
        out += self._send_calls(sc.calls, base, final=False)
        self._settle(sc)
        if self.stream_args:
            try:
                out += self._follow(sc, base)
            except Exception:  # model output must never crash a request: sent whole
                logger.exception("argument stream failed on partial model output")
                self._track = None
        return out

    # -- arguments streamed as written (stream_args)

    def _follow(self, sc: RegionScan, base: int) -> list[StreamDelta]:
        """Start a stream of arguments over the call region the text now ends inside
        (its text so far read once; later deltas fed as they come)."""
        region = sc.open_region
        if region is None or self._wait is None or region.tail > len(self._tail):
            self._track = None
            return []
        start = self._n - region.tail
        if self._track is not None and self._track.start == start:
            return []  # the same region, read on
        made = arg_stream(region, self._opts)
        if made is None:
            self._track = None
            return []
        stream, prefix = made
        self._track = Tracked(start, base + region.before, stream)
        return self._args_deltas(stream.feed(prefix + self._tail[len(self._tail) - region.tail :]))

    def _args_deltas(self, frags: list[Fragment]) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        assert self._track is not None
        for f in frags:
            n = self._track.base + f.k
            if f.name is not None:
                # a call starts streaming only after every earlier one has been sent or
                # started (merged chunks list calls in the order their indexes first came)
                if n in self._streamed or any(
                    m not in self._streamed for m in range(self._calls_done, n)
                ):
                    continue
                self._streamed[n], self._stream_names[n] = [f.args], f.name
                cid = self._id(n, f.id)
                out.append(StreamDelta("tool_call", index=n, id=cid, name=f.name, args=f.args))
            elif n in self._streamed and n >= self._calls_done:
                self._streamed[n].append(f.args)
                out.append(StreamDelta("tool_call", index=n, args=f.args))
        return out

    def _seal(self, n: int, c: ParsedCall) -> list[StreamDelta]:
        """A streamed call is complete: nothing to add when what was sent reads as its
        arguments, else the fragment that makes the merged arguments unreadable."""
        sent = "".join(self._streamed[n])
        valid = c.error is None and c.name and c.args is not None
        if valid and c.name == self._stream_names[n]:
            try:  # (compared as JSON text: 1 == 1.0 == True in Python)
                if _canonical(json.loads(sent)) == _canonical(c.args):
                    return []
            except (ValueError, TypeError):
                pass
        if valid:
            logger.warning(
                "the streamed arguments of tool call %r read otherwise once complete; "
                "the call is reported invalid",
                c.name,
            )
        tail = spoiler(sent)
        self._streamed[n].append(tail)
        self._spoiled[n] = sent + tail
        return [StreamDelta("tool_call", index=n, args=tail)]

    def _streamed_result(
        self, calls: list[ParsedCall], ids: list[str]
    ) -> tuple[list[ToolCall], list[InvalidToolCall]]:
        """The final calls as the merged stream reads them: a streamed call that ended
        invalid keeps the arguments it was streamed with (and is invalid even where the
        parse reads the call otherwise)."""
        good: list[ToolCall] = []
        bad: list[InvalidToolCall] = []
        for n, c in enumerate(calls):
            g, b = _finish_calls([c], [ids[n]])
            if n in self._spoiled:
                error = b[0]["error"] if b else "read otherwise than its arguments were streamed"
                g, b = (
                    [],
                    [
                        invalid_tool_call(
                            name=self._stream_names[n],
                            args=self._spoiled[n],
                            id=ids[n],
                            error=error,
                        )
                    ],
                )
            good += g
            bad += b
        for n in sorted(k for k in self._spoiled if k >= len(calls)):
            bad.append(
                invalid_tool_call(
                    name=self._stream_names[n],
                    args=self._spoiled[n],
                    id=self._id(n, None),
                    error="streamed as a call the finished output does not hold",
                )
            )
        return good, bad

    def _settle(self, sc: RegionScan) -> None:
        """Forget the text read so far when nothing in it can change any more."""
        n_calls = self._calls_base + len(sc.calls)
        cut = (
            sc.stage == "think"
            or sc.stage in ("rest", "plain")
            and sc.settled
            and not sc.trimmed
            and self._calls_done == n_calls
        )
        cut = (
            cut
            and self._content.settled()
            and self._thought.settled()
            and not held_suffix(self._tail, self._restart)
        )
        if not cut:
            if sc.stage == "rest" and sc.open:
                self._wait = sc.wake or self._region_wake
            elif sc.stage == "rest" and sc.hold is not None:
                self._wait = (sc.hold, frozenset())
            if self._wait is not None:
                self._recent = self._tail[max(0, len(self._tail) - self._longest + 1) :]
            return
        if sc.reasoning:
            self._thought_any = True
        if sc.stage == "rest":
            self._ctx = ParseContext(
                head=self._ctx.head and sc.rest_blank,
                had_calls=self._ctx.had_calls or bool(sc.calls),
            )
        self._state = sc.stage if sc.stage in ("think", "plain") else "rest"
        self._replay = sc.resume
        self._calls_base = n_calls
        self._tail = ""
        self._content.settle()
        self._thought.settle()

    def _send_calls(self, calls: list[ParsedCall], base: int, final: bool) -> list[StreamDelta]:
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
            if n in self._streamed:
                out += self._seal(n, c)
                self._calls_done = n + 1
                continue
            valid = c.error is None and c.name and c.args is not None
            args = json.dumps(c.args, ensure_ascii=False) if valid else invalid_args(c)
            out.append(
                StreamDelta("tool_call", index=n, id=self._id(n, c.id), name=c.name, args=args)
            )
            self._calls_done = n + 1
        return out

    def _emit(self, sc: RegionScan, final: bool) -> list[StreamDelta]:
        """The deltas of a scan of the whole text (its content and reasoning whole)."""
        out: list[StreamDelta] = []
        if sc.reasoning is not None:
            text = sc.reasoning.lstrip()
            if final:
                keep = len(text.rstrip())
            else:
                keep = len(text) - held_suffix(text, (*self._think_end, *self.stream_markers))
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
            keep = len(content) - held_suffix(content, self.stream_markers)
            keep = min(keep, len(content[:keep].rstrip()))
            if self._whole and not sc.settled:
                keep = min(keep, sent)
        if keep > sent:
            out.append(StreamDelta("content", content[sent:keep]))
            self._content.sent = keep
        return out + self._send_calls(sc.calls, 0, final)

    def finish(self) -> list[StreamDelta]:
        """End of generation: settle everything still held back."""
        # its own counters: a copy of a stream may be finished while the stream goes on
        self._content, self._thought = copy.copy(self._content), copy.copy(self._thought)
        self._streamed = {n: list(v) for n, v in self._streamed.items()}
        self._spoiled = dict(self._spoiled)
        text = "".join(self._parts)
        try:
            sc = _scan(text, self.fmt, self._opts, final=True, analysis=self._analysis)
        except Exception:
            logger.exception("tool-call parser failed on model output; returning it as content")
            sc = RegionScan(None, text, [], True)
        try:
            out = self._emit(sc, final=True)
        except Exception:
            logger.exception("tool-call parser failed to emit its result")
            sc, out = RegionScan(None, text, [], True), []
        for n in sorted(self._streamed):
            if n >= max(self._calls_done, len(sc.calls)):  # a call the parse does not hold
                out += self._seal(n, ParsedCall(None, None, "", error="not a call"))
        ids = [self._id(n, c.id) for n, c in enumerate(sc.calls)]
        if self._streamed:
            good, bad = self._streamed_result(sc.calls, ids)
        else:
            good, bad = _finish_calls(sc.calls, ids)
        self._result = ParsedOutput(
            content=sc.content.strip(),
            reasoning=sc.reasoning.strip() if sc.reasoning is not None else None,
            tool_calls=good,
            invalid_tool_calls=bad,
        )
        return out
