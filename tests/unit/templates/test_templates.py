"""Tests for templates.py: real model templates, the sandbox, message conversion,
template selection and the lenient built-ins (no model needed)."""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)

from langchain_llamacpp_local.errors import ChatTemplateError
from langchain_llamacpp_local.templates.builtin_templates import BUILTIN_TEMPLATES, select_template
from langchain_llamacpp_local.templates.chat_template import ChatTemplate
from langchain_llamacpp_local.templates.hermes_prompt import (
    TOOL_SYSTEM_PROMPT,
    flatten_tool_messages,
    inject_tool_prompt,
    tool_prompt,
)
from langchain_llamacpp_local.templates.messages import convert_messages

# ----------------------------------------------------------------- real templates

# Qwen2.5-Instruct's template (verbatim apart from line breaks).
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama 3.1 Instruct's template, shortened (builtin_tools / system-tools branches cut).
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Gemma 3's official template: no system role, the system text opens the first user turn.
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Gemma 2's template: raises on a system message and on non-alternating roles.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# DeepSeek-V3 style: tool-call arguments are concatenated as a string.
CONCAT_ARGS = (
    "{% for m in messages %}{% if m.tool_calls %}{% for tc in m.tool_calls %}"
    "{{ 'call ' + tc['function']['name'] + '\n```json\n' + tc['function']['arguments'] + '\n```' }}"
    "{% endfor %}{% else %}{{ m.role + ': ' + m.content + '\n' }}{% endif %}{% endfor %}"
)

# Qwen3-style thinking switch.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city; use <city> & country.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

TOOL_CONVERSATION: list[BaseMessage] = [
    SystemMessage("You are terse."),
    HumanMessage("Weather in Paris & Nice?"),
    AIMessage(
        "",
        tool_calls=[
            {"name": "get_weather", "args": {"city": "Paris & <Nice>"}, "id": "call_1"},
            {"name": "get_weather", "args": {"city": "Nice"}, "id": "call_2"},
        ],
    ),
    ToolMessage("18C", tool_call_id="call_1", name="get_weather"),
    ToolMessage("21C", tool_call_id="call_2", name="get_weather"),
    AIMessage("Paris 18C, Nice 21C."),
    HumanMessage("Thanks"),
]

# langchain-tests' standard conversations.
DOUBLE_MESSAGES: list[BaseMessage] = [
    SystemMessage("hello"),
    SystemMessage("hello"),
    HumanMessage("hello"),
    HumanMessage("hello"),
    AIMessage("hello"),
    AIMessage("hello"),
    HumanMessage("how are you"),
]
STANDARD_CONVERSATIONS: list[list[BaseMessage]] = [
    DOUBLE_MESSAGES,
    [HumanMessage("hello"), AIMessage("hello"), HumanMessage("how are you")],
    [SystemMessage("be nice"), HumanMessage("hi")],
    [HumanMessage("hi")],
    TOOL_CONVERSATION,
    [
        HumanMessage("What is 3 * 12?"),
        AIMessage(
            [
                {"type": "text", "text": "Let me compute."},
                {"type": "tool_use", "id": "x", "name": "multiply", "input": {"a": 3, "b": 12}},
            ],
            tool_calls=[{"name": "multiply", "args": {"a": 3, "b": 12}, "id": "x"}],
        ),
        ToolMessage("36", tool_call_id="x"),
    ],
]


def builtin(name: str) -> ChatTemplate:
    return ChatTemplate(
        BUILTIN_TEMPLATES[name], origin=f"builtin:{name}", bos_token="<bos>", eos_token="</s>"
    )


# ----------------------------------------------------------------- real templates render


def test_qwen25_renders_tools_tool_calls_and_results() -> None:
    tpl = ChatTemplate(QWEN25, origin="gguf:tokenizer.chat_template")
    assert tpl.supports_tools and tpl.supports_system_role and tpl.tool_call_args_as_dict
    text = tpl.render(convert_messages(TOOL_CONVERSATION), tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n" + tool_prompt([WEATHER_TOOL]))
    # tojson keeps < and & (Jinja's own filter would write \u003c / \u0026).
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris & <Nice>"}}\n</tool_call>'
        in text
    )
    assert "use <city> & country." in text
    assert (
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
        in text
    )
    assert text.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_builtin_chatml_matches_qwen25_byte_for_byte() -> None:
    """The built-in is Qwen 2.5's format, so the same tool parser fits both."""
    msgs = convert_messages(TOOL_CONVERSATION)
    for tools in (None, [WEATHER_TOOL]):
        for gen in (True, False):
            qwen = ChatTemplate(QWEN25).render(msgs, tools=tools, add_generation_prompt=gen)
            assert builtin("chatml").render(msgs, tools=tools, add_generation_prompt=gen) == qwen


