"""The worker's step plan without a model: grouping, drafts, LoRA sets.

The worker applies the plan on real llama.cpp (tests/integration/cache/test_slots.py,
test_exactness.py, test_lora.py, test_speculative.py)."""

from __future__ import annotations

from langchain_llamacpp_local.runtime.scheduler import StepPlan, plan_step, row_limit


def plan(
    generating: list[str],
    *,
    drafting: set[str] = frozenset(),  # type: ignore[assignment]
    limit: int = 8,
    lora: dict[str, str] | None = None,
    turn: int = 0,
) -> StepPlan[str]:
    return plan_step(
        generating,
        drafting=lambda r: r in drafting,
        limit=limit,
        lora_of=lambda r: (lora or {}).get(r, ""),
        turn=turn,
    )


def test_every_generating_request_shares_one_decode_by_default() -> None:
    step = plan(["a", "b", "c", "d"])
    assert step == StepPlan((("a", "b", "c", "d"),), ())


def test_a_row_limit_splits_into_the_fewest_even_calls() -> None:
    assert plan(["a", "b", "c", "d"], limit=3).decode_groups == (("a", "b"), ("c", "d"))


def test_drafting_requests_verify_in_calls_of_their_own() -> None:
    step = plan(["a", "b", "c"], drafting={"b"})
    assert step.decode_groups == (("a", "c"),)
    assert step.verify == ("b",)


def test_lora_sets_never_share_a_call_and_take_turns_going_first() -> None:
    lora = {"a": "sql", "b": "", "c": "sql"}
    first = plan(["a", "b", "c"], lora=lora, turn=0).decode_groups
    second = plan(["a", "b", "c"], lora=lora, turn=1).decode_groups
    assert first == (("a", "c"), ("b",))
    assert second == (("b",), ("a", "c"))


def test_nothing_to_do() -> None:
    assert plan([]) == StepPlan((), ())


def test_row_limit_by_mode() -> None:
    assert row_limit(5, deterministic=False, kv_unified=False, exact_rows=2) == 5
    assert row_limit(0, deterministic=False, kv_unified=False, exact_rows=2) == 1
    assert row_limit(5, deterministic=True, kv_unified=False, exact_rows=2) == 2
    assert row_limit(5, deterministic=True, kv_unified=True, exact_rows=2) == 5
