"""Tool-call arguments streamed while the model writes them (``stream_tool_args``).

By default a :class:`~.stream_parser.StreamParser` sends a call whole once it can no longer
change. With ``stream_args=True`` it also runs an :class:`ArgStream` over the call region
the output ends inside: each character of the region is read once, and each call's id
and name go out with the first fragment of its arguments, then further fragments, as
LangChain's ``tool_call_chunks`` carry them (merged by ``index``, ``args`` joined).

What is sent is JSON text of the arguments as written: an argument object copied with
the whitespace outside its strings dropped (:class:`JsonCopy`), or markup parameters
(``<parameter=k>v</parameter>``) as ``{"k":"v",...}`` with each text value escaped as it
comes; a value the tool's schema may read as something other than text (a number, a
list, a CDATA block) is sent once closed, as the parse types it. A suffix that may be
the start of the marker that closes a text value is held back.

The parse of the finished call stays the reference: when the call is complete the
stream checks that the text sent reads as the parse's arguments; a call that ends
invalid (cut off by ``max_tokens``, malformed, or read otherwise than it was streamed)
gets a last fragment (:func:`spoiler`) after which LangChain's ``parse_partial_json``
reads the merged arguments as nothing, so the merged message lists the call in
``invalid_tool_calls``. A call whose syntax the stream does not follow (a Python literal
list, a learned syntax, a name written after the arguments) is sent whole, as without
the option. :data:`_STREAMS` maps each body reader to the stream that reads its region
as it does.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from langchain_llamacpp_local.formats.base import (
    OpenRegion,
    Options,
    held_suffix,
    read_as_arguments,
    typed_value,
)
from langchain_llamacpp_local.formats.classic import (
    _bare_call,
    _deepseek_body,
    _generic_calls,
    _hermes_fn,
    _hermes_json,
    _list_body,
    _llama3_calls,
    _pythonic_calls,
)
from langchain_llamacpp_local.formats.families import (
    DSML_MARKER,
    MM_MARKER,
    apertus_body,
    command_r_body,
    deepseek_v3_1_body,
    dsml_body,
    functionary_v3_1_body,
    gemma4_body,
    glm_body,
    hy3_body,
    json_call_body,
    json_lines_body,
    json_list_body,
    kimi_k2_body,
    kimi_k3_body,
    minicpm5_body,
    minimax_body,
    minimax_m3_body,
    mistral_body,
    mm_value,
    muse_body,
    py_literal,
    qwen3_coder_body,
    seed_oss_body,
    solar_body,
)


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


def _escaped(text: str) -> str:
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


# --------------------------------------------------------------------------- NAME sep {json}


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
            if ch == "{" and _FENCE_HEAD.fullmatch("".join(self.fence[:-1])):
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


def _r1_name(head: str) -> tuple[str, str | None] | None:
    _, found, name = head.partition("<｜tool▁sep｜>")
    return (name.strip(), None) if found and name.strip() else None


def _plain_name(head: str) -> tuple[str, str | None] | None:
    name = head.strip()
    return (name, None) if name else None


def _kimi_name(head: str) -> tuple[str, str | None] | None:
    full = head.strip()
    name = full.split(":", 1)[0]
    name = name[len("functions.") :] if name.startswith("functions.") else name
    return (name, full) if name else None


_MISTRAL_HEAD = re.compile(r"\s*([\w.\-]+)(?:\[CALL_ID\]([^\[]*))?")


def _mistral_name(head: str) -> tuple[str, str | None] | None:
    m = _MISTRAL_HEAD.fullmatch(head)
    return (m.group(1), m.group(2) or None) if m else None


def _solar_name(head: str) -> tuple[str, str | None] | None:
    cid, found, rest = head.partition("<|tool_call:name|>")
    name = rest.strip()
    return (name, cid.strip() or None) if found and name else None


_HERMES_FN = re.compile(r'=([^>\s]+)|\s+name="([^"]*)"')


def _hermes_fn_name(head: str) -> tuple[str, str | None] | None:
    m = _HERMES_FN.fullmatch(head)
    name = m and (m.group(1) or m.group(2))
    return (name, None) if name else None


# --------------------------------------------------------------------------- JSON call objects


_FENCE_HEAD = re.compile(r"```(?:json|JSON)?\s*")


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
            if not _FENCE_HEAD.fullmatch("".join(self.fence[:-1])):
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


# --------------------------------------------------------------------------- markup parameters


@dataclass(frozen=True)
class Tags:
    """A markup family's call and parameter tags: ``call_open NAME name_stop``, then one
    of ``name_tails``; ``param_open KEY key_stop`` then one of ``key_tails`` (its
    number: the value's mode, for DSML's ``string="true|false"``); a name or key cannot
    hold a character of ``bad``; ``framed``: one newline after the key's tag and one
    before the closing tag are framing, not value."""

    call_open: str
    call_close: str
    param_open: str
    param_close: str
    name_stop: str = ">"
    name_tails: tuple[str, ...] = ("",)
    key_stop: str = ">"
    key_tails: tuple[str, ...] = ("",)
    bad: str = "\n"
    framed: bool = False
    #: key_tails' meaning (DSML): "raw" text, "json" (read as JSON), or the schema's type
    modes: tuple[str, ...] = ("schema",)
    prefix: str = ""  # what the body reader puts back before the region's text
    #: tails of any text up to ``tail_end`` matching a pattern (Kimi K3's attributes);
    #: a key's group 1 is its ``type``
    name_tail_re: str | None = None
    key_tail_re: str | None = None
    tail_end: str = ""
    cdata: bool = True  # a ``<![CDATA[...]]>`` value is its inside
    cdata_close: bool = False  # a CDATA value's closing tag inside it does not close it
    strip_name: bool = True  # the parse strips the call's name


_CDATA = "<![CDATA["
#: how a value the parse may read as a JSON number, string or container can start
_JSONISH = frozenset('{["-0123456789')
#: the words it may read as a literal (JSON's, Python's, and those ``json`` accepts)
_WORDS = ("true", "false", "null", "NaN", "Infinity", "True", "False", "None")


class Markup(ArgStream):
    """Calls written in a markup family's tags (Qwen3-Coder, Seed-OSS, MiniMax M2,
    DeepSeek DSML, MiniCPM5, Muse, Kimi K3), read as their body readers
    (:func:`~.families._xml_function_calls`, :func:`~.families.kimi_k3_body`) read them."""

    def __init__(self, opts: Options, tags: Tags) -> None:
        t = tags
        markers = (t.call_open, t.call_close, t.param_open, t.param_close)
        super().__init__(opts, markers)
        self.t = tags
        self.state = "seek"
        self.acc: list[str] = []
        self.tail: str | None = None
        self.name = ""
        self.streaming = False
        self.n_params = 0
        self.key = ""
        self.mode = "schema"
        self.val: list[str] = []
        self.sent = 0
        self.decided: str | None = None
        self.cdata_open = False  # a CDATA value read past a closing tag (MiniCPM5)
        holds = [t.param_close] + (["\n" + t.param_close] if t.framed else [])
        self.holds = tuple(holds)
        self.hold_len = max(len(h) for h in holds)

    def at_region_end(self, ch: str) -> None:
        if self.t.call_close and self.win.endswith(self.t.call_close):
            self.step(ch)  # (the region's end closes its one call: GLM, MiniCPM5)

    def _header(
        self, ch: str, stop: str, tails: tuple[str, ...], tail_re: str | None = None
    ) -> bool | int | re.Match[str] | None:
        """Reads a name or key: None while under way, False when the tag is not one
        the parse reads, else the number of the tail it ended with (or its match)."""
        if self.tail is None:
            if ch == stop:
                self.tail = ""
            elif ch in self.t.bad:
                return False
            else:
                self.acc.append(ch)
                return None
        else:
            self.tail += ch
        if tail_re is not None:
            end = self.t.tail_end
            if not self.tail.endswith(end):
                return None
            return re.fullmatch(tail_re, self.tail[: len(self.tail) - len(end)]) or False
        for n, tail in enumerate(tails):
            if tail == self.tail:
                return n
        if not any(tail.startswith(self.tail) for tail in tails):
            return False
        return None

    def step(self, ch: str) -> None:
        t, win, state = self.t, self.win, self.state
        if state == "seek":
            if win.endswith(t.call_open):
                self.state, self.acc, self.tail = "name", [], None
            return
        if state != "name" and win.endswith(t.call_close):  # the call ends here
            if state in ("vstart", "value") or self.cdata_open:
                self.streaming = False  # the parse leaves the open value out: stop
            elif self.streaming:
                self.emit("}")
            self.state = "seek"
            return
        if state == "name":
            got = self._header(ch, t.name_stop, t.name_tails, t.name_tail_re)
            if got is False:
                self.state = "seek"
            elif got is not None:
                self.k += 1
                name = "".join(self.acc)
                self.name, self.n_params = name.strip() if t.strip_name else name, 0
                self.streaming = bool(self.name)
                if self.streaming:
                    self.emit("{", self.name)
                self.state = "body"
        elif state == "body":
            if win.endswith(t.param_open):
                self.state, self.acc, self.tail = "key", [], None
        elif state == "key":
            got = self._header(ch, t.key_stop, t.key_tails, t.key_tail_re)
            if got is False:
                self.state = "body"
            elif got is not None:
                self.key, self.mode = "".join(self.acc).strip(), _mode(got, t.modes)
                self.val, self.sent, self.decided = [], 0, None
                self.state = "vstart"
        else:
            if state == "vstart":
                self.state = "value"
                if t.framed and ch == "\n":
                    return
            self.val.append(ch)
            if win.endswith(t.param_close):
                value = "".join(self.val)[: -len(t.param_close)]
                if t.framed and value.endswith("\n"):
                    value = value[:-1]
                if t.cdata_close and value.startswith(_CDATA) and not value.endswith("]]>"):
                    # MiniCPM5: a CDATA value runs to "]]></param>" where one comes; if
                    # none does, the parse ends it here (the stream then stops)
                    self.cdata_open = True
                    return
                self.cdata_open = False
                self._close(value)
                self.state = "body"
            elif self.streaming:
                self._stream()

    def _types(self) -> set[str] | None:
        if self.mode == "raw":
            return {"string"}
        if self.mode == "json":
            return None
        if self.mode.startswith("type:"):  # Kimi K3's type="number": read as written
            return {self.mode[len("type:") :], "integer"}
        return self.opts.param_types(self.name, self.key)

    def _decide(self, text: str) -> str | None:
        """``"str"``: the value (written so far as ``text``) is its text, sent as written;
        ``"buf"``: the parse may read it as JSON, a literal or CDATA, sent once closed;
        None: not known yet."""
        head = text[: len(_CDATA)]
        if self.t.cdata and _CDATA.startswith(head) and head:
            return "buf" if len(head) == len(_CDATA) else None
        types = self._types()
        if types is not None and types <= {"string"}:
            return "str" if head else None
        word = text.lstrip()
        if not word:
            return None
        if word[0] in _JSONISH:
            return "buf"
        for w in _WORDS:  # still a literal, or one followed by whitespace only
            if w.startswith(word) or word.startswith(w) and not word[len(w) :].strip():
                return None
        return "str"

    def _stream(self) -> None:
        n = len(self.val)
        safe = n - held_suffix("".join(self.val[max(0, n - self.hold_len) :]), self.holds)
        if self.decided is None:  # (decided on the text known not to close the value)
            self.decided = self._decide("".join(self.val[:safe]))
            if self.decided == "str":
                sep = "," if self.n_params else ""
                self.emit(sep + json.dumps(self.key, ensure_ascii=False) + ':"')
                self.n_params += 1
        if self.decided != "str":
            return
        if safe > self.sent:
            self.emit(_escaped("".join(self.val[self.sent : safe])))
            self.sent = safe

    def _close(self, value: str) -> None:
        if not self.streaming:
            return
        if self.decided == "str":
            self.emit(_escaped(value[self.sent :]) + '"')
            return
        text = value
        if self.t.cdata and text.startswith(_CDATA) and text.endswith("]]>"):
            text = text[len(_CDATA) : -len("]]>")]
        typed = text if self.mode == "raw" else typed_value(text, self._types())
        sep = "," if self.n_params else ""
        self.n_params += 1
        self.emit(sep + json.dumps(self.key, ensure_ascii=False) + ":" + _dumps(typed))


def _mode(got: int | re.Match[str], modes: tuple[str, ...]) -> str:
    """A key's value mode from how its tag ended (a tail's number, or Kimi K3's type)."""
    if isinstance(got, re.Match):
        kind = got.group(1) if got.re.groups else None
        return "schema" if kind is None else "raw" if kind == "string" else "type:" + kind
    return modes[got]


