"""Chunk reuse after a history edit, the decision: llama.cpp server's walk, model-free."""

from __future__ import annotations

import random

import pytest

from langchain_llamacpp_local.cache.reuse import (
    Move,
    ReusePlan,
    memory_blocker,
    pinned_end,
    plan_reuse,
)
from langchain_llamacpp_local.cache.slots import common_prefix_len
from langchain_llamacpp_local.llama.probes import MemoryKind

SYSTEM = list(range(1000, 1010))  # 10 entries every prompt starts with
TURN1 = list(range(100, 140))  # 40
TURN2 = list(range(200, 260))  # 60
TURN3 = list(range(300, 330))  # 30


def reference(cached: list[int], prompt: list[int], n_past: int, n_min: int) -> ReusePlan:
    """llama.cpp's loop, transcribed as it is (server-context.cpp), capped before the
    prompt's last entry as the package needs."""
    if n_min <= 0:
        return ReusePlan((), n_past)
    head_c = head_p = n_past
    end = len(prompt) - 1
    moves = []
    while head_c < len(cached) and head_p < end:
        n = 0
        while (
            head_c + n < len(cached)
            and head_p + n < end
            and cached[head_c + n] == prompt[head_p + n]
        ):
            n += 1
        if n >= n_min:
            moves.append(Move(head_c, head_c + n, head_p - head_c))
            head_c += n
            head_p += n
        else:
            head_c += 1
    return ReusePlan(tuple(moves), head_p)


def apply(cached: list[int], plan: ReusePlan, n_past: int) -> list[int]:
    """What the sequence holds after the moves (positions re-keyed as llama.cpp does)."""
    cells = dict(enumerate(cached))
    for m in plan.moves:
        for pos in [p for p in cells if m.dst_start <= p < m.src_start]:
            del cells[pos]
        moved = {p + m.shift: cells.pop(p) for p in range(m.src_start, m.src_end)}
        cells.update(moved)
    return [cells[p] for p in range(plan.n_past)]


def test_dropping_the_oldest_turn_moves_the_rest() -> None:
    cached = SYSTEM + TURN1 + TURN2 + TURN3
    prompt = SYSTEM + TURN2 + TURN3 + [7]
    plan = plan_reuse(cached, prompt, 10, 16)
    assert plan.moves == (Move(50, 140, -40),)
    assert plan.n_past == 100 and plan.moved == 90
    assert apply(cached, plan, 10) == prompt[:100]


def test_a_chunk_below_n_is_not_moved() -> None:
    cached = SYSTEM + TURN1 + TURN3[:15] + TURN2
    prompt = SYSTEM + TURN3[:15] + [5] + TURN2 + [7]
    plan = plan_reuse(cached, prompt, 10, 16)
    assert plan.moves == () and plan.n_past == 10  # 15 < 16: the walk never reaches TURN2
    assert plan_reuse(cached, prompt, 10, 15).moves == (Move(50, 65, -40),)


def test_several_chunks() -> None:
    summary = [9] * 5
    cached = SYSTEM + TURN1 + TURN2 + [1, 2, 3] + TURN3
    prompt = SYSTEM + summary + TURN2 + TURN3 + [7]
    plan = plan_reuse(cached, prompt, 10, 20)
    assert plan.n_past == 10  # the summary is new: the walk meets it first, nothing matches
    prompt = SYSTEM + TURN2 + TURN3 + [7]
    plan = plan_reuse(cached, prompt, 10, 20)
    assert plan.moves == (Move(50, 110, -40), Move(113, 143, -43))
    assert apply(cached, plan, 10) == prompt[: plan.n_past]


def test_a_moved_chunk_followed_by_new_text_leaves_it_to_read() -> None:
    cached = SYSTEM + TURN1 + TURN2
    prompt = SYSTEM + TURN2 + [42, 43, 44]
    plan = plan_reuse(cached, prompt, 10, 16)
    assert plan.moves == (Move(50, 110, -40),)
    assert plan.n_past == 70  # the new text is read


def test_never_covers_the_last_prompt_entry() -> None:
    cached = SYSTEM + TURN1 + TURN2
    prompt = SYSTEM + TURN2
    plan = plan_reuse(cached, prompt, 10, 16)
    assert plan.n_past == len(prompt) - 1


