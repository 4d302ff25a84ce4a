"""Forced and lazy tool-call grammars in the models' own markup, on real llama.cpp.

A random tiny model sampled under a family's grammar must write a call that the
family's own parser reads back as the forced tool, with arguments typed by the tool's
schema; under the lazy grammar the model's free text ends at the family's opening
marker and the call after it is held to the same syntax.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from langchain_llamacpp_local.formats import parse
from langchain_llamacpp_local.formats.grammars import tool_call_grammar
from langchain_llamacpp_local.formats.registry import FAMILIES, Markup
from langchain_llamacpp_local.llama.sampling import SamplingParams
from tests.gguf_models import write_scripted_llama
from tests.sampling_support import TOOLS, TinyModel
from tests.sampling_support import validate as _validate

TYPED = {
    "type": "function",
    "function": {
        "name": "typed",
        "description": "One parameter of each JSON type.",
        "parameters": {
            "type": "object",
            "properties": {
                "note": {"type": "string", "maxLength": 4},
                "n": {"type": "number"},
                "flag": {"type": "boolean"},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 2},
                    "maxItems": 2,
                },
                "opt": {"type": ["integer", "null"]},
                "size": {"type": "string", "enum": ["1", "big"]},
            },
            "required": ["note", "n", "flag", "tags", "size"],
        },
    },
}
ALL_TOOLS: list[dict[str, Any]] = [*TOOLS, TYPED]
SCHEMAS = {
    t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in ALL_TOOLS
}
FORMATS = sorted(f.name for f in FAMILIES.values() if isinstance(f.grammar, Markup))


def _check_one_call(text: str, fmt: str, name: str | None) -> dict[str, Any]:
    out = parse(text, fmt, tools=ALL_TOOLS)
    assert not out.invalid_tool_calls and len(out.tool_calls) == 1, (text, out)
    call = out.tool_calls[0]
    if name is not None:
        assert call["name"] == name, (text, call)
    _validate(call["args"], SCHEMAS[call["name"]])
    return call


@pytest.mark.parametrize("name", ["book", "typed"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_call_in_the_models_syntax(tiny: TinyModel, fmt: str, name: str) -> None:
    grammar, used = tool_call_grammar(ALL_TOOLS, fmt, parallel=False, name=name)
    assert used == fmt  # no fallback to the generic JSON object
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 1000)
    assert ended, text
    assert text.startswith(FAMILIES[fmt].triggers), text
    call = _check_one_call(text, fmt, name)
    if name == "typed":  # schema types survive the markup: numbers, booleans, lists
        args = call["args"]
        assert isinstance(args["n"], (int, float)) and not isinstance(args["n"], bool)
        assert isinstance(args["flag"], bool) and isinstance(args["tags"], list)
        assert args["size"] in ("1", "big")  # a string enum stays a string, even "1"


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_any_tool_sampled(tiny: TinyModel, fmt: str) -> None:
    grammar, _ = tool_call_grammar(ALL_TOOLS, fmt, parallel=False)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    text, ended = tiny.generate(params.replace(grammar=grammar), 1000)
    assert ended, text
    _check_one_call(text, fmt, None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_parallel_grammar_reads_back_every_call(tiny: TinyModel, fmt: str) -> None:
    grammar, _ = tool_call_grammar(ALL_TOOLS, fmt, parallel=True)
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 400)
    assert text.startswith(FAMILIES[fmt].triggers), text
    if ended:
        out = parse(text, fmt, tools=ALL_TOOLS)
        assert out.tool_calls and not out.invalid_tool_calls, (text, out)


def test_raw_string_values_may_hold_markup_but_not_the_closer(tmp_path: Path) -> None:
    """An unbounded string value is raw text up to the closing tag: ``<`` and partial
    closers are allowed, the closer itself ends the value."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "w",
                "parameters": {
                    "type": "object",
                    "properties": {"s": {"type": "string"}},
                    "required": ["s"],
                },
            },
        }
    ]
    grammar, _ = tool_call_grammar(tools, "minimax_m2", parallel=False)
    # "<<", a partial closer, and a "<" right before the closer are all text
    chunks = ['<minimax:tool_call>\n<invoke name="w">\n<parameter name="s">', "a<"]
    chunks += ["<b></par", "<", "</parameter>\n</invoke>\n</minimax:tool_call>"]
    model = _scripted(tmp_path, chunks)
    try:
        text, ended = model.generate(SamplingParams(temperature=0, grammar=grammar), 200, "x")
    finally:
        model.close()
    assert ended and text == "".join(chunks), text
    assert parse(text, "minimax_m2", tools=tools).tool_calls[0]["args"] == {"s": "a<<b></par<"}


