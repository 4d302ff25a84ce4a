"""Requests that arrive together (real llama.cpp): one its caller is still preparing
counts as arriving, so the request admitted meanwhile is not taken to decode alone; and
prompts queued together are read in one call, as llama.cpp's server fills a batch."""

from __future__ import annotations

from typing import Any

import pytest

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.runtime.worker import ModelWorker
from tests.gguf_models import write_scripted_llama
from tests.helpers import worker_of
from tests.holding import ask_together

GREEDY = {"temperature": 0.0}


def _parked(worker: ModelWorker) -> int:
    """Conversations the host-RAM cache holds."""
    return worker.stats().host_ram_items


def test_idle_conversations_stay_while_another_request_is_being_prepared(
    tiny_llama: str,
) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=3, **GREEDY).load()
    worker = worker_of(llm)
    assert worker is not None
    try:
        assert worker.stats().kv_unified
        llm.invoke("the first conversation is about boats", max_tokens=4)
        assert _parked(worker) == 0
        with worker.preparing():  # another caller is preparing its request
            llm.invoke("a second one, about mountains and rivers", max_tokens=4)
        # the second did not decode alone: the idle conversation stayed in the pool
        assert _parked(worker) == 0
        assert worker.stats().preparing == 0
        llm.invoke("and a third, alone this time: clocks", max_tokens=4)
        # alone: the two idle conversations beside it went to host RAM
        assert _parked(worker) == 2
    finally:
        llm.close()


RAW = "{{ messages[-1].content }}"
CYCLE = "abcd efg."


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Prints ``CYCLE`` on from the last character of any prompt."""
    nxt = {c: {CYCLE[(i + 1) % len(CYCLE)]: 10.0} for i, c in enumerate(CYCLE)}
    path = tmp_path_factory.mktemp("arrivals") / "cycle.gguf"
    return str(write_scripted_llama(path, transitions=nxt))


# each prompt ends on another character of the script: a reply sampled from another
# request's row would continue the wrong one
PROMPTS = {"x": "some words then a", "y": "more e", "z": "and finally, c"}
SCRIPTED = {"x": "bcd ef", "y": "fg.abc", "z": "d efg."}


def _together(
    llm: ChatLlamaCpp, monkeypatch: pytest.MonkeyPatch, on_call: Any = None
) -> tuple[dict[str, str], list[list[int]]]:
    """Ask ``PROMPTS`` from three threads with the worker held until all three are
    queued (it admits them together); each caller's answer (or its error's type name)
    and every decode call's sequence ids. ``on_call(cancel, seq_ids)`` runs before
    each decode call."""
    worker = worker_of(llm)
    assert worker is not None
    calls: list[list[int]] = []
    decode_batch = Engine.decode_batch

    def recording(
        self: Engine, tokens: Any, positions: Any, seq_ids: Any, *a: Any, **k: Any
    ) -> Any:
        calls.append(list(seq_ids))
        if on_call is not None:
            on_call(k.get("cancel"), list(seq_ids))
        return decode_batch(self, tokens, positions, seq_ids, *a, **k)

    monkeypatch.setattr(Engine, "decode_batch", recording)
    answers = ask_together(
        llm, monkeypatch, {k: lambda k=k: llm.invoke(PROMPTS[k]).content for k in PROMPTS}
    )
    out = {k: v if isinstance(v, str) else type(v).__name__ for k, v in answers.items()}
    worker.call(lambda st: st.memory.check())
    return out, calls


def _cycle_llm(path: str) -> ChatLlamaCpp:
    return ChatLlamaCpp(
        model_path=path, n_slots=3, n_ctx=512, max_tokens=6, chat_template=RAW, **GREEDY
    ).load()


def test_prompts_queued_together_are_read_in_one_call(
    cycle_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _cycle_llm(cycle_model)
    try:
        out, calls = _together(llm, monkeypatch)
        assert out == SCRIPTED
        # one call read the three prompts (each with its BOS), then their tokens
        assert len(calls[0]) == sum(len(p) + 1 for p in PROMPTS.values())
        assert len(set(calls[0])) == 3
        assert all(len(c) == len(set(c)) == 3 for c in calls[1:])
    finally:
        llm.close()


def test_the_oldest_prompts_cancel_stops_the_call_and_the_others_read_again(
    cycle_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _cycle_llm(cycle_model)
    stopped: list[list[int]] = []

    def cancel_first(cancel: Any, seq_ids: list[int]) -> None:
        # the call carrying all three prompts: its oldest request is cancelled as it starts
        if not stopped and cancel is not None and len(set(seq_ids)) == 3:
            stopped.append(seq_ids)
            cancel.flag.set()

    try:
        out, calls = _together(llm, monkeypatch, cancel_first)
        assert stopped
        cancelled = [k for k, v in out.items() if v not in SCRIPTED.values()]
        assert len(cancelled) == 1 and "Cancel" in out[cancelled[0]]
        # the other two lost only that call's rows: read again, they answer as scripted
        assert {k: v for k, v in out.items() if k not in cancelled} == {
            k: v for k, v in SCRIPTED.items() if k not in cancelled
        }
        assert len(set(calls[1])) == 2  # the next call read the two prompts again
    finally:
        llm.close()
