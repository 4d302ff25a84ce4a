"""LangChain's own pieces act on our errors: ``SummarizationMiddleware`` recovers from a
context overflow, the model-retry middleware retries a timeout or a dead worker (which
the retry really replaces) and not an invalid request, and every call's error is
LangChain's standard type while keeping its Python base."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from uuid import UUID

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import ModelRetryMiddleware, SummarizationMiddleware
from langchain_core import exceptions as lc
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage

from langchain_llamacpp_local import ChatLlamaCpp, ContextOverflowError, WorkerDeadError
from langchain_llamacpp_local.runtime.requests import EngineRequest
from tests.helpers import make_worker_fail, worker_of


class _Calls(BaseCallbackHandler):
    """Counts model calls and keeps the errors they ended with."""

    def __init__(self) -> None:
        self.starts = 0
        self.errors: list[BaseException] = []

    def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
        self.starts += 1

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.errors.append(error)


_TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}},
}


def _retry() -> ModelRetryMiddleware:
    return ModelRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False, on_failure="error")


# --------------------------------------------------------------------------- each kind of error


def test_invalid_requests_are_model_invalid_request_errors(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, temperature=0, max_tokens=4)
    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"temperature": -1.0}, ValueError),  # a sampling value out of range
        ({"max_tokens": 0}, ValueError),
        ({"top_logprobs": "3"}, TypeError),
        ({"n_predict": 3}, TypeError),  # an unknown keyword
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": False}}},
            ValueError,
        ),
        ({"chat_template": "{{ raise_exception('refused') }}"}, ValueError),
        ({"chat_template": "{% for %}"}, ValueError),  # does not compile
        ({"tools": [_TOOL], "tool_choice": "nope"}, ValueError),
        ({"lora": {"missing": 1.0}}, ValueError),
        ({"speculative": "draft", "speculative_max_draft": 4}, ValueError),
    ]
    for kwargs, base in cases:
        with pytest.raises(lc.ModelInvalidRequestError) as info:
            llm.invoke("hi", **kwargs)
        assert isinstance(info.value, base), kwargs
        assert info.value.is_retryable is False
    assert llm.invoke("still serving").response_metadata["finish_reason"] in ("stop", "length")


def test_context_overflow_is_langchains(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=128, temperature=0, max_tokens=16)
    with pytest.raises(lc.ContextOverflowError) as info:
        llm.invoke("word " * 400)
    assert isinstance(info.value, ContextOverflowError) and isinstance(info.value, ValueError)
    assert not info.value.is_retryable


def test_timeouts_are_model_timeout_errors(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=512, max_tokens=400, timeout=0.001).load()
    with pytest.raises(lc.ModelTimeoutError) as info:
        llm.invoke("hi")
    assert isinstance(info.value, TimeoutError) and info.value.is_retryable
    with pytest.raises(lc.ModelTimeoutError):
        asyncio.run(llm.ainvoke("hi"))
    with pytest.raises(TimeoutError):  # the call's own timeout, per call
        llm.invoke("hi", timeout=0.001)


def test_missing_models_are_model_not_found_errors(tmp_path: Any) -> None:
    with pytest.raises(lc.ModelNotFoundError, match="model file not found"):
        ChatLlamaCpp(model_path=str(tmp_path / "absent.gguf")).invoke("hi")
    with pytest.raises(lc.ModelNotFoundError, match="'absent' not found"):
        ChatLlamaCpp(model="absent", models_dir=str(tmp_path)).invoke("hi")


def test_a_dead_worker_is_a_retryable_api_error_and_a_retry_gets_a_new_one(
    tiny_llama: str,
) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, temperature=0, max_tokens=4)
    worker = make_worker_fail(llm)
    calls = _Calls()
    agent = create_agent(model=llm, tools=[], middleware=[_retry()])
    out = agent.invoke({"messages": [HumanMessage("hi")]}, config={"callbacks": [calls]})
    assert isinstance(out["messages"][-1], AIMessage)
    assert calls.starts == 2  # the failed call and its retry
    (error,) = calls.errors
    assert isinstance(error, WorkerDeadError) and isinstance(error, lc.ModelAPIError)
    assert error.is_retryable
    assert not worker.alive and worker_of(llm) is not worker and worker_of(llm).alive  # type: ignore[union-attr]
    # a job on the dead worker itself fails fast with the same error
    with pytest.raises(lc.ModelAPIError):
        worker.submit(EngineRequest(tokens=[], sampling=llm._sampling(), max_new=1))


# --------------------------------------------------------------------------- retry middleware


def test_retry_middleware_retries_a_timeout(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=512, max_tokens=400, timeout=0.001).load()
    calls = _Calls()
    agent = create_agent(model=llm, tools=[], middleware=[_retry()])
    with pytest.raises(lc.ModelTimeoutError):
        agent.invoke({"messages": [HumanMessage("hi")]}, config={"callbacks": [calls]})
    assert calls.starts == 3  # the call and both retries


def test_retry_middleware_does_not_retry_an_invalid_request(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(
        model_path=tiny_llama,
        n_ctx=256,
        max_tokens=4,
        chat_template="{{ raise_exception('this template refuses every conversation') }}",
    )
    calls = _Calls()
    agent = create_agent(model=llm, tools=[], middleware=[_retry()])
    with pytest.raises(lc.ModelInvalidRequestError, match="refuses every conversation"):
        agent.invoke({"messages": [HumanMessage("hi")]}, config={"callbacks": [calls]})
    assert calls.starts == 1


# --------------------------------------------------------------------------- summarization


def test_summarization_recovers_from_an_overflowing_summary(smollm2: str) -> None:
    """The history is too long to summarize in a 1024-token window: the summary call
    overflows, the middleware retries it with the middle of the history cut out, and the
    agent answers from the summary and the last messages."""
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=1024, temperature=0, max_tokens=48)
    topics = ["rivers", "volcanoes", "glaciers", "deserts", "forests", "oceans", "caves"]
    history: list[Any] = []
    for topic in topics:
        history.append(HumanMessage(f"Tell me about {topic} in detail, please."))
        history.append(
            AIMessage(
                f"Here is a long answer about {topic}. "
                + " ".join(
                    f"Fact {i} about {topic} is interesting and worth noting." for i in range(12)
                )
            )
        )
    history.append(HumanMessage("Which topic did we discuss first? Answer in one word."))
    middleware = SummarizationMiddleware(
        model=llm, trigger=("tokens", 600), keep=("messages", 1), trim_tokens_to_summarize=None
    )
    calls = _Calls()
    agent = create_agent(model=llm, tools=[], middleware=[middleware])
    out = agent.invoke({"messages": history}, config={"callbacks": [calls]})
    assert isinstance(out["messages"][-1], AIMessage) and out["messages"][-1].text
    assert len(out["messages"]) < len(history)  # the old turns were replaced by a summary
    overflows = [e for e in calls.errors if isinstance(e, lc.ContextOverflowError)]
    assert overflows and all(isinstance(e, ValueError) for e in overflows)
    assert len(calls.errors) == len(overflows) == 1  # overflowed once, then fit


def test_a_timeout_during_templating_is_a_timeout(tiny_llama: str) -> None:
    """The template budget stops at the request's deadline; the front end then reports
    the timeout (retryable), not a template error (which would not be retried)."""
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, max_tokens=4).load()
    slow = "{% for i in range(90000) %}{% for j in range(90000) %}{% endfor %}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(lc.ModelTimeoutError) as info:
        llm.invoke("hi", chat_template=slow, timeout=0.3)
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - started < 30
    assert llm.invoke("still serving").response_metadata["finish_reason"] in ("stop", "length")


def test_embeddings_and_rerank_errors_are_langchains(tiny_llama: str) -> None:
    """Bad input to embeddings and rerank is LangChain's invalid-request error too (and
    still the ``TypeError``/``ValueError`` it always was); an overflow is LangChain's."""
    from langchain_llamacpp_local import LlamaCppEmbeddings, LlamaCppRerank

    emb = LlamaCppEmbeddings(model_path=tiny_llama, n_ctx=64)
    with pytest.raises(TypeError) as info:
        emb.embed_query(42)  # type: ignore[arg-type]
    assert isinstance(info.value, lc.ModelInvalidRequestError)
    with pytest.raises(ValueError) as info2:
        emb.embed_documents(["bad \ud800 text"])
    assert isinstance(info2.value, lc.ModelInvalidRequestError)
    with pytest.raises(lc.ContextOverflowError):
        emb.embed_documents(["word " * 500])
    rr = LlamaCppRerank(model_path=tiny_llama, n_ctx=64)
    with pytest.raises(TypeError) as info3:
        rr.rerank(7, ["a"])  # type: ignore[arg-type]
    assert isinstance(info3.value, lc.ModelInvalidRequestError)
