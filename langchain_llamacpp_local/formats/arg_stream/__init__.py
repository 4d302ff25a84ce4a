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
the option.

Each body reader declares the stream that reads its region as it does
(:func:`~..syntax.reads`); a family whose calls do not stream says so on its record.
The streams by how arguments are written: :mod:`.json_calls` (JSON after a header or in
call objects), :mod:`.markup` (parameter tags), :mod:`.python_calls` (a pythonic list),
:mod:`.gemma` (Gemma 4's notation); :mod:`.core` holds what they share.
"""

from langchain_llamacpp_local.formats.arg_stream.core import (
    ArgStream,
    Fragment,
    StreamMaker,
    Tracked,
    spoiler,
)

__all__ = ["ArgStream", "Fragment", "StreamMaker", "Tracked", "spoiler"]
