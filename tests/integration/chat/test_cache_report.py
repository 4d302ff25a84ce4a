"""Each reply's ``response_metadata["cache"]``: where the kept prefix came from (slot,
host RAM) and whether the prompt left the cached candidate (a miss) or extended it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
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
    assert second["missed"] is False and "mismatch_tokens" not in second


def test_changed_system_prompt_is_a_miss(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **SETTINGS)
    llm.invoke(_convo("You are a helpful assistant. ", 1))
    report = _cache(llm.invoke(_convo("You are a careful assistant. ", 2)))
    assert report["missed"] is True and "mismatch_tokens" not in report


def test_restored_from_host_ram(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **SETTINGS)
    llm.invoke(_convo("Conversation A, with its own system prompt. ", 1))
    llm.invoke(_convo("Conversation B is another one entirely. ", 1))  # A leaves the slot
    report = _cache(llm.invoke(_convo("Conversation A, with its own system prompt. ", 2)))
    assert report["source"] == "host_ram" and report["cached_tokens"] > 0
    assert report["missed"] is False


def _miss(llm: ChatLlamaCpp, first: list[BaseMessage], second: list[BaseMessage]) -> Any:
    llm.invoke(first)
    report = _cache(llm.invoke(second))
    assert report["missed"] is True
    return report["miss"]


def test_system_prompt_change_names_message_and_offset(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **SETTINGS)
    old = "You are a helpful assistant. The date is 2026-11-25. "
    new = "You are a helpful assistant. The date is 2026-11-26. "
    miss = _miss(llm, _convo(old, 1), _convo(new, 2))
    assert miss["message_index"] == 0 and miss["role"] == "system"
    assert miss["cause"] == "system prompt changed"
    # offsets count from the message's content (byte-level vocabulary: exact)
    assert miss["prompt"].startswith("6. ") and "cached" not in miss
    assert miss["offset"] == old.index("5. ")


def test_edited_earlier_message_is_history_edited(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **SETTINGS)
    first = _convo("A system prompt. ", 2)
    edited = _convo("A system prompt. ", 3)
    edited[1] = HumanMessage("question zero, rewritten by a middleware")
    miss = _miss(llm, first, edited)
    assert miss["message_index"] == 1 and miss["role"] == "user"
    assert miss["cause"] == "history edited"
    assert miss["prompt"].startswith("zero") and "cached" not in miss
    assert miss["offset"] == len("question ")


def _tool(name: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} tool",
            "parameters": {"type": "object", "properties": {}},
        },
    }


def test_reordered_tools(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **SETTINGS)
    a = llm.bind_tools([_tool("get_weather"), _tool("search_web")])
    b = llm.bind_tools([_tool("search_web"), _tool("get_weather")])
    convo = _convo("A system prompt. ", 1)
    a.invoke(convo)
    later = [*convo, AIMessage("ok"), HumanMessage("more")]
    report = _cache(b.invoke(later))
    assert report["missed"] is True
    assert report["miss"]["cause"] == "tool list or order changed"
    assert report["miss"]["message_index"] == 0
    # the offset: where the two renderings first differ, counted from the system content
    before = llm.render_prompt(convo, tools=[_tool("get_weather"), _tool("search_web")]).text
    after = llm.render_prompt(later, tools=[_tool("search_web"), _tool("get_weather")]).text
    differ = next(i for i, (x, y) in enumerate(zip(before, after, strict=False)) if x != y)
    assert report["miss"]["offset"] == differ - after.index(convo[0].content)
    assert report["miss"]["prompt"].startswith("search_web")


DATED = (
    "Today is {{ today }}.\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_changed_template_kwargs(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, chat_template=DATED, **SETTINGS)
    convo = _convo("A system prompt. ", 1)
    llm.invoke(convo, chat_template_kwargs={"today": "Monday"})
    report = _cache(
        llm.invoke(
            [*convo, AIMessage("ok"), HumanMessage("more")],
            chat_template_kwargs={"today": "Tuesday"},
        )
    )
    assert report["missed"] is True
    miss = report["miss"]
    assert miss["cause"] == "template kwargs changed" and miss["message_index"] is None
    assert miss["offset"] == len("Today is ")


def test_restored_from_disk(tiny_llama: str, tmp_path: Path) -> None:
    from langchain_llamacpp_local.cache import disk as disk_cache
    from langchain_llamacpp_local.runtime import registry

    def call(msgs: list[BaseMessage]) -> dict[str, Any]:
        llm = ChatLlamaCpp(model_path=tiny_llama, prompt_cache_dir=str(tmp_path), **SETTINGS)
        try:
            return _cache(llm.invoke(msgs))
        finally:
            llm.close()
            registry.unload()
            assert disk_cache.flush(30)

    first = call(_convo("A system prompt saved to disk. ", 1))
    assert first["source"] is None and first["cached_tokens"] == 0
    second = call(_convo("A system prompt saved to disk. ", 2))
    assert second["source"] == "disk" and second["cached_tokens"] > 0
    # the file records its prompt's length: leaving the reply it holds (the scripted
    # "answer 1" is not what the model wrote) is a new turn, not a miss
    assert second["missed"] is False and "mismatch_tokens" not in second
    # leaving its prompt is one, reported as for a slot
    third = call(_convo("A system prompt saved to disk, edited. ", 2))
    assert third["source"] == "disk" and third["missed"] is True
    assert third["miss"]["cause"] == "system prompt changed"
    assert third["miss"]["message_index"] == 0
    assert third["miss"]["offset"] == len("A system prompt saved to disk")


def test_costly_miss_warns_once_per_conversation(
    tiny_llama: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``cache_miss_warning_tokens``: a miss that re-reads more than it is logged with
    its message, offset and cause, once per conversation."""
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, cache_miss_warning_tokens=10, **SETTINGS)
    caplog.set_level(logging.WARNING, logger="langchain_llamacpp_local.chat.cache_report")
    llm.invoke(_convo("The date is 2026-11-25. ", 1))
    assert not caplog.records  # nothing cached: no miss
    msg = llm.invoke(_convo("The date is 2026-11-26. ", 2))
    report = _cache(msg)
    assert report["missed"] is True
    [record] = caplog.records
    text = record.getMessage()
    assert f"message 0 (system), offset {report['miss']['offset']}" in text
    assert "system prompt changed" in text
    usage = msg.usage_metadata
    assert usage is not None
    assert str(usage["input_tokens"] - usage["input_token_details"]["cache_read"]) in text
    # the same conversation misses again: no second warning
    again = _cache(llm.invoke(_convo("The date is 2026-11-27. ", 2)))
    assert again["missed"] is True and len(caplog.records) == 1
    # an instance without the threshold never warns
    quiet = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, **SETTINGS)
    caplog.clear()
    quiet.invoke(_convo("The date is 2026-11-28. ", 2))
    assert not caplog.records


SIGNED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.role == 'system' %} Signed: {{ signature }}.{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_changed_template_kwargs_inside_a_message(tiny_llama: str) -> None:
    """A template argument whose text lands inside a message's span is named as such
    (the front end remembers each conversation's last arguments), with that message."""
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, chat_template=SIGNED, **SETTINGS)
    convo = _convo("A system prompt. ", 1)
    llm.invoke(convo, chat_template_kwargs={"signature": "Alice"})
    later = [*convo, AIMessage("ok"), HumanMessage("more")]
    report = _cache(llm.invoke(later, chat_template_kwargs={"signature": "Bob"}))
    assert report["missed"] is True
    miss = report["miss"]
    assert miss["cause"] == "template kwargs changed"
    assert miss["message_index"] == 0 and miss["role"] == "system"
    assert miss["offset"] == len("A system prompt. " * 8 + " Signed: ")
    assert miss["prompt"].startswith("Bob") and "cached" not in miss
    # the same arguments again, the system prompt edited: the system prompt is named
    edited = [SystemMessage("B system prompt. " * 8), *later[1:]]
    report = _cache(llm.invoke(edited, chat_template_kwargs={"signature": "Bob"}))
    assert report["miss"]["cause"] == "system prompt changed"
