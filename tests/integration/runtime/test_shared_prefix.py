"""Sub-agents that share a system prompt share its room (real llama.cpp): the unified
pool's admission counts a prefix copied by ``seq_cp`` once, so three sub-agents after
a 1,780-token system prompt generate together in a 2,048-position pool, where counted
apart (every prompt plus ``max_tokens``) they took turns. The KV bookkeeping check
(``LLAMACPP_LOCAL_CHECK_KV``, on in the tests) runs after every step.

The count itself, without a model: tests/unit/cache/test_pool.py."""

from __future__ import annotations

import logging
import random
import re
import threading
from typing import Any

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.cache.pool import cells_in_use
from tests.gguf_models import write_scripted_llama
from tests.helpers import worker_of
from tests.holding import ask_together

#: the system message, then the question, nothing else (each character a token)
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
CYCLE = "abcd efg."
N_CTX = 2048
REPLY = 48


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Prints ``CYCLE`` on from the last character of any prompt (never an end)."""
    nxt = {c: {CYCLE[(i + 1) % len(CYCLE)]: 10.0} for i, c in enumerate(CYCLE)}
    path = tmp_path_factory.mktemp("shared-prefix") / "cycle.gguf"
    return str(write_scripted_llama(path, transitions=nxt, n_ctx_train=8192))


def _system(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["tools", "agent", "plan", "search", "file", "answer", "step", "check"]
    text = ""
    while len(text) < n:
        text += rng.choice(words) + " "
    return text[:n]


def _llm(path: str, **kw: Any) -> ChatLlamaCpp:
    return ChatLlamaCpp(
        model_path=path, chat_template=TEMPLATE, temperature=0.0, **{"n_ctx": N_CTX, **kw}
    ).load()


def _stream(llm: ChatLlamaCpp, messages: list[Any], key: str, order: list[str]) -> str:
    """The streamed reply; ``key`` noted in ``order`` as each piece of it arrives."""
    text = ""
    for chunk in llm.stream(messages, max_tokens=REPLY):
        if chunk.content:
            order.append(key)  # (one list, appended from every caller's thread)
            text += str(chunk.content)
    return text


def test_three_sub_agents_with_a_shared_system_prompt_generate_together(
    cycle_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _llm(cycle_model, n_slots=3)
    worker = worker_of(llm)
    assert worker is not None
    system = SystemMessage(_system(1780))
    # each question ends on another character of the script
    questions = {"x": "what about the a", "y": "and the plan for e", "z": "then check c"}
    assert all(len(q) + REPLY < 100 for q in questions.values())
    order: list[str] = []
    try:
        assert worker.call(lambda st: st.engine.kv_unified and st.engine.n_ctx_total) == N_CTX
        # counted apart, two of them would not fit the pool at once
        assert 2 * (1780 + 17 + REPLY) > N_CTX
        out = ask_together(
            llm,
            monkeypatch,
            {
                k: lambda k=k, q=q: _stream(llm, [system, HumanMessage(q)], k, order)
                for k, q in questions.items()
            },
        )
        for k, text in out.items():
            assert isinstance(text, str), text
            assert len(text) == REPLY, (k, text)
        # their generations overlap: every one had its first token before any ended
        first = max(order.index(k) for k in questions)
        last = min(len(order) - 1 - order[::-1].index(k) for k in questions)
        assert first < last, "the sub-agents took turns"
        # each sequence holds its own prompt and reply; the prefix is held once
        slots = worker.call(
            lambda st: [(s.n_past, list(s.entries), s.runs()) for s in st.memory.slots]
        )
        prompts = {len(system.content) + len(q) for q in questions.values()}
        held = sorted(n for n, _, _ in slots)
        # (BOS + prompt + the reply's tokens but the last, which was never decoded)
        assert held == sorted(1 + p + REPLY - 1 for p in prompts)
        assert cells_in_use(r for _, _, r in slots) < N_CTX < sum(held)
        worker.call(lambda st: st.memory.check())
    finally:
        llm.close()


def test_a_soak_of_sub_agents_with_and_without_shared_prefixes(cycle_model: str) -> None:
    """Agents after one of two system prompts, or none, arriving from four threads:
    every one answers in full (no overflow, no reply cut short mid-stream) while the
    pool is shared as tightly as the count allows."""
    llm = _llm(cycle_model, n_slots=4)
    worker = worker_of(llm)
    assert worker is not None
    systems = [_system(1200, 1), _system(700, 2), ""]
    rng = random.Random(20261129)
    plan = [
        (
            rng.choice(systems),
            "q" + "x" * rng.randrange(5, 200) + rng.choice(CYCLE),
            rng.randrange(8, 64),
        )
        for _ in range(24)
    ]
    errors: list[BaseException] = []
    done: list[tuple[int, int]] = []
    lock = threading.Lock()

    def run(items: list[tuple[str, str, int]]) -> None:
        for system, question, n in items:
            messages = ([SystemMessage(system)] if system else []) + [HumanMessage(question)]
            try:
                reply = llm.invoke(messages, max_tokens=n)
                with lock:
                    done.append((len(str(reply.content)), n))
            except BaseException as exc:  # noqa: BLE001 - collected, asserted below
                with lock:
                    errors.append(exc)

    threads = [threading.Thread(target=run, args=(plan[i::4],)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        assert len(done) == len(plan)
        assert all(got == want for got, want in done)
        worker.call(lambda st: st.memory.check())
    finally:
        llm.close()


def test_priority_and_stall_budget_reach_the_engine_request(
    cycle_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from langchain_llamacpp_local.chat import leases

    seen: list[tuple[str, float | None]] = []
    original = leases._queue

    def queue(request: Any, *a: Any, **k: Any) -> Any:
        seen.append((request.priority, request.stall_budget_ms))
        return original(request, *a, **k)

    monkeypatch.setattr(leases, "_queue", queue)
    llm = _llm(cycle_model, n_slots=1, n_ctx=256, stall_budget_ms=80.0)
    try:
        llm.invoke("a", max_tokens=2)
        llm.invoke("a", max_tokens=2, priority="background", stall_budget_ms=None)
        llm.bind(priority="background").invoke("a", max_tokens=2)
    finally:
        llm.close()
    assert seen == [("interactive", 80.0), ("background", None), ("background", 80.0)]


def test_the_next_question_on_an_idle_state_takes_its_slot_in_place_beside_a_stream(
    cycle_model: str,
) -> None:
    """Beside a running stream, a question on the state an idle slot holds, where the
    pool cannot hold that conversation whole beside a fork that copies its prefix: the
    question takes the idle slot itself and cuts its tail, copying no whole state out of
    llama.cpp (parking it and restoring it into the empty slot took two)."""
    llm = _llm(cycle_model, n_slots=3, n_ctx=4096)
    worker = worker_of(llm)
    assert worker is not None
    state = _system(900, seed=3)
    first_q = _system(300, seed=4) + " a"
    reads: list[int] = []

    def count_reads(st: Any) -> None:  # whole-state copies out of llama.cpp, counted
        get = st.engine.state_get

        def counted(seq_id: int, flags: int = 0) -> bytearray:
            reads.append(seq_id)
            return get(seq_id, flags)

        st.engine.state_get = counted

    started = threading.Event()
    order: list[str] = []

    def stream() -> None:
        for chunk in llm.stream([HumanMessage("go on e")], max_tokens=2500):
            if chunk.content:
                order.append("s")
                started.set()

    t = threading.Thread(target=stream)
    try:
        t.start()
        assert started.wait(60)
        # beside the stream (one decoding alone would have the idle ones parked)
        llm.invoke([SystemMessage(state), HumanMessage(first_q)], max_tokens=1)
        idle = worker.call(lambda st: max(st.memory.slots, key=lambda s: s.n_past).seq_id)
        held = worker.call(lambda st: st.memory.slots[idle].n_past)
        assert held == 1 + len(state) + len(first_q)
        worker.call(count_reads)
        before = len(order)
        # a fork: 2,508 (the stream) + 1,203 (the idle conversation) + 17 + 500 > 4,096;
        # in place: 2,508 + 1 + 900 + 17 + 500 fits
        reply = llm.invoke(
            [SystemMessage(state), HumanMessage("second question c")], max_tokens=500
        )
        assert t.is_alive() and len(order) > before, "the stream ran beside the question"
        t.join(120)
        assert not t.is_alive()
        assert reply.usage_metadata is not None
        assert reply.usage_metadata["input_token_details"]["cache_read"] >= len(state)
        assert idle not in reads, "the idle conversation was copied out of llama.cpp"
        slots = worker.call(lambda st: {s.seq_id: list(s.entries) for s in st.memory.slots})
        prefix = slots[idle][: 1 + len(state)]  # BOS and the state: each character a token
        holding = [
            k for k, e in slots.items() if len(e) > len(state) and e[: len(prefix)] == prefix
        ]
        assert holding == [idle], "the question did not take the idle slot"
        # its tail is the second question now (the first one's was cut)
        assert len(slots[idle]) == 1 + len(state) + len("second question c") + 500 - 1
        worker.call(lambda st: st.memory.check())
    finally:
        llm.close()
        t.join(120)


class _CellLog(logging.Handler):
    """llama.cpp's own account of its cells before each decode (``LLAMA_KV_CACHE_DEBUG``):
    its highest used cell + 1 (what every row attends over) and the cells in use."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = re.search(r"n = +(\d+), used = +(\d+)", record.getMessage())
        if m:
            self.seen.append((int(m.group(1)), int(m.group(2))))


