"""Agents as LangChain builds them, on scripted models of real tool-call syntaxes.

``create_agent(llm, tools=[...], response_format=Schema)`` picks the provider strategy
(the profile says ``structured_output``) and binds the tools with OpenAI's
``response_format``: the reply is then a call in the model's own syntax or the typed
answer, and the agent returns a validated ``structured_response``. A model that calls
two tools at once has both run by default. Each model prints an exact script
(:mod:`tests.printing_model`), so what is checked is the request path, not the model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from langchain_core.exceptions import ModelInvalidRequestError
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from langchain_llamacpp_local import ChatLlamaCpp
from tests.llama_cpp_cases import TEMPLATES
from tests.printing_model import write_printing_llama, write_turns_llama

QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
QWEN3_CODER = (TEMPLATES / "Qwen3-Coder.jinja").read_text(encoding="utf-8")

#: Hermes-style calls with no generation prompt: the prompt ends with the last message,
#: so a scripted model can tell the question ("?") from the tool results ("#").
HERMES_TURNS = (
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' %}<tool_response>{{ m.content }}"
    "{%- elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}"
    "{%- else %}{{ m.content }}{% endif -%}"
    "{%- endfor -%}"
)


class Weather(BaseModel):
    """The answer about the weather."""

    city: str
    sky: str


ANSWER = '{"city": "Paris", "sky": "sunny"}'
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'

ran: list[str] = []


@tool
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    ran.append(f"weather {city}")
    return f"sunny in {city}#"


@tool
def get_time(city: str) -> str:
    """Get the local time in a city."""
    ran.append(f"time {city}")
    return f"noon in {city}#"


def _llm(path: Path, **kw: object) -> ChatLlamaCpp:
    return ChatLlamaCpp(model_path=str(path), temperature=0, n_ctx=2048, max_tokens=200, **kw)


def _ask(agent: object) -> dict[str, object]:
    question = {"messages": [HumanMessage("What is the weather in Paris?")]}
    return agent.invoke(question, {"recursion_limit": 8})  # type: ignore[attr-defined]


def test_hermes_agent_calls_then_returns_the_typed_answer(tmp_path: Path) -> None:
    from langchain.agents import create_agent

    path = write_turns_llama(
        tmp_path / "hermes.gguf",
        {"?": CALL, "#": ANSWER},
        chat_template=HERMES_TURNS,
        cuts=("<tool_call>",),
    )
    llm = _llm(path)
    ran.clear()
    result = _ask(create_agent(llm, tools=[get_weather], response_format=Weather))
    assert ran == ["weather Paris"]
    assert result["structured_response"] == Weather(city="Paris", sky="sunny")
    kinds = [m.type for m in result["messages"]]  # type: ignore[attr-defined]
    assert kinds == ["human", "ai", "tool", "ai"]
    call = result["messages"][1]  # type: ignore[index]
    assert call.response_metadata["finish_reason"] == "tool_calls"
    assert result["messages"][-1].response_metadata["finish_reason"] == "stop"  # type: ignore[index]


@pytest.mark.parametrize(
    ("template", "text", "reasoning"),
    [
        (QWEN3_CODER, ANSWER, None),
        (QWEN3, ANSWER, None),
        # a thinking model, by default: the block is allowed before the answer and
        # extracted from it
        (QWEN3, f"<think>\nThe tool is not needed.\n</think>\n\n{ANSWER}", None),
        (QWEN3, f"<think>\nThe tool is not needed.\n</think>\n\n{ANSWER}", True),
    ],
    ids=["qwen3_coder", "hermes", "thinking-default", "thinking-on"],
)
def test_agent_answers_in_the_schema_beside_tools(
    template: str, text: str, reasoning: bool | None, tmp_path: Path
) -> None:
    from langchain.agents import create_agent

    path, _ = write_printing_llama(
        tmp_path / "m.gguf", text, chat_template=template, cuts=("<think>", "</think>")
    )
    llm = _llm(path, reasoning=reasoning)
    result = _ask(create_agent(llm, tools=[get_weather], response_format=Weather))
    assert result["structured_response"] == Weather(city="Paris", sky="sunny")
    final = result["messages"][-1]  # type: ignore[index]
    assert isinstance(final, AIMessage) and json.loads(str(final.content)) == json.loads(ANSWER)
    if "<think>" in text:
        assert final.additional_kwargs["reasoning_content"] == "The tool is not needed."
    # the grammar is the calls in the model's syntax or the answer, never tools alone
    prompt = llm.render_prompt(
        "hi",
        tools=[get_weather],
        response_format={
            "type": "json_schema",
            "json_schema": {"schema": Weather.model_json_schema()},
        },
    )
    assert prompt.grammar and "answer-root" in prompt.grammar and "calls-root" in prompt.grammar


def test_a_thinking_model_thinks_before_a_forced_call(tmp_path: Path) -> None:
    """function_calling, tool_choice="any" and ToolStrategy leave room for the block."""
    from langchain.agents import create_agent
    from langchain.agents.structured_output import ToolStrategy

    text = (
        "<think>\nI should answer.\n</think>\n\n<tool_call>\n"
        '{"name": "Weather", "arguments": {"city": "Paris", "sky": "sunny"}}\n</tool_call>'
    )
    path, _ = write_printing_llama(
        tmp_path / "think.gguf", text, chat_template=QWEN3, cuts=("<tool_call>", "</think>")
    )
    llm = _llm(path)
    out = llm.with_structured_output(Weather, method="function_calling").invoke("weather?")
    assert out == Weather(city="Paris", sky="sunny")
    msg = llm.bind_tools([Weather], tool_choice="any").invoke("weather?")
    assert msg.tool_calls[0]["args"] == {"city": "Paris", "sky": "sunny"}
    assert msg.additional_kwargs["reasoning_content"] == "I should answer."
    assert "<think>" not in str(msg.content)
    agent = create_agent(llm, tools=[], response_format=ToolStrategy(Weather))
    assert _ask(agent)["structured_response"] == Weather(city="Paris", sky="sunny")
    # asked not to think, the grammar leaves no room (the template closed the block)
    prompt = llm.render_prompt("weather?", tools=[Weather], tool_choice="any", reasoning=False)
    assert prompt.grammar and "think" not in prompt.grammar


def test_two_parallel_calls_both_run_by_default(tmp_path: Path) -> None:
    from langchain.agents import create_agent

    path = write_turns_llama(
        tmp_path / "parallel.gguf",
        {"?": f"{CALL}\n{TIME_CALL}", "#": "Sunny at noon."},
        chat_template=HERMES_TURNS,
        cuts=("<tool_call>",),
    )
    ran.clear()
    result = _ask(create_agent(_llm(path), tools=[get_weather, get_time]))
    assert sorted(ran) == ["time Paris", "weather Paris"]
    assert result["messages"][-1].content == "Sunny at noon."  # type: ignore[index]


def test_a_call_past_the_first_is_reported_when_one_is_allowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With one call allowed the grammar lets the model write one more, which is
    reported, not lost silently (the Hermes prompt of a template without tools)."""
    path, _ = write_printing_llama(
        tmp_path / "two.gguf",
        f"{CALL}\n{TIME_CALL}",
        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
        cuts=("<tool_call>",),
    )
    llm = _llm(path)
    bound = llm.bind_tools([get_weather, get_time], parallel_tool_calls=False)
    with caplog.at_level(logging.WARNING):
        msg = bound.invoke("weather and time?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    dropped = msg.response_metadata["dropped_tool_calls"]
    assert [(c["name"], c["args"]) for c in dropped] == [("get_time", {"city": "Paris"})]
    assert "dropped get_time" in caplog.text
    streamed = list(bound.stream("weather and time?"))
    merged = streamed[0]
    for c in streamed[1:]:
        merged = merged + c
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]
    # the default for a template that cannot show parallel calls is one call, reported
    assert (
        llm.bind_tools([get_weather, get_time])
        .invoke("weather and time?")
        .response_metadata["dropped_tool_calls"]
    )
    both = llm.bind_tools([get_weather, get_time], parallel_tool_calls=True).invoke("weather?")
    assert [c["name"] for c in both.tool_calls] == ["get_weather", "get_time"]
    assert "dropped_tool_calls" not in both.response_metadata


def test_response_format_beside_an_unmarked_call_syntax_is_refused_at_bind(
    tmp_path: Path,
) -> None:
    """Llama 3.1 writes a call as a bare JSON object: it cannot be told apart from a JSON
    answer, so binding both names ToolStrategy instead of ignoring the format."""
    llama31 = (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text(encoding="utf-8")
    path, _ = write_printing_llama(tmp_path / "l.gguf", ANSWER, chat_template=llama31)
    llm = _llm(path)
    fmt = {"type": "json_schema", "json_schema": {"schema": Weather.model_json_schema()}}
    with pytest.raises(ModelInvalidRequestError, match="ToolStrategy"):
        llm.bind_tools([get_weather], response_format=fmt)
    with pytest.raises(ModelInvalidRequestError, match="ToolStrategy"):
        llm.bind_tools([get_weather]).invoke("hi", response_format=fmt)
