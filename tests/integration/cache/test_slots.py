"""Several conversations on one model: slots, prefix copy, host-RAM cache, continuous batching.

These compare warm and concurrent answers with fresh ones bit for bit, so they run in
deterministic mode (per-slot KV streams); test_fast_mode.py covers the default mode.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp
from tests.compare import GREEDY as _BASE
from tests.compare import assert_identical
from tests.helpers import cached_tokens, worker_of

_GREEDY: dict[str, Any] = {**_BASE, "deterministic": True}

GRID = 64  # prompt pieces are cut on multiples of this (n_batch 512): reuse stops there

GREEDY: dict[str, Any] = {**_GREEDY, "max_tokens": 16}


def _convo(tag: str, turns: int) -> list[BaseMessage]:
    msgs: list[BaseMessage] = [
        SystemMessage(f"{tag}: the system prompt of this conversation. " * 4)
    ]
    for i in range(turns):
        msgs.append(HumanMessage(f"{tag} question number {i}"))
        msgs.append(AIMessage(f"{tag} answer {i}"))
    msgs.append(HumanMessage(f"{tag} question number {turns}"))
    return msgs


def test_interleaved_conversations_keep_their_caches(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=3, **GREEDY)
    prev: dict[str, int] = {}
    for turn in range(4):
        for tag in ("alpha", "beta", "gamma"):
            msg = llm.invoke(_convo(tag, turn))
            if turn > 0:
                # the previous turn of *this* conversation is still cached
                assert cached_tokens(msg) >= prev[tag] // GRID * GRID
            prev[tag] = msg.usage_metadata["input_tokens"]  # type: ignore[index]
            assert_identical(msg, llm.invoke(_convo(tag, turn), cache_prompt=False))
            llm.invoke(_convo(tag, turn))  # restore the cached state after the fresh run


def test_single_slot_loses_the_other_conversation_but_ram_cache_restores_it(
    tiny_llama: str,
) -> None:
    no_ram = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, prompt_cache_bytes=0, **GREEDY)
    with_ram = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **GREEDY)
    for llm, expect_reuse in ((no_ram, False), (with_ram, True)):
        a1 = llm.invoke(_convo("a", 1))
        llm.invoke(_convo("b", 1))  # pushes conversation a out of the only slot
        a2 = llm.invoke(_convo("a", 2))
        if expect_reuse:
            assert cached_tokens(a2) >= a1.usage_metadata["input_tokens"] // GRID * GRID  # type: ignore[index]
        else:
            assert cached_tokens(a2) < 30  # only the template's first tokens are shared with b
        assert_identical(a2, llm.invoke(_convo("a", 2), cache_prompt=False))


def test_shared_prefix_is_copied_not_decoded(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=2, **GREEDY)
    system = SystemMessage("A long shared system prompt for every sub-agent. " * 10)
    first = llm.invoke([system, HumanMessage("task one")])
    second = llm.invoke([system, HumanMessage("a different task two")])
    # byte-level vocab: 1 token a byte
    assert cached_tokens(second) >= len(str(system.content)) // GRID * GRID
    # and the first conversation is still intact in its own slot
    again = llm.invoke([system, HumanMessage("task one")])
    n_again = again.usage_metadata["input_tokens"]  # type: ignore[index]
    assert cached_tokens(again) >= (n_again - 2) // GRID * GRID
    assert_identical(again, first)


def test_concurrent_requests_match_sequential_ones(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=4, max_tokens=24, **_GREEDY)
    prompts = [f"concurrent prompt {i} " * (i + 1) for i in range(6)]
    expected = [llm.invoke(p, cache_prompt=False) for p in prompts]
    results: list[Any] = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = llm.invoke(prompts[i], cache_prompt=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for exp, got in zip(expected, results, strict=True):
        assert got is not None
        # exact: per-slot streams, grid-aligned prompts, rows batched only where identical
        assert_identical(got, exp)


async def test_concurrent_async_streams_interleave(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=2, max_tokens=30, **_GREEDY)
    order: list[int] = []

    async def consume(i: int) -> str:
        text = ""
        async for chunk in llm.astream(f"stream {i}"):
            if chunk.content:
                order.append(i)
                text += str(chunk.content)
        return text

    a, b = await asyncio.gather(consume(0), consume(1))
    assert a and b
    # both streams made progress before either finished: they ran in the same batches
    first_done = min(len(order) - order[::-1].index(0), len(order) - order[::-1].index(1))
    assert set(order[:first_done]) == {0, 1}


# ---------------------------------------------------------------- admission and bookkeeping


def test_concurrent_streams_each_get_their_own_window(tiny_llama: str) -> None:
    """Two streams whose max_tokens together exceed n_ctx both finish."""
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, n_slots=2, **_GREEDY)
    results: list[Any] = [None, None]

    def run(i: int) -> None:
        results[i] = llm.invoke(f"stream number {i}", max_tokens=150)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, msg in enumerate(results):
        assert msg is not None
        assert_identical(msg, llm.invoke(f"stream number {i}", max_tokens=150, cache_prompt=False))


def test_sequential_requests_never_run_out_of_room(tiny_llama: str) -> None:
    """X, Y at 200 then X at 300 on n_ctx=512 with two slots; four slots."""
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=512, n_slots=2, **_GREEDY)
    llm.invoke("conversation X", max_tokens=200)
    llm.invoke("conversation Y", max_tokens=200)
    out = llm.invoke("conversation X", max_tokens=300)
    assert out.usage_metadata["output_tokens"] <= 300  # type: ignore[index]
    four = ChatLlamaCpp(model_path=tiny_llama, n_ctx=512, n_slots=4, max_tokens=64, **_GREEDY)
    for tag in ("a", "b", "c"):
        four.invoke(f"conversation {tag} " * 10)
    # with no max_tokens it generates to the end of the context: the others made room
    fourth = four.invoke("the fourth one", max_tokens=None)
    assert fourth.response_metadata["finish_reason"] == "length"
    assert fourth.usage_metadata["total_tokens"] == 512  # type: ignore[index]


def test_unified_cache_queues_instead_of_failing_midstream(tiny_llama: str) -> None:
    """With the shared (unified) cache, a request that does not fit beside the running one
    waits for it instead of both failing mid-stream."""
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=512, n_slots=2, kv_unified=True, **_GREEDY)
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = llm.invoke(f"unified {i}", max_tokens=300)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert all(r is not None for r in results)


def test_a_waiting_request_is_prepared_once(
    tiny_llama: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request queued behind another is rendered/tokenized only once."""
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **_GREEDY)
    llm.load()
    caplog.set_level(logging.DEBUG, logger="langchain_llamacpp_local.chat.frontend")
    threads = [
        threading.Thread(target=llm.invoke, args=(f"queued {i}",), kwargs={"max_tokens": 60})
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    prepared = [r for r in caplog.records if r.getMessage().startswith("prepared a prompt")]
    assert len(prepared) == 3


def test_parking_cannot_evict_the_entry_being_restored(tiny_llama: str) -> None:
    """A host-RAM cache that holds about one conversation, one slot, three
    conversations in turn: every restore either works or falls back, never desyncs."""
    probe = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, max_tokens=4, **_GREEDY)
    probe.invoke(_convo("p", 1))
    size = worker_of(probe).call(  # type: ignore[union-attr]
        lambda st: len(st.engine.state_get(0, 0))
    )
    llm = ChatLlamaCpp(
        model_path=tiny_llama,
        n_slots=1,
        prompt_cache_bytes=int(size * 1.5),
        max_tokens=4,
        **_GREEDY,
    )
    for turn in range(3):
        for tag in ("a", "b", "c"):
            msg = llm.invoke(_convo(tag, turn))
            assert_identical(msg, llm.invoke(_convo(tag, turn), cache_prompt=False))
