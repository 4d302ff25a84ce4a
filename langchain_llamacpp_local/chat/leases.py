"""A chat request's hold on its model: the lease, the submission, the release.

A request leases the loaded model from the registry (loading it, or waiting for room,
if needed), has its prompt prepared by the model's front end on the caller's side and
queues the token request; the lease goes back once the reply is complete, even when the
caller never reads it to the end. An async caller does the blocking parts (the load, the
preparation) on a worker-pool thread, and a cancelled task never strands a lease.

Other kinds of work made from a chat prompt (a decision question's scoring request)
take the same path (:func:`submit_as`) and are answered by one typed item
(:func:`answer_of`), waited for up to the request's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.chat.frontend import Frontend, frontend_for
from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.chat.reply import Reply
from langchain_llamacpp_local.errors import RequestTimeoutError
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.runtime.requests import EngineRequest, Failed

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


async def hold_off_loop(get: Callable[[], tuple[registry.Lease, T]]) -> tuple[registry.Lease, T]:
    """``get()`` (a blocking lease) on a worker-pool thread; if the task is cancelled,
    the lease it got, now or later, is released."""
    box: list[tuple[registry.Lease, T]] = []
    abandoned: list[bool] = []

    def run() -> tuple[registry.Lease, T]:
        got = get()
        box.append(got)
        if abandoned:
            got[0].release()
        return got

    try:
        return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    except BaseException:
        abandoned.append(True)
        for lease, _ in box:
            lease.release()
        raise


def submit(
    job: ChatJob,
    lease: registry.Lease,
    inflight: weakref.WeakSet[threading.Event],
    *,
    progress: bool = False,
    whole: bool = False,
) -> Reply:
    """Prepare ``job`` (on this thread: template, tokens, grammar) and queue it;
    ``inflight`` collects the cancel events of the caller's running requests;
    ``progress``: the worker reports prompt reading (a caller with callbacks);
    ``whole``: the reply is read only when it is complete (no wake-up per token)."""
    inflight.add(job.cancel)
    frontend = frontend_for(lease.worker)
    with lease.worker.preparing():
        request, prepared = frontend.prepare(job)
        request.prompt_progress = progress
        request.channel.wake_for_text(not whole)
        return _queue(request, prepared, frontend.info.model_name, lease)


async def asubmit(
    job: ChatJob,
    lease: registry.Lease,
    inflight: weakref.WeakSet[threading.Event],
    *,
    progress: bool = False,
    whole: bool = False,
) -> Reply:
    """:func:`submit` with the preparation off the event loop; its reply is read with
    ``aitems()``."""
    inflight.add(job.cancel)
    frontend = frontend_for(lease.worker)
    made: list[Any] = []

    def prepare() -> Any:
        made.append(frontend.prepare(job))
        return made[-1]

    with lease.worker.preparing():
        try:
            request, prepared = await anyio.to_thread.run_sync(prepare)
        except BaseException:  # cancelled while it ran: free what it built
            for req, _ in made:
                req.close_sampler()
            raise
        request.channel.bind_loop()
        request.prompt_progress = progress
        request.channel.wake_for_text(not whole)
        return _queue(request, prepared, frontend.info.model_name, lease)


def _queue(request: EngineRequest, prepared: Any, model_name: str, lease: registry.Lease) -> Reply:
    reply = Reply(request, prepared, model_name)
    reply.explain_miss = frontend_for(lease.worker).explain_miss
    # the model is free for others (keep-alive, max_loaded_models) once the reply is
    # complete, even if the caller never reads it to the end
    request.channel.on_final(lease.release)
    lease.worker.submit(request)
    return reply


def submit_as(
    job: ChatJob,
    lease: registry.Lease,
    inflight: weakref.WeakSet[threading.Event],
    convert: Convert[R],
) -> R:
    """Prepare ``job`` as :func:`submit` does, queue ``convert(frontend, request)``
    instead of the chat request and return it: its answer is one final item
    (:func:`answer_of`). The lease stays the caller's to release."""
    inflight.add(job.cancel)
    frontend = frontend_for(lease.worker)
    with lease.worker.preparing():
        request = _convert(frontend, job, convert)
        lease.worker.submit(request)
        return request


async def asubmit_as(
    job: ChatJob,
    lease: registry.Lease,
    inflight: weakref.WeakSet[threading.Event],
    convert: Convert[R],
) -> R:
    """:func:`submit_as` with the preparation off the event loop; its answer is read
    with :func:`aanswer_of`."""
    inflight.add(job.cancel)
    frontend = frontend_for(lease.worker)
    made: list[EngineRequest] = []

    def prepare() -> R:
        made.append(_convert(frontend, job, convert))
        return made[-1]  # type: ignore[return-value]

    with lease.worker.preparing():
        try:
            request = await anyio.to_thread.run_sync(prepare)
        except BaseException:  # cancelled while it ran: free what it built
            for req in made:
                req.close_sampler()
            raise
        request.channel.bind_loop()
        lease.worker.submit(request)
        return request


def _convert(frontend: Frontend, job: ChatJob, convert: Convert[R]) -> R:
    request, _ = frontend.prepare(job)
    try:
        return convert(frontend, request)
    finally:
        request.close_sampler()  # what the converted request does not take


def answer_of(request: EngineRequest) -> Any:
    """The final item of a request answered by one item (a :class:`Failed` raises its
    error); past the request's deadline it is cancelled and ``RequestTimeoutError``
    raised, and it is cancelled too if the wait ends any other way."""
    done = False
    try:
        try:
            item = request.channel.get(timeout=_left(request))
        except TimeoutError:
            raise RequestTimeoutError("the request timed out") from None
        done = True
    finally:
        if not done:
            request.cancel.set()
    return _answer(item)


async def aanswer_of(request: EngineRequest) -> Any:
    """:func:`answer_of` for an event loop (the request's channel bound to it)."""
    done = False
    try:
        try:
            with anyio.fail_after(_left(request)):
                item = await request.channel.aget()
        except TimeoutError:
            raise RequestTimeoutError("the request timed out") from None
        done = True
    finally:
        if not done:
            request.cancel.set()
    return _answer(item)


def _left(request: EngineRequest) -> float | None:
    """Seconds left before ``request``'s deadline (None: it has none)."""
    return None if request.deadline is None else max(request.deadline - time.monotonic(), 0)


def _answer(item: Any) -> Any:
    """A request's final item, or the error of a :class:`Failed` one."""
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
