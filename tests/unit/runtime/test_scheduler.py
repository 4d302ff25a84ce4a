"""The worker's step plan without a model: grouping, drafts, LoRA sets, prompt pieces.

The worker applies the plan on real llama.cpp (tests/integration/cache/test_slots.py,
test_exactness.py, test_lora.py, test_speculative.py)."""

from __future__ import annotations

import pytest

from langchain_llamacpp_local.cache.chunking import piece_end
from langchain_llamacpp_local.cache.slot_memory import WINDOW_SLACK
from langchain_llamacpp_local.runtime.scheduler import (
    PieceRules,
    PromptPiece,
    PromptRead,
    StepPlan,
    plan_piece,
    plan_step,
    row_limit,
)


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


# --------------------------------------------------------------------------- drafts


def test_each_verify_carries_its_draft_and_requests_without_one_decode() -> None:
    drafts = {"a": [], "b": [5, 6], "c": [7]}
    step = plan_step(
        ["a", "b", "c"], drafts=lambda r: drafts[r], limit=8, lora_of=lambda r: "", turn=0
    )
    assert step.decode_groups == (("a",),)
    assert list(step.verifies()) == [("b", (5, 6)), ("c", (7,))]
    assert step.prompt is None


# --------------------------------------------------------------------------- prompt pieces

FAST = PieceRules(
    deterministic=False, n_batch=256, n_ubatch=256, align=64, window_checkpoints=False
)


def piece(read: PromptRead, rules: PieceRules = FAST) -> PromptPiece[str]:
    return plan_piece("r", read, rules)


def test_default_mode_reads_n_batch_tokens_from_where_the_slot_ends() -> None:
    assert (piece(PromptRead(0, 1000)).start, piece(PromptRead(0, 1000)).end) == (0, 256)
    assert piece(PromptRead(300, 1000)).end == 556
    assert piece(PromptRead(900, 1000)).end == 1000


def test_a_piece_ends_at_a_checkpoint_target_an_image_or_an_alora_activation() -> None:
    assert piece(PromptRead(0, 1000, targets=(100, 700))).end == 100
    assert piece(PromptRead(0, 1000, media={200: 10})).end == 200
    before = piece(PromptRead(0, 1000, lora_start=50))
    assert before.end == 50 and not before.adapters
    after = piece(PromptRead(50, 1000, lora_start=50))
    assert after.end == 306 and after.adapters


def test_images_at_the_resume_point_are_read_first() -> None:
    p = piece(PromptRead(10, 1000, media={10: 5, 15: 20, 600: 4}))
    assert p.media == (10, 15) and (p.start, p.end) == (35, 291)
    # an image the prompt would end with is planned (the worker refuses it), no text after
    last = piece(PromptRead(10, 30, media={10: 20}))
    assert last.media == (10,) and last.start == last.end == 10


def test_window_checkpoints_near_the_start_are_taken_before_the_piece() -> None:
    rules = PieceRules(
        deterministic=False, n_batch=256, n_ubatch=256, align=64, window_checkpoints=True
    )
    p = piece(PromptRead(0, 1000, targets=(40, 60, 300)), rules)
    assert p.window and p.targets_taken == 2 and p.checkpoint_at_start
    assert p.end == 256  # the targets taken no longer cut the piece; 300 is beyond
    # the newest checkpoint is close enough: the targets are settled without one
    near = piece(PromptRead(100, 1000, targets=(150,), last_checkpoint=90), rules)
    assert near.targets_taken == 1 and not near.checkpoint_at_start
    # not for prompts with images: their targets cut pieces
    img = piece(PromptRead(0, 1000, targets=(40,), media={500: 4}), rules)
    assert not img.window and img.targets_taken == 0 and img.end == 40