def test_the_pool_is_rewritten_from_its_first_cell_before_a_long_prompt_beside_a_stream(
    cycle_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt arrives beside a running stream in the unified pool, after an idle
    conversation parked to make room left a hole under the stream's cells: the pool is
    rewritten first (every sequence copied out and back, positions kept), so llama.cpp's
    next call attends over exactly the cells in use; the stream streams on to the same
    text it writes alone, the prompt is answered and the memory matches every slot."""
    monkeypatch.setenv("LLAMA_KV_CACHE_DEBUG", "1")
    cells = _CellLog()
    native = logging.getLogger("langchain_llamacpp_local.llama_cpp")
    level = native.level
    native.setLevel(logging.DEBUG)
    native.addHandler(cells)
    llm = _llm(cycle_model, n_slots=3, n_ctx=4096)
    worker = worker_of(llm)
    assert worker is not None
    rewrites: list[int] = []

    def count_rewrites(st: Any) -> None:
        compact = st.memory.compact

        def counted() -> Any:
            # the case this is for: the streams decoded above cells since freed
            assert cells.seen[-1][0] > cells_in_use(s.runs() for s in st.memory.slots)
            lost = compact()
            rewrites.append(len(cells.seen))
            return lost

        st.memory.compact = counted

    head = _system(60, seed=6)  # what the streams share with the idle conversation
    asks = [[SystemMessage(head), HumanMessage(f"go on {c}")] for c in "ea"]
    try:
        worker.call(count_rewrites)
        fresh = _llm(cycle_model, n_slots=3, n_ctx=4096)
        try:
            alone = ["".join(str(c.content) for c in fresh.stream(m, max_tokens=400)) for m in asks]
        finally:
            fresh.close()
        # an idle conversation holds the pool's first cells; two streams starting together
        # copy its first ones (so it stays) and write above it
        llm.invoke([SystemMessage(head + _system(2500, seed=4)), HumanMessage("q b")], max_tokens=2)
        started = [threading.Event() for _ in asks]
        texts: list[list[str]] = [[] for _ in asks]

        def stream(i: int) -> None:
            for chunk in llm.stream(asks[i], max_tokens=400):
                if chunk.content:
                    texts[i].append(str(chunk.content))
                    started[i].set()

        together = threading.Thread(
            target=ask_together,
            args=(llm, monkeypatch, {i: (lambda i=i: stream(i)) for i in range(len(asks))}),
        )
        together.start()
        assert all(e.wait(60) for e in started)
        reply = llm.invoke(
            [SystemMessage(_system(1500, seed=5)), HumanMessage("q a")], max_tokens=4
        )
        together.join(120)
        assert not together.is_alive()
        assert rewrites, "the pool was not rewritten before the long prompt"
        n_kv, used = cells.seen[rewrites[0]]  # llama.cpp's first call after the rewrite
        assert n_kv == used, "the rewritten pool still spans empty cells"
        assert reply.content
        worker.call(lambda st: st.memory.check())
        assert ["".join(t) for t in texts] == alone
    finally:
        native.removeHandler(cells)
        native.setLevel(level)
        llm.close()