class ArgPairs(Markup):
    """GLM's ``NAME<arg_key>k</arg_key><arg_value>v</arg_value>...``, one call per region
    (its end, ``tags.call_close``, closes the call), read as
    :func:`~.families.glm_body` reads it."""

    def __init__(self, opts: Options, tags: Tags, key_close: str, value_open: str) -> None:
        super().__init__(opts, tags)
        self.key_close, self.value_open = key_close, value_open
        self._size = max(self._size, len(key_close), len(value_open))
        self.state, self.k = "name", 0
        self.blank = True  # the name so far is whitespace

    def step(self, ch: str) -> None:
        t, win, state = self.t, self.win, self.state
        if state == "done":
            return
        if state == "name":
            self.acc.append(ch)
            if ch not in " \t\r\n":
                self.blank = False
            for stop in (t.param_open, t.call_close, "\n"):
                if win.endswith(stop) and len(self.acc) >= len(stop):
                    if stop != "\n" or not self.blank:  # (leading newlines are no end)
                        break
            else:
                return
            text = "".join(self.acc)
            name = text[: len(text) - len(stop)].strip()
            self.name, self.n_params = name, 0
            self.streaming = bool(name) and "<" not in name
            if self.streaming:
                self.emit("{", name)
            self.state, self.acc = ("key" if stop == t.param_open else "body"), []
            if stop == t.call_close:
                self._end()
            return
        if win.endswith(t.call_close):
            if state == "value":
                self.streaming = False  # the parse leaves the open value out: stop
            self._end()
            return
        if state == "body":
            if win.endswith(t.param_open):
                self.state, self.acc = "key", []
        elif state == "key":
            self.acc.append(ch)
            if win.endswith(self.key_close):
                self.key = "".join(self.acc)[: -len(self.key_close)].strip()
                self.state, self.acc = "between", []
        elif state == "between":
            self.acc.append(ch)
            if win.endswith(self.value_open):
                if "".join(self.acc)[: -len(self.value_open)].strip():
                    self.streaming = False  # (text between the tags: the parse decides)
                self.val, self.sent, self.decided = [], 0, None
                self.state = "value"
        else:
            self.val.append(ch)
            if win.endswith(t.param_close):
                self._close("".join(self.val)[: -len(t.param_close)])
                self.state = "body"
            elif self.streaming:
                self._stream()

    def _end(self) -> None:
        if self.streaming:
            self.emit("}")
        self.streaming, self.state = False, "done"


