"""The worker's loop without a model: admit -> plan -> steps -> finished.

The worker's own loop body (``WorkerLoop.tick``) runs over a pure-Python store
(the ``SequenceStore`` fake of tests/unit/cache/test_slot_memory.py, which checks that
every sequence's positions follow) and a simulated decoder: each ``llama_decode`` call
appends its rows to the store and advances a simulated clock by what a call of that
shape costs (per call, per row, per attended position), the clock the worker times its
calls with. So the stall budget's piece sizes, the priorities' order and the pool's
admission are checked on the real scheduling code, counted in simulated seconds (no
wall clock). The KV bookkeeping check runs after every step.

The same loop on real llama.cpp: tests/integration/runtime/test_shared_prefix.py,
benchmarks/bench_arrival.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from langchain_llamacpp_local.cache.pool import cells_in_use
from langchain_llamacpp_local.cache.slot_memory import CacheOptions, SlotMemory
from langchain_llamacpp_local.llama.probes import MemoryKind
from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.runtime.loop import WorkerLoop
from langchain_llamacpp_local.runtime.requests import EngineRequest, Failed, Finished
from langchain_llamacpp_local.runtime.scheduler import (
    BACKGROUND_AGE_S,
    CallCost,
    attended,
    call_attention,
    largest_piece,
)
from langchain_llamacpp_local.runtime.step_cost import MARGIN_MAX, CostFit
from tests.unit.cache.test_slot_memory import FakeStore

#: the simulated machine: about SmolLM2-135M on two CPU cores
COST = CallCost(per_call=0.015, per_row=0.003, per_attended=1e-7)
BUDGET_MS = 150.0


class SimDecoder(FakeStore):
    """A unified pool whose decode calls append to the store and take simulated time."""

    def __init__(
        self, *, n_slots: int = 4, n_ctx: int = 8192, n_batch: int = 512, all_cells: bool = False
    ) -> None:
        super().__init__(MemoryKind.PARTIAL, n_slots=n_slots, n_ctx=n_ctx, n_batch=n_batch)
        self.kv_unified = True
        self.n_ctx_total = n_ctx
        self.exact_rows = self.exact_verify_rows = 1
        self.attends_all_cells = self.all_cells = all_cells
        self.ctx = None
        self.now = 0.0
        #: every call: the rows of each sequence in it, its simulated seconds
        self.calls: list[tuple[dict[int, int], float]] = []

    def clock(self) -> float:
        return self.now

    def set_lora(self, lora: Any) -> None:
        assert not lora

    def decode_batch(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seq_ids: Sequence[int],
        outputs: Sequence[bool],
        cancel: Any = None,
    ) -> None:
        rows: dict[int, list[tuple[int, int]]] = {}
        for tok, pos, seq in zip(tokens, positions, seq_ids, strict=True):
            rows.setdefault(seq, []).append((pos, tok))
        for seq, items in rows.items():
            self.decode(seq, [t for _, t in items], items[0][0])
        own = sum(p + 1 for p in positions)
        # all_cells: llama.cpp's unified pool without flash attention, where every row
        # attends over every used cell (other conversations' too, masked)
        pool = sum(len(c) for c in self.cells) - len(tokens) if self.all_cells else None
        seconds = replace(COST, pool=pool).of(len(tokens), own)
        self.now += seconds
        self.calls.append(({s: len(r) for s, r in rows.items()}, seconds))

    def is_eog(self, tok: int) -> bool:
        return False

    def token_piece(self, tok: int) -> bytes:
        return b"a"


class Sampler:
    """Always the same token (the loop's decisions do not depend on which)."""

    def sample(self, ctx: Any, idx: int) -> int:
        return 7

    def force(self, tok: int) -> int:
        return tok

    def close(self) -> None:
        pass


def _make_loop(**kw: Any) -> tuple[WorkerLoop, SimDecoder]:
    eng = SimDecoder(**kw)
    state = WorkerLoop(eng.config, CacheOptions(checkpoint_max_count=0), None)
    state.engine = eng  # type: ignore[assignment]
    state.memory = SlotMemory(eng, state.cache)
    state.memory.checking = True
    state.clock = eng.clock
    return state, eng


def _job(tokens: list[int], max_new: int, **kw: Any) -> EngineRequest:
    job = EngineRequest(
        tokens=tokens,
        sampling=SamplingParams(),
        max_new=max_new,
        sampler=Sampler(),  # type: ignore[arg-type]
        **kw,
    )
    job.channel.wake_for_text(False)  # no reader thread: nothing to hand over to
    return job


def _end(job: EngineRequest) -> Finished | Failed:
    """The reply's last item (the loop has run it to the end)."""
    last = None
    while True:
        try:
            last = job.channel.get(timeout=0)
        except TimeoutError:
            break
    assert isinstance(last, Finished | Failed), last
    return last


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 10 for i in range(n)]


