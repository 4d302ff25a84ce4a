"""Tool-call and reasoning parsing for the output formats of the model families llama.cpp handles.

Pure functions (no model needed):

- :func:`detect_handler` names the handler llama.cpp 0.3.36 picks for a chat template
  (a specialized family or its differential auto-parser) and :func:`detect_format` the
  output syntax we parse for it;
- :func:`parse` splits a finished generation into content, reasoning and tool calls;
- :class:`StreamParser` does the same incrementally, never letting a half-written marker
  through as content.

Parsing never raises on model output: anything malformed becomes an ``invalid_tool_calls``
entry with the raw text and a reason.
"""

from langchain_llamacpp_local.formats.detect import detect_format, detect_handler
from langchain_llamacpp_local.formats.parsers import FORMATS, ParsedOutput, new_call_id, parse
from langchain_llamacpp_local.formats.stream_parser import DeltaKind, StreamDelta, StreamParser

__all__ = [
    "FORMATS",
    "ParsedOutput",
    "DeltaKind",
    "StreamDelta",
    "StreamParser",
    "detect_format",
    "detect_handler",
    "new_call_id",
    "parse",
]
