"""Tool calling, structured output and agents on Gemma 3 270M (grammar-constrained paths)."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from langchain_llamacpp_local import ChatLlamaCpp, StructuredOutputTruncatedError
from tests.helpers import assert_generated


@tool
def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the current weather for a city."""
    return f"It is 21 degrees {unit} and sunny in {city}."


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="The person's name")
    age: int = Field(description="Age in years")


class PersonDict(TypedDict):
    """A person mentioned in the text."""

    name: str
    age: int


PERSON_SCHEMA = Person.model_json_schema()


@pytest.fixture(scope="module")
def llm(gemma: str) -> ChatLlamaCpp:
    return ChatLlamaCpp(model_path=gemma, temperature=0, max_tokens=64, n_ctx=4096)


def _check_call(call: dict[str, Any], tools: dict[str, Any]) -> None:
    assert call["name"] in tools
    schema = tools[call["name"]].tool_call_schema.model_json_schema()
    jsonschema.validate(call["args"], schema)
    assert call["id"]


@pytest.mark.parametrize(
    "choice", ["any", "required", "get_weather", {"type": "function", "function": {"name": "add"}}]
)
def test_forced_tool_calls_are_schema_valid(llm: ChatLlamaCpp, choice: Any) -> None:
    tools = {"get_weather": get_weather, "add": add}
    bound = llm.bind_tools(list(tools.values()), tool_choice=choice)
    msg = bound.invoke("What is the weather in Paris? Also add 2 and 3.")
    assert isinstance(msg, AIMessage)
    assert msg.tool_calls, msg
    ids = [c["id"] for c in msg.tool_calls]
    assert len(set(ids)) == len(ids)
    for call in msg.tool_calls:
        _check_call(call, tools)
    if isinstance(choice, str) and choice in tools:
        assert {c["name"] for c in msg.tool_calls} == {choice}
    if isinstance(choice, dict):
        assert {c["name"] for c in msg.tool_calls} == {"add"}


def test_streamed_tool_calls_aggregate_to_the_invoke_result(llm: ChatLlamaCpp) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    prompt = "Weather in Oslo?"
    expected = bound.invoke(prompt)
    chunks = list(bound.stream(prompt))
    assert any(c.tool_call_chunks for c in chunks)
    first = next(c for c in chunks if c.tool_call_chunks)
    assert first.tool_call_chunks[0]["name"] == "get_weather"  # name first, then arguments
    total: AIMessageChunk = chunks[0]
    for c in chunks[1:]:
        total += c
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [
        (c["name"], c["args"]) for c in expected.tool_calls
    ]
    assert [c["id"] for c in total.tool_calls] != [None]
    assert "<tool_call>" not in str(total.content)


def test_tool_choice_none_hides_tools(llm: ChatLlamaCpp) -> None:
    msg = llm.bind_tools([get_weather], tool_choice="none").invoke("Weather in Rome?")
    assert msg.tool_calls == []


def test_unknown_tool_choice_is_a_clear_error(llm: ChatLlamaCpp) -> None:
    with pytest.raises(ValueError, match="not one of the bound tools"):
        llm.bind_tools([get_weather], tool_choice="nope")


def test_tool_message_history_renders(llm: ChatLlamaCpp) -> None:
    bound = llm.bind_tools([get_weather, add])
    history = [
        HumanMessage("Weather in Paris?"),
        AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "c1"}]),
        ToolMessage("It is sunny in Paris.", tool_call_id="c1", name="get_weather"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": "x"}, "id": "c2"}]),
        ToolMessage("Error: b must be an integer", tool_call_id="c2", status="error"),
        ToolMessage([{"type": "text", "text": "list content"}], tool_call_id="c3"),
    ]
    msg = bound.invoke(history)
    assert isinstance(msg, AIMessage)
    assert msg.usage_metadata["input_tokens"] > 50  # type: ignore[index]


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_pydantic(llm: ChatLlamaCpp, method: str) -> None:
    structured = llm.with_structured_output(Person, method=method)  # type: ignore[arg-type]
    prompt = "Extract the person as JSON with keys name and age: Alice is 30 years old."
    if method == "json_mode":
        # json_mode cannot constrain the keys: the 270M base model invents more until
        # max_tokens, and output cut off there is an error, not a partial Person
        out = llm.with_structured_output(Person, method=method, include_raw=True).invoke(prompt)
        if out["raw"].response_metadata["finish_reason"] == "length":
            assert out["parsed"] is None
            assert isinstance(out["parsing_error"], StructuredOutputTruncatedError)
        else:
            assert isinstance(out["parsed"], Person)
    else:
        out = structured.invoke(prompt)
        assert isinstance(out, Person)
        assert out.name and isinstance(out.age, int)