def _run(state: WorkerLoop, until: Any, limit: int = 5000) -> int:
    for i in range(limit):
        if until():
            return i
        state.tick()
    raise AssertionError("the loop did not get there")


def _generating(state: WorkerLoop, jobs: Sequence[EngineRequest]) -> bool:
    acts = {id(a.job): a for a in state.active}
    return all(id(j) in acts and acts[id(j)].n_gen > 0 for j in jobs)


def _seq_of(state: WorkerLoop, job: EngineRequest) -> int:
    return next(a.slot.seq_id for a in state.active if a.job is job)


def test_pieces_fit_the_budget_and_background_prompts_wait_until_they_age() -> None:
    state, eng = _make_loop()
    streams = [_job(_prompt(i, 200), 1000, stall_budget_ms=BUDGET_MS) for i in (1, 2)]
    for job in streams:
        state.enqueue(job)
    _run(state, lambda: _generating(state, streams))
    # two long prompts arrive together: an interactive one and a background one
    chat = _job(_prompt(3, 3000), 4)
    bg = _job(_prompt(4, 1500), 4, priority="background")
    state.enqueue(chat)
    state.enqueue(bg)
    t_arrival = eng.now
    state.tick()  # admitted together
    seq = {"chat": _seq_of(state, chat), "bg": _seq_of(state, bg)}
    steps: list[tuple[float, float, dict[int, int]]] = []  # start, seconds, prompt rows
    while any(a.job in (chat, bg) and a.prefilling for a in state.active):
        t0, n0 = eng.now, len(eng.calls)
        reading = {a.slot.seq_id for a in state.active if a.prefilling}
        state.tick()
        rows: dict[int, int] = {}
        for call, _ in eng.calls[n0:]:
            for s, n in call.items():
                if s in reading:
                    rows[s] = rows.get(s, 0) + n
        steps.append((t0, eng.now - t0, rows))
        assert _generating(state, streams), "the streams generate throughout"
    # every step fits the budget (the cost fit needs a few calls to learn the pieces)
    assert max(sec for _, sec, _ in steps[3:]) <= BUDGET_MS / 1000 * 1.05
    sizes = [rows[seq["chat"]] for _, _, rows in steps if rows.get(seq["chat"])]
    assert max(sizes) < 512 and min(sizes[:-1]) >= 16  # (the last: what was left)
    # pieces shrink as the prompt grows (attention): the last ones are the smallest
    # (the very first is planned by the prior's margin)
    assert sizes[-3] < max(sizes[:5])
    # the background prompt waited behind the interactive one until it aged
    first_bg = next(t for t, _, rows in steps if rows.get(seq["bg"]))
    assert first_bg >= t_arrival + BACKGROUND_AGE_S
    chat_done = max(t for t, _, rows in steps if rows.get(seq["chat"]))
    assert first_bg < chat_done, "aged, it is read beside the interactive prompt"
    # aged, it fills the rest of the older prompt's call: the two share steps
    assert any(rows.get(seq["bg"]) and rows.get(seq["chat"]) for _, _, rows in steps)
    _run(state, lambda: not any(a.job in (chat, bg) for a in state.active))
    assert _end(chat).n_generated == 4 and _end(bg).n_generated == 4


def test_a_lone_prompt_reads_whole_pieces() -> None:
    state, eng = _make_loop()
    job = _job(_prompt(1, 2000), 3)
    state.enqueue(job)
    _run(state, lambda: not state.active and not state.pending)
    prompt_calls = [sum(call.values()) for call, _ in eng.calls if sum(call.values()) > 1]
    assert prompt_calls == [512, 512, 512, 464]
    assert _end(job).n_generated == 3


def test_background_streams_are_not_protected_by_the_budget() -> None:
    state, eng = _make_loop()
    stream = _job(_prompt(1, 100), 3000, priority="background")
    state.enqueue(stream)
    _run(state, lambda: _generating(state, [stream]))
    chat = _job(_prompt(2, 1100), 2)
    state.enqueue(chat)
    n0 = len(eng.calls)
    _run(state, lambda: any(a.job is chat and not a.prefilling for a in state.active))
    pieces = [sum(call.values()) for call, _ in eng.calls[n0:]]
    assert pieces[0] == 512  # the interactive prompt reads whole pieces (one row rides)


