"""The core provider on a tiny random-weight llama: real llama.cpp, exact comparisons."""

from __future__ import annotations

import asyncio
import gc
import threading
from pathlib import Path

import pytest
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
)

from langchain_llamacpp_local import ChatLlamaCpp, ContextOverflowError, ModelLoadError
from langchain_llamacpp_local.runtime.registry import live_workers, unload
from tests.compare import GREEDY, assert_same_greedy
from tests.helpers import assert_generated, reply_of, worker_of

FRESH = {"cache_prompt": False}  # same path for both sides of a comparison


@pytest.fixture()
def llm(tiny_llama: str) -> ChatLlamaCpp:
    return ChatLlamaCpp(model_path=tiny_llama, n_slots=1, max_tokens=24, **GREEDY)


def _assert_same_as_fresh(llm: ChatLlamaCpp, messages: list[BaseMessage]) -> AIMessage:
    """Run through the cache, then on a cleared sequence: the same greedy generation."""
    cached = llm.invoke(messages)
    fresh = llm.invoke(messages, cache_prompt=False)
    assert fresh.usage_metadata["input_token_details"]["cache_read"] == 0
    assert_same_greedy(cached, fresh)
    return cached


def test_invoke_reports_usage_and_metadata(llm: ChatLlamaCpp) -> None:
    msg = llm.invoke("Hello there")
    assert isinstance(msg, AIMessage)
    assert isinstance(msg.content, str) and msg.content
    usage = msg.usage_metadata
    assert usage is not None
    assert usage["input_tokens"] > 10
    assert 0 < usage["output_tokens"] <= 24
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert "cache_read" in usage["input_token_details"]
    meta = msg.response_metadata
    assert meta["model_name"]
    assert meta["finish_reason"] in ("stop", "length")
    assert (
        meta["timings"]["prompt_ms"] >= 0
        and meta["timings"]["predicted_n"] == usage["output_tokens"]
    )


def test_max_tokens_gives_length(llm: ChatLlamaCpp) -> None:
    msg = llm.invoke("Count", max_tokens=3)
    assert msg.usage_metadata["output_tokens"] == 3
    assert msg.response_metadata["finish_reason"] == "length"


def test_multi_turn_reuse_is_exact(llm: ChatLlamaCpp) -> None:
    system = SystemMessage("You are a terse assistant. " * 8)
    u1 = HumanMessage("What is the capital of France?")
    first = _assert_same_as_fresh(llm, [system, u1])
    n1 = first.usage_metadata["input_tokens"]

    # extension: the next turn reuses the whole previous prompt
    convo = [system, u1, AIMessage(first.content), HumanMessage("And of Italy?")]
    llm.invoke([system, u1])  # put turn 1 back in the cache
    second = llm.invoke(convo)
    # reuse resumes on the 64-position decode grid (docs/cache.md, "Exactness")
    assert second.usage_metadata["input_token_details"]["cache_read"] >= n1 // 64 * 64
    assert_same_greedy(second, llm.invoke(convo, cache_prompt=False))

    # divergence: edit the last user message
    edited = [*convo[:-1], HumanMessage("And of Spain?")]
    llm.invoke(convo)
    third = _assert_same_as_fresh(llm, edited)
    llm.invoke(convo)
    again = llm.invoke(edited)
    shared = again.usage_metadata["input_token_details"]["cache_read"]
    assert n1 // 64 * 64 <= shared < again.usage_metadata["input_tokens"]
    assert_same_greedy(again, third)

    # full match: the same prompt again re-decodes only its last token
    full = llm.invoke(edited)
    n_full = full.usage_metadata["input_tokens"]
    assert n_full - 66 <= full.usage_metadata["input_token_details"]["cache_read"] < n_full
    assert_same_greedy(full, third)

    # shrink: back to the first turn
    shrink = llm.invoke([system, u1])
    assert n1 - 66 <= shrink.usage_metadata["input_token_details"]["cache_read"] < n1
    assert_same_greedy(shrink, first)


def test_stream_matches_invoke_and_only_last_chunk_has_usage(llm: ChatLlamaCpp) -> None:
    prompt = "Tell me something"
    expected = llm.invoke(prompt, **FRESH)
    chunks = list(llm.stream(prompt, **FRESH))
    assert len(chunks) > 2
    with_usage = [c for c in chunks if c.usage_metadata]
    assert len(with_usage) == 1
    total: AIMessageChunk = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.content == expected.content
    assert total.response_metadata["finish_reason"] == expected.response_metadata["finish_reason"]


def test_stream_delivers_tokens_as_they_are_produced(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=40)
    seen = 0
    for chunk in llm.stream("stream please"):
        if chunk.content:
            seen += 1
    assert seen >= 10  # one chunk per token, not one blob at the end


async def test_async_paths(llm: ChatLlamaCpp) -> None:
    expected = llm.invoke("async hello", **FRESH)
    got = await llm.ainvoke("async hello", **FRESH)
    assert got.content == expected.content
    parts = [c.content async for c in llm.astream("async hello", **FRESH)]
    assert "".join(parts) == expected.content
    results = await llm.abatch(["async hello", "another"], **FRESH)
    assert results[0].content == expected.content
    # the event loop keeps running while the model works
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    t = asyncio.create_task(ticker())
    await llm.ainvoke("keep the loop alive", max_tokens=40)
    t.cancel()
    assert ticks > 3


def test_batch_from_threads(llm: ChatLlamaCpp) -> None:
    prompts = ["a", "b", "c", "d"]
    expected = [llm.invoke(p, **FRESH).content for p in prompts]
    got = llm.batch(prompts, config={"max_concurrency": 4}, **FRESH)
    assert [m.content for m in got] == expected


