"""Grammars for a reply of calls or a typed answer, and how many calls they allow."""

from __future__ import annotations

import re

import pytest

from langchain_llamacpp_local.formats.grammars import (
    either_grammar,
    prefix_rules,
    tool_call_grammar,
)
from langchain_llamacpp_local.templates.chat_template import ChatTemplate
from tests.llama_cpp_cases import TEMPLATES

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _rules(grammar: str) -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9-]+) ::=", grammar, re.M))


def test_prefix_rules_renames_rules_and_leaves_literals_and_counts() -> None:
    g = 'root ::= "root space" space x{2,3}\nspace ::= " "?\nx ::= [a-z] "\\"root"'
    out = prefix_rules(g, "p-")
    assert _rules(out) == {"p-root", "p-space", "p-x"}
    assert '"root space" p-space p-x{2,3}' in out and '"\\"root"' in out


def test_either_grammar_keeps_the_two_grammars_apart() -> None:
    calls, _ = tool_call_grammar([TOOL], "hermes", parallel=False)
    out = either_grammar(calls, 'root ::= "{" space "}"\nspace ::= " "?')
    assert out.startswith("root ::= calls-root | answer-root")
    rules = _rules(out)
    assert {"calls-space", "answer-space", "calls-root", "answer-root"} <= rules
    assert len(re.findall(r"^root ::=", out, re.M)) == 1


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "mistral_nemo", "generic"])
def test_calls_allowed_true_any_false_one_n_at_most_n(fmt: str) -> None:
    any_n, _ = tool_call_grammar([TOOL], fmt, parallel=True)
    one, _ = tool_call_grammar([TOOL], fmt, parallel=False)
    two, _ = tool_call_grammar([TOOL], fmt, parallel=2)
    assert "{0,1}" in two  # the first call and at most one more
    assert "{0,1}" not in any_n and "{0,1}" not in one and any_n != one


@pytest.mark.parametrize(
    ("template", "parallel"),
    [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", True),
        ("Qwen3-Coder.jinja", True),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", False),  # one call per message
        ("google-gemma-2-2b-it.jinja", False),  # no tool calls at all
    ],
)
def test_parallel_calls_are_probed_from_the_template(template: str, parallel: bool) -> None:
    source = (TEMPLATES / template).read_text(encoding="utf-8")
    assert ChatTemplate(source).supports_parallel_tool_calls is parallel
