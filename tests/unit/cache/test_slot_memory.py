"""SlotMemory without a model: prefix reuse, host-RAM parking, checkpoints and draft
rollback on a pure-Python :class:`~langchain_llamacpp_local.cache.store.SequenceStore`.

The store keeps the token each sequence holds at each position and follows
llama.cpp's rules for the memory kinds: attention KV trims any suffix; a recurrent
state is one summary of every token so far that only goes away whole
(``llama_memory_recurrent::seq_rm``); a sliding-window cache forgets positions that
left its window at once (llama.cpp forgets them when their cells are needed, and a
saved state never holds them: the fake takes the earliest moment). Its saved states are its contents, so what a restore gives back is
checked, not assumed. The same bookkeeping on real llama.cpp: tests/integration/cache/
test_slots.py, test_checkpoints.py and tests/integration/runtime/test_speculative.py.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from langchain_llamacpp_local.cache.slot_memory import Acquired, CacheOptions, SlotMemory
from langchain_llamacpp_local.cache.slots import Slot
from langchain_llamacpp_local.cache.store import SequenceStore
from langchain_llamacpp_local.errors import DecodeError
from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.probes import MemoryKind

_END = 2**31 - 1


def fill(got: Acquired) -> tuple[Slot, int]:
    """The slot :meth:`SlotMemory.acquire` gave and the entries it keeps."""
    return got.slot, got.n_keep


class FakeStore:
    """The positions each sequence holds and their tokens (see module docstring)."""

    def __init__(
        self,
        kind: MemoryKind = MemoryKind.PARTIAL,
        *,
        n_slots: int = 2,
        n_ctx: int = 512,
        n_batch: int = 64,
        n_swa: int = 0,
        deterministic: bool = False,
    ) -> None:
        self.config = LoadConfig(
            model_path="fake.gguf", n_slots=n_slots, deterministic=deterministic
        )
        self.memory_kind = kind
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.n_ctx_total = n_ctx * n_slots
        self.n_batch = self.n_ubatch = n_batch
        self.n_swa = n_swa
        self.kv_unified = False
        self.is_recurrent = kind is MemoryKind.FULL_ONLY
        self.is_hybrid = False
        self.can_shift = kind is not MemoryKind.SWA
        self.mrope = False
        self.cells: list[dict[int, int]] = [{} for _ in range(n_slots)]
        self.refuse_states = False  # state_set answers False (a state llama.cpp rejects)
        self.events: list[tuple[str, int]] = []  # ("remove" | "load", seq): their order
        self.decoded = 0  # rows decoded

    # -- decoding (what the engine's decode calls do to the memory)

    def decode(self, seq: int, tokens: Sequence[int], start: int) -> None:
        """Append ``tokens`` at ``start``: llama.cpp requires it to follow the last position."""
        if start != self.seq_pos_max(seq) + 1:
            raise DecodeError(f"seq {seq}: position {start} does not follow its last one")
        cells = self.cells[seq]
        for i, tok in enumerate(tokens):
            cells[start + i] = tok
        self.decoded += len(tokens)
        if self.memory_kind is MemoryKind.SWA:  # positions out of the window are gone
            last = start + len(tokens) - 1
            for pos in [p for p in cells if p <= last - self.n_swa]:
                del cells[pos]

    def tokens(self, seq: int) -> list[int]:
        """What the sequence holds, by position (recurrent: what its state summarises)."""
        return [self.cells[seq][p] for p in sorted(self.cells[seq])]

    # -- SequenceStore

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        p0 = max(p0, 0)
        p1 = _END if p1 < 0 else p1
        cells = self.cells[seq_id]
        if self.memory_kind is MemoryKind.FULL_ONLY and cells:
            last = max(cells)
            if 0 < p0 < last or 0 < p1 <= last:  # a part of the state: impossible
                return False
            if p0 <= last < p1:
                cells.clear()
            return True
        gone = [p for p in cells if p0 <= p < p1]
        for pos in gone:
            del cells[pos]
        if gone:
            self.events.append(("remove", seq_id))
        return True

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        p0 = max(p0, 0)
        p1 = _END if p1 < 0 else p1
        self.cells[dst].update({p: t for p, t in self.cells[src].items() if p0 <= p < p1})

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """llama.cpp's rule: positions in [p0, p1) move by ``delta``; one landing below 0
        is removed. A cell already at the new position would be two in one: refused."""
        p0 = max(p0, 0)
        p1 = _END if p1 < 0 else p1
        cells = self.cells[seq_id]
        moving = {p: t for p, t in cells.items() if p0 <= p < p1}
        for p in moving:
            del cells[p]
        for p, t in moving.items():
            if p + delta >= 0:
                if p + delta in cells:
                    raise AssertionError(f"seq {seq_id}: two cells at position {p + delta}")
                cells[p + delta] = t
        self.events.append(("shift", seq_id))

    def seq_pos_min(self, seq_id: int) -> int:
        cells = self.cells[seq_id]
        if not cells:
            return -1
        # a recurrent state sits at its last position only
        return max(cells) if self.memory_kind is MemoryKind.FULL_ONLY else min(cells)

    def seq_pos_max(self, seq_id: int) -> int:
        return max(self.cells[seq_id], default=-1)

    def state_size(self, seq_id: int, flags: int = 0) -> int:
        return len(self.state_get(seq_id, flags))

    def state_get(self, seq_id: int, flags: int = 0) -> bytes:
        return json.dumps(sorted(self.cells[seq_id].items())).encode()

    def state_set(self, data: bytes, seq_id: int, flags: int = 0) -> bool:
        if self.refuse_states:
            return False
        self.cells[seq_id] = {int(p): int(t) for p, t in json.loads(data)}
        self.events.append(("load", seq_id))
        return True

    def wipe_memory(self, drop: set[int], *, zero: bool = True) -> frozenset[int]:
        for seq in drop:
            self.cells[seq].clear()
        if self.refuse_states:  # nothing could be put back
            lost = {seq for seq, cells in enumerate(self.cells) if cells}
            for seq in lost:
                self.cells[seq].clear()
            return frozenset(lost)
        return frozenset()


def _memory(store: FakeStore, **cache: int) -> SlotMemory:
    return SlotMemory(store, CacheOptions(**cache))  # type: ignore[arg-type]


def _read(memory: SlotMemory, store: FakeStore, slot: Slot, tokens: list[int], end: int) -> None:
    """Decode ``tokens[n_past:end]`` into ``slot`` as a prompt piece (the worker's apply)."""
    start = slot.n_past
    store.decode(slot.seq_id, tokens[start:end], start)
    memory.record(slot, tokens[start:end], exact=True)


def _generate(memory: SlotMemory, store: FakeStore, slot: Slot, tokens: list[int]) -> None:
    for tok in tokens:
        store.decode(slot.seq_id, [tok], slot.n_past)
        memory.record(slot, [tok], exact=False)


def _held(store: FakeStore, slot: Slot) -> list[int]:
    return store.tokens(slot.seq_id)


PROMPT = list(range(100, 160))


def _count_state_reads(store: FakeStore, *, sizes_too: bool = True) -> list[int]:
    """The sequences whose whole state is read from now on (a park copies it out of
    llama.cpp); ``sizes_too=False``: a size probe (``state_size``) is not counted."""
    reads: list[int] = []
    state_get = store.state_get

    def counted(seq_id: int, flags: int = 0) -> bytes:
        reads.append(seq_id)
        return state_get(seq_id, flags)

    store.state_get = counted  # type: ignore[method-assign]
    if not sizes_too:
        store.state_size = lambda seq_id, flags=0: len(state_get(seq_id, flags))  # type: ignore[method-assign]
    return reads


def test_an_edited_prompt_reuses_the_cached_prefix() -> None:
    store = FakeStore(n_slots=1)
    memory = _memory(store)
    slot, n_keep = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    assert n_keep == 0
    _read(memory, store, slot, PROMPT, len(PROMPT))
    _generate(memory, store, slot, [7, 8, 9])
    memory.check()

    edited = PROMPT[:40] + [1, 2, 3] + PROMPT[40:]
    again, n_keep = fill(memory.acquire(edited, [], set(), cache_prompt=True))
    assert again is slot and n_keep == 40  # the same slot, trimmed to the common prefix
    assert _held(store, slot) == PROMPT[:40] and slot.entries == PROMPT[:40]
    memory.check()

    # cache_prompt=False: nothing is reused
    fresh, n_keep = fill(memory.acquire(edited, [], set(), cache_prompt=False))
    assert n_keep == 0 and _held(store, fresh) == []


def test_a_free_slot_copies_a_prefix_and_the_conversation_stays() -> None:
    store = FakeStore(n_slots=2)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    _generate(memory, store, slot, [7, 8, 9])
    edited = PROMPT[:40] + [1, 2, 3] + PROMPT[40:]
    other, n_keep = fill(memory.acquire(edited, [], set(), cache_prompt=True))
    assert other is not slot and n_keep == 40
    assert _held(store, other) == PROMPT[:40] and other.entries == PROMPT[:40]
    assert _held(store, slot) == [*PROMPT, 7, 8, 9]
    memory.check()


def test_the_slot_holding_the_longest_prefix_is_taken_and_busy_ones_are_not() -> None:
    store = FakeStore(n_slots=2)
    memory = _memory(store)
    a, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, a, PROMPT, len(PROMPT))
    other = [5] * 30
    b, _ = fill(memory.acquire(other, [], {a.seq_id}, cache_prompt=True))
    assert b is not a
    _read(memory, store, b, other, len(other))
    slot, n_keep = fill(memory.acquire(PROMPT + [1], [], set(), cache_prompt=True))
    assert slot is a and n_keep == len(PROMPT)
    memory.check()