def test_tool_system_prompt_is_qwens_text() -> None:
    text = ChatTemplate(QWEN25).render([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL])
    assert tool_prompt([WEATHER_TOOL]) in text
    assert "{tools}" in TOOL_SYSTEM_PROMPT
    assert TOOL_SYSTEM_PROMPT.endswith(
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def test_llama31_bos_date_and_tools_in_user_message() -> None:
    tpl = ChatTemplate(LLAMA31, bos_token="<|begin_of_text|>")
    msgs = convert_messages(
        [
            SystemMessage("sys"),
            HumanMessage("weather?"),
            AIMessage(
                "", tool_calls=[{"name": "get_weather", "args": {"city": "Oslo"}, "id": "c"}]
            ),
            ToolMessage("cold", tool_call_id="c"),
        ]
    )
    text = tpl.render(msgs, tools=[WEATHER_TOOL])
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    )
    assert text.count("<|begin_of_text|>") == 1
    assert "Today Date: " in text and "26 Jul 2024" not in text  # our date_string wins
    assert '"name": "get_weather"' in text and "weather?<|eot_id|>" in text
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\ncold<|eot_id|>" in text
    assert (
        tpl.render(msgs, tools=[WEATHER_TOOL], date_string="1 Jan 2030").count(
            "Today Date: 1 Jan 2030"
        )
        == 1
    )
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        tpl.render(convert_messages(TOOL_CONVERSATION), tools=[WEATHER_TOOL])


def test_gemma3_official_template() -> None:
    tpl = ChatTemplate(GEMMA3, origin="gguf:tokenizer.chat_template", bos_token="<bos>")
    assert tpl.supports_system_role  # merges it itself
    assert not tpl.supports_tools
    msgs = convert_messages(
        [
            SystemMessage("Be brief."),
            HumanMessage(
                [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ]
            ),
        ]
    )
    assert tpl.render(msgs) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is this?<start_of_image><end_of_turn>\n<start_of_turn>model\n"
    )
    assert tpl.render(msgs, add_generation_prompt=False).endswith("<end_of_turn>\n")
    with pytest.raises(
        ChatTemplateError,
        match=r"'gguf:tokenizer\.chat_template': Conversation roles must alternate",
    ):
        tpl.render(convert_messages(DOUBLE_MESSAGES))


def test_gemma2_has_no_system_role_and_system_is_merged() -> None:
    tpl = ChatTemplate(GEMMA2, origin="gemma2", bos_token="<bos>")
    assert not tpl.supports_system_role
    text = tpl.render(
        convert_messages(
            [SystemMessage("Rules."), HumanMessage("Hi"), AIMessage("Yo"), HumanMessage("Ok")]
        )
    )
    assert text == (
        "<bos><start_of_turn>user\nRules.\n\nHi<end_of_turn>\n<start_of_turn>model\nYo<end_of_turn>\n"
        "<start_of_turn>user\nOk<end_of_turn>\n<start_of_turn>model\n"
    )
    # A system message later on is folded into the following user turn.
    text = tpl.render(
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "system", "content": "S"},
            {"role": "user", "content": "c"},
        ]
    )
    assert "<start_of_turn>user\nS\n\nc<end_of_turn>" in text


def test_raise_exception_becomes_chat_template_error_naming_origin() -> None:
    tpl = ChatTemplate(GEMMA2, origin="gguf:tokenizer.chat_template")
    with pytest.raises(ChatTemplateError, match=r"gguf:tokenizer\.chat_template.*must alternate"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert issubclass(ChatTemplateError, ValueError)


def test_generation_prompt_on_and_off() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    expected = {
        "gemma": "<start_of_turn>model\n",
        "chatml": "<|im_start|>assistant\n",
        "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "phi3": "<|assistant|>\n",
    }
    for name, suffix in expected.items():
        tpl = builtin(name)
        on, off = tpl.render(msgs), tpl.render(msgs, add_generation_prompt=False)
        assert on == off + suffix, name
    assert ChatTemplate(QWEN25).render(msgs).endswith("<|im_start|>assistant\n")
    assert (
        not ChatTemplate(QWEN25).render(msgs, add_generation_prompt=False).endswith("assistant\n")
    )


def test_bos_token_variable() -> None:
    for name in ("gemma", "llama3", "mistral"):
        assert builtin(name).render([{"role": "user", "content": "x"}]).startswith("<bos>")
    assert ChatTemplate("{{ bos_token }}|{{ eos_token }}").render([]) == "|"
    assert (
        ChatTemplate("{{ bos_token }}|{{ eos_token }}", bos_token="<s>", eos_token="</s>").render(
            []
        )
        == "<s>|</s>"
    )


def test_tojson_filter_does_not_html_escape() -> None:
    tpl = ChatTemplate(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ y | tojson(sort_keys=true, separators=(',', ':')) }}"
    )
    out = tpl.render([], x="<a & 'b'>", y={"b": 1, "a": "é"})
    assert out == '"<a & \'b\'>"|"<a & \'b\'>"|{"a":"é","b":1}'


