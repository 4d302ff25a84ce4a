"""Batch invariance: a greedy answer is the same alone, beside other requests, warm or fresh.

Every comparison here is bit-for-bit (token ids and log-probabilities), not within
a tolerance, with ``deterministic=True``: the worker decodes prompts on a fixed grid of absolute positions, gives
each slot its own KV stream and batches generation steps only where the model's
kernels give identical rows (see docs/cache.md, "Exactness").
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp
from tests.compare import GREEDY, assert_identical
from tests.gguf_models import write_tiny_llama
from tests.helpers import worker_of

# mixed prompt lengths: below one grid cell, a few cells, past one micro-batch
PROMPTS = [
    "hi",
    "A medium question about the weather in the mountains? " * 3,
    "Summarise this long document. " * 24,
    "Another short one.",
    "Count the words of this text, please. " * 9,
]


def _tiny(path: str, **kw: Any) -> ChatLlamaCpp:
    return ChatLlamaCpp(
        model_path=path, n_slots=4, max_tokens=10, deterministic=True, **GREEDY, **kw
    )


# a template whose generation prompt starts with a control token (<s>): prompts are then
# also cut where each reply began (chunking marks), and the next turn reuses them whole
MARKED_TEMPLATE = (
    "{% for m in messages %}<s>{{ m.role }}:{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_llama_marked(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("marked") / "tiny-llama-marked.gguf"
    return str(write_tiny_llama(path, chat_template=MARKED_TEMPLATE))


@pytest.fixture(params=["llama", "mamba", "llama_marked"])
def tiny(request: pytest.FixtureRequest) -> ChatLlamaCpp:
    return _tiny(request.getfixturevalue(f"tiny_{request.param}"))


def _solo(llm: ChatLlamaCpp, prompts: list[str]) -> list[BaseMessage]:
    return [llm.invoke(p, cache_prompt=False) for p in prompts]


def _cancel_midway(llm: ChatLlamaCpp) -> None:
    """A long stream whose caller goes away after a few chunks."""
    gen = llm.stream("this stream is abandoned midway " * 5, max_tokens=200)
    for _ in range(3):
        next(gen, None)
    gen.close()


def _threads(llm: ChatLlamaCpp, prompts: list[str]) -> list[BaseMessage]:
    results: list[Any] = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = llm.invoke(prompts[i])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    threads.append(threading.Thread(target=_cancel_midway, args=(llm,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return results


async def _tasks(llm: ChatLlamaCpp, prompts: list[str]) -> list[BaseMessage]:
    async def abandoned() -> None:
        n = 0
        async for _ in llm.astream("an async stream abandoned midway " * 4, max_tokens=200):
            n += 1
            if n == 3:
                break

    async def staggered(i: int, p: str) -> BaseMessage:
        await asyncio.sleep(0.01 * i)  # interleave: later requests join running ones
        return await llm.ainvoke(p)

    out = await asyncio.gather(*(staggered(i, p) for i, p in enumerate(prompts)), abandoned())
    return list(out[:-1])


def test_concurrent_equals_solo_threads_and_asyncio(tiny: ChatLlamaCpp) -> None:
    solo = _solo(tiny, PROMPTS)
    for got, ref in zip(_threads(tiny, PROMPTS), solo, strict=True):
        assert_identical(got, ref)
    # reversed order so other slots and other companions are involved
    got_async = asyncio.run(_tasks(tiny, PROMPTS[::-1]))
    for got, ref in zip(got_async, solo[::-1], strict=True):
        assert_identical(got, ref)
    assert worker_of(tiny) is not None and worker_of(tiny).alive


def _conversation(tag: str) -> list[BaseMessage]:
    return [
        SystemMessage(f"{tag}: you are a careful assistant with a long system prompt. " * 4),
        HumanMessage(f"{tag}: first question?"),
    ]


def test_warm_equals_fresh_after_edits_and_regenerations(tiny: ChatLlamaCpp) -> None:
    llm = tiny
    history = _conversation("warm")
    checks: list[list[BaseMessage]] = []
    t1 = llm.invoke(history)
    assert_identical(t1, llm.invoke(history, cache_prompt=False))
    history = [*history, AIMessage(str(t1.content)), HumanMessage("second question, longer " * 3)]
    checks.append(history)
    checks.append(history)  # regenerate
    checks.append([*history[:-1], HumanMessage("an edited second question")])  # edit last
    checks.append(
        [history[0], HumanMessage("an edited FIRST question"), *history[2:]]
    )  # early edit
    for msgs in checks:
        llm.invoke(history)  # the slot holds the unedited conversation
        warm = llm.invoke(msgs)
        assert_identical(warm, llm.invoke(msgs, cache_prompt=False))
    # and beside other conversations, warm, in other slots
    others = [llm.invoke(_conversation(t)) for t in ("x", "y")]
    assert len(others) == 2
    warm = llm.invoke(checks[0])
    assert_identical(warm, llm.invoke(checks[0], cache_prompt=False))


@pytest.mark.timeout(1200)
def test_gemma_concurrent_and_warm_equal_solo_and_fresh(gemma: str) -> None:
    llm = ChatLlamaCpp(
        model_path=gemma, n_ctx=1024, n_slots=3, max_tokens=6, deterministic=True, **GREEDY
    )
    prompts = ["Name a colour.", "Write one word about the sea. " * 6]
    solo = _solo(llm, prompts)
    for got, ref in zip(_threads(llm, prompts), solo, strict=True):
        assert_identical(got, ref)
    history: list[BaseMessage] = [HumanMessage("Tell me a fact about cats. " * 12)]
    t1 = llm.invoke(history)
    history += [AIMessage(str(t1.content)), HumanMessage("And about dogs?")]
    warm = llm.invoke(history)
    assert warm.usage_metadata["input_token_details"]["cache_read"] > 0  # type: ignore[index]
    assert_identical(warm, llm.invoke(history, cache_prompt=False))
    regen = llm.invoke(history)
    assert_identical(regen, warm)


def test_next_turn_reuses_the_whole_previous_prompt_exactly(tiny_llama_marked: str) -> None:
    llm = _tiny(tiny_llama_marked)
    for tag, n_user in (("short", 1), ("long", 30)):
        history: list[BaseMessage] = [HumanMessage(f"{tag} question " * n_user)]
        for _turn in range(3):
            first = llm.invoke(history)
            history += [AIMessage(str(first.content)), HumanMessage("and then?")]
            warm = llm.invoke(history)
            usage = first.usage_metadata
            assert usage is not None and warm.usage_metadata is not None
            # everything the previous prompt read is reused (not only whole grid cells)
            read = warm.usage_metadata["input_token_details"]["cache_read"]  # type: ignore[typeddict-item]
            assert read >= usage["input_tokens"], (read, usage["input_tokens"])
            assert_identical(warm, llm.invoke(history, cache_prompt=False))
            history += [AIMessage(str(warm.content)), HumanMessage("more")]


def _one_token_tail(llm: ChatLlamaCpp, text: str) -> str:
    """``text`` padded until its prompt is one token past a grid cell (64): cut into
    small pieces, its last token must still join the cell before it."""
    while llm.render_prompt([HumanMessage(text)]).n_tokens % 64 != 1:
        text += " x"
    return text


@pytest.mark.parametrize("name", ["llama", "mamba"])
def test_prompts_cut_to_a_tiny_stall_budget_stay_exact(
    name: str, request: pytest.FixtureRequest
) -> None:
    # with streams generating, every prompt piece is two grid cells (the budget's floor
    # in deterministic mode); alone, pieces are whole: the answers must not differ
    llm = _tiny(request.getfixturevalue(f"tiny_{name}"), stall_budget_ms=0.001)
    prompts = [*PROMPTS, _one_token_tail(llm, "Tail case. " * 30)]
    solo = _solo(llm, prompts)
    for got, ref in zip(_threads(llm, prompts), solo, strict=True):
        assert_identical(got, ref)
