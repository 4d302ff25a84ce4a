"""One worker thread per loaded model: it owns the engine and serves requests in order.

Callers (the front end, ``chat/``) put a token-level
:class:`~langchain_llamacpp_local.runtime.requests.EngineRequest` on the worker's queue and
read its reply from the request's :class:`~langchain_llamacpp_local.runtime.channel.Channel`.
The thread reuses the longest cached prefix (restoring a state checkpoint where the
memory cannot be trimmed), decodes only the new suffix, samples, detokenizes, applies
stop strings and streams typed items back (:class:`TextDelta`, then :class:`Finished`
or :class:`Failed`). It renders, tokenizes and parses nothing: the caller's side does.
What it runs between two reads of its queue is :class:`~.loop.WorkerLoop`; this module
keeps the thread, its lifecycle and the callers' handle (:class:`ModelWorker`).

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
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.errors import RequestCancelledError, WorkerDeadError
from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.runtime.channel import Channel
from langchain_llamacpp_local.runtime.loop import STOP, StatsAsk, WorkerLoop
from langchain_llamacpp_local.runtime.requests import EngineRequest, Failed
from langchain_llamacpp_local.runtime.stats import ModelInfo, WorkerStats

logger = logging.getLogger(__name__)

#: Worker threads not yet ended (loading, serving or freeing their model): waited for
#: at interpreter exit (:func:`join_workers`).
_running: set[threading.Thread] = set()
_running_lock = threading.Lock()


def join_all(threads: Iterable[threading.Thread], timeout: float) -> None:
    """Wait up to ``timeout`` seconds in all for ``threads`` to end (never the calling
    one): the exit hooks' wait for threads that may still run llama.cpp."""
    deadline = time.monotonic() + timeout
    for t in threads:
        if t is not threading.current_thread():
            t.join(max(0.0, deadline - time.monotonic()))


def join_workers(timeout: float) -> None:
    """Wait up to ``timeout`` seconds in all for every worker thread to end (each told
    to stop before): one may still be loading or freeing its model, and llama.cpp calls
    into Python from there (its log), which a daemon thread must not do once the
    interpreter finalizes (see :func:`~.registry.shutdown_all`)."""
    with _running_lock:
        threads = list(_running)
    join_all(threads, timeout)


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
        state = WorkerLoop(config, cache, progress)
        self._state = state
        self._thread = threading.Thread(
            target=_thread_main,
            args=(state, self._queue, self._ready, weakref.ref(self)),
            name=f"llamacpp-worker:{config.model_path}",
            daemon=True,
        )
        with _running_lock:
            _running.add(self._thread)
        self._thread.start()
        self._ready.wait()
        if state.load_error is not None:
            raise state.load_error
        self.info = state.info
        # Stop the thread when the last user drops this worker.
        self._finalizer = weakref.finalize(self, self._queue.put, STOP)

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
        ask = StatsAsk()
        if not self.alive:
            raise WorkerDeadError(f"the worker for {self.config.model_path} has stopped")
        self._queue.put(ask)
        got = ask.channel.get()
        if isinstance(got, BaseException):
            raise got
        assert isinstance(got, WorkerStats)
        return got

    def call(self, fn: Callable[[WorkerLoop], Any]) -> Any:
        """Run ``fn(state)`` on the worker thread between steps and return its result.

        A test hook (tests install probes or faults on the engine with it): the package
        itself never uses it; its work reaches the worker as typed requests
        (:class:`EngineRequest`, :class:`ScoreRequest`) and :meth:`stats` reads it."""
        ch = Channel()
        if not self.alive:
            raise WorkerDeadError(f"the worker for {self.config.model_path} has stopped")
        self._queue.put((fn, ch))
        got = ch.get()
        if isinstance(got, Failed):
            raise got.error
        return got

    def stop(self, timeout: float | None = 30.0) -> None:
        self._finalizer()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _mark_dead(self, exc: BaseException) -> None:
        self._dead = exc


# --------------------------------------------------------------------------- thread


def _thread_main(
    state: WorkerLoop,
    q: queue.SimpleQueue[Any],
    ready: threading.Event,
    owner: weakref.ref[ModelWorker],
) -> None:
    try:
        _serve(state, q, ready, owner)
    finally:
        with _running_lock:
            _running.discard(threading.current_thread())


def _serve(
    state: WorkerLoop,
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
            item[1].put(Failed(exc))
        elif isinstance(item, StatsAsk):
            item.channel.put(exc)


__all__ = ["ModelWorker"]
