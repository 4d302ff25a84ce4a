"""One worker thread per loaded model: it owns the engine and serves requests in order.

Callers (the front end, ``chat/``) put a token-level
:class:`~langchain_llamacpp_local.runtime.requests.EngineRequest` on the worker's queue and
read its reply from the request's :class:`~langchain_llamacpp_local.runtime.channel.Channel`.
The thread reuses the longest cached prefix (restoring a state checkpoint where the
memory cannot be trimmed), decodes only the new suffix, samples, detokenizes, applies
stop strings and streams typed items back (:class:`TextDelta`, then :class:`Finished`
or :class:`Failed`). It renders, tokenizes and parses nothing: the caller's side does.

Models are shared: :mod:`~langchain_llamacpp_local.runtime.registry` keeps one worker per
:class:`~langchain_llamacpp_local.llama.loading.LoadConfig` (keep-alive, loaded-model budget).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from langchain_llamacpp_local.cache.disk import PendingSave
from langchain_llamacpp_local.cache.pool import waits_for_prefix
from langchain_llamacpp_local.cache.slot_memory import CacheOptions, SlotMemory, Verify
from langchain_llamacpp_local.cache.slots import Slot, common_prefix_len
from langchain_llamacpp_local.errors import (
    ContextOverflowError,
    DecodeError,
    ImageInputError,
    InvalidRequestError,
    NonFiniteOutputError,
    RequestCancelledError,
    WorkerDeadError,
)
from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.omp import release_team
from langchain_llamacpp_local.llama.probes import MemoryKind
from langchain_llamacpp_local.llama.sampling import Sampler
from langchain_llamacpp_local.llama.text_stream import StopMatcher, Utf8Decoder
from langchain_llamacpp_local.runtime.channel import Channel
from langchain_llamacpp_local.runtime.logprobs import logprob_entry
from langchain_llamacpp_local.runtime.requests import (
    EngineRequest,
    Failed,
    Finished,
    PromptProgress,
    ScoreRequest,
    TextDelta,
    cancel_check,
    cancel_error,
)
from langchain_llamacpp_local.runtime.scheduler import (
    PieceRules,
    PromptPiece,
    PromptRead,
    StepBudget,
    StepPlan,
    by_priority,
    effective_priority,
    plan_step,
    row_limit,
)
from langchain_llamacpp_local.runtime.scoring import LabelWork
from langchain_llamacpp_local.runtime.speculative import DraftController, NgramProposer, Proposer
from langchain_llamacpp_local.runtime.stats import SlotStats, WorkerStats
from langchain_llamacpp_local.runtime.step_cost import CostFit
from langchain_llamacpp_local.runtime.thinking import ThinkCounter

logger = logging.getLogger(__name__)


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
    #: the chat template's origin and tool-call format: the front end's (resolved once
    #: per loaded model on the caller's side); empty in the worker's own copy
    template_origin: str = ""
    tool_format: str = ""
    #: MiB of weights per buffer type, as llama.cpp reported the load (CPU_REPACK, AMX...)
    weight_buffers: dict[str, float] = field(default_factory=dict)
    #: the CPU threads chosen at load (``n_threads``, ``n_threads_batch``, the usable
    #: CPUs they were chosen from and why); under load fewer may run at a time
    threads: dict[str, object] = field(default_factory=dict)


@dataclass
class _StatsAsk:
    """A queued request for a :class:`WorkerStats` snapshot."""

    channel: Channel = field(default_factory=Channel)


_STOP = object()

#: How long the worker waits at most for a streaming reader to take a reply's first
#: text before decoding on (see runtime.channel): a reader's turn through LangChain's
#: stream machinery takes well under a millisecond; this bounds a slow one's cost.
READER_WAIT_S = 0.005


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
        self._preparing_lock = threading.Lock()
        state = _WorkerState(config, cache, progress)
        self._state = state
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

    @property
    def engine(self) -> Engine:
        """The loaded engine, for what callers may read of it from their own thread: the
        vocabulary (tokenizing, token texts), metadata and sizes (llama.cpp's vocabulary
        is read-only once loaded, as its server's HTTP threads rely on)."""
        eng = self._state.engine
        if eng is None:
            raise WorkerDeadError(f"the worker for {self.config.model_path} has stopped")
        return eng

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Count a request as arriving while its caller prepares and queues it: the
        worker's decisions then know it is coming (a burst of requests reaches the queue
        over milliseconds, and the first one admitted does not decode alone)."""
        with self._preparing_lock:
            self._state.preparing += 1
        try:
            yield
        finally:
            with self._preparing_lock:
                self._state.preparing -= 1

    def submit(self, job: EngineRequest) -> Channel:
        if not self.alive:
            job.close_sampler()
            raise WorkerDeadError(
                f"the worker for {self.config.model_path} has stopped"
                + (f": {self._dead!r}" if self._dead else "")
            )
        self._queue.put(job)
        return job.channel

    def stats(self) -> WorkerStats:
        """A snapshot of the slots and queues, taken on the worker thread between steps."""
        ask = _StatsAsk()
        if not self.alive:
            raise WorkerDeadError(f"the worker for {self.config.model_path} has stopped")
        self._queue.put(ask)
        got = ask.channel.get()
        if isinstance(got, BaseException):
            raise got
        assert isinstance(got, WorkerStats)
        return got

    def call(self, fn: Callable[[_WorkerState], Any]) -> Any:
        """Run ``fn(state)`` on the worker thread between steps and return its result.

        A test hook (tests install probes or faults on the engine with it): the package
        itself never uses it; its work reaches the worker as typed requests
        (:class:`EngineRequest`, :class:`ScoreRequest`) and :meth:`stats` reads it."""
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
        try:  # what loaded before the failure (the engine, when the draft model fails)
            state.close()
        except BaseException:
            logger.exception("freeing a failed load failed")
        ready.set()
        return
    ready.set()
    try:
        state.run(q)
    except BaseException as exc:  # llama.cpp itself failed: fail everything fast
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
        if isinstance(item, EngineRequest):
            item.close_sampler()
            item.channel.put(Failed(exc))
        elif isinstance(item, tuple):
            item[1].put(("error", exc))
        elif isinstance(item, _StatsAsk):
            item.channel.put(exc)


@dataclass
class _Waiting:
    """A queued request (its prompt prepared by the front end before it was queued)."""

    job: EngineRequest
    step: int = 0  # the worker's step count when it was queued (background aging)
    t_queued: float = 0.0  # the worker's clock then


@dataclass
class _Speculation:
    """A speculating request's proposer, draft-length controller and token history."""

    kind: str
    proposer: Proposer | None  # None: speculation is off for this request (see limit)
    controller: DraftController
    limit: int  # most draft tokens per verify step (exactness, n_batch)
    history: list[int]  # text tokens of the sequence (after its last image), pending last
    drafted: int = 0  # totals reported in the metadata
    accepted: int = 0


