"""A chat request's hold on its model: the lease, the submission, the release.

A request leases the loaded model from the registry (loading it, or waiting for room,
if needed), has its prompt prepared by the model's front end on the caller's side and
queues the token request; the lease goes back once the reply is complete, even when the
caller never reads it to the end. An async caller does the blocking parts (the load, the
preparation) on a worker-pool thread, and a cancelled task never strands a lease.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.chat.frontend import frontend_for
from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.chat.reply import Reply
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.runtime.requests import EngineRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