_GEMMA_STR = '<|"|>'
_GEMMA_KEY = re.compile(r"([A-Za-z_][\w.\-]*)\s*:")
_GEMMA_KEY_START = re.compile(r"[A-Za-z_][\w.\-]*\s*")
_GEMMA_NAME = re.compile(r"[\w.\-]")


class GemmaArgs(ArgStream):
    """Gemma 4's ``call:NAME{key:<|"|>text<|"|>,n:1}``, converted to JSON as it is written
    the way :func:`~.families._gemma_value` converts it whole: a ``<|"|>`` string becomes a
    JSON string, a bare key after ``{`` or ``,`` a quoted one, any other character is
    copied; a suffix that may start ``<|"|>`` or the region's end is held back."""

    END = "<tool_call|>"

    def __init__(self, opts: Options) -> None:
        super().__init__(opts, (_GEMMA_STR, self.END))
        self.k = 0
        self.state = "head"
        self.head: list[str] = []
        self.name = ""
        self.pend = ""
        self.prev_ok = True  # the last piece was "{" or ",": a bare key may follow

    def step(self, ch: str) -> None:
        state = self.state
        if state == "head":
            self.head.append(ch)
            text = "".join(self.head).lstrip()
            if len(text) <= len("call:"):
                if not "call:".startswith(text):
                    self.state = "skip"
                return
            if not text.startswith("call:"):
                self.state = "skip"
            elif not _GEMMA_NAME.match(ch):
                self.name = text[len("call:") : -1]
                self.state = "gap" if self.name else "skip"
                if self.name:
                    self.step_gap(ch)
        elif state == "gap":
            self.step_gap(ch)
        elif state in ("out", "str"):
            self.pend += ch
            self.drain()

    def quoted(self) -> bool:
        return self.state == "str"

    def step_gap(self, ch: str) -> None:
        if ch == "{":
            self.emit("{", self.name)
            self.state, self.prev_ok = "out", True
        elif ch not in " \t\r\n":
            self.state = "skip"

    def drain(self) -> None:
        pend = self.pend
        while pend:
            if self.state == "str":
                j = pend.find(_GEMMA_STR)
                if j >= 0:
                    self.emit(_escaped(pend[:j]) + '"')
                    pend, self.state, self.prev_ok = pend[j + len(_GEMMA_STR) :], "out", False
                    continue
                keep = held_suffix(pend, (_GEMMA_STR,))
                if len(pend) > keep:
                    self.emit(_escaped(pend[: len(pend) - keep]))
                pend = pend[len(pend) - keep :]
                break
            if pend.startswith(self.END):
                self.state, pend = "done", ""
                break
            if pend.startswith(_GEMMA_STR):
                self.emit('"')
                pend, self.state = pend[len(_GEMMA_STR) :], "str"
                continue
            if _GEMMA_STR.startswith(pend) or self.END.startswith(pend):
                break  # a marker may be being written
            c = pend[0]
            if self.prev_ok and (c == "_" or c.isascii() and c.isalpha()):
                m = _GEMMA_KEY.match(pend)
                if m:
                    self.emit(json.dumps(m.group(1), ensure_ascii=False) + ":")
                    pend, self.prev_ok = pend[m.end() :], False
                    continue
                if _GEMMA_KEY_START.fullmatch(pend):
                    break  # a key still being written
            self.emit(c)
            pend, self.prev_ok = pend[1:], c in "{,"
        self.pend = pend