def test_template_kwargs_reach_the_template() -> None:
    tpl = ChatTemplate(THINKING)
    msgs = [{"role": "user", "content": "hi"}]
    assert tpl.render(msgs, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tpl.render(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert tpl.render(msgs).endswith("<|im_start|>assistant\n")
    assert (
        ChatTemplate("{{ chat_template_kwargs.x }}").render([], chat_template_kwargs={"x": 1})
        == "1"
    )


def test_helpers_and_generation_tag() -> None:
    tpl = ChatTemplate(
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
        "|{{ strftime_now('%Y') }}|{{ date_string }}|{{ datetime }}"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    out = tpl.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    head, year, date_string, dt = out.split("|")
    assert head == "[a][b]"
    assert year.isdigit() and len(year) == 4
    assert year in date_string and date_string.split()[0].isdigit()  # "%d %b %Y"
    assert dt.startswith(date_string.split()[1]) and dt.endswith("01")  # "%b %d %Y" then loop 0,1


def test_message_content_is_data_not_template() -> None:
    for name in BUILTIN_TEMPLATES:
        text = builtin(name).render([{"role": "user", "content": "{{ 7*7 }}{% raw %}"}])
        assert "{{ 7*7 }}{% raw %}" in text and "49" not in text


# ----------------------------------------------------------------- errors and the sandbox


def test_syntax_error_raises_at_compile_naming_origin() -> None:
    with pytest.raises(ChatTemplateError, match="'gguf:tokenizer.chat_template' failed to compile"):
        ChatTemplate("{% for m in messages %}{{ m.content }", origin="gguf:tokenizer.chat_template")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% endgeneration %}")


@pytest.mark.parametrize(
    "source",
    [
        "{{ foo.bar() }}",  # calling an undefined value (its attributes are undefined)
        "{{ 1 + 'a' }}",  # TypeError inside rendering
        "{{ messages[0].content | tojson }}{{ undefined_thing | tojson }}",  # tojson(Undefined)
        "{{ messages.pop().missing.attr - 1 }}",  # mutation allowed, the result is undefined
        "{{ 1 // 0 }}",
        "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",  # runaway recursion
    ],
)
def test_render_failures_are_chat_template_errors(source: str) -> None:
    tpl = ChatTemplate(source, origin="override")
    with pytest.raises(ChatTemplateError, match="'override'"):
        tpl.render([{"role": "user", "content": "x"}])


SSTI_PAYLOADS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__.os.system('id') }}",
    "{{ self._TemplateReference__context.joiner.__init__.__globals__.os.popen('id').read() }}",
    "{{ config.items() }}",
    "{% for x in ().__class__.__base__.__subclasses__() %}{{ x }}{% endfor %}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ namespace.__init__.__globals__['__builtins__']['__import__']('os').popen('id').read() }}",
    "{{ raise_exception.__globals__['json'] }}",
    "{{ strftime_now.__globals__.datetime }}",
    "{{ '{0.__class__.__mro__}'.format(1) }}",
    "{{ (messages|attr('__class__')).__subclasses__() }}",
    "{{ request.application.__globals__.__builtins__.__import__('os').popen('id').read() }}",
    "{{ _jj_iter.__globals__['os'] }}",
    "{{ _jj_concat.__code__.co_consts }}",
    "{% set l = [] %}{{ l.append.__self__.__class__.__subclasses__() }}",
]


@pytest.mark.parametrize("payload", SSTI_PAYLOADS)
def test_ssti_payloads_are_contained(payload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    executed: list[Any] = []
    monkeypatch.setattr(os, "popen", lambda *a, **k: executed.append(a))
    monkeypatch.setattr(os, "system", lambda *a, **k: executed.append(a))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: executed.append(a))
    tpl = ChatTemplate(payload, origin="override")  # compiling is harmless
    with pytest.raises(ChatTemplateError, match=r"'override'.*(SecurityError|UndefinedError)"):
        tpl.render([{"role": "user", "content": "x"}])
    assert executed == []


