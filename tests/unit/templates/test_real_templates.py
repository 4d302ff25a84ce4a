"""Every chat template llama.cpp ships (tests/data/llama_cpp_templates, MIT) renders an agent
conversation: system, user, an assistant turn with two tool calls, both tool results, a
follow-up user turn, with tools bound — the way llama.cpp / transformers render it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from langchain_llamacpp_local.errors import ChatTemplateError
from langchain_llamacpp_local.templates.adaptation import render_chat
from langchain_llamacpp_local.templates.chat_template import (
    ChatTemplate,
    TemplateConventions,
    short_tool_call_id,
)
from langchain_llamacpp_local.templates.messages import convert_messages
from tests.llama_cpp_cases import template_file

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "data" / "llama_cpp_templates"
TEMPLATES = sorted(p.name for p in TEMPLATE_DIR.glob("*.jinja"))


def _tool(name: str, description: str, arg: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": f"The {arg}"}},
                "required": [arg],
            },
        },
    }


# get_news is bound but never called: it proves the tool definitions are shown.
TOOLS = [
    _tool("get_weather", "Current weather of a city", "city"),
    _tool("get_news", "Headlines on a topic", "topic"),
    _tool("get_time", "Local time in a time zone", "tz"),
]

CALL_WEATHER = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_w3ath3r0001"}
CALL_TIME = {"name": "get_time", "args": {"tz": "Asia/Tokyo"}, "id": "call_t1me00000002"}


def agent_conversation(*, one_call_per_turn: bool = False) -> list:
    head = [
        SystemMessage("You are a terse assistant."),
        HumanMessage("Weather in Paris and time in Tokyo?"),
    ]
    results = [
        ToolMessage("sunny, 21 C", tool_call_id=CALL_WEATHER["id"]),
        ToolMessage("09:30 JST", tool_call_id=CALL_TIME["id"]),
    ]
    if one_call_per_turn:
        middle = [
            AIMessage("", tool_calls=[CALL_WEATHER]),
            results[0],
            AIMessage("", tool_calls=[CALL_TIME]),
            results[1],
        ]
    else:
        middle = [AIMessage("", tool_calls=[CALL_WEATHER, CALL_TIME]), *results]
    return [*head, *middle, HumanMessage("Thanks. And in Berlin?")]


# What each part of the conversation looks like in the prompt.
EXPECTED = {
    "tool definitions": ["get_news"],
    "first call": ["get_weather", "city", "Paris"],
    "second call": ["get_time", "tz", "Asia/Tokyo"],
    "tool results": ["sunny, 21 C", "09:30 JST"],
    "last user message": ["Thanks. And in Berlin?"],
}

# Templates that legitimately leave something out (with the reason).
OMITS = {
    "GigaChat3-10B-A1.8B.jinja": ("second call", "renders message.tool_calls[0] only"),
    "GigaChat3.1-10B-A1.8B.jinja": ("second call", "renders message.tool_calls[0] only"),
    "openai-gpt-oss-120b.jinja": ("second call", "harmony: one call per message, tool_calls[0]"),
}

# Templates that forbid two calls in one turn themselves (their own message is the error).
ONE_CALL_PER_TURN = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": "This model only supports single tool-calls at once!",
    "meta-llama-Llama-3.2-3B-Instruct.jinja": "This model only supports single tool-calls at once!",
    "meta-llama-Llama-3.3-70B-Instruct.jinja": "This model only supports single tool-calls at once!",
}


def load(name: str) -> ChatTemplate:
    return template_file(name, bos_token="<s>", eos_token="</s>")


def test_all_llama_cpp_templates_are_present() -> None:
    # llama.cpp @0c1e57098 ships 70 .jinja templates (the "72 files" counted the
    # folder's two other files), and newer llama.cpp's MiroThinker.jinja is added
    assert len(TEMPLATES) == 71
    assert "MiroThinker.jinja" in TEMPLATES


@pytest.mark.parametrize("name", TEMPLATES)
def test_agent_conversation_renders(name: str) -> None:
    tpl = load(name)
    messages = convert_messages(agent_conversation())
    if name in ONE_CALL_PER_TURN:
        with pytest.raises(ChatTemplateError, match=ONE_CALL_PER_TURN[name]) as info:
            render_chat(tpl, messages, TOOLS)
        assert info.value.raised_by_template
        messages = convert_messages(agent_conversation(one_call_per_turn=True))
    text = render_chat(tpl, messages, TOOLS)
    omitted = OMITS.get(name, (None, ""))[0]
    for part, needles in EXPECTED.items():
        if part == omitted:
            continue
        missing = [n for n in needles if n not in text]
        assert not missing, f"{name}: {part} missing {missing}\n{text}"
    # arguments are JSON once, never JSON text encoded again nor a Python repr
    assert '\\"city\\"' not in text and "'city': 'Paris'" not in text, text
    # rendering is deterministic: the same conversation gives the same prompt (prefix cache)
    assert render_chat(tpl, messages, TOOLS) == text


def test_kimi_k2_list_append_is_allowed() -> None:
    text = render_chat(
        load("Kimi-K2-Instruct.jinja"), convert_messages(agent_conversation()), TOOLS
    )
    assert "get_weather" in text and "Asia/Tokyo" in text


@pytest.mark.parametrize(
    "name",
    [
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    ],
)
def test_mistral_gets_stable_nine_character_ids(name: str) -> None:
    tpl = load(name)
    assert tpl.conventions.short_ids
    # the usual agent shape: the model answers after the tool results
    conv = agent_conversation()[:-1] + [AIMessage("Sunny; 09:30."), HumanMessage("Berlin?")]
    text = render_chat(tpl, convert_messages(conv), TOOLS)
    short = short_tool_call_id(CALL_WEATHER["id"])
    assert len(short) == 9 and short.isalnum()
    assert text.count(short) == 2  # in the call and in its result
    assert CALL_WEATHER["id"] not in text
    assert "[TOOL_CALLS]" in text  # rendered natively, not flattened
    assert short_tool_call_id(CALL_WEATHER["id"]) == short  # stable across turns
    assert short_tool_call_id("abcDEF123") == "abcDEF123"


def test_templates_that_do_not_check_ids_keep_them() -> None:
    tpl = load("mistralai-Ministral-3-14B-Reasoning-2512.jinja")
    assert not tpl.conventions.short_ids


def test_conventions_are_probed_not_guessed() -> None:
    # Apertus writes `arguments | tojson`: a dict (a string would be encoded twice)
    assert load("Apertus-8B-Instruct.jinja").conventions == TemplateConventions()
    # R1-Distill concatenates arguments as text and renders calls only for content=None
    r1 = load("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja").conventions
    assert r1.args_as_string and r1.null_content
    # Qwen3-Coder iterates over the arguments' items
    assert not load("Qwen3-Coder.jinja").conventions.args_as_string


def test_r1_distill_renders_both_calls() -> None:
    tpl = load("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    text = render_chat(tpl, convert_messages(agent_conversation()), TOOLS)
    assert text.count("<｜tool▁call▁begin｜>") == 2
    assert '{"city": "Paris"}' in text


def test_firefunction_gets_functions_variable() -> None:
    tpl = load("fireworks-ai-llama-3-firefunction-v2.jinja")
    text = render_chat(tpl, convert_messages(agent_conversation()), TOOLS)
    assert json.dumps(TOOLS, indent=2) in text


def test_caller_data_is_not_mutated_by_templates() -> None:
    tpl = ChatTemplate(
        "{% set m = messages[0] %}{% set _ = m.update({'content': 'changed'}) %}"
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages | length }}"
    )
    messages = [{"role": "user", "content": "original"}]
    assert tpl.render(messages) == "2"
    assert messages == [{"role": "user", "content": "original"}]


def test_tojson_of_generators_and_macro_scoping() -> None:
    tpl = ChatTemplate(
        "{{ messages | map(attribute='role') | tojson }}"
        "{% macro outer(x) %}{% macro inner() %}{{ x }}{% endmacro %}{{ inner() }}{% endmacro %}"
        "{{ outer('scoped') }}"
    )
    assert tpl.render([{"role": "user", "content": "a"}]) == '["user"]scoped'


def test_null_and_undefined_concatenate_as_empty_like_llama_cpp() -> None:
    tpl = ChatTemplate("{{ 'a' + messages[0].missing }}|{{ 'b' ~ none }}")
    assert tpl.render([{"role": "user", "content": "x"}]) == "a|b"


# llama.cpp tests/test-jinja.cpp:1068-1124 (test_macros, test_namespace): macro arguments,
# caller() and macro scoping, the constructs MiroThinker's template relies on.
_CALLER_MACRO = (
    "{%- macro nest_dict(o, i, ff='') %}\n"
    "  {{- caller(ff) }}\n"
    "  {%- for k, v in o|items %}\n"
    "    {{- i + k + ': ' }}\n"
    "    {%- if v is mapping %}\n"
    "      {{- '{' }}\n"
    "      {% call(f) nest_dict(v, i + '    ') %}\n"
    "        {{- 'fail' if ff is undefined }}\n"
    "      {%- endcall %}\n"
    "      {{- i + '}' }}\n"
    "    {% else %}\n"
    "      {{- v|string }}\n"
    "    {% endif %}\n"
    "  {%- endfor %}\n"
    "{%- endmacro %}\n"
    "{%- call(f) nest_dict({'root1': 1, 'root2': {'nest1': 1, 'nest2': {'nest3': 2}}}, '    ', 'Dict') %}\n"
    "  {{- 'fail' if ff is defined }}\n"
    "  {{- f + ' {' }}\n"
    "{% endcall %}\n"
    "{{- '}' }}"
)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "{% macro greet(name) %}Hello {{ name }}{% endmacro %}{{ greet('World') }}",
            "Hello World",
        ),
        ("{% macro greet(name='Guest') %}Hi {{ name }}{% endmacro %}{{ greet() }}", "Hi Guest"),
        (
            "{% macro my_func(a, b=False) %}{% if b %}{{ a }}{% else %}nope{% endif %}"
            "{% endmacro %}{{ my_func(1, b=True) }}",
            "1",
        ),
        (
            "{% macro add(a, b, c=0) %}{{ a + b + c }}{% endmacro %}"
            "{{ add(1, 2) }},{{ add(1, 2, 3) }},{{ add(1, b=10) }},{{ add(1, 2, c=5) }}",
            "3,6,11,8",
        ),
        (
            "{% macro greet(first, last, greeting='Hello') %}{{ greeting }}, {{ first }} "
            "{{ last }}{% endmacro %}{{ greet(last='Smith', first='John') }},"
            "{{ greet(last='Doe', greeting='Hi', first='Jane') }}",
            "Hello, John Smith,Hi, Jane Doe",
        ),
        (
            _CALLER_MACRO,
            "Dict {\n    root1: 1\n    root2: {\n        nest1: 1\n        nest2: {\n"
            "            nest3: 2\n        }\n    }\n}",
        ),
        (
            "{% set ns = namespace(count=0) %}{% for i in range(3) %}"
            "{% set ns.count = ns.count + 1 %}{% endfor %}{{ ns.count }}",
            "3",
        ),
    ],
)
def test_llama_cpp_jinja_macro_cases(source: str, expected: str) -> None:
    assert ChatTemplate(source).render([]) == expected


def test_mirothinker_macros_read_their_callers_variables_as_in_llama_cpp() -> None:
    """MiroThinker's macros take no parameters: ``function_name()`` reads the ``tool`` of
    the loop that calls it and ``render_tool()`` sets the caller's ``ns.last_server``. A
    server heading is written once per server, each tool once; in the history (no
    ``tool`` in scope there) a call's server is ``generic-extras``, as llama.cpp renders."""
    tools = [
        *TOOLS,
        _tool("run_python_sandbox", "Run code", "code"),
        _tool("web_search", "Search", "q"),
    ]
    text = render_chat(load("MiroThinker.jinja"), convert_messages(agent_conversation()), tools)
    head = text[: text.index("# General Objective")]
    assert head.count("## Server name:") == 3, head
    for server, tool in (
        ("tool-python", "run_python_sandbox"),
        ("search_and_scrape_webpage", "web_search"),
        ("generic-extras", "get_weather"),
    ):
        assert head.index(f"## Server name: {server}\n") < head.index(f"### Tool name: {tool}\n")
        assert head.count(f"### Tool name: {tool}\n") == 1
    assert head.count("### Tool name:") == len(tools)
    assert text.count("<server_name>generic-extras</server_name>\n<tool_name>") == 2
    assert '<tool_name>get_time</tool_name>\n<arguments>\n{"tz": "Asia/Tokyo"}' in text
