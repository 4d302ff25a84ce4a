"""The unified pool's admission count without a model: a prefix shared by ``seq_cp``
counts once, generation growth is each request's own, per-slot streams share nothing
(where the old count, every request's prompt plus ``max_tokens``, is right).

The same count on real llama.cpp: tests/integration/runtime/test_shared_prefix.py."""

from __future__ import annotations

import pytest

from langchain_llamacpp_local.cache.pool import (
    Footprint,
    admits,
    cells_in_use,
    idle_to_park,
    pool_need,
)
from langchain_llamacpp_local.cache.slot_memory import CacheOptions, SlotMemory
from tests.unit.cache.test_slot_memory import FakeStore, fill

QUESTION, REPLY = 17, 48


def agent(prefix: tuple[int, int], own: int, n_q: int = QUESTION, reply: int = REPLY) -> Footprint:
    """A sub-agent after its prompt was read: the shared prefix ``(group, length)``
    copied from the first one, its question in cells of group ``own``."""
    group, n = prefix
    return Footprint(((0, n, group), (n, n + n_q, own)), n + n_q + reply)


def old_count(feet: list[Footprint]) -> int:
    """Every request's prompt plus max_tokens, as if each held its own copy."""
    return sum(f.final for f in feet)


@pytest.mark.parametrize("n_prefix", [0, 1, 64, 1780, 4000])
def test_a_shared_prefix_counts_once(n_prefix: int) -> None:
    prefix = (100, n_prefix)
    feet = [agent(prefix, 200 + i) for i in range(3)]
    need = pool_need(feet)
    assert need == n_prefix + 3 * (QUESTION + REPLY)
    assert old_count(feet) - need == 2 * n_prefix
    assert admits(need, feet[:2], feet[2]) and not admits(need - 1, feet[:2], feet[2])


def test_the_first_agent_of_a_group_holds_the_prefix_as_its_own_cells() -> None:
    # the first one read the prefix itself: its own group; the others copied it
    first = Footprint(((0, 1780 + QUESTION, 7),), 1780 + QUESTION + REPLY)
    others = [agent((7, 1780), 8 + i) for i in range(2)]
    assert pool_need([first, *others]) == 1780 + 3 * (QUESTION + REPLY)
    # the case: three sub-agents after a 1,780-token system prompt fit 2,048
    assert admits(2048, [first, others[0]], others[1])
    assert not admits(2048, [first, others[0]], others[1], shared=False)


def test_a_request_that_shares_nothing_counts_whole() -> None:
    a = Footprint(((0, 500, 1),), 600)
    b = Footprint(((0, 300, 2),), 350)  # same positions, other cells
    assert pool_need([a, b]) == old_count([a, b]) == 950
    assert admits(950, [a], b) and not admits(949, [a], b)


def test_two_groups_with_different_prefixes() -> None:
    g1 = [agent((10, 1000), 11), agent((10, 1000), 12)]
    g2 = [agent((20, 400), 21), agent((20, 400), 22), agent((20, 400), 23)]
    per_agent = QUESTION + REPLY
    assert pool_need([*g1, *g2]) == 1000 + 400 + 5 * per_agent
    # a prefix is shared within its group only
    assert cells_in_use([g1[0].runs, g2[0].runs]) == 1000 + 400 + 2 * QUESTION


def test_a_partly_read_prompt_grows_into_cells_of_its_own() -> None:
    reading = Footprint(((0, 800, 5),), 2000)  # 800 of a 1,900-token prompt, 100 to generate
    copy = Footprint(((0, 500, 5),), 600)  # copied the first 500 positions
    assert reading.growth == 1200 and copy.growth == 100
    assert pool_need([reading, copy]) == 800 + 1200 + 100


