"""The stall budget and priorities without a model: piece sizes from a call-cost model,
the cost model fitted from timed calls, the order interactive and background work take.

The worker loop that applies them, on a pure-Python store: test_step_loop.py; on real
llama.cpp: tests/integration/runtime/test_shared_prefix.py and benchmarks/bench_arrival.py."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from langchain_llamacpp_local.runtime.scheduler import (
    BACKGROUND_AGE_S,
    BACKGROUND_AGE_STEPS,
    FIRST_PIECE,
    MIN_PIECE,
    CallCost,
    PieceRules,
    PromptPiece,
    PromptRead,
    StepBudget,
    attended,
    by_priority,
    effective_priority,
    largest_piece,
    plan_step,
)
from langchain_llamacpp_local.runtime.step_cost import PRIOR, CostFit

#: about SmolLM2-135M on two CPU cores: 15 ms a call, 3 ms a row, attention on top
COST = CallCost(per_call=0.015, per_row=0.003, per_attended=1e-7)
FAST = PieceRules(
    deterministic=False, n_batch=512, n_ubatch=512, align=64, window_checkpoints=False
)
EXACT = PieceRules(
    deterministic=True, n_batch=512, n_ubatch=512, align=64, window_checkpoints=False
)


def test_attended_positions_of_a_piece() -> None:
    assert attended(0, 1) == 1
    assert attended(10, 3) == 11 + 12 + 13


@pytest.mark.parametrize("start", [0, 1000, 4000, 30000])
@pytest.mark.parametrize("seconds", [0.05, 0.15, 0.5])
def test_the_largest_piece_is_the_last_that_fits(start: int, seconds: float) -> None:
    n = largest_piece(seconds, COST, start=start, n_max=512, rows=2, attending=2 * start)
    assert MIN_PIECE <= n <= 512
    if n > MIN_PIECE:
        assert COST.of(2 + n, 2 * start + attended(start, n)) <= seconds
    if n < 512:
        assert COST.of(2 + n + 1, 2 * start + attended(start, n + 1)) > seconds


def test_a_piece_late_in_a_prompt_is_smaller_than_an_early_one() -> None:
    early = largest_piece(0.15, COST, start=0, n_max=512)
    late = largest_piece(0.15, COST, start=8000, n_max=512)
    assert late < early


def test_a_prompt_always_progresses_and_a_generous_budget_keeps_whole_pieces() -> None:
    assert largest_piece(0.0, COST, start=0, n_max=512) == MIN_PIECE
    assert largest_piece(0.0, COST, start=0, n_max=512, n_min=16) == 16
    assert largest_piece(0.0, COST, start=0, n_max=5) == 5
    assert largest_piece(100.0, COST, start=0, n_max=512) == 512


def test_over_a_large_pool_a_piece_shrinks_below_the_first_pieces_size_to_fit() -> None:
    """Where every row attends over a pool so large that a row costs 7 ms, 16 prompt
    tokens and two stream rows overrun the budget: the piece reads fewer (down to
    MIN_PIECE) and the step fits; the first piece too. Only where not even MIN_PIECE
    fits does the step overrun."""
    pool = replace(COST, pool=40_000)
    rows_ms = pool.of(1, 0)  # one row over the pool
    budget = StepBudget(0.12, pool)
    for beside in (0, 1):
        step = _step(["g", "h"], {"x": PromptRead(2000, 6000, beside=beside)}, budget=budget)
        n = step.prompt.end - step.prompt.start
        assert MIN_PIECE <= n < FIRST_PIECE
        assert pool.of(2 + n, 0) <= 0.12 < pool.of(2 + n + 1, 0)
    tight = StepBudget(pool.of(2 + MIN_PIECE, 0) - rows_ms, pool)
    step = _step(["g", "h"], {"x": PromptRead(2000, 6000, beside=1)}, budget=tight)
    assert step.prompt.end - step.prompt.start == MIN_PIECE


def _step(generating: list[str], reads: dict[str, PromptRead], **kw: object):  # type: ignore[no-untyped-def]
    positions = {"g": 3000, "h": 100, **kw.pop("positions", {})}  # type: ignore[dict-item]
    return plan_step(
        generating,
        limit=8,
        lora_of=lambda r: "",
        turn=0,
        reading=list(reads.items()),
        rules=kw.pop("rules", FAST),  # type: ignore[arg-type]
        mix=kw.pop("mix", True),  # type: ignore[arg-type]
        budget=kw.pop("budget", StepBudget(0.15, COST)),  # type: ignore[arg-type]
        position=lambda r: positions[r],
    )


def _call_cost(step, positions: dict[str, int]) -> float:  # type: ignore[no-untyped-def]
    """What the step's calls cost under COST."""
    total = sum(COST.of(len(g), sum(positions[r] + 1 for r in g)) for g in step.decode_groups)
    pieces = [step.prompt, *step.more_prompts]
    rows = len(step.with_prompt) + sum(p.end - p.start for p in pieces)
    att = sum(positions[r] + 1 for r in step.with_prompt)
    att += sum(attended(p.start, p.end - p.start) for p in pieces)
    return total + COST.of(rows, att)


