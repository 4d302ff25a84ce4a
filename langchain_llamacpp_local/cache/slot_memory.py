"""The slots' memory: the one mechanism that changes what a llama.cpp sequence holds.

A :class:`SlotMemory` owns the slots (one llama.cpp sequence each), the host-RAM
prompt cache and the checkpoints. It is the only code that changes a sequence's
memory (the prompt and generation decodes append to it; :meth:`SlotMemory.record`
tracks them), and every such change, a draft's rollback included, updates the slot's
tracked entries in the same method, so the bookkeeping cannot drift from the KV
cache. It reaches the memory through :class:`~.store.SequenceStore`, which the
engine satisfies and a pure-Python store does in the unit tests. With
``LLAMACPP_LOCAL_CHECK_KV=1`` (read when the worker starts) :meth:`check` asserts
that after every step.

Which slot a request takes and how it is filled is decided by the pure functions of
:mod:`~.slot_plan` (llama.cpp's server selection); this class applies their plans.
By default a request reuses the whole common prefix, the previous reply included
(as llama.cpp's server does); in deterministic mode reuse stops at the fixed decode
grid of :mod:`chunking` so a warm request computes exactly what a fresh one would.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from langchain_llamacpp_local.cache import checkpoints, host_ram
from langchain_llamacpp_local.cache import disk as disk_cache
from langchain_llamacpp_local.cache.checkpoints import (
    Checkpoint,
    CheckpointStore,
    checkpoint_targets,
)
from langchain_llamacpp_local.cache.chunking import (
    exact_prefix,
    grid_align,
    restart_point,
    resume_point,
)
from langchain_llamacpp_local.cache.host_ram import CachedPrompt, PromptCache
from langchain_llamacpp_local.cache.pool import Footprint, Run, admits, idle_to_park
from langchain_llamacpp_local.cache.reuse import (
    ReuseOff,
    ReusePlan,
    memory_blocker,
    pinned_end,
    plan_reuse,
)
from langchain_llamacpp_local.cache.slot_plan import (
    DISK_MIN_ENTRIES,
    FillPlan,
    SlotChoice,
    SlotState,
    best_match,
    choose_slot,
    disk_beats,
    plan_fill,
    plan_solo_parking,
    usable_cached,
)
from langchain_llamacpp_local.cache.slots import Slot, common_prefix_len
from langchain_llamacpp_local.cache.store import SequenceStore
from langchain_llamacpp_local.errors import DecodeError, KVDesyncError, RequestCancelledError
from langchain_llamacpp_local.llama.backend import build_info
from langchain_llamacpp_local.llama.engine import PARTIAL_ONLY
from langchain_llamacpp_local.llama.probes import MemoryKind

logger = logging.getLogger(__name__)

CHECK_ENV = "LLAMACPP_LOCAL_CHECK_KV"
#: Default mode, sliding-window cache: a checkpoint wanted at most this many entries
#: after a prompt piece's start is taken at that start, before the piece is decoded (a
#: state copy, where a cut costs a decode call), or not at all when one at most this many
#: entries before it exists; an edit there re-reads the entries in between.
WINDOW_SLACK = 64


@dataclass(frozen=True)
class CacheOptions:
    """Per-model cache settings that do not change how the weights load."""

    checkpoint_max_count: int = checkpoints.DEFAULT_MAX_COUNT
    checkpoint_max_bytes: int = checkpoints.DEFAULT_MAX_BYTES
    checkpoint_min_step: int = 512
    prompt_cache_bytes: int = host_ram.DEFAULT_MAX_BYTES
    #: Directory of the prompt cache on disk (None: off), and its byte budget.
    prompt_cache_dir: str | None = None
    prompt_cache_dir_bytes: int = disk_cache.DEFAULT_MAX_BYTES


#: LoadConfig fields that do not change what a sequence's saved state holds.
_STATE_NEUTRAL = frozenset(
    {"model_path", "n_slots", "use_mmap", "use_mlock", "draft_model_path", "mmproj_path"}
    | {"image_min_tokens", "image_max_tokens"}
)


def disk_key_parts(engine: SequenceStore) -> dict[str, object]:
    """What a saved state depends on: the model file's contents and every load setting
    that changes the KV cache or its numbers (``deterministic`` included: it decides how
    ``exact`` prefixes were computed)."""
    config = engine.config
    parts: dict[str, object] = {
        f: getattr(config, f) for f in vars(config) if f not in _STATE_NEUTRAL
    }
    parts["model"] = disk_cache.file_identity(config.model_path)
    parts["n_ctx_per_seq"] = engine.n_ctx
    return parts


def check_enabled() -> bool:
    """Whether the KV invariant check is on (``LLAMACPP_LOCAL_CHECK_KV=1``)."""
    return os.environ.get(CHECK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Room:
    """What admission counted for a request in the unified pool (:meth:`SlotMemory.room`):
    the running requests' footprints, the positions the request may hold, and the
    prefix of a running slot it was counted as sharing (copied into its slot by
    ``seq_cp``: the same cells)."""

    running: tuple[Footprint, ...]
    needed: int
    share_from: int | None = None
    """The running slot whose cells it shares (None: it shares nothing)."""
    n_share: int = 0
    """How many leading positions it shares."""
    share_runs: tuple[Run, ...] = ()


@dataclass(frozen=True)
class Acquired:
    """What :meth:`SlotMemory.acquire` gave a request, for its cache report: positions
    and counts only, nothing of the candidate's entries (they may be another caller's
    conversation, and the report goes into the caller's reply)."""

    slot: Slot
    n_keep: int
    """Entries the request keeps (moved ones included); it reads the rest."""
    source: str | None = None
    """Where the kept prefix came from: "slot", "host_ram", "disk"; None: nothing cached."""
    missed: bool = False
    """The prompt left the candidate's cached *prompt* (leaving its reply is no miss: a
    re-rendered reply may differ from the tokens the model wrote)."""
    mismatch_at: int = 0
    """The prompt position where it left the candidate."""
    moved: int = 0
    """Entries moved to new positions rather than read (``cache_reuse``)."""
    reuse_off: ReuseOff | None = None
    """Why ``cache_reuse`` was asked for but could not apply (None: it applied, or
    nothing was left to move)."""