def test_interactive_requests_are_admitted_before_background_ones() -> None:
    state, eng = _make_loop(n_slots=2)
    first = _job(_prompt(1, 50), 50)
    state.enqueue(first)
    state.tick()
    bg = _job(_prompt(2, 50), 5, priority="background")
    chat = _job(_prompt(3, 50), 5)
    state.enqueue(bg)
    state.enqueue(chat)  # one slot left: the younger interactive request takes it
    state.tick()
    assert [a.job for a in state.active] == [first, chat]
    _run(state, lambda: not state.active and not state.pending)
    for job in (first, chat, bg):
        assert isinstance(_end(job), Finished)


@pytest.mark.parametrize("n_agents", [3, 5])
def test_sub_agents_with_a_shared_system_prompt_run_together(n_agents: int) -> None:
    # the shared prefix counts once: all of them fit a pool the old count (every
    # request's prompt and max_tokens apart) would have let only one use at a time
    system = _prompt(9, 1780)
    n_ctx = 2048 if n_agents == 3 else 8192
    if n_agents == 5:
        system = _prompt(9, 4300)
    state, eng = _make_loop(n_slots=n_agents, n_ctx=n_ctx)
    jobs = [_job([*system, *_prompt(20 + i, 17)], 48) for i in range(n_agents)]
    assert len(jobs[0].tokens) + 48 + len(jobs[1].tokens) + 48 > n_ctx
    for job in jobs:
        state.enqueue(job)
    most = 0
    while state.active or state.pending:
        state.tick()
        most = max(most, sum(1 for a in state.active if a.n_gen > 0))
        held = cells_in_use(s.runs() for s in state.memory.slots)  # type: ignore[union-attr]
        assert held <= n_ctx
    assert most == n_agents
    for job in jobs:
        end = _end(job)
        assert end.n_generated == 48, end


def test_a_request_that_cannot_fit_waits_and_nothing_fails() -> None:
    state, eng = _make_loop(n_slots=3, n_ctx=1024)
    jobs = [_job(_prompt(i, 400), 100) for i in range(3)]  # nothing shared: two at a time
    for job in jobs:
        state.enqueue(job)
    most = 0
    while state.active or state.pending:
        state.tick()
        most = max(most, len(state.active))
    assert most == 2
    for job in jobs:
        assert not isinstance(_end(job), Failed)


def test_a_request_waits_to_copy_a_prefix_being_read_but_never_behind_background_work() -> None:
    state, eng = _make_loop()
    shared = _prompt(5, 2000)
    first = _job([*shared, 1, 2], 4)
    state.enqueue(first)
    state.tick()  # reads its first piece
    second = _job([*shared, 3, 4], 4)
    state.enqueue(second)
    state.tick()
    assert [a.job for a in state.active] == [first]  # waits: the prefix is being read
    _run(state, lambda: len(state.active) == 2)
    act = next(a for a in state.active if a.job is second)
    assert act.n_keep == 2000  # copied, not read again
    _run(state, lambda: not state.active)
    # an interactive request does not wait for a background reader
    state, eng = _make_loop()
    bg = _job([*shared, 1, 2], 4, priority="background")
    state.enqueue(bg)
    state.tick()
    chat = _job([*shared, 3, 4], 4)
    state.enqueue(chat)
    state.tick()
    assert {a.job.priority for a in state.active} == {"background", "interactive"}
    _run(state, lambda: not state.active)