# ----------------------------------------------------------------- convert_messages


def test_convert_every_message_type() -> None:
    msgs = convert_messages(
        [
            SystemMessage("s"),
            HumanMessage("h", name="alice"),
            AIMessage(
                "",
                tool_calls=[{"name": "f", "args": {"a": 1}, "id": "c1"}],
                additional_kwargs={"reasoning_content": "because"},
            ),
            ToolMessage("out", tool_call_id="c1", name="f"),
            ToolMessage("boom", tool_call_id="c2", status="error"),
            ChatMessage(role="developer", content="d"),
            ChatMessage(role="user", content="u"),
            ChatMessage(role="assistant", content="a"),
            ChatMessage(role="tool", content="t"),
            ChatMessage(role="system", content="s2"),
            FunctionMessage(name="fn", content="r"),
            AIMessage("plain"),
        ]
    )
    assert msgs == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "h", "name": "alice"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
            ],
            "reasoning_content": "because",
        },
        {"role": "tool", "content": "out", "tool_call_id": "c1", "name": "f"},
        {"role": "tool", "content": "Error: boom", "tool_call_id": "c2"},
        {"role": "system", "content": "d"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "t"},
        {"role": "system", "content": "s2"},
        {"role": "tool", "content": "r", "name": "fn"},
        {"role": "assistant", "content": "plain"},
    ]


def test_convert_content_forms() -> None:
    image = {"type": "image", "base64": "AAAA", "mime_type": "image/png"}
    image_url = {"type": "image_url", "image_url": {"url": "https://x/y.png"}}
    [a, b, c, d, e] = convert_messages(
        [
            HumanMessage(["one", {"type": "text", "text": "two"}]),
            HumanMessage([{"type": "text", "text": "look"}, image, "and", image_url]),
            AIMessage(
                [
                    {"type": "thinking", "thinking": "hmm"},
                    {"type": "reasoning", "reasoning": "hmm"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t", "name": "f", "input": {}},
                    {"type": "tool_call", "id": "t", "name": "f", "args": {}},
                ],
                tool_calls=[{"name": "f", "args": {}, "id": "t"}],
            ),
            HumanMessage([]),
            ToolMessage([{"type": "text", "text": "bad"}, image], tool_call_id="t", status="error"),
        ]
    )
    assert a["content"] == "one\ntwo"
    assert b["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image", "image": image},
        {"type": "text", "text": "and"},
        {"type": "image", "image": image_url},
    ]
    assert c["content"] == "calling" and c["tool_calls"][0]["function"]["name"] == "f"
    assert d["content"] == ""
    assert (
        e["content"][0] == {"type": "text", "text": "Error: "}
        and e["content"][-1]["type"] == "image"
    )


def test_convert_already_prefixed_error_and_invalid_tool_calls() -> None:
    [tool, ai] = convert_messages(
        [
            ToolMessage("Error: no such city", tool_call_id="c", status="error"),
            AIMessage(
                "",
                invalid_tool_calls=[
                    {
                        "name": "f",
                        "args": "{oops",
                        "id": "c",
                        "error": "bad json",
                        "type": "invalid_tool_call",
                    }
                ],
            ),
        ]
    )
    assert tool["content"] == "Error: no such city"
    assert ai["tool_calls"] == [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    ]


def test_convert_rejects_unknown_blocks_and_roles() -> None:
    with pytest.raises(ValueError, match=r"message 1.*'video'"):
        convert_messages([HumanMessage("ok"), HumanMessage([{"type": "video", "base64": "AA"}])])
    with pytest.raises(ValueError, match=r"message 0.*None"):
        convert_messages([HumanMessage([{"text": "no type"}])])
    with pytest.raises(ValueError, match="'wizard'"):
        convert_messages([ChatMessage(role="wizard", content="x")])
    with pytest.raises(ValueError, match="remove"):
        convert_messages([RemoveMessage(id="1")])


def test_convert_accepts_message_like_inputs() -> None:
    assert convert_messages([("human", "hi"), {"role": "assistant", "content": "yo"}]) == [  # type: ignore[list-item]
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]


# ----------------------------------------------------------------- tool prompt, flattening


