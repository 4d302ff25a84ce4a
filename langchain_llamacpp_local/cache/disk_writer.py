"""The disk cache's writer thread: files written off the reply's path, in order.

When a reply is done the worker sends it, then copies the sequence state once into a
:class:`PendingSave` it reserved before; one background thread encodes, hashes and writes
the records in the order they were reserved. Pending writes are flushed at exit (a
``multiprocessing`` child's too); a forked child starts its own writer.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from typing import Any, Protocol

from langchain_llamacpp_local.cache.host_ram import CachedPrompt

logger = logging.getLogger(__name__)

#: Seconds the exit hook waits for pending writes.
_EXIT_FLUSH_S = 30.0


class RecordWriter(Protocol):
    """What the writer thread writes records for (a :class:`~.disk.DiskPromptCache`)."""

    def write_record(self, item: CachedPrompt) -> None:
        """Encode and write ``item`` (on the writer thread)."""

    def after_fork(self) -> None:
        """Renew the locks the writer thread may have held at a ``fork()``."""


class PendingSave:
    """A record's place in the writer's queue, taken before the reply is sent and filled
    after (:meth:`fill`), so that files keep their order and the exit flush waits for it."""

    def __init__(self) -> None:
        self.item: CachedPrompt | None = None
        self._ready = threading.Event()

    def fill(self, item: CachedPrompt | None) -> None:
        """Hand over the record (None: nothing to write); call exactly once."""
        self.item = item
        self._ready.set()

    def wait(self) -> CachedPrompt | None:
        self._ready.wait()
        return self.item


class _Writer:
    """One background thread encoding and writing files in order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="llamacpp-disk-cache", daemon=True)
        self._thread.start()

    def put(self, cache: RecordWriter, pending: PendingSave) -> None:
        self._queue.put(("write", cache, pending))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every file queued before this call is written (True) or ``timeout``."""
        done = threading.Event()
        self._queue.put(("mark", done))
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item[0] == "mark":
                item[1].set()
                continue
            _, cache, pending = item
            record = pending.wait()
            if record is None:
                continue
            try:
                cache.write_record(record)
            except Exception:  # a full disk or a removed directory must not kill the thread
                logger.warning("prompt cache: could not write a record", exc_info=True)


_writer_lock = threading.Lock()
_writer: _Writer | None = None
#: The cache objects the writer thread has written for, to renew their locks in a forked
#: child (the thread may have held one at the fork).
_caches: weakref.WeakSet[RecordWriter] = weakref.WeakSet()


def _get_writer() -> _Writer:
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = _Writer()
            _flush_at_child_exit()
        return _writer


def flush(timeout: float | None = None) -> bool:
    """Wait for the files queued so far to be written (tests, short-lived programs)."""
    writer = _writer
    return writer.flush(timeout) if writer is not None else True


def _flush_at_exit() -> None:
    flush(_EXIT_FLUSH_S)


def _flush_at_child_exit() -> None:
    """A ``multiprocessing`` child ends with ``os._exit`` (no atexit hooks) but runs its
    exit finalizers first: flush there too."""
    import multiprocessing.util  # only where a writer starts

    multiprocessing.util.Finalize(None, _flush_at_exit, exitpriority=0)


def _after_fork_in_child() -> None:
    """A forked child inherits the parent's writer but not its thread: what it queued
    would never be written and its exit flush would wait in vain. It starts afresh (the
    parent writes what the parent queued)."""
    global _writer, _writer_lock
    _writer_lock = threading.Lock()  # the parent's writer thread may have held a lock
    _writer = None
    for cache in list(_caches):
        cache.after_fork()


def queue_write(cache: RecordWriter, pending: PendingSave) -> None:
    """Queue ``pending`` for ``cache`` to write once it is filled."""
    _caches.add(cache)  # the writer thread takes its lock from now on
    _get_writer().put(cache, pending)


atexit.register(_flush_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
