"""The front end of a loaded model: from a chat request to the worker's token request.

Everything a request costs in Python before its first decode runs here, on the
caller's thread (a worker-pool thread for async callers), never on the thread that
decodes for every slot: the chat template, tokenizing, the special-token check,
grammar construction and the sampler chain (its grammar compiled), the LoRA
activation and the window checks. The worker receives an
:class:`~langchain_llamacpp_local.runtime.requests.EngineRequest`; the reply is read by
:mod:`~langchain_llamacpp_local.chat.reply`. This is the split llama.cpp's server makes
(it tokenizes in its HTTP threads) and vLLM's front end makes (input processing before
the engine core).

Reading the vocabulary from another thread while the worker decodes is safe:
llama.cpp's vocabulary is read-only once loaded. A prompt with images or audio is
tokenized here too, by mtmd with the model's projector, under the engine's projector
lock (the worker frees the projector only under that lock).

The format of a loaded model (templates, tool format, chunk markers) is resolved once,
by the first request's front end, and kept with the worker (:func:`frontend_for`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from langchain_llamacpp_local.cache.chunking import marker_cuts
from langchain_llamacpp_local.chat import cache_report, prompts, thinking
from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.chat.preview import RenderedPrompt, from_prepared
from langchain_llamacpp_local.chat.special_tokens import scan_in_background
from langchain_llamacpp_local.errors import (
    ContextOverflowError,
    InvalidRequestError,
    WorkerDeadError,
)
from langchain_llamacpp_local.llama.sampling import Sampler
from langchain_llamacpp_local.llama.threads import cpu_budget
from langchain_llamacpp_local.runtime.lora import activate, key_tokens
from langchain_llamacpp_local.runtime.requests import CacheReport, EngineRequest, cancel_error
from langchain_llamacpp_local.runtime.stats import ModelInfo
from langchain_llamacpp_local.runtime.worker import ModelWorker

logger = logging.getLogger(__name__)


class Frontend:
    """What the caller's side keeps of one loaded model (see module docstring)."""

    def __init__(self, worker: ModelWorker) -> None:
        eng = worker.engine
        # weak: the worker's thread stops when its last user drops it (see ModelWorker)
        self._worker = weakref.ref(worker)
        self.engine = eng
        with self.holding_vocab():
            self.format = prompts.ChatFormat.from_engine(eng)
        #: token sequences prompts are cut after (chunking marks: message boundaries)
        self.markers = self.format.markers
        # what requests need of the vocabulary (control-token texts): not part of loading
        scan_in_background(eng)
        assert worker.info is not None
        #: each conversation's last template arguments (a miss names a change of them)
        self.last_kwargs = cache_report.LastKwargs()
        self.info = replace(
            worker.info,
            template_origin=self.format.template.origin,
            tool_format=self.format.call_format,
        )

    @contextmanager
    def holding_vocab(self) -> Iterator[None]:
        """Hold the model while the caller reads its vocabulary: the worker may close its
        engine meanwhile (it died), and the vocabulary must outlive the read."""
        try:
            ref = self.engine.hold_model()
        except RuntimeError:
            raise WorkerDeadError("the model worker has stopped") from None
        try:
            yield
        finally:
            ref.release()

    def _tokenize_media(self, text: Any, images: list[Any]) -> tuple[list[Any], dict[int, Any]]:
        """A prompt with images as positions and image chunks, made on this thread (mtmd
        preprocesses the images; the engine's lock keeps its projector loaded meanwhile)."""
        if self._worker() is None:
            raise WorkerDeadError("the model worker has stopped")
        return self.engine.tokenize_multimodal(text, images)

    def explain_miss(self, prepared: prompts.PreparedPrompt, cache: CacheReport) -> dict[str, Any]:
        """Where a prompt that missed the cache left it, in its messages (a miss only:
        this detokenizes the prompt up to that point)."""
        with self.holding_vocab():
            return cache_report.explain_miss(
                prepared.text,
                prepared.tokens,
                cache.at,
                lambda t: self.engine.token_piece(t),
                prepared.messages,
                prepared.tool_specs,
                prepared.kwargs_changed,
            )

    def prepare(self, job: ChatJob) -> tuple[EngineRequest, prompts.PreparedPrompt]:
        """The token request for ``job`` and the prompt it came from (its parser).

        Raises what a bad request raises (a template error, an overflow, an unknown
        adapter...); a cancel or timeout that stopped the templating is raised as such.
        """
        try:
            with self.holding_vocab(), cpu_budget().own_work():
                return self._prepare(job)
        except Exception as exc:
            try:
                stopped = cancel_error(job) if job.cancelled() else None
            except Exception:  # a broken job object: its own error is the answer
                stopped = None
            if stopped is not None:
                raise stopped from exc
            raise

    def _prepare(self, job: ChatJob) -> tuple[EngineRequest, prompts.PreparedPrompt]:
        eng = self.engine
        prepared = prompts.prepare(self.format, job, eng, self._tokenize_media)
        prepared.kwargs_changed = self.last_kwargs.changed(
            cache_report.conversation_key(job.messages),
            cache_report.job_kwargs_key(job),
        )
        logger.debug("prepared a prompt of %d tokens", len(prepared.tokens))
        lora, lora_start = job.lora, 0
        if lora:  # the adapter set is part of the prefix's identity
            eng.check_lora(lora)
            # an activated LoRA: off before its invocation, off without one
            lora, lora_start = activate(lora, eng.alora, prepared.tokens)
            prepared.tokens = key_tokens(prepared.tokens, lora, lora_start)
            prepared.lora_start = lora_start
        tokens = prepared.tokens
        n_prompt = len(tokens)
        if n_prompt == 0:
            raise InvalidRequestError("the rendered prompt is empty")
        max_tokens = job.max_tokens
        budget = eng.n_ctx - n_prompt
        if budget > 0 and job.max_tokens_default and (max_tokens or 0) > budget:
            logger.warning(
                "the prompt of %d tokens leaves %d of the %d-token context: generating at "
                "most %d tokens instead of the default max_tokens=%d (pass max_tokens= or "
                "raise n_ctx)",
                n_prompt,
                budget,
                eng.n_ctx,
                budget,
                max_tokens,
            )
            max_tokens = budget
        if budget <= 0 or (max_tokens is not None and max_tokens > budget):
            raise ContextOverflowError(
                f"prompt of {n_prompt} tokens"
                + (f" plus max_tokens={max_tokens}" if max_tokens is not None else "")
                + f" does not fit the context window of {eng.n_ctx} tokens"
                " (raise n_ctx, lower max_tokens or shorten the conversation)"
            )
        request = EngineRequest(
            tokens=tokens,
            sampling=prepared.sampling,
            max_new=budget if max_tokens is None else max_tokens,
            stop=list(prepared.stop),
            media=prepared.media,
            boundaries=prepared.boundaries,
            marks=marker_cuts(tokens, self.markers),
            lora=lora,
            lora_start=lora_start,
            cache_prompt=job.cache_prompt,
            cache_reuse=job.cache_reuse if job.cache_prompt else 0,
            reuse_owner=job.reuse_owner,
            speculative=job.speculative,
            speculative_max_draft=job.speculative_max_draft,
            logprobs=job.logprobs,
            top_logprobs=job.top_logprobs,
            priority=job.priority,
            stall_budget_ms=job.stall_budget_ms,
            deadline=job.deadline,
            cancel=job.cancel,
            think=thinking.plan(
                functools.partial(self.format.tokenizer.plain, eng),
                self.format.call_format,
                prepared.prefill,
                job.reasoning_budget,
                job.reasoning_budget_message,
                lambda text: eng.tokenize(text, add_special=False, parse_special=False),
            ),
        )
        # the grammar is compiled here, not on the decode loop; the worker owns it now
        request.sampler = Sampler(eng.vocab, prepared.sampling, n_ctx=eng.n_ctx)
        return request, prepared

    def render(self, job: ChatJob) -> RenderedPrompt:
        """What ``job`` would decode (``render_prompt``), prepared as a request is."""
        with self.holding_vocab():
            prepared = prompts.prepare(self.format, job, self.engine, self._tokenize_media)
        return from_prepared(prepared)