class SepPairs(ArgPairs):
    """Hy3's ``<tool_call:…>NAME<tool_sep:…><arg_key:…>k</arg_key:…><arg_value:…>v…``:
    calls begin at ``begin`` (ended by ``tags.call_close`` or the next ``begin``), the
    name runs to ``sep``, as :func:`~.families.hy3_body` reads them."""

    def __init__(
        self, opts: Options, tags: Tags, key_close: str, value_open: str, begin: str, sep: str
    ) -> None:
        super().__init__(opts, tags, key_close, value_open)
        self.begin, self.sep = begin, sep
        self._size = max(self._size, len(begin), len(sep))
        self.state, self.k = "seek", -1

    def step(self, ch: str) -> None:
        win = self.win
        if win.endswith(self.begin):
            if self.state not in ("seek", "done"):
                if self.state == "value":
                    self.streaming = False  # the parse leaves the open value out
                self._end()
            self.k += 1
            self.state, self.acc = "hname", []
            return
        if self.state in ("seek", "done"):
            return
        if self.state == "hname":
            if win.endswith(self.t.call_close):
                self.state = "seek"
                return
            self.acc.append(ch)
            if win.endswith(self.sep) and len(self.acc) >= len(self.sep):
                name = "".join(self.acc)[: -len(self.sep)].strip()
                self.name, self.n_params, self.streaming = name, 0, bool(name)
                if name:
                    self.emit("{", name)
                self.state, self.acc = "body", []
            return
        super().step(ch)

    def _end(self) -> None:
        super()._end()
        self.state = "seek"


