"""Tests for template_analysis.py: llama.cpp's differential template analysis and
the parser driven by it, on llama.cpp's own chat templates (no model needed).

Expectations ported from llama.cpp's ``tests/test-chat-auto-parser.cpp`` cite
their line; the marker table follows ``docs/autoparser.md`` ("Tested Templates").
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from langchain_llamacpp_local.formats.auto import (
    AnalysisParse,
    TemplateAnalysis,
    after_common_suffix,
    analyze_template,
    analyze_template_full,
    calculate_diff_split,
    parse_with_analysis,
    segmentize_markers,
    until_common_prefix,
)
from langchain_llamacpp_local.formats.auto import parser as ta_parser
from langchain_llamacpp_local.formats.auto import probes as ta
from langchain_llamacpp_local.templates.chat_template import ChatTemplate
from tests.llama_cpp_cases import template_file

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "llama_cpp_templates"
ALL_TEMPLATES = sorted(p.name for p in TEMPLATES.glob("*.jinja"))


@functools.cache
def source(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


def compiled(name: str) -> ChatTemplate:
    return template_file(name, bos_token="<s>", eos_token="</s>")


@functools.cache
def analysis(name: str) -> TemplateAnalysis:
    return analyze_template_full(compiled(name))


# ===================================================================== diff helpers


def test_segmentize_markers() -> None:
    """test-chat-auto-parser.cpp:571-635."""

    def seg(text: str) -> list[tuple[bool, str]]:
        return [(s.marker, s.value) for s in segmentize_markers(text)]

    assert seg("pre_marker[marker]post_marker") == [
        (False, "pre_marker"),
        (True, "[marker]"),
        (False, "post_marker"),
    ]
    assert seg("pre_marker<marker>post_marker") == [
        (False, "pre_marker"),
        (True, "<marker>"),
        (False, "post_marker"),
    ]
    assert seg("<hello>world</hello>") == [(True, "<hello>"), (False, "world"), (True, "</hello>")]
    assert seg("<hello>[hello]<world>[world]") == [
        (True, "<hello>"),
        (True, "[hello]"),
        (True, "<world>"),
        (True, "[world]"),
    ]
    assert seg("im<blue>daba<dee>da[hey]") == [
        (False, "im"),
        (True, "<blue>"),
        (False, "daba"),
        (True, "<dee>"),
        (False, "da"),
        (True, "[hey]"),
    ]


# (left, right, prefix, left diff, right diff, suffix) — test-chat-auto-parser.cpp:651-1003
DIFF_CASES = [
    ("hello world", "hello test", "hello ", "world", "test", ""),  # :652
    ("abc", "xyz", "", "abc", "xyz", ""),  # :658
    ("prefixA suffix", "prefixB suffix", "prefix", "A", "B", " suffix"),  # :664
    ("hello", "hello", "hello", "", "", ""),  # :672
    ("", "", "", "", "", ""),  # :678
    ("a", "a", "a", "", "", ""),  # :684
    ("<row><row><row><your><boat><gently>",) * 2
    + ("<row><row><row><your><boat><gently>", "", "", ""),  # :690
    ("abcdef", "abcxyz", "abc", "def", "xyz", ""),  # :698
    ("same", "sameagain", "same", "", "again", ""),  # :704
    ("test", "testing", "test", "", "ing", ""),  # :710
    ("123end", "456end", "", "123", "456", "end"),  # :718
    ("start", "end", "", "start", "end", ""),  # :724
    ("abcsuffix", "xyzsuffix", "", "abc", "xyz", "suffix"),  # :730
    ("helloXworld", "helloYworld", "hello", "X", "Y", "world"),  # :738
    ("ABCmiddleXYZ", "ABCdifferentXYZ", "ABC", "middle", "different", "XYZ"),  # :744
    ("startAend", "startBend", "start", "A", "B", "end"),  # :750
    ("aa", "ab", "a", "a", "b", ""),  # :757
    ("", "hello", "", "", "hello", ""),  # :766
    ("hello", "", "", "hello", "", ""),  # :773
    ("a", "", "", "a", "", ""),  # :787
    ("", "a", "", "", "a", ""),  # :794
    ("left", "right", "", "lef", "righ", "t"),  # :808
    ("123", "456", "", "123", "456", ""),  # :816
    ("a", "b", "", "a", "b", ""),  # :824
    ("a", "ab", "a", "", "b", ""),  # :836
    ("prefix<tag>", "prefix</tag>suffix", "prefix", "<tag>", "</tag>suffix", ""),  # :898
    (
        "prefix<div>content</div>",
        "prefix<div>different</div>",
        "prefix<div>",
        "cont",
        "differ",
        "ent</div>",
    ),  # :906
    ("<tag>left</tag>", "<tag>righ</tag>", "<tag>", "left", "righ", "</tag>"),  # :930
    (
        "PREFIX</think>Sure",
        "PREFIX<think>Lemme think</think>Sure",
        "PREFIX",
        "",
        "<think>Lemme think",
        "</think>Sure",
    ),
    (
        "<|im_start|>user\nHello<|im_end|>\n",
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n",
        "<|im_start|>user\nHello<|im_end|>\n",
        "",
        "<|im_start|>assistant\n<think>\n",
        "",
    ),  # :976
]


@pytest.mark.parametrize(("left", "right", "prefix", "dleft", "dright", "suffix"), DIFF_CASES)
def test_calculate_diff_split(
    left: str, right: str, prefix: str, dleft: str, dright: str, suffix: str
) -> None:
    d = calculate_diff_split(left, right)
    assert (d.prefix, d.left, d.right, d.suffix) == (prefix, dleft, dright, suffix)
    # the split always reassembles both inputs
    assert d.prefix + d.left + d.suffix == left or (not d.left and not d.right)
    if d.left or d.right:
        assert d.prefix + d.right + d.suffix == right


def test_calculate_diff_split_keeps_markers_whole() -> None:
    """test-chat-auto-parser.cpp:914-968 (unclosed brackets, special tokens split at ``|>``)."""
    d = calculate_diff_split("Hello <world>", "Hello test")
    assert (d.prefix, d.right, d.suffix) == ("Hello ", "test", "")
    assert "<world>" in d.left
    d = calculate_diff_split("test [array]", "test other")
    assert (d.prefix, d.right, d.suffix) == ("test ", "other", "")
    assert "[array]" in d.left
    suffix = "|><|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    left = "SOME_PREFIX<|START_RESPONSE|>Let me help you.<|END_RESPONSE" + suffix
    right = (
        "SOME_PREFIX<|START_THINKING|><|END_THINKING|><|START_ACTION|>[\n"
        '    {"tool_call_id": "0", "tool_name": "test_function_name", '
        '"parameters": {"param1": "value1", "param2": "value2"}}\n'
        "]<|END_ACTION" + suffix
    )
    d = calculate_diff_split(left, right)
    assert d.prefix == "SOME_PREFIX"
    assert d.left == "<|START_RESPONSE|>Let me help you.<|END_RESPONSE|>"
    assert "<|END_ACTION|>" in d.right
    assert d.suffix == "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"


def test_until_common_prefix() -> None:
    """test-chat-auto-parser.cpp:1009-1034."""
    assert until_common_prefix(
        "<function name=foo><arg name=bar>", "<arg name=bar>", "<arg name=baz>"
    ) == ("<function name=foo>")
    assert until_common_prefix("prefix<test>suffix", "<test>different", "<test>other") == "prefix"
    assert until_common_prefix("<common>rest", "<common>left", "<common>right") == ""
    assert until_common_prefix("something", "left", "right") == ""
    assert until_common_prefix("test", "", "right") == ""
    assert (
        until_common_prefix(
            "abcXYZ<shared_prefix>rest", "<shared_prefix>left", "<shared_prefix>right"
        )
        == "abcXYZ"
    )


def test_after_common_suffix() -> None:
    """test-chat-auto-parser.cpp:1040-1072."""
    full = "<function name=foo><arg name=bar>100</arg></function>"
    assert (
        after_common_suffix(full, "<arg name=bar>100</arg>", "<arg name=baz>535</arg>")
        == "</function>"
    )
    assert after_common_suffix("rest<common>", "left<common>", "right<common>") == ""
    assert after_common_suffix("test", "left", "") == ""
    assert after_common_suffix(
        "<outer><inner>value</inner></outer>", "<inner>value</inner>", "<inner>different</inner>"
    ) == ("</outer>")
    assert (
        after_common_suffix("<tag>content</tag><extra>", "<tag>value</tag>", "<tag>other</tag>")
        == "<extra>"
    )
    assert (
        after_common_suffix(
            "start<middle>end</middle>",
            "prefix<middle>left</middle>",
            "prefix<middle>right</middle>",
        )
        == ""
    )


def _render(src: str) -> ta.Renderer:
    return ta.Renderer(ChatTemplate(src))


def test_compare_variants() -> None:
    """test-chat-auto-parser.cpp:1106-1213: renders diffed; a failing template gives None."""
    loop = "{% for message in messages %}{{ message['role'] }}:{{ message['content'] }}{% endfor %}"
    cmp = ta.compare(
        _render(loop),
        {"messages": [{"role": "user", "content": "A"}]},
        {"messages": [{"role": "user", "content": "B"}]},
    )
    assert cmp is not None and (cmp.diff.left, cmp.diff.right) == ("A", "B")
    cmp = ta.compare(
        _render(loop),
        {"messages": [{"role": "user", "content": "A"}]},
        {"messages": [{"role": "newuser", "content": "B"}]},
    )
    assert cmp is not None and (cmp.diff.left, cmp.diff.right) == ("user:A", "newuser:B")
    tools_tpl = "{% for tool in tools %}{{ tool['name'] }}{% endfor %}"
    cmp = ta.compare(
        _render(tools_tpl),
        {"messages": [], "tools": [{"name": "foo"}]},
        {"messages": [], "tools": [{"name": "bar"}]},
    )
    assert cmp is not None and (cmp.diff.left, cmp.diff.right) == ("foo", "bar")
    failing = "{{ messages.cahoot()[0]['nonexistent_field'] }}"
    msgs = {"messages": [{"role": "user", "content": "Hello"}]}
    assert ta.compare(_render(failing), msgs, msgs) is None
    same = ta.compare(_render("{{ messages[0]['content'] }}"), msgs, msgs)
    assert same is not None and same.diff == ta.DiffSplit(prefix="Hello")


# ===================================================================== real templates


def test_seed_oss_tool_presence_diff() -> None:
    """test-chat-auto-parser.cpp:1282-1343 (T1 on Seed-OSS: the call is the whole diff)."""
    render = ta.Renderer(compiled("ByteDance-Seed-OSS.jinja"))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "test_function_name",
                "description": "A test function for debugging",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "param1": {"type": "string", "description": "First parameter"},
                        "param2": {"type": "string", "description": "Second parameter"},
                    },
                    "required": ["param1", "param2"],
                },
            },
        }
    ]
    user = {"role": "user", "content": "Hello, please help me."}
    call = ta.probe_call("test_function_name", {"param1": "value1", "param2": "value2"}, "call_001")
    cmp = ta.compare(
        render,
        {"messages": [user, {"role": "assistant", "content": "Let me help you."}], "tools": tools},
        {"messages": [user, ta.assistant(None, [call])], "tools": tools},
    )
    assert cmp is not None
    d = cmp.diff
    for word in ("system", "user", "assistant"):
        assert word in d.prefix
    assert d.left == "Let me help you."
    for piece in (
        "<seed:tool_call>",
        "<function=test_function_name>",
        "<parameter=param1>",
        "<parameter=param2>",
    ):
        assert piece in d.right
    assert "value1" in d.right and "value2" in d.right and "</seed:tool_call>" in d.right
    assert d.suffix == "<seed:eos>"


def test_nemotron_3_analysis() -> None:
    """test-chat-auto-parser.cpp:1769-1837."""
    a = analysis("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja")
    assert (a.reasoning_mode, a.reasoning_start, a.reasoning_end) == (
        "tag",
        "<think>\n",
        "\n</think>\n",
    )
    assert (a.content_mode, a.content_start, a.content_end) == ("plain", "", "")
    assert (a.section_start, a.section_end) == ("", "")
    assert (a.per_call_start, a.per_call_end) == ("<tool_call>\n", "</tool_call>")
    assert a.supports_parallel_calls and a.supports_tool_calls
    assert (a.name_prefix, a.name_suffix, a.function_close) == (
        "<function=",
        ">\n",
        "</function>\n",
    )
    assert (a.arg_name_prefix, a.arg_name_suffix, a.arg_value_suffix) == (
        "<parameter=",
        ">\n",
        "\n</parameter>\n",
    )
    assert a.tool_format == "tag_tagged" and a.arg_encoding == "tagged"


@pytest.mark.parametrize(
    "name",
    ["poolside-Laguna-XS-2.1.jinja", "poolside-Laguna-S-2.1.jinja", "poolside-Laguna-XS.2.jinja"],
)
def test_laguna_analysis(name: str) -> None:
    """test-chat-auto-parser.cpp:1846-1925."""
    a = analysis(name)
    assert (a.reasoning_mode, a.reasoning_start, a.reasoning_end) == ("tag", "<think>", "</think>")
    assert a.arg_value_suffix == "</arg_value>"


def test_cohere_command_r7b_analysis() -> None:
    """test-chat-auto-parser.cpp:1940-2007."""
    a = analysis("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja")
    assert (a.reasoning_start, a.reasoning_end, a.reasoning_mode) == (
        "<|START_THINKING|>",
        "<|END_THINKING|>",
        "tools_only",
    )
    assert (a.content_start, a.content_end, a.content_mode) == (
        "<|START_RESPONSE|>",
        "<|END_RESPONSE|>",
        "always_wrapped",
    )
    assert (a.section_start, a.section_end, a.per_call_start, a.per_call_end) == (
        "<|START_ACTION|>",
        "<|END_ACTION|>",
        "",
        "",
    )
    assert (a.name_prefix, a.name_suffix, a.function_close, a.args_start, a.args_end) == ("",) * 5
    assert (
        a.arg_name_prefix,
        a.arg_name_suffix,
        a.arg_value_prefix,
        a.arg_value_suffix,
        a.arg_separator,
    ) == ("",) * 5
    assert (a.name_field, a.args_field, a.id_field) == ("tool_name", "parameters", "")
    assert a.tool_format == "json" and a.tools_array_wrapped and a.supports_parallel_calls


def test_smollm3_reasoning() -> None:
    """test-chat-auto-parser.cpp:2024-2048 (reasoning only: SmolLM3 renders no tool calls)."""
    a = analysis("HuggingFaceTB-SmolLM3-3B.jinja")
    assert (a.reasoning_start, a.reasoning_end, a.reasoning_mode) == ("<think>", "</think>", "tag")
    assert (a.content_start, a.content_end, a.content_mode) == ("", "", "plain")
    assert "<think>" in a.preserved_tokens and "</think>" in a.preserved_tokens
    assert analyze_template(source("HuggingFaceTB-SmolLM3-3B.jinja")) is None


BAILING_V3 = r"""
{# Bailing V3 chat template #}
{%- if tools %}{{ tools | tojson }}{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<role>HUMAN</role>' + message.content + '<|role_end|>' }}
    {%- elif message.role == "assistant" %}
        {{- '<role>ASSISTANT</role>' }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- set tc = tool_call.function %}
                {{- '<tool_call>' + tc.name }}
                {%- for k, v in tc.arguments.items() %}
                    {{- '<arg_key>' + k + '</arg_key>' }}
                    {{- '\n<arg_value>' + v + '</arg_value>' }}
                {%- endfor %}
                {{- '\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|role_end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<role>ASSISTANT</role>' }}{%- endif %}
"""


def test_bailing_v3_tolerates_intertag_whitespace() -> None:
    """test-chat-auto-parser.cpp:2529-2590 (template copied from there)."""
    a = analyze_template(BAILING_V3)
    assert a is not None and a.arg_value_suffix == "</arg_value>"
    tools = [_tool("test_function_name", param1="string", param2="string")]
    out = (
        "<tool_call>test_function_name\n<arg_key>param1</arg_key>\n<arg_value>value1</arg_value>"
        "<arg_key>param2</arg_key>\n<arg_value>value2</arg_value>\n</tool_call>"
    )
    res = parse_with_analysis(out, a, final=True, reasoning=None, think_open=False, tools=tools)
    assert _calls(res) == [("test_function_name", {"param1": "value1", "param2": "value2"})]


def test_seed_oss_tagged_values_keep_embedded_quotes() -> None:
    """test-chat-auto-parser.cpp:2592-2707."""
    a = analysis("ByteDance-Seed-OSS.jinja")
    tools = [_tool("edit", filename="string", oldString="string", newString="string")]
    out = (
        "<seed:tool_call>\n<function=edit>\n<parameter=filename>foo.cpp</parameter>\n"
        '<parameter=oldString>def foo(arg = "14"):\n    return arg + "bar"\n\n</parameter>\n'
        '<parameter=newString>def foo(arg = "15"):\n    pass\n\n</parameter>\n</function>\n</seed:tool_call>'
    )
    res = parse_with_analysis(out, a, final=True, reasoning=True, think_open=False, tools=tools)
    ((name, args),) = _calls(res)
    assert name == "edit" and args["filename"] == "foo.cpp"
    assert (
        '"14"' in args["oldString"] and '"bar"' in args["oldString"] and '"15"' in args["newString"]
    )


# Expected markers per template (docs/autoparser.md "Tested Templates"; the
# templates llama.cpp routes to the auto-parser, chat.cpp:1090-1222).
EXPECTED: dict[str, dict[str, Any]] = {
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": {
        "tool_format": "json",
        "per_call_start": "<tool_call>\n",
        "per_call_end": "</tool_call>",
    },
    "Qwen-Qwen2.5-7B-Instruct.jinja": {"tool_format": "json", "per_call_start": "<tool_call>\n"},
    "Qwen-QwQ-32B.jinja": {
        "tool_format": "json",
        "reasoning_start": "<think>",
        "reasoning_end": "</think>",
        "prompt_opens_reasoning": True,
    },
    "ibm-granite-granite-4.0.jinja": {"tool_format": "json", "per_call_start": "<tool_call>\n"},
    "GLM-4.6.jinja": {
        "tool_format": "tag_tagged",
        "per_call_start": "<tool_call>",
        "per_call_end": "</tool_call>",
        "name_suffix": "\n",
        "arg_name_prefix": "<arg_key>",
        "arg_name_suffix": "</arg_key>\n",
        "arg_value_prefix": "<arg_value>",
        "arg_value_suffix": "</arg_value>\n",
    },
    "GLM-4.7-Flash.jinja": {
        "tool_format": "tag_tagged",
        "per_call_start": "<tool_call>",
        "arg_name_prefix": "<arg_key>",
        "arg_value_prefix": "<arg_value>",
        "prompt_opens_reasoning": True,
    },
    "ByteDance-Seed-OSS.jinja": {
        "tool_format": "tag_tagged",
        "reasoning_start": "<seed:think>",
        "per_call_start": "<seed:tool_call>\n",
        "per_call_end": "</seed:tool_call>",
        "name_prefix": "<function=",
        "arg_name_prefix": "<parameter=",
    },
    "Qwen3-Coder.jinja": {
        "tool_format": "tag_tagged",
        "name_prefix": "<function=",
        "arg_name_prefix": "<parameter=",
    },
    "deepseek-ai-DeepSeek-V3.1.jinja": {
        "tool_format": "tag_json",
        "section_start": "<｜tool▁calls▁begin｜>",
        "per_call_start": "<｜tool▁call▁begin｜>",
        "name_suffix": "<｜tool▁sep｜>",
        "prompt_opens_reasoning": True,
    },
    "Apertus-8B-Instruct.jinja": {
        "tool_format": "json",
        "fun_name_is_key": True,
        "tools_array_wrapped": True,
        "section_start": "<|tools_prefix|>",
    },
    "MiniMax-M2.jinja": {
        "tool_format": "tag_tagged",
        "section_start": "<minimax:tool_call>\n",
        "name_prefix": '<invoke name="',
        "arg_name_prefix": '<parameter name="',
    },
    "NVIDIA-Nemotron-Nano-v2.jinja": {
        "tool_format": "json",
        "per_call_start": "<TOOLCALL>",
        "per_call_end": "</TOOLCALL>",
        "tools_array_wrapped": True,
    },
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": {
        "tool_format": "json",
        "content_start": "<|CHATBOT_TOKEN|>",
        "tools_array_wrapped": True,
    },
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": {
        "tool_format": "json",
        "section_start": "[TOOL_CALLS]",
        "tools_array_wrapped": True,
        "id_field": "id",
    },
    "meetkai-functionary-medium-v3.1.jinja": {
        "tool_format": "tag_json",
        "per_call_start": "<function=",
        "per_call_end": "</function>",
        "name_suffix": ">",
    },
    "meta-llama-Llama-3.1-8B-Instruct.jinja": {
        "tool_format": "json",
        "args_field": "parameters",
        "trigger": "",
    },
    "meta-llama-Llama-3.2-3B-Instruct.jinja": {"tool_format": "json", "args_field": "parameters"},
    "meta-llama-Llama-3.3-70B-Instruct.jinja": {"tool_format": "json", "args_field": "parameters"},
    "unsloth-Apriel-1.5.jinja": {
        "tool_format": "json",
        "section_start": "<tool_calls>",
        "tools_array_wrapped": True,
    },
    "Apriel-1.6-15b-Thinker-fixed.jinja": {
        "reasoning_start": "<|begin_assistant|>\n",
        "reasoning_end": "\n[BEGIN FINAL RESPONSE]\n",
    },
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": {
        "tool_format": "tag_json",
        "per_call_start": "[TOOL_CALLS]",
        "call_id_position": "between_func_and_args",
        "call_id_prefix": "[CALL_ID]",
    },
    "unsloth-mistral-Devstral-Small-2507.jinja": {
        "tool_format": "tag_json",
        "per_call_start": "[TOOL_CALLS]",
        "name_suffix": "[ARGS]",
        "call_id_position": "none",
    },
    "StepFun3.5-Flash.jinja": {
        "tool_format": "tag_tagged",
        "name_prefix": "<function=",
        "arg_name_prefix": "<parameter=",
    },
    "Spark2.5.jinja": {
        "tool_format": "tag_tagged",
        "per_call_start": "<tool_call>",
        "arg_name_prefix": "<arg_key>",
    },
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": {
        "reasoning_start": "<think>",
        "prompt_opens_reasoning": True,
        "section_start": "<｜tool▁calls▁begin｜>",
    },
    "llama-cpp-deepseek-r1.jinja": {
        "reasoning_start": "<think>",
        "prompt_opens_reasoning": True,
        "section_start": "<｜tool▁calls▁begin｜>",
        "name_suffix": "\n```json\n",
    },
    "fireworks-ai-llama-3-firefunction-v2.jinja": {
        "tool_format": "json",
        "section_start": "functools",
        "tools_array_wrapped": True,
    },
    "ibm-granite-granite-3.3-2B-Instruct.jinja": {
        "reasoning_start": "<think>",
        "content_mode": "wrapped_with_reasoning",
        "content_start": "<response>",
    },
    "google-gemma-2-2b-it.jinja": {"tool_format": "none", "reasoning_mode": "none"},
    # reasoning read from a thinking content block (not in llama.cpp's probes)
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": {
        "reasoning_start": "[THINK]",
        "reasoning_end": "[/THINK]",
        "per_call_start": "[TOOL_CALLS]",
        "name_suffix": "[ARGS]",
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_expected_markers(name: str) -> None:
    a = analysis(name)
    got = {k: getattr(a, k) for k in EXPECTED[name]}
    assert got == EXPECTED[name]


@pytest.mark.parametrize("name", ALL_TEMPLATES)
def test_every_template_is_analysed_without_error(name: str) -> None:
    """Every template yields an analysis; a template that fails to render only loses probes."""
    a = analysis(name)
    assert isinstance(a, TemplateAnalysis)
    if a.tool_format != "none" and not _specialized(name):
        # the sentinels never leak into the learned markers
        assert a.supports_tool_calls
        assert a.trigger or a.tool_format == "json"
        for marker in a.preserved_tokens:
            assert not any(
                s in marker
                for s in ("FFF_FIRST", "SSS_SECOND", "AA_ARG", "BB_ARG", "call0000", "XXXX")
            )


# ===================================================================== round trips

# Families llama.cpp does not leave to the auto-parser (chat.cpp:1090-1222):
# dedicated hand-written parsers handle them (tool_parsers' job here).
SPECIALIZED = {
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "Ministral 3",
    "openai-gpt-oss-120b.jinja": "GPT-OSS",
    "muse-glimmer.jinja": "Muse Glimmer",
    "meetkai-functionary-medium-v3.2.jinja": "Functionary v3.2",
    "Kimi-K2-Instruct.jinja": "Kimi K2",
    "Kimi-K2-Thinking.jinja": "Kimi K2",
    "moonshotai-Kimi-K2.jinja": "Kimi K2",
    "Kimi-K3.jinja": "Kimi K3",
    "inclusionai-ling-3.0-flash.jinja": "Ling 3",
    "Cohere2MoE.jinja": "Cohere2 MoE",
    "LFM2-8B-A1B.jinja": "LFM2",
    "LFM2.5-8B-A1B.jinja": "LFM2",
    "LFM2.5-Instruct.jinja": "LFM2.5",
    "GigaChat3-10B-A1.8B.jinja": "GigaChat v3",
    "MiniMax-M3.jinja": "MiniMax-M3",
    "deepseek-ai-DeepSeek-V3.2.jinja": "DeepSeek DSML",
    "deepseek-ai-DeepSeek-V4.jinja": "DeepSeek DSML",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "DeepSeek DSML",
    "google-gemma-4-31B-it.jinja": "Gemma 4",
    "google-gemma-4-31B-it-interleaved.jinja": "Gemma 4",
    "openbmb-MiniCPM5-1B.jinja": "MiniCPM5",
    "Qwen3-Coder.jinja": "Qwen3-Coder",
    "Qwen3.5-4B.jinja": "Qwen3-Coder",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "Qwen3-Coder",
    "StepFun3.5-Flash.jinja": "Qwen3-Coder",
}
# Specialized in llama.cpp, yet the generic analysis reads them correctly too.
SPECIALIZED_BUT_LEARNED = {
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
    "moonshotai-Kimi-K2.jinja",
    "inclusionai-ling-3.0-flash.jinja",
    "Cohere2MoE.jinja",
    "deepseek-ai-DeepSeek-V3.2.jinja",
    "deepseek-ai-DeepSeek-V4.jinja",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
    "Qwen3-Coder.jinja",
    "Qwen3.5-4B.jinja",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
    "StepFun3.5-Flash.jinja",
}


def _specialized(name: str) -> bool:
    return name in SPECIALIZED and name not in SPECIALIZED_BUT_LEARNED


def _tool(name: str, **params: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t, "description": k} for k, t in params.items()},
            },
        },
    }


RT_TOOLS = [
    _tool("get_weather", city="string", days="integer"),
    _tool("search_docs", query="string", limit="integer"),
]
RT_CALLS = [
    {
        "id": "a1b2c3d4e",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    },
    {
        "id": "f5g6h7i8j",
        "type": "function",
        "function": {"name": "search_docs", "arguments": {"query": "hello world", "limit": 5}},
    },
]


def _calls(res: AnalysisParse) -> list[tuple[str | None, dict[str, Any] | None]]:
    return [(c.name, c.args) for c in res.calls]


# End-of-generation tokens some templates write after tool calls: the engine stops
# on them, so they never reach the parser.
END_OF_TURN = {
    "</s>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<｜end▁of▁sentence｜>",
    "<｜Assistant｜>",
    "<｜hy_eos:opensource｜>",
}


def _assistant_part(
    name: str, a: TemplateAnalysis, calls: list[dict[str, Any]]
) -> tuple[str, bool]:
    """What the model would generate for ``calls``: the rendered assistant turn after
    the generation prompt, without the end-of-turn tokens (generation stops there)."""
    render = ta.Renderer(compiled(name), a.arguments_as_string, a.content_none_with_calls)
    user = {"role": "user", "content": "What is the weather?"}
    full = render([user, ta.assistant("", calls)], RT_TOOLS)
    prompt = render([user], RT_TOOLS, add_generation_prompt=True)
    plain = render([user, ta.assistant("ZZZ_PLAIN")], RT_TOOLS)
    assert full is not None and prompt is not None and plain is not None
    after_prompt = full.startswith(prompt)
    part = full[len(prompt) :] if after_prompt else calculate_diff_split(prompt, full).right
    turn_end = {s.value.strip() for s in segmentize_markers(plain[plain.rfind("ZZZ_PLAIN") + 9 :])}
    turn_end |= END_OF_TURN
    cut = 0
    for seg in segmentize_markers(part):
        if (
            seg.value.strip()
            and seg.value.strip() in turn_end
            and seg.value.strip() not in a.markers
        ):
            break
        cut += len(seg.value)
    return part[:cut], after_prompt and a.opens_reasoning(prompt)


ROUND_TRIP = [n for n in ALL_TEMPLATES if not _specialized(n)]
#: the templates that render no tool calls (an assistant turn's calls are dropped, or the
#: template has no tool syntax): pinned, so a template that loses its calls fails the
#: round trip instead of skipping it, and one that gains them is moved out of the list
NO_TOOL_CALLS = frozenset(
    {
        "HuggingFaceTB-SmolLM3-3B.jinja",
        "google-gemma-2-2b-it.jinja",
        "ibm-granite-granite-3.3-2B-Instruct.jinja",
        "llama-cpp-rwkv-world.jinja",
        "microsoft-Phi-3.5-mini-instruct.jinja",
    }
)


def _skip_without_tool_calls(name: str, a: TemplateAnalysis) -> None:
    """Skip a template pinned in :data:`NO_TOOL_CALLS`; any other without a learned call
    syntax fails (it lost its tool calls), as does a pinned one that has one now."""
    if a.tool_format != "none":
        if name in NO_TOOL_CALLS:
            pytest.fail(f"{name} renders tool calls now: take it out of NO_TOOL_CALLS")
        return
    if a.supports_tool_calls:
        pytest.fail(f"{name}: renders tool calls but no format was learned")
    if name not in NO_TOOL_CALLS:
        pytest.fail(f"{name}: no tool calls are learned from the template any more")
    pytest.skip(f"{name}: the template renders no tool calls")


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_round_trip(name: str) -> None:
    """Render two calls through the template, parse the assistant turn back."""
    a = analysis(name)
    _skip_without_tool_calls(name, a)
    calls = RT_CALLS if a.supports_parallel_calls else RT_CALLS[:1]
    part, think_open = _assistant_part(name, a, calls)
    res = parse_with_analysis(
        part, a, final=True, reasoning=True, think_open=think_open, tools=RT_TOOLS
    )
    assert _calls(res) == [(c["function"]["name"], c["function"]["arguments"]) for c in calls], part
    assert not res.content.strip(), part
    assert all(c.error is None for c in res.calls)
    # streamed in random chunks: the same result, and nothing emitted early is taken back
    _assert_streams_like_one_shot(part, a, think_open, RT_TOOLS, seed=len(name))


def _assert_streams_like_one_shot(
    text: str, a: TemplateAnalysis, think_open: bool, tools: list[dict[str, Any]] | None, seed: int
) -> None:
    final = parse_with_analysis(
        text, a, final=True, reasoning=True, think_open=think_open, tools=tools
    )
    rng = random.Random(seed)
    pos = 0
    while pos < len(text):
        pos = min(len(text), pos + rng.randint(1, 7))
        part = parse_with_analysis(
            text[:pos], a, final=False, reasoning=True, think_open=think_open, tools=tools
        )
        content = part.content[: len(part.content) - part.held].lstrip()
        assert final.content.lstrip().startswith(content.rstrip()) or not content.strip(), (
            text[:pos],
            content,
        )
        if part.reasoning is not None:
            r = part.reasoning[: len(part.reasoning) - part.reasoning_held]
            assert (final.reasoning or "").startswith(r) or not r.strip(), (text[:pos], r)
        complete = [(c.name, c.args) for c in part.calls if c.complete and c.error is None]
        assert complete == _calls(final)[: len(complete)], text[:pos]
        named = [c.name for c in part.calls if c.name]
        assert named == [c.name for c in final.calls][: len(named)], text[:pos]


# ===================================================================== parser semantics


@functools.cache
def qwen3_coder() -> TemplateAnalysis:
    return analysis("Qwen3-Coder.jinja")


def test_tagged_values_follow_the_schema() -> None:
    """A ``string`` parameter stays a string (llama.cpp test-chat.cpp qwen3_coder cases)."""
    a = qwen3_coder()
    tools = [_tool("f", code="string", n="integer", flag="boolean", obj="object")]
    out = (
        "<tool_call>\n<function=f>\n<parameter=code>\n5123123\n</parameter>\n"
        "<parameter=n>\n42\n</parameter>\n<parameter=flag>\ntrue\n</parameter>\n"
        '<parameter=obj>\n{"a": [1, 2]}\n</parameter>\n</function>\n</tool_call>'
    )
    res = parse_with_analysis(out, a, final=True, reasoning=None, think_open=False, tools=tools)
    assert _calls(res) == [("f", {"code": "5123123", "n": 42, "flag": True, "obj": {"a": [1, 2]}})]
    quoted = '<tool_call>\n<function=f>\n<parameter=code>\n"foo"\n</parameter>\n</function>\n</tool_call>'
    res = parse_with_analysis(quoted, a, final=True, reasoning=None, think_open=False, tools=tools)
    assert _calls(res) == [("f", {"code": '"foo"'})]
    # without a schema, values that are JSON are decoded
    res = parse_with_analysis(out, a, final=True, reasoning=None, think_open=False)
    assert res.calls[0].args == {"code": 5123123, "n": 42, "flag": True, "obj": {"a": [1, 2]}}


def test_content_around_calls_and_reasoning() -> None:
    a = analysis("Qwen-QwQ-32B.jinja")
    out = 'Let me think.</think>Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    res = parse_with_analysis(out, a, final=True, reasoning=True, think_open=True, tools=RT_TOOLS)
    assert res.reasoning == "Let me think."
    assert res.content.strip() == "Sure."
    assert _calls(res) == [("get_weather", {"city": "Oslo"})]
    # thinking disabled but the model thought anyway: still reasoning, never content
    res = parse_with_analysis(
        "<think>hm</think>Hi", a, final=True, reasoning=False, think_open=False
    )
    assert (res.reasoning, res.content) == ("hm", "Hi")
    # reasoning=None: no extraction
    res = parse_with_analysis(
        "<think>hm</think>Hi", a, final=True, reasoning=None, think_open=False
    )
    assert res.reasoning is None and res.content == "<think>hm</think>Hi"


def test_malformed_calls_become_errors_with_raw_text() -> None:
    a = analysis("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja")
    out = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    res = parse_with_analysis(out, a, final=True, reasoning=None, think_open=False)
    assert res.content.strip() == "Hi"
    (call,) = res.calls
    assert call.error and '"city"' in call.raw
    a = qwen3_coder()
    res = parse_with_analysis(
        "<tool_call>\n<function=f>\n<parameter=x>\n1",
        a,
        final=True,
        reasoning=None,
        think_open=False,
    )
    (call,) = res.calls
    assert call.error and call.args is None


def test_streaming_holds_back_half_written_markers() -> None:
    a = analysis("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja")
    res = parse_with_analysis("Hello <tool_ca", a, final=False, reasoning=None, think_open=False)
    assert res.content[: len(res.content) - res.held] == "Hello "
    res = parse_with_analysis(
        'Hello <tool_call>\n{"name": "get_w', a, final=False, reasoning=None, think_open=False
    )
    assert res.content == "Hello " and not res.settled and res.calls == []
    tagged = qwen3_coder()
    res = parse_with_analysis(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        tagged,
        final=False,
        reasoning=None,
        think_open=False,
        tools=RT_TOOLS,
    )
    assert [(c.name, c.complete) for c in res.calls] == [("get_weather", False)] and not res.settled


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "Qwen-QwQ-32B.jinja",
            'Hmm, weather.</think>Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "search_docs", "arguments": {"query": "x"}}\n</tool_call>',
        ),
        (
            "GLM-4.6.jinja",
            "<think>ok</think>\nOn it.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n</tool_call>",
        ),
        (
            "mistralai-Mistral-Nemo-Instruct-2407.jinja",
            'Calling.[TOOL_CALLS][{"name": "get_weather", "arguments": '
            '{"city": "Paris"}, "id": "abcdefghi"}]',
        ),
        (
            "unsloth-mistral-Devstral-Small-2507.jinja",
            'Calling.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        ),
        (
            "meta-llama-Llama-3.1-8B-Instruct.jinja",
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        ),
        (
            "Apertus-8B-Instruct.jinja",
            'Sure<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>',
        ),
    ],
)
def test_streamed_equals_one_shot(name: str, text: str) -> None:
    a = analysis(name)
    think_open = a.prompt_opens_reasoning
    final = parse_with_analysis(
        text, a, final=True, reasoning=True, think_open=think_open, tools=RT_TOOLS
    )
    assert final.calls and all(c.error is None for c in final.calls), final
    for seed in range(5):
        _assert_streams_like_one_shot(text, a, think_open, RT_TOOLS, seed)


def test_call_ids_are_read() -> None:
    a = analysis("Mistral-Small-3.2-24B-Instruct-2506.jinja")
    out = '[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris"}'
    res = parse_with_analysis(out, a, final=True, reasoning=None, think_open=False, tools=RT_TOOLS)
    assert [(c.name, c.args, c.id) for c in res.calls] == [
        ("get_weather", {"city": "Paris"}, "abc123XYZ")
    ]


FUZZ_TEMPLATES = [
    "Qwen3-Coder.jinja",  # tag + tagged arguments
    "deepseek-ai-DeepSeek-V3.1.jinja",  # tag + JSON arguments, reasoning
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",  # JSON array after a marker
    "meta-llama-Llama-3.1-8B-Instruct.jinja",  # bare JSON
    "Mistral-Small-3.2-24B-Instruct-2506.jinja",  # call ids
    "Apriel-1.6-15b-Thinker-fixed.jinja",  # delimiter-style reasoning
]


def _fuzz_pieces(a: TemplateAnalysis) -> list[str]:
    pieces = [m for m in (*a.preserved_tokens, a.reasoning_start, a.reasoning_end) if m]
    return [
        *pieces,
        *(p[: len(p) // 2] for p in pieces),
        "get_weather",
        "city",
        '"',
        "{",
        "}",
        "[",
        "]",
        "\n",
        " ",
        "x",
        "1",
        ",",
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_parser_never_raises_on_garbage(data: st.DataObject) -> None:
    """Fuzzed marker soup: the parser itself (not its safety net) never raises."""
    a = analysis(data.draw(st.sampled_from(FUZZ_TEMPLATES)))
    text = "".join(data.draw(st.lists(st.sampled_from(_fuzz_pieces(a)), max_size=25)))
    final = data.draw(st.booleans())
    reasoning = data.draw(st.sampled_from([None, True, False]))
    think_open = data.draw(st.booleans())
    res = ta_parser._parse(text, a, final, reasoning, think_open, RT_TOOLS)
    assert isinstance(res, AnalysisParse)
    assert 0 <= res.held <= len(res.content)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_streams_never_take_back(data: st.DataObject) -> None:
    """Fuzzed marker soup fed one character at a time: content, reasoning and calls
    shown early are always a prefix of the final parse."""
    a = analysis(data.draw(st.sampled_from(FUZZ_TEMPLATES)))
    text = "".join(data.draw(st.lists(st.sampled_from(_fuzz_pieces(a)), max_size=15)))
    kw: dict[str, Any] = {
        "reasoning": data.draw(st.sampled_from([None, True, False])),
        "think_open": data.draw(st.booleans()),
        "tools": RT_TOOLS,
    }
    final = parse_with_analysis(text, a, final=True, **kw)
    for k in range(1, len(text) + 1):
        part = parse_with_analysis(text[:k], a, final=False, **kw)
        assert final.content.strip().startswith(
            part.content[: len(part.content) - part.held].strip()
        )
        if part.reasoning is not None:
            thought = part.reasoning[: len(part.reasoning) - part.reasoning_held].strip()
            assert (final.reasoning or "").strip().startswith(thought)
        done = [(c.name, c.args) for c in part.calls if c.complete and c.error is None]
        assert done == _calls(final)[: len(done)]


def test_not_a_template() -> None:
    assert analyze_template("{% if %}") is None  # does not compile
    assert analyze_template("{{ messages[0]['content'] }}") is None  # no tool calls
    assert analyze_template(source("google-gemma-2-2b-it.jinja")) is None
    a = analyze_template(source("Qwen-Qwen2.5-7B-Instruct.jinja"))
    assert a is not None and json.dumps(a.markers)


def test_grammar_triggers() -> None:
    """chat-auto-parser-generator.cpp:70-94: the section (else per-call) start; none for bare JSON."""
    assert analysis("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja").grammar_triggers == (
        "<tool_call>",
    )
    assert analysis("deepseek-ai-DeepSeek-V3.1.jinja").grammar_triggers == (
        "<｜tool▁calls▁begin｜>",
    )
    assert analysis("meta-llama-Llama-3.1-8B-Instruct.jinja").grammar_triggers == ()
    assert analysis("google-gemma-2-2b-it.jinja").grammar_triggers == ()


# ===================================================================== llama.cpp's parse cases

_CASES_DATA = json.loads(
    (Path(__file__).resolve().parents[2] / "data" / "llama_cpp_autoparser_cases.json").read_text(
        encoding="utf-8"
    )
)
AUTOPARSER_CASES = _CASES_DATA["cases"] + _CASES_DATA["extra_cases"]


@functools.cache
def _generation_prompt(name: str, tools_json: str, thinking: bool) -> str:
    """What the template appends for ``add_generation_prompt`` (llama.cpp's suffix diff)."""
    render = ta.Renderer(compiled(name))
    tools = [{"type": "function", "function": t} for t in json.loads(tools_json)] or None
    msgs = [{"role": "user", "content": "Hey there!"}]
    cmp = ta.compare(
        render,
        {
            "messages": msgs,
            "tools": tools,
            "add_generation_prompt": False,
            "enable_thinking": thinking,
        },
        {
            "messages": msgs,
            "tools": tools,
            "add_generation_prompt": True,
            "enable_thinking": thinking,
        },
    )
    if cmp is None:
        return _generation_prompt(name, "[]", thinking) if tools else ""
    return cmp.b[_common_prefix(cmp.a, cmp.b) :]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _json_or_empty(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return ""
    return value


@pytest.mark.parametrize(
    "case",
    AUTOPARSER_CASES,
    ids=[f"{c['template']}@{c['source'].rsplit(':', 1)[1]}" for c in AUTOPARSER_CASES],
)
def test_llama_cpp_parse_case(case: dict[str, Any]) -> None:
    """llama.cpp's recorded outputs for auto-parsed templates, one-shot and streamed."""
    a = analysis(case["template"])
    prompt = _generation_prompt(
        case["template"], json.dumps(case["tools"]), case["enable_thinking"]
    )
    reasoning = None if case["reasoning_format"] == "none" else bool(case["enable_thinking"])
    tools = [{"type": "function", "function": t} for t in case["tools"]] or None
    kw: dict[str, Any] = {
        "reasoning": reasoning,
        "think_open": False,
        "tools": tools,
        "generation_prompt": prompt,
    }
    text, expect, partial = case["input"], case["expect"], case["is_partial"]
    res = parse_with_analysis(text, a, final=not partial, **kw)
    content = res.content[: len(res.content) - res.held] if partial else res.content
    assert content.strip() == expect["content"].strip()
    assert (res.reasoning or "").strip() == expect["reasoning"].strip()
    calls = [(c.name or "", c.args) for c in res.calls if c.complete]
    want = [(c["name"], _json_or_empty(c["arguments"])) for c in expect["tool_calls"]]
    if partial:
        assert calls == want[: len(calls)]
        return
    assert calls == want
    for c, e in zip(res.calls, expect["tool_calls"], strict=True):
        assert not e["id"] or c.id == e["id"]
    # streamed in random chunks: nothing emitted early is taken back
    rng = random.Random(case["source"])
    pos = 0
    while pos < len(text):
        pos = min(len(text), pos + rng.randint(1, 6))
        part = parse_with_analysis(text[:pos], a, final=False, **kw)
        shown = part.content[: len(part.content) - part.held].strip()
        assert res.content.strip().startswith(shown), text[:pos]
        if part.reasoning is not None:
            thought = part.reasoning[: len(part.reasoning) - part.reasoning_held].strip()
            assert (res.reasoning or "").strip().startswith(thought), text[:pos]
        done = [(c.name, c.args) for c in part.calls if c.complete and c.error is None]
        assert done == calls[: len(done)], text[:pos]


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_every_cut_of_the_learned_markers_streams_to_the_parse(name: str) -> None:
    """Format ``auto``: the round trip's assistant turn and each marker learned from the
    template (alone and inside text), streamed one character at a time, so every position
    is a chunk boundary (``test_stream_equals_parse.stream_every_cut``)."""
    from .test_stream_equals_parse import stream_every_cut

    a = analysis(name)
    _skip_without_tool_calls(name, a)
    calls = RT_CALLS if a.supports_parallel_calls else RT_CALLS[:1]
    part, think_open = _assistant_part(name, a, calls)
    opts: dict[str, Any] = {"reasoning": True, "think_open": think_open, "analysis": a}
    stream_every_cut(part, "auto", {**opts, "tools": RT_TOOLS})
    for marker in a.markers:
        for text in (marker, f"Hi {marker} x"):
            for tools in (RT_TOOLS, []):
                stream_every_cut(text, "auto", {**opts, "tools": tools}, truncate=True)