@dataclass
class _Active:
    """A request that owns a slot: reading its prompt or generating."""

    job: EngineRequest
    slot: Slot
    n_keep: int
    cache: dict[str, Any] | None
    max_new: int
    targets: list[int]
    keep: frozenset[int]
    sampler: Sampler | None  # None: a scoring request (it never samples)
    decoder: Utf8Decoder = field(default_factory=Utf8Decoder)
    stopper: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    logprobs: list[dict[str, Any]] | None = None
    logprobs_sent: int = 0  # entries of logprobs already sent with a text item
    marks: list[int] = field(default_factory=list)  # chunking.marker_cuts of the prompt
    n_gen: int = 0
    pending: int | None = None  # sampled token to decode in the next step
    t_start: float = field(default_factory=time.perf_counter)
    t_prefill: float = 0.0
    retried: bool = False
    text_sent: bool = False  # a text item of the reply went out
    spec: _Speculation | None = None
    think: ThinkCounter | None = None
    labels: LabelWork | None = None  # a scoring request's labels (runtime.scoring)
    queued: _Waiting | None = None  # when it was queued (background aging)

    @property
    def tokens(self) -> list[Any]:
        return self.job.tokens

    @property
    def media(self) -> dict[int, Any]:
        """Image chunks by the position where each starts."""
        return self.job.media

    @property
    def lora_start(self) -> int:
        return self.job.lora_start

    @property
    def prefilling(self) -> bool:
        return self.slot.n_past < len(self.job.tokens)

    @property
    def reserved(self) -> int:
        """KV positions this request may occupy until it ends (unified-cache admission)."""
        return len(self.job.tokens) + self.max_new