class CopyingDecoder(SimDecoder):
    """A pool whose state copies take simulated time too, per entry (llama.cpp copies a
    parked or restored conversation's cells in one piece: it cannot be cut)."""

    def __init__(self, per_entry: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.per_entry = per_entry

    def state_get(self, seq_id: int, flags: int = 0) -> bytes:
        self.now += self.per_entry * len(self.cells[seq_id])
        return super().state_get(seq_id, flags)

    def state_set(self, data: bytes, seq_id: int, flags: int = 0) -> bool:
        ok = super().state_set(data, seq_id, flags)
        self.now += self.per_entry * len(self.cells[seq_id])
        return ok


@pytest.mark.parametrize("per_entry", [25e-6, 40e-6])
def test_a_slot_fill_beside_streams_counts_against_the_step_budget(per_entry: float) -> None:
    # A second question on a long state takes the slot an older conversation holds: the
    # slot's fill parks that conversation first (75 or 120 ms of copying, the streams
    # waiting for it). The step that follows gets what is left of the budget, or reads
    # no prompt when nothing is; the prompt still reads from the next step on.
    eng = CopyingDecoder(per_entry, n_slots=3)
    state = WorkerLoop(eng.config, CacheOptions(checkpoint_max_count=0), None)
    state.engine = eng  # type: ignore[assignment]
    state.memory = SlotMemory(eng, state.cache)
    state.memory.checking = True
    state.clock = eng.clock
    shared = _prompt(5, 1000)
    old = _job([*shared, *_prompt(6, 2000)], 1)
    state.enqueue(old)
    _run(state, lambda: not state.active and not state.pending)
    (held,) = [s for s in state.memory.slots if s.n_past]  # the old conversation
    assert held.n_past == 3000
    streams = [_job(_prompt(i, 200), 1000, stall_budget_ms=BUDGET_MS) for i in (1, 2)]
    for job in streams:  # together: neither decodes alone, nothing is parked for them
        state.enqueue(job)
    _run(state, lambda: _generating(state, streams))
    for _ in range(20):  # the cost fit learns the token steps
        state.tick()
    assert held.n_past == 3000
    arrival = _job([*shared, *_prompt(7, 1000)], 1, stall_budget_ms=BUDGET_MS)
    state.enqueue(arrival)
    ticks: list[float] = []
    while True:
        t0 = eng.now
        state.tick()
        ticks.append(eng.now - t0)
        if not any(a.job is arrival for a in state.active):
            break
        assert _generating(state, streams)
    assert ticks[0] >= per_entry * 3000, "the fill parked the old conversation"
    # the fill's tick, the streams' gap, fits the budget with the fill in it
    assert ticks[0] <= BUDGET_MS / 1000 * 1.05, ticks[:3]
    assert max(ticks) <= BUDGET_MS / 1000 * 1.05
    assert isinstance(_end(arrival), Finished)


def _arrival_steps(state: WorkerLoop, eng: SimDecoder, n_prompt: int) -> list[float]:
    """Two streams generate beside an idle 3,000-token conversation; then a prompt of
    ``n_prompt`` tokens arrives: the seconds of each step until it is read."""
    idle = _job(_prompt(5, 3000), 2)
    state.enqueue(idle)
    _run(state, lambda: not state.active and not state.pending)
    streams = [_job(_prompt(i, 200), 1000, stall_budget_ms=BUDGET_MS) for i in (1, 2)]
    for job in streams:
        state.enqueue(job)
    _run(state, lambda: _generating(state, streams))
    for _ in range(20):  # the fit learns the streams' steps over the idle cells
        state.tick()
    chat = _job(_prompt(3, n_prompt), 4)
    state.enqueue(chat)
    state.tick()
    steps = []
    while any(a.job is chat and a.prefilling for a in state.active):
        t0 = eng.now
        state.tick()
        steps.append(eng.now - t0)
    return steps


def test_pieces_count_the_idle_cells_every_row_attends_over() -> None:
    """In a unified pool without flash attention every row attends over all used
    cells: the budget's cost model counts them, so the first pieces of a prompt
    arriving beside an idle long conversation fit the budget too."""
    state, eng = _make_loop(all_cells=True)
    steps = _arrival_steps(state, eng, 2000)
    assert len(steps) > 10
    assert max(steps) <= BUDGET_MS / 1000 * 1.05, [round(s * 1000) for s in steps[:6]]


def test_the_margin_follows_how_far_pieces_ran_over() -> None:
    fit = CostFit(CallCost(per_call=0.01, per_row=0.002, per_attended=1e-8))
    assert fit.margin == 1.0  # nothing seen yet
    seen = []
    for i in range(30):
        rows, att = 64, attended(500 + i * 64, 64)
        predicted = fit.model.of(rows, att)
        # alternate calls run 1.0x and 1.3x their prediction (a shared machine)
        fit.observe(rows, att, predicted * (1.3 if i % 2 else 1.0))
        seen.append(fit.margin)
    assert 1.2 <= seen[-1] <= 1.3
    # bounded: calls descheduled for seconds do not shrink pieces past half
    for _ in range(5):
        _ = fit.model  # the planner reads the model each budgeted step
        fit.observe(64, attended(500, 64), 100.0)
    assert fit.margin == MARGIN_MAX


def test_a_margin_shrinks_the_piece_and_a_pool_counts_every_row() -> None:
    cost = CallCost(per_call=0.01, per_row=0.002, per_attended=1e-8)
    n1 = largest_piece(0.15, cost, start=1000, n_max=512)
    n2 = largest_piece(0.15, cost.scaled(1.5), start=1000, n_max=512)
    assert n2 < n1
    # over a 4,000-cell pool every row attends all of them, wherever it is
    assert call_attention(3, 100, None) == 100
    assert call_attention(3, 100, 4000) == 3 * 4003
    pooled = replace(cost, pool=4000)
    assert largest_piece(0.15, pooled, start=10, n_max=512) < largest_piece(
        0.15, cost, start=10, n_max=512
    )