def test_a_conversation_is_parked_in_host_ram_and_restored() -> None:
    store = FakeStore(n_slots=1)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    _generate(memory, store, slot, [7, 8])
    conversation = PROMPT + [7, 8]

    other = [9] * 20
    slot, n_keep = fill(memory.acquire(other, [], set(), cache_prompt=True))  # the only slot
    assert n_keep == 0 and _held(store, slot) == [] and len(memory.ram.items) == 1
    _read(memory, store, slot, other, len(other))

    follow_up = [*conversation, 11, 12]
    slot, n_keep = fill(memory.acquire(follow_up, [], set(), cache_prompt=True))
    assert n_keep == len(conversation)  # restored from RAM, not decoded again
    assert _held(store, slot) == conversation and slot.entries == conversation
    # the conversation it replaced went to RAM in its turn
    assert [list(c.entries) for c in memory.ram.items] == [other]
    memory.check()


def test_a_displaced_conversation_is_copied_out_once() -> None:
    """A request that keeps less than half of the only slot's conversation parks it
    before taking the slot: one copy of its state (each one a whole-state read from
    llama.cpp), and the conversation comes back from RAM whole."""
    store = FakeStore(n_slots=1)
    reads = _count_state_reads(store, sizes_too=False)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    _generate(memory, store, slot, [7, 8])
    conversation = PROMPT + [7, 8]

    other = PROMPT[:10] + [9] * 20  # shares 10 of the 62 entries: park, then trim
    slot, n_keep = fill(memory.acquire(other, [], set(), cache_prompt=True))
    assert n_keep == 10 and reads == [0]
    assert [list(c.entries) for c in memory.ram.items] == [conversation]
    _read(memory, store, slot, other, len(other))
    slot, n_keep = fill(memory.acquire([*conversation, 11], [], set(), cache_prompt=True))
    assert n_keep == len(conversation) and _held(store, slot) == conversation
    memory.check()


