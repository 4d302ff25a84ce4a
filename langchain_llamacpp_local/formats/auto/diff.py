"""Diffing two renders of a template (llama.cpp's ``chat-auto-parser-helpers.cpp``).

``calculate_diff_split`` splits two texts into a common prefix, a common suffix and
the two differing middles, comparing ``<...>``/``[...]`` markers whole so that a
marker is never cut in two; the small regex helpers stand in for the PEG parsers
llama.cpp uses to find markers around a sentinel.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# =========================================================================== diff helpers


@dataclass(frozen=True)
class Segment:
    """A piece of rendered text: a ``<...>``/``[...]`` marker or plain text."""

    marker: bool
    value: str


def segmentize_markers(text: str) -> list[Segment]:
    """Split text into markers (``<...>``, ``[...]``) and the text between them."""
    out: list[Segment] = []
    in_marker = False
    opener = ""
    last = 0
    for pos, ch in enumerate(text):
        if not in_marker and ch in "<[":
            if last < pos:
                out.append(Segment(False, text[last:pos]))
            last = pos
            in_marker = True
            opener = ch
        elif in_marker and ((opener == "<" and ch == ">") or (opener == "[" and ch == "]")):
            out.append(Segment(True, text[last : pos + 1]))
            last = pos + 1
            in_marker = False
    if last < len(text):
        out.append(Segment(False, text[last:]))
    return out


def prune_whitespace_segments(segments: list[Segment]) -> list[Segment]:
    return [s for s in segments if s.value.strip()]


def common_text_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _common_suffix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(reversed(a), reversed(b), strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class DiffSplit:
    """Two texts as ``prefix + left + suffix`` and ``prefix + right + suffix``."""

    prefix: str = ""
    suffix: str = ""
    left: str = ""
    right: str = ""


def calculate_diff_split(left: str, right: str) -> DiffSplit:
    """Common prefix/suffix and the differing middles, never cutting a marker in two.

    A faithful port of ``calculate_diff_split`` (chat-auto-parser-helpers.cpp:87):
    markers are compared whole, plain text character by character.
    """
    ls, rs = segmentize_markers(left), segmentize_markers(right)
    if not ls:
        return DiffSplit(right=right)
    if not rs:
        return DiffSplit(left=left)
    prefix, suffix = "", ""
    l0, l1, r0, r1 = 0, len(ls) - 1, 0, len(rs) - 1
    l_done = r_done = False
    while l0 != l1 and r0 != r1:
        advanced = False
        if ls[l0] == rs[r0]:
            prefix += ls[l0].value
            l0 += 1
            r0 += 1
            advanced = True
        if ls[l1] == rs[r1]:
            suffix = ls[l1].value + suffix
            if l0 != l1:
                l1 -= 1
            else:
                l_done = True
            if r0 != r1:
                r1 -= 1
            else:
                r_done = True
            advanced = True
        if not advanced:
            break
    if l0 == l1 and r0 != r1:
        if ls[l0] == rs[r1]:
            suffix = rs[r1].value + suffix
            r1 -= 1
            l_done = True
        elif ls[l0] == rs[r0]:
            prefix += rs[r0].value
            r0 += 1
            l_done = True
    elif r0 == r1 and l0 != l1:
        if ls[l1] == rs[r0]:
            suffix = ls[l1].value + suffix
            l1 -= 1
            r_done = True
        elif ls[l0] == rs[r0]:
            prefix += ls[l0].value
            l0 += 1
            r_done = True
    elif l0 == l1 and r0 == r1 and ls[l0] == rs[r0] and ls[l0].marker:
        prefix += rs[r0].value
        l_done = r_done = True

    text_suffix_ok = not ls[l1].marker and not rs[r1].marker
    text_prefix_ok = not rs[r0].marker and not ls[l0].marker
    rem_l = "".join(s.value for s in ls[l0 : (l1 if l_done else l1 + 1)])
    rem_r = "".join(s.value for s in rs[r0 : (r1 if r_done else r1 + 1)])
    suf_len = _common_suffix_len(rem_l, rem_r) if text_suffix_ok else 0
    pre_len = (
        common_text_prefix_len(rem_l[: len(rem_l) - suf_len], rem_r[: len(rem_r) - suf_len])
        if text_prefix_ok
        else 0
    )
    prefix += rem_l[:pre_len]
    suffix = rem_l[len(rem_l) - suf_len :] + suffix
    d_left = rem_l[pre_len : len(rem_l) - suf_len]
    d_right = rem_r[pre_len : len(rem_r) - suf_len]
    if not d_left and not d_right:
        return DiffSplit(prefix=left)
    if not d_left and d_right and right.startswith(left):
        return DiffSplit(prefix=left, right=right[len(left) :])
    return DiffSplit(prefix, suffix, d_left, d_right)


def until_common_prefix(full: str, left: str, right: str) -> str:
    """``full`` up to the first occurrence of the common prefix of ``left`` and ``right``."""
    n = common_text_prefix_len(left, right)
    if n == 0:
        return ""
    pos = full.find(left[:n])
    return "" if pos < 0 else full[:pos]


def after_common_suffix(full: str, left: str, right: str) -> str:
    """``full`` after the last occurrence of the common suffix of ``left`` and ``right``."""
    n = _common_suffix_len(left, right)
    if n == 0:
        return ""
    common = left[len(left) - n :]
    pos = full.rfind(common)
    return "" if pos < 0 else full[pos + n :]


# --------------------------------------------------------------------------- PEG stand-ins
# llama.cpp matches these shapes with small PEG parsers; plain regexes suffice
# because every repetition there is possessive and markers are unambiguous.

MARKER = r"(?:<[^>]*>|\[[^\]]*\])"
MARKER_RE = re.compile(MARKER)


def marker_at(text: str, pos: int) -> re.Match[str] | None:
    return MARKER_RE.match(text, pos)


def until_marker(text: str, start: int = 0) -> int:
    """Index of the first complete marker at or after ``start`` (len(text) if none)."""
    m = MARKER_RE.search(text, start)
    return m.start() if m else len(text)


def last_marker_tail(text: str) -> str | None:
    """The last marker of ``text`` and everything after it (llama.cpp's ``last_marker``)."""
    last = None
    for m in MARKER_RE.finditer(text):
        last = m
    return text[last.start() :] if last else None


def last_marker_of(text: str) -> str:
    last = None
    for m in MARKER_RE.finditer(text):
        last = m
    return last.group(0) if last else ""


def first_marker(text: str) -> str:
    m = MARKER_RE.search(text)
    return m.group(0) if m else ""


def wrapped_between(text: str, needle: str) -> tuple[str, str] | None:
    """``marker + space + needle + space + marker + space`` anywhere: (pre, post)."""
    m = re.search(rf"({MARKER}\s*){re.escape(needle)}(\s*{MARKER}\s*)", text)
    return (m.group(1), m.group(2)) if m else None
