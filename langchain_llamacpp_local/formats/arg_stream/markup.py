"""Argument streams of calls whose parameters are markup tags (``<parameter=k>v</parameter>``
and the like): each text value is sent, escaped, as it comes; a value the parse may read
as something other than text is sent once closed, as the parse types it. A family's
:class:`Tags` are defined once, beside its body reader, and read by both."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from langchain_llamacpp_local.formats.arg_stream.core import (
    ArgStream,
    StreamMaker,
    dumps,
    escaped,
)
from langchain_llamacpp_local.formats.base import Options, held_suffix, typed_value
from langchain_llamacpp_local.formats.values import MM_MARKER, mm_value


@dataclass(frozen=True)
class Tags:
    """A markup family's call and parameter tags: ``call_open NAME name_stop``, then one
    of ``name_tails``; ``param_open KEY key_stop`` then one of ``key_tails`` (its
    number: the value's mode, for DSML's ``string="true|false"``); a name or key cannot
    hold a character of ``bad``; ``framed``: one newline after the key's tag and one
    before the closing tag are framing, not value. Key/value pairs (GLM, Hy3):
    ``param_open KEY key_stop``, then ``value_open VALUE param_close``; Hy3's calls
    begin at ``call_open``, the name running to ``name_stop``."""

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
    value_open: str = ""  # key/value pairs: the tag that opens a value after its key

    @classmethod
    def quoted(
        cls, call_open: str, call_close: str, param_open: str, param_close: str, **kw: Any
    ) -> Tags:
        """Tags whose name and key are quoted attributes (``<invoke name="X">``)."""
        quoting: dict[str, Any] = {
            "name_stop": '"',
            "name_tails": (">",),
            "key_stop": '"',
            "key_tails": (">",),
            "bad": "",
        }
        return cls(call_open, call_close, param_open, param_close, **{**quoting, **kw})


_CDATA = "<![CDATA["
#: how a value the parse may read as a JSON number, string or container can start
_JSONISH = frozenset('{["-0123456789')
#: the words it may read as a literal (JSON's, Python's, and those ``json`` accepts)
_WORDS = ("true", "false", "null", "NaN", "Infinity", "True", "False", "None")


class Markup(ArgStream):
    """Calls written in a markup family's tags (Qwen3-Coder, Seed-OSS, MiniMax M2,
    DeepSeek DSML, MiniCPM5, Muse, Kimi K3), read as their body readers
    (:func:`~...markup_bodies.xml_function_calls`, :func:`~...markup_bodies.kimi_k3_body`)
    read them."""

    def __init__(self, opts: Options, tags: Tags) -> None:
        t = tags
        markers = (t.call_open, t.call_close, t.param_open, t.param_close)
        super().__init__(opts, markers)
        self.t = tags
        self.prefix = tags.prefix
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
            self.emit(escaped("".join(self.val[self.sent : safe])))
            self.sent = safe

    def _close(self, value: str) -> None:
        if not self.streaming:
            return
        if self.decided == "str":
            self.emit(escaped(value[self.sent :]) + '"')
            return
        typed = self._typed(value)
        sep = "," if self.n_params else ""
        self.n_params += 1
        self.emit(sep + json.dumps(self.key, ensure_ascii=False) + ":" + dumps(typed))

    def _typed(self, value: str) -> Any:
        """A closed value not sent as text, as the parse types it."""
        text = value
        if self.t.cdata and text.startswith(_CDATA) and text.endswith("]]>"):
            text = text[len(_CDATA) : -len("]]>")]
        return text if self.mode == "raw" else typed_value(text, self._types())


def _mode(got: int | re.Match[str], modes: tuple[str, ...]) -> str:
    """A key's value mode from how its tag ended (a tail's number, or Kimi K3's type)."""
    if isinstance(got, re.Match):
        kind = got.group(1) if got.re.groups else None
        return "schema" if kind is None else "raw" if kind == "string" else "type:" + kind
    return modes[got]


class ArgPairs(Markup):
    """GLM's ``NAME<arg_key>k</arg_key><arg_value>v</arg_value>...``, one call per region
    (its end, ``tags.call_close``, closes the call), read as
    :func:`~...markup_bodies.glm_body` reads it."""

    def __init__(self, opts: Options, tags: Tags) -> None:
        super().__init__(opts, tags)
        key_close, value_open = tags.key_stop, tags.value_open
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


class SepPairs(ArgPairs):
    """Hy3's ``<tool_call:…>NAME<tool_sep:…><arg_key:…>k</arg_key:…><arg_value:…>v…``:
    calls begin at ``begin`` (ended by ``tags.call_close`` or the next ``begin``), the
    name runs to ``sep``, as :func:`~...markup_bodies.hy3_body` reads them."""

    def __init__(self, opts: Options, tags: Tags) -> None:
        super().__init__(opts, tags)
        begin, sep = tags.call_open, tags.name_stop
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
    ``]<]minimax[>[`` marker), read as :func:`~...families.minimax_m3_body` reads it: a
    ``string`` parameter is its text as written; any other value (text, nested tags, a
    list of ``<item>``) is sent once its tag closes, as the parse types it."""

    def __init__(self, opts: Options, tags: Tags) -> None:
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

    def _typed(self, value: str) -> Any:
        return mm_value(value, self._types())


def markup(tags: Tags) -> StreamMaker:
    """The stream of a region of calls in ``tags`` (:class:`Markup`)."""
    return lambda opts, name: Markup(opts, tags)


def pairs(tags: Tags) -> StreamMaker:
    """The stream of a region that is one call of key/value pairs (:class:`ArgPairs`)."""
    return lambda opts, name: ArgPairs(opts, tags)


def sep_pairs(tags: Tags) -> StreamMaker:
    """The stream of a region of calls of key/value pairs (:class:`SepPairs`)."""
    return lambda opts, name: SepPairs(opts, tags)


def minimax_m3(tags: Tags) -> StreamMaker:
    """The stream of MiniMax M3's call region (:class:`MiniMaxM3`)."""
    return lambda opts, name: MiniMaxM3(opts, tags)
