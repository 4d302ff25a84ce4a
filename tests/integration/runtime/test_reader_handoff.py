"""The worker hands the CPU to a streaming reader for a reply's first text: it waits
(briefly) for the reader to take it when the request runs alone, never beside others,
and never for a reader of the whole reply (real llama.cpp decodes every token)."""

from __future__ import annotations

import pytest

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.runtime.channel import Channel
from tests.holding import ask_together

GREEDY = {"temperature": 0.0}


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each ``Channel.wait_reader`` call's answer (True: the reader came back for more)."""
    seen: list[bool] = []
    original = Channel.wait_reader

    def recording(self: Channel, timeout: float) -> bool:
        answer = original(self, timeout)
        seen.append(answer)
        return answer

    monkeypatch.setattr(Channel, "wait_reader", recording)
    return seen


def test_a_lone_streaming_reply_waits_once_for_its_reader(
    tiny_llama: str, waits: list[bool]
) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=2, **GREEDY)
    try:
        chunks = [c for c in llm.stream("a story about a lighthouse", max_tokens=24)]
        assert "".join(str(c.content) for c in chunks)
        # once, for the first text (whether the reader came within the wait's bound
        # depends on the machine's load: not asserted)
        assert len(waits) == 1
        waits.clear()
        whole = llm.invoke("a story about a baker", max_tokens=24)  # not woken per token
        assert whole.content
        assert waits == []  # a reader of the whole reply is never waited for
    finally:
        llm.close()


def test_no_wait_beside_another_running_request(
    tiny_llama: str, waits: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=2, **GREEDY).load()
    try:
        # the worker is held busy until both requests have queued: it admits them together
        out = ask_together(
            llm,
            monkeypatch,
            {
                i: lambda i=i: "".join(
                    str(c.content) for c in llm.stream(f"story {i}", max_tokens=16)
                )
                for i in range(2)
            },
        )
        assert isinstance(out[0], str) and out[0] and isinstance(out[1], str) and out[1]
        assert waits == []  # each first text came beside the other request
    finally:
        llm.close()
