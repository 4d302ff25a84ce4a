"""The decode abort flag: a native callback ggml can call without the GIL, set the moment
a request's cancel flag is set (or its deadline passes), or by a watcher thread polling a
plain cancel check."""

from __future__ import annotations

import ctypes
import threading
import time

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.llama.abort import POLL_S, CancelCheck, CancelFlag, DecodeAbort


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


def test_setting_a_requests_flag_aborts_its_decode_at_once_with_no_thread() -> None:
    abort = DecodeAbort()
    flag = CancelFlag()
    with abort.watch(None, CancelCheck(flag)):
        assert _callback_result(abort) is False
        flag.set()  # the caller's thread sets the byte: no poll to wait for
        assert _callback_result(abort) is True
    assert _callback_result(abort) is False
    assert abort._thread is None  # nothing polled, nothing slept until a deadline
    abort.close()


def test_a_flag_set_before_the_decode_aborts_it_and_a_late_set_touches_nothing() -> None:
    abort = DecodeAbort()
    done = CancelFlag()
    done.set()
    with abort.watch(None, CancelCheck(done)):
        assert _callback_result(abort) is True
    flag = CancelFlag()
    with abort.watch(None, CancelCheck(flag)):
        pass
    flag.set()  # after its decode: the next decode of this context must not abort
    assert _callback_result(abort) is False
    assert not flag._hooks
    abort.close()


def test_a_deadline_aborts_the_decode_when_it_passes() -> None:
    abort = DecodeAbort()
    check = CancelCheck(CancelFlag(), deadline=time.monotonic() + 0.1)
    with abort.watch(None, check):
        assert _callback_result(abort) is False
        end = time.monotonic() + 5
        while not _callback_result(abort) and time.monotonic() < end:
            time.sleep(0.01)
        assert _callback_result(abort) is True
        assert check()  # and the request reads as cancelled (timed out)
    assert _callback_result(abort) is False
    abort.close()