def test_the_step_with_a_piece_fits_the_budget() -> None:
    for start in (0, 2000, 6000):
        step = _step(["g", "h"], {"x": PromptRead(start, 10000, beside=1)})
        assert step.with_prompt == ("g", "h")
        n = step.prompt.end - step.prompt.start
        assert 16 < n < 512
        assert _call_cost(step, {"g": 3000, "h": 100}) <= 0.15


def test_without_a_budget_the_piece_is_whole() -> None:
    step = _step(["g"], {"x": PromptRead(0, 10000, beside=1)}, budget=None)
    assert step.prompt.end - step.prompt.start == 511  # n_batch less the riding row


def test_other_calls_of_the_step_take_their_share_of_the_budget() -> None:
    # without mixing, the generation call runs apart: it is counted before the piece
    mixed = _step(["g", "h"], {"x": PromptRead(0, 10000, beside=1)})
    apart = _step(["g", "h"], {"x": PromptRead(0, 10000, beside=1)}, mix=False)
    assert apart.decode_groups == (("g", "h"),)
    assert apart.prompt.end < mixed.prompt.end
    assert _call_cost(apart, {"g": 3000, "h": 100}) <= 0.15


def test_younger_prompts_fill_only_the_time_left() -> None:
    reads = {
        "x": PromptRead(0, 10, beside=1),
        "y": PromptRead(0, 10000, beside=1),
        "z": PromptRead(0, 10000, beside=1),
    }
    step = _step(["g"], reads)
    assert step.prompt == PromptPiece("x", (), 0, 10)
    assert [p.request for p in step.more_prompts] == ["y"]  # y took what time was left
    assert _call_cost(step, {"g": 3000}) <= 0.15


def test_deterministic_pieces_stay_on_the_grid_under_a_budget() -> None:
    for start in (0, 64, 1024):
        step = _step(["g"], {"x": PromptRead(start, 10000, beside=1)}, rules=EXACT, mix=False)
        assert step.prompt.start % 64 == 0 and step.prompt.end % 64 == 0
        assert step.prompt.end - step.prompt.start >= 128
    # a budget too small for a grid cell still reads two
    tiny = _step(
        ["g"], {"x": PromptRead(0, 10000, beside=1)}, rules=EXACT, budget=StepBudget(0.0, COST)
    )
    assert tiny.prompt.end == 128
    # so that a one-token tail joins the cell before it, as in a piece alone: no lone row
    tail = _step(
        ["g"], {"x": PromptRead(0, 129, beside=1)}, rules=EXACT, budget=StepBudget(0.0, COST)
    )
    assert tail.prompt.end == 64


def test_an_image_is_read_whole_and_the_text_after_it_waits() -> None:
    read = PromptRead(0, 2000, media={0: 300})
    step = _step(["g"], {"x": read})
    assert step.prompt.media == (0,)
    assert step.prompt.start == 300 and step.prompt.end - step.prompt.start == MIN_PIECE


# --------------------------------------------------------------------------- priorities


def test_background_work_ages_into_interactive() -> None:
    assert effective_priority("interactive", 0, 0) == 0
    assert effective_priority("background", 0, 0) == 1
    assert effective_priority("background", BACKGROUND_AGE_S, 0) == 0
    assert effective_priority("background", 0, BACKGROUND_AGE_STEPS) == 0


def test_interactive_first_arrival_order_within_a_kind() -> None:
    arrivals = [("b1", 1), ("i1", 0), ("b2", 1), ("i2", 0)]
    assert [n for n, _ in by_priority(arrivals, lambda a: a[1])] == ["i1", "i2", "b1", "b2"]


# --------------------------------------------------------------------------- the cost fit


def test_the_fit_starts_from_the_prior_and_learns_the_calls() -> None:
    fit = CostFit()
    assert fit.model == PRIOR
    rng = random.Random(7)
    for i in range(300):
        rows, start = (512, rng.randrange(0, 6000)) if i % 8 == 0 else (2, rng.randrange(0, 6000))
        att = attended(start, rows) if rows > 8 else 2 * start
        fit.observe(rows, att, COST.of(rows, att) * (1 + 0.05 * rng.random()))
    model = fit.model
    for rows, att in ((2, 6000), (64, attended(4000, 64)), (512, attended(3000, 512))):
        assert model.of(rows, att) == pytest.approx(COST.of(rows, att), rel=0.1)


