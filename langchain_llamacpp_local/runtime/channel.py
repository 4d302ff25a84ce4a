"""A per-request reply channel between the worker thread and sync or async callers.

The worker never blocks on a caller: it appends and wakes. A sync caller waits
on a condition variable; an async caller waits on an ``asyncio.Event`` set
through ``call_soon_threadsafe``, so the event loop is never blocked.

A caller that reads the reply only as a whole (``invoke`` without streaming callbacks)
asks not to be woken for each piece of text (:meth:`Channel.wake_for_text`): a reader
woken at every token takes a CPU from llama.cpp's thread team in the middle of the next
decode, and the team's barriers wait for it (about a fifth of the decode speed of a
small model on 2 CPUs).

The other way round, a streaming reader starves for a CPU while the team decodes the
next token: its wake-up can wait for the scheduler's next tick (measured: 2.5-4 ms on 2
CPUs, in about a third of the turns of an agent loop). So the worker may hand the CPU to
the reader once, for the first text of a reply (:meth:`Channel.wait_reader`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Channel:
    """Single-producer, single-consumer queue of reply items."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._on_final: Callable[[], None] | None = None
        self._wake_for_text = True
        #: the reader waits in get/aget with nothing left to read
        self._reader_idle = False
        #: the producer waits in wait_reader for that
        self._awaited = False

    def wake_for_text(self, wake: bool) -> None:
        """Whether the reader is woken for each text item (``batchable`` items); when
        not, they wait in the queue until an item that is not batchable (the end of
        the reply, prompt progress) wakes it, and are read then, in order."""
        self._wake_for_text = wake

    @property
    def wakes_for_text(self) -> bool:
        """Whether the reader is woken for each text item (a streaming reader)."""
        return self._wake_for_text

    def on_final(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (once, on the producer's thread) when the reply's last item is put.

        What a request holds for its reply (its lease on the model) is given back when
        the reply is complete, not when the caller has read it: a stream left unread
        must not keep an idle model busy."""
        self._on_final = fn

    def bind_loop(self) -> None:
        """Attach the running event loop so ``aget`` can be awaited from it."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()

    def put(self, item: Any) -> None:
        if not self._wake_for_text and getattr(item, "batchable", False):
            with self._cond:
                self._items.append(item)
            return
        with self._cond:
            self._items.append(item)
            self._cond.notify()
        loop, event = self._loop, self._event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass
        # the item that ends a reply (runtime.requests' Finished, Failed): none follows
        if getattr(item, "final", False):
            fn, self._on_final = self._on_final, None
            if fn is not None:
                try:
                    fn()
                except Exception:  # the caller's hook must never break the producer
                    logger.exception("a reply's completion hook failed")

    def get(self, timeout: float | None = None) -> Any:
        """Next item; raises ``TimeoutError`` if none arrives within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                self._idle()
                try:
                    self._cond.wait(remaining)
                finally:
                    self._reader_idle = False
            return self._items.popleft()

    async def aget(self) -> Any:
        """Next item, awaited on the running event loop (bound at the first call: an
        item put before that is in the queue, and every later one wakes the loop)."""
        if self._event is None:
            self.bind_loop()
        assert self._event is not None
        while True:
            self._event.clear()
            with self._cond:
                if self._items:
                    return self._items.popleft()
                self._idle()
            try:
                await self._event.wait()
            finally:
                with self._cond:
                    self._reader_idle = False

    def _idle(self) -> None:
        """The reader is about to wait (the condition's lock held)."""
        self._reader_idle = True
        if self._awaited:
            self._cond.notify_all()

    def wait_reader(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until the reader has read every item and
        waits for the next one; False at once for a reader not woken for text.

        The producer calls it before decoding on: while it waits, its CPU is free, so a
        reader on a machine whose CPUs the thread team fills gets one at once instead of
        at the scheduler's next tick."""
        if not self._wake_for_text:
            return False
        deadline = time.monotonic() + timeout
        with self._cond:
            self._awaited = True
            try:
                while self._items or not self._reader_idle:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cond.wait(remaining)
                return True
            finally:
                self._awaited = False
