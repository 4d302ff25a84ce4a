"""A chat request's hold on its model: the lease, the submission, the release.

A request leases the loaded model from the registry (loading it, or waiting for room,
if needed), has its prompt prepared by the model's front end on the caller's side and
queues the token request; the lease goes back once the reply is complete, even when the
caller never reads it to the end. These are steps of a call (:mod:`.steps`): an async
caller does the blocking parts (the load, the preparation) on a worker-pool thread, and
a cancelled task never strands a lease.

Other kinds of work made from a chat prompt (a decision question's scoring request)
take the same path (:func:`submitting_as`) and are answered by one typed item
(:func:`answering`), waited for up to the request's deadline.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from langchain_core.messages import BaseMessage

from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.chat.frontend import Frontend, frontend_for
from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.chat.prompts import PreparedPrompt
from langchain_llamacpp_local.chat.reply import Reply, receive
from langchain_llamacpp_local.chat.steps import OffLoop, Steps
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.resolution.model_resolution import ResolvedModel
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.runtime.requests import EngineRequest, Failed, ReplyItem

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R", bound=EngineRequest)

#: Turns a prepared chat request into the request actually queued (a decision
#: question's scoring request), on the caller's thread with the front end at hand.
Convert = Callable[[Frontend, EngineRequest], R]


def hold(
    config: LoadConfig,
    cache: CacheOptions,
    *,
    keep_alive: float,
    max_loaded_models: int | None,
    deadline: float | None,
    verbose_name: str | None = None,
) -> registry.Lease:
    """Lease the model of ``config``, with its front end ready (the model's format is
    resolved once per loaded model, on the caller's side). ``verbose_name``: show
    llama.cpp's log and the load's progress under this name."""
    if verbose_name is not None:
        show_native_log()
    lease = registry.acquire(
        config,
        cache,
        log_progress(verbose_name) if verbose_name is not None else None,
        keep_alive=keep_alive,
        max_loaded_models=max_loaded_models,
        deadline=deadline,
    )
    try:
        frontend_for(lease.worker)
    except BaseException:
        lease.release()
        raise
    return lease


def leasing(get: Callable[[], tuple[registry.Lease, T]]) -> OffLoop[tuple[registry.Lease, T]]:
    """The step of ``get()`` (a blocking lease, and what comes with it): off the event
    loop for an async caller, whose task may be cancelled while it waits; the lease it
    got, now or later, is then released."""
    return OffLoop(get, undo=lambda got: got[0].release(), abandon=True)


@dataclass(frozen=True)
class ChatAccess:
    """What code beside the chat model (the decision model) needs of it to make
    requests on its model: its jobs, its lease, its cancel registry and its name.
    ``ChatLlamaCpp.chat_access()`` hands one out; package-internal."""

    #: a chat job from messages, stop strings and call options (checked, images read)
    make_job: Callable[[list[BaseMessage], list[str] | None, dict[str, Any]], ChatJob]
    #: hold the chat model's own model until the deadline (loading it if needed)
    lease: Callable[[float | None], tuple[registry.Lease, ResolvedModel]]
    #: the cancel events of the chat model's running requests (``close()`` sets them)
    inflight: weakref.WeakSet[threading.Event]
    #: the traced name (from the configuration only)
    name: str


def submitting(
    job: ChatJob,
    lease: registry.Lease,
    inflight: weakref.WeakSet[threading.Event],
    *,
    progress: bool = False,
    whole: bool = False,
) -> Steps[Reply]:
    """Prepare ``job`` (template, tokens, grammar: off the event loop for an async
    caller) and queue it; ``inflight`` collects the cancel events of the caller's running
    requests; ``progress``: the worker reports prompt reading (a caller with callbacks);
    ``whole``: the reply is read only when it is complete (no wake-up per token)."""
    inflight.add(job.cancel)
    frontend = frontend_for(lease.worker)
    with lease.worker.preparing():
        # cancelled while it ran: free what it built
        request, prepared = yield OffLoop(
            partial(frontend.prepare, job), undo=lambda made: made[0].close_sampler()
        )
        request.prompt_progress = progress
        request.channel.wake_for_text(not whole)
        return _queue(request, prepared, frontend.info.model_name, lease)


def _queue(
    request: EngineRequest, prepared: PreparedPrompt, model_name: str, lease: registry.Lease
) -> Reply:
    reply = Reply(request, prepared, model_name)
    reply.explain_miss = frontend_for(lease.worker).explain_miss
    # the model is free for others (keep-alive, max_loaded_models) once the reply is
    # complete, even if the caller never reads it to the end
    request.channel.on_final(lease.release)
    lease.worker.submit(request)
    return reply


def submitting_as(
    job: ChatJob,
    lease: registry.Lease,
    inflight: weakref.WeakSet[threading.Event],
    convert: Convert[R],
) -> Steps[R]:
    """Prepare ``job`` as :func:`submitting` does, queue ``convert(frontend, request)``
    instead of the chat request and return it: its answer is one final item
    (:func:`answering`). The lease stays the caller's to release."""
    inflight.add(job.cancel)
    frontend = frontend_for(lease.worker)
    with lease.worker.preparing():
        request: R = yield OffLoop(
            partial(_convert, frontend, job, convert), undo=lambda made: made.close_sampler()
        )
        lease.worker.submit(request)
        return request


def _convert(frontend: Frontend, job: ChatJob, convert: Convert[R]) -> R:
    request, _ = frontend.prepare(job)
    try:
        return convert(frontend, request)
    finally:
        request.close_sampler()  # what the converted request does not take


def answering(request: EngineRequest) -> Steps[ReplyItem]:
    """The final item of a request answered by one item (a :class:`Failed` raises its
    error); past the request's deadline it is cancelled and ``RequestTimeoutError``
    raised, and it is cancelled too if the wait ends any other way."""
    done = False
    try:
        item = yield from receive(request, "the request timed out")
        done = True
    finally:
        if not done:
            request.cancel.set()
    if isinstance(item, Failed):
        raise item.error
    return item


def log_progress(path: str) -> Callable[[float], None]:
    """A load-progress callback logging every 10%."""
    state = {"last": -1}

    def report(p: float) -> None:
        pct = int(p * 100)
        if pct // 10 != state["last"] // 10 or pct == 100:
            state["last"] = pct
            logger.info("loading %s: %d%%", path, pct)

    return report


def show_native_log() -> None:
    """``verbose=True``: show llama.cpp's own log and load progress on stderr."""
    lg = logging.getLogger("langchain_llamacpp_local")
    if not lg.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