_TAG_NAME = re.compile(r"[\w.\-]")


class MiniMaxM3(Markup):
    """MiniMax M3's ``<invoke name="X"><k>v</k>...</invoke>`` (each tag maybe after its
    ``]<]minimax[>[`` marker), read as :func:`~.families.minimax_m3_body` reads it: a
    ``string`` parameter is its text as written; any other value (text, nested tags, a
    list of ``<item>``) is sent once its tag closes, as the parse types it."""

    def __init__(self, opts: Options) -> None:
        tags = Tags('<invoke name="', "</invoke>", "<", "", **_QUOTED, strip_name=False)  # type: ignore[arg-type]
        super().__init__(opts, tags)
        self._size = max(self._size, len(MM_MARKER) + 2)
        self.close = ""

    def step(self, ch: str) -> None:
        t, win, state = self.t, self.win, self.state
        if state in ("seek", "name"):
            super().step(ch)
            return
        if win.endswith(t.call_close):  # the call ends (an open value is left out)
            if state == "value":
                self.streaming = False
            elif self.streaming:
                self.emit("}")
            self.state = "seek"
            return
        if state == "body":
            if ch == "<":
                self.state, self.acc = "key", []
        elif state == "key":
            if ch == ">" and self.acc:
                self.key, self.mode = "".join(self.acc), "schema"
                self.close = f"</{self.key}>"
                self.holds = (self.close, MM_MARKER + self.close)
                self.hold_len = len(MM_MARKER + self.close)
                self._size = max(self._size, self.hold_len)
                self.val, self.sent, self.decided = [], 0, None
                self.state = "value"
            elif _TAG_NAME.match(ch):
                self.acc.append(ch)
            else:
                self.state, self.acc = ("key", []) if ch == "<" else ("body", [])
        else:
            self.val.append(ch)
            if win.endswith(self.close):
                value = "".join(self.val)[: -len(self.close)]
                self._close(value.removesuffix(MM_MARKER))
                self.state = "body"
            elif self.streaming:
                self._stream()

    def _decide(self, text: str) -> str | None:
        types = self._types()
        return "str" if types is not None and "string" in types else "buf"

    def _close(self, value: str) -> None:
        if not self.streaming:
            return
        if self.decided == "str":
            self.emit(_escaped(value[self.sent :]) + '"')
            return
        typed = mm_value(value, self._types())
        sep = "," if self.n_params else ""
        self.n_params += 1
        self.emit(sep + json.dumps(self.key, ensure_ascii=False) + ":" + _dumps(typed))