@pytest.mark.parametrize("schema", [PersonDict, PERSON_SCHEMA])
def test_structured_output_typed_dict_and_json_schema(llm: ChatLlamaCpp, schema: Any) -> None:
    out = llm.with_structured_output(schema).invoke("Bob is 41.")
    assert isinstance(out, dict)
    jsonschema.validate(out, PERSON_SCHEMA)


def test_structured_output_include_raw(llm: ChatLlamaCpp) -> None:
    out = llm.with_structured_output(Person, include_raw=True).invoke("Carol is 25.")
    assert isinstance(out["raw"], AIMessage)
    assert isinstance(out["parsed"], Person)
    assert out["parsing_error"] is None


def test_structured_output_pydantic_v1(llm: ChatLlamaCpp) -> None:
    from pydantic.v1 import BaseModel as V1Model

    class Pet(V1Model):
        """A pet."""

        name: str
        legs: int

    out = llm.with_structured_output(Pet).invoke("Rex the dog has four legs.")
    assert isinstance(out, Pet)


def test_create_agent_runs_a_tool_and_answers(llm: ChatLlamaCpp) -> None:
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call

    calls: list[str] = []

    @tool
    def lookup_capital(country: str) -> str:
        """Look up the capital city of a country."""
        calls.append(country)
        return "The capital of France is Paris."

    # A 270M base model cannot decide on its own when to call a tool, so this
    # middleware makes the path deterministic with tool_choice: the first model call
    # must call lookup_capital (grammar-constrained), the next one must answer in text.
    @wrap_model_call
    def steer(request, handler):  # type: ignore[no-untyped-def]
        called = any(isinstance(m, ToolMessage) for m in request.messages)
        return handler(request.override(tool_choice="none" if called else "lookup_capital"))

    agent = create_agent(llm, tools=[lookup_capital], middleware=[steer])
    result = agent.invoke(
        {"messages": [HumanMessage("What is the capital of France?")]}, {"recursion_limit": 8}
    )
    msgs = result["messages"]
    assert calls, "the agent ran the tool the model called"
    call_msg = next(m for m in msgs if isinstance(m, AIMessage) and m.tool_calls)
    assert call_msg.tool_calls[0]["name"] == "lookup_capital"
    assert isinstance(call_msg.tool_calls[0]["args"].get("country"), str)
    tool_msg = next(m for m in msgs if isinstance(m, ToolMessage))
    assert tool_msg.tool_call_id == call_msg.tool_calls[0]["id"]
    final = msgs[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and str(final.content).strip()


def test_create_agent_with_tool_strategy_response_format(llm: ChatLlamaCpp) -> None:
    from langchain.agents import create_agent
    from langchain.agents.structured_output import ToolStrategy

    class Answer(BaseModel):
        """The final answer to the user."""

        answer: str

    # With only the response tool available, "any" forces the structured answer.
    agent = create_agent(llm, tools=[], response_format=ToolStrategy(Answer))
    result = agent.invoke({"messages": [HumanMessage("Say hello.")]}, {"recursion_limit": 6})
    assert isinstance(result["structured_response"], Answer)


def test_create_agent_with_provider_strategy(llm: ChatLlamaCpp) -> None:
    from langchain.agents import create_agent
    from langchain.agents.structured_output import ProviderStrategy

    agent = create_agent(llm, tools=[], response_format=ProviderStrategy(Person))
    result = agent.invoke(
        {"messages": [HumanMessage("Dana is 52 years old. Extract the person.")]},
        {"recursion_limit": 6},
    )
    assert isinstance(result["structured_response"], Person)


def test_auto_tool_choice_calls_are_valid_when_made(llm: ChatLlamaCpp) -> None:
    # "auto": the model may answer in text; once it opens <tool_call> the grammar
    # (lazy, triggered by the marker) makes the call valid. One call: a base model
    # allowed parallel calls (the default with two tools) keeps adding them until
    # max_tokens cuts the last; a second one is reported in dropped_tool_calls.
    bound = llm.bind_tools([get_weather, add], parallel_tool_calls=False)
    for prompt in ("What is the weather in Paris?", "Hi!", "<tool_call>"):
        msg = bound.invoke(prompt)
        assert msg.invalid_tool_calls == []
        for call in msg.tool_calls:
            _check_call(call, {"get_weather": get_weather, "add": add})
        assert "<tool_call>" not in str(msg.content)


def test_unconvertible_tool_schema_is_a_clear_error(llm: ChatLlamaCpp) -> None:
    bad = {
        "type": "function",
        "function": {
            "name": "remote",
            "description": "uses a remote $ref",
            "parameters": {
                "type": "object",
                "properties": {"x": {"$ref": "https://example.com/s.json"}},
            },
        },
    }
    with pytest.raises(ValueError, match=r"(?i)\$ref|grammar|schema"):
        llm.bind_tools([bad], tool_choice="any").invoke("go")
    assert_generated(llm.invoke("still serving?", max_tokens=4), 4)
