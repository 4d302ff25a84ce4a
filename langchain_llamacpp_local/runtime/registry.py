"""The process-wide table of loaded models: sharing, keep-alive and the loaded-model budget.

Requests take a :class:`Lease` on the worker for their :class:`LoadConfig`; the
registry loads the model on first use and holds it strongly until it has been idle
(no lease) for its ``keep_alive`` seconds (Ollama's semantics: ``0`` frees it right
after the call, a negative value keeps it until :func:`unload` or exit). At most
``max_loaded_models`` models stay loaded: loading one more evicts the least recently
used idle model, never one with running or queued requests, and waits for one to
become idle when all are busy.

Locking rules:

* ``_lock`` guards bookkeeping only. It is never held across a load, an unload or
  a thread join, so a thread waiting for it never waits on llama.cpp.
* Code that can run inside the garbage collector (a generator's ``finally``, a
  ``__del__``) never takes a lock: :meth:`Lease.release` only posts to ``_events``,
  a :class:`queue.SimpleQueue` (documented as safe to call re-entrantly from
  finalizers). The reaper thread, or the next registry call, applies the events.
* A model loads on its own loader thread. A caller interrupted while waiting
  (``KeyboardInterrupt``, a cancelled task) gives up only its wait: the load still
  completes, is registered and is reused by the next call, or freed after
  ``keep_alive`` like any idle model. Nothing is left on a thread nobody can stop.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.errors import RequestCancelledError, RequestTimeoutError
from langchain_llamacpp_local.runtime.worker import ModelWorker, join_all, join_workers

logger = logging.getLogger(__name__)

#: Seconds an idle model stays loaded unless told otherwise (Ollama's default).
DEFAULT_KEEP_ALIVE = 300.0
#: Models kept loaded at once unless ``LLAMACPP_MAX_LOADED_MODELS`` or the field says
#: otherwise (Ollama's default for CPU-only machines).
DEFAULT_MAX_LOADED_MODELS = 3

#: A chat model's (LoadConfig, CacheOptions), or another loaded thing's (config, None)
#: with a ``factory`` (an embedding or rerank context: :func:`acquire`).
Key = tuple[Any, Any]


#: ``keep_alive`` past this (ten years, or ``inf``) means "forever", as a negative value
#: does: a timestamp that far away overflows the clock functions that wait for it.
MAX_KEEP_ALIVE = 10 * 365 * 24 * 3600.0


def keep_alive_seconds(value: float) -> float:
    """``keep_alive`` seconds bounded: negative, ``inf`` or past :data:`MAX_KEEP_ALIVE`
    mean "stay loaded" (-1.0); ``nan`` is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"keep_alive must be seconds or a duration like '5m', not {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float: as good as forever
        return -1.0
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number of seconds, not nan")
    if seconds < 0 or seconds > MAX_KEEP_ALIVE:
        return -1.0
    return seconds


def default_max_loaded_models() -> int:
    """``LLAMACPP_MAX_LOADED_MODELS`` if set (a positive integer), else 3."""
    raw = os.environ.get("LLAMACPP_MAX_LOADED_MODELS")
    if raw is None or not raw.strip():
        return DEFAULT_MAX_LOADED_MODELS
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"LLAMACPP_MAX_LOADED_MODELS must be a positive integer, not {raw!r}"
        ) from None
    if value < 1:
        raise ValueError(f"LLAMACPP_MAX_LOADED_MODELS must be a positive integer, not {raw!r}")
    return value


class _LoadedWorker:
    """One model in the table: loading, loaded, or failed."""

    __slots__ = ("key", "worker", "loaded", "error", "active", "last_used", "keep_alive", "doomed")

    def __init__(self, key: Key, keep_alive: float) -> None:
        keep_alive = keep_alive_seconds(keep_alive)
        self.key = key
        self.worker: ModelWorker | None = None
        self.loaded = threading.Event()
        self.error: BaseException | None = None
        self.active = 0  # leases held or reserved: running or queued requests
        self.last_used = time.monotonic()
        self.keep_alive = keep_alive
        self.doomed = False  # unload() asked for it while busy: free it once idle

    def dead(self) -> bool:
        return self.worker is not None and not self.worker.alive

    def expires_at(self) -> float | None:
        if self.worker is None or self.active:
            return None
        if self.doomed:
            return self.last_used
        if self.keep_alive < 0:
            return None
        return self.last_used + self.keep_alive


