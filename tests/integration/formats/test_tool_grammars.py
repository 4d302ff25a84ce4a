"""Forced and lazy tool-call grammars of the marker-wrapped JSON formats, on a real model.

The grammar built for a format must make a random tiny model write calls that our parser
for the same format reads back as valid calls of the bound tools.
"""

from __future__ import annotations

import pytest

from langchain_llamacpp_local.formats import parse
from langchain_llamacpp_local.formats.grammars import tool_call_grammar
from langchain_llamacpp_local.formats.registry import FAMILIES, JsonCalls
from langchain_llamacpp_local.llama.sampling import SamplingParams
from tests.sampling_support import PARAMS as _PARAMS
from tests.sampling_support import TOOLS, TinyModel
from tests.sampling_support import validate as _validate

#: the formats whose calls are JSON after an opening marker
WRAPPED = sorted(
    f.name
    for f in FAMILIES.values()
    if isinstance(f.grammar, JsonCalls) and f.grammar.shape in ("list", "object", "lines")
)


# one format per shape (list, object, lines, {name: args}, command-r keys): generation is slow
@pytest.mark.parametrize(
    "fmt", ["nemotron_v2", "gigachat_v3_1", "minimax_m1", "apertus", "command_r7b"]
)
def test_wrapped_grammar_output_parses_as_valid_calls(tiny: TinyModel, fmt: str) -> None:
    grammar, used = tool_call_grammar(TOOLS, fmt, parallel=False)
    assert used == fmt
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 300)
    assert ended and text.startswith(FAMILIES[fmt].triggers[0]), text
    out = parse(text, fmt, tools=TOOLS)
    assert len(out.tool_calls) == 1 and not out.invalid_tool_calls, (text, out)
    _validate(out.tool_calls[0]["args"], _PARAMS[out.tool_calls[0]["name"]])


@pytest.mark.parametrize("fmt", WRAPPED)
def test_parallel_grammar_compiles_and_starts_with_its_trigger(tiny: TinyModel, fmt: str) -> None:
    grammar, _ = tool_call_grammar(TOOLS, fmt, parallel=True)
    text, _ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 12)
    assert text.startswith(FAMILIES[fmt].triggers[0][:4]), text


@pytest.mark.parametrize("fmt", WRAPPED)
def test_forced_name(tiny: TinyModel, fmt: str) -> None:
    grammar, _ = tool_call_grammar(TOOLS, fmt, parallel=False, name="now")
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 120)
    assert ended, text
    out = parse(text, fmt, tools=TOOLS)
    assert [c["name"] for c in out.tool_calls] == ["now"], (text, out)
