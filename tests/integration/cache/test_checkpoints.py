"""State checkpoints on a recurrent model (tiny random Mamba): exact reuse after divergence."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp
from tests.compare import GREEDY as _GREEDY
from tests.compare import assert_identical
from tests.helpers import cached_tokens

GRID = 64  # prompt pieces are cut on multiples of this: reuse resumes on the grid

GREEDY: dict[str, Any] = {**_GREEDY, "max_tokens": 12}


def _fresh_equal(llm: ChatLlamaCpp, msgs: list[BaseMessage], got: BaseMessage) -> None:
    assert_identical(got, llm.invoke(msgs, cache_prompt=False))


@pytest.fixture(params=["mamba", "hybrid"])
def mamba(request: pytest.FixtureRequest) -> ChatLlamaCpp:
    """A recurrent (Mamba) and a hybrid (LFM2: short-conv + attention) model."""
    path = request.getfixturevalue(f"tiny_{request.param}")
    return ChatLlamaCpp(model_path=path, n_slots=1, checkpoint_min_step=128, **GREEDY)


def test_recurrent_memory_is_detected(mamba: ChatLlamaCpp) -> None:
    assert mamba.model_info.memory_kind == "full_only"


def test_extension_edit_regenerate_and_rewrite_are_exact(mamba: ChatLlamaCpp) -> None:
    system = SystemMessage("You are a recurrent model with a long memory. " * 12)
    history: list[BaseMessage] = [system, HumanMessage("first question")]
    t1 = mamba.invoke(history)
    n1 = t1.usage_metadata["input_tokens"]  # type: ignore[index]
    _fresh_equal(mamba, history, t1)

    # extension: state continues from the end of the cache, no trim needed
    mamba.invoke(history)
    history += [AIMessage(t1.content), HumanMessage("second question")]
    t2 = mamba.invoke(history)
    assert cached_tokens(t2) >= n1 // GRID * GRID
    _fresh_equal(mamba, history, t2)

    # regenerate: same history again -> a checkpoint near the end of the prompt
    mamba.invoke(history)
    regen = mamba.invoke(history)
    n2 = regen.usage_metadata["input_tokens"]  # type: ignore[index]
    assert n2 - GRID - 2 <= cached_tokens(regen) < n2
    assert_identical(regen, t2)

    # edit the last user message -> restore the checkpoint at its start
    edited = [*history[:-1], HumanMessage("a different second question")]
    mamba.invoke(history)
    out = mamba.invoke(edited)
    assert (
        cached_tokens(out) >= n1 // GRID * GRID
    )  # everything before the last user message was kept
    _fresh_equal(mamba, edited, out)

    # history rewrite early in the conversation: bounded by checkpoint spacing
    rewritten = [system, HumanMessage("FIRST question, rewritten"), *history[2:]]
    mamba.invoke(history)
    out = mamba.invoke(rewritten)
    _fresh_equal(mamba, rewritten, out)


def test_regenerate_cost_is_bounded_by_spacing(tiny_mamba: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_mamba, n_slots=1, checkpoint_min_step=64, **GREEDY)
    long_history: list[BaseMessage] = [SystemMessage("history " * 120)]
    for i in range(4):
        long_history += [HumanMessage(f"q{i} " * 20), AIMessage(f"a{i} " * 20)]
    long_history.append(HumanMessage("last"))
    first = llm.invoke(long_history)
    n = first.usage_metadata["input_tokens"]  # type: ignore[index]
    assert n > 1500
    regen = llm.invoke(long_history)
    assert n - cached_tokens(regen) <= GRID + 2  # one grid cell, not the whole prompt
    # drop the last exchange: resumes from a periodic checkpoint
    shorter = [*long_history[:-3], HumanMessage("last")]
    out = llm.invoke(shorter)
    assert out.usage_metadata["input_tokens"] - cached_tokens(out) <= 64 + GRID + 40  # type: ignore[index]
    _fresh_equal(llm, shorter, out)


def test_no_checkpoints_means_full_reprocessing(tiny_mamba: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_mamba, n_slots=1, checkpoint_max_count=0, **GREEDY)
    msgs: list[BaseMessage] = [HumanMessage("hello " * 30)]
    llm.invoke(msgs)
    again = llm.invoke(msgs)
    assert cached_tokens(again) == 0  # the state cannot be rolled back one token
    _fresh_equal(llm, msgs, again)
