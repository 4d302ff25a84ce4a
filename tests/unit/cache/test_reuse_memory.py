"""Chunk reuse applied by SlotMemory on the pure-Python store: moves, bookkeeping, the
slot choice, the pool count, and where it does not apply. The same on real llama.cpp:
tests/integration/cache/test_cache_reuse.py."""

from __future__ import annotations

from langchain_llamacpp_local.cache.pool import cells_in_use
from langchain_llamacpp_local.llama.probes import MemoryKind
from tests.unit.cache.test_slot_memory import FakeStore, _generate, _held, _memory, _read

SYSTEM = list(range(1000, 1010))
TURN1 = list(range(100, 140))
TURN2 = list(range(200, 260))
REPLY = [7, 8, 9]


def _conversation(memory, store, owner="a", busy=frozenset()):  # type: ignore[no-untyped-def]
    prompt = SYSTEM + TURN1 + TURN2
    got = memory.acquire(prompt, [], set(busy), cache_prompt=True, reuse=16, owner=owner)
    _read(memory, store, got.slot, prompt, len(prompt))
    _generate(memory, store, got.slot, REPLY)
    return got.slot


def test_dropping_the_oldest_turn_moves_the_rest() -> None:
    store = FakeStore(n_slots=1)
    memory = _memory(store)
    slot = _conversation(memory, store)
    edited = SYSTEM + TURN2 + REPLY + [5, 6]
    got = memory.acquire(edited, [], set(), cache_prompt=True, reuse=16, owner="a")
    assert got.slot is slot and got.moved == 63 and got.reuse_off is None
    assert got.n_keep == 73 and got.mismatch_at == 10
    assert _held(store, slot) == edited[:73] == slot.entries
    memory.check()
    decoded = store.decoded
    _read(memory, store, slot, edited, len(edited))
    assert store.decoded - decoded == 2  # only the new tokens were read
    memory.check()


def test_off_by_default_and_below_n() -> None:
    store = FakeStore(n_slots=1)
    memory = _memory(store)
    _conversation(memory, store)
    edited = SYSTEM + TURN2 + REPLY + [5]
    got = memory.acquire(edited, [], set(), cache_prompt=True, owner="a")
    assert got.moved == 0 and got.n_keep == 10 and got.reuse_off is None
    memory = _memory(store := FakeStore(n_slots=1))
    _conversation(memory, store)
    got = memory.acquire(edited, [], set(), cache_prompt=True, reuse=100, owner="a")
    assert got.moved == 0 and got.n_keep == 10 and got.reuse_off is None


def test_only_the_same_conversation_is_moved() -> None:
    store = FakeStore(n_slots=1)
    memory = _memory(store)
    _conversation(memory, store, owner="a")
    edited = SYSTEM + TURN2 + REPLY + [5]
    got = memory.acquire(edited, [], set(), cache_prompt=True, reuse=16, owner="b")
    assert got.moved == 0 and got.n_keep == 10 and got.reuse_off == "other_conversation"
    memory.check()


def test_the_owned_slot_wins_over_a_fork() -> None:
    # with a free empty slot, a prompt leaving a conversation early forks (copies the
    # prefix); moving the chunks keeps more, so the conversation's own slot is taken
    store = FakeStore(n_slots=3)
    memory = _memory(store)
    slot = _conversation(memory, store)
    edited = SYSTEM + TURN2 + REPLY + [5]
    got = memory.acquire(edited, [], set(), cache_prompt=True, reuse=16, owner="a")
    assert got.slot is slot and got.moved == 63
    memory.check()


def test_memory_that_cannot_shift_says_why() -> None:
    for kind, reason in ((MemoryKind.FULL_ONLY, "recurrent"), (MemoryKind.SWA, "sliding_window")):
        store = FakeStore(kind, n_slots=1, n_swa=4096)
        memory = _memory(store)
        _conversation(memory, store)
        edited = SYSTEM + TURN2 + REPLY + [5]
        got = memory.acquire(edited, [], set(), cache_prompt=True, reuse=16, owner="a")
        assert got.moved == 0 and got.reuse_off == reason
        assert ("shift", 0) not in store.events
        memory.check()
    store = FakeStore(n_slots=1, deterministic=True)
    memory = _memory(store)
    _conversation(memory, store)
    got = memory.acquire(SYSTEM + TURN2 + [5], [], set(), cache_prompt=True, reuse=16, owner="a")
    assert got.moved == 0 and got.reuse_off == "deterministic"


