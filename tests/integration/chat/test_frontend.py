"""The front end runs on the caller's side: templates, tokens, grammars and the output
parser never run on the worker thread that decodes for every slot."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.chat import prompts
from langchain_llamacpp_local.llama.sampling import Sampler
from langchain_llamacpp_local.templates.chat_template import ChatTemplate
from tests.compare import GREEDY


def _spy(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, seen: list[str]) -> None:
    real = getattr(cls, name)

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, spy)


def test_prompt_preparation_and_parsing_run_on_the_callers_thread(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered: list[str] = []
    sampled: list[str] = []
    parsed: list[str] = []
    _spy(monkeypatch, ChatTemplate, "render", rendered)
    _spy(monkeypatch, Sampler, "__init__", sampled)
    _spy(monkeypatch, prompts.PlainParser, "feed", parsed)
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=512, max_tokens=6, **GREEDY)
    out = llm.invoke("hello there")
    assert out.content  # the parser saw the text
    me = threading.current_thread().name
    assert rendered and set(rendered) == {me}
    assert sampled and set(sampled) == {me}
    assert parsed and set(parsed) == {me}

    # async: preparation on a pool thread (never the loop's, never the worker's)
    rendered.clear()
    sampled.clear()
    parsed.clear()
    asyncio.run(llm.ainvoke("hello again"))
    for names in (rendered, sampled):
        assert names and not any(n == me or n.startswith("llamacpp-worker") for n in names)
    assert parsed and not any(n.startswith("llamacpp-worker") for n in parsed)


def test_a_stream_keeps_decoding_while_another_request_is_templated(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose template is slow (here: held until released) costs the running
    stream nothing: the stream's tokens keep coming while it renders."""
    gate = threading.Event()
    entered = threading.Event()
    real = ChatTemplate.render

    def render(self: ChatTemplate, messages: Any, *args: Any, **kwargs: Any) -> str:
        if "HOLD" in str(messages):
            entered.set()
            gate.wait(60)
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(ChatTemplate, "render", render)
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=2048, n_slots=2, max_tokens=600, **GREEDY)
    llm.load()
    times: list[float] = []

    def stream() -> None:
        for _chunk in llm.stream("tell me a long story", cache_prompt=False):
            times.append(time.monotonic())

    held: list[Any] = []
    runner = threading.Thread(target=stream)
    other = threading.Thread(target=lambda: held.append(llm.invoke("HOLD", max_tokens=2)))
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while len(times) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(times) >= 3, "the stream did not start"
        other.start()
        assert entered.wait(60)
        before = len(times)
        deadline = time.monotonic() + 20
        while len(times) < before + 5 and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        progressed = len(times) - before
    finally:
        gate.set()
        runner.join(120)
        if other.ident is not None:
            other.join(120)
    # five more tokens, or the stream's end (an end-of-generation token) after some
    assert progressed >= 5 or (progressed > 0 and len(times) < 600), progressed
    assert held and held[0].response_metadata["finish_reason"] in ("stop", "length")