@pytest.mark.parametrize("ram", [True, False])
def test_idle_conversations_leave_the_unified_pool_while_one_decodes_alone(ram: bool) -> None:
    store = FakeStore(n_slots=4)  # a slot each: nothing is pushed out
    store.kv_unified = True
    memory = _memory(store, **({} if ram else {"prompt_cache_bytes": 0}))
    room = (100, 0)
    a, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True, room=room))
    _read(memory, store, a, PROMPT, len(PROMPT))
    b_tokens = [5] * 30
    b, _ = fill(memory.acquire(b_tokens, [], set(), cache_prompt=True, room=room))
    assert b is not a
    assert _held(store, a) == ([] if ram else PROMPT)  # parked while b decodes alone
    _read(memory, store, b, b_tokens, len(b_tokens))
    # beside a running request, or with another waiting, nothing is parked
    c_tokens = [6] * 20
    c, _ = fill(memory.acquire(c_tokens, [], {b.seq_id}, cache_prompt=True, room=room))
    _read(memory, store, c, c_tokens, len(c_tokens))
    d_tokens = [7] * 20
    d, _ = fill(memory.acquire(d_tokens, [], set(), cache_prompt=True, room=room, waiting=1))
    assert _held(store, b) == b_tokens and _held(store, c) == c_tokens
    _read(memory, store, d, d_tokens, len(d_tokens))
    memory.check()

    # the first conversation comes back: restored (or still in its slot), not decoded
    back, n_keep = fill(memory.acquire([*PROMPT, 1], [], set(), cache_prompt=True, room=room))
    assert n_keep == len(PROMPT) and _held(store, back) == PROMPT
    others = [_held(store, s) for s in memory.slots if s is not back]
    assert all(h == [] for h in others) if ram else sorted(map(len, others)) == [20, 20, 30]
    memory.check()


