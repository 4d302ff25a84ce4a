"""Cancelling a running ``llama_decode`` without calling into Python from ggml's threads.

ggml's CPU backend calls a context's abort callback after every node of the graph
(about a thousand per token for a small model), from the thread that called
``llama_decode``, while the other threads of its team spin at the next barrier. A Python
callback (a ctypes thunk) must take the GIL for each of those calls: idle that costs
about 7 % of a small model's decode speed, and while another Python thread holds the
GIL (a caller rendering a template or parsing a reply) each call waits up to the
interpreter's switch interval, which stretched a 3-token decode to over a second.

So the callback is a native function that reads one byte and never touches the
interpreter: the C library's ``strlen`` over a two-byte buffer, which returns 0 or 1,
the ``bool`` ggml expects in the same return register on every ABI llama.cpp builds
for. A decode that may be cancelled (a prompt piece) has the byte set the moment its
request is cancelled: a request's :class:`CancelFlag` calls the decode's hook when a
caller sets it, and a request with a deadline has one thread per context sleep until
then. Nothing wakes while a decode runs: a thread polling every 20 ms took a CPU from
the thread team about a dozen times per prompt piece of an agent turn, each time
stalling the team at its next barrier. A cancel check that is a plain callable is
polled every :data:`POLL_S` by that thread instead. Where no C library can be found,
the Python callback is installed for those decodes only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.llama.backend import aborting

logger = logging.getLogger(__name__)

#: How often a watched decode's cancel check runs (seconds).
POLL_S = 0.02


def _native_strlen() -> int | None:
    """The address of the C library's ``strlen``, or None where it cannot be found."""
    candidates: list[Callable[[], ctypes.CDLL]] = []
    if sys.platform == "win32":
        candidates += [lambda: ctypes.CDLL("ucrtbase"), lambda: ctypes.CDLL("msvcrt")]
    else:
        # the process's own symbols first: find_library runs ldconfig (a subprocess,
        # a fifth of a second), so only where that fails
        candidates += [
            lambda: ctypes.CDLL(None),
            lambda: ctypes.CDLL(ctypes.util.find_library("c")),
        ]
    for load in candidates:
        try:
            fn = load().strlen
        except (OSError, AttributeError, TypeError):
            continue
        addr = ctypes.cast(fn, ctypes.c_void_p).value
        if addr:
            return int(addr)
    return None


_STRLEN = _native_strlen()


class CancelFlag(threading.Event):
    """A request's cancel event that also calls the hooks of the decodes watching it,
    on the thread that sets it."""

    def __init__(self) -> None:
        super().__init__()
        self._hooks: list[Callable[[], None]] = []
        self._hook_lock = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._hook_lock:
            hooks = list(self._hooks)
        for fn in hooks:
            fn()

    def add_hook(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the flag is set (at once if it is set already)."""
        with self._hook_lock:
            self._hooks.append(fn)
        if self.is_set():
            fn()

    def remove_hook(self, fn: Callable[[], None]) -> None:
        with self._hook_lock, contextlib.suppress(ValueError):
            self._hooks.remove(fn)


@dataclass(frozen=True)
class CancelCheck:
    """What stops a decode: its request's ``flag``, set by a caller, or its
    ``deadline`` (``time.monotonic()``), passed. Called, it says whether either has
    happened (a passed deadline sets the flag), as a request's ``cancelled()`` does."""

    flag: CancelFlag
    deadline: float | None = None

    def __call__(self) -> bool:
        return is_cancelled(self.flag, self.deadline)


def is_cancelled(flag: threading.Event, deadline: float | None) -> bool:
    """Whether a request with this cancel ``flag`` and ``deadline`` is to stop (a passed
    deadline sets the flag): every request's ``cancelled()``."""
    if flag.is_set():
        return True
    if deadline is not None and time.monotonic() >= deadline:
        flag.set()
        return True
    return False


class DecodeAbort:
    """One context's abort flag: a byte ggml reads natively, set by a watcher thread.

    ``install(cparams)`` wires it into the context parameters before the context is
    created; ``watch(cancel)`` brackets a decode that ``cancel()`` may stop.
    """

    def __init__(self) -> None:
        self._byte = ctypes.create_string_buffer(2)
        self.native = _STRLEN is not None
        # kept referenced for the context's life: ggml holds the raw pointers
        self._callback = (
            C.ggml_abort_callback(_STRLEN) if _STRLEN is not None else C.ggml_abort_callback()
        )
        self._py_callback = C.ggml_abort_callback(self._python_check)
        self._cond = threading.Condition()
        #: a polled cancel check (a plain callable) of the decode running now
        self._check: Callable[[], bool] | None = None
        #: the deadline of the decode running now (a :class:`CancelCheck`'s)
        self._deadline: float | None = None
        #: the hook of the decode running now: a hook called late is a no-op
        self._armed: object | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def install(self, cparams: C.llama_context_params) -> None:
        """Set the context's abort callback and its data (before the context exists)."""
        cparams.abort_callback = self._callback
        cparams.abort_callback_data = ctypes.cast(self._byte, ctypes.c_void_p)

    def _python_check(self, _data: ctypes.c_void_p) -> bool:
        check = self._check
        if check is not None and check():
            aborting.active = True
            return True
        return False

    @contextlib.contextmanager
    def watch(self, ctx: C.llama_context_p, cancel: Callable[[], bool] | None) -> Iterator[None]:
        """Let ``cancel()`` stop the decode run inside this block."""
        if cancel is None:
            yield
            return
        if not self.native:
            self._check = cancel
            C.llama_set_abort_callback(ctx, self._py_callback, None)
            try:
                yield
            finally:
                C.llama_set_abort_callback(ctx, self._callback, None)
                self._check = None
            return
        if isinstance(cancel, CancelCheck):
            with self._hooked(cancel):
                yield
            return
        with self._cond:
            self._check = cancel
            self._start_thread()
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._check = None
                self._byte[0] = b"\x00"

    @contextlib.contextmanager
    def _hooked(self, check: CancelCheck) -> Iterator[None]:
        """Set the byte from the flag's hook, or from the thread at the deadline."""
        token = object()

        def trip() -> None:
            with self._cond:
                if self._armed is token:
                    self._trip()

        with self._cond:
            self._armed = token
            if check.deadline is not None:
                self._deadline = check.deadline
                self._start_thread()
                self._cond.notify_all()
        check.flag.add_hook(trip)
        try:
            yield
        finally:
            check.flag.remove_hook(trip)
            with self._cond:
                self._armed = None
                self._deadline = None
                self._byte[0] = b"\x00"

    def _trip(self) -> None:
        """Abort the decode running now (``self._cond`` held)."""
        aborting.active = True
        self._byte[0] = b"\x01"

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="llamacpp-abort-watch", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._check is not None:  # a plain callable: polled
                    self._cond.wait(POLL_S)
                    check = self._check
                    if check is not None and self._byte[0] == b"\x00" and check():
                        self._trip()
                elif self._deadline is not None:
                    remaining = self._deadline - time.monotonic()
                    if remaining > 0:
                        self._cond.wait(remaining)
                    else:
                        self._deadline = None
                        if self._armed is not None:
                            self._trip()
                else:
                    self._cond.wait()

    def close(self) -> None:
        """Stop the watcher thread (the context is being freed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
