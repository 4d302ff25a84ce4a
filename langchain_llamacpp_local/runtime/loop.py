"""The worker's loop: everything that lives on its thread, a scheduler over a
:class:`~langchain_llamacpp_local.cache.slot_memory.SlotMemory`.

:class:`~.worker.ModelWorker` runs it on its thread; a model-free test drives its
:meth:`WorkerLoop.tick` over a pure-Python store (tests/unit/runtime/test_step_loop.py).
The loop applies what others decide: admission (:mod:`~.admission`, :mod:`~.cache.pool`),
each step's plan (:mod:`~.scheduler`); sampled tokens become reply items in
:mod:`~.output`, drafts are verified by :mod:`~.verify`, labels scored by :mod:`~.scoring`.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from langchain_llamacpp_local.cache.disk import PendingSave
from langchain_llamacpp_local.cache.pool import Footprint, cells_in_use, pool_need
from langchain_llamacpp_local.cache.slot_memory import CacheOptions, SlotMemory
from langchain_llamacpp_local.cache.slot_plan import plan_compaction
from langchain_llamacpp_local.cache.slots import Slot
from langchain_llamacpp_local.errors import (
    ContextOverflowError,
    DecodeError,
    ImageInputError,
    InvalidRequestError,
    KVDesyncError,
    NonFiniteOutputError,
    RequestCancelledError,
)
from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.omp import release_team
from langchain_llamacpp_local.llama.probes import MemoryKind
from langchain_llamacpp_local.llama.sampling import Sampler
from langchain_llamacpp_local.llama.text_stream import StopMatcher
from langchain_llamacpp_local.runtime import verify
from langchain_llamacpp_local.runtime.active import WORKER_LOG, Active, Waiting, lora_of
from langchain_llamacpp_local.runtime.admission import speculation, waits_for_reader
from langchain_llamacpp_local.runtime.channel import Channel
from langchain_llamacpp_local.runtime.output import OutputPipeline
from langchain_llamacpp_local.runtime.requests import (
    CacheReport,
    EngineRequest,
    Failed,
    Finished,
    LabelScores,
    PromptProgress,
    ScoreRequest,
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
    call_attention,
    effective_priority,
    plan_step,
    row_limit,
)
from langchain_llamacpp_local.runtime.scoring import LabelWork
from langchain_llamacpp_local.runtime.speculative import NgramProposer, Proposer
from langchain_llamacpp_local.runtime.stats import ModelInfo, SlotStats, WorkerStats
from langchain_llamacpp_local.runtime.step_cost import CostFit
from langchain_llamacpp_local.runtime.thinking import ThinkCounter

logger = logging.getLogger(WORKER_LOG)


@dataclass
class StatsAsk:
    """A queued request for a :class:`WorkerStats` snapshot."""

    channel: Channel = field(default_factory=Channel)


#: What the worker's queue gets to end the loop.
STOP = object()


class WorkerLoop:
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
        self.pending: deque[Waiting] = deque()
        #: requests their callers are preparing now (:meth:`ModelWorker.preparing`)
        self.preparing = 0
        self.active: list[Active] = []
        #: sampled tokens to reply items, and the reader hand-off after a step
        self.output = OutputPipeline()
        self.proposers: dict[str, Proposer] = {}
        self.lora_turn = 0  # steps so far: rotates which adapter group decodes first
        #: whether this step's plan was cut to a stall budget (an interactive stream generates)
        self._budgeted = False
        #: the decode calls' measured cost, for the stall budget's piece sizes
        self.cost = CostFit()
        #: the cells a call attends over in a unified pool (:meth:`_pool`)
        self._span = 0
        #: what decode calls and waits are timed with (a test's simulated clock)
        self.clock: Callable[[], float] = time.perf_counter
        #: conversations finished this step, their disk-cache places still to fill
        self.saves: list[tuple[Slot, PendingSave]] = []
        #: seconds the last tick spent after its step (disk-cache copies): the streams
        #: wait for them before the next step's calls, so that step's budget counts them
        self._after_step = 0.0
        #: whether the last step's prompt waited for the time its tick spent before the
        #: calls (:attr:`StepBudget.spent`): the next one reads, whatever was spent
        self._deferred = False

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
            n_slots=eng.n_slots,
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
                if item is STOP:
                    return
                if isinstance(item, StatsAsk):
                    item.channel.put(self.stats())
                elif isinstance(item, tuple):
                    fn, ch = item
                    try:
                        ch.put(fn(self))
                    except Exception as exc:
                        ch.put(Failed(exc))
                else:
                    self.enqueue(item)
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    item = None
            self.tick()

    def enqueue(self, job: EngineRequest) -> None:
        """Queue ``job`` for admission (noting when, for background aging)."""
        self.pending.append(Waiting(job, self.lora_turn, self.clock()))

    def tick(self) -> None:
        """One loop iteration: admit what fits, decode one step, save what finished.

        Filling a slot (a conversation copied out of llama.cpp's memory or back into
        it) and a finished conversation's copy for the disk cache are work the running
        streams wait for like a decode call: the step's stall budget counts them."""
        t0 = self.clock()
        try:
            self._admit()
            if self.active:
                self._step(self._after_step + self.clock() - t0)
        finally:
            t1 = self.clock()
            self._persist_finished()
            self._after_step = self.clock() - t1
            if not self.active:  # the next request's cells may land anywhere
                self._span = 0
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

    def _rank(self, job: EngineRequest, queued: Waiting | None) -> int:
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
            self._compact(act)

    def _compact(self, started: Active) -> None:
        """Rewrite the pool from its first cell before ``started`` reads a long prompt
        beside running requests (:func:`plan_compaction`): in a unified pool without
        flash attention every row attends up to the highest cell in use, and they may
        decode above a hole a parked conversation left."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        if (
            len(self.active) < 2
            or not eng.attends_all_cells
            or self.config.deterministic
            or eng.memory_kind is not MemoryKind.PARTIAL
        ):
            return
        final = {a.slot.seq_id: a.reserved for a in self.active}
        apart = [  # each sequence in cells of its own once put back
            Footprint(((0, s.n_past, -1 - s.seq_id),), final.get(s.seq_id, 0)) for s in memory.slots
        ]
        if not plan_compaction(
            n_read=len(started.job.tokens) - started.n_keep,
            copied=sum(s.n_past for s in memory.slots),
            fits_apart=pool_need(apart) <= eng.n_ctx_total,
        ):
            return
        lost = {s.seq_id for s in memory.compact()}
        for act in [a for a in self.active if a.slot.seq_id in lost]:
            why = f"slot {act.slot.seq_id}: its state did not come back from the pool's rewrite"
            self._finish_error(act, KVDesyncError(why))
        # every cell in use is now in the pool's first ones, one sequence after another
        self._span = cells_in_use(s.runs() for s in memory.slots)

    # ------------------------------------------------------------------ starting a request

    def _start(self, w: Waiting, busy: set[int]) -> Active | None:
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        job = w.job
        tokens = job.tokens
        if not tokens:
            raise InvalidRequestError("the rendered prompt is empty")
        labels = LabelWork.check(eng, job) if isinstance(job, ScoreRequest) else None
        spans = [(p, m.n_pos) for p, m in job.media.items()]
        exact = eng.exact_verify_rows if self.config.deterministic else None
        spec = speculation(job, self.proposers, eng.n_batch, exact)  # first: it may refuse
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
        got = memory.acquire(
            tokens,
            spans,
            busy,
            cache_prompt=job.cache_prompt,
            marks=marks,
            room=room,
            waiting=len(self.pending) - 1 + self.preparing,
            reuse=job.cache_reuse,
            owner=job.reuse_owner,
        )
        slot, n_keep = got.slot, got.n_keep
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
        reuse = job.cache_reuse > 0 and job.cache_prompt
        cache = CacheReport(
            got.source,
            got.missed,
            got.mismatch_at,
            moved=got.moved if reuse else None,
            reuse_off=got.reuse_off if reuse else None,
        )
        if n_keep == 0:
            for proposer in self.proposers.values():
                proposer.forget(slot.seq_id)
        return Active(
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
        """Whether ``job`` waits to copy a prefix a running request is still reading
        (:func:`~.admission.waits_for_reader`; only where the unified pool copies one)."""
        eng = self.engine
        assert eng is not None
        if not (eng.kv_unified and job.cache_prompt and eng.memory_kind is MemoryKind.PARTIAL):
            return False
        readers = (
            (a.tokens, a.slot.n_past, self._rank(a.job, a.queued))
            for a in self.active
            if a.prefilling
        )
        return waits_for_reader(job.tokens, rank, readers)

    # ------------------------------------------------------------------ one step

    def _step(self, spent: float = 0.0) -> None:
        """Plan one step (:func:`plan_step`), then run it: the generating requests'
        next tokens, their draft verifies, then the prompt pieces' call. ``spent``: the
        seconds the streams already waited since their last step (admission, saves)."""
        for act in list(self.active):
            err = self._stopped(act.job)
            if err is not None:
                self._finish_error(act, err)
        lone = self._lone_generation()
        if lone is not None:
            self._decode_generation([lone])
            self.output.hand_to_reader(self.active)
            return
        plan = self._plan(spent)
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
        read = piece is not None and piece.request in self.active
        if read:
            self._decode_prompt_piece(piece, riding, more)
        elif riding:
            self._decode_generation(riding)
        # a budgeted step that read a prompt piece (or whose piece waited for a slot's
        # fill) is full: a label call would make the streams wait past the budget, so it
        # waits for a step without one
        if not ((read or self._deferred) and self._budgeted):
            self._score_labels()
        self.output.hand_to_reader(self.active)

    def _lone_generation(self) -> Active | None:
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

    def _plan(self, spent: float = 0.0) -> StepPlan[Active]:
        """What this step decodes: the drafts are proposed here (a proposer may run a
        draft model), the rest is :func:`plan_step`'s decision. A prompt waits for the
        time ``spent`` before the step one step at most: it always progresses."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        gen = sorted((a for a in self.active if a.pending is not None), key=lambda a: a.slot.seq_id)
        drafts = {id(act): verify.draft(eng, act) for act in gen}
        n_drafting = sum(1 for d in drafts.values() if d)
        readers = [a for a in self.active if a.pending is None and a.prefilling]
        rank = {id(a): self._rank(a.job, a.queued) for a in readers + gen}
        # background prompts wait behind interactive ones (and never fill their call)
        reading = by_priority(readers, lambda a: rank[id(a)])
        if reading:
            reading = [a for a in reading if rank[id(a)] == rank[id(reading[0])]]
        self.lora_turn += 1
        budget = self._budget([a for a in gen if rank[id(a)] == 0])
        if budget is not None and not self._deferred:
            budget = replace(budget, spent=max(0.0, spent))
        self._budgeted = budget is not None
        plan = plan_step(
            gen,
            drafts=lambda a: drafts[id(a)],
            limit=row_limit(
                len(gen) - n_drafting,
                deterministic=self.config.deterministic,
                kv_unified=eng.kv_unified,
                exact_rows=eng.exact_rows,
            ),
            lora_of=lora_of,
            turn=self.lora_turn,
            reading=[(a, self._prompt_read(a)) for a in reading],
            rules=self.piece_rules,
            # a row of an aborted call is dropped with seq_rm, which recurrent memory lacks
            mix=eng.memory_kind is not MemoryKind.FULL_ONLY,
            budget=budget,
            position=lambda a: a.slot.n_past,
        )
        self._deferred = bool(reading) and plan.prompt is None
        if self._deferred:
            logger.debug(
                "a prompt piece waits a step: %.1f ms went to a slot fill or a save", spent * 1000
            )
        return plan

    def _budget(self, streams: Sequence[Active]) -> StepBudget | None:
        """The stall budget of this step: the tightest of the interactive generating
        requests' (None: none generates, pieces are whole)."""
        budgets = [a.job.stall_budget_ms for a in streams if a.job.stall_budget_ms]
        if not budgets:
            return None
        cost = replace(self.cost.model, pool=self._pool())
        return StepBudget(min(budgets) / 1000, cost, margin=self.cost.margin)

    def _pool(self) -> int | None:
        """The cells every row of a call attends over (``CallCost.pool``), or None.

        llama.cpp's span is its highest cell in use, which its C API does not give: a
        conversation parked from low cells leaves the running ones' cells above the
        hole, so the span stays. Counted as the most cells in use since the worker
        last had nothing running (it may then overestimate: pieces get smaller)."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        if not eng.attends_all_cells:
            return None
        self._span = max(self._span, cells_in_use(s.runs() for s in memory.slots))
        return self._span

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

    def _prompt_read(self, act: Active) -> PromptRead:
        items = act.slot.checkpoints.items
        return PromptRead(
            n_past=act.slot.n_past,
            n_prompt=len(act.tokens),
            media={p: m.n_pos for p, m in act.media.items()},
            targets=tuple(act.targets),
            marks=tuple(act.marks),
            lora_start=act.lora_start,
            last_checkpoint=items[-1].n_tokens if items else None,
            beside=act.beside,
        )

    def _decode_generation(self, gen: list[Active]) -> None:
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None
        toks = [a.pending for a in gen]
        positions = [a.slot.n_past for a in gen]
        try:
            eng.set_lora(lora_of(gen[0]))  # LoRA hook: one adapter set per group
            pool = self._pool()
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
        self._observe(positions, pool, t0)
        self._generated(gen)

    def _observe(self, positions: Sequence[int], pool: int | None, t0: float) -> None:
        """Give the cost fit one decode call that started at ``t0``: a row at each of
        ``positions``, each attending its own sequence up to it or, over a ``pool``
        every row attends, all of it (:func:`call_attention`)."""
        rows = len(positions)
        own = sum(p + 1 for p in positions)
        self.cost.observe(rows, call_attention(rows, own, pool), self.clock() - t0)

    def _generated(self, gen: Sequence[Active]) -> None:
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
        if act.labels.done:  # its prompt goes to the disk cache, as a chat's
            self._end(act, act.labels.result(act.n_keep))

    # ------------------------------------------------------------------ speculation

    def _decode_verify(self, act: Active, draft: list[int]) -> None:
        """Verify ``act``'s draft (:mod:`~.verify`); the slot's memory saves and rolls
        back what the verify needs."""
        eng = self.engine
        memory = self.memory
        assert eng is not None and memory is not None and act.pending is not None
        step = memory.begin_verify(act.slot, [act.pending, *draft])
        try:
            verify.decode_rows(eng, act, step)
        except (RequestCancelledError, DecodeError) as exc:
            memory.abort_verify(step)
            self._after_failed_decode([act], exc)
            return
        act.pending = None
        self._guarded(act, verify.accept, eng, memory, act, step, self._take)

    # ------------------------------------------------------------------ prompt pieces

    def _decode_prompt_piece(
        self,
        piece: PromptPiece[Active],
        gen: Sequence[Active] = (),
        more: Sequence[PromptPiece[Active]] = (),
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
        lora = lora_of(act) if piece.adapters else ()
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
            pool = self._pool()
            t0 = self.clock()
            eng.decode_batch(
                tokens,
                positions,
                seq_ids,
                outputs,
                # the oldest prompt's cancel stops the call; the others' are seen next step
                cancel=cancel_check(act.job) if len(tokens) - len(gen) > 1 else None,
            )
            self._observe(positions, pool, t0)
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
            if self._budgeted:
                p.request.beside += 1
            self._after_piece(p, row - 1)

    def _after_piece(self, piece: PromptPiece[Active], last_row: int) -> None:
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

    def _eval_media(self, act: Active, media: Any) -> None:
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
            eng.set_lora(lora_of(act) if start >= act.lora_start else ())  # LoRA hook
            eng.eval_media(media, start, slot.seq_id)
        except DecodeError:
            memory.sync(slot)
            raise
        memory.record(slot, act.tokens[start : start + media.n_pos], exact=True)

    def _after_failed_decode(self, plan: list[Active], exc: BaseException) -> None:
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

    def _after_non_finite(self, plan: list[Active], exc: NonFiniteOutputError) -> None:
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

    def _guarded(self, act: Active, fn: Callable[..., None], *args: Any) -> None:
        """Run per-request work; any exception in it ends that request only."""
        try:
            fn(*args)
        except Exception as exc:
            logger.debug("request failed while handling model output", exc_info=True)
            if act in self.active:
                self._finish_error(act, exc)

    # ------------------------------------------------------------------ the reply

    def _sample(self, act: Active, idx: int) -> None:
        eng = self.engine
        assert eng is not None
        tok = self.output.next_token(eng, act, idx)
        if self._take(act, idx, tok):
            act.pending = tok

    def _take(self, act: Active, idx: int, tok: int) -> bool:
        """Hand one sampled token to the reply (:meth:`OutputPipeline.take`); False once
        the request has finished."""
        eng = self.engine
        assert eng is not None
        last = self.output.take(eng, act, idx, tok)
        if last is None:
            return True
        self._end(act, last)
        return False

    def _end(self, act: Active, last: Finished | LabelScores) -> None:
        """Free the request's slot and take its disk-cache place, then send its reply's
        last item: whoever reads that item finds the request gone from the worker."""
        self._release(act)
        self._reserve_save(act)
        act.job.channel.put(last)

    def _reserve_save(self, act: Active) -> None:
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

    def _finish_error(self, act: Active, exc: BaseException) -> None:
        self._release(act)
        act.job.channel.put(Failed(exc))

    def _release(self, act: Active) -> None:
        if act in self.active:
            self.active.remove(act)
        if act.sampler is None:
            return
        try:
            act.sampler.close()
        except Exception:
            logger.exception("closing a sampler failed")