_PY_ESCAPES = {
    "\\": "\\",
    "'": "'",
    '"': '"',
    "n": "\n",
    "t": "\t",
    "r": "\r",
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "v": "\v",
}
_PY_NAME = re.compile(r"[A-Za-z_][\w.]*")


class PyCalls(ArgStream):
    """A pythonic list of calls (``[get_weather(city="Paris", n=2)]``), read as
    :func:`~.classic._pythonic_calls` reads it: a keyword's string literal is decoded
    and sent as it comes (its simple escapes; a ``\\x``, ``\\u``, ``\\N``, octal or line
    escape, or a string prefix, ends the stream of that call); any other literal is sent
    once its argument ends, as the parse reads it."""

    def __init__(self, opts: Options) -> None:
        super().__init__(opts, ())
        self.state = "open"
        self.acc: list[str] = []
        self.streaming = False
        self.n_params = 0
        self.key = ""
        self.quote = ""  # the string literal's quote ("'", '"', or a triple)
        self.esc = False
        self.depth = 0
        self.in_q = ""

    def poison(self) -> None:
        self.streaming = False  # not followed: the parse decides (sent whole is too late)

    def step(self, ch: str) -> None:
        state = self.state
        if state == "open":
            if ch == "[":
                self.state, self.acc = "name", []
            elif ch not in " \t\r\n":
                self.state = "off"
        elif state == "name":
            if ch == "(":
                name = "".join(self.acc).strip()
                self.k += 1
                self.streaming, self.n_params = bool(_PY_NAME.fullmatch(name)), 0
                if self.streaming:
                    self.emit("{", name)
                self.state = "kw"
            elif ch == "]" and not "".join(self.acc).strip():
                self.state = "off"
            else:
                self.acc.append(ch)
        elif state == "kw":
            if ch == ")":
                self._end_call()
            elif ch.isalpha() or ch == "_":
                self.state, self.acc = "key", [ch]
            elif ch not in " \t\r\n,":
                self.poison()
                self.state, self.depth, self.acc = "other", 0, []
                self.step(ch)
        elif state == "key":
            if ch.isalnum() or ch == "_":
                self.acc.append(ch)
            elif ch == "=":
                self.key, self.state = "".join(self.acc), "vstart"
            elif ch not in " \t":
                self.poison()
                self.state, self.depth, self.acc = "other", 0, []
        elif state == "vstart":
            if ch in "'\"":
                self.state, self.quote, self.acc = "q1", ch, []
                if self.streaming:
                    sep = "," if self.n_params else ""
                    self.emit(sep + json.dumps(self.key, ensure_ascii=False) + ':"')
                    self.n_params += 1
            elif ch not in " \t\r\n":
                self.state, self.depth, self.in_q, self.acc = "other", 0, "", []
                self.step(ch)
        elif state == "q1":  # one quote read: a string, an empty one or a triple
            if ch == self.quote:
                self.state = "q2"
            else:
                self.state = "str"
                self.step(ch)
        elif state == "q2":
            if ch == self.quote:
                self.state, self.quote = "str", self.quote * 3
            else:
                self.state = "after"  # an empty string
                self.step(ch)
        elif state == "str":
            self._string(ch)
        elif state == "after":  # a string closed: another may follow (concatenated)
            if ch in "'\"":
                self.state, self.quote = "q1", ch
            elif ch in ",)":
                if self.streaming:
                    self.emit('"')
                self.state = "kw"
                if ch == ")":
                    self._end_call()
            elif ch not in " \t\r\n":
                self.poison()
                self.state = "other_after"
        elif state == "other":
            self._other(ch)
        elif state == "other_after":
            if ch in ",)":
                self.state = "kw"
                if ch == ")":
                    self._end_call()
        elif state == "after_call":
            if ch == ",":
                self.state, self.acc = "name", []
            elif ch == "]":
                self.state = "off"

    def _string(self, ch: str) -> None:
        if self.esc:
            self.esc = False
            if ch in _PY_ESCAPES:
                self._text(_PY_ESCAPES[ch])
            elif ch in "xuUN01234567\r\n":
                self.poison()  # (a code or line escape: not followed)
            else:
                self._text("\\" + ch)  # an unknown escape stays as written
            return
        if ch == "\\":
            self.esc = True
            return
        q = self.quote
        if len(q) == 1:
            if ch == q:
                self.state = "after"
            elif ch == "\n":
                self.poison()  # (a line break in a one-line string: not Python)
            else:
                self._text(ch)
            return
        self.acc.append(ch)  # a triple: its closing quotes are held back
        text = "".join(self.acc[-3:])
        if text.endswith(q):
            self.acc = []
            self.state = "after"
        elif not q.startswith(text[-2:]) and not q.startswith(text[-1:]):
            self._text("".join(self.acc))
            self.acc = []
        elif len(self.acc) > 2:
            self._text("".join(self.acc[:-2]))
            self.acc = self.acc[-2:]

    def _text(self, text: str) -> None:
        if self.streaming and text:
            self.emit(_escaped(text))

    def _other(self, ch: str) -> None:
        """A literal other than a string, read to the ``,`` or ``)`` that ends it."""
        if self.in_q:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == self.in_q:
                self.in_q = ""
        elif ch in "'\"":
            self.in_q = ch
        elif ch in "([{":
            self.depth += 1
        elif ch in ")]}" and self.depth:
            self.depth -= 1
        elif ch in ",)" and not self.depth:
            self._literal("".join(self.acc))
            self.state = "kw"
            if ch == ")":
                self._end_call()
            return
        self.acc.append(ch)

    def _literal(self, text: str) -> None:
        if not self.streaming:
            return
        try:
            value = py_literal(ast.parse(text.strip(), mode="eval").body)
            out = json.dumps(value, ensure_ascii=False)
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            self.poison()
            return
        sep = "," if self.n_params else ""
        self.n_params += 1
        self.emit(sep + json.dumps(self.key, ensure_ascii=False) + ":" + out)

    def _end_call(self) -> None:
        if self.streaming:
            self.emit("}")
        self.streaming, self.state = False, "after_call"


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return "?"  # (never JSON: the parse reports the call invalid too)


