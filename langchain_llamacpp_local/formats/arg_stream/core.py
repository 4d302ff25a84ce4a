"""What every argument stream shares: the fragments it returns, a JSON value copied as
written, the spoiler of a call that ends invalid, and :class:`ArgStream`, which reads a
region's text once, character by character, and holds back where a marker may end."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from langchain_llamacpp_local.formats.base import Options, read_as_arguments


@dataclass
class Fragment:
    """Argument text of the ``k``-th call of a region (its first carries name and id)."""

    k: int
    parts: list[str]
    name: str | None = None
    id: str | None = None

    @property
    def args(self) -> str:
        return "".join(self.parts)


class JsonCopy:
    """One JSON value as written, whitespace outside its strings dropped (so the copy
    reads as the original wherever the original is JSON); ``done`` once its outermost
    bracket closes. An escape is copied whole, so the copy never ends inside one."""

    __slots__ = ("depth", "done", "esc", "in_str")

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.done = False

    def feed(self, ch: str) -> str:
        if self.in_str:
            if self.esc:
                self.esc = False
                return "\\" + ch
            if ch == "\\":
                self.esc = True
                return ""
            if ch == '"':
                self.in_str = False
            return ch
        if ch in " \t\r\n":
            return ""
        if ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth <= 0:
                self.done = True
        return ch


def spoiler(sent: str) -> str:
    """The text that, appended to ``sent``, makes LangChain read the merged arguments as
    no call: ``parse_partial_json`` (``langchain_core.utils.json``) returns None at a
    closing bracket that matches no open one (and ``json.loads`` fails on it first), so
    an open string is closed and the bracket that does not close the innermost open
    one is written."""
    stack: list[str] = []
    in_str = esc = False
    for ch in sent:  # parse_partial_json's own reading of the text
        if in_str:
            if ch == '"' and not esc:
                in_str = False
            elif ch == "\\":
                esc = not esc
            else:
                esc = False
        elif ch == '"':
            in_str, esc = True, False
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if stack and stack[-1] == ch:
                stack.pop()
            else:
                stack = ["?"]  # already unreadable: one more stray bracket changes nothing
                break
    tail = ("n" if in_str and esc else "") + ('"' if in_str else "")
    tail += "]" if stack and stack[-1] == "}" else "}"
    while read_as_arguments(sent + tail):  # (never: the bracket matches nothing)
        tail += "]}"
    return tail


def escaped(text: str) -> str:
    """``text`` as the inside of a JSON string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class ArgStream:
    """Reads one call region's text as it is written; :meth:`feed` returns fragments."""

    def __init__(self, opts: Options, markers: tuple[str, ...]) -> None:
        self.opts = opts
        self.k = -1  # the call being read (its number in the region)
        self._out: list[Fragment] = []
        self._size = max((len(m) for m in markers if m), default=1)
        self.win = ""  # the last characters read (a marker completes at its end)
        #: the region's end marker (outside a quoted value, where the syntax has them):
        #: the stream reads nothing after it
        self.region_end = ""
        self.closed = False
        #: markers the reader replaces in the text before reading it (Granite's
        #: ``<response>`` taken out): replaced here too, a suffix that may start one
        #: held back
        self.rewrite: tuple[tuple[str, str], ...] = ()
        self._held = ""
        #: what the body reader puts back before the region's text (fed first)
        self.prefix = ""

    def end_at(self, marker: str | None) -> None:
        self.region_end = marker or ""
        self._size = max(self._size, len(self.region_end))

    def feed(self, text: str) -> list[Fragment]:
        if self.rewrite:
            text = self._rewritten(text)
        size, end = self._size, self.region_end
        for ch in text:
            if self.closed:
                break
            win = self.win + ch
            self.win = win[-size:] if len(win) > size else win
            if end and win.endswith(end) and not self.quoted():
                self.closed = True
                self.at_region_end(ch)
                break
            self.step(ch)
        out, self._out = self._out, []
        return out

    def _rewritten(self, text: str) -> str:
        """``text`` with the markers replaced, as the reader's ``replace`` does."""
        held = self._held + text
        out: list[str] = []
        while held:
            for marker, by in self.rewrite:
                if held.startswith(marker):
                    out.append(by)
                    held = held[len(marker) :]
                    break
            else:
                if any(m.startswith(held) for m, _ in self.rewrite):
                    break  # may be one being written
                out.append(held[0])
                held = held[1:]
        self._held = held
        return "".join(out)

    def step(self, ch: str) -> None:
        raise NotImplementedError

    def at_region_end(self, ch: str) -> None:
        """The region's end marker was just written (``ch`` its last character)."""

    def quoted(self) -> bool:
        """Whether the text read so far ends inside a quoted value (JSON string)."""
        return False

    def emit(self, text: str, name: str | None = None, cid: str | None = None) -> None:
        out = self._out
        if name is None and out and out[-1].k == self.k:
            out[-1].parts.append(text)
        else:
            out.append(Fragment(self.k, [text], name, cid))


#: (options, the call's name where a header gave it) -> the stream of one region, or
#: None where this region does not stream (no name known)
StreamMaker = Callable[[Options, "str | None"], "ArgStream | None"]


@dataclass
class Tracked:
    """The region a stream of arguments follows: where its body starts in the whole
    generation, the number of its first call, and its stream."""

    start: int
    base: int
    stream: ArgStream


def dumps(value: Any) -> str:
    """A closed value as JSON text (``?``, never JSON, where it has no JSON form: the
    parse reports the call invalid too)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return "?"


def rewriting(make: StreamMaker, rewrite: tuple[tuple[str, str], ...]) -> StreamMaker:
    """``make``'s stream, reading the text with ``rewrite``'s markers replaced as the
    body's reader replaces them before reading it."""

    def made(opts: Options, name: str | None) -> ArgStream | None:
        stream = make(opts, name)
        if stream is not None:
            stream.rewrite = rewrite
        return stream

    return made
