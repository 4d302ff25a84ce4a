"""Prompt-reading progress reaches LangChain callbacks as custom events, sync and async,
as llama.cpp's ``return_progress`` reports it: one event per prompt piece, the processed
count rising until cached + processed is the whole prompt."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import UUID

from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.messages import HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.chat.progress import PROGRESS_EVENT
from tests.compare import GREEDY

SETTINGS: dict[str, Any] = {**GREEDY, "max_tokens": 4, "n_batch": 64}
PROMPT = [SystemMessage("A long system prompt, read in several pieces. " * 12), HumanMessage("hi")]


class Collect(BaseCallbackHandler):
    def __init__(self) -> None:
        self.events: list[dict[str, int]] = []

    def on_custom_event(
        self,
        name: str,
        data: Any,
        *,
        run_id: UUID,
        tags: Any = None,
        metadata: Any = None,
        **kwargs: Any,
    ) -> None:
        if name == PROGRESS_EVENT:
            self.events.append(data)


class ACollect(AsyncCallbackHandler):
    def __init__(self) -> None:
        self.events: list[dict[str, int]] = []

    async def on_custom_event(
        self,
        name: str,
        data: Any,
        *,
        run_id: UUID,
        tags: Any = None,
        metadata: Any = None,
        **kwargs: Any,
    ) -> None:
        if name == PROGRESS_EVENT:
            self.events.append(data)


def _check(events: list[dict[str, int]], n_prompt: int, n_cached: int) -> None:
    assert len(events) >= 3  # several pieces of at most n_batch tokens
    processed = [e["processed"] for e in events]
    assert processed == sorted(set(processed))  # strictly rising
    assert all(e["total"] == n_prompt and e["cached"] == n_cached for e in events)
    assert events[-1]["cached"] + events[-1]["processed"] == n_prompt


def test_progress_events_sync(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, **SETTINGS)
    seen = Collect()
    first = llm.invoke(PROMPT, config={"callbacks": [seen]})
    usage = first.usage_metadata
    assert usage is not None
    _check(seen.events, usage["input_tokens"], usage["input_token_details"]["cache_read"])
    # a second, longer call reads only the new part: cached counts the kept prefix
    seen2 = Collect()
    longer = [*PROMPT[:1], HumanMessage("hi, and a longer question " * 8)]
    msg = llm.invoke(longer, config={"callbacks": [seen2]})
    assert msg.usage_metadata is not None
    cached = msg.usage_metadata["input_token_details"]["cache_read"]
    assert cached > 0
    _check(seen2.events, msg.usage_metadata["input_tokens"], cached)


def test_progress_events_async(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, **SETTINGS)
    seen = ACollect()

    msg = asyncio.run(llm.ainvoke(PROMPT, config={"callbacks": [seen]}))
    _check(seen.events, msg.usage_metadata["input_tokens"], 0)


def test_no_progress_without_callbacks(tiny_llama: str) -> None:
    """Without a callback the worker sends nothing extra (the flag stays off)."""
    llm = ChatLlamaCpp(model_path=tiny_llama, **SETTINGS)
    assert [c for c in llm.stream(PROMPT) if c.content or c.usage_metadata]


def test_progress_events_on_stream(tiny_llama: str) -> None:
    """``stream()`` hands ``_stream`` no run manager; the events reach the run's
    handlers anyway, with the chat model's run as their run id."""
    llm = ChatLlamaCpp(model_path=tiny_llama, **SETTINGS)
    seen = RunIds()
    chunks = list(llm.stream(PROMPT, config={"callbacks": [seen]}))
    usage = sum(chunks[1:], chunks[0]).usage_metadata
    assert usage is not None
    _check(seen.events, usage["input_tokens"], 0)
    assert seen.event_runs == {seen.chat_run}


def test_progress_events_on_streaming_invoke(tiny_llama: str) -> None:
    """``streaming=True``: LangChain's ``invoke`` streams through ``_stream`` itself."""
    llm = ChatLlamaCpp(model_path=tiny_llama, streaming=True, **SETTINGS)
    seen = Collect()
    msg = llm.invoke(PROMPT, config={"callbacks": [seen]})
    assert msg.usage_metadata is not None
    _check(seen.events, msg.usage_metadata["input_tokens"], 0)


def test_progress_events_on_astream(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, **SETTINGS)
    seen = ACollect()

    async def run() -> Any:
        chunks = [c async for c in llm.astream(PROMPT, config={"callbacks": [seen]})]
        return sum(chunks[1:], chunks[0]).usage_metadata

    usage = asyncio.run(run())
    _check(seen.events, usage["input_tokens"], 0)


def test_progress_events_in_astream_events(tiny_llama: str) -> None:
    """``astream_events`` (v2) surfaces them as ``on_custom_event`` of the chat model's
    run, for the model alone and as a step of a chain (LangChain then invokes it)."""
    from langchain_core.runnables import RunnableLambda

    llm = ChatLlamaCpp(model_path=tiny_llama, **SETTINGS)

    async def events(runnable: Any, prompt: Any) -> tuple[list[dict[str, int]], set[str], int]:
        custom: list[dict[str, int]] = []
        runs: set[str] = set()
        n_prompt = 0
        async for ev in runnable.astream_events(prompt, version="v2"):
            if ev["event"] == "on_custom_event" and ev["name"] == PROGRESS_EVENT:
                custom.append(ev["data"])
                runs.add(ev["run_id"])
            elif ev["event"] == "on_chat_model_end":
                n_prompt = ev["data"]["output"].usage_metadata["input_tokens"]
                runs.add("model:" + ev["run_id"])
        return custom, runs, n_prompt

    chain = RunnableLambda(lambda x: x) | llm
    for runnable, opening in ((llm, "One long prompt. "), (chain, "Another long prompt. ")):
        prompt = [SystemMessage(opening * 30), HumanMessage("hi")]
        custom, runs, n_prompt = asyncio.run(events(runnable, prompt))
        _check(custom, n_prompt, custom[0]["cached"] if custom else -1)
        [run] = [r for r in runs if not r.startswith("model:")]
        assert runs == {run, "model:" + run}  # the chat model's own run


class RunIds(Collect):
    """Also records the chat model's run id and the events' run ids."""

    def __init__(self) -> None:
        super().__init__()
        self.chat_run: UUID | None = None
        self.event_runs: set[UUID] = set()

    def on_chat_model_start(self, *args: Any, run_id: UUID, **kwargs: Any) -> None:
        self.chat_run = run_id

    def on_custom_event(self, name: str, data: Any, *, run_id: UUID, **kwargs: Any) -> None:
        super().on_custom_event(name, data, run_id=run_id, **kwargs)
        self.event_runs.add(run_id)