def test_inject_tool_prompt() -> None:
    original = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "hi"}]
    out = inject_tool_prompt(original, [WEATHER_TOOL])
    assert out[0]["content"] == tool_prompt([WEATHER_TOOL]) + "\n\nBe nice."
    assert original[0]["content"] == "Be nice."  # not mutated
    out = inject_tool_prompt([{"role": "user", "content": "hi"}], [WEATHER_TOOL])
    assert out[0] == {"role": "system", "content": tool_prompt([WEATHER_TOOL])}
    assert len(out) == 2
    parts = inject_tool_prompt(
        [{"role": "system", "content": [{"type": "text", "text": "S"}]}], [WEATHER_TOOL]
    )
    assert (
        parts[0]["content"][0]["text"].startswith("# Tools")
        and parts[0]["content"][1]["text"] == "S"
    )
    line = '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city; use <city> & country."'
    assert "<tools>\n" + line in tool_prompt([WEATHER_TOOL])


def test_flatten_tool_messages() -> None:
    msgs = convert_messages(TOOL_CONVERSATION)
    flat = flatten_tool_messages(msgs)
    assert all("tool_calls" not in m and m["role"] != "tool" for m in flat)
    assert flat[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris & <Nice>"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>',
    }
    assert flat[3] == {
        "role": "user",
        "content": "<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response>",
    }
    assert len(flat) == len(msgs) - 1
    assert msgs[2]["tool_calls"]  # input untouched
    with_text = flatten_tool_messages(
        [{"role": "assistant", "content": "Sure.", "tool_calls": msgs[2]["tool_calls"][:1]}]
    )
    assert with_text[0]["content"].startswith("Sure.\n<tool_call>\n")


def test_tools_through_a_template_without_tool_support() -> None:
    """Gemma 2 (no tools, no system role, strict alternation) with a tool conversation."""
    tpl = ChatTemplate(GEMMA2, bos_token="<bos>")
    assert not tpl.supports_tools and "tool_calls" not in tpl.source
    msgs = flatten_tool_messages(
        inject_tool_prompt(convert_messages(TOOL_CONVERSATION), [WEATHER_TOOL])
    )
    text = tpl.render(msgs)
    assert text.startswith("<bos><start_of_turn>user\n# Tools\n")
    assert "You are terse.\n\nWeather in Paris & Nice?<end_of_turn>" in text
    assert "<start_of_turn>user\n<tool_response>\n18C" in text


def test_string_arguments_for_concatenating_templates() -> None:
    tpl = ChatTemplate(CONCAT_ARGS)
    assert not tpl.tool_call_args_as_dict
    assert (
        ChatTemplate(QWEN25).tool_call_args_as_dict and ChatTemplate(LLAMA31).tool_call_args_as_dict
    )
    msgs = convert_messages(TOOL_CONVERSATION[1:3])
    text = tpl.render(msgs)
    assert 'call get_weather\n```json\n{"city": "Paris & <Nice>"}\n```' in text
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris & <Nice>"}


def test_supports_tools_ignores_comments_and_text() -> None:
    assert not ChatTemplate("{# tools #}tools{{ messages|length }}").supports_tools
    assert ChatTemplate("{% if tools %}T{% endif %}").supports_tools


# ----------------------------------------------------------------- select_template


def test_select_template_origins() -> None:
    meta = {
        "tokenizer.chat_template": THINKING,
        "tokenizer.chat_template.tool_use": QWEN25,
        "general.architecture": "qwen2",
        "_bos_token": "<B>",
        "_eos_token": "<E>",
    }
    t = select_template(meta)
    assert (t.origin, t.source, t.bos_token, t.eos_token) == (
        "gguf:tokenizer.chat_template",
        THINKING,
        "<B>",
        "<E>",
    )
    assert select_template(meta, with_tools=True).origin == "gguf:tokenizer.chat_template.tool_use"
    assert (
        select_template(meta, override="tool_use").origin == "gguf:tokenizer.chat_template.tool_use"
    )
    assert select_template(meta, override="chatml").origin == "builtin:chatml"
    t = select_template(meta, override=" Gemma ")
    assert t.origin == "builtin:gemma" and t.render([]) == "<B><start_of_turn>model\n"
    assert select_template(meta, override="{{ 'x' }}").origin == "override"
    with pytest.raises(ChatTemplateError, match="'override'"):
        select_template(meta, override="{% if %}")
    no_tool_use = {"tokenizer.chat_template": THINKING}
    assert select_template(no_tool_use, with_tools=True).origin == "gguf:tokenizer.chat_template"