class _WorkerState:
    """Everything that lives on the worker thread: the scheduler over a :class:`SlotMemory`.

    Each loop iteration admits queued requests into free slots (interactive ones
    first; in the unified pool as its cells are counted, :mod:`~.cache.pool`), then
    decodes one step: the next token of every generating request, and a piece (see
    :mod:`chunking`) of the oldest request still reading its prompt, the younger
    ones' pieces filling the rest of its call, cut to the stall budget while an
    interactive request generates (:mod:`~.scheduler`), and at most one label call of a
    scoring request (:class:`ScoreRequest`) whose prompt is read. In deterministic
    mode pieces lie on a fixed grid, are never mixed with other sequences and
    generation steps share a call only in groups the kernels keep exact, so a request
    computes the same logits whatever runs beside it.

    Anything that goes wrong while starting, sampling or streaming one request
    becomes that request's error; only a failure of llama.cpp itself (an
    exception out of the engine other than a decode error) stops the worker.
    """

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
        self.memory: SlotMemory | None = None
        self.load_error: BaseException | None = None
        self.info: ModelInfo | None = None
        self.pending: deque[_Waiting] = deque()
        #: requests their callers are preparing now (:meth:`ModelWorker.preparing`)
        self.preparing = 0
        self.active: list[_Active] = []
        #: a request whose first text this step sent (see :meth:`_hand_to_reader`)
        self._first_text: _Active | None = None
        self.proposers: dict[str, Proposer] = {}
        self.lora_turn = 0  # steps so far: rotates which adapter group decodes first
        #: the decode calls' measured cost, for the stall budget's piece sizes
        self.cost = CostFit()
        #: what decode calls and waits are timed with (a test's simulated clock)
        self.clock: Callable[[], float] = time.perf_counter
        #: conversations finished this step, their disk-cache places still to fill
        self.saves: list[tuple[Slot, PendingSave]] = []

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        eng = Engine(self.config, self.progress)
        self.engine = eng
        self.memory = SlotMemory(eng, self.cache)
        self.proposers["ngram"] = NgramProposer()
        if self.config.draft_model_path:
            from langchain_llamacpp_local.llama.draft import DraftModel

            self.proposers["draft"] = DraftModel(self.config, eng)
        name = eng.metadata.get("general.name") or self.config.model_path.rsplit("/", 1)[-1]
        self.info = ModelInfo(
            model_name=name,
            n_ctx=eng.n_ctx,
            n_ctx_train=eng.n_ctx_train,
            n_vocab=eng.n_vocab,
            n_slots=eng.n_seq_max,
            memory_kind=eng.memory_kind.value,
            metadata=dict(eng.metadata),
            weight_buffers=dict(eng.weight_buffers),
            threads=eng.thread_plan.as_dict(),
        )

    @property
    def slots(self) -> list[Slot]:
        return self.memory.slots if self.memory is not None else []

    def close(self) -> None:
        self.fail_all(RequestCancelledError("the model was closed"))
        for proposer in self.proposers.values():
            try:
                proposer.close()
            except Exception:
                logger.exception("closing a draft proposer failed")
        self.proposers.clear()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def fail_all(self, exc: BaseException) -> None:
        for act in self.active:
            if act.sampler is not None:
                act.sampler.close()
            act.job.channel.put(Failed(exc))
        self.active.clear()
        while self.pending:
            job = self.pending.popleft().job
            job.close_sampler()
            job.channel.put(Failed(exc))

    # ------------------------------------------------------------------ main loop

    def run(self, q: queue.SimpleQueue[Any]) -> None:
        """Serve until told to stop: admit requests into free slots, then step them all."""
        while True:
            idle = not self.active and not self.pending
            if idle:
                # nothing to decode: this thread's OpenMP helpers go, so that a pool kept
                # idle here never slows another model's barriers (see llama.omp)
                release_team()
            try:
                item = q.get() if idle else q.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    return
                if isinstance(item, _StatsAsk):
                    item.channel.put(self.stats())
                elif isinstance(item, tuple):
                    fn, ch = item
                    try:
                        ch.put(("ok", fn(self)))
                    except Exception as exc:
                        ch.put(("error", exc))
                else:
                    self.enqueue(item)
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    item = None
            self.tick()

    def enqueue(self, job: EngineRequest) -> None:
        """Queue ``job`` for admission (noting when, for background aging)."""
        self.pending.append(_Waiting(job, self.lora_turn, self.clock()))

    def tick(self) -> None:
        """One loop iteration: admit what fits, decode one step, save what finished."""
        try:
            self._admit()
            if self.active:
                self._step()
        finally:
            self._persist_finished()
        if self.memory is not None and self.memory.checking:
            self.memory.check()

    def stats(self) -> WorkerStats:
        """What :meth:`ModelWorker.stats` answers (on this thread, between steps)."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        return WorkerStats(
            slots=tuple(
                SlotStats(s.seq_id, s.n_past, eng.seq_pos_max(s.seq_id), s.checkpoints.total_bytes)
                for s in memory.slots
            ),
            n_active=len(self.active),
            n_pending=len(self.pending),
            preparing=self.preparing,
            host_ram_items=len(memory.ram.items),
            kv_unified=eng.kv_unified,
            exact_rows=eng.exact_rows,
            exact_verify_rows=eng.exact_verify_rows,
        )

    def _busy(self) -> set[int]:
        return {a.slot.seq_id for a in self.active}

    def _stopped(self, job: EngineRequest) -> BaseException | None:
        """The error ``job`` must end with now (cancelled, timed out, broken), or None."""
        try:
            return cancel_error(job) if job.cancelled() else None
        except Exception as exc:  # a broken job object is that request's problem only
            logger.debug("a request's cancel check failed", exc_info=True)
            return exc

    def _rank(self, job: EngineRequest, queued: _Waiting | None) -> int:
        """0: planned as interactive work; 1: background work not yet aged."""
        if queued is None:
            return 0
        return effective_priority(
            job.priority,
            self.clock() - queued.t_queued,
            self.lora_turn - queued.step,
        )

    def _admit(self) -> None:
        """Start queued requests, interactive ones first and each kind in arrival order
        (:func:`by_priority`), while a slot (and KV room) is free."""
        while self.pending:
            w = by_priority(self.pending, lambda w: self._rank(w.job, w))[0]
            err = self._stopped(w.job)
            if err is not None:  # the caller is gone: skip, don't run
                self.pending.remove(w)
                w.job.close_sampler()
                w.job.channel.put(Failed(err))
                continue
            busy = self._busy()
            if len(busy) >= len(self.slots):
                return
            try:
                act = self._start(w, busy)
            except Exception as exc:
                self.pending.remove(w)
                w.job.close_sampler()
                w.job.channel.put(Failed(self._stopped(w.job) or exc))
                continue
            if act is None:  # unified cache: running requests hold the room it needs
                return
            self.pending.remove(w)
            act.queued = w
            self.active.append(act)

    # ------------------------------------------------------------------ starting a request

    def _start(self, w: _Waiting, busy: set[int]) -> _Active | None:
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        job = w.job
        tokens = job.tokens
        if not tokens:
            raise InvalidRequestError("the rendered prompt is empty")
        labels = LabelWork.check(eng, job) if isinstance(job, ScoreRequest) else None
        spans = [(p, m.n_pos) for p, m in job.media.items()]
        spec = self._speculation(job)  # first: it may refuse the job
        marks = job.marks
        needed = len(tokens) + job.max_new
        room = None
        if self._prefix_coming(job, self._rank(job, w)):
            return None
        if eng.kv_unified:
            # Streams give each slot its own n_ctx window; a unified cache is shared, so
            # a request starts only when the cells running requests hold (a prefix they
            # share counted once) and may still add leave room for it until all end.
            # Decided before the slot is filled: a conversation restored into the pool for
            # a request that then waits would take cells the running ones were promised.
            room = memory.room(
                tokens,
                needed,
                [memory.footprint(a.slot, a.reserved) for a in self.active],
                busy,
                media=spans,
                marks=marks,
                cache_prompt=job.cache_prompt,
            )
            if room is None:
                if not self.active:
                    raise ContextOverflowError(
                        f"the request needs {needed} positions of the "
                        f"{eng.n_ctx_total}-position unified cache"
                    )
                return None
        slot, n_keep = memory.acquire(
            tokens,
            spans,
            busy,
            cache_prompt=job.cache_prompt,
            marks=marks,
            room=room,
            waiting=len(self.pending) - 1 + self.preparing,
        )
        targets = memory.checkpoint_targets(n_keep, tokens, job.boundaries, spans, slot, marks)
        sampler = None
        if labels is None:
            sampler = job.sampler or Sampler(eng.vocab, job.sampling, n_ctx=eng.n_ctx)
        job.sampler = None  # the request's from here on: closed when it ends
        try:
            stopper = StopMatcher(job.stop)
        except BaseException:
            if sampler is not None:
                sampler.close()
            raise
        cache = {
            "source": memory.last_source,
            "missed": memory.last_missed,
            "at": memory.last_mismatch_at,
        }
        if n_keep == 0:
            for proposer in self.proposers.values():
                proposer.forget(slot.seq_id)
        return _Active(
            job=job,
            slot=slot,
            n_keep=n_keep,
            cache=cache,
            max_new=job.max_new,
            targets=targets,
            keep=frozenset(targets),
            marks=marks,
            sampler=sampler,
            stopper=stopper,
            logprobs=[] if job.logprobs else None,
            spec=spec,
            think=None if job.think is None else ThinkCounter(job.think),
            labels=labels,
        )

    def _prefix_coming(self, job: EngineRequest, rank: int) -> bool:
        """Whether ``job`` (of priority ``rank``) waits for a running request to finish
        reading the prefix they share (:func:`~.pool.waits_for_prefix`): in the unified
        pool it is then copied (read once, held once) instead of read again beside it.
        Never for a reader of lower priority, whose prompt waits behind its own."""
        eng = self.engine
        assert eng is not None
        if not (eng.kv_unified and job.cache_prompt and eng.memory_kind is MemoryKind.PARTIAL):
            return False
        for act in self.active:
            # (the adapter set is part of the tokens' identity)
            if act.prefilling and self._rank(act.job, act.queued) <= rank:
                later = common_prefix_len(act.tokens, job.tokens)
                if waits_for_prefix(min(later, len(job.tokens) - 1), act.slot.n_past):
                    return True
        return False

    def _speculation(self, job: EngineRequest) -> _Speculation | None:
        """How ``job`` speculates, or None when it does not ask to."""
        kind = job.speculative
        if kind is None:
            return None
        eng = self.engine
        assert eng is not None
        proposer = self.proposers.get(kind)
        if proposer is None:
            raise InvalidRequestError(
                f"speculative={kind!r} is not available for this model"
                + (" (load it with draft_model_path=...)" if kind == "draft" else "")
            )
        limit = min(job.speculative_max_draft, eng.n_batch - 1)
        if self.config.deterministic:
            # a verify step longer than the probed limit would change the logits
            limit = min(limit, eng.exact_verify_rows - 1)
            if limit < 1:
                logger.debug(
                    "speculation off: this model's kernels give a multi-token verify step "
                    "different logits (exact_verify_rows=%d); deterministic=False allows it",
                    eng.exact_verify_rows,
                )
        start = max((p + m.n_pos for p, m in job.media.items()), default=0)
        history = [int(t) for t in job.tokens[start:]]
        return _Speculation(
            kind=kind,
            proposer=proposer if limit >= 1 else None,
            controller=DraftController(n_max=max(1, limit)),
            limit=max(0, limit),
            history=history,
        )

    # ------------------------------------------------------------------ one step

    def _step(self) -> None:
        """Plan one step (:func:`plan_step`), then run it: the generating requests'
        next tokens, their draft verifies, then the prompt pieces' call."""
        for act in list(self.active):
            err = self._stopped(act.job)
            if err is not None:
                self._finish_error(act, err)
        lone = self._lone_generation()
        if lone is not None:
            self._decode_generation([lone])
            self._hand_to_reader()
            return
        plan = self._plan()
        for group in plan.decode_groups:
            members = [a for a in group if a in self.active]
            if members:
                self._decode_generation(members)
        for act, draft in plan.verifies():  # each its own decode call (see _decode_verify)
            if act in self.active:
                self._decode_verify(act, list(draft))
        piece = plan.prompt
        riding = [a for a in plan.with_prompt if a in self.active]
        more = [p for p in plan.more_prompts if p.request in self.active]
        # a request whose memory was lost with another's (adapters overflowed) ended
        if piece is not None and piece.request in self.active:
            self._decode_prompt_piece(piece, riding, more)
        elif riding:
            self._decode_generation(riding)
        self._score_labels()
        self._hand_to_reader()

    def _hand_to_reader(self) -> None:
        """Before decoding on, let the reader of a reply's first text take it, when that
        request runs alone: the time to first token is what a streaming caller waits
        for, and the team's next decode would hold the CPUs the reader needs
        (runtime.channel). Beside other requests nothing waits: it would stall them."""
        act, self._first_text = self._first_text, None
        if act is None or len(self.active) != 1 or self.active[0] is not act:
            return
        channel = act.job.channel
        if channel.wakes_for_text:
            # the team's helpers spin on their CPUs for a while after a decode; ended,
            # they leave them to the reader (the next decode starts them again)
            release_team()
            channel.wait_reader(READER_WAIT_S)

    def _lone_generation(self) -> _Active | None:
        """The request whose next token is this whole step, when it generates alone
        without drafts: :func:`plan_step`'s plan is then that one token, so the step
        skips making it (a few percent of a small model's token time)."""
        if len(self.active) != 1:
            return None
        act = self.active[0]
        if act.pending is None or act.spec is not None:
            return None
        self.lora_turn += 1
        return act

    def _plan(self) -> StepPlan[_Active]:
        """What this step decodes: the drafts are proposed here (a proposer may run a
        draft model), the rest is :func:`plan_step`'s decision."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        gen = sorted((a for a in self.active if a.pending is not None), key=lambda a: a.slot.seq_id)
        drafts = {id(act): self._draft(act) for act in gen}
        n_drafting = sum(1 for d in drafts.values() if d)
        readers = [a for a in self.active if a.pending is None and a.prefilling]
        rank = {id(a): self._rank(a.job, a.queued) for a in readers + gen}
        # background prompts wait behind interactive ones (and never fill their call)
        reading = by_priority(readers, lambda a: rank[id(a)])
        if reading:
            reading = [a for a in reading if rank[id(a)] == rank[id(reading[0])]]
        self.lora_turn += 1
        return plan_step(
            gen,
            drafts=lambda a: drafts[id(a)],
            limit=row_limit(
                len(gen) - n_drafting,
                deterministic=self.config.deterministic,
                kv_unified=eng.kv_unified,
                exact_rows=eng.exact_rows,
            ),
            lora_of=_lora_of,
            turn=self.lora_turn,
            reading=[(a, self._prompt_read(a)) for a in reading],
            rules=self.piece_rules,
            # a row of an aborted call is dropped with seq_rm, which recurrent memory lacks
            mix=eng.memory_kind is not MemoryKind.FULL_ONLY,
            budget=self._budget([a for a in gen if rank[id(a)] == 0]),
            position=lambda a: a.slot.n_past,
        )

    def _budget(self, streams: Sequence[_Active]) -> StepBudget | None:
        """The stall budget of this step: the tightest of the interactive generating
        requests' (None: none generates, pieces are whole)."""
        budgets = [a.job.stall_budget_ms for a in streams if a.job.stall_budget_ms]
        if not budgets:
            return None
        return StepBudget(min(budgets) / 1000, self.cost.model)

    @property
    def piece_rules(self) -> PieceRules:
        """How this context cuts prompts into decode calls."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        return PieceRules(
            deterministic=self.config.deterministic,
            n_batch=eng.n_batch,
            n_ubatch=eng.n_ubatch,
            align=memory.align,
            window_checkpoints=memory.window_checkpoints,
        )

    def _prompt_read(self, act: _Active) -> PromptRead:
        items = act.slot.checkpoints.items
        return PromptRead(
            n_past=act.slot.n_past,
            n_prompt=len(act.tokens),
            media={p: m.n_pos for p, m in act.media.items()},
            targets=tuple(act.targets),
            marks=tuple(act.marks),
            lora_start=act.lora_start,
            last_checkpoint=items[-1].n_tokens if items else None,
        )

    def _decode_generation(self, gen: list[_Active]) -> None:
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        toks = [a.pending for a in gen]
        positions = [a.slot.n_past for a in gen]
        try:
            eng.set_lora(_lora_of(gen[0]))  # LoRA hook: one adapter set per group
            t0 = self.clock()
            eng.decode_batch(
                toks,  # type: ignore[arg-type]
                positions,
                [a.slot.seq_id for a in gen],
                [True] * len(gen),
            )
        except (RequestCancelledError, DecodeError) as exc:
            self._after_failed_decode(gen, exc)
            return
        self.cost.observe(len(gen), sum(p + 1 for p in positions), self.clock() - t0)
        self._generated(gen)

    def _generated(self, gen: Sequence[_Active]) -> None:
        """After a decode whose first rows were ``gen``'s pending tokens: record them
        and sample each request's next token from its row."""
        memory = self.memory
        assert memory is not None
        for i, act in enumerate(gen):
            memory.record(act.slot, [act.pending], exact=False)
            act.pending = None
            self._guarded(act, self._sample, act, i)

    # ------------------------------------------------------------------ scoring

    def _score_labels(self) -> None:
        """Score labels of the oldest scoring request whose prompt is read: one decode
        call at most per step, so the streams beside it wait for one small call, and
        its cancel or deadline is seen before its next label (``_step``'s check)."""
        act = next((a for a in self.active if a.labels is not None and a.labels.reading), None)
        if act is None or act.labels is None:
            return
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        try:
            act.labels.step(eng, memory, act.slot)
        except Exception as exc:  # the slot holds its prompt again: this request's error
            logger.debug("scoring a label failed", exc_info=True)
            self._finish_error(act, self._stopped(act.job) or exc)
            return
        if act.labels.done:
            self._release(act)
            self._reserve_save(act)  # its prompt, for the disk cache, as a chat's
            act.job.channel.put(act.labels.result(act.n_keep))

    # ------------------------------------------------------------------ speculation

    def _draft(self, act: _Active) -> list[int]:
        """Draft tokens to verify after ``act``'s pending token this step ([]: none)."""
        sp = act.spec
        if sp is None or sp.proposer is None or (act.think is not None and act.think.forcing):
            return []  # forced tokens are not sampled: nothing to verify
        eng = self.engine
        assert eng is not None
        # every verified row is a generated token and a KV position: stay within both
        room = min(act.max_new - act.n_gen - 1, eng.n_ctx - act.slot.n_past - 1)
        n = min(sp.limit, room)
        if n < 1:
            return []
        n = min(n, sp.controller.want())
        if n < 1:
            return []
        try:
            draft = sp.proposer.propose(act.slot.seq_id, sp.history, n)
        except Exception:  # a failing proposer costs speed, never the request
            logger.warning(
                "the %s proposer failed; speculation off for the request", sp.kind, exc_info=True
            )
            sp.proposer = None
            return []
        return [int(t) for t in draft[:n]]

    def _decode_verify(self, act: _Active, draft: list[int]) -> None:
        """Decode [pending, *draft] of one request in one call and keep what its sampler
        agrees with (llama.cpp's ``common_sampler_sample_and_accept_n``); the slot's
        memory saves and rolls back what the verify needs."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None and act.pending is not None
        slot = act.slot
        step = memory.begin_verify(slot, [act.pending, *draft])
        n = len(step.rows)
        try:
            eng.set_lora(_lora_of(act))  # LoRA hook
            eng.decode_batch(
                step.rows, range(step.n_past, step.n_past + n), [slot.seq_id] * n, [True] * n
            )
        except (RequestCancelledError, DecodeError) as exc:
            memory.abort_verify(step)
            self._after_failed_decode([act], exc)
            return
        act.pending = None
        self._guarded(act, self._accept_draft, act, step)

    def _accept_draft(self, act: _Active, step: Verify) -> None:
        """Sample the verify rows in order until the sampler disagrees with the draft."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None and act.spec is not None
        batch = step.rows
        n_draft = len(batch) - 1
        used = 0  # rows whose input token stays in the sequence
        accepted = 0
        sp = act.spec
        sp.drafted += n_draft
        try:
            for i in range(len(batch)):
                used = i + 1
                tok = act.sampler.sample(eng.ctx, i)
                match = i < n_draft and tok == batch[i + 1]
                if match:  # counted first: the request may finish on this token
                    accepted += 1
                    sp.accepted += 1
                if not self._take(act, i, tok):
                    break  # finished (end of generation, stop string, length)
                if not match or (act.think is not None and act.think.forcing):
                    act.pending = tok
                    break
        finally:
            act.spec.controller.update(n_draft, accepted)
            memory.keep(step, used, partial(self._decode_kept, act))

    def _decode_kept(self, act: _Active, rows: Sequence[Any], start: int) -> None:
        """Decode a verify step's kept rows again (``SlotMemory.keep`` restored the state
        from before it: memory that cannot be trimmed)."""
        eng = self.engine
        assert eng is not None
        eng.set_lora(_lora_of(act))  # LoRA hook
        n = len(rows)
        eng.decode_batch(rows, range(start, start + n), [act.slot.seq_id] * n, [False] * n)

    def _decode_prompt_piece(
        self,
        piece: PromptPiece[_Active],
        gen: Sequence[_Active] = (),
        more: Sequence[PromptPiece[_Active]] = (),
    ) -> None:
        """Read the planned piece: its images, then its tokens in one decode call that
        also carries ``gen``'s next tokens (rows ``0..len(gen)``) and, after them, the
        ``more`` pieces of younger prompts (no images)."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        act = piece.request
        media = act.media
        try:
            for pos in piece.media:
                self._eval_media(act, media[pos])
        except Exception as exc:  # a decode error or a bad image: this request's error
            self._finish_error(act, exc)
            if gen:
                self._decode_generation(list(gen))
            return
        pieces = [piece, *more]
        readers = [p.request for p in pieces]
        for p in pieces:  # the images read, each slot ends at its piece's start
            if p.targets_taken:
                del p.request.targets[: p.targets_taken]
                if p.checkpoint_at_start:
                    memory.save_checkpoint(p.request.slot, p.request.keep)
        tokens: list[int] = [a.pending for a in gen]  # type: ignore[misc]
        positions: list[int] = [a.slot.n_past for a in gen]
        seq_ids: list[int] = [a.slot.seq_id for a in gen]
        outputs: list[bool] = [True] * len(gen)
        lora = _lora_of(act) if piece.adapters else ()
        for p in pieces:
            r = p.request
            chunk = r.tokens[p.start : p.end]
            n_prompt = len(r.tokens)
            tokens += chunk
            positions += range(p.start, p.end)
            seq_ids += [r.slot.seq_id] * len(chunk)
            # under adapters every piece's last row too: its logits show an overflow
            outputs += [
                i == n_prompt - 1 or (bool(lora) and i == p.end - 1) for i in range(p.start, p.end)
            ]
        try:
            eng.set_lora(lora)  # LoRA hook
            t0 = self.clock()
            eng.decode_batch(
                tokens,
                positions,
                seq_ids,
                outputs,
                # the oldest prompt's cancel stops the call; the others' are seen next step
                cancel=cancel_check(act.job) if len(tokens) - len(gen) > 1 else None,
            )
            self.cost.observe(len(tokens), sum(p + 1 for p in positions), self.clock() - t0)
        except NonFiniteOutputError as exc:
            self._after_non_finite([*gen, *readers], exc)
            return
        except RequestCancelledError as exc:
            # the oldest prompt's cancel: the rows beside it lose only this step's
            # entries and are decoded again next step
            for a in [*gen, *readers[1:]]:
                memory.sync(a.slot)
            self._after_failed_decode([act], exc)
            return
        except DecodeError as exc:
            for a in gen:
                memory.sync(a.slot)
            self._after_failed_decode(readers, exc)
            return
        self._generated(gen)
        row = len(gen)
        for p in pieces:
            row += p.end - p.start
            self._after_piece(p, row - 1)

    def _after_piece(self, piece: PromptPiece[_Active], last_row: int) -> None:
        """Record a decoded piece (``last_row``: its last token's row in the call), and
        once it ends its prompt, sample the request's first token."""
        memory = self.memory
        assert memory is not None
        act = piece.request
        slot = act.slot
        job = act.job
        n_prompt = len(act.tokens)
        memory.record(slot, act.tokens[piece.start : piece.end], exact=True)
        if job.prompt_progress:
            job.channel.put(PromptProgress(n_prompt, act.n_keep, slot.n_past - act.n_keep))
        if act.prefilling:
            if act.targets and slot.n_past == act.targets[0]:
                act.targets.pop(0)
                memory.save_checkpoint(slot, act.keep)
            return
        memory.seal_prompt(slot, n_prompt, act.marks)
        act.t_prefill = time.perf_counter()
        if act.labels is not None:  # a scoring request: its labels are scored from here
            eng = self.engine
            assert eng is not None
            self._guarded(act, lambda work: work.prompt_read(eng.logits(last_row)), act.labels)
        else:
            self._guarded(act, self._sample, act, last_row)
        if piece.window and slot.n_past == n_prompt:
            # the prompt's end, after its first token went out: a regenerate of this
            # prompt resumes one entry back from it
            memory.save_checkpoint(slot, act.keep)

    def _eval_media(self, act: _Active, media: Any) -> None:
        """Encode and decode one image of a prompt (its own decode calls)."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        slot = act.slot
        start = slot.n_past
        # refused before it is read: the text after an image is what shows (its logits)
        # whether the image overflowed under adapters, and nothing would follow this one
        if start + media.n_pos >= len(act.tokens):
            raise ImageInputError("a prompt cannot end with an image: add text after it")
        try:
            eng.set_lora(_lora_of(act) if start >= act.lora_start else ())  # LoRA hook
            eng.eval_media(media, start, slot.seq_id)
        except DecodeError:
            memory.sync(slot)
            raise
        memory.record(slot, act.tokens[start : start + media.n_pos], exact=True)

    def _after_failed_decode(self, plan: list[_Active], exc: BaseException) -> None:
        """Keep each slot's entries equal to what the memory still holds, then recover."""
        memory = self.memory
        assert memory is not None
        if isinstance(exc, NonFiniteOutputError):
            self._after_non_finite(plan, exc)
            return
        for act in plan:
            slot = act.slot
            memory.sync(slot)
            err = self._stopped(act.job)
            if err is not None:
                self._finish_error(act, err)
            elif isinstance(exc, DecodeError) and act.n_gen == 0 and not act.retried:
                # reading the prompt failed (e.g. a reused prefix): start over once, from scratch
                logger.warning("decode failed (%s); retrying the request from scratch", exc)
                memory.reset(slot)
                act.retried = True
                act.n_keep = 0
                act.targets = sorted(t for t in act.keep if t > 0)
            else:
                self._finish_error(act, exc)

    def _after_non_finite(self, plan: list[_Active], exc: NonFiniteOutputError) -> None:
        """An adapter set overflowed (Engine._check_finite wiped the memory and put the
        other sequences back): its requests fail, the rest of the step is decoded again."""
        memory = self.memory
        assert memory is not None
        for slot in self.slots:
            if slot.seq_id in exc.seq_ids or slot.seq_id in exc.lost:
                memory.reset(slot)
        for act in list(self.active):
            seq = act.slot.seq_id
            if seq in exc.seq_ids:  # one exception object per caller: each raises its own
                self._finish_error(act, NonFiniteOutputError(str(exc), exc.seq_ids, exc.lost))
            elif seq in exc.lost:
                self._finish_error(
                    act,
                    DecodeError(
                        "the KV memory was wiped after another request's adapters overflowed "
                        "and this request's state could not be put back; retry it"
                    ),
                )
            elif act in plan:  # in the same decode with finite outputs: decoded again
                memory.sync(act.slot)

    # ------------------------------------------------------------------ the request boundary

    def _guarded(self, act: _Active, fn: Callable[..., None], *args: Any) -> None:
        """Run per-request work; any exception in it ends that request only."""
        try:
            fn(*args)
        except Exception as exc:
            logger.debug("request failed while handling model output", exc_info=True)
            if act in self.active:
                self._finish_error(act, exc)

    # ------------------------------------------------------------------ sampling

    def _sample(self, act: _Active, idx: int) -> None:
        eng = self.engine
        assert eng is not None
        forced = act.think.next_forced() if act.think is not None else None
        tok = act.sampler.sample(eng.ctx, idx) if forced is None else act.sampler.force(forced)
        if self._take(act, idx, tok):
            act.pending = tok

    def _take(self, act: _Active, idx: int, tok: int) -> bool:
        """Handle one sampled token (logprobs, end of generation, stop strings, length);
        False once the request has finished."""
        eng = self.engine
        assert eng is not None
        if act.logprobs is not None:
            act.logprobs.append(_logprob_entry(eng, idx, tok, act.job.top_logprobs))
        if eng.is_eog(tok):
            self._finish(act, "stop")
            return False
        act.n_gen += 1
        if act.think is not None:
            act.think.feed(tok)
        if act.spec is not None:
            act.spec.history.append(tok)
        if self._emit(act, act.decoder.feed(eng.token_piece(tok))):
            self._finish(act, "stop", stopped=True)
        elif act.n_gen >= act.max_new:
            self._finish(act, "length")
        else:
            return True
        return False

    def _emit(self, act: _Active, text: str) -> bool:
        """Stream ``text`` through stop strings; True if a stop matched."""
        if not text:
            return False
        out, stopped = act.stopper.feed(text)
        if out:
            self._put_text(act, out)
        return stopped

    def _put_text(self, act: _Active, text: str) -> None:
        """Send text with the logprobs of the tokens sampled since the last item sent."""
        logprobs = None
        if act.logprobs is not None:
            logprobs = act.logprobs[act.logprobs_sent :]
            act.logprobs_sent = len(act.logprobs)
        act.job.channel.put(TextDelta(text, logprobs))
        if not act.text_sent:
            act.text_sent = True
            self._first_text = act

    def _finish(self, act: _Active, reason: str, *, stopped: bool = False) -> None:
        put = act.job.channel.put
        if not stopped:
            if self._emit(act, act.decoder.flush()):
                reason = "stop"
            else:
                rest = act.stopper.flush()
                if rest:
                    self._put_text(act, rest)
        now = time.perf_counter()
        t_prefill = act.t_prefill or now
        n_prompt = len(act.tokens)
        n_decoded = n_prompt - act.n_keep
        prompt_ms = (t_prefill - act.t_start) * 1000
        gen_ms = (now - t_prefill) * 1000
        timings = {
            "prompt_n": float(n_decoded),
            "prompt_ms": prompt_ms,
            "prompt_per_second": n_decoded / (prompt_ms / 1000) if prompt_ms > 0 else 0.0,
            "predicted_n": float(act.n_gen),
            "predicted_ms": gen_ms,
            "predicted_per_second": act.n_gen / (gen_ms / 1000) if gen_ms > 0 else 0.0,
        }
        spec = None
        if act.spec is not None:
            sp = act.spec
            spec = {"type": sp.kind, "drafted": sp.drafted, "accepted": sp.accepted}
            timings["draft_n"] = float(sp.drafted)
            timings["draft_n_accepted"] = float(sp.accepted)
        self._release(act)
        self._reserve_save(act)
        put(
            Finished(
                reason,
                n_prompt=n_prompt,
                n_cached=act.n_keep,
                n_generated=act.n_gen,
                timings=timings,
                # the tokens no text item carried (an end-of-generation token)
                logprobs=None if act.logprobs is None else act.logprobs[act.logprobs_sent :],
                speculative=spec,
                lora=None if act.job.lora is None else dict(act.job.lora),
                cache=act.cache,
                n_reasoning=None if act.think is None else act.think.n,
            )
        )

    def _reserve_save(self, act: _Active) -> None:
        """Take the finished conversation's place in the disk cache's queue before the
        reply's last message (a program may exit right after it: the exit flush waits
        for the place); :meth:`_persist_finished` fills it after the step."""
        if self.memory is None or self.memory.disk is None:
            return
        try:
            pending = self.memory.reserve_save(act.slot)
        except Exception:  # the cache is an optimisation: never fail the worker for it
            logger.warning("prompt cache: could not save a conversation", exc_info=True)
            return
        if pending is not None:
            self.saves.append((act.slot, pending))

    def _persist_finished(self) -> None:
        """Copy the states of the conversations finished this step for the disk cache.

        After the step, so the replies are out and the memory is settled (a verify step
        drops its rejected rows after its request finished); the slots are not reused
        before this. Encoding, hashing and writing happen on the disk cache's thread."""
        while self.saves:
            slot, pending = self.saves.pop(0)
            if self.memory is None:
                pending.fill(None)  # the writer waits for every place it was given
                continue
            try:
                self.memory.persist(slot, pending)  # fills it, even when the copy fails
            except Exception:
                logger.warning("prompt cache: could not save a conversation", exc_info=True)

    def _finish_error(self, act: _Active, exc: BaseException) -> None:
        self._release(act)
        act.job.channel.put(Failed(exc))

    def _release(self, act: _Active) -> None:
        if act in self.active:
            self.active.remove(act)
        if act.sampler is None:
            return
        try:
            act.sampler.close()
        except Exception:
            logger.exception("closing a sampler failed")


#: The loop's state under a public name: a model-free test drives its :meth:`tick` over a
#: pure-Python store (tests/unit/runtime/test_step_loop.py).
WorkerLoop = _WorkerState


def _lora_of(act: _Active) -> tuple[tuple[str, float], ...]:
    """The adapter set ``act`` decodes with (``()``: the base model)."""
    return act.job.lora or ()


def _logprob_entry(eng: Engine, idx: int, tok: int, top: int) -> dict[str, Any]:
    def piece(t: int) -> str:
        return eng.token_piece(t).decode("utf-8", errors="replace")

    return logprob_entry(eng.logits(idx), tok, top, piece)


__all__ = [
    "CacheOptions",
    "EngineRequest",
    "Failed",
    "Finished",
    "ModelInfo",
    "ModelWorker",
    "ScoreRequest",
    "SlotStats",
    "TextDelta",
    "WorkerLoop",
    "WorkerStats",
]
