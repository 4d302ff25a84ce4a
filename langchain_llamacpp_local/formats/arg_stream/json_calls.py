"""Argument streams of calls whose arguments are JSON: after a header (``NAME sep {...}``,
:class:`SepJson`) or inside call objects (``{"name": ..., "arguments": {...}}``,
:class:`JsonObjects`). The arguments object is copied as written (:class:`~.core.JsonCopy`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from langchain_llamacpp_local.formats.arg_stream.core import ArgStream, JsonCopy, StreamMaker
from langchain_llamacpp_local.formats.base import Options

#: a ```json fence's opening line, up to the JSON
FENCE_HEAD = re.compile(r"```(?:json|JSON)?\s*")

#: the text before a call's separator -> (name, id), or None: not a call the stream follows
Header = Callable[[str], "tuple[str, str | None] | None"]


class SepJson(ArgStream):
    """Calls written ``[begin] HEADER sep {json} [end]``: ``header`` reads the text
    before ``sep`` as (name, id), or None (not a call the stream follows). ``begin``
    starts every call (``first``: the region's start was the first one); without it
    the region is one call. ``name``: the header is already read (the arguments are
    the region)."""

    def __init__(
        self,
        opts: Options,
        header: Header,
        sep: str,
        begin: str | None = None,
        end: str | None = None,
        first: bool = False,
        name: str | None = None,
        fenced: bool = False,
        begin_splits: bool = True,
    ) -> None:
        super().__init__(opts, (sep, begin or "", end or ""))
        self.header, self.sep, self.begin, self.end = header, sep, begin, end
        self.fenced = fenced  # the JSON may be in a ```json fence (the parse unfences it)
        #: ``begin`` inside an open call starts the next one (False: only after ``end``)
        self.begin_splits = begin_splits
        self.fence: list[str] = []
        self.state = "head" if begin is None or first else "seek"
        self.k = 0 if self.state == "head" else -1
        self.head: list[str] = []
        self.name: str | None = name
        self.id: str | None = None
        self.copy = JsonCopy()
        if name is not None:
            self.state = "open"

    def step(self, ch: str) -> None:
        win = self.win
        if self.begin and win.endswith(self.begin) and (self.begin_splits or self.state == "seek"):
            self.k += 1
            self.state, self.head = "head", []
            return
        if self.end and win.endswith(self.end):
            self.state = "seek"
            return
        state = self.state
        if state == "args":
            piece = self.copy.feed(ch)
            if piece:
                self.emit(piece)
            if self.copy.done:
                self.state = "after"
        elif state == "head":
            self.head.append(ch)
            if len(self.head) >= len(self.sep) and win.endswith(self.sep):
                got = self.header("".join(self.head)[: -len(self.sep)])
                self.state = "skip" if got is None else "open"
                if got is not None:
                    self.name, self.id = got
        elif state == "fence":
            self.fence.append(ch)
            if ch == "{" and FENCE_HEAD.fullmatch("".join(self.fence[:-1])):
                self._start(ch)
            elif ch == "{" or len(self.fence) > 16:
                self.state = "skip"
        elif state == "open" and ch not in " \t\r\n":
            if ch == "`" and self.fenced and self.name:
                self.state, self.fence = "fence", [ch]
                return
            if ch != "{" or not self.name:
                self.state = "skip"  # not an object: sent whole once the parse has it
                return
            self._start(ch)

    def quoted(self) -> bool:
        return self.state == "args" and self.copy.in_str

    def _start(self, ch: str) -> None:
        self.copy = JsonCopy()
        self.copy.feed(ch)
        self.emit("{", self.name, self.id)
        self.state = "args"


def plain_name(head: str) -> tuple[str, str | None] | None:
    """A header that is the call's name."""
    name = head.strip()
    return (name, None) if name else None


def sep_json(header: Header, sep: str, **kw: Any) -> StreamMaker:
    """The stream of a region of ``[begin] HEADER sep {json} [end]`` calls (:class:`SepJson`)."""
    return lambda opts, name: SepJson(opts, header, sep, **kw)


def named_json(opts: Options, name: str | None) -> ArgStream | None:
    """The stream of a region that is one call's JSON arguments, named by a header before
    it (none without a name)."""
    return SepJson(opts, plain_name, "", name=name) if name else None


def objects(**kw: Any) -> StreamMaker:
    """The stream of a region of JSON call objects (:class:`JsonObjects`)."""
    return lambda opts, name: JsonObjects(opts, **kw)


class JsonObjects(ArgStream):
    """Calls written as JSON objects (``{"name": ..., "arguments": {...}}``): one, a list
    of them, or (``lines``) one after another. A call streams when its name comes
    before its arguments and they are an object; any other value is sent whole."""

    def __init__(
        self,
        opts: Options,
        names: tuple[str, ...] = ("name",),
        args: tuple[str, ...] = ("arguments", "parameters"),
        ids: tuple[str, ...] = ("id", "tool_call_id"),
        lines: bool = False,
        name_key: bool = False,
        fenced: bool = False,
        seps: str = ",",
        document: bool = False,
    ) -> None:
        super().__init__(opts, ())
        #: the body may be a ```json fence around the JSON (the parse unfences it)
        self.fenced = fenced
        self.fence: list[str] | None = None
        self.seps = seps  # what may stand between calls
        #: the calls are in a ``{"tool_call": {...}}`` / ``{"tool_calls": [...]}`` document
        self.document = document
        self.doc_key: str | None = None
        self.doc_expect = "key"
        self.names, self.args, self.ids, self.lines = names, args, ids, lines
        #: a list of ``{"NAME": {arguments}}`` (Apertus): the only key is the name
        self.name_key = name_key
        self.level: int | None = None  # depth at which calls start (0, or 1 in a list)
        self.off = False
        self.depth = 0
        self.in_str = self.esc = False
        self.cap: list[str] | None = None  # a key or a name being read
        self.expect = ""  # at a call's members: "key", "colon", "value", "comma"
        self.elem = "value"  # where calls start: "value" (one may start) or "comma"
        self.key: str | None = None
        self.call: dict[str, Any] = {}
        self.copy: JsonCopy | None = None

    def step(self, ch: str) -> None:
        copy = self.copy
        if copy is not None:  # inside the arguments being streamed
            piece = copy.feed(ch)
            if piece:
                self.emit(piece)
            if copy.done:
                self.copy, self.expect = None, "comma"
            return
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                self._string_end()
                return
            if self.cap is not None:
                self.cap.append(ch)
            return
        if self.fence is not None:  # the fence's opening line, up to the JSON
            self.fence.append(ch)
            if ch not in "[{":
                if len(self.fence) > 16:
                    self.fence, self.off = None, True
                return
            if not FENCE_HEAD.fullmatch("".join(self.fence[:-1])):
                self.fence, self.off = None, True
                return
            self.fence = None
        elif ch in " \t\r\n" or self.off:
            return
        if self.document and self.level is None and not self._document(ch):
            return
        if self.level is None:  # the region's first character
            if ch == "`" and self.fenced and self.fence is None:
                self.fence, self.fenced = [ch], False
                return
            if ch == "[" and not self.lines:
                self.level = 1
            elif ch == "{" and not self.name_key:
                self.level = 0
            else:
                self.off = True  # not JSON (fenced, markup): the parse's calls go whole
                return
        depth = self.depth
        if depth == self.level and ch not in "]}" and ch not in self.seps:
            if self.elem == "value" or self.lines and ch == "{":  # a call starts
                self.k += 1
                self.call, self.expect, self.elem = {}, "key", "comma"
                if ch != "{":
                    self.call["off"] = True
            elif not self.lines or ch != "{":
                self.off = self.level == 0  # more after the one call: the parse decides
        at_call = depth == self.level + 1 and not self.call.get("off")
        if ch == '"':
            self.in_str = True
            self.cap = [] if at_call and self.expect in ("key", "value") else None
            return
        if ch in "{[":
            if at_call and self.expect == "value":
                self.expect = "comma"
                if self._starts_args(ch):
                    return
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == self.level:
                self.elem = "comma"
            if self.depth < (self.level or 0):
                self.off = True
        elif depth == self.level and ch in self.seps:
            self.elem = "value"
        elif at_call:
            if ch == ":" and self.expect == "colon":
                self.expect = "value"
            elif ch == "," and self.expect == "comma":
                self.expect = "key"
            elif self.expect == "value":
                self.expect = "comma"  # a number or literal

    def quoted(self) -> bool:
        return self.in_str or self.copy is not None and self.copy.in_str

    def _document(self, ch: str) -> bool:
        """The generic document around the calls, up to them: whether ``ch`` starts the
        one call (``"tool_call"``); the list (``"tool_calls"``) sets where calls start."""
        if self.depth == 0:
            if ch == "`" and self.fenced and self.fence is None:
                self.fence, self.fenced = [ch], False
            elif ch == "{":
                self.depth, self.doc_expect = 1, "key"
            else:
                self.off = True
            return False
        if ch == '"' and self.doc_expect == "key":
            self.in_str, self.cap = True, []
            return False
        if ch == ":" and self.doc_expect == "colon":
            self.doc_expect = "value"
            return False
        if self.doc_expect == "value" and ch == "{" and self.doc_key == "tool_call":
            self.level = 1
            return True
        if self.doc_expect == "value" and ch == "[" and self.doc_key == "tool_calls":
            self.level, self.depth = 2, 2
            return False
        self.off = True  # ("response", or another shape: the parse decides)
        return False

    def _string_end(self) -> None:
        cap, self.cap = self.cap, None
        if cap is None:
            if self.expect == "value" and self.depth == (self.level or 0) + 1:
                self.expect = "comma"
            return
        try:
            text = json.loads('"' + "".join(cap) + '"')
        except ValueError:
            text = None
        if self.document and self.level is None:
            self.doc_key, self.doc_expect = text, "colon"
            return
        call = self.call
        if self.expect == "key":
            self.key, self.expect = text, "colon"
            call["keys"] = call.get("keys", 0) + 1
            if self.name_key and call["keys"] == 1 and isinstance(text, str):
                call["name"] = text
            if text == "function" and not self.name_key:
                call["off"] = True  # {"function": {...}}: read by the parse, sent whole
            return
        self.expect = "comma"
        if self.key in self.names and "name" not in call and isinstance(text, str):
            call["name"] = text
        elif self.key in self.ids and "id" not in call and text:
            call["id"] = text

    def _starts_args(self, ch: str) -> bool:
        call = self.call
        if self.name_key:
            is_args = call.get("keys") == 1 and self.key == call.get("name")
        else:
            is_args = self.key in self.args
        if ch != "{" or not is_args or call.get("streamed") or "args" in call:
            if is_args:
                call["args"] = True
            return False
        call["args"] = True
        if not call.get("name"):
            return False
        call["streamed"] = True
        self.copy = JsonCopy()
        self.copy.feed(ch)
        self.emit("{", call["name"], call.get("id"))
        return True
