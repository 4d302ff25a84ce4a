"""The argument stream of Gemma 4's ``call:NAME{key:<|"|>text<|"|>,n:1}`` notation."""

from __future__ import annotations

import json
import re

from langchain_llamacpp_local.formats.arg_stream.core import ArgStream, StreamMaker, escaped
from langchain_llamacpp_local.formats.base import Options, held_suffix
from langchain_llamacpp_local.formats.values import GEMMA_KEY, GEMMA_QUOTE

_GEMMA_KEY_START = re.compile(r"[A-Za-z_][\w.\-]*\s*")
_GEMMA_NAME = re.compile(r"[\w.\-]")


class GemmaArgs(ArgStream):
    """Gemma 4's ``call:NAME{key:<|"|>text<|"|>,n:1}``, converted to JSON as it is written
    the way :func:`~..values.gemma_value` converts it whole: a ``<|"|>`` string becomes a
    JSON string, a bare key after ``{`` or ``,`` a quoted one, any other character is
    copied; a suffix that may start ``<|"|>`` or the region's end is held back."""

    def __init__(self, opts: Options, end: str) -> None:
        super().__init__(opts, (GEMMA_QUOTE, end))
        self.end = end  # the call region's end marker
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
                j = pend.find(GEMMA_QUOTE)
                if j >= 0:
                    self.emit(escaped(pend[:j]) + '"')
                    pend, self.state, self.prev_ok = pend[j + len(GEMMA_QUOTE) :], "out", False
                    continue
                keep = held_suffix(pend, (GEMMA_QUOTE,))
                if len(pend) > keep:
                    self.emit(escaped(pend[: len(pend) - keep]))
                pend = pend[len(pend) - keep :]
                break
            if pend.startswith(self.end):
                self.state, pend = "done", ""
                break
            if pend.startswith(GEMMA_QUOTE):
                self.emit('"')
                pend, self.state = pend[len(GEMMA_QUOTE) :], "str"
                continue
            if GEMMA_QUOTE.startswith(pend) or self.end.startswith(pend):
                break  # a marker may be being written
            c = pend[0]
            if self.prev_ok and (c == "_" or c.isascii() and c.isalpha()):
                m = GEMMA_KEY.match(pend)
                if m:
                    self.emit(json.dumps(m.group(1), ensure_ascii=False) + ":")
                    pend, self.prev_ok = pend[m.end() :], False
                    continue
                if _GEMMA_KEY_START.fullmatch(pend):
                    break  # a key still being written
            self.emit(c)
            pend, self.prev_ok = pend[1:], c in "{,"
        self.pend = pend


def gemma_args(end: str) -> StreamMaker:
    """The stream of Gemma 4's call region that ``end`` closes."""
    return lambda opts, name: GemmaArgs(opts, end)
