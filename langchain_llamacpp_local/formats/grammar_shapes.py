"""How a family's forced calls are written: the shapes its record gives :mod:`.grammars`.

:class:`JsonCalls` for JSON after an opening marker, :class:`Markup` for the family's own
markup, with the GBNF pieces the records' markup lambdas share.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class JsonCalls:
    """Forced calls written as JSON after an ``opening`` marker.

    ``shape``: ``list``, one JSON list of calls; ``object``, one call object per opening
    marker; ``lines``, call objects one per line; ``each``, every call wrapped in
    ``opening``/``closing``, ``sep`` between them; ``document``, the generic
    ``{"tool_calls": [...]}``. ``call``: ``named`` is ``{"name", args_key}``, ``name_key``
    ``{"NAME": {arguments}}``, ``cohere`` ``{"tool_call_id", "tool_name", "parameters"}``.
    The opening text is also where a lazy grammar starts.
    """

    opening: str = ""
    closing: str = ""
    shape: Literal["list", "object", "lines", "each", "document"] = "list"
    sep: str = ""
    call: Literal["named", "name_key", "cohere"] = "named"
    args_key: str = "arguments"


def gbnf_literal(text: str) -> str:
    """A GBNF string literal (UTF-8 kept raw: GBNF reads ``\\u`` escapes one code point
    at a time, so JSON's surrogate pairs would be wrong)."""
    return json.dumps(text, ensure_ascii=False)


#: How many calls a grammar allows: ``True`` any number, ``False`` one, an int ``n`` at
#: most ``n`` (one allowed, one more written only to be reported, never cut off unseen).
Calls = bool | int


def more_calls(item: str, parallel: Calls) -> str:
    """GBNF for the calls after the first (``item``: a separator and one call)."""
    if parallel is True:
        return f" ({item})*"
    if parallel is False or parallel <= 1:
        return ""
    return f" ({item}){{0,{parallel - 1}}}"


def repeat(one: str, parallel: Calls, sep: str = "") -> str:
    """GBNF for ``one`` call and as many more as ``parallel`` allows, ``sep`` between."""
    glue = f"{gbnf_literal(sep)} " if sep else ""
    return f"{one}{more_calls(glue + one, parallel)}"


@dataclass(frozen=True)
class Markup:
    """Forced calls in the family's own markup; ``arg`` gets (key, value rule, is raw string)."""

    #: whole output for the calls (rule of one call, how many: :data:`Calls`) -> GBNF
    block: Callable[[str, Calls], str]
    #: (name literal, args expression) -> one call
    call: Callable[[str, str], str]
    arg: Callable[[str, str, bool], str] | None = None  # None: arguments are one JSON object
    closer: str = ""  # what ends a raw string value
    quote: str = ""  # around a raw string value (Gemma 4's <|"|>)
    sep: str = ""  # between arguments
    sorted_keys: bool = False  # the template writes arguments in key order
    #: a union with ``string`` is written as raw text (DSML marks JSON ones instead)
    raw_unions: bool = True