def _scripted(tmp_path: Path, chunks: list[str]) -> TinyModel:
    """A model whose greedy output after the prompt ``x`` is ``chunks``, one token each
    (a chunk longer than a character is an extra token of the vocabulary, as markers
    are in real ones); after the last one, end of generation."""
    assert len(set(chunks)) == len(chunks), chunks
    transitions: dict[str, dict[str, float]] = {}
    prev = "x"
    for tok in chunks:
        transitions[prev] = {tok: 10.0}
        prev = tok
    extra = tuple(c for c in chunks if len(c) > 1)
    path = write_scripted_llama(
        tmp_path / "scripted.gguf", transitions=transitions, extra_tokens=extra
    )
    return TinyModel(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_lazy_grammar_starts_at_the_marker(tmp_path: Path, fmt: str) -> None:
    """With tool_choice="auto", free text runs until the model writes the family's
    opening marker (one token, as in the real vocabularies); from there on the call
    must follow the grammar, and the parser reads the text before it as content."""
    trigger = FAMILIES[fmt].triggers[0]
    grammar, _ = tool_call_grammar(ALL_TOOLS, fmt, parallel=False, name="get_weather")
    model = _scripted(tmp_path, ["O", "K", trigger])
    try:
        params = SamplingParams(
            temperature=0, grammar=grammar, grammar_lazy_triggers=FAMILIES[fmt].triggers
        )
        text, ended = model.generate(params, 300, "x")
    finally:
        model.close()
    assert ended and text.startswith("OK" + trigger), text
    out = parse(text, fmt, tools=ALL_TOOLS)
    assert out.content.strip() == "OK", (text, out)
    assert [c["name"] for c in out.tool_calls] == ["get_weather"], (text, out)
    assert not out.invalid_tool_calls
    _validate(out.tool_calls[0]["args"], SCHEMAS["get_weather"])


def test_forced_call_closes_a_think_block_the_prompt_opened(tiny: TinyModel) -> None:
    """MiniMax M2's generation prompt opens ``<think>``: a call written inside it would be
    read as reasoning, so the forced grammar closes the block first."""
    prefill = "]~b]ai\n<think>\n"
    grammar, _ = tool_call_grammar(
        ALL_TOOLS, "minimax_m2", parallel=False, name="get_weather", prefill=prefill
    )
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 1000)
    assert ended and text.startswith("</think>"), text
    out = parse(text, "minimax_m2", tools=ALL_TOOLS, prefill=prefill)
    assert [c["name"] for c in out.tool_calls] == ["get_weather"], (text, out)
    assert not out.invalid_tool_calls and not out.content.strip()
    closed, _ = tool_call_grammar(ALL_TOOLS, "minimax_m2", prefill="]~b]ai\n<think>\n</think>\n")
    assert closed.startswith('root ::= "<minimax:tool_call>'), closed[:80]


def test_arguments_without_properties_fall_back_to_the_generic_object() -> None:
    """Free-form arguments (``additionalProperties`` only) cannot be written one tag each:
    such a call is forced in the generic JSON object, which the caller then parses."""
    free = {
        "type": "function",
        "function": {
            "name": "free",
            "parameters": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    }
    grammar, used = tool_call_grammar([free], "qwen3_coder", parallel=False)
    assert used == "generic" and "tool_call" in grammar
    # the JSON-argument families write it as they always do
    assert tool_call_grammar([free], "kimi_k2", parallel=False)[1] == "kimi_k2"
