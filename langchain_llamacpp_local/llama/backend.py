"""llama.cpp's process-wide start, and its native logs (llama, ggml, mtmd) routed
through :mod:`logging`.

Every other module of ``llama/`` starts the backend through :func:`init_backend` before
its first call into llama.cpp, so the log is routed before anything is printed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Iterator

import llama_cpp
import llama_cpp.llama_cpp as C

native_logger = logging.getLogger("langchain_llamacpp_local.llama_cpp")

_backend_lock = threading.Lock()
_backend_ready = False


def _after_fork_in_child() -> None:
    """The lock may have been held by a parent's thread at the fork (the backend
    itself, started once, stays started in the child)."""
    global _backend_lock
    _backend_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

_LEVELS = {
    1: logging.DEBUG,  # GGML_LOG_LEVEL_DEBUG
    2: logging.DEBUG,  # INFO: llama.cpp is chatty; keep it below the default threshold
    3: logging.INFO,  # WARN
    4: logging.ERROR,  # ERROR
}
_last_level = logging.DEBUG


class _AbortState:
    """Set while a requested abort unwinds (the abort callback runs on ggml's threads)."""

    active = False


aborting = _AbortState()


class _Captured(threading.local):
    """Lines llama.cpp logs on this thread while a load is watched (the loaders log from
    the calling thread), with their :mod:`logging` level."""

    lines: list[tuple[int, str]] | None = None


_captured = _Captured()


@contextlib.contextmanager
def capture_log() -> Iterator[list[tuple[int, str]]]:
    """Collect what llama.cpp logs on this thread: the weight buffers a load reports, and
    its reasons for a failed load (they go to the log, not to the caller)."""
    lines: list[tuple[int, str]] = []
    previous, _captured.lines = _captured.lines, lines
    try:
        yield lines
    finally:
        _captured.lines = previous


def log_reasons(lines: list[tuple[int, str]]) -> str:
    """The warning and error lines of a capture, as one line."""
    return " ".join(" ".join(text for lvl, text in lines if lvl >= logging.WARNING).split())


@C.llama_log_callback
def log_callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    global _last_level
    lvl = _last_level if level == 5 else _LEVELS.get(level, logging.DEBUG)  # 5 = CONT
    if aborting.active:
        lvl = logging.DEBUG  # llama.cpp reports a requested abort as an error: it is not one
    _last_level = lvl
    captured = _captured.lines
    if captured is not None:
        captured.append((lvl, text.decode("utf-8", errors="replace").rstrip("\n")))
    if native_logger.isEnabledFor(lvl):
        native_logger.log(lvl, text.decode("utf-8", errors="replace").rstrip("\n"))


def init_backend() -> None:
    """Initialise llama.cpp once per process and route its log through :mod:`logging`."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        C.llama_log_set(log_callback, ctypes.c_void_p(0))
        C.llama_backend_init()
        _backend_ready = True


def route_mtmd_log() -> None:
    """Send mtmd/clip's own log (a separate logger in llama.cpp) through :mod:`logging`
    too; by default it prints to stderr. Set again before every projector load: other
    code in the process (llama-cpp-python's own chat handlers) may have replaced it, and
    a failed load's reasons are read from this log."""
    from llama_cpp import mtmd_cpp as M

    with _backend_lock:
        M.mtmd_log_set(log_callback, ctypes.c_void_p(0))
        M.mtmd_helper_log_set(log_callback, ctypes.c_void_p(0))


def build_info() -> str:
    """The llama.cpp build: llama-cpp-python's version and what ggml was compiled with
    (a saved sequence state is only read back by the build that wrote it)."""
    init_backend()
    return f"llama-cpp-python {llama_cpp.__version__}; {C.llama_print_system_info().decode()}"