def test_stop_sequences_cut_output(llm: ChatLlamaCpp) -> None:
    base = llm.invoke("stop test", max_tokens=30, **FRESH).content
    assert isinstance(base, str) and len(base) > 12
    stop = base[6:9]
    first = base.find(stop)
    msg = llm.invoke("stop test", max_tokens=30, stop=[stop], **FRESH)
    assert msg.content == base[:first]
    assert msg.response_metadata["finish_reason"] == "stop"
    streamed = "".join(
        str(c.content) for c in llm.stream("stop test", max_tokens=30, stop=[stop], **FRESH)
    )
    assert streamed == base[:first]


def test_context_overflow_is_a_clear_error_and_worker_keeps_serving(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, temperature=0, max_tokens=8)
    with pytest.raises(ContextOverflowError, match="context window of 256"):
        llm.invoke("x" * 400)
    with pytest.raises(ContextOverflowError, match="max_tokens=250"):
        llm.invoke("short", max_tokens=250)
    assert llm.invoke("short").content


def test_instances_share_one_model_and_release_it(tiny_llama: str) -> None:
    unload()  # models that earlier tests left in their keep-alive time
    gc.collect()
    before = live_workers()
    a = ChatLlamaCpp(model_path=tiny_llama, n_ctx=512, temperature=0, max_tokens=4)
    b = ChatLlamaCpp(model_path=tiny_llama, n_ctx=512, temperature=0.5, max_tokens=4)
    assert live_workers() == before  # construction loads nothing
    a.invoke("hi")
    b.invoke("hi")
    assert worker_of(a) is worker_of(b)
    assert live_workers() == before + 1
    thread_names = {t.name for t in threading.enumerate()}
    assert any(n.startswith("llamacpp-worker") for n in thread_names)
    a.close()
    assert_generated(b.invoke("still works"), 4)  # sampled: its length, not its text
    with b:
        pass  # context manager releases b
    gc.collect()
    # the registry keeps the model for keep_alive seconds of idleness; unload() frees it now
    assert live_workers() == before + 1
    assert b.unload() == 1
    assert live_workers() == before
    # a closed instance loads again on next use
    assert a.invoke("back").usage_metadata["input_tokens"] > 0
    a.close()


def test_load_errors_are_clear(tmp_path: Path, tiny_llama: str) -> None:
    missing = ChatLlamaCpp(model_path=str(tmp_path / "nope.gguf"))  # lazy: no error yet
    with pytest.raises(ModelLoadError, match="not found"):
        missing.invoke("hi")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model at all")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        ChatLlamaCpp(model_path=str(bogus)).load()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(Path(tiny_llama).read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="could not load"):
        ChatLlamaCpp(model_path=str(truncated)).load()


def test_bad_settings_fail_at_construction(tiny_llama: str) -> None:
    with pytest.raises(ValueError, match="temperature"):
        ChatLlamaCpp(model_path=tiny_llama, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        ChatLlamaCpp(model_path=tiny_llama, top_p=2)
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="min_p"):
        llm.invoke("hi", min_p=5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        llm.invoke("hi", bogus_option=1)
    # the refused calls changed nothing: the reply is a fresh decode's
    assert reply_of(llm.invoke("hi")) == reply_of(llm.invoke("hi", cache_prompt=False))


def test_seeded_sampling_is_reproducible(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=1.0, seed=1234, max_tokens=16)
    a = llm.invoke("random?", **FRESH).content
    b = llm.invoke("random?", **FRESH).content
    c = llm.invoke("random?", seed=99, **FRESH).content
    assert a == b
    assert a != c


def test_ls_params_and_profile(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0.3, max_tokens=7)
    params = llm._get_ls_params()
    assert params["ls_provider"] == "llamacpp"
    assert params["ls_model_type"] == "chat"
    assert params["ls_temperature"] == 0.3 and params["ls_max_tokens"] == 7
    assert llm._get_ls_params(model="other")["ls_model_name"] == "other"
    assert llm.profile is not None
    assert llm.profile["max_input_tokens"] == 2048  # the tiny model's trained context
    assert ChatLlamaCpp(model_path=tiny_llama, n_ctx=512).profile["max_input_tokens"] == 512
    assert llm.model_info.n_ctx == 2048


THINK_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is not defined or enable_thinking %}"
    "<think>\n{% endif %}{% endif %}"
)


def test_reasoning_from_an_opened_think_block(tiny_llama: str) -> None:
    base = ChatLlamaCpp(
        model_path=tiny_llama, chat_template=THINK_TEMPLATE, max_tokens=20, **GREEDY
    )
    thinking = base.invoke("why?", reasoning=True, **FRESH)
    # the template opened <think>; the random model never closes it: all of it is reasoning
    assert thinking.content == ""
    assert str(thinking.additional_kwargs["reasoning_content"]).strip()
    # reasoning=None on a template that thinks extracts it too (llama.cpp's "auto")
    default = base.invoke("why?", **FRESH)
    assert (default.content, default.additional_kwargs) == ("", thinking.additional_kwargs)
    assert any(b["type"] == "reasoning" for b in thinking.content_blocks)
    chunks = list(base.stream("why?", reasoning=True, **FRESH))
    streamed = "".join(c.additional_kwargs.get("reasoning_content", "") for c in chunks)
    assert streamed == thinking.additional_kwargs["reasoning_content"]
    # reasoning=False asks the template not to think: a different prompt
    off = base.invoke("why?", reasoning=False, **FRESH)
    assert off.usage_metadata["input_tokens"] < thinking.usage_metadata["input_tokens"]
    assert "reasoning_content" not in off.additional_kwargs