_lock = threading.Lock()
_frontends: weakref.WeakKeyDictionary[ModelWorker, Frontend] = weakref.WeakKeyDictionary()
_creating: weakref.WeakKeyDictionary[ModelWorker, threading.Lock] = weakref.WeakKeyDictionary()


def _after_fork_in_child() -> None:
    """A parent's caller may have held a lock at a fork; the parent's workers, whose
    front ends these are, do not run in the child."""
    global _lock, _creating
    _lock = threading.Lock()
    _creating = weakref.WeakKeyDictionary()


os.register_at_fork(after_in_child=_after_fork_in_child)


def frontend_for(worker: ModelWorker) -> Frontend:
    """The front end of ``worker``'s model, made by the first caller that asks (its
    format resolved once, on that caller's thread; others wait for it)."""
    with _lock:
        fe = _frontends.get(worker)
        if fe is not None:
            return fe
        making = _creating.setdefault(worker, threading.Lock())
    with making:
        with _lock:
            fe = _frontends.get(worker)
        if fe is None:
            fe = Frontend(worker)
            with _lock:
                _frontends[worker] = fe
        return fe


def model_info(worker: ModelWorker) -> ModelInfo:
    """``worker``'s :class:`ModelInfo` with the front end's template origin and tool format."""
    return frontend_for(worker).info