def test_window_checkpoint_boundaries_sit_at_the_slack() -> None:
    """A target up to WINDOW_SLACK entries past the start is taken at the start; a newest
    checkpoint exactly WINDOW_SLACK before the last target taken is close enough (no new
    checkpoint), one entry further is not."""
    rules = PieceRules(
        deterministic=False, n_batch=256, n_ubatch=256, align=64, window_checkpoints=True
    )
    edge = 100 + WINDOW_SLACK
    assert piece(PromptRead(100, 1000, targets=(edge,)), rules).targets_taken == 1
    beyond = piece(PromptRead(100, 1000, targets=(edge + 1,)), rules)
    assert beyond.targets_taken == 0 and beyond.end == edge + 1
    close = piece(PromptRead(100, 1000, targets=(150,), last_checkpoint=150 - WINDOW_SLACK), rules)
    assert close.targets_taken == 1 and not close.checkpoint_at_start
    far = piece(PromptRead(100, 1000, targets=(150,), last_checkpoint=149 - WINDOW_SLACK), rules)
    assert far.targets_taken == 1 and far.checkpoint_at_start


def test_deterministic_pieces_lie_on_the_grid() -> None:
    rules = PieceRules(
        deterministic=True, n_batch=512, n_ubatch=128, align=64, window_checkpoints=False
    )
    read = PromptRead(0, 1000, targets=(300,), marks=(200,))
    p = piece(read, rules)
    assert p.end == piece_end(0, 1000, 128, 64, stops=[300], marks=[200]) == 128
    assert piece(PromptRead(128, 1000, targets=(300,), marks=(200,)), rules).end == 200
    assert piece(PromptRead(200, 1000, targets=(300,), marks=(200,)), rules).end == 256


def test_the_oldest_reading_request_reads_one_piece() -> None:
    step = plan_step(
        ["g"],
        limit=8,
        lora_of=lambda r: "",
        turn=0,
        reading=[("x", PromptRead(0, 1000)), ("y", PromptRead(0, 10))],
        rules=FAST,
    )
    assert step.decode_groups == (("g",),)
    assert step.prompt == PromptPiece("x", (), 0, 256)
    with pytest.raises(ValueError, match="rules"):
        plan_step([], limit=1, lora_of=lambda r: "", turn=0, reading=[("x", PromptRead(0, 9))])


# --------------------------------------------------------------------------- generation beside a piece


def _mixed(generating: list[str], lora: dict[str, str], read: PromptRead, **kw: object) -> StepPlan:
    return plan_step(
        generating,
        limit=8,
        lora_of=lambda r: lora.get(r, ""),
        turn=0,
        reading=[("x", read)],
        rules=kw.pop("rules", FAST),  # type: ignore[arg-type]
        mix=kw.pop("mix", True),  # type: ignore[arg-type]
    )


def test_generation_rides_in_the_piece_call_and_the_piece_makes_room() -> None:
    step = _mixed(["a", "b", "c"], {}, PromptRead(0, 1000))
    assert step.decode_groups == () and step.with_prompt == ("a", "b", "c")
    # the call stays within n_batch: the piece gives up one token per row
    assert (step.prompt.start, step.prompt.end) == (0, 253)
    # the prompt's short tail is not cut shorter
    assert _mixed(["a"], {}, PromptRead(900, 1000)).prompt.end == 1000


def test_a_group_of_n_batch_rows_leaves_no_room_to_ride() -> None:
    """A group one row short of n_batch rides with a one-token piece; a group of exactly
    n_batch rows would leave the piece no token: it decodes in its own call."""
    small = PieceRules(
        deterministic=False, n_batch=4, n_ubatch=4, align=4, window_checkpoints=False
    )
    rows = ["a", "b", "c", "d"]
    full = _mixed(rows, {}, PromptRead(0, 1000), rules=small)
    assert full.with_prompt == () and full.decode_groups == (tuple(rows),)
    assert (full.prompt.start, full.prompt.end) == (0, 4)
    short = _mixed(rows[:3], {}, PromptRead(0, 1000), rules=small)
    assert short.with_prompt == ("a", "b", "c") and short.decode_groups == ()
    assert (short.prompt.start, short.prompt.end) == (0, 1)