def test_the_fit_follows_a_machine_that_slows_down() -> None:
    fit = CostFit()
    slow = CallCost(COST.per_call * 3, COST.per_row * 3, COST.per_attended * 3)
    for cost in (COST, slow):  # 100 pieces each: the old ones have faded
        for i in range(400):
            rows, start = (256, 100 * (i % 40)) if i % 4 == 0 else (1, 100 * (i % 40))
            att = attended(start, rows)
            fit.observe(rows, att, cost.of(rows, att))
    assert fit.model.of(256, attended(2000, 256)) == pytest.approx(
        slow.of(256, attended(2000, 256)), rel=0.1
    )


def test_failed_or_empty_calls_teach_nothing() -> None:
    fit = CostFit()
    fit.observe(0, 0, 1.0)
    fit.observe(5, 10, 0.0)
    assert fit.n == 0 and fit.model == PRIOR


def test_the_first_call_of_each_kind_warms_up_and_is_not_learned() -> None:
    fit = CostFit()
    fit.observe(512, attended(0, 512), 50.0)  # graph reservation, page faults
    fit.observe(1, 100, 5.0)
    assert fit.n == 0 and fit.model == PRIOR


def test_time_spent_before_the_step_counts_and_a_prompt_waits_one_step_at_most() -> None:
    positions = {"g": 3000, "h": 100}
    read = {"x": PromptRead(2000, 10000, beside=1)}
    whole = _step(["g", "h"], read)
    # a slot's fill took 40 ms before the calls: the piece is cut to the rest
    some = _step(["g", "h"], read, budget=StepBudget(0.15, COST, spent=0.04))
    assert some.prompt is not None
    assert some.prompt.end - some.prompt.start < whole.prompt.end - whole.prompt.start
    assert _call_cost(some, positions) <= 0.15 - 0.04
    # the fill took the piece's time: the streams decode alone, in one call
    none = _step(["g", "h"], read, budget=StepBudget(0.15, COST, spent=0.12))
    assert none.prompt is None and none.more_prompts == () and none.with_prompt == ()
    assert none.decode_groups == (("g", "h"),)
    # a smallest piece that is over the budget anyway is read as before (the prompt
    # progresses) after a short admission ...
    slow = CallCost(per_call=0.2, per_row=0.003, per_attended=1e-7)
    over = _step(["g", "h"], read, budget=StepBudget(0.15, slow, spent=0.012))
    assert over.prompt is not None and over.prompt.end - over.prompt.start == MIN_PIECE
    # ... but after a copy (a conversation parked or restored: a quarter of the budget)
    # the streams do not wait for both: the prompt reads from the next step
    for spent in (0.04, 0.3):
        copy = _step(["g", "h"], read, budget=StepBudget(0.15, slow, spent=spent))
        assert copy.prompt is None and copy.decode_groups == (("g", "h"),)


def test_one_call_descheduled_for_seconds_does_not_shrink_the_pieces() -> None:
    fit = CostFit()
    rng = random.Random(3)
    piece, token = (18, attended(3000, 18)), (2, 6000)

    def steps(n: int, scale: float = 1.0) -> None:  # a token step, then a piece, ...
        for _ in range(n):
            start = rng.randrange(1000, 4000)
            rows = rng.randrange(16, 200) if fit.n % 2 else 2
            att = attended(start, rows)
            fit.observe(rows, att, COST.of(rows, att) * scale)
            assert fit.model.per_row > 0  # a budgeted step reads the fit every step

    steps(60)
    fit.observe(*piece, 14.0)  # the machine took the worker's cores for 14 s
    for _ in range(40):  # unlearned, it would freeze the fit, then inflate it 4-11x
        steps(1)
        for call in (piece, token):
            assert fit.model.of(*call) <= COST.of(*call) * 1.25
    # a machine that really got 6x slower is followed within a hundred calls
    steps(100, scale=6.0)
    assert fit.model.of(*piece) == pytest.approx(6 * COST.of(*piece), rel=0.15)


def test_a_prompts_first_piece_beside_the_streams_is_the_smallest() -> None:
    """The fit has not yet timed a piece where a fill just changed llama.cpp's memory:
    the first piece is the minimum, the next ones as large as the budget allows."""
    first = _step(["g", "h"], {"x": PromptRead(0, 10000)})
    later = _step(["g", "h"], {"x": PromptRead(0, 10000, beside=1)})
    assert first.prompt is not None and later.prompt is not None
    assert first.prompt.end - first.prompt.start == FIRST_PIECE
    assert later.prompt.end - later.prompt.start > FIRST_PIECE
    # a short prompt is read as the budget allows from its first piece
    short = _step(["g", "h"], {"x": PromptRead(0, 60)})
    assert short.prompt is not None and short.prompt.end - short.prompt.start > FIRST_PIECE
    # with no budget (no interactive stream), a prompt's first piece is whole (less
    # the row of the token riding in its call)
    alone = _step(["g"], {"x": PromptRead(0, 10000)}, budget=None)
    assert alone.prompt is not None and alone.prompt.end == 511
