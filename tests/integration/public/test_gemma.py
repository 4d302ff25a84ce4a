"""Gemma 3 270M (a real model with sliding-window attention and no chat template)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp
from tests.compare import GREEDY, assert_same_greedy
from tests.helpers import worker_of

SYSTEM = (
    "You are a patient travel guide for a small mountain town. You answer questions about "
    "trails, weather, local food, opening hours of the museum, the old railway, the lake and "
    "the festival in August. Keep answers short, friendly and practical. If you do not know "
    "something, say so and suggest asking at the tourist office next to the station. "
) * 4

QUESTIONS = [
    "Which trail is good for a first hike?",
    "Is the lake warm enough to swim in July?",
    "What local dish should I try?",
    "When does the museum open?",
    "Can I take the old railway to the summit?",
    "What happens at the festival in August?",
]


@pytest.fixture(scope="module")
def llm(gemma: str) -> ChatLlamaCpp:
    return ChatLlamaCpp(model_path=gemma, max_tokens=24, n_ctx=4096, **GREEDY)


def test_template_fallback_and_memory_kind(llm: ChatLlamaCpp) -> None:
    info = llm.model_info
    assert info.template_origin == "builtin:gemma"  # the GGUF carries no template
    assert info.memory_kind == "swa"  # swa_full=False by default


def test_six_turns_decode_only_new_tokens(llm: ChatLlamaCpp) -> None:
    history: list[BaseMessage] = [SystemMessage(SYSTEM)]
    prev_prompt = 0
    prev_total = 0
    for turn, q in enumerate(QUESTIONS):
        history.append(HumanMessage(q))
        reply = llm.invoke(history)
        usage: dict[str, Any] = reply.usage_metadata  # type: ignore[assignment]
        cached = usage["input_token_details"]["cache_read"]
        if turn == 0:
            assert usage["input_tokens"] >= 280  # the ~300-token system prompt
        else:
            # what the previous turn read is reused up to the 64-position decode grid; the
            # reply and the grid remainder are read again, as a fresh prompt would
            # (docs/cache.md, "Exactness")
            assert cached >= prev_prompt // 64 * 64
            assert usage["input_tokens"] - cached < 40 + 64 + (prev_total - prev_prompt)
        prev_prompt = usage["input_tokens"]
        prev_total = usage["input_tokens"] + usage["output_tokens"]
        history.append(AIMessage(reply.content))


def test_regenerate_and_edit_match_a_fresh_context(llm: ChatLlamaCpp) -> None:
    # Long enough (> n_swa + n_ubatch) that the sliding-window cache has pruned the
    # positions a trim would need: only a checkpoint can serve the reuse.
    history: list[BaseMessage] = [SystemMessage(SYSTEM * 5), HumanMessage(QUESTIONS[0])]
    first = llm.invoke(history)
    history += [AIMessage(first.content), HumanMessage(QUESTIONS[1])]
    turn2 = llm.invoke(history)
    # regenerate: the same history again -> restores a checkpoint near the end
    regen = llm.invoke(history)
    assert_same_greedy(regen, turn2, tol=0.1)
    assert turn2.usage_metadata["input_tokens"] > 1200
    assert regen.usage_metadata["input_token_details"]["cache_read"] > 1000
    # edit the last user message: reuse up to the divergence, exact output
    edited = [*history[:-1], HumanMessage(QUESTIONS[2])]
    out = llm.invoke(edited)
    fresh = llm.invoke(edited, cache_prompt=False)
    # Q4_K matmuls take other kernels for other batch shapes: same tokens, close logits
    assert_same_greedy(out, fresh, tol=0.1)
    assert out.usage_metadata["input_token_details"]["cache_read"] > 1000


def test_a_turn_reads_its_new_tokens_in_one_decode_call(gemma: str) -> None:
    """Default mode on a sliding-window cache: the checkpoints an edit or a regenerate
    needs cost no decode call of their own (they are taken where a piece starts and at
    the prompt's end), so a turn's new tokens reach llama.cpp in one call, as with
    ``Llama``; one slot, so that the window is gone and only checkpoints serve reuse."""
    llm = ChatLlamaCpp(model_path=gemma, max_tokens=8, n_ctx=4096, n_slots=1, **GREEDY)
    sizes: list[int] = []

    def count_calls(state: Any) -> None:
        decode = state.engine.decode_batch

        def counting(tokens: Any, *args: Any, **kwargs: Any) -> Any:
            sizes.append(len(tokens))
            return decode(tokens, *args, **kwargs)

        state.engine.decode_batch = counting

    worker_of(llm.load()).call(count_calls)  # type: ignore[union-attr]
    history: list[BaseMessage] = [SystemMessage(SYSTEM * 5), HumanMessage(QUESTIONS[0])]
    first = llm.invoke(history)
    history += [AIMessage(first.content), HumanMessage(QUESTIONS[1])]
    sizes.clear()
    turn2 = llm.invoke(history)
    usage: dict[str, Any] = turn2.usage_metadata  # type: ignore[assignment]
    assert usage["input_tokens"] > 1200
    new = usage["input_tokens"] - usage["input_token_details"]["cache_read"]
    assert new < 60  # the reply's end, the new question and the generation prompt
    assert sizes[0] == new and all(n == 1 for n in sizes[1:]), sizes
    # regenerate: resumes one entry before the end (the prompt's end checkpoint)
    regen = llm.invoke(history)
    assert regen.usage_metadata["input_token_details"]["cache_read"] == usage["input_tokens"] - 1
    assert_same_greedy(regen, turn2, tol=0.1)
    # edit the last question: resumes at most WINDOW_SLACK entries before it
    edited = [*history[:-1], HumanMessage(QUESTIONS[2])]
    out = llm.invoke(edited)
    assert out.usage_metadata["input_token_details"]["cache_read"] >= usage["input_tokens"] - 64
    fresh = llm.invoke(edited, cache_prompt=False)
    assert_same_greedy(out, fresh, tol=0.1)
