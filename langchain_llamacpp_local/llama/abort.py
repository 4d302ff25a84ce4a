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
for. A decode that may be cancelled (a prompt piece) is watched by one sleeping thread
per context that polls the request's cancel check every :data:`POLL_S` and sets the
byte: the abort then lands within one poll and one graph node. Where no C library can be
found, the Python callback is installed for those decodes only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import sys
import threading
from collections.abc import Callable, Iterator

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
        self._check: Callable[[], bool] | None = None
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
        with self._cond:
            self._check = cancel
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="llamacpp-abort-watch", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._check = None
                self._byte[0] = b"\x00"

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._check is None:
                    self._cond.wait()
                    continue
                self._cond.wait(POLL_S)
                check = self._check
                if check is not None and self._byte[0] == b"\x00" and check():
                    aborting.active = True
                    self._byte[0] = b"\x01"

    def close(self) -> None:
        """Stop the watcher thread (the context is being freed)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
