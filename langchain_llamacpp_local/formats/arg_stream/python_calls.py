"""The argument stream of a pythonic list of calls (``[get_weather(city="Paris")]``)."""

from __future__ import annotations

import ast
import json
import re

from langchain_llamacpp_local.formats.arg_stream.core import ArgStream, escaped
from langchain_llamacpp_local.formats.base import Options
from langchain_llamacpp_local.formats.values import py_literal

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
    :mod:`~..classic`'s pythonic reader reads it: a keyword's string literal is decoded
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
            self.emit(escaped(text))

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


def py_calls(opts: Options, name: str | None) -> ArgStream:
    """The stream of a pythonic list of calls (:class:`PyCalls`)."""
    return PyCalls(opts)
