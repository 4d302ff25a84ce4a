"""Whole-output scanners of the families whose output is a sequence of addressed messages.

gpt-oss (harmony: ``<|channel|>C to=R<|message|>body<|end|>``) and Muse Glimmer
(``to=R<|message|>body<|eom|>``) have no reasoning block followed by content: each
message says by its header whether it is reasoning, content or a call. The family's
record (:mod:`.registry`) names its scanner. ``scan(text, spec, opts, final, blank)``:
``blank`` keeps reasoning that is only whitespace (a stream reading on from a settled
point needs it).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from langchain_llamacpp_local.formats.base import (
    OpenRegion,
    Options,
    ParsedCall,
    RegionScan,
    loads_lenient,
    scan_multi,
)
from langchain_llamacpp_local.formats.families import Spec
from langchain_llamacpp_local.formats.syntax import NAMED_ARGUMENTS

logger = logging.getLogger(__name__)

Scanner = Callable[[str, "Spec | None", Options, bool, bool], RegionScan]

# --------------------------------------------------------------------------- Muse Glimmer

_MUSE_HEADER = re.compile(r"\s*(?:<\|start\|>assistant)?\s*to=([^\s<]+)\s*<\|message\|>")
_MUSE_END = re.compile(r"<\|eot\|>|<\|eom\|>")


def muse(
    text: str, spec: Spec | None, opts: Options, final: bool, blank: bool = False
) -> RegionScan:
    """Muse Glimmer messages: ``[<|start|>assistant] to=R<|message|>body<|eom|>`` / ``<|eot|>``.

    ``to=self`` is reasoning, ``to=user`` content (call markup quoted in it stays
    text), any other recipient a message whose ``<atem:function_calls>`` are calls (as
    llama.cpp's Muse parser reads them). The generation prompt ends with
    ``<|start|>assistant``, so the output starts at `` to=``.
    """
    regions = spec.regions if spec is not None else ()
    content: list[str] = []
    thought: list[str] = []
    calls: list[ParsedCall] = []
    settled = True
    pos, n = 0, len(text)
    m: re.Match[str] | None = None
    e: re.Match[str] | None = None
    resume: str | None = None
    wake: tuple[tuple[str, ...], frozenset[str]] | None = None
    opened: list[OpenRegion] = []  # the call region the text ends inside
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
            before, opened = len(calls), []
            pieces, found, at = scan_multi(
                body, regions if opts.calls else (), opts, done, None if done else opened
            )
            opened = [OpenRegion(r.tail, r.body, before + r.before, end=r.end) for r in opened]
            calls.extend(found)
            content.append("".join(pieces).strip())
            if not done:
                settled = False
                if at < len(body):  # an open call: read again where it may end
                    ends = [m for start, end, body in regions for m in (end, *body.closers)]
                    wake = ((*ends, "<|eom|>", "<|eot|>"), frozenset())
    reasoning = "".join(thought) if thought else None
    sc = RegionScan(reasoning, "".join(content), calls, settled, wake=wake, open=wake is not None)
    if wake is not None and opened:
        sc.open_region = opened[-1]
    if pos == n and m is not None and e is None and resume is not None:
        sc.stage, sc.resume = "rest", resume  # the text ends inside a message's text
    elif wake is not None:
        sc.stage = "rest"
    return sc


# --------------------------------------------------------------------------- gpt-oss (harmony)

_HARMONY_END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
#: how a message header starts (the generation prompt ends with <|start|>assistant)
_HARMONY_HEAD = re.compile(r"\s*(assistant\b|<\||to=|$)")
#: what a generation may start with and still turn out to be a harmony header
_HARMONY_OPENERS = ("assistant", "<|", "to=")


def _plain_from_start(text: str) -> bool:
    """Whether a generation starting with ``text`` is plain text to its end: no header
    starts it, so whatever follows (markers included) is read as content (see
    :func:`harmony`); a start that may still become a header is not decided yet."""
    lead = text.lstrip()
    if not lead or _HARMONY_HEAD.match(text):
        return False
    return not any(opener.startswith(lead) for opener in _HARMONY_OPENERS)


def harmony(
    text: str, spec: Spec | None, opts: Options, final: bool, blank: bool = False
) -> RegionScan:
    """Harmony messages: ``[<|start|>assistant][ to=R]<|channel|>C[ to=R][<|constrain|>x]<|message|>body<|end|>``.

    ``analysis`` is reasoning; ``final`` and recipient-less ``commentary`` are content; a
    ``to=functions.NAME`` recipient makes the body a call's JSON arguments; other
    recipients (built-in tools such as ``python``, ``container.exec``) are not function
    calls and are dropped, like llama.cpp does; with no tools bound, so are messages to
    ``functions.*``. The end of generation (``<|call|>`` is an
    end-of-generation token) ends the last message.
    """
    if not blank and _plain_from_start(text):
        # the whole generation is content: a stream reads on without reading it again
        return RegionScan(None, text, [], True, stage="plain")
    content: list[str] = []
    thought: list[str] = []
    calls: list[ParsedCall] = []
    settled = True
    resume: str | None = None
    wake: tuple[str, ...] | None = None
    opened: OpenRegion | None = None  # a call's arguments the text ends inside
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
                    opened = OpenRegion(len(body), NAMED_ARGUMENTS, len(calls), name)
                    calls.append(ParsedCall(name, None, body, complete=False))
                    settled = False
                else:
                    obj, err = loads_lenient(body.strip() or "{}")
                    if err or not isinstance(obj, dict):
                        calls.append(
                            ParsedCall(
                                name,
                                None,
                                body.strip(),
                                error=err or "arguments are not a JSON object",
                            )
                        )
                    else:
                        calls.append(ParsedCall(name, obj, body.strip()))
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
    sc = RegionScan(reasoning, "".join(content), calls, settled)
    if resume is not None:
        sc.stage, sc.resume = "rest", resume
    elif wake is not None:
        sc.stage, sc.open, sc.wake = "rest", True, (wake, frozenset())
        sc.open_region = opened
    return sc
