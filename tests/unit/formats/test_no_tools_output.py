"""Output of a request that bound no tools, with llama.cpp as the reference.

Each of llama.cpp's family parsers (``common/parsers/*.cpp``, and the auto-parser's
``analyze_content::build_parser``) returns, when ``!has_tools || tool_choice == NONE``,
``generation_prompt + reasoning + content(rest) + end``: the reasoning is still
extracted, the family's turn and channel wrappers are still consumed, and nothing is a
tool call, so call markup the model writes stays in the content as written. The package
does the same: ``parse(..., tools=[])`` (and a request without tools) reads no calls,
removes the wrappers, reads the family's own think markers. Each case is also streamed in
random chunks: the merged deltas equal the one-shot parse.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from langchain_llamacpp_local.formats import detect_format, parse
from langchain_llamacpp_local.formats.families import MM_MARKER
from tests.llama_cpp_cases import _settings, _template, load_cases

from .test_stream_equals_parse import check_stream

SEED_CALL = (
    "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
    "</function>\n</seed:tool_call>"
)
GLM_CALL = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
)
MM3_CALL = f'{MM_MARKER}<tool_call>{MM_MARKER}<invoke name="get_weather">{MM_MARKER}</invoke>{MM_MARKER}</tool_call>'
CMD_ACTION = 'Action: ```json\n[{"tool_name": "get_weather", "parameters": {"city": "Paris"}}]\n```'
GEMMA4_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
HARMONY_CALL = (
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>'
)

#: (format, model output, parse options, content, reasoning), with the llama.cpp source
#: that decides the same for no tools
CASES: list[tuple[str, str, str, dict[str, Any], str, str | None]] = [
    # cohere2moe.cpp / chat-diff-analyzer.cpp "Cohere Command R+" patch: the content
    # wrapper goes; the auto-parser builds no tool rules without tools
    (
        "command_r_plus wrapper",
        "command_r_plus",
        "<|CHATBOT_TOKEN|>Hello there<|END_OF_TURN_TOKEN|>",
        {},
        "Hello there",
        None,
    ),
    (
        "command_r_plus action",
        "command_r_plus",
        f"<|CHATBOT_TOKEN|>{CMD_ACTION}<|END_OF_TURN_TOKEN|>",
        {},
        CMD_ACTION,
        None,
    ),
    # auto-parser (Seed-OSS): reasoning in its own markers, then content(rest)
    (
        "seed_oss",
        "seed_oss",
        f"<seed:think>Look it up.</seed:think>Sure. {SEED_CALL}",
        {"reasoning": True},
        f"Sure. {SEED_CALL}",
        "Look it up.",
    ),
    (
        "seed_oss raw thinking",
        "seed_oss",
        f"<seed:think>Look it up.</seed:think>{SEED_CALL}",
        {},
        f"<seed:think>Look it up.</seed:think>{SEED_CALL}",
        None,
    ),
    # ling3.cpp: opener + reasoning + content(until <|role_end|>) + <|role_end|>
    (
        "ling",
        "glm45",
        f"<think>Plan.</think>Calling {GLM_CALL}<|role_end|>",
        {"reasoning": True},
        f"Calling {GLM_CALL}",
        "Plan.",
    ),
    # functionary-v3-2.cpp: generation prompt ">>>" + "all\n" + content(rest)
    (
        "functionary all",
        "functionary_v3_2",
        "all\nHello there",
        {"prefill": "<|start_header_id|>assistant<|end_header_id|>\n\n>>>"},
        "Hello there",
        None,
    ),
    (
        "functionary call text",
        "functionary_v3_2",
        'get_weather\n{"city": "Paris"}',
        {"prefill": "<|start_header_id|>assistant<|end_header_id|>\n\n>>>"},
        'get_weather\n{"city": "Paris"}',
        None,
    ),
    # minimax-m3.cpp: generation_prompt + reasoning + content(rest)
    (
        "minimax_m3",
        "minimax_m3",
        f"Thinking it over.</mm:think>Here: {MM3_CALL}",
        {"reasoning": True, "prefill": "ai\n<mm:think>"},  # thinking_mode "enabled"
        f"Here: {MM3_CALL}",
        "Thinking it over.",
    ),
    # the same text with no opener in the prompt or the output (thinking_mode
    # "adaptive"): minimax-m3.cpp reads optional(block | THINK_END), so nothing is
    # reasoning; streamed, no content is taken back
    (
        "minimax_m3 no opener",
        "minimax_m3",
        "Thinking it over.</mm:think>Here.",
        {"reasoning": True, "prefill": "ai\n"},
        "Thinking it over.</mm:think>Here.",
        None,
    ),
    (
        "minimax_m3 bare end",
        "minimax_m3",
        "</mm:think>Here.",
        {"reasoning": True, "prefill": "ai\n"},
        "Here.",
        None,
    ),
    # gemma4.cpp: the tool rule exists only with tools; channels are still read
    (
        "gemma4",
        "gemma4",
        f"<|channel>thought\nHmm.<channel|>{GEMMA4_CALL}",
        {"reasoning": True},
        GEMMA4_CALL,
        "Hmm.",
    ),
    # the classic formats: content(rest)
    (
        "hermes",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        {},
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        None,
    ),
    (
        "qwen3_coder",
        "qwen3_coder",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        {},
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        None,
    ),
    (
        "granite",
        "granite",
        "<response>Hello there</response>",
        {},
        "Hello there",
        None,
    ),
    # gpt-oss.cpp: without tools, a message to any recipient is consumed as an
    # "unsolicited" call (test-chat.cpp:6547 and 6556 record it for built-in tools)
    (
        "gpt_oss",
        "gpt_oss",
        f"<|channel|>analysis<|message|>Check.<|end|><|start|>assistant{HARMONY_CALL}",
        {"reasoning": True},
        "",
        "Check.",
    ),
]


@pytest.mark.parametrize(
    ("fmt", "text", "opts", "content", "reasoning"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_no_tools_bound_reads_no_calls(
    fmt: str, text: str, opts: dict[str, Any], content: str, reasoning: str | None
) -> None:
    out = parse(text, fmt, tools=[], **opts)
    assert (out.content, out.reasoning) == (content, reasoning)
    assert out.tool_calls == [] and out.invalid_tool_calls == []
    for seed in range(4):
        check_stream(text, fmt, {**opts, "tools": []}, random.Random(seed))


@pytest.mark.parametrize(
    ("fmt", "text", "opts"),
    [c[1:4] for c in CASES if "call" in c[0] or "action" in c[0] or c[1] in ("seed_oss", "glm45")],
)
def test_the_same_output_with_tools_bound_is_a_call(
    fmt: str, text: str, opts: dict[str, Any]
) -> None:
    """Contrast: the markup the cases keep as content is a call once a tool is bound."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    out = parse(text, fmt, tools=[tool], **opts)
    assert len(out.tool_calls) + len(out.invalid_tool_calls) == 1


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("deepseek_v3_1", "<｜tool▁calls▁begin｜>not a call at all<｜tool▁calls▁end｜>"),
        ("kimi_k2", "<|tool_calls_section_begin|>garbage<|tool_calls_section_end|>"),
        ("hy3", "<tool_calls:opensource>garbage</tool_calls:opensource>"),
    ],
)
def test_an_unreadable_call_region_is_reported_not_dropped(fmt: str, text: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    out = parse(text, fmt, tools=[tool])
    assert out.tool_calls == []
    (bad,) = out.invalid_tool_calls
    assert "garbage" in bad["args"] or "not a call" in bad["args"]
    assert bad["error"]


# ------------------------------------------------------------------- every recorded output

RECORDED = [c for c in load_cases()["cases"] if not c["is_partial"]]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(RECORDED), st.floats(0.0, 1.0), st.integers(0, 2**32))
def test_any_recorded_output_with_no_tools_bound_streams_to_its_parse(
    case: dict[str, Any], cut: float, seed: int
) -> None:
    """llama.cpp's recorded outputs of every family, cut anywhere and chunked at random,
    parsed as if the request had bound no tools: the chunks merge to the one-shot parse
    and nothing is a call."""
    text = case["input"][: round(len(case["input"]) * cut)]
    fmt = detect_format(_template(case["template"]).source)
    opts = {**_settings(case), "tools": []}
    check_stream(text, fmt, opts, random.Random(seed))
    out = parse(text, fmt, **opts)
    assert out.tool_calls == [] and out.invalid_tool_calls == []