_QWEN = Tags("<function=", "</function>", "<parameter=", "</parameter>", framed=True)
_SEED = Tags("<function=", "</function>", "<parameter=", "</parameter>")
_QUOTED = {"name_stop": '"', "name_tails": (">",), "key_stop": '"', "key_tails": (">",), "bad": ""}
_MINIMAX = Tags('<invoke name="', "</invoke>", '<parameter name="', "</parameter>", **_QUOTED)  # type: ignore[arg-type]
_DSML = Tags(
    f'<{DSML_MARKER}invoke name="',
    f"</{DSML_MARKER}invoke>",
    f'<{DSML_MARKER}parameter name="',
    f"</{DSML_MARKER}parameter>",
    **{**_QUOTED, "key_tails": (">", ' string="true">', ' string="false">')},  # type: ignore[arg-type]
    modes=("schema", "raw", "json"),
)
_MUSE = Tags(
    '<atem:invoke name="',
    "</atem:invoke>",
    '<atem:parameter name="',
    "</atem:parameter>",
    **_QUOTED,  # type: ignore[arg-type]
)
_K3 = Tags(
    '<|open|>call tool="',
    "<|close|>call<|sep|>",
    '<|open|>argument key="',
    "<|close|>argument<|sep|>",
    name_stop='"',
    key_stop='"',
    bad="",
    name_tail_re=r"[^<]*",
    key_tail_re=r'(?: type="([^"]*)")?',
    tail_end="<|sep|>",
    cdata=False,
    strip_name=False,
)
_HY = "opensource"
_MINICPM = Tags(
    '<function name="',
    "</function>",
    '<param name="',
    "</param>",
    **_QUOTED,
    prefix="<function",  # type: ignore[arg-type]
    cdata_close=True,
)


# --------------------------------------------------------------------------- the families


def _sep(header: Header, sep: str, **kw: Any) -> Callable[[Options, str | None], ArgStream]:
    return lambda opts, name: SepJson(opts, header, sep, **kw)


def _markup(tags: Tags) -> Callable[[Options, str | None], ArgStream]:
    return lambda opts, name: Markup(opts, tags)


def _pairs(
    tags: Tags, key_close: str, value_open: str
) -> Callable[[Options, str | None], ArgStream]:
    return lambda opts, name: ArgPairs(opts, tags, key_close, value_open)


