"""One worker thread per loaded model: it owns the engine and serves requests in order.

Callers put a :class:`ChatJob` on the worker's queue and read replies from the
job's :class:`~langchain_llamacpp_local.channel.Channel`. The thread renders the
prompt, reuses the longest cached prefix (restoring a state checkpoint where the
memory cannot be trimmed), decodes only the new suffix, samples, parses, and
streams :class:`~langchain_llamacpp_local.tool_parsers.StreamDelta` items back.

Models are shared: :func:`get_worker` returns the live worker for an equal
:class:`~langchain_llamacpp_local.engine.LoadConfig`, held weakly, so the model
is freed when its last user goes.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import prompts
from .channel import Channel
from .checkpoints import Checkpoint, CheckpointStore, checkpoint_targets
from .engine import Engine, LoadConfig, MemoryKind
from .errors import (
    ContextOverflowError,
    DecodeError,
    RequestCancelledError,
    WorkerDeadError,
)
from .kv_cache import Slot, reusable_prefix
from .prompt_cache import CachedPrompt, PromptCache
from .sampling import Sampler, SamplingParams, StopMatcher, Utf8Decoder
from .tool_parsers import StreamDelta

logger = logging.getLogger(__name__)

PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


@dataclass(frozen=True)
class CacheOptions:
    """Per-model cache settings that do not change how the weights load."""

    checkpoint_max_count: int = 16
    checkpoint_max_bytes: int = 256 * 1024 * 1024
    checkpoint_min_step: int = 512
    prompt_cache_bytes: int = 1024 * 1024 * 1024


@dataclass
class ChatJob:
    """One chat request, as handed to the worker."""

    messages: list[dict[str, Any]]
    sampling: SamplingParams
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning: bool | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    cache_prompt: bool = True
    deadline: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    channel: Channel = field(default_factory=Channel)

    def cancelled(self) -> bool:
        if self.cancel.is_set():
            return True
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.cancel.set()
            return True
        return False


@dataclass
class Done:
    """Final reply item: why generation ended, usage and timings."""

    finish_reason: str
    usage: dict[str, Any]
    timings: dict[str, float]
    model_name: str
    logprobs: list[dict[str, Any]] | None = None
    parsed: Any = None  # the parser's final ParsedOutput, when tools or reasoning were parsed


@dataclass
class ModelInfo:
    """What callers may want to know about the loaded model (read once after load)."""

    model_name: str
    n_ctx: int
    n_ctx_train: int
    n_vocab: int
    n_slots: int
    memory_kind: str
    metadata: dict[str, str]
    template_origin: str
    tool_format: str


_STOP = object()


class ModelWorker:
    """The thread that owns one :class:`Engine` (see module docstring)."""

    def __init__(
        self,
        config: LoadConfig,
        cache: CacheOptions,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._dead: BaseException | None = None
        self.info: ModelInfo | None = None
        state = _WorkerState(config, cache, progress)
        self._thread = threading.Thread(
            target=_thread_main,
            args=(state, self._queue, self._ready, weakref.ref(self)),
            name=f"llamacpp-worker:{config.model_path}",
            daemon=True,
        )
        self._thread.start()
        self._ready.wait()
        if state.load_error is not None:
            raise state.load_error
        self.info = state.info
        # Stop the thread when the last user drops this worker.
        self._finalizer = weakref.finalize(self, self._queue.put, _STOP)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def submit(self, job: ChatJob) -> Channel:
        if not self.alive:
            raise WorkerDeadError(
                f"the worker for {self.config.model_path} has stopped"
                + (f": {self._dead!r}" if self._dead else "")
            )
        self._queue.put(job)
        return job.channel

    def call(self, fn: Callable[[_WorkerState], Any]) -> Any:
        """Run ``fn(state)`` on the worker thread and return its result (tests, tools)."""
        ch = Channel()
        if not self.alive:
            raise WorkerDeadError(f"the worker for {self.config.model_path} has stopped")
        self._queue.put((fn, ch))
        kind, value = ch.get()
        if kind == "error":
            raise value
        return value

    def stop(self, timeout: float | None = 30.0) -> None:
        self._finalizer()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _mark_dead(self, exc: BaseException) -> None:
        self._dead = exc


# --------------------------------------------------------------------------- registry

_registry: dict[tuple[LoadConfig, CacheOptions], weakref.ref[ModelWorker]] = {}
_registry_lock = threading.Lock()


def get_worker(
    config: LoadConfig,
    cache: CacheOptions,
    progress: Callable[[float], None] | None = None,
) -> ModelWorker:
    """The live worker for these settings, loading the model if none is alive."""
    key = (config, cache)
    with _registry_lock:
        ref = _registry.get(key)
        worker = ref() if ref is not None else None
        if worker is not None and worker.alive:
            return worker
        worker = ModelWorker(config, cache, progress)
        _registry[key] = weakref.ref(worker, lambda _r, k=key: _forget(k, _r))
        return worker


def shutdown_all(timeout: float = 10.0) -> None:
    """Stop every worker (at interpreter exit): running requests are cancelled."""
    with _registry_lock:
        workers = [w for r in _registry.values() if (w := r()) is not None]
    for w in workers:
        w._finalizer()
    for w in workers:
        w._thread.join(timeout)


atexit.register(shutdown_all)


def _forget(key: tuple[LoadConfig, CacheOptions], ref: weakref.ref[ModelWorker]) -> None:
    with _registry_lock:
        if _registry.get(key) is ref:
            del _registry[key]


def live_workers() -> int:
    """How many models are loaded (for tests and diagnostics)."""
    with _registry_lock:
        return sum(1 for r in _registry.values() if (w := r()) is not None and w.alive)


# --------------------------------------------------------------------------- thread


def _thread_main(
    state: _WorkerState,
    q: queue.SimpleQueue[Any],
    ready: threading.Event,
    owner: weakref.ref[ModelWorker],
) -> None:
    try:
        state.load()
    except BaseException as exc:  # reported to the constructor
        state.load_error = exc
        ready.set()
        return
    ready.set()
    try:
        state.run(q)
    except BaseException as exc:  # the engine is unusable: fail everything fast
        logger.exception("llama.cpp worker died")
        w = owner()
        if w is not None:
            w._mark_dead(exc)
        state.fail_all(WorkerDeadError(f"the model worker died: {exc!r}"))
        _drain(q, WorkerDeadError(f"the model worker died: {exc!r}"))
    finally:
        state.close()
        _drain(q, RequestCancelledError("the model was closed"))


def _drain(q: queue.SimpleQueue[Any], exc: BaseException) -> None:
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            return
        if isinstance(item, ChatJob):
            item.channel.put(("error", exc))
        elif isinstance(item, tuple):
            item[1].put(("error", exc))


@dataclass
class _Active:
    """A request that owns a slot: prefilling its prompt or generating."""

    job: ChatJob
    prepared: prompts.PreparedPrompt
    slot: Slot
    n_keep: int
    max_new: int
    targets: list[int]
    keep: frozenset[int]
    sampler: Sampler
    parser: prompts.OutputParser
    decoder: Utf8Decoder = field(default_factory=Utf8Decoder)
    stopper: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    logprobs: list[dict[str, Any]] | None = None
    n_gen: int = 0
    pending: int | None = None  # sampled token to decode in the next step
    t_start: float = field(default_factory=time.perf_counter)
    t_prefill: float = 0.0
    retried: bool = False
    streamed: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prepared.tokens

    @property
    def prefilling(self) -> bool:
        return self.slot.n_past < len(self.prepared.tokens)


class _WorkerState:
    """Everything that lives on the worker thread."""

    def __init__(
        self,
        config: LoadConfig,
        cache: CacheOptions,
        progress: Callable[[float], None] | None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.progress = progress
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.info: ModelInfo | None = None
        self.slots: list[Slot] = []
        self.format: prompts.ChatFormat | None = None
        self.ram = PromptCache(max_bytes=cache.prompt_cache_bytes)
        self.pending: deque[ChatJob] = deque()
        self.active: list[_Active] = []
        self._clock = 0

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        eng = Engine(self.config, self.progress)
        self.engine = eng
        self.format = prompts.ChatFormat.from_engine(eng)
        self.slots = [self._new_slot(i) for i in range(eng.n_seq_max)]
        name = eng.metadata.get("general.name") or self.config.model_path.rsplit("/", 1)[-1]
        self.info = ModelInfo(
            model_name=name,
            n_ctx=eng.n_ctx,
            n_ctx_train=eng.n_ctx_train,
            n_vocab=eng.n_vocab,
            n_slots=eng.n_seq_max,
            memory_kind=eng.memory_kind.value,
            metadata=dict(eng.metadata),
            template_origin=self.format.template.origin,
            tool_format=self.format.tool_format,
        )

    def _new_slot(self, seq_id: int) -> Slot:
        return Slot(
            seq_id=seq_id,
            checkpoints=CheckpointStore(
                max_count=self.cache.checkpoint_max_count,
                max_bytes=self.cache.checkpoint_max_bytes,
            ),
        )

    def close(self) -> None:
        self.fail_all(RequestCancelledError("the model was closed"))
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def fail_all(self, exc: BaseException) -> None:
        for act in self.active:
            act.sampler.close()
            act.job.channel.put(("error", exc))
        self.active.clear()
        while self.pending:
            self.pending.popleft().channel.put(("error", exc))

    # ------------------------------------------------------------------ main loop

    def run(self, q: queue.SimpleQueue[Any]) -> None:
        """Serve until told to stop: admit requests into free slots, then step them all."""
        while True:
            idle = not self.active and not self.pending
            try:
                item = q.get() if idle else q.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    return
                if isinstance(item, tuple):
                    fn, ch = item
                    try:
                        ch.put(("ok", fn(self)))
                    except Exception as exc:
                        ch.put(("error", exc))
                else:
                    self.pending.append(item)
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    item = None
            self._admit()
            if self.active:
                self._step()

    def _busy(self) -> set[int]:
        return {a.slot.seq_id for a in self.active}

    def _admit(self) -> None:
        """Start queued requests, in arrival order, while a slot is free."""
        while self.pending:
            job = self.pending[0]
            if job.cancelled():  # the caller is gone: skip, don't run
                self.pending.popleft()
                job.channel.put(("error", _cancel_error(job)))
                continue
            busy = self._busy()
            if len(busy) >= len(self.slots):
                return
            self.pending.popleft()
            try:
                act = self._start(job, busy)
            except Exception as exc:
                job.channel.put(("error", exc))
                continue
            if act is None:  # not enough free KV memory while others run: wait
                self.pending.appendleft(job)
                return
            self.active.append(act)

    # ------------------------------------------------------------------ starting a request

    def _start(self, job: ChatJob, busy: set[int]) -> _Active | None:
        eng = self.engine
        assert eng is not None and self.format is not None
        prepared = prompts.prepare(self.format, job, eng)
        tokens = prepared.tokens
        n_prompt = len(tokens)
        if n_prompt == 0:
            raise ValueError("the rendered prompt is empty")
        budget = eng.n_ctx - n_prompt
        if budget <= 0 or (job.max_tokens is not None and job.max_tokens > budget):
            raise ContextOverflowError(
                f"prompt of {n_prompt} tokens"
                + (f" plus max_tokens={job.max_tokens}" if job.max_tokens is not None else "")
                + f" does not fit the context window of {eng.n_ctx} tokens"
                " (raise n_ctx, lower max_tokens or shorten the conversation)"
            )
        max_new = budget if job.max_tokens is None else job.max_tokens
        if busy and not self._make_room(n_prompt + max_new, busy):
            return None
        slot = self._choose_slot(tokens, busy)
        if not job.cache_prompt:
            self._reset_slot(slot)
        else:
            self._make_room(n_prompt + max_new, busy | {slot.seq_id}, reserve=slot)
        n_keep = self._restore_point(slot, reusable_prefix(slot.entries, tokens))
        targets: list[int] = []
        if eng.memory_kind is not MemoryKind.PARTIAL and self.cache.checkpoint_max_count > 0:
            media = prepared.media
            last = slot.checkpoints.items[-1].n_tokens if slot.checkpoints.items else None
            targets = checkpoint_targets(
                n_keep,
                n_prompt,
                n_ubatch=eng.n_ubatch,
                min_step=self.cache.checkpoint_min_step,
                boundaries=prepared.boundaries,
                last_at=last,
            )
            # never inside an image: its positions are written by one mtmd call
            targets = [
                t for t in targets if not any(s < t < s + m.n_pos for s, m in media.items())
            ]
        sampler = Sampler(eng.vocab, prepared.sampling, n_ctx=eng.n_ctx)
        return _Active(
            job=job,
            prepared=prepared,
            slot=slot,
            n_keep=n_keep,
            max_new=max_new,
            targets=targets,
            keep=frozenset(targets),
            sampler=sampler,
            parser=prepared.make_parser(),
            stopper=StopMatcher(prepared.stop),
            logprobs=[] if job.logprobs else None,
        )

    def _touch(self, slot: Slot) -> Slot:
        self._clock += 1
        slot.last_used = self._clock
        return slot

    def _choose_slot(self, tokens: list[int], busy: set[int]) -> Slot:
        """Pick the free slot for ``tokens`` (llama.cpp server's slot selection).

        The free slot sharing the longest prefix wins when it keeps most of what it
        holds; otherwise the request takes an empty or least recently used slot and
        the shared prefix is copied from whichever slot has it (attention KV is
        shared between sequences of a unified cache, so the copy costs nothing).
        A conversation pushed out of its slot is parked in the host-RAM cache, and
        one found there is restored instead of being decoded again.
        """
        eng = self.engine
        assert eng is not None
        free = [s for s in self.slots if s.seq_id not in busy]
        lcp = {s.seq_id: reusable_prefix(s.entries, tokens) for s in self.slots}
        best_free = max(free, key=lambda s: (lcp[s.seq_id], -s.last_used))
        n_best = lcp[best_free.seq_id]
        empty = [s for s in free if s.n_past == 0]
        can_copy = eng.memory_kind is MemoryKind.PARTIAL
        if can_copy and empty and 0 < n_best < best_free.n_past:
            target = empty[0]  # fork: keep the other conversation whole, copy the prefix
        elif n_best > 0 and (n_best * 10 >= len(tokens) or len(free) == 1):
            target = best_free  # similar enough (llama.cpp's slot_prompt_similarity 0.1)
            if n_best * 2 < target.n_past:
                self._park(target)  # most of it is about to be trimmed: keep a copy
        else:
            target = empty[0] if empty else min(free, key=lambda s: s.last_used)
        n_target = lcp[target.seq_id]

        cached, n_cached = self.ram.best(tokens)
        n_cached = min(n_cached, len(tokens) - 1)
        src = max(self.slots, key=lambda s: lcp[s.seq_id])
        n_src = lcp[src.seq_id]
        if cached is not None and n_cached > max(n_target, n_src) and n_cached * 4 >= len(cached.entries):
            self._park(target)
            self._reset_slot(target)
            if eng.state_set(cached.data, target.seq_id, 0):
                self.ram.take(cached)
                target.entries = list(cached.entries)
                for ck in cached.checkpoints:
                    target.checkpoints.add(ck)
                logger.debug("restored %d cached entries from host RAM", len(cached.entries))
            else:
                self._reset_slot(target)
        elif (
            n_src > n_target
            and src is not target
            and eng.memory_kind is MemoryKind.PARTIAL
        ):
            self._park(target)
            self._reset_slot(target)
            eng.seq_cp(src.seq_id, target.seq_id, 0, n_src)
            target.entries = list(src.entries[:n_src])
            logger.debug("copied a %d-entry prefix from slot %d", n_src, src.seq_id)
        elif target.n_past and n_target * 2 < target.n_past:
            self._park(target)
        return self._touch(target)

    def _park(self, slot: Slot) -> None:
        """Save a conversation to the host-RAM cache before its slot is reused."""
        eng = self.engine
        assert eng is not None
        if slot.n_past == 0 or self.ram.max_bytes <= 0:
            return
        data = eng.state_get(slot.seq_id, 0)
        self.ram.put(
            CachedPrompt(tuple(slot.entries), data, list(slot.checkpoints.items))
        )

    def _make_room(self, needed: int, busy: set[int], reserve: Slot | None = None) -> bool:
        """Free KV cells (shared by all slots) for a request needing ``needed`` positions.

        Idle slots are parked in host RAM and cleared, least recently used first.
        Returns False when running requests hold too much for it to fit now.
        """
        eng = self.engine
        assert eng is not None
        if sum(s.n_past for s in self.slots if s.seq_id in busy) + needed > eng.n_ctx:
            return False
        idle = sorted(
            (s for s in self.slots if s.seq_id not in busy and s is not reserve and s.n_past),
            key=lambda s: s.last_used,
        )
        while idle and sum(s.n_past for s in self.slots if s is not reserve) + needed > eng.n_ctx:
            victim = idle.pop(0)
            self._park(victim)
            self._reset_slot(victim)
        return True

    # ------------------------------------------------------------------ cache reuse

    def _reset_slot(self, slot: Slot) -> None:
        assert self.engine is not None
        self.engine.seq_rm(slot.seq_id, -1, -1)
        slot.entries.clear()
        slot.checkpoints.clear()

    def _restore_point(self, slot: Slot, n_keep: int) -> int:
        """Trim ``slot`` to at most ``n_keep`` entries; returns how many it really keeps.

        Attention KV is trimmed in place. Memory that cannot be trimmed (recurrent,
        hybrid) or whose sliding window already dropped the positions needed is
        rolled back to the newest checkpoint at or before ``n_keep``; without one the
        sequence is cleared.
        """
        eng = self.engine
        assert eng is not None
        seq = slot.seq_id
        kind = eng.memory_kind
        if n_keep >= slot.n_past:  # pure extension: nothing to trim
            return slot.n_past
        if kind is MemoryKind.PARTIAL:
            if eng.seq_rm(seq, n_keep, -1):
                slot.truncate(n_keep)
                return n_keep
            self._reset_slot(slot)
            return 0
        if kind is MemoryKind.SWA and n_keep > 0 and self._swa_window_ok(slot, n_keep):
            if eng.seq_rm(seq, n_keep, -1):
                slot.truncate(n_keep)
                return n_keep
        ck = slot.checkpoints.best_for(n_keep)
        if ck is not None and eng.state_set(ck.data, seq, PARTIAL_ONLY):
            if eng.seq_rm(seq, ck.n_tokens, -1):
                logger.debug(
                    "restored the checkpoint at %d entries (common prefix %d, cached %d)",
                    ck.n_tokens,
                    n_keep,
                    slot.n_past,
                )
                slot.truncate(ck.n_tokens)
                return ck.n_tokens
        logger.debug("no checkpoint at or before %d entries: re-reading the prompt", n_keep)
        self._reset_slot(slot)
        return 0

    def _swa_window_ok(self, slot: Slot, n_keep: int) -> bool:
        """True if the SWA cache still holds the window needed to resume at ``n_keep``."""
        eng = self.engine
        assert eng is not None
        pos_min = eng.seq_pos_min(slot.seq_id)
        return pos_min <= max(0, n_keep - eng.n_swa)

    def _save_checkpoint(self, act: _Active) -> None:
        eng = self.engine
        assert eng is not None
        slot = act.slot
        if slot.n_past == 0:
            return
        slot.checkpoints.add(
            Checkpoint(
                n_tokens=slot.n_past,
                pos_min=eng.seq_pos_min(slot.seq_id),
                pos_max=eng.seq_pos_max(slot.seq_id),
                data=eng.state_get(slot.seq_id, PARTIAL_ONLY),
            ),
            keep=act.keep,
        )

    # ------------------------------------------------------------------ one batch step

    def _step(self) -> None:
        """Build one batch from every active request, decode it, sample, stream."""
        eng = self.engine
        assert eng is not None
        for act in list(self.active):
            if act.job.cancelled():
                self._finish_error(act, _cancel_error(act.job))
                continue
            media = act.prepared.media
            try:
                while act.prefilling and act.slot.n_past in media:
                    self._eval_media(act, media[act.slot.n_past])
            except DecodeError as exc:
                self._finish_error(act, exc)
        if not self.active:
            return
        toks: list[int] = []
        pos: list[int] = []
        seqs: list[int] = []
        outs: list[bool] = []
        plan: list[tuple[_Active, int, int]] = []  # (request, batch offset, count)
        budget = eng.n_batch
        for act in self.active:
            if act.pending is not None:
                plan.append((act, len(toks), 1))
                toks.append(act.pending)
                pos.append(act.slot.n_past)
                seqs.append(act.slot.seq_id)
                outs.append(True)
                budget -= 1
        for act in self.active:
            if budget <= 0:
                break
            if act.pending is not None or not act.prefilling:
                continue
            start = act.slot.n_past
            stop_at = next((t for t in act.targets if t > start), len(act.tokens))
            stop_at = min([stop_at, *(p for p in act.prepared.media if p > start)])
            n = min(budget, stop_at - start)
            plan.append((act, len(toks), n))
            for i in range(n):
                toks.append(act.tokens[start + i])
                pos.append(start + i)
                seqs.append(act.slot.seq_id)
                outs.append(start + i == len(act.tokens) - 1)
            budget -= n
        if not toks:
            return
        members = [a for a, _, _ in plan]
        # The abort callback runs on every graph node; it only pays off for prompt
        # chunks; a one-token step is checked between steps anyway.
        prefill = len(toks) > sum(1 for a in members if a.pending is not None)
        try:
            eng.decode_batch(
                toks,
                pos,
                seqs,
                outs,
                cancel=(lambda: all(a.job.cancelled() for a in members)) if prefill else None,
            )
        except (RequestCancelledError, DecodeError) as exc:
            self._after_failed_decode(plan, exc)
            return
        for act, off, n in plan:
            if act.pending is not None:
                act.slot.entries.append(act.pending)
                act.pending = None
                self._sample(act, off)
                continue
            start = act.slot.n_past
            act.slot.entries.extend(act.tokens[start : start + n])
            if act.prefilling:
                if act.targets and act.slot.n_past == act.targets[0]:
                    act.targets.pop(0)
                    self._save_checkpoint(act)
            else:
                act.t_prefill = time.perf_counter()
                if eng.memory_kind is not MemoryKind.PARTIAL and self.cache.checkpoint_max_count > 0:
                    # the end of the prompt: where the next turn diverges when a
                    # template rewrites the reply (e.g. drops reasoning)
                    self._save_checkpoint(act)
                self._sample(act, off + n - 1)

    def _eval_media(self, act: _Active, media: Any) -> None:
        """Encode and decode one image of a prompt (outside the shared batch)."""
        eng = self.engine
        assert eng is not None
        slot = act.slot
        start = slot.n_past
        try:
            eng.eval_media(media, start, slot.seq_id)
        except DecodeError:
            self._sync_slot(slot)
            raise
        slot.entries.extend(act.tokens[start : start + media.n_pos])
        if not act.prefilling:  # an image at the very end of the prompt
            raise DecodeError("a prompt cannot end with an image: add text after it")

    def _sync_slot(self, slot: Slot) -> None:
        """After a failed or aborted decode, track exactly what the memory still holds."""
        eng = self.engine
        assert eng is not None
        n = max(0, min(slot.n_past, eng.seq_pos_max(slot.seq_id) + 1))
        if n < slot.n_past:
            slot.truncate(n)
        # Nothing of the failed ubatch may stay behind the entries we track: a stale
        # cell at a reused position would be attended to later.
        if not eng.seq_rm(slot.seq_id, slot.n_past, -1):
            self._reset_slot(slot)

    def _after_failed_decode(
        self, plan: list[tuple[_Active, int, int]], exc: BaseException
    ) -> None:
        """Keep each slot's entries equal to what the memory still holds, then recover."""
        eng = self.engine
        assert eng is not None
        for act, _, _ in plan:
            slot = act.slot
            self._sync_slot(slot)
            if act.job.cancelled():
                self._finish_error(act, _cancel_error(act.job))
            elif isinstance(exc, DecodeError) and not act.streamed and not act.retried:
                # reuse failed before anything was streamed: start over once, from scratch
                logger.warning("decode failed (%s); retrying the request from scratch", exc)
                self._reset_slot(slot)
                act.retried = True
                act.n_keep = 0
                act.targets = [t for t in act.keep if t > 0]
                act.targets.sort()
            else:
                self._finish_error(act, exc)

    # ------------------------------------------------------------------ sampling

    def _sample(self, act: _Active, idx: int) -> None:
        eng = self.engine
        assert eng is not None
        tok = act.sampler.sample(eng.ctx, idx)
        if act.logprobs is not None:
            act.logprobs.append(_logprob_entry(eng, idx, tok, act.job.top_logprobs))
        if eng.is_eog(tok):
            self._finish(act, "stop")
            return
        act.n_gen += 1
        if self._emit(act, act.decoder.feed(eng.token_piece(tok))):
            self._finish(act, "stop", stopped=True)
        elif act.n_gen >= act.max_new:
            self._finish(act, "length")
        else:
            act.pending = tok

    def _emit(self, act: _Active, text: str) -> bool:
        """Stream ``text`` through stop strings and the output parser; True if a stop matched."""
        if not text:
            return False
        out, stopped = act.stopper.feed(text)
        if out:
            for d in act.parser.feed(out):
                act.streamed = True
                act.job.channel.put(("delta", d))
        return stopped

    def _finish(self, act: _Active, reason: str, *, stopped: bool = False) -> None:
        put = act.job.channel.put
        if not stopped:
            if self._emit(act, act.decoder.flush()):
                reason = "stop"
            else:
                rest = act.stopper.flush()
                if rest:
                    for d in act.parser.feed(rest):
                        put(("delta", d))
        for d in act.parser.finish():
            put(("delta", d))
        now = time.perf_counter()
        t_prefill = act.t_prefill or now
        n_prompt = len(act.tokens)
        n_decoded = n_prompt - act.n_keep
        prompt_ms = (t_prefill - act.t_start) * 1000
        gen_ms = (now - t_prefill) * 1000
        usage = {
            "input_tokens": n_prompt,
            "output_tokens": act.n_gen,
            "total_tokens": n_prompt + act.n_gen,
            "input_token_details": {"cache_read": act.n_keep},
        }
        timings = {
            "prompt_n": float(n_decoded),
            "prompt_ms": prompt_ms,
            "prompt_per_second": n_decoded / (prompt_ms / 1000) if prompt_ms > 0 else 0.0,
            "predicted_n": float(act.n_gen),
            "predicted_ms": gen_ms,
            "predicted_per_second": act.n_gen / (gen_ms / 1000) if gen_ms > 0 else 0.0,
        }
        assert self.info is not None
        parsed = getattr(act.parser, "result", None)
        self._release(act)
        put(("done", Done(reason, usage, timings, self.info.model_name, act.logprobs, parsed)))

    def _finish_error(self, act: _Active, exc: BaseException) -> None:
        self._release(act)
        act.job.channel.put(("error", exc))

    def _release(self, act: _Active) -> None:
        act.sampler.close()
        if act in self.active:
            self.active.remove(act)


def _logprob_entry(eng: Engine, idx: int, tok: int, top: int) -> dict[str, Any]:
    logits = eng.logits(idx).astype(np.float64)
    m = logits.max()
    lse = m + np.log(np.exp(logits - m).sum())
    entry: dict[str, Any] = {
        "token": eng.token_piece(tok).decode("utf-8", errors="replace"),
        "id": int(tok),
        "logprob": float(logits[tok] - lse),
    }
    if top > 0:
        k = min(top, len(logits))
        idxs = np.argpartition(-logits, k - 1)[:k]
        idxs = idxs[np.argsort(-logits[idxs])]
        entry["top_logprobs"] = [
            {
                "token": eng.token_piece(int(i)).decode("utf-8", errors="replace"),
                "id": int(i),
                "logprob": float(logits[i] - lse),
            }
            for i in idxs
        ]
    return entry


def _cancel_error(job: ChatJob) -> BaseException:
    if job.deadline is not None and time.monotonic() >= job.deadline:
        return TimeoutError("the request timed out")
    return RequestCancelledError("the request was cancelled")


__all__ = [
    "CacheOptions",
    "ChatJob",
    "Done",
    "ModelInfo",
    "ModelWorker",
    "StreamDelta",
    "get_worker",
    "live_workers",
]
