"""Generated text as it streams: stop strings and UTF-8 split over tokens.

:class:`StopMatcher` and :class:`Utf8Decoder` make streaming safe: a stop string is
never partly emitted and a character split over tokens is emitted once whole.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class StopMatcher:
    """Applies stop strings to generated text while streaming, never emitting a
    partial stop string.

    Text is held back only while its tail could still become a stop string; the
    emitted text is always the generated text cut at the earliest stop occurrence.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stops = sorted({s for s in stop if s}, key=len)
        self._buf = ""
        self.stopped = False

    def _potential_start(self) -> int | None:
        """Earliest index whose suffix is a proper prefix of some stop string."""
        buf = self._buf
        longest = max((len(s) for s in self._stops), default=0)
        for j in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[j:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self._stops):
                return j
        return None

    def _first_match(self) -> int | None:
        found = [i for s in self._stops if (i := self._buf.find(s)) >= 0]
        return min(found) if found else None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        self._buf += text
        match = self._first_match()
        held = self._potential_start()
        if match is not None and (held is None or match <= held):
            out, self._buf, self.stopped = self._buf[:match], "", True
            return out, True
        cut = len(self._buf) if held is None else held
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out, False

    def flush(self) -> str:
        """Held-back text at the end of generation (cut at a stop string that matched
        while a longer, earlier one could still have completed)."""
        if self.stopped:
            return ""
        match = self._first_match()
        out = self._buf if match is None else self._buf[:match]
        self.stopped = match is not None
        self._buf = ""
        return out


class Utf8Decoder:
    """Turns token pieces (bytes) into text incrementally; a multi-byte character
    split across tokens is emitted once complete."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        return self._dec.decode(piece, final=False)

    def flush(self) -> str:
        """Pending bytes of an incomplete character become U+FFFD."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out