def test_per_slot_streams_share_nothing_and_keep_the_old_count() -> None:
    feet = [agent((100, 1780), 200 + i) for i in range(3)]
    assert pool_need(feet, shared=False) == old_count(feet)
    assert admits(old_count(feet), feet[:2], feet[2], shared=False)
    assert not admits(old_count(feet) - 1, feet[:2], feet[2], shared=False)


def test_idle_conversations_are_parked_only_for_the_cells_they_free() -> None:
    running = [agent((1, 1000), 2)]
    # an idle slot that shares the running prefix frees only its own tail when parked
    sharing = (10, ((0, 1000, 1), (1000, 1100, 3)))
    apart = (11, ((0, 400, 4),))
    need = pool_need(running)
    assert idle_to_park(need + 500, running, [sharing, apart]) == ()
    assert idle_to_park(need + 450, running, [sharing, apart]) == (10,)
    assert idle_to_park(need + 50, running, [sharing, apart]) == (10, 11)
    assert idle_to_park(need - 1, running, [sharing, apart]) is None


def _unified(n_slots: int, n_ctx: int) -> tuple[FakeStore, SlotMemory]:
    store = FakeStore(n_slots=n_slots, n_ctx=n_ctx, n_batch=64)
    store.kv_unified = True
    store.n_ctx_total = n_ctx
    return store, SlotMemory(store, CacheOptions(checkpoint_max_count=0))


def _read(memory: SlotMemory, store: FakeStore, slot, tokens: list[int]) -> None:  # type: ignore[no-untyped-def]
    new = tokens[slot.n_past :]
    store.decode(slot.seq_id, new, slot.n_past)
    memory.record(slot, new, exact=True)


def test_slot_memory_admits_agents_that_share_a_running_prefix() -> None:
    store, memory = _unified(3, 256)
    system = list(range(1000, 1200))  # 200 shared tokens
    prompts = [[*system, 3 + i, 1, 2] for i in range(3)]
    needed = len(prompts[0]) + 10
    slots = []
    for i, tokens in enumerate(prompts):
        busy = {s.seq_id for s in slots}
        room = memory.room(tokens, needed, [memory.footprint(s, needed) for s in slots], busy)
        assert room is not None, f"agent {i} should fit: {200 + 3 * 13} <= 256"
        assert room.n_share == (200 if i else 0)
        slot, n_keep = fill(memory.acquire(tokens, [], busy, cache_prompt=True, room=room))
        assert n_keep == (200 if i else 0)
        _read(memory, store, slot, tokens)
        slots.append(slot)
    memory.check()
    assert cells_in_use(s.runs() for s in slots) == 200 + 3 * 3
    # counted apart (the old count) the third would have had to wait
    assert not memory.fits(needed, 2 * needed)


def test_a_copy_of_the_running_prefix_wins_over_a_private_restore_when_the_pool_is_tight() -> None:
    store, memory = _unified(3, 256)
    system = list(range(1000, 1200))
    a_tokens = [*system, 1]
    a, _ = fill(memory.acquire(a_tokens, [], set(), cache_prompt=True))
    _read(memory, store, a, a_tokens)
    # an idle conversation with the same prefix, parked in host RAM (its cells left)
    b_tokens = [*system, 2, 2]
    b, _ = fill(memory.acquire(b_tokens, [], {a.seq_id}, cache_prompt=True))
    _read(memory, store, b, b_tokens)
    assert memory.park(b)
    memory.reset(b)
    c_tokens = [*system, 2, 2, 5]  # the RAM copy would give it 202 entries of its own
    needed = len(c_tokens) + 20
    running = [memory.footprint(a, len(a_tokens) + 20)]
    room = memory.room(c_tokens, needed, running, {a.seq_id})
    assert room is not None and room.share_from == a.seq_id
    c, n_keep = fill(memory.acquire(c_tokens, [], {a.seq_id}, cache_prompt=True, room=room))
    assert n_keep == 200  # copied from the running slot, not restored (202 private)
    assert cells_in_use([a.runs(), c.runs()]) == 201
    memory.check()
