"""Structured output (and a forced tool call) cut off by ``max_tokens`` is an error that
names ``max_tokens``, never a partial answer read as valid (ChatOpenAI raises
``LengthFinishReasonError`` here); with ``include_raw=True`` it is the ``parsing_error``."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
from langchain_core import exceptions as lc
from pydantic import BaseModel

from langchain_llamacpp_local import ChatLlamaCpp, StructuredOutputTruncatedError

METHODS = ["json_schema", "json_mode", "function_calling"]
PROMPT = (
    "Extract the contact as JSON with the keys name and email: John Doe can be reached "
    "at john@example.com, or at his office in Springfield on weekdays."
)


class Contact(BaseModel):
    name: str
    email: str


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


def _llm(path: str, max_tokens: int) -> ChatLlamaCpp:
    return ChatLlamaCpp(model_path=path, n_ctx=1024, temperature=0, max_tokens=max_tokens)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("schema", [Contact, Contact.model_json_schema()], ids=["pydantic", "dict"])
def test_cut_off_structured_output_raises_naming_max_tokens(
    smollm2: str, method: Any, schema: Any
) -> None:
    structured = _llm(smollm2, 6).with_structured_output(schema, method=method)
    with pytest.raises(StructuredOutputTruncatedError, match="max_tokens") as info:
        structured.invoke(PROMPT)
    assert isinstance(info.value, lc.OutputParserException) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("method", METHODS)
def test_include_raw_reports_the_cut_as_parsing_error(smollm2: str, method: Any) -> None:
    structured = _llm(smollm2, 6).with_structured_output(Contact, method=method, include_raw=True)
    out = structured.invoke(PROMPT)
    assert out["parsed"] is None
    assert isinstance(out["parsing_error"], StructuredOutputTruncatedError)
    assert "max_tokens" in str(out["parsing_error"])
    assert out["raw"].response_metadata["finish_reason"] == "length"


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_output_complete_at_the_limit_still_parses(smollm2: str, method: Any) -> None:
    """``finish_reason == "length"`` alone is no error: output that ends exactly at
    ``max_tokens`` (the end of generation would have been the next token) is whole."""
    question = "Is the sky blue on a clear day? Answer yes or no."
    full = _llm(smollm2, 64).with_structured_output(Verdict, method=method, include_raw=True)
    first = full.invoke(question)
    assert first["parsing_error"] is None and first["parsed"] is not None
    n = first["raw"].usage_metadata["output_tokens"]
    for limit in (n, n - 1):  # with or without the end-of-generation token counted
        out = (
            _llm(smollm2, limit)
            .with_structured_output(Verdict, method=method, include_raw=True)
            .invoke(question)
        )
        if out["raw"].response_metadata["finish_reason"] == "length":
            if out["parsing_error"] is None:
                assert out["parsed"] == first["parsed"]
                return
    pytest.fail("no limit gave whole output with finish_reason 'length'")


def test_a_cut_off_forced_tool_call_names_max_tokens(smollm2: str) -> None:
    """Outside structured output a forced call cut off by ``max_tokens`` is an invalid
    tool call whose error says so (create_agent's RetryInvalidToolCalls reads it)."""
    llm = _llm(smollm2, 6).bind_tools([Contact], tool_choice="Contact")
    msg = llm.invoke(PROMPT)
    assert msg.response_metadata["finish_reason"] == "length"
    assert not msg.tool_calls
    (bad,) = msg.invalid_tool_calls
    assert "max_tokens" in (bad["error"] or "")


@pytest.mark.parametrize("method", METHODS)
def test_a_stream_yields_partial_output_then_raises(smollm2: str, method: Any) -> None:
    """The check does not buffer: partial output still streams, and the cut is raised at
    its end (sync and async)."""
    structured = _llm(smollm2, 16).with_structured_output(
        Contact.model_json_schema(), method=method
    )
    seen: list[Any] = []
    with pytest.raises(StructuredOutputTruncatedError, match="max_tokens"):
        for part in structured.stream(PROMPT):
            seen.append(part)
    if method != "function_calling":  # (a forced call's arguments arrive whole)
        assert len(seen) >= 2 and isinstance(seen[-1], dict)

    async def consume() -> None:
        async for _ in structured.astream(PROMPT):
            pass

    with pytest.raises(StructuredOutputTruncatedError, match="max_tokens"):
        asyncio.run(consume())
