"""The slot decision without a model: plain numbers in, a plan out.

The mechanism that applies the plans (``cache.slot_memory.SlotMemory``) is tested on
real llama.cpp in ``tests/integration/cache/test_slots.py`` and ``test_checkpoints.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from langchain_llamacpp_local.cache.slot_plan import (
    COMPACT_ABOVE,
    COMPACT_MAX_CELLS,
    DISK_MIN_ENTRIES,
    FillPlan,
    SlotChoice,
    SlotState,
    choose_slot,
    disk_beats,
    plan_compaction,
    plan_fill,
    plan_solo_parking,
    usable_cached,
)


def slot(seq_id: int, n_past: int = 0, last_used: int = 0, reusable: int = 0) -> SlotState:
    return SlotState(seq_id, n_past, last_used, reusable)


# --------------------------------------------------------------------------- choice


def test_the_slot_sharing_the_longest_prefix_wins() -> None:
    slots = [slot(0, 100, 1, 10), slot(1, 100, 2, 90), slot(2, 100, 3, 50)]
    assert choose_slot(slots, set(), 120, can_copy=True) == SlotChoice(1, park_first=False)


def test_ties_go_to_the_least_recently_used() -> None:
    slots = [slot(0, 40, 5, 40), slot(1, 40, 2, 40)]
    assert choose_slot(slots, set(), 50, can_copy=False).target == 1


def test_busy_slots_are_never_chosen() -> None:
    slots = [slot(0, 100, 1, 90), slot(1, 0, 0, 0)]
    assert choose_slot(slots, {0}, 100, can_copy=True).target == 1
    with pytest.raises(ValueError, match="no free slot"):
        choose_slot(slots, {0, 1}, 100, can_copy=True)


def test_a_prefix_shorter_than_the_slot_forks_into_an_empty_slot() -> None:
    """A sub-agent sharing only the system prompt must not cut the main conversation
    short: it takes an empty slot (and the prefix is copied there by the fill)."""
    slots = [slot(0, 500, 1, 30), slot(1)]
    assert choose_slot(slots, set(), 60, can_copy=True) == SlotChoice(1, park_first=False)


def test_a_fork_that_does_not_fit_takes_the_match_in_place_when_its_tail_is_shorter() -> None:
    """Beside running requests a unified pool may not hold the matched conversation
    whole beside the fork's copy: the request then takes that slot itself and cuts its
    tail (no park and restore of the whole state), unless the tail is the longer part."""
    slots = [slot(0, 400, 1, 390), slot(1), slot(2, 50, 2, 0)]
    assert choose_slot(slots, {2}, 410, can_copy=True, fork_fits=False) == SlotChoice(
        0, park_first=False, in_place=True
    )
    assert choose_slot(slots, {2}, 410, can_copy=True) == SlotChoice(1, park_first=False)
    long_tail = [slot(0, 900, 1, 390), slot(1), slot(2, 50, 2, 0)]
    assert choose_slot(long_tail, {2}, 410, can_copy=True, fork_fits=False) == SlotChoice(
        1, park_first=False
    )


def test_without_copies_the_similar_slot_is_reused_and_parked_first() -> None:
    """Recurrent memory cannot copy a prefix: the similar slot is taken, and as most of
    it will be trimmed its conversation is parked in host RAM first."""
    slots = [slot(0, 500, 1, 30), slot(1)]
    assert choose_slot(slots, set(), 60, can_copy=False) == SlotChoice(0, park_first=True)


def test_similarity_below_one_tenth_takes_an_empty_or_lru_slot() -> None:
    slots = [slot(0, 20, 9, 5), slot(1, 300, 1, 0), slot(2, 300, 4, 0)]
    assert choose_slot(slots, set(), 200, can_copy=False).target == 1  # LRU
    slots.append(slot(3))
    assert choose_slot(slots, set(), 200, can_copy=False).target == 3  # empty first


def test_the_only_free_slot_is_taken_however_little_it_shares() -> None:
    slots = [slot(0, 300, 1, 2), slot(1, 300, 2, 280)]
    assert choose_slot(slots, {1}, 400, can_copy=False) == SlotChoice(0, park_first=True)


@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 9), st.integers(0, 50)), min_size=1, max_size=6
    ),
    st.integers(1, 60),
    st.booleans(),
    st.data(),
)
def test_the_choice_is_always_a_free_slot(
    raw: list[tuple[int, int, int]], n_tokens: int, can_copy: bool, data: st.DataObject
) -> None:
    slots = [slot(i, n, lu, min(r, n)) for i, (n, lu, r) in enumerate(raw)]
    busy = set(data.draw(st.sets(st.integers(0, len(slots) - 1), max_size=len(slots) - 1)))
    choice = choose_slot(slots, busy, n_tokens, can_copy=can_copy)
    assert choice.target not in busy
    chosen = slots[choice.target]
    assert not choice.park_first or chosen.reusable * 2 < chosen.n_past


# --------------------------------------------------------------------------- fill


def test_a_parked_conversation_that_gives_more_is_restored() -> None:
    slots = [slot(0, 100, 1, 10), slot(1, 50, 2, 40)]
    assert plan_fill(slots, 0, 80, can_copy=True) == FillPlan("restore")


def test_a_longer_prefix_in_another_slot_is_copied() -> None:
    slots = [slot(0, 500, 1, 300), slot(1)]
    assert plan_fill(slots, 1, 0, can_copy=True) == FillPlan("copy", source=0, n_copy=300)
    # a cached conversation giving less than the copy loses to it
    assert plan_fill(slots, 1, 250, can_copy=True).action == "copy"


def test_no_copy_between_sequences_of_recurrent_memory() -> None:
    slots = [slot(0, 500, 1, 300), slot(1)]
    assert plan_fill(slots, 1, 0, can_copy=False) == FillPlan("keep")


def test_a_slot_about_to_lose_most_of_its_conversation_is_parked() -> None:
    slots = [slot(0, 400, 1, 100)]
    assert plan_fill(slots, 0, 0, can_copy=True) == FillPlan("park")
    slots = [slot(0, 400, 1, 300)]
    assert plan_fill(slots, 0, 0, can_copy=True) == FillPlan("keep")


# --------------------------------------------------------------------------- cached entries


def test_usable_cached_entries() -> None:
    assert usable_cached(90, 200, 100, 100) == 90
    assert usable_cached(100, 200, 100, 100) == 99  # the last prompt token is decoded again
    assert usable_cached(90, 64, 100, 100) == 64  # only its exact part in deterministic mode
    assert usable_cached(20, 200, 100, 100) == 0  # most of it would be trimmed


def test_a_disk_record_must_beat_what_is_at_hand_and_be_long_enough() -> None:
    assert disk_beats(DISK_MIN_ENTRIES, 0)
    assert not disk_beats(DISK_MIN_ENTRIES - 1, 0)
    assert not disk_beats(100, 100)
    assert disk_beats(101, 100)


# --------------------------------------------------------------------------- solo parking


def test_a_request_decoding_alone_parks_every_idle_conversation() -> None:
    slots = [slot(0, 300), slot(1, 0), slot(2, 120), slot(3, 40)]
    assert plan_solo_parking(slots, set(), 1, waiting=0, attention=True) == (0, 2, 3)


def test_the_target_keeps_its_own_conversation() -> None:
    slots = [slot(0, 300), slot(1, 200)]
    assert plan_solo_parking(slots, set(), 0, waiting=0, attention=True) == (1,)


def test_nothing_is_parked_beside_running_or_waiting_requests() -> None:
    slots = [slot(0, 300), slot(1, 200), slot(2, 100)]
    assert plan_solo_parking(slots, {2}, 0, waiting=0, attention=True) == ()
    assert plan_solo_parking(slots, set(), 0, waiting=1, attention=True) == ()
    # the target itself counts as nobody else
    assert plan_solo_parking(slots, {0}, 0, waiting=0, attention=True) == (1, 2)


def test_recurrent_memory_has_no_span_to_shorten() -> None:
    assert plan_solo_parking([slot(0, 10), slot(1, 10)], set(), 0, waiting=0, attention=False) == ()


def test_the_pool_is_rewritten_only_for_a_long_prompt_a_cheap_copy_and_room() -> None:
    """Before a long prompt is read beside running requests, the pool is rewritten from
    its first cell (a parked conversation may have left a hole under them): only when
    the copy is cheap and everything still fits with shared prefixes apart."""
    base = dict(n_read=COMPACT_ABOVE, copied=COMPACT_MAX_CELLS, fits_apart=True)
    assert plan_compaction(**base)
    assert not plan_compaction(**{**base, "n_read": COMPACT_ABOVE - 1})
    assert not plan_compaction(**{**base, "copied": COMPACT_MAX_CELLS + 1})
    assert not plan_compaction(**{**base, "fits_apart": False})