def _stream_beside_idle(
    state: list[int],
) -> tuple[FakeStore, SlotMemory, Slot, Slot, list[int]]:
    """A 768-position unified pool: a 100-token stream running and ``state`` read into
    an idle slot; the whole-state reads counted from then on."""
    store = FakeStore(n_slots=3, n_ctx=256)
    store.kv_unified = True
    memory = _memory(store)
    stream_tokens = [5] * 100
    stream, _ = fill(memory.acquire(stream_tokens, [], set(), cache_prompt=True))
    _read(memory, store, stream, stream_tokens, len(stream_tokens))
    first, _ = fill(memory.acquire(state, [], {stream.seq_id}, cache_prompt=True))
    _read(memory, store, first, state, len(state))
    memory.check()
    reads = _count_state_reads(store)
    store.events.clear()
    return store, memory, stream, first, reads


def test_an_idle_prefix_copied_beside_a_stream_is_counted_once_not_parked() -> None:
    """A question about the state an idle slot holds arrives while a stream runs and the
    pool has room only if that prefix counts once: the fill copies it (``seq_cp``, the
    same cells) instead of parking the idle slot to make room and then restoring it
    from host RAM (two whole-state copies inside one worker step)."""
    from langchain_llamacpp_local.cache.pool import Footprint

    state = list(range(1000, 1400))  # the first question's prompt, now idle
    store, memory, stream, first, reads = _stream_beside_idle(state)
    second = [*state[:390], *([9] * 20)]  # the next question on the same state
    running = (Footprint(stream.runs(), 150),)
    busy = {stream.seq_id}
    # apart: 150 + 400 + 450 > 768; the copied prefix once: 150 + 400 + 60 fits
    room = memory.room(second, len(second) + 40, running, busy)
    assert room is not None
    target, n_keep = fill(memory.acquire(second, [], busy, cache_prompt=True, room=room))
    assert target is not first and n_keep >= 300
    assert first.seq_id not in reads  # never parked (a whole-state read)
    assert not any(kind == "load" for kind, _ in store.events)  # nor restored
    assert _held(store, first) == state  # the source stays where it was
    assert _held(store, target) == state[:n_keep]
    memory.check()


