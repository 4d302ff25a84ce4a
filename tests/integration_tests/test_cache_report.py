"""Each reply's ``response_metadata["cache"]``: where the kept prefix came from (slot,
host RAM) and whether the prompt left the cached candidate (a miss) or extended it."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp
from tests.compare import GREEDY

SETTINGS: dict[str, Any] = {**GREEDY, "max_tokens": 4, "deterministic": True}


def _convo(system: str, turns: int) -> list[BaseMessage]:
    msgs: list[BaseMessage] = [SystemMessage(system * 8)]
    for i in range(turns):
        msgs += [HumanMessage(f"question {i}"), AIMessage(f"answer {i}")]
    return [*msgs, HumanMessage(f"question {turns}")]


def _cache(msg: BaseMessage) -> dict[str, Any]:
    return msg.response_metadata["cache"]


def test_hit_from_the_slot_reports_no_miss(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **SETTINGS)
    llm.invoke(_convo("You are a helpful assistant. ", 1))
    second = _cache(llm.invoke(_convo("You are a helpful assistant. ", 2)))
    assert second["source"] == "slot" and second["cached_tokens"] > 0
    assert second["missed"] is False and second["mismatch_tokens"] == []


def test_changed_system_prompt_is_a_miss(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **SETTINGS)
    llm.invoke(_convo("You are a helpful assistant. ", 1))
    report = _cache(llm.invoke(_convo("You are a careful assistant. ", 2)))
    assert report["missed"] is True and report["mismatch_tokens"]


def test_restored_from_host_ram(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **SETTINGS)
    llm.invoke(_convo("Conversation A, with its own system prompt. ", 1))
    llm.invoke(_convo("Conversation B is another one entirely. ", 1))  # A leaves the slot
    report = _cache(llm.invoke(_convo("Conversation A, with its own system prompt. ", 2)))
    assert report["source"] == "host_ram" and report["cached_tokens"] > 0
    assert report["missed"] is False