@pytest.mark.parametrize(
    ("arch", "name", "expected"),
    [
        ("gemma3", "Gemma 3 270m It", "gemma"),
        ("gemma2", "gemma-2-2b-it", "gemma"),
        ("gemma", "", "gemma"),
        ("llama", "Meta-Llama-3.1-8B-Instruct", "llama3"),
        ("llama", "Llama3 8B", "llama3"),
        ("llama", "TinyLlama", "chatml"),
        ("llama", "Mistral-7B-Instruct-v0.3", "mistral"),
        ("mistral3", "", "mistral"),
        ("phi3", "Phi 3.5 Mini Instruct", "phi3"),
        ("qwen2", "Qwen2.5 0.5B", "chatml"),
        ("", "", "chatml"),
    ],
)
def test_select_builtin_by_architecture(arch: str, name: str, expected: str) -> None:
    t = select_template(
        {"general.architecture": arch, "general.name": name, "tokenizer.chat_template": ""}
    )
    assert t.origin == f"builtin:{expected}" and t.source == BUILTIN_TEMPLATES[expected]


def test_broken_gguf_template_falls_back_to_builtin(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        t = select_template(
            {"tokenizer.chat_template": "{% for %}", "general.architecture": "gemma3"}
        )
    assert t.origin == "builtin:gemma"
    assert "gguf:tokenizer.chat_template" in caplog.text


# ----------------------------------------------------------------- built-ins


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(STANDARD_CONVERSATIONS)))
def test_builtins_render_standard_conversations(name: str, conversation: int) -> None:
    tpl = builtin(name)
    msgs = convert_messages(STANDARD_CONVERSATIONS[conversation])
    for tools in (None, [WEATHER_TOOL]):
        text = tpl.render(msgs, tools=tools)
        for m in msgs:
            if isinstance(m["content"], str):
                assert m["content"].strip() in text
        if tools:
            assert tool_prompt(tools) in text
        if any(m.get("tool_calls") for m in msgs):
            assert "<tool_call>\n{" in text
        if any(m["role"] == "tool" for m in msgs):
            assert "<tool_response>\n" in text


def test_builtin_gemma_format() -> None:
    text = builtin("gemma").render(convert_messages(DOUBLE_MESSAGES))
    assert text == (
        "<bos><start_of_turn>user\nhello\n\nhello\n\nhello<end_of_turn>\n<start_of_turn>user\nhello<end_of_turn>\n"
        "<start_of_turn>model\nhello<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nhow are you<end_of_turn>\n<start_of_turn>model\n"
    )
    text = builtin("gemma").render(
        convert_messages(TOOL_CONVERSATION), tools=[WEATHER_TOOL], add_generation_prompt=False
    )
    assert text.startswith(
        "<bos><start_of_turn>user\nYou are terse.\n\n"
        + tool_prompt([WEATHER_TOOL])
        + "\n\nWeather in Paris"
    )
    assert (
        "<start_of_turn>model\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris & <Nice>"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call><end_of_turn>\n'
        "<start_of_turn>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><end_of_turn>\n"
        "<start_of_turn>model\nParis 18C, Nice 21C.<end_of_turn>\n"
    ) in text
    # System only, or tools only: still a user turn, never a dropped instruction.
    assert (
        builtin("gemma").render([{"role": "system", "content": "S"}])
        == "<bos><start_of_turn>user\nS<end_of_turn>\n<start_of_turn>model\n"
    )
    images = convert_messages([HumanMessage([{"type": "image", "url": "u"}, "what?"])])
    assert "<start_of_turn>user\n<start_of_image>what?<end_of_turn>" in builtin("gemma").render(
        images
    )


def test_builtin_mistral_and_phi3_formats() -> None:
    msgs = convert_messages(
        [SystemMessage("S"), HumanMessage("a"), AIMessage("b"), HumanMessage("c")]
    )
    assert builtin("mistral").render(msgs) == "<bos>[INST] S\n\na [/INST] b</s>[INST] c [/INST]"
    assert builtin("phi3").render(msgs) == (
        "<|system|>\nS<|end|>\n<|user|>\na<|end|>\n<|assistant|>\nb<|end|>\n<|user|>\nc<|end|>\n<|assistant|>\n"
    )


def test_builtins_keep_system_role_probe_true() -> None:
    for name in BUILTIN_TEMPLATES:
        assert builtin(name).supports_system_role and builtin(name).supports_tools


# ----------------------------------------------------------------- property tests