@pytest.mark.parametrize("with_stream", [0, 10])
def test_an_idle_prefix_too_big_to_fork_beside_a_stream_is_taken_in_place(
    with_stream: int,
) -> None:
    """The next question on an idle slot's state arrives beside a stream, and the pool
    cannot hold that slot's whole conversation beside the fork that would copy its
    prefix: the question takes that slot itself (its short tail cut) instead of parking
    it to make room and restoring it from host RAM into an empty slot (two whole-state
    copies inside one worker step). Also when the prompt's first ``with_stream`` tokens
    (a system prompt) are the running stream's too."""
    from langchain_llamacpp_local.cache.pool import Footprint

    state = [5] * with_stream + list(range(1000, 1400 - with_stream))
    store, memory, stream, first, reads = _stream_beside_idle(state)
    second = [*state[:390], *([9] * 20)]
    running = (Footprint(stream.runs(), 150),)
    busy = {stream.seq_id}
    # a fork: 150 + 400 + (615 - 390) > 768; in place: 150 + 615 fits
    room = memory.room(second, 615, running, busy)
    assert room is not None
    target, n_keep = fill(memory.acquire(second, [], busy, cache_prompt=True, room=room))
    assert target is first and n_keep == 390
    assert not reads  # nothing parked (a whole-state read)
    assert not any(kind == "load" for kind, _ in store.events)  # nor restored
    assert _held(store, target) == state[:390]
    memory.check()


def test_the_pool_is_emptied_before_a_conversation_comes_back_into_it() -> None:
    # llama.cpp puts a restored state in the first free cells: loaded beside an idle
    # conversation, it would sit above that one's cells for its whole turn
    store = FakeStore(n_slots=2)
    store.kv_unified = True
    memory = _memory(store)
    room = (100, 0)
    a, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True, room=room))
    _read(memory, store, a, PROMPT, len(PROMPT))
    b_tokens = [5] * 30
    b, _ = fill(memory.acquire(b_tokens, [], set(), cache_prompt=True, room=room))
    _read(memory, store, b, b_tokens, len(b_tokens))
    store.events.clear()
    back, n_keep = fill(memory.acquire([*PROMPT, 1], [], set(), cache_prompt=True, room=room))
    assert n_keep == len(PROMPT) and _held(store, back) == PROMPT
    assert store.events.index(("remove", b.seq_id)) < store.events.index(("load", back.seq_id))
    assert _held(store, b) == []
    memory.check()


def test_a_refused_state_leaves_the_slot_empty() -> None:
    store = FakeStore(n_slots=1)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    slot, _ = fill(memory.acquire([9] * 20, [], set(), cache_prompt=True))
    store.refuse_states = True
    slot, n_keep = fill(memory.acquire(PROMPT + [1], [], set(), cache_prompt=True))
    assert n_keep == 0 and _held(store, slot) == [] and slot.n_past == 0
    memory.check()


def _read_with_checkpoints(
    memory: SlotMemory, store: FakeStore, slot: Slot, tokens: list[int], n_keep: int
) -> list[int]:
    """Read a prompt as the worker does: a checkpoint at each target it cuts at."""
    targets = memory.checkpoint_targets(n_keep, tokens, (), [], slot)
    for end in [*targets, len(tokens)]:
        _read(memory, store, slot, tokens, end)
        if end in targets:
            memory.save_checkpoint(slot, frozenset(targets))
    return targets


def test_recurrent_memory_resumes_from_a_checkpoint() -> None:
    store = FakeStore(MemoryKind.FULL_ONLY, n_slots=1, n_batch=16)
    memory = _memory(store, checkpoint_min_step=16)
    prompt = list(range(200, 300))
    slot, _ = fill(memory.acquire(prompt, [], set(), cache_prompt=True))
    targets = _read_with_checkpoints(memory, store, slot, prompt, 0)
    assert targets and [c.n_tokens for c in slot.checkpoints.items] == targets
    _generate(memory, store, slot, [1, 2])
    memory.check()

    # an edit at 70: the state cannot be trimmed, the newest checkpoint before it returns
    edited = prompt[:70] + [3, 4] + prompt[70:]
    before = max(t for t in targets if t <= 70)
    slot, n_keep = fill(memory.acquire(edited, [], set(), cache_prompt=True))
    assert n_keep == before
    assert _held(store, slot) == prompt[:before] and slot.entries == prompt[:before]
    memory.check()


