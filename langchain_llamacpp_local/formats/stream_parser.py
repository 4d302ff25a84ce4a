"""The incremental parse: :class:`StreamParser` reads a generation as it is generated.

It does the same work per token however long the generation grows (it reads only the
text since its last settled point and an open call only where it may end, with the
scans of :mod:`.parsers`), and emits only what can no longer change: a half-written
marker, an unfinished call or a header still being written is held back. What it sends
adds up to :func:`~.parsers.parse` of the whole text.
"""

from __future__ import annotations

import copy
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from langchain_core.messages.tool import InvalidToolCall, ToolCall, invalid_tool_call

from langchain_llamacpp_local.formats.arg_stream import Fragment, Tracked, spoiler
from langchain_llamacpp_local.formats.base import (
    THINK,
    Options,
    ParseContext,
    ParsedCall,
    RegionScan,
    checked,
    held_suffix,
    invalid_args,
)
from langchain_llamacpp_local.formats.parsers import (
    ParsedOutput,
    canonical_json,
    check_format,
    finish_calls,
    reader_of,
    scan,
    scan_rest,
    scan_think,
    spec_of,
    think_markers,
)
from langchain_llamacpp_local.formats.registry import FAMILIES
from langchain_llamacpp_local.formats.syntax import stream_for

if TYPE_CHECKING:
    from langchain_llamacpp_local.formats.auto.analyzer import TemplateAnalysis

logger = logging.getLogger(__name__)


class DeltaKind(str, Enum):
    """What a streamed piece carries. A ``str`` enum, so the piece's kind prints and
    serialises as the word it names."""

    CONTENT = "content"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"


@dataclass
class StreamDelta:
    """One streamed piece: content or reasoning text, or a tool-call chunk."""

    kind: DeltaKind
    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    args: str = ""
    #: the log-probabilities of the tokens sampled since the previous piece (set by
    #: the worker when the request asks for them)
    logprobs: list[dict[str, Any]] | None = None


def stream_markers(fmt: str) -> tuple[str, ...]:
    spec = spec_of(fmt)
    out = list(FAMILIES[fmt].markers)
    if spec is not None:
        out += (
            [r[0] for r in spec.regions] + list(spec.strip) + list(spec.section) + list(spec.held)
        )
        if spec.think is not None:
            out += [m for m in spec.think if m]
    else:
        out += list(THINK)
        out += reader_of(fmt).held
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
            out += reader_of(fmt).markers
    return tuple(dict.fromkeys(m for m in out if m))


def _region_wake(fmt: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """What may change how an open call region of ``fmt`` reads: the regions' ends and
    the markers that complete a call inside them (a body reader that names none is
    read again at every character that may end a marker)."""
    family = FAMILIES.get(fmt)
    regions: tuple[tuple[str, str | None, Any], ...] = ()
    if family is not None and family.spec is not None:
        regions = family.spec.regions
    wake = reader_of(fmt).wake if family is None or family.spec is None else ()
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

    def send(self, keep: int, kind: DeltaKind) -> list[StreamDelta]:
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
        check_format(fmt, analysis)
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
        think = think_markers(fmt) if fmt not in ("gpt_oss", "auto") else None
        self._think_end = tuple(m for m in (think or ()) if m)
        if analysis is not None:
            a = analysis
            learned = (a.trigger, a.turn_end, a.reasoning_start, a.reasoning_end, a.content_start)
            self._restart = tuple(m for m in (*a.markers, *(x.strip() for x in learned)) if m)
        else:
            self._restart = _restart_markers(fmt)
        self._replay = ""  # what the text since the settled point is read after
        spec = spec_of(fmt) if analysis is None else None
        self._rethinks = spec is not None and spec.rethinks
        #: a call may be the whole output: content waits until it is known not to be one
        self._whole = analysis is None and spec_of(fmt) is None and reader_of(fmt).whole_output
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
                sc = scan(text, self.fmt, self._opts, final=False, analysis=self._analysis)
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
            sc = scan(tail, self.fmt, self._opts, final=False, analysis=self._analysis)
        elif self._state == "think":
            sc = scan_think(tail, self.fmt, self._opts)
            if not sc.stage:  # ended by a call: read as a whole from now on
                self._state = "full"
                text = "".join(self._parts)
                sc = scan(text, self.fmt, self._opts, final=False, analysis=self._analysis)
                return self._emit(sc, final=False)
        else:
            text = self._replay + tail
            sc = scan_rest(text, self.fmt, self._opts, False, self._ctx, self._analysis)
        out: list[StreamDelta] = []
        thought = sc.reasoning
        if self._rethinks and self._state == "rest" and thought and self._thought_any:
            thought = "\n" + thought  # thoughts between calls join the earlier ones
        if thought is not None or self._thought.pending:
            text = self._thought.read(thought or "")
            keep = len(text) - held_suffix(text, (*self._think_end, *self.stream_markers))
            out += self._thought.send(len(text[:keep].rstrip()), DeltaKind.REASONING)
        text = self._content.read(sc.content)
        keep = len(text) - held_suffix(text, self.stream_markers)
        keep = min(keep, len(text[:keep].rstrip()))
        if self._whole and not sc.settled:
            keep = min(keep, self._content.epoch)
        out += self._content.send(keep, DeltaKind.CONTENT)
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
        made = stream_for(region, self._opts)
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
                out.append(
                    StreamDelta(DeltaKind.TOOL_CALL, index=n, id=cid, name=f.name, args=f.args)
                )
            elif n in self._streamed and n >= self._calls_done:
                self._streamed[n].append(f.args)
                out.append(StreamDelta(DeltaKind.TOOL_CALL, index=n, args=f.args))
        return out

    def _seal(self, n: int, c: ParsedCall) -> list[StreamDelta]:
        """A streamed call is complete: nothing to add when what was sent reads as its
        arguments, else the fragment that makes the merged arguments unreadable."""
        sent = "".join(self._streamed[n])
        valid = c.error is None and c.name and c.args is not None
        if valid and c.name == self._stream_names[n]:
            try:  # (compared as JSON text: 1 == 1.0 == True in Python)
                if canonical_json(json.loads(sent)) == canonical_json(c.args):
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
        return [StreamDelta(DeltaKind.TOOL_CALL, index=n, args=tail)]

    def _streamed_result(
        self, calls: list[ParsedCall], ids: list[str]
    ) -> tuple[list[ToolCall], list[InvalidToolCall]]:
        """The final calls as the merged stream reads them: a streamed call that ended
        invalid keeps the arguments it was streamed with (and is invalid even where the
        parse reads the call otherwise)."""
        good: list[ToolCall] = []
        bad: list[InvalidToolCall] = []
        for n, c in enumerate(calls):
            g, b = finish_calls([c], [ids[n]])
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
                StreamDelta(
                    DeltaKind.TOOL_CALL, index=n, id=self._id(n, c.id), name=c.name, args=args
                )
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
                out.append(StreamDelta(DeltaKind.REASONING, text[sent:keep]))
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
            out.append(StreamDelta(DeltaKind.CONTENT, content[sent:keep]))
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
            sc = scan(text, self.fmt, self._opts, final=True, analysis=self._analysis)
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
            good, bad = finish_calls(sc.calls, ids)
        self._result = ParsedOutput(
            content=sc.content.strip(),
            reasoning=sc.reasoning.strip() if sc.reasoning is not None else None,
            tool_calls=good,
            invalid_tool_calls=bad,
        )
        return out