_lock = threading.Lock()
_cond = threading.Condition(_lock)
_table: dict[Key, _LoadedWorker] = {}
_events: queue.SimpleQueue[Any] = queue.SimpleQueue()
_WAKE = ("wake",)
_n_loads = 0  # models loaded successfully (guarded by _lock)
_reaper: threading.Thread | None = None
#: Set at interpreter exit (:func:`shutdown_all`): the reaper ends its loop.
_closing = threading.Event()
#: the parent's models in a forked child: kept referenced (never stopped or freed there)
_forked_away: list[_LoadedWorker] = []


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads: its workers, loaders and reaper
    are gone, a model being loaded at the fork never finishes, and the lock may be held.
    The child starts with an empty table (its models load again on first use)."""
    global _lock, _cond, _events, _reaper
    _lock = threading.Lock()
    _cond = threading.Condition(_lock)
    _events = queue.SimpleQueue()
    _reaper = None
    _forked_away.extend(_table.values())
    _table.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Lease:
    """A request's hold on a loaded model: the model is not evicted while it is held.

    :meth:`release` is idempotent and safe from any thread, a finalizer included.
    """

    __slots__ = ("_entry", "_keep_alive", "_once", "__weakref__")

    def __init__(self, entry: _LoadedWorker, keep_alive: float) -> None:
        # Created with ``_lock`` held, right after the entry's count was raised: from
        # here on, however the caller unwinds, dropping the lease gives the count back.
        self._once = [True]
        self._entry = entry
        self._keep_alive = keep_alive_seconds(keep_alive)

    @property
    def worker(self) -> ModelWorker:
        worker = self._entry.worker
        if worker is None:
            raise RuntimeError("the model of this lease has not finished loading")
        return worker

    def release(self) -> None:
        """Give the hold back; the keep-alive clock starts when the last one goes."""
        try:
            self._once.pop()  # atomic: only the first call gets past here
        except IndexError:
            return
        _events.put(("release", self._entry, self._keep_alive, time.monotonic()))

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: the registry is going away too
            pass


# --------------------------------------------------------------------------- events


def _apply(event: tuple[Any, ...]) -> bool:
    """Apply one posted event (``_lock`` held); True if it changed a deadline."""
    if event[0] == "release":
        _, entry, keep_alive, when = event
        entry.active -= 1
        entry.last_used = max(entry.last_used, when)
        entry.keep_alive = keep_alive  # the last request's keep_alive wins, as in Ollama
        return True
    return False


def _apply_pending() -> bool:
    changed = False
    while True:
        try:
            event = _events.get_nowait()
        except queue.Empty:
            return changed
        changed = _apply(event) or changed


def _take_expired(now: float) -> list[_LoadedWorker]:
    """Remove (``_lock`` held) the entries to free now: idle past keep-alive, or dead."""
    out = []
    for key, e in list(_table.items()):
        exp = e.expires_at()
        if e.dead() or (exp is not None and now >= exp):
            del _table[key]
            out.append(e)
    return out


def _next_deadline() -> float | None:
    times = [t for e in _table.values() if (t := e.expires_at()) is not None]
    return min(times) if times else None


def _free(entries: list[_LoadedWorker]) -> None:
    """Stop the workers of removed entries (never with ``_lock`` held)."""
    for e in entries:
        if e.worker is not None:
            logger.debug("unloading %s", e.key[0].model_path)
            e.worker.stop()


#: The reaper wakes at least this often (a far deadline is never passed to a clock wait).
_MAX_WAIT_S = 3600.0


def _reaper_main() -> None:
    """Free idle models when their keep-alive runs out, until the exit hook. No error
    ends this loop: one in a round is logged and the next round runs."""
    while not _closing.is_set():
        try:
            _reap_once()
        except Exception:  # noqa: BLE001 - the reaper outlives any bad value
            logger.exception("the model registry's reaper hit an error; it keeps running")
            time.sleep(0.1)


def _reap_once() -> None:
    with _cond:
        deadline = _next_deadline()
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        event = _events.get(timeout=_MAX_WAIT_S if timeout is None else min(timeout, _MAX_WAIT_S))
    except queue.Empty:
        event = None
    with _cond:
        if event is not None:
            _apply(event)
        _apply_pending()
        expired = _take_expired(time.monotonic())
        _cond.notify_all()
    _free(expired)


def _ensure_reaper() -> None:
    global _reaper
    if _reaper is not None and _reaper.is_alive():
        return
    with _cond:
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reaper_main, name="llamacpp-registry", daemon=True)
            _reaper.start()


# --------------------------------------------------------------------------- acquire


def acquire(
    config: Any,
    cache: CacheOptions | None,
    progress: Callable[[float], None] | None = None,
    *,
    keep_alive: float = DEFAULT_KEEP_ALIVE,
    max_loaded_models: int | None = None,
    deadline: float | None = None,
    factory: Callable[[], Any] | None = None,
) -> Lease:
    """A lease on the loaded model for these settings, loading it if needed.

    ``deadline`` (``time.monotonic()``) bounds the wait for a free place in the
    budget and for the load; past it ``TimeoutError`` is raised and a load already
    started still completes and is kept for ``keep_alive``.

    ``factory`` loads something other than a chat :class:`ModelWorker` for ``config``
    (an embedding context, keyed by its config and ``cache=None``): an object with
    ``alive`` and ``stop()``, shared, kept alive and evicted like a chat model.

    Once the exit hook ran (:func:`shutdown_all`) nothing is loaded any more: a call
    from a thread still running then gets :class:`RequestCancelledError`.
    """
    if _closing.is_set():
        raise RequestCancelledError("the interpreter is exiting: no model is loaded any more")
    _ensure_reaper()
    key = (config, cache)
    budget = max_loaded_models or default_max_loaded_models()
    victims: list[_LoadedWorker] = []
    new = False
    warned = False
    t0 = time.monotonic()
    try:
        with _cond:
            if _apply_pending():
                _events.put(_WAKE)  # the reaper's next deadline may have moved
            while True:
                entry = _table.get(key)
                if entry is not None and entry.dead():
                    del _table[key]
                    victims.append(entry)
                    entry = None
                if entry is not None:
                    entry.active += 1
                    lease = Lease(entry, keep_alive)
                    break
                while len(_table) >= budget:
                    idle = [e for e in _table.values() if e.worker is not None and not e.active]
                    if not idle:
                        break
                    victim = min(idle, key=lambda e: e.last_used)
                    del _table[victim.key]
                    victims.append(victim)
                    logger.debug(
                        "evicting idle %s (max_loaded_models=%d)", victim.key[0].model_path, budget
                    )
                if len(_table) < budget:
                    entry = _table[key] = _LoadedWorker(key, keep_alive)
                    entry.active = 1
                    lease = Lease(entry, keep_alive)
                    new = True
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RequestTimeoutError(
                        f"{len(_table)} models are loaded (max_loaded_models={budget}) and all "
                        f"have running or queued requests; none became idle in time to load "
                        f"{config.model_path}"
                    )
                if not warned and time.monotonic() - t0 > 10:
                    warned = True
                    logger.warning(
                        "waiting for one of %d busy models to become idle to load %s "
                        "(max_loaded_models=%d)",
                        len(_table),
                        config.model_path,
                        budget,
                    )
                _cond.wait(timeout=1.0 if remaining is None else min(remaining, 1.0))
                if _apply_pending():
                    _events.put(_WAKE)
    finally:
        _free(victims)
    try:
        if new:
            threading.Thread(
                target=_load,
                args=(entry, config, cache, progress, factory),
                name=f"llamacpp-load:{config.model_path}",
                daemon=True,
            ).start()
        _await_loaded(entry, deadline)
    except BaseException:
        # KeyboardInterrupt, a cancelled task, a timeout or a failed load: the
        # reservation goes back through the event queue (no lock: we may be unwinding
        # anywhere), and the load itself finishes on its own thread.
        lease.release()
        raise
    return lease


def _await_loaded(entry: _LoadedWorker, deadline: float | None) -> None:
    """Wait for ``entry`` to finish loading (short waits: Ctrl-C is seen promptly)."""
    while not entry.loaded.wait(0.25):
        if deadline is not None and time.monotonic() >= deadline:
            raise RequestTimeoutError(
                f"loading {entry.key[0].model_path} took longer than the request's timeout "
                "(it goes on loading and will be reused)"
            )
    if entry.error is not None:
        raise entry.error


def _load(
    entry: _LoadedWorker,
    config: Any,
    cache: CacheOptions | None,
    progress: Callable[[float], None] | None,
    factory: Callable[[], Any] | None = None,
) -> None:
    """Loader thread: build the worker, then publish it (or the error) to the waiters."""
    global _n_loads
    try:
        worker = factory() if factory is not None else ModelWorker(config, cache, progress)
    except BaseException as exc:
        with _cond:
            entry.error = exc
            if _table.get(entry.key) is entry:
                del _table[entry.key]
            _cond.notify_all()
        entry.loaded.set()
        return
    with _cond:
        entry.worker = worker
        entry.last_used = time.monotonic()
        _n_loads += 1
        _cond.notify_all()
    entry.loaded.set()
    _events.put(_WAKE)


# --------------------------------------------------------------------------- control


def unload(config: Any = None, cache: CacheOptions | None = None) -> int:
    """Free loaded models now: those of ``config`` (any cache options if ``cache`` is
    None), or all when ``config`` is None. A model with running or queued requests
    is freed as soon as they finish. Returns how many were freed now."""
    with _cond:
        _apply_pending()
        chosen = [
            e
            for e in _table.values()
            if config is None or (e.key[0] == config and (cache is None or e.key[1] == cache))
        ]
        freed = []
        for e in chosen:
            e.doomed = True
            if e.worker is not None and not e.active:
                del _table[e.key]
                freed.append(e)
        _cond.notify_all()
    _events.put(_WAKE)
    _free(freed)
    return len(freed)


def shutdown_all(timeout: float = 10.0) -> None:
    """Stop every worker (at interpreter exit): running requests are cancelled. Other
    loaded things (embedding contexts) are left to their own finalizers: closing one
    waits for a call that may still run on a daemon thread.

    Nothing of llama.cpp may still run on a daemon thread once the interpreter
    finalizes: llama.cpp logs (and reports load progress) through Python callbacks, and
    a daemon thread entering Python then is ended with ``pthread_exit``, whose unwinding
    through llama.cpp's C++ frames aborts the process ("terminate called without an
    active exception"). So the reaper ends after the model it may be freeing, a load in
    flight finishes and its worker is stopped, and every worker thread is waited for,
    those of models freed just before as well (all within ``timeout``)."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    _closing.set()
    _events.put(_WAKE)
    if _reaper is not None:
        join_all([_reaper], left())
    with _cond:
        entries = list(_table.values())
        _table.clear()
    for e in entries:  # a load in flight: it finishes, then its worker is stopped
        e.loaded.wait(left())
    for e in entries:
        if isinstance(e.worker, ModelWorker):
            e.worker._finalizer()
    join_workers(left())


