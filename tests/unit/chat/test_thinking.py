"""The thinking markers the worker is given and the grammar that lets a constrained
answer follow a thinking block, per family of the registry."""

from __future__ import annotations

import pytest

from langchain_llamacpp_local.chat.thinking import grammar_after_thinking, markers
from langchain_llamacpp_local.formats.registry import FAMILIES
from langchain_llamacpp_local.llama.json_grammar import JSON_OBJECT_GRAMMAR, check_grammar

THINKING = sorted(name for name in FAMILIES if markers(name) is not None)


def test_apriel_thinks_from_its_prompts_lead_in() -> None:
    assert markers("apriel") == (
        "Here are my reasoning steps:\n",
        "[BEGIN FINAL RESPONSE]",
        "[BEGIN FINAL RESPONSE]",
    )


@pytest.mark.parametrize("name", THINKING)
@pytest.mark.parametrize("opened", [False, True])
def test_the_grammar_after_thinking_is_valid(name: str, opened: bool) -> None:
    start, _end, close = markers(name) or ("", "", "")
    prefill = "<|assistant|>" + (start if opened else "")
    grammar = grammar_after_thinking(JSON_OBJECT_GRAMMAR, name, prefill)
    check_grammar(grammar)
    if grammar == JSON_OBJECT_GRAMMAR:  # markup between the block and the answer
        assert FAMILIES[name].channel_markup
        return
    first = grammar.splitlines()[0]
    assert f'"{close}"' in first or close.replace('"', '\\"') in first
    # optional unless the prompt opened the block
    assert first.startswith("root ::= (") != opened
