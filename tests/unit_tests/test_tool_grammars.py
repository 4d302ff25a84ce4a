"""Forced and lazy tool-call grammars of the marker-wrapped JSON formats, on a real model.

The grammar built for a format must make a random tiny model write calls that our parser
for the same format reads back as valid calls of the bound tools.
"""

from __future__ import annotations

import pytest

from langchain_llamacpp_local.formats import parse
from langchain_llamacpp_local.llama.sampling import (
    WRAPPED_JSON_FORMATS,
    SamplingParams,
    tool_call_grammar,
)

from .test_sampling import _PARAMS, TOOLS, TinyModel, _validate, tiny  # noqa: F401 (fixture)


# one format per shape (list, object, lines, {name: args}, command-r keys): generation is slow
@pytest.mark.parametrize(
    "fmt", ["nemotron_v2", "gigachat_v3_1", "minimax_m1", "apertus", "command_r7b"]
)
def test_wrapped_grammar_output_parses_as_valid_calls(tiny: TinyModel, fmt: str) -> None:  # noqa: F811
    grammar, used = tool_call_grammar(TOOLS, fmt, parallel=False)
    assert used == fmt
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 300)
    assert ended and text.startswith(WRAPPED_JSON_FORMATS[fmt][0]), text
    out = parse(text, fmt, tools=TOOLS)
    assert len(out.tool_calls) == 1 and not out.invalid_tool_calls, (text, out)
    _validate(out.tool_calls[0]["args"], _PARAMS[out.tool_calls[0]["name"]])


@pytest.mark.parametrize("fmt", sorted(WRAPPED_JSON_FORMATS))
def test_parallel_grammar_compiles_and_starts_with_its_trigger(tiny: TinyModel, fmt: str) -> None:  # noqa: F811
    grammar, _ = tool_call_grammar(TOOLS, fmt, parallel=True)
    text, _ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 12)
    assert text.startswith(WRAPPED_JSON_FORMATS[fmt][0][:4]), text


@pytest.mark.parametrize("fmt", sorted(WRAPPED_JSON_FORMATS))
def test_forced_name(tiny: TinyModel, fmt: str) -> None:  # noqa: F811
    grammar, _ = tool_call_grammar(TOOLS, fmt, parallel=False, name="now")
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 120)
    assert ended, text
    out = parse(text, fmt, tools=TOOLS)
    assert [c["name"] for c in out.tool_calls] == ["now"], (text, out)