@dataclass
class Verify:
    """A verify step in flight (:meth:`SlotMemory.begin_verify`): the rows decoded in
    one call, where they start, and the state to roll back to (None: trimmable)."""

    slot: Slot
    rows: list[Hashable]
    n_past: int
    saved: bytes | None


class SlotMemory:
    """Slots, host-RAM cache and checkpoints of one context (see module docstring)."""

    def __init__(self, engine: SequenceStore, cache: CacheOptions) -> None:
        self.engine = engine
        self.cache = cache
        self.slots = [
            Slot(
                seq_id=i,
                checkpoints=CheckpointStore(
                    max_count=cache.checkpoint_max_count, max_bytes=cache.checkpoint_max_bytes
                ),
            )
            for i in range(engine.n_slots)
        ]
        self.ram = PromptCache(max_bytes=cache.prompt_cache_bytes)
        self.disk: disk_cache.DiskPromptCache | None = None
        if cache.prompt_cache_dir:
            try:
                self.disk = disk_cache.DiskPromptCache(
                    cache.prompt_cache_dir,
                    disk_cache.cache_key(disk_key_parts(engine)),
                    build_info(),
                    cache.prompt_cache_dir_bytes,
                )
            except OSError as exc:
                raise ValueError(
                    f"prompt_cache_dir={cache.prompt_cache_dir!r} cannot be used: {exc}"
                ) from None
        self.align = grid_align(engine.n_batch)
        #: bit-exact mode (fixed grid, exact prefixes only); else llama.cpp's reuse
        self.deterministic = engine.config.deterministic
        self.checking = check_enabled()
        self._clock = 0
        #: the file the slot being acquired was restored from (its checkpoints are next)
        self._restored_file: disk_cache.DiskEntry | None = None
        #: why this memory never moves cached chunks (None: it can, ``cache_reuse``)
        self.reuse_blocker: ReuseOff | None = memory_blocker(
            memory_kind=engine.memory_kind,
            is_recurrent=engine.is_recurrent,
            is_hybrid=engine.is_hybrid,
            mrope=engine.mrope,
            can_shift=engine.can_shift,
            deterministic=self.deterministic,
        )
        #: each sequence's state size while empty (the memory is empty now): what
        #: :meth:`reset` checks it left
        self._empty_size = [engine.state_size(s.seq_id) for s in self.slots]

    @property
    def uses_checkpoints(self) -> bool:
        return (
            self.engine.memory_kind is not MemoryKind.PARTIAL
            and self.cache.checkpoint_max_count > 0
        )

    @property
    def window_checkpoints(self) -> bool:
        """Default mode on a sliding-window cache: checkpoints at piece starts and at the
        prompt's end instead of cuts near them (see :meth:`checkpoint_targets`)."""
        return (
            self.uses_checkpoints
            and not self.deterministic
            and self.engine.memory_kind is MemoryKind.SWA
        )

    # ------------------------------------------------------------------ choosing

    def acquire(
        self,
        tokens: Sequence[Hashable],
        media: Sequence[tuple[int, int]],
        busy: set[int],
        *,
        cache_prompt: bool,
        marks: Sequence[int] = (),
        room: Room | tuple[int, int] | None = None,
        waiting: int = 0,
        reuse: int = 0,
        owner: str | None = None,
    ) -> Acquired:
        """A free slot for ``tokens`` and how many of its entries the request keeps.

        ``reuse`` (``cache_reuse``, 0: off): after the common prefix, move cached chunks
        of at least that many entries that match the prompt's next ones
        (:func:`~.reuse.plan_reuse`) instead of reading them; only entries the same
        conversation (``owner``, the front end's key) wrote are moved, and a slot it
        holds is chosen when moving keeps more than any prefix would.

        ``room`` (unified cache): what admission counted (:meth:`room`; or the request's
        ``needed`` positions and the ``reserved`` positions of the running requests,
        counted as held apart); idle slots are parked to make that room once the slot
        is chosen and before it is filled, so a restored conversation finds free cells,
        and a fill that would hold more cells than counted (a restore instead of the
        counted copy of a running slot's prefix) gives way to that copy. A request that
        decodes alone (nothing in ``busy``, no others ``waiting``) has the other idle
        conversations parked too (:func:`~.slot_plan.plan_solo_parking`), before a
        parked conversation is restored into the slot: restored beside them it would
        land in the cells after theirs, and every step attends over the pool up to its
        highest cell in use."""
        self._restored_file = None
        if isinstance(room, tuple):
            room = Room((Footprint((), room[1]),), room[0])
        if not cache_prompt:
            reuse = 0
        slot, (source, missed, at) = self._choose(
            tokens, busy, room, waiting, media, marks, reuse, owner
        )
        if not cache_prompt:
            self.reset(slot)
        try:
            n_keep, moved, off = self._rewind(slot, tokens, media, marks, reuse, owner)
        finally:
            self._restored_file = None
        slot.owner = owner
        return Acquired(slot, n_keep, source, missed, at, moved, off)

    def _touch(self, slot: Slot) -> Slot:
        self._clock += 1
        slot.last_used = self._clock
        return slot

    def _states(
        self, tokens: Sequence[Hashable], owner: str | None = None, reuse: int = 0
    ) -> list[SlotState]:
        return [
            SlotState(
                s.seq_id,
                s.n_past,
                s.last_used,
                min(
                    common_prefix_len(s.entries, tokens),
                    s.reusable_exact(self._own(s, owner, reuse)),
                ),
            )
            for s in self.slots
        ]

    @staticmethod
    def _own(slot: Slot, owner: str | None, reuse: int) -> bool:
        """Whether a request (``owner``, ``reuse``) may keep the entries chunk reuse
        moved in ``slot``: its owner's, asking for reuse itself."""
        return reuse > 0 and owner is not None and slot.owner == owner

    def _choose(
        self,
        tokens: Sequence[Hashable],
        busy: set[int],
        room: Room | None,
        waiting: int = 0,
        media: Sequence[tuple[int, int]] = (),
        marks: Sequence[int] = (),
        reuse: int = 0,
        owner: str | None = None,
    ) -> tuple[Slot, tuple[str | None, bool, int]]:
        """Take the free slot :func:`~.slot_plan.choose_slot` picks for ``tokens`` and fill
        it as :func:`~.slot_plan.plan_fill` says (park, restore, copy). With ``room``,
        the idle conversations beside a request that decodes alone are parked once:
        before a restore, after any other fill (a copy's source must stay until then)."""
        can_copy = self.engine.memory_kind is MemoryKind.PARTIAL
        states = self._states(tokens, owner, reuse)
        pick = self._reuse_pick(tokens, busy, media, marks, reuse, owner, states)
        if pick is not None:  # moving its chunks keeps more than any prefix would
            choice = SlotChoice(pick[0], park_first=False)
            states = [
                replace(s, reusable=pick[1].n_past) if s.seq_id == pick[0] else s for s in states
            ]
        else:
            fork_fits = True
            if room is not None and can_copy and busy:
                fork_fits = self._fork_fits(states, busy, room, len(tokens), media, marks)
            choice = choose_slot(states, busy, len(tokens), can_copy=can_copy, fork_fits=fork_fits)
        target = self.slots[choice.target]
        # a conversation is saved once: parking copies its whole state out of llama.cpp
        # (milliseconds when its cells are interleaved with other sequences')
        parked = choice.park_first
        if parked:
            self.park(target)
        copy_from = None  # an idle slot whose prefix the fill copies, counted once
        if room is not None:
            # the request's own kept cells in place (a prefix it shares with a running
            # slot is not counted once then); else the prefix admission counted
            counted = Footprint((() if choice.in_place else room.share_runs), room.needed)
            # beside running requests only: one decoding alone has the idle ones parked
            if (
                not choice.in_place
                and can_copy
                and busy
                and pick is None
                and room.share_from is None
            ):
                copy_from = self._park_beside_copy_source(
                    states, busy, target, room, len(tokens), media, marks
                )
            if copy_from is None and not self._park_for(
                room.running, counted, busy, {target.seq_id}
            ):
                raise AssertionError("acquire(room=...) of a request that does not fit")
            states = [  # parked slots hold nothing to copy now
                replace(s, reusable=pick[1].n_past) if pick and s.seq_id == pick[0] else s
                for s in self._states(tokens, owner, reuse)
            ]
        best_slot = max(s.reusable for s in states)
        cached, n_cached = self.ram.best(tokens)
        if cached is not None:
            n_cached = usable_cached(n_cached, cached.exact, len(tokens), len(cached.entries))
            if n_cached == 0:
                cached = None
        else:
            n_cached = 0
        from_disk: disk_cache.DiskEntry | None = None
        if self.disk is not None:  # a state saved by this or an earlier process
            on_disk = self._from_disk(tokens, max(best_slot, n_cached))
            if on_disk is not None:
                cached, n_cached, from_disk = on_disk
        plan = plan_fill(states, choice.target, n_cached, can_copy=can_copy)
        if copy_from is not None and (plan.action != "copy" or plan.source != copy_from):
            # the room was counted for this copy: a restore would hold cells of its own
            n_copy = next(x.reusable for x in states if x.seq_id == copy_from)
            plan, cached, from_disk = FillPlan("copy", copy_from, n_copy), None, None
        if pick is not None and plan.action == "park":  # the edited-away history goes
            plan = FillPlan("keep")
        if room is not None and room.share_from is not None:
            plan, cached, from_disk = self._within_room(
                plan, room, states, target, busy, len(tokens), media, marks, cached, from_disk
            )
        note = self._note_source(plan.action, plan.source, choice.target, cached, from_disk, tokens)
        if plan.action == "restore":
            assert cached is not None
            # Take it out first: parking the target, or the idle conversations beside a
            # request that decodes alone, may evict cache entries (this one too).
            self.ram.take(cached)
            if room is not None:
                # before the state comes back: llama.cpp puts it in the first free cells
                self.park_beside(target, busy, waiting)
            if not parked:
                self.park(target)
            if self.restore(target, cached):
                self._restored_file = from_disk
            elif from_disk is not None:
                self._discard(from_disk)
        elif plan.action == "copy":
            assert plan.source is not None
            if not parked:
                self.park(target)
            self.copy(self.slots[plan.source], target, plan.n_copy)
        elif plan.action == "park" and not parked:
            self.park(target)
        if room is not None and plan.action != "restore":
            self.park_beside(target, busy, waiting)
        return self._touch(target), note

    def _reuse_pick(
        self,
        tokens: Sequence[Hashable],
        busy: set[int],
        media: Sequence[tuple[int, int]],
        marks: Sequence[int],
        reuse: int,
        owner: str | None,
        states: Sequence[SlotState],
    ) -> tuple[int, ReusePlan] | None:
        """The free slot of this conversation (``owner``) whose chunk reuse keeps the
        most entries, when that beats every slot's plain prefix; None otherwise."""
        if reuse <= 0 or owner is None or self.reuse_blocker is not None:
            return None
        best: tuple[int, ReusePlan] | None = None
        for slot in self.slots:
            if slot.seq_id in busy or slot.owner != owner or not slot.n_past:
                continue
            plan = self._reuse_plan(slot, tokens, media, marks, reuse)
            if plan.moves and (best is None or plan.n_past > best[1].n_past):
                best = (slot.seq_id, plan)
        if best is None or best[1].n_past <= max(s.reusable for s in states):
            return None
        return best

    def _reuse_plan(
        self,
        slot: Slot,
        tokens: Sequence[Hashable],
        media: Sequence[tuple[int, int]],
        marks: Sequence[int],
        reuse: int,
    ) -> ReusePlan:
        """:func:`~.reuse.plan_reuse` for ``slot``: from where the request resumes, its
        cells shared with another sequence pinned."""
        limit = min(common_prefix_len(slot.entries, tokens), slot.exact)  # its owner's
        n_keep = self._resume(limit, len(tokens), media, marks)
        pinned = 0
        if self.engine.kv_unified:
            others = [o.runs() for o in self.slots if o is not slot and o.n_past]
            pinned = pinned_end(slot.runs(), others)
        return plan_reuse(slot.entries, tokens, n_keep, reuse, media=media, pinned=pinned)

    def _within_room(
        self,
        plan: FillPlan,
        room: Room,
        states: Sequence[SlotState],
        target: Slot,
        busy: set[int],
        n_prompt: int,
        media: Sequence[tuple[int, int]],
        marks: Sequence[int],
        cached: CachedPrompt | None,
        from_disk: disk_cache.DiskEntry | None,
    ) -> tuple[FillPlan, CachedPrompt | None, disk_cache.DiskEntry | None]:
        """``plan``, or the copy of the running slot's prefix admission counted when
        ``plan`` would hold more cells than the pool has left (a restore, or a kept
        prefix of the slot's own, instead of the running one's cells)."""
        kept = {s.seq_id: s.reusable for s in states}
        if plan.action == "restore":
            runs: tuple[Run, ...] = ()
        else:
            src = self.slots[plan.source] if plan.action == "copy" else target
            n = plan.n_copy if plan.action == "copy" else kept[target.seq_id]
            n = self._resume(n, n_prompt, media, marks)
            runs = tuple((a, min(b, n), g) for a, b, g in src.runs() if a < n)
        spare = {target.seq_id} | ({plan.source} if plan.source is not None else set())
        if self._room_left(room.running, Footprint(runs, room.needed), busy, spare):
            return plan, cached, from_disk
        assert room.share_from is not None
        if cached is not None:  # taken from neither cache: it stays where it is
            cached = None
        return FillPlan("copy", room.share_from, room.n_share), None, None

    def _note_source(
        self,
        action: str,
        source: int | None,
        target: int,
        cached: CachedPrompt | None,
        from_disk: disk_cache.DiskEntry | None,
        tokens: Sequence[Hashable],
    ) -> tuple[str | None, bool, int]:
        """Where the kept prefix comes from, whether the prompt left the candidate's
        prompt and where, for the cache report (:class:`Acquired`): positions only,
        nothing of the candidate's entries (no cost on a hit)."""
        entries: Sequence[Hashable] = ()
        n_prompt = 0
        if action == "restore" and cached is not None:
            source = "disk" if from_disk is not None else "host_ram"
            entries = cached.entries
            n_prompt = len(entries) if cached.n_prompt is None else cached.n_prompt
        else:
            slot = self.slots[source if action == "copy" and source is not None else target]
            entries, n_prompt = slot.entries, slot.n_prompt
            source = "slot" if entries else None
        n = common_prefix_len(entries, tokens)
        # leaving the cached reply is no miss: a re-rendered reply may differ from the
        # tokens the model wrote; leaving the cached prompt is one
        return source, n < n_prompt, n

    def _from_disk(
        self, tokens: Sequence[Hashable], beat: int
    ) -> tuple[CachedPrompt, int, disk_cache.DiskEntry] | None:
        """The disk cache's record for ``tokens`` if it restores more than ``beat``
        entries (restoring a file is far cheaper than decoding what it holds)."""
        assert self.disk is not None
        entry, n = self.disk.best(tokens)
        if entry is None:
            return None
        n = min(n, entry.exact, len(tokens) - 1)
        if not disk_beats(n, beat):
            return None
        item = self.disk.load(entry)
        if item is None:
            return None
        logger.debug("prompt cache: %d of %d entries found on disk", n, len(tokens))
        return item, n, entry

    def _discard(self, entry: disk_cache.DiskEntry) -> None:
        """Delete a file whose state or checkpoint did not hold what it claims."""
        if self.disk is not None:
            self.disk.discard(entry)

    def reserve_save(self, slot: Slot) -> disk_cache.PendingSave | None:
        """A place in the disk writer's queue for ``slot``'s conversation, taken before
        its reply is sent (a program may exit right after: the exit flush waits for it);
        :meth:`persist` fills it. None when there is nothing new to save."""
        disk = self.disk
        if disk is None or slot.n_past < DISK_MIN_ENTRIES:
            return None
        if not disk.wants(slot.seq_id, slot.entries):
            return None
        return disk.reserve()

    def persist(self, slot: Slot, pending: disk_cache.PendingSave) -> None:
        """Copy ``slot``'s state into ``pending`` (once; the writer thread encodes,
        hashes and writes it). ``pending`` is filled even when the copy fails."""
        item = None
        try:
            if slot.n_past < DISK_MIN_ENTRIES:  # the step that finished it dropped rows
                return
            data = self.engine.state_get(slot.seq_id, 0)
            item = CachedPrompt(
                tuple(slot.entries),
                data,
                list(slot.checkpoints.items),
                slot.reusable_exact(own=False),  # never entries moved for its owner
                n_prompt=slot.n_prompt,
            )
        finally:
            pending.fill(item)

    # ------------------------------------------------------------------ memory changes

    def reset(self, slot: Slot) -> None:
        """Remove the whole sequence (never fails) and forget its entries.

        llama.cpp's ``seq_rm(seq, -1, -1)`` removes positions in [0, 2**31 - 1) only: a
        cell outside (a state from a file may hold one) would stay and fail every later
        decode of the sequence, so what is left is checked and purged."""
        self.engine.seq_rm(slot.seq_id, -1, -1)
        if self.engine.state_size(slot.seq_id) != self._empty_size[slot.seq_id]:
            logger.warning("slot %d kept cells seq_rm cannot remove: purging them", slot.seq_id)
            self._purge(slot)
        slot.clear()

    def _purge(self, slot: Slot) -> None:
        """Empty ``slot``'s sequence whatever positions it holds: clear the whole memory
        and put the other slots' sequences back (the engine's ``wipe_memory``)."""
        self._rewrite({slot.seq_id}, zero=True)
        slot.clear()

    def _rewrite(self, drop: set[int], *, zero: bool) -> tuple[Slot, ...]:
        """Clear llama.cpp's memory (``zero``: its data too) and put every sequence but
        ``drop`` back; no cell is shared afterwards. The slots that could not be put
        back are emptied and returned."""
        lost = self.engine.wipe_memory(drop, zero=zero)
        gone: list[Slot] = []
        for other in self.slots:
            other.share(())
            if other.seq_id in lost and other.seq_id not in drop:  # it fitted a moment ago
                logger.error("slot %d could not be put back into the memory", other.seq_id)
                other.clear()
                gone.append(other)
        return tuple(gone)

    def _holds(self, seq_id: int, n: int) -> bool:
        """Whether ``seq_id`` holds what a state of ``n`` entries must: its last position
        ``n - 1``, none below 0, and from 0 on where memory is trimmable."""
        eng = self.engine
        lo, hi = eng.seq_pos_min(seq_id), eng.seq_pos_max(seq_id)
        if hi != n - 1 or not 0 <= lo <= hi:
            return False
        return lo == 0 or eng.memory_kind is not MemoryKind.PARTIAL

    def park(self, slot: Slot) -> bool:
        """Save a conversation to the host-RAM cache before its slot is reused; returns
        whether the cache holds it (see :meth:`~.host_ram.PromptCache.put`)."""
        if slot.n_past == 0 or self.ram.max_bytes <= 0:
            return False
        data = self.engine.state_get(slot.seq_id, 0)
        return self.ram.put(
            CachedPrompt(
                tuple(slot.entries),
                data,
                list(slot.checkpoints.items),
                slot.reusable_exact(own=False),  # never entries moved for its owner
                n_prompt=slot.n_prompt,
            )
        )

    def park_beside(self, target: Slot, busy: set[int], waiting: int) -> None:
        """Park the idle conversations :func:`~.slot_plan.plan_solo_parking` names, each
        removed from the cache only once host RAM holds it (one over the byte budget stays
        where it is: nothing is dropped to make a decode faster)."""
        plan = plan_solo_parking(
            self._states(()),
            busy,
            target.seq_id,
            waiting=waiting,
            attention=self.engine.memory_kind is not MemoryKind.FULL_ONLY,
        )
        for seq_id in plan:
            slot = self.slots[seq_id]
            if self.park(slot):
                self.reset(slot)

    def restore(self, slot: Slot, cached: CachedPrompt) -> bool:
        """Load a parked or saved conversation into ``slot`` (cleared first). False, the
        slot left empty, when llama.cpp refuses the state or it does not hold the
        positions its entries claim (a file's state may hold any position)."""
        self.reset(slot)
        n = len(cached.entries)
        if not self.engine.state_set(cached.data, slot.seq_id, 0):
            self.reset(slot)  # a partial load: nothing of it may stay
            return False
        if not self._holds(slot.seq_id, n):
            logger.warning(
                "a cached state does not hold the %d positions it claims: reading the prompt", n
            )
            self._purge(slot)
            return False
        slot.entries = list(cached.entries)
        slot.exact = cached.exact
        slot.n_prompt = n if cached.n_prompt is None else cached.n_prompt
        for ck in cached.checkpoints:
            slot.checkpoints.add(ck)
        logger.debug("restored %d cached entries", n)
        return True

    def compact(self) -> tuple[Slot, ...]:
        """Rewrite the pool from its first cell (:func:`~.slot_plan.plan_compaction`):
        every sequence is copied out, llama.cpp's memory cleared (its data kept: nothing
        in it is unsound) and each put back from cell 0 on, so the cells every row of a
        unified pool attends over are the cells held. Positions and entries stay; a
        prefix shared through ``seq_cp`` is held in cells of each sequence's own
        afterwards. Returns the slots that could not be put back (emptied)."""
        return self._rewrite(set(), zero=False)

    def copy(self, src: Slot, dst: Slot, n: int) -> None:
        """Give ``dst`` the first ``n`` entries of ``src`` without decoding them.

        Per-sequence KV streams copy a whole stream (llama.cpp supports nothing
        finer across streams) and trim it; a unified cache shares the cells.
        """
        eng = self.engine
        self.reset(dst)
        if eng.kv_unified:
            eng.seq_cp(src.seq_id, dst.seq_id, 0, n)
        else:
            eng.seq_cp(src.seq_id, dst.seq_id, -1, -1)
            if not eng.seq_rm(dst.seq_id, n, -1):
                self.reset(dst)
                return
        dst.entries = list(src.entries[:n])
        if eng.kv_unified:  # the same cells: held once in the pool
            dst.share([(a, min(b, n), g) for a, b, g in src.runs() if a < n])
        dst.exact = min(src.exact, n)
        dst.n_prompt = min(src.n_prompt, n)
        logger.debug("copied a %d-entry prefix from slot %d", n, src.seq_id)

    def _rewind(
        self,
        slot: Slot,
        tokens: Sequence[Hashable],
        media: Sequence[tuple[int, int]],
        marks: Sequence[int] = (),
        reuse: int = 0,
        owner: str | None = None,
    ) -> tuple[int, int, ReuseOff | None]:
        """Trim ``slot`` to the grid cut point a request for ``tokens`` resumes from;
        returns the entries kept, those of them moved, and why ``reuse`` did not apply.

        Attention KV is trimmed in place, after the chunks :meth:`_reuse_plan` finds
        were moved (``reuse`` > 0). Memory that cannot be trimmed (recurrent, hybrid) or
        whose sliding window already dropped the positions needed is rolled back to the
        newest checkpoint at or before that point; without one the sequence is cleared.
        """
        off = self.reuse_blocker if reuse > 0 else None
        exact = slot.reusable_exact(self._own(slot, owner, reuse))
        limit = min(common_prefix_len(slot.entries, tokens), exact)
        n_keep = self._resume(limit, len(tokens), media, marks)
        if n_keep >= slot.n_past:  # pure extension: nothing to trim
            return slot.n_past, 0, off
        if reuse > 0 and off is None:
            if owner is None or slot.owner != owner:
                off = "other_conversation"
            else:
                plan = self._reuse_plan(slot, tokens, media, marks, reuse)
                if plan.moves:
                    return self._move(slot, tokens, n_keep, plan), plan.moved, None
                off = "media" if plan.media_blocked else None
        return self._cut(slot, n_keep), 0, off

    def _move(self, slot: Slot, tokens: Sequence[Hashable], n_keep: int, plan: ReusePlan) -> int:
        """Apply a :class:`~.reuse.ReusePlan` after the kept prefix ``n_keep``: each
        chunk's gap removed, the chunk shifted into it (llama.cpp server's
        ``seq_rm`` + ``seq_add``), the rest trimmed; the slot then tracks the prompt's
        first ``plan.n_past`` entries. The moved cells were this sequence's alone
        (``pinned``): from ``n_keep`` on they count as cells of a new group."""
        eng = self.engine
        seq = slot.seq_id
        for move in plan.moves:
            if move.shift:
                eng.seq_rm(seq, move.dst_start, move.src_start)
                eng.seq_add(seq, move.src_start, move.src_end, move.shift)
        if not eng.seq_rm(seq, plan.n_past, -1):
            self.reset(slot)
            return 0
        slot.truncate(n_keep)
        slot.entries.extend(tokens[n_keep : plan.n_past])
        slot.exact = slot.n_past  # default mode only: every entry counts as reusable
        first = plan.moves[0].dst_start
        slot.moved_at = first if slot.moved_at is None else min(slot.moved_at, first)
        logger.debug(
            "cache reuse: kept %d entries, moved %d in %d chunks",
            n_keep,
            plan.moved,
            len(plan.moves),
        )
        return plan.n_past

    def _cut(self, slot: Slot, n_keep: int) -> int:
        """Trim ``slot`` to ``n_keep`` entries (see :meth:`_rewind`); the entries kept."""
        eng = self.engine
        kind = eng.memory_kind
        seq = slot.seq_id
        if kind is MemoryKind.PARTIAL or (
            kind is MemoryKind.SWA and n_keep > 0 and self._swa_window_ok(slot, n_keep)
        ):
            if eng.seq_rm(seq, n_keep, -1):
                slot.truncate(n_keep)
                return n_keep
        # a sliding-window state resumes one entry before its end (default mode; the
        # deterministic grid resumes on its own cut points only)
        reach = 1 if kind is MemoryKind.SWA and not self.deterministic else 0
        ck = slot.checkpoints.best_for(n_keep, reach)
        if ck is not None and eng.state_set(ck.data, seq, PARTIAL_ONLY):
            if not self._holds(seq, ck.n_tokens):  # a file's checkpoint may hold anything
                logger.warning(
                    "the checkpoint at %d entries does not hold its positions", ck.n_tokens
                )
                self._purge(slot)
                if self._restored_file is not None:
                    self._discard(self._restored_file)
                return 0
            resume = min(ck.n_tokens, n_keep)
            if eng.seq_rm(seq, resume, -1):
                logger.debug(
                    "restored the checkpoint at %d entries (resume point %d, cached %d)",
                    ck.n_tokens,
                    n_keep,
                    slot.n_past,
                )
                slot.truncate(resume)
                return resume
        logger.debug("no checkpoint at or before %d entries: re-reading the prompt", n_keep)
        self.reset(slot)
        return 0

    def _resume(
        self, limit: int, n_prompt: int, media: Sequence[tuple[int, int]], marks: Sequence[int]
    ) -> int:
        """Where a prompt sharing ``limit`` entries with a slot resumes decoding."""
        if self.deterministic:
            return restart_point(limit, n_prompt, self.align, media, marks)
        return resume_point(limit, n_prompt, media)

    def _swa_window_ok(self, slot: Slot, n_keep: int) -> bool:
        """True if the SWA cache still holds the window needed to resume at ``n_keep``."""
        eng = self.engine
        return eng.seq_pos_min(slot.seq_id) <= max(0, n_keep - eng.n_swa)

    def record(self, slot: Slot, entries: Sequence[Hashable], *, exact: bool) -> None:
        """Track entries just decoded into ``slot`` (``exact``: a grid prompt piece).

        Outside deterministic mode every decoded entry is reusable (generated ones too)."""
        grid_exact = slot.exact == slot.n_past
        slot.entries.extend(entries)
        if (exact and grid_exact) or not self.deterministic:
            slot.exact = slot.n_past

    def seal_prompt(self, slot: Slot, n_prompt: int, marks: Sequence[int] = ()) -> None:
        """After a prompt is read: only whole grid cells of it stay reusable exactly.

        The last partial cell was computed as a prompt's tail; a longer prompt would
        compute the same positions inside a full piece, unless that cell ends on a
        mark (a prompt ending with the generation prompt), where it cuts too.
        """
        slot.n_prompt = n_prompt
        if not self.deterministic:
            return
        slot.exact = min(slot.exact, exact_prefix(n_prompt, self.align, marks))

    def sync(self, slot: Slot) -> None:
        """After a failed or aborted decode, track exactly what the memory still holds."""
        eng = self.engine
        n = max(0, min(slot.n_past, eng.seq_pos_max(slot.seq_id) + 1))
        if n < slot.n_past:
            slot.truncate(n)
        # Nothing of the failed ubatch may stay behind the entries we track: a stale
        # cell at a reused position would be attended to later.
        if not eng.seq_rm(slot.seq_id, slot.n_past, -1):
            self.reset(slot)

    # ------------------------------------------------------------------ draft verify

    def rollback_mode(self, slot: Slot, n_rows: int) -> bool:
        """True if rejected positions of a verify step need a state restore (not seq_rm).

        Recurrent/hybrid memory cannot be trimmed. A sliding-window cache can, as
        llama.cpp's server trims it: a step that fits one ubatch only reuses cells
        masked for its first position (``find_slot`` tests the mask against the
        sequence's end before the step), which no position after it attends to. In
        deterministic mode the kept rows are decoded again from a restored state
        instead, so that every cell sits where a fresh run puts it (the order of
        the attention sums), unless the whole sequence fits in half a window.
        """
        eng = self.engine
        kind = eng.memory_kind
        if kind is MemoryKind.PARTIAL:
            return False
        if kind is MemoryKind.SWA:
            if not self.deterministic and n_rows <= eng.n_ubatch:
                return False
            return slot.n_past + n_rows >= eng.n_swa // 2
        return True

    def begin_verify(self, slot: Slot, rows: Sequence[Hashable]) -> Verify:
        """Before ``rows`` (the pending token and a draft) are decoded into ``slot`` in
        one call: saves what a rollback of rejected rows will need."""
        saved = (
            self.engine.state_get(slot.seq_id, PARTIAL_ONLY)
            if self.rollback_mode(slot, len(rows))
            else None
        )
        return Verify(slot, list(rows), slot.n_past, saved)

    def abort_verify(self, step: Verify) -> None:
        """The verify decode failed: put the state saved before it back (the caller
        then syncs the slot with what the memory holds)."""
        if step.saved is not None:
            self.engine.state_set(step.saved, step.slot.seq_id, PARTIAL_ONLY)

    def keep(
        self, step: Verify, used: int, redecode: Callable[[Sequence[Hashable], int], None]
    ) -> None:
        """Leave the first ``used`` rows of a verify step in the sequence, drop the rest.

        Trimmable memory drops them; otherwise the state saved by :meth:`begin_verify`
        comes back and ``redecode(rows, start)`` decodes the kept rows again (a decode
        call of the caller's, with its adapters). Raises :class:`DecodeError`, the slot
        emptied, when the memory cannot be rolled back."""
        slot, batch, n_past, saved = step.slot, step.rows, step.n_past, step.saved
        seq = slot.seq_id
        eng = self.engine
        if used == len(batch):
            self.record(slot, batch, exact=False)
            return
        if saved is None:
            if eng.seq_rm(seq, n_past + used, -1):
                self.record(slot, batch[:used], exact=False)
                return
        elif eng.state_set(saved, seq, PARTIAL_ONLY) and eng.seq_rm(seq, n_past, -1):
            try:  # back to before the step: decode the kept rows again
                redecode(batch[:used], n_past)
            except (RequestCancelledError, DecodeError):
                self.sync(slot)
                raise
            self.record(slot, batch[:used], exact=False)
            return
        self.reset(slot)  # the memory is unknown now: nothing of it may be reused
        raise DecodeError("rolling back the rejected draft tokens failed")

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_targets(
        self,
        n_keep: int,
        tokens: Sequence[Hashable],
        boundaries: tuple[int, ...],
        media: Sequence[tuple[int, int]],
        slot: Slot,
        marks: Sequence[int] = (),
    ) -> list[int]:
        """Cut points at which to save a checkpoint while this prompt is read.

        With :attr:`window_checkpoints` (and no image) the worker also saves one at the
        prompt's end, where a regenerate resumes one entry back, so the points just
        before the end need no cuts of their own.
        """
        if not self.uses_checkpoints:
            return []
        n_prompt = len(tokens)
        window = self.window_checkpoints and not media
        last = slot.checkpoints.items[-1].n_tokens if slot.checkpoints.items else None
        raw = checkpoint_targets(
            n_keep,
            n_prompt,
            n_ubatch=self.engine.n_ubatch,
            min_step=self.cache.checkpoint_min_step,
            boundaries=boundaries,
            last_at=last,
            tail=not window,
        )
        if not window:
            raw.append(n_prompt - 1)  # where a regenerate of this very prompt resumes
        out = {self._resume(t, n_prompt, media, marks) for t in raw}
        return sorted(t for t in out if n_keep < t < n_prompt)

    def save_checkpoint(self, slot: Slot, keep: frozenset[int]) -> None:
        eng = self.engine
        if slot.n_past == 0:
            return
        slot.checkpoints.add(
            Checkpoint(
                n_tokens=slot.n_past,
                pos_min=eng.seq_pos_min(slot.seq_id),
                pos_max=eng.seq_pos_max(slot.seq_id),
                data=eng.state_get(slot.seq_id, PARTIAL_ONLY),
            ),
            keep=keep,
        )

    # ------------------------------------------------------------------ unified cache room

    def footprint(self, slot: Slot, final: int) -> Footprint:
        """``slot``'s cells now and the positions its request may reach (``final``)."""
        return Footprint(slot.runs(), final)

    def room(
        self,
        tokens: Sequence[Hashable],
        needed: int,
        running: Sequence[Footprint],
        busy: set[int],
        *,
        media: Sequence[tuple[int, int]] = (),
        marks: Sequence[int] = (),
        cache_prompt: bool = True,
    ) -> Room | None:
        """Unified cache: the room a request of ``tokens`` (``needed`` positions with its
        generation) takes beside the ``running`` requests (in slots ``busy``), or None
        when the pool cannot hold them all until they end (:func:`~.pool.admits`).

        A prefix it shares with a running slot counts once: :meth:`acquire` copies it
        (``seq_cp``: the same cells) unless another fill fits too. Idle conversations
        are not counted: they are parked to make the room. Asked before :meth:`acquire`
        fills a slot: a request that must wait may not take cells (a restored
        conversation) from the running ones."""
        running = tuple(running)
        src: int | None = None
        n = 0
        runs: tuple[Run, ...] = ()
        if cache_prompt and self.engine.memory_kind is MemoryKind.PARTIAL:
            best = max(
                (s for s in self._states(tokens) if s.seq_id in busy),
                key=lambda s: s.reusable,
                default=None,
            )
            if best is not None and best.reusable > 0:
                n = self._resume(best.reusable, len(tokens), media, marks)
                if n > 0:
                    src = best.seq_id
                    held = self.slots[src].runs()
                    runs = tuple((a, min(b, n), g) for a, b, g in held if a < n)
        if not admits(self.engine.n_ctx_total, running, Footprint(runs, needed)):
            return None
        return Room(running, needed, src, n, runs)

    def fits(self, needed: int, reserved: int) -> bool:
        """Unified cache: whether a request of ``needed`` positions that shares nothing
        can start beside running requests that may still occupy ``reserved`` positions,
        counted as held apart (:meth:`room` counts shared prefixes once)."""
        return reserved + needed <= self.engine.n_ctx_total

    def _idle(self, busy: set[int], spare: set[int]) -> list[tuple[int, tuple[Run, ...]]]:
        """The idle conversations parking may take, least recently used first."""
        idle = sorted(
            (s for s in self.slots if s.seq_id not in busy | spare and s.n_past),
            key=lambda s: s.last_used,
        )
        return [(s.seq_id, s.runs()) for s in idle]

    def _room_left(
        self, running: Sequence[Footprint], new: Footprint, busy: set[int], spare: set[int]
    ) -> bool:
        """Whether ``new`` fits beside ``running`` and every idle conversation but the
        ``spare`` ones (the slot being filled, a copy's source) without parking one."""
        return self._parking_for(running, new, busy, spare) == ()

    def _park_beside_copy_source(
        self,
        states: Sequence[SlotState],
        busy: set[int],
        target: Slot,
        room: Room,
        n_prompt: int,
        media: Sequence[tuple[int, int]],
        marks: Sequence[int],
    ) -> int | None:
        """When the fill will copy an idle slot's prefix (``seq_cp``: the same cells),
        make room counting those cells once and sparing that slot, and return it. Without
        this the source was counted apart, parked to make room, and then restored from
        host RAM into the target: two whole-state copies inside one worker step where a
        ``seq_cp`` takes a fraction of a millisecond. None (nothing parked) when no idle
        slot is a better source than what admission counted, or the room still does not
        fit: the caller then counts as before."""
        own = next(x.reusable for x in states if x.seq_id == target.seq_id)
        best = best_match(states, busy | {target.seq_id})
        if best is None or best.reusable <= max(own, room.n_share):
            return None
        n = self._resume(best.reusable, n_prompt, media, marks)
        if n <= 0:
            return None
        kept, new = self._fork_room(room, best.seq_id, n)
        if not self._park_for(kept, new, busy, {target.seq_id, best.seq_id}):
            return None
        return best.seq_id

    def _fork_room(
        self, room: Room, source: int, n: int
    ) -> tuple[tuple[Footprint, ...], Footprint]:
        """The footprints a fork of ``source``'s first ``n`` positions must fit beside:
        the running ones and the source, which keeps its cells (idle: no growth); and
        the fork's own, that prefix counted once (``seq_cp``: the same cells)."""
        runs = self.slots[source].runs()
        share = tuple((a, min(b, n), g) for a, b, g in runs if a < n)
        return (*room.running, Footprint(runs, 0)), Footprint(share, room.needed)

    def _fork_fits(
        self,
        states: Sequence[SlotState],
        busy: set[int],
        room: Room,
        n_prompt: int,
        media: Sequence[tuple[int, int]],
        marks: Sequence[int],
    ) -> bool:
        """Whether a fork of the best match into an empty slot beside running requests
        stays the choice (:func:`~.slot_plan.choose_slot`'s ``fork_fits``): False when
        taking that slot in place fits the pool (idle ones parked, sparing it) and the
        fork does not, its copy of the prefix counted once beside the whole source
        (:meth:`_park_beside_copy_source`), or is not tried (the prompt shares a running
        slot's prefix, which admission counted). Nothing is parked here."""
        best = best_match(states, busy)
        if best is None or best.reusable <= room.n_share:
            return True
        spare = {best.seq_id}
        # in place: its own kept cells (a prefix shared with a running slot not counted once)
        if self._parking_for(room.running, Footprint((), room.needed), busy, spare) is None:
            return True
        if room.share_from is not None:
            return False
        n = self._resume(best.reusable, n_prompt, media, marks)
        if n <= 0:  # nothing of it to copy
            return False
        return self._parking_for(*self._fork_room(room, best.seq_id, n), busy, spare) is not None

    def _parking_for(
        self, running: Sequence[Footprint], new: Footprint, busy: set[int], spare: set[int]
    ) -> tuple[int, ...] | None:
        """The idle conversations to park (least recently used first, never a ``spare``
        one) for ``new`` to fit beside ``running`` (:func:`~.pool.idle_to_park`); None
        when even all of them leave too little room. Nothing is parked."""
        return idle_to_park(
            self.engine.n_ctx_total, [*running, new], self._idle(busy, spare), shared=True
        )

    def _park_for(
        self, running: Sequence[Footprint], new: Footprint, busy: set[int], spare: set[int]
    ) -> bool:
        """Park idle conversations (least recently used first, never a ``spare`` one)
        until ``new`` fits beside ``running`` (:func:`~.pool.idle_to_park`); False when
        they leave too little room even with every idle one parked."""
        plan = self._parking_for(running, new, busy, spare)
        if plan is None:
            return False
        for seq_id in plan:
            victim = self.slots[seq_id]
            self.park(victim)
            self.reset(victim)
        return True

    # ------------------------------------------------------------------ invariant check

    def check(self) -> None:
        """Assert that every slot's entries match its sequence in llama.cpp's memory."""
        eng = self.engine
        for slot in self.slots:
            pos_max = eng.seq_pos_max(slot.seq_id)
            if pos_max + 1 != slot.n_past:
                raise KVDesyncError(
                    f"slot {slot.seq_id}: tracks {slot.n_past} entries but the memory's "
                    f"seq_pos_max is {pos_max}"
                )
            if slot.n_past and eng.memory_kind is MemoryKind.PARTIAL:
                pos_min = eng.seq_pos_min(slot.seq_id)
                if pos_min != 0:
                    raise KVDesyncError(
                        f"slot {slot.seq_id}: trimmable memory starts at {pos_min}, not 0"
                    )
            if not 0 <= slot.exact <= slot.n_past:
                raise KVDesyncError(f"slot {slot.seq_id}: exact={slot.exact} > {slot.n_past}")
