"""What a body reader says about its syntax, and the argument stream of an open region.

A body reads the inside of one tool-call region into call records. Its record
(:func:`reads`) says whether its quoted values may spell the region's end, which
markers complete a call, and how its arguments stream while written (the family's
record holds its bodies, so everything about a syntax is in one place). A stream parser
asks :func:`stream_for` for the stream of the region the output ends inside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from langchain_llamacpp_local.formats.arg_stream.core import ArgStream, StreamMaker
from langchain_llamacpp_local.formats.arg_stream.json_calls import named_json
from langchain_llamacpp_local.formats.base import OpenRegion, Options, ParsedCall

#: body(region, final, opts) -> calls
Body = Callable[[str, bool, Options], list[ParsedCall]]
_B = TypeVar("_B", bound=Callable[..., Any])


def reads(
    syntax: str | None = None, closers: tuple[str, ...] = (), *, stream: StreamMaker | None
) -> Callable[[_B], _B]:
    """What a body reader's record says about its syntax.

    ``syntax``: its values are quoted strings that may spell the region's closing marker
    (``"json"``, Gemma 4's ``"gemma"``), so the region ends only at a marker outside them.
    ``closers``: the markers whose writing completes one of its calls while the region is
    still open (a stream reads an open region again only when one of them, or the
    region's end, is written). ``stream``: the argument stream that reads its region as
    it does (None: its calls are sent whole, said here rather than left out).
    """

    def mark(body: _B) -> _B:
        body.string_syntax = syntax  # type: ignore[attr-defined]
        body.closers = closers  # type: ignore[attr-defined]
        body.stream = stream  # type: ignore[attr-defined]
        return body

    return mark


def rewrap(prefix: str, suffix: str, body: Body) -> Body:
    """A body that gets its region back with the start (and, once closed, end) marker.

    It completes calls at the same markers; its region ends at the first closing marker;
    its stream is the body's, fed ``prefix`` first.
    """

    def wrapped(region: str, final: bool, opts: Options) -> list[ParsedCall]:
        return body(prefix + region + (suffix if final else ""), final, opts)

    wrapped.prefix = prefix  # type: ignore[attr-defined]
    return reads(None, body.closers, stream=body.stream)(wrapped)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class NamedArguments:
    """A region that is one call's JSON arguments, the call named by a message header
    before it (gpt-oss's ``to=functions.NAME``, Functionary v3.2's ``>>>NAME``): the
    scanner reads the call, :attr:`stream` its arguments."""

    stream: StreamMaker = named_json


NAMED_ARGUMENTS = NamedArguments()


def streams(body: Any) -> bool:
    """Whether ``body`` declares a stream of its arguments."""
    return getattr(body, "stream", None) is not None


def stream_for(region: OpenRegion, opts: Options) -> tuple[ArgStream, str] | None:
    """The stream of arguments for ``region`` and the text to feed it before the
    region's own (the marker a wrapping reader puts back), or None: its calls are sent
    whole. A body that never said how it streams is an error (logged by the stream
    parser), not a call silently sent whole."""
    body = region.body
    if not hasattr(body, "stream"):
        raise LookupError(f"the body reader {body!r} does not say how its arguments stream")
    make: StreamMaker | None = body.stream
    stream = make(opts, region.name) if make is not None else None
    if stream is None:
        return None
    stream.end_at(region.end)
    return stream, stream.prefix + getattr(body, "prefix", "")