def test_recurrent_memory_without_checkpoints_reads_the_prompt_again() -> None:
    store = FakeStore(MemoryKind.FULL_ONLY, n_slots=1)
    memory = _memory(store, checkpoint_max_count=0)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    assert memory.checkpoint_targets(0, PROMPT, (), [], slot) == []
    _read(memory, store, slot, PROMPT, len(PROMPT))
    slot, n_keep = fill(memory.acquire(PROMPT[:30] + [1], [], set(), cache_prompt=True))
    assert n_keep == 0 and _held(store, slot) == []
    memory.check()


def test_attention_memory_is_trimmed_without_checkpoints() -> None:
    store = FakeStore(MemoryKind.PARTIAL)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    assert memory.checkpoint_targets(0, PROMPT, (), [], slot) == []
    assert not memory.uses_checkpoints


@pytest.mark.parametrize(("n_swa", "kept"), [(256, 50), (16, 0)])
def test_a_sliding_window_is_trimmed_only_while_it_holds_what_the_prefix_needs(
    n_swa: int, kept: int
) -> None:
    store = FakeStore(MemoryKind.SWA, n_slots=1, n_swa=n_swa)
    memory = _memory(store, checkpoint_max_count=0)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    slot, n_keep = fill(memory.acquire(PROMPT[:50] + [1], [], set(), cache_prompt=True))
    assert n_keep == kept and _held(store, slot) == PROMPT[:kept]
    memory.check()


# --------------------------------------------------------------------------- draft verify


def _verify(
    memory: SlotMemory, store: FakeStore, slot: Slot, rows: list[int], used: int
) -> list[tuple[list[int], int]]:
    """One verify step as the worker runs it: begin, decode the rows, keep ``used``."""
    redone: list[tuple[list[int], int]] = []

    def redecode(kept: Sequence[object], start: int) -> None:
        redone.append(([int(t) for t in kept], start))  # type: ignore[call-overload]
        store.decode(slot.seq_id, [int(t) for t in kept], start)  # type: ignore[call-overload]

    step = memory.begin_verify(slot, rows)
    store.decode(slot.seq_id, rows, step.n_past)
    memory.keep(step, used, redecode)
    return redone


@pytest.mark.parametrize("used", [1, 3, 5])
def test_rejected_draft_rows_are_trimmed_from_attention_memory(used: int) -> None:
    store = FakeStore(MemoryKind.PARTIAL)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    assert not memory.rollback_mode(slot, 5)
    rows = [1, 2, 3, 4, 5]
    assert _verify(memory, store, slot, rows, used) == []  # trimmed, nothing decoded again
    assert _held(store, slot) == PROMPT + rows[:used] and slot.entries == PROMPT + rows[:used]
    memory.check()


@pytest.mark.parametrize("used", [1, 3, 5])
def test_rejected_draft_rows_roll_recurrent_memory_back(used: int) -> None:
    store = FakeStore(MemoryKind.FULL_ONLY)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    assert memory.rollback_mode(slot, 5)
    rows = [1, 2, 3, 4, 5]
    redone = _verify(memory, store, slot, rows, used)
    # all kept: nothing to undo; else the state before the step, then the kept rows again
    assert redone == ([] if used == 5 else [(rows[:used], len(PROMPT))])
    assert _held(store, slot) == PROMPT + rows[:used] and slot.entries == PROMPT + rows[:used]
    memory.check()


