"""A request whose caller is still preparing it counts as arriving: the worker does not
treat the request it admits meanwhile as decoding alone (real llama.cpp, unified pool)."""

from __future__ import annotations

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.runtime.worker import ModelWorker

GREEDY = {"temperature": 0.0}


def _parked(worker: ModelWorker) -> int:
    """Conversations the host-RAM cache holds."""
    return int(worker.call(lambda st: len(st.memory.ram.items)))


def test_idle_conversations_stay_while_another_request_is_being_prepared(
    tiny_llama: str,
) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=3, **GREEDY).load()
    worker = llm._worker
    assert worker is not None
    try:
        assert worker.call(lambda st: st.engine.kv_unified)
        llm.invoke("the first conversation is about boats", max_tokens=4)
        assert _parked(worker) == 0
        with worker.preparing():  # another caller is preparing its request
            llm.invoke("a second one, about mountains and rivers", max_tokens=4)
        # the second did not decode alone: the idle conversation stayed in the pool
        assert _parked(worker) == 0
        assert worker.call(lambda st: st.preparing) == 0
        llm.invoke("and a third, alone this time: clocks", max_tokens=4)
        # alone: the two idle conversations beside it went to host RAM
        assert _parked(worker) == 2
    finally:
        llm.close()
