"""The decode abort flag: a native callback ggml can call without the GIL, set by a
watcher thread from a request's cancel check."""

from __future__ import annotations

import ctypes
import threading
import time

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.llama.abort import POLL_S, DecodeAbort


def _callback_result(abort: DecodeAbort) -> bool:
    """Call the installed callback the way ggml does: with its data pointer."""
    params = C.llama_context_default_params()
    abort.install(params)
    return bool(params.abort_callback(params.abort_callback_data))


def test_the_callback_is_native_and_reads_the_flag() -> None:
    abort = DecodeAbort()
    assert abort.native, "no C library strlen found: the Python fallback would be used"
    params = C.llama_context_default_params()
    abort.install(params)
    # a native function pointer, not a ctypes thunk of a Python function
    addr = ctypes.cast(params.abort_callback, ctypes.c_void_p).value
    thunk = ctypes.cast(abort._py_callback, ctypes.c_void_p).value
    assert addr and addr != thunk
    assert _callback_result(abort) is False
    abort._byte[0] = b"\x01"
    assert _callback_result(abort) is True
    abort.close()


def test_the_watcher_sets_the_flag_only_while_watching() -> None:
    abort = DecodeAbort()
    cancel = threading.Event()
    ctx = None  # the native path never touches the context
    with abort.watch(ctx, cancel.is_set):
        time.sleep(POLL_S * 3)
        assert _callback_result(abort) is False
        cancel.set()
        deadline = time.monotonic() + 5
        while not _callback_result(abort) and time.monotonic() < deadline:
            time.sleep(POLL_S / 4)
        assert _callback_result(abort) is True
    # the next decode starts clear, even though this request stays cancelled
    assert _callback_result(abort) is False
    time.sleep(POLL_S * 3)
    assert _callback_result(abort) is False
    with abort.watch(ctx, None):
        assert _callback_result(abort) is False
    abort.close()