_text = st.text(max_size=20)
_content = st.one_of(
    _text,
    st.lists(
        st.one_of(
            _text,
            st.builds(lambda t: {"type": "text", "text": t}, _text),
            st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}),
            st.just({"type": "reasoning", "reasoning": "r"}),
        ),
        max_size=3,
    ),
)
_tool_call = st.builds(
    lambda name, v: {"name": name or "f", "args": {"k": v}, "id": "c"},
    st.text(min_size=1, max_size=8),
    _text,
)
_lc_message = st.one_of(
    st.builds(SystemMessage, content=_content),
    st.builds(HumanMessage, content=_content),
    st.builds(AIMessage, content=_content, tool_calls=st.lists(_tool_call, max_size=2)),
    st.builds(
        lambda c, s: ToolMessage(c, tool_call_id="c", status=s),
        _content,
        st.sampled_from(["success", "error"]),
    ),
    st.builds(
        lambda r, c: ChatMessage(role=r, content=c),
        st.sampled_from(["developer", "user", "system"]),
        _text,
    ),
)
_real_templates = [
    ChatTemplate(s, origin=o)
    for o, s in [("qwen", QWEN25), ("llama31", LLAMA31), ("gemma3", GEMMA3), ("gemma2", GEMMA2)]
]
_builtins = {name: builtin(name) for name in BUILTIN_TEMPLATES}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_lc_message, max_size=6), st.booleans(), st.booleans())
def test_property_langchain_conversations(
    messages: list[BaseMessage], with_tools: bool, gen: bool
) -> None:
    msgs = convert_messages(messages)
    tools = [WEATHER_TOOL] if with_tools else None
    texts = [m["content"] for m in msgs if isinstance(m.get("content"), str) and m["content"]]
    for tpl in _builtins.values():  # lenient: never fail on anything convert_messages makes
        out = tpl.render(msgs, tools=tools, add_generation_prompt=gen)
        missing = [t for t in texts if t.strip() and t.strip() not in out]
        assert not missing, (tpl.origin, missing)  # every message's text is in the prompt
    for tpl in _real_templates:  # strict ones may refuse, but only with ChatTemplateError
        try:
            out = tpl.render(msgs, tools=tools, add_generation_prompt=gen)
        except ChatTemplateError as exc:
            assert repr(tpl.origin) in str(exc), exc  # the error names the template
        else:
            assert isinstance(out, str)


_junk = st.one_of(
    st.none(),
    st.integers(),
    _text,
    st.lists(_text, max_size=2),
    st.dictionaries(_text, _text, max_size=2),
)
_raw_message = st.dictionaries(
    st.sampled_from(["role", "content", "tool_calls", "name", "tool_call_id"]),
    st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "model", ""]), _junk),
    max_size=5,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_raw_message, max_size=5))
def test_property_random_dicts_only_raise_template_errors(messages: list[dict[str, Any]]) -> None:
    for tpl in [*_builtins.values(), *_real_templates]:
        try:
            out = tpl.render(messages)
        except ChatTemplateError as exc:  # not any ValueError: UnicodeError, JSON errors...
            assert repr(tpl.origin) in str(exc) or "messages" in str(exc), exc
        else:
            assert isinstance(out, str)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_lc_message, min_size=1, max_size=6), st.booleans())
def test_property_builtin_history_is_a_prefix(
    messages: list[BaseMessage], with_tools: bool
) -> None:
    """Rendering a conversation's head yields a prefix of the whole (KV-cache reuse).

    Holds once past the leading system messages (those are folded into the first
    user turn by no-system-role formats)."""
    msgs = convert_messages(messages)
    tools = [WEATHER_TOOL] if with_tools else None
    first = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
    for name, tpl in _builtins.items():
        full = tpl.render(msgs, tools=tools)
        for k in range(first + 1, len(msgs)):
            if msgs[k]["role"] == "tool" and msgs[k - 1]["role"] == "tool":
                continue  # a tool-result group is still open
            head = tpl.render(msgs[:k], tools=tools, add_generation_prompt=False)
            assert full.startswith(head), (name, k)