def test_a_failed_rollback_empties_the_slot() -> None:
    store = FakeStore(MemoryKind.FULL_ONLY)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    step = memory.begin_verify(slot, [1, 2, 3])
    store.decode(slot.seq_id, [1, 2, 3], step.n_past)
    store.refuse_states = True
    with pytest.raises(DecodeError, match="rolling back"):
        memory.keep(step, 1, lambda rows, start: None)
    assert slot.n_past == 0 and _held(store, slot) == []
    memory.check()


def test_a_failed_redecode_leaves_what_the_memory_holds() -> None:
    store = FakeStore(MemoryKind.FULL_ONLY)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    step = memory.begin_verify(slot, [1, 2, 3])
    store.decode(slot.seq_id, [1, 2, 3], step.n_past)

    def fail(rows: Sequence[object], start: int) -> None:
        raise DecodeError("no room")

    with pytest.raises(DecodeError, match="no room"):
        memory.keep(step, 2, fail)
    assert slot.entries == PROMPT and _held(store, slot) == PROMPT  # back to before the step
    memory.check()


def test_an_aborted_verify_puts_the_saved_state_back() -> None:
    store = FakeStore(MemoryKind.FULL_ONLY)
    memory = _memory(store)
    slot, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, slot, PROMPT, len(PROMPT))
    step = memory.begin_verify(slot, [1, 2, 3])
    store.decode(slot.seq_id, [1, 2], step.n_past)  # the call broke off half way
    memory.abort_verify(step)
    memory.sync(slot)
    assert slot.entries == PROMPT and _held(store, slot) == PROMPT
    memory.check()


def test_sliding_window_rollback_mode() -> None:
    """A sliding-window cache trims a one-ubatch verify by default; in deterministic
    mode it restores a state unless the sequence fits in half a window."""
    fast = _memory(FakeStore(MemoryKind.SWA, n_swa=128, n_batch=8))
    exact = _memory(FakeStore(MemoryKind.SWA, n_swa=128, n_batch=8, deterministic=True))
    slot = fast.slots[0]
    assert not fast.rollback_mode(slot, 8)
    assert fast.rollback_mode(slot, 9) is False  # fits half the window
    slot.entries = list(range(60))
    assert fast.rollback_mode(slot, 9)
    slot = exact.slots[0]
    assert not exact.rollback_mode(slot, 4)
    slot.entries = list(range(60))
    assert exact.rollback_mode(slot, 4)


def test_the_engine_and_the_fake_offer_what_the_protocol_asks() -> None:
    methods = {n for n in vars(SequenceStore) if not n.startswith("_")}
    assert methods == {
        "seq_rm", "seq_cp", "seq_add", "seq_pos_min", "seq_pos_max",
        "state_size", "state_get", "state_set", "wipe_memory",
    }  # fmt: skip
    for name in methods:
        assert callable(getattr(Engine, name)) and callable(getattr(FakeStore, name))
    fake = FakeStore()
    for name in SequenceStore.__annotations__:
        assert hasattr(fake, name), name


def test_a_compacted_pool_keeps_every_entry_in_cells_of_each_sequences_own() -> None:
    """``compact`` copies every sequence out and back: the same entries, and a prefix
    shared through ``seq_cp`` is each one's own afterwards (the pool counts it apart);
    a sequence that cannot be put back leaves its slot empty and is named."""
    store = FakeStore(n_slots=2)
    store.kv_unified = True
    memory = _memory(store)
    a, _ = fill(memory.acquire(PROMPT, [], set(), cache_prompt=True))
    _read(memory, store, a, PROMPT, len(PROMPT))
    b = next(s for s in memory.slots if s is not a)
    memory.copy(a, b, 20)
    assert b.shared
    assert memory.compact() == ()
    assert _held(store, b) == PROMPT[:20] and b.shared == () and b.runs()[0][2] == b.group
    assert _held(store, a) == PROMPT
    memory.check()
    store.refuse_states = True
    assert {s.seq_id for s in memory.compact()} == {a.seq_id, b.seq_id}
    assert a.n_past == b.n_past == 0
    memory.check()