def test_zero_is_off() -> None:
    cached = SYSTEM + TURN1 + TURN2
    prompt = SYSTEM + TURN2 + [7]
    assert plan_reuse(cached, prompt, 10, 0) == ReusePlan((), 10)
    assert plan_reuse(cached, prompt, 10, -3) == ReusePlan((), 10)


def test_media_stops_the_walk_and_is_reported() -> None:
    image = [("media", "d1", k) for k in range(8)]
    cached = SYSTEM + TURN1 + TURN2 + image + TURN3
    prompt = SYSTEM + TURN2 + image + TURN3 + [7]
    plan = plan_reuse(cached, prompt, 10, 16, media=[(70, 8)])
    assert plan.moves == (Move(50, 110, -40),)  # the text before the image only
    assert plan.n_past == 70 and plan.media_blocked
    # an image right after the prefix: nothing moves, and the report says why
    prompt = SYSTEM + image + TURN3 + [7]
    cached = SYSTEM + TURN1 + image + TURN3
    plan = plan_reuse(cached, prompt, 10, 4, media=[(10, 8)])
    assert plan.moves == () and plan.media_blocked


def test_pinned_cells_are_never_moved() -> None:
    cached = SYSTEM + TURN1 + TURN2
    prompt = SYSTEM + TURN2 + [7]
    assert plan_reuse(cached, prompt, 10, 16, pinned=30).moves == (Move(50, 110, -40),)
    # the chunk starts among the pinned cells: it stays, and the prompt is read from 10
    assert plan_reuse(cached, prompt, 10, 16, pinned=60) == ReusePlan((), 10)


def test_pinned_end_from_runs() -> None:
    own = ((0, 30, 1), (30, 90, 5))
    assert pinned_end(own, []) == 0
    assert pinned_end(own, [((0, 30, 1),)]) == 30
    assert pinned_end(own, [((0, 30, 1), (30, 50, 5))]) == 50
    assert pinned_end(own, [((0, 40, 7),)]) == 0  # other cells at the same positions


@pytest.mark.parametrize("seed", range(40))
def test_agrees_with_llama_cpp_loop(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.randint(2, 6)
    cached = [rng.randrange(vocab) for _ in range(rng.randint(0, 120))]
    cut = rng.randint(0, len(cached))
    prompt = cached[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
    n_past = common_prefix_len(cached, prompt)
    n_past = min(n_past, len(prompt) - 1)
    n_min = rng.randint(1, 8)
    plan = plan_reuse(cached, prompt, n_past, n_min)
    assert plan == reference(cached, prompt, n_past, n_min)
    assert apply(cached, plan, n_past) == prompt[: plan.n_past]


def test_hostile_repetition_stays_linear() -> None:
    n_min = 256
    cached = ([1] * (n_min - 1) + [2]) * 64  # every run falls one short
    prompt = [1] * (n_min + 10)
    # every cached entry starts a candidate that falls one short: nothing moves
    plan = plan_reuse(cached, prompt, 0, n_min)
    assert plan.moves == ()


@pytest.mark.parametrize(
    ("kind", "flags", "reason"),
    [
        (MemoryKind.PARTIAL, {}, None),
        (MemoryKind.PARTIAL, {"deterministic": True}, "deterministic"),
        (MemoryKind.FULL_ONLY, {"is_recurrent": True}, "recurrent"),
        (MemoryKind.FULL_ONLY, {"is_hybrid": True}, "hybrid"),
        (MemoryKind.SWA, {}, "sliding_window"),
        (MemoryKind.PARTIAL, {"mrope": True, "can_shift": False}, "mrope"),
        (MemoryKind.PARTIAL, {"can_shift": False}, "cannot_shift"),
    ],
)
def test_memory_blocker(kind: MemoryKind, flags: dict[str, bool], reason: str | None) -> None:
    args = {"is_recurrent": False, "is_hybrid": False, "mrope": False, "can_shift": True}
    args["deterministic"] = False
    args.update(flags)
    assert memory_blocker(memory_kind=kind, **args) == reason