def test_only_the_group_with_the_piece_adapters_rides() -> None:
    lora = {"a": "sql", "x": "sql"}
    step = _mixed(["a", "b"], lora, PromptRead(0, 1000))
    assert step.with_prompt == ("a",) and step.decode_groups == (("b",),)
    assert step.prompt.end == 255
    none = _mixed(["b"], lora, PromptRead(0, 1000))
    assert none.with_prompt == () and none.decode_groups == (("b",),)
    assert none.prompt.end == 256


def test_no_riding_in_deterministic_mode_without_mix_or_before_an_alora() -> None:
    exact = PieceRules(
        deterministic=True, n_batch=256, n_ubatch=256, align=64, window_checkpoints=False
    )
    assert _mixed(["a"], {}, PromptRead(0, 1000), rules=exact).with_prompt == ()
    assert _mixed(["a"], {}, PromptRead(0, 1000), mix=False).with_prompt == ()
    before = _mixed(["a"], {}, PromptRead(0, 1000, lora_start=50))
    assert before.with_prompt == () and not before.prompt.adapters
    # an image-only piece has no call to ride in
    img = _mixed(["a"], {}, PromptRead(10, 30, media={10: 20}))
    assert img.with_prompt == () and img.decode_groups == (("a",),)


# --------------------------------------------------------------------------- prompts read together


def _reading(
    reads: dict[str, PromptRead], lora: dict[str, str] | None = None, **kw: object
) -> StepPlan:
    return plan_step(
        list(kw.pop("generating", [])),  # type: ignore[call-overload]
        limit=8,
        lora_of=lambda r: (lora or {}).get(r, ""),
        turn=0,
        reading=list(reads.items()),
        rules=kw.pop("rules", FAST),  # type: ignore[arg-type]
        mix=kw.pop("mix", True),  # type: ignore[arg-type]
    )


def test_younger_prompts_fill_the_rest_of_the_pieces_call() -> None:
    reads = {"x": PromptRead(0, 20), "y": PromptRead(5, 35), "z": PromptRead(0, 1000)}
    step = _reading(reads)
    assert step.prompt == PromptPiece("x", (), 0, 20)
    # in arrival order, each cut where it would be alone, the last one to the room left
    assert step.more_prompts == (PromptPiece("y", (), 5, 35), PromptPiece("z", (), 0, 206))
    # riding generation rows take their room first: the call stays within n_batch
    ridden = _reading(reads, generating=["g", "h"])
    assert ridden.with_prompt == ("g", "h")
    assert ridden.more_prompts[-1] == PromptPiece("z", (), 0, 204)
    # a full first piece leaves no room
    assert _reading({"z": PromptRead(0, 1000), "x": PromptRead(0, 20)}).more_prompts == ()


def test_a_younger_prompt_keeps_its_own_cuts() -> None:
    # a checkpoint target ends its piece where it would end alone
    step = _reading({"x": PromptRead(0, 20), "y": PromptRead(0, 100, targets=(40,))})
    assert step.more_prompts == (PromptPiece("y", (), 0, 40),)


def test_no_younger_prompt_with_images_other_adapters_or_in_exact_modes() -> None:
    reads = {
        "x": PromptRead(0, 20),
        "img": PromptRead(0, 50, media={0: 10}),  # its image is read first, in calls of its own
        "sql": PromptRead(0, 30),
        "y": PromptRead(0, 30),
    }
    step = _reading(reads, {"sql": "sql"})
    assert step.more_prompts == (PromptPiece("y", (), 0, 30),)
    exact = PieceRules(
        deterministic=True, n_batch=256, n_ubatch=256, align=64, window_checkpoints=False
    )
    assert _reading(reads, rules=exact).more_prompts == ()
    assert _reading(reads, mix=False).more_prompts == ()
    # an aLoRA's prompt before its activation decodes on the base model: it joins
    alora = _reading({"x": PromptRead(0, 20), "a": PromptRead(0, 30, lora_start=25)}, {"a": "al"})
    assert alora.more_prompts == (PromptPiece("a", (), 0, 25, adapters=False),)