# The constructs of MiroThinker v1's template that Jinja2 refuses and llama.cpp's engine
# renders: attributes set on the tools and messages it iterates (``set tool.mt_visited``,
# ``set message.role``), inside macros' callers and nested loops, beside namespaces, and an
# undefined name stored in a namespace and compared later.
_MIRO_LIKE = r"""{%- macro render_tool(server_name, tool, last_server) %}
{%- if tool.mt_visited is not defined %}{% if server_name != last_server %}## {{ server_name }}
{% endif %}### {{ tool.function.name }}
{% endif %}{%- endmacro %}
{%- if tools %}{%- set ns = namespace(formatted_tools='', last_server=None) %}
{%- for tool_server in ['a', 'b'] %}{%- for tool in tools %}
{%- set ns.formatted_tools = ns.formatted_tools + render_tool(tool_server, tool, ns.last_server) %}
{%- set ns.last_server = server_name %}{%- set tool.mt_visited = 1 %}
{%- endfor %}{%- endfor %}{{ ns.formatted_tools }}{% endif %}
{%- for message in messages %}{%- if message.role == 'tool' %}{%- set message.role = 'user' %}{% endif %}{% endfor %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- for message in messages %}{%- if message.role == "assistant" %}
{%- if message.tool_calls | length == 0 %}{%- set message.tool_calls = [1, 2] %}{% endif %}
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_attributes_can_be_set_on_mappings_as_llama_cpp_allows() -> None:
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "r", "tool_call_id": "1"},
    ]
    before = repr((tools, messages))
    out = ChatTemplate(_MIRO_LIKE).render(messages, tools=tools, add_generation_prompt=True)
    assert out == (
        "## a\n### f\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
        "<|im_start|>user\nr<|im_end|>\n<|im_start|>assistant\n"
    )
    assert repr((tools, messages)) == before  # the template changed its own copies only


def test_undefined_values_chain_as_in_llama_cpp() -> None:
    """llama.cpp's engine reads an attribute or item of an undefined value as undefined
    (Jinja2 alone raises): it prints as nothing and tests as not defined."""
    tpl = ChatTemplate(
        "[{{ foo.bar }}|{{ foo['x'].y }}|{{ foo.bar is defined }}|"
        "{{ messages[0].missing.deeper is defined }}|{{ 'a' + foo.bar }}]"
    )
    assert tpl.render([{"role": "user", "content": "x"}]) == "[||False|False|a]"


# llama.cpp runs a macro's body in a copy of its caller's scope (common/jinja/runtime.cpp:
# ``context macro_ctx(args.ctx)``), its parameters bound on top
_CALLER_SCOPED = [
    # the caller's loop variable, as MiroThinker's macros read ``tool``
    (
        "{% macro name() %}{{ tool.name }}{% endmacro %}"
        "{% for tool in [{'name': 'a'}, {'name': 'b'}] %}{{ name() }},{% endfor %}",
        "a,b,",
    ),
    # through a macro calling a macro, and the caller's own loop inside a macro
    (
        "{% macro inner() %}{{ tool }}{{ item }}{% endmacro %}"
        "{% macro outer() %}{% for item in [1, 2] %}{{ inner() }};{% endfor %}{% endmacro %}"
        "{% for tool in ['x'] %}{{ outer() }}{% endfor %}",
        "x1;x2;",
    ),
    # a parameter wins over the caller's variable of the same name
    (
        "{% macro show(tool) %}{{ tool }}{% endmacro %}"
        "{% for tool in ['loop'] %}{{ show('arg') }}{{ show(tool=tool ~ '!') }}{% endfor %}",
        "argloop!",
    ),
    # the caller's variable shadows a top-level one of the same name
    (
        "{% set x = 'top' %}{% macro show() %}{{ x }}{% endmacro %}"
        "{{ show() }},{% for x in ['loop'] %}{{ show() }}{% endfor %},{{ show() }}",
        "top,loop,top",
    ),
    # a macro's own assignment stays its own; a namespace it changes is the caller's
    (
        "{% set ns = namespace(n=0) %}{% macro bump() %}{% set ns.n = ns.n + 1 %}"
        "{% set tool = 'inside' %}{{ tool }}{% endmacro %}"
        "{% for tool in ['t'] %}{{ bump() }}{{ tool }}{% endfor %}{{ ns.n }}",
        "insidet1",
    ),
    # the loop variable of a finished loop is gone, as in llama.cpp: undefined, not an error
    (
        "{% macro name() %}[{{ tool.function.name }}]{% endmacro %}"
        "{% for tool in ['a'] %}{% endfor %}{{ name() }}",
        "[]",
    ),
    # a call block's body keeps the scope where it is written
    (
        "{% macro wrap() %}<{{ caller() }}>{% endmacro %}"
        "{% for tool in ['t'] %}{% call wrap() %}{{ tool }}{% endcall %}{% endfor %}",
        "<t>",
    ),
]


@pytest.mark.parametrize(("source", "expected"), _CALLER_SCOPED)
def test_macros_see_their_callers_variables_as_in_llama_cpp(source: str, expected: str) -> None:
    assert ChatTemplate(source).render([{"role": "user", "content": "x"}]) == expected


def test_unsafe_attributes_fail_even_where_undefined_values_chain() -> None:
    for source in ("{{ raise_exception.__globals__ }}", "{{ foo.bar.__class__ }}"):
        with pytest.raises(ChatTemplateError, match="SecurityError"):
            ChatTemplate(source, origin="override").render([{"role": "user", "content": "x"}])


def test_attributes_still_cannot_be_set_on_strings() -> None:
    with pytest.raises(ChatTemplateError, match="non-namespace"):
        ChatTemplate("{% set s = 'abc' %}{% set s.x = 1 %}").render(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True
        )