def _rewriting(
    make: Callable[[Options, str | None], ArgStream], rewrite: tuple[tuple[str, str], ...]
) -> Callable[[Options, str | None], ArgStream]:
    def made(opts: Options, name: str | None) -> ArgStream:
        stream = make(opts, name)
        stream.rewrite = rewrite
        return stream

    return made


def _objects(**kw: Any) -> Callable[[Options, str | None], ArgStream]:
    return lambda opts, name: JsonObjects(opts, **kw)


_DS_BEGIN, _DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
_KIMI_BEGIN, _KIMI_END = "<|tool_call_begin|>", "<|tool_call_end|>"

#: body reader -> the stream that reads its region as it does
_STREAMS: dict[Any, Callable[[Options, str | None], ArgStream]] = {
    _hermes_json: _objects(fenced=True),
    _list_body: _rewriting(_objects(fenced=True), (("<response>", ""), ("</response>", ""))),
    _hermes_fn: _sep(_hermes_fn_name, ">"),
    json_list_body: _objects(fenced=True),
    json_call_body: _objects(),
    apertus_body: _objects(name_key=True),
    json_lines_body: _objects(lines=True),
    _llama3_calls: _objects(lines=True, seps=";", args=("parameters", "arguments")),
    _generic_calls: _objects(document=True, fenced=True),
    _bare_call: _objects(fenced=True),
    _pythonic_calls: lambda opts, name: PyCalls(opts),
    command_r_body: _objects(
        names=("tool_name",), args=("parameters",), ids=("tool_call_id",), fenced=True
    ),
    deepseek_v3_1_body: _sep(_plain_name, "<｜tool▁sep｜>", begin=_DS_BEGIN, end=_DS_END),
    kimi_k2_body: _sep(
        _kimi_name, "<|tool_call_argument_begin|>", begin=_KIMI_BEGIN, end=_KIMI_END
    ),
    functionary_v3_1_body: _sep(_plain_name, ">"),
    _deepseek_body: _rewriting(  # (as DeepSeek R1's reader rewrites its text)
        _sep(_r1_name, "\n", begin=_DS_BEGIN, end=_DS_END, fenced=True, begin_splits=False),
        (("<｜tool▁calls｜>", "<｜tool▁calls▁begin｜>" + _DS_BEGIN), ("<｜tool▁calls▁end｜>", "")),
    ),
    solar_body: _sep(_solar_name, "<|tool_call:args|>"),
    mistral_body: _sep(_mistral_name, "[ARGS]", begin="[TOOL_CALLS]", first=True),
    qwen3_coder_body: _markup(_QWEN),
    seed_oss_body: _markup(_SEED),
    minimax_body: _markup(_MINIMAX),
    dsml_body: _markup(_DSML),
    minicpm5_body: _markup(_MINICPM),
    muse_body: _markup(_MUSE),
    gemma4_body: lambda opts, name: GemmaArgs(opts),
    kimi_k3_body: _markup(_K3),
    minimax_m3_body: lambda opts, name: MiniMaxM3(opts),
    hy3_body: lambda opts, name: SepPairs(
        opts,
        Tags("", f"</tool_call:{_HY}>", f"<arg_key:{_HY}>", f"</arg_value:{_HY}>"),
        f"</arg_key:{_HY}>",
        f"<arg_value:{_HY}>",
        f"<tool_call:{_HY}>",
        f"<tool_sep:{_HY}>",
    ),
    glm_body: _pairs(
        Tags("", "</tool_call>", "<arg_key>", "</arg_value>"), "</arg_key>", "<arg_value>"
    ),
}


@dataclass
class Tracked:
    """The region a stream of arguments follows: where its body starts in the whole
    generation, the number of its first call, and its stream."""

    start: int
    base: int
    stream: ArgStream


def arg_stream(region: OpenRegion, opts: Options) -> tuple[ArgStream, str] | None:
    """The stream of arguments for ``region`` and the text to feed it before the
    region's own (the marker a wrapping reader puts back), or None: sent whole."""
    body, prefix = region.body, ""
    inner = getattr(body, "inner", None)
    if inner is not None:
        body, prefix = inner, body.prefix
    if body == "arguments":  # the region is the arguments of a call named by its header
        if not region.name:
            return None
        return SepJson(opts, _plain_name, "", name=region.name), ""
    make = _STREAMS.get(body)
    if make is None:
        return None
    stream = make(opts, region.name)
    stream.end_at(region.end)
    if isinstance(stream, Markup):
        prefix = stream.t.prefix + prefix
    return stream, prefix