def test_media_chunks_stay_and_say_why() -> None:
    store = FakeStore(n_slots=1)
    memory = _memory(store)
    image = [("media", "d", k) for k in range(4)]
    prompt = SYSTEM + TURN1 + image + TURN2
    got = memory.acquire(prompt, [(50, 4)], set(), cache_prompt=True, reuse=2, owner="a")
    store.decode(0, prompt, 0)  # the fake holds any entry
    memory.record(got.slot, prompt, exact=True)
    edited = SYSTEM + image + TURN2 + [5]
    got = memory.acquire(edited, [(10, 4)], set(), cache_prompt=True, reuse=2, owner="a")
    assert got.moved == 0 and got.n_keep == 10 and got.reuse_off == "media"
    memory.check()


def _forked(share: int):  # type: ignore[no-untyped-def]
    """Slot a holds the conversation; slot b copied its first ``share`` entries (the
    same cells in a unified pool) and read 20 of its own."""
    store = FakeStore(n_slots=2)
    store.kv_unified = True
    memory = _memory(store)
    a = _conversation(memory, store)
    b_prompt = (SYSTEM + TURN1 + TURN2)[:share] + [77] * 20
    got = memory.acquire(b_prompt, [], {a.seq_id}, cache_prompt=True, reuse=16, owner="b")
    b = got.slot
    assert b is not a and got.n_keep == share
    _read(memory, store, b, b_prompt, len(b_prompt))
    return store, memory, a, b


def test_cells_shared_with_another_slot_never_move() -> None:
    store, memory, a, b = _forked(80)  # b shares TURN2's first 30 cells
    edited = SYSTEM + TURN2 + REPLY + [5]
    got = memory.acquire(edited, [], {b.seq_id}, cache_prompt=True, reuse=16, owner="a")
    assert got.slot is a and got.moved == 0 and got.n_keep == 10
    assert ("shift", a.seq_id) not in store.events
    memory.check()


def test_moved_cells_count_once_in_the_pool() -> None:
    store, memory, a, b = _forked(50)  # b shares SYSTEM + TURN1 only
    edited = SYSTEM + TURN2 + REPLY + [5]
    got = memory.acquire(edited, [], {b.seq_id}, cache_prompt=True, reuse=16, owner="a")
    assert got.slot is a and got.moved == 63
    assert _held(store, a) == edited[:73]
    memory.check()
    _read(memory, store, a, edited, len(edited))
    # a: 10 cells shared with b, 63 moved and 1 read, its own; b: the 40 TURN1 cells
    # (now its alone) beside the 10 shared, and 20 of its own
    assert cells_in_use([a.runs(), b.runs()]) == 10 + 63 + 1 + 40 + 20


def test_moved_entries_are_kept_only_by_their_owner_asking_for_reuse() -> None:
    """Moved entries attended to the old history: a request that did not ask for reuse,
    another conversation's, and a parked copy stop before them."""
    store = FakeStore(n_slots=1)
    memory = _memory(store)
    slot = _conversation(memory, store)
    edited = SYSTEM + TURN2 + REPLY + [5]
    got = memory.acquire(edited, [], set(), cache_prompt=True, reuse=16, owner="a")
    assert got.moved == 63 and slot.moved_at == 10
    _read(memory, store, slot, edited, len(edited))
    nxt = [*edited, 6]
    # the owner's next turn keeps everything
    assert memory._states(nxt, "a", 16)[0].reusable == len(edited)
    # reuse off, or another conversation: only what was never moved
    assert memory._states(nxt, "a", 0)[0].reusable == 10
    assert memory._states(nxt, "b", 16)[0].reusable == 10
    got = memory.acquire(nxt, [], set(), cache_prompt=True, owner="a")  # reuse off now
    assert got.n_keep == 10 and slot.moved_at is None
    memory.check()


def test_a_parked_copy_never_offers_moved_entries() -> None:
    store = FakeStore(n_slots=1)
    memory = _memory(store)
    slot = _conversation(memory, store)
    edited = SYSTEM + TURN2 + REPLY + [5]
    memory.acquire(edited, [], set(), cache_prompt=True, reuse=16, owner="a")
    _read(memory, store, slot, edited, len(edited))
    assert memory.park(slot)
    cached, _ = memory.ram.best(edited)
    assert cached is not None and cached.exact == 10
