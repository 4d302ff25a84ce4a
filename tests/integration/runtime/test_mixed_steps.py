"""Generation rows in a prompt piece's call (default mode): the running streams wait for
one ``llama_decode`` per step while a prompt is read, and keep their answers.

The tiny F32 model rounds the same within a few 1e-6 whatever call a row is in, so a
wrong position, mask or dropped row shows as a real difference."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.messages import BaseMessage

from langchain_llamacpp_local import ChatLlamaCpp, RequestCancelledError
from langchain_llamacpp_local.llama.abort import CancelCheck
from tests.compare import GREEDY, assert_same_greedy
from tests.helpers import worker_of

STREAMS = ("a long story about a lighthouse", "a long story about a baker")
LONG = "Summarise this report. " + "The committee reviewed the figures. " * 16
STREAM_TOKENS = 1200


def _mixed(seq_ids: tuple[int, ...]) -> bool:
    """A call that carried other sequences' single rows beside a prompt piece."""
    return len(set(seq_ids)) > 1 and len(seq_ids) > len(set(seq_ids))


def _install(
    llm: ChatLlamaCpp,
    calls: list[tuple[int, ...]],
    both: threading.Event,
    on_mixed: Callable[[Any, Callable[[], bool] | None], None] | None = None,
) -> None:
    """Record the sequence ids of each decode call (real llama.cpp runs them) made once
    both streams generate (``both`` is set by the first call that carries their two rows
    alone); ``on_mixed(engine, cancel)`` runs before the first mixed call after that."""

    def install(state: Any) -> None:
        engine = state.engine
        decode = engine.decode_batch

        def recording(tokens: Any, positions: Any, seq_ids: Any, *a: Any, **k: Any) -> Any:
            ids = tuple(seq_ids)
            if both.is_set():
                if on_mixed is not None and _mixed(ids) and not any(map(_mixed, calls)):
                    on_mixed(engine, k.get("cancel"))
                calls.append(ids)
            elif len(ids) == 2 and len(set(ids)) == 2:
                both.set()
            return decode(tokens, positions, seq_ids, *a, **k)

        engine.decode_batch = recording

    worker_of(llm).call(install)  # type: ignore[union-attr]


def _start_streams(llm: ChatLlamaCpp, out: dict[int, BaseMessage]) -> list[threading.Thread]:
    def one(i: int) -> None:
        out[i] = llm.invoke(STREAMS[i], max_tokens=STREAM_TOKENS, cache_prompt=False, **GREEDY)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(STREAMS))]
    for t in threads:
        t.start()
    return threads


def _llm(tiny_llama: str) -> ChatLlamaCpp:
    return ChatLlamaCpp(model_path=tiny_llama, n_slots=3, n_ctx=3 * 2048, n_batch=32).load()


def test_streams_ride_in_the_piece_call_and_keep_their_answers(tiny_llama: str) -> None:
    llm = _llm(tiny_llama)
    solo = [llm.invoke(p, max_tokens=STREAM_TOKENS, cache_prompt=False, **GREEDY) for p in STREAMS]
    assert all(m.usage_metadata["output_tokens"] > 200 for m in solo)  # type: ignore[index]
    long_solo = llm.invoke(LONG, max_tokens=8, cache_prompt=False, **GREEDY)
    calls: list[tuple[int, ...]] = []
    both = threading.Event()
    _install(llm, calls, both)
    out: dict[int, BaseMessage] = {}
    threads = _start_streams(llm, out)
    assert both.wait(60)
    long = llm.invoke(LONG, max_tokens=8, cache_prompt=False, **GREEDY)
    for t in threads:
        t.join(120)
    assert any(map(_mixed, calls)), calls
    # the piece gave up a token per riding row: no call exceeds n_batch
    assert max(len(c) for c in calls) <= 32
    assert_same_greedy(long, long_solo)
    for i, ref in enumerate(solo):
        assert_same_greedy(out[i], ref)


def test_a_cancelled_piece_leaves_the_rows_beside_it_intact(tiny_llama: str) -> None:
    """The piece's request is cancelled as its first shared call starts, and the call is
    aborted inside llama.cpp: the streams' rows in it are dropped and decoded again, and
    their answers are unchanged."""
    llm = _llm(tiny_llama)
    solo = [llm.invoke(p, max_tokens=STREAM_TOKENS, cache_prompt=False, **GREEDY) for p in STREAMS]

    def cancel_inside(engine: Any, cancel: Callable[[], bool] | None) -> None:
        # the request's own flag, set as its call starts: the call's hook sets the abort
        # byte as it arms, and the first node aborts
        assert isinstance(cancel, CancelCheck)
        cancel.flag.set()

    calls: list[tuple[int, ...]] = []
    both = threading.Event()
    _install(llm, calls, both, cancel_inside)
    out: dict[int, BaseMessage] = {}
    threads = _start_streams(llm, out)
    assert both.wait(60)
    with pytest.raises(RequestCancelledError):
        llm.invoke(LONG, max_tokens=8, cache_prompt=False)
    for t in threads:
        t.join(120)
    assert any(map(_mixed, calls)), calls
    for i, ref in enumerate(solo):
        assert_same_greedy(out[i], ref)
    # and the worker keeps serving
    assert_same_greedy(
        llm.invoke(STREAMS[0], max_tokens=16, cache_prompt=False, **GREEDY),
        llm.invoke(STREAMS[0], max_tokens=16, cache_prompt=False, **GREEDY),
    )