atexit.register(shutdown_all)


def live_workers() -> int:
    """How many models are loaded (for tests and diagnostics)."""
    with _cond:
        return sum(1 for e in _table.values() if e.worker is not None and e.worker.alive)


def load_count() -> int:
    """Models loaded successfully by this process so far (for tests and benchmarks)."""
    return _n_loads


@dataclass(frozen=True)
class LoadedModel:
    """What :func:`loaded_models` reports about one model."""

    model_path: str
    mmproj_path: str | None
    active: int
    idle_seconds: float
    keep_alive: float


def loaded_models() -> list[LoadedModel]:
    """The models loaded now, most recently used first."""
    now = time.monotonic()
    with _cond:
        if _apply_pending():  # a release taken here must still reach the reaper
            _events.put(_WAKE)
        rows = [
            LoadedModel(
                e.key[0].model_path,
                getattr(e.key[0], "mmproj_path", None),
                e.active,
                0.0 if e.active else now - e.last_used,
                e.keep_alive,
            )
            for e in _table.values()
            if e.worker is not None and e.worker.alive
        ]
    rows.sort(key=lambda r: r.idle_seconds)
    return rows


__all__ = [
    "DEFAULT_KEEP_ALIVE",
    "DEFAULT_MAX_LOADED_MODELS",
    "Lease",
    "LoadedModel",
    "acquire",
    "default_max_loaded_models",
    "live_workers",
    "load_count",
    "loaded_models",
    "shutdown_all",
    "unload",
]
