"""A thread that stops decoding gives its OpenMP helper threads back (llama.omp): an
embedding call when it returns, a chat model's worker when no request is left. Counted
as the process's threads on real llama.cpp; each test also shows the helper staying
when the release is switched off, so it cannot pass by accident."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings
from langchain_llamacpp_local.llama import omp

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts Linux threads"),
    pytest.mark.skipif(omp._pause() is None, reason="llama.cpp is not built with libgomp"),
]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_at(want: int, within_s: float = 5.0) -> int:
    """The thread count once it equals ``want`` (or the last seen, after ``within_s``)."""
    end = time.monotonic() + within_s
    n = _threads()
    while n != want and time.monotonic() < end:
        time.sleep(0.01)
        n = _threads()
    return n


@pytest.fixture
def release_off(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Switch the release off; returns the real one, to end the pools left behind."""
    real = omp._pause()
    assert real is not None
    monkeypatch.setattr(omp, "_pause", lambda: None)
    return lambda: real(1)


def test_an_embedding_call_gives_back_its_threads_helpers(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an explicit team of 2: a parallel region whatever the CPU budget grants
    emb = LlamaCppEmbeddings(model_path=tiny_llama, n_ctx=128, n_threads=2).load()
    real = omp._pause()
    assert real is not None
    try:
        real(1)  # whatever an earlier test left on this thread
        before = _threads()
        emb.embed_documents(["one", "two", "three"])
        assert _threads() == before

        monkeypatch.setattr(omp, "_pause", lambda: None)
        try:
            emb.embed_documents(["one", "two", "three"])
            assert _threads() == before + 1  # this thread's pool: one helper
        finally:
            real(1)
        assert _threads() == before
    finally:
        emb.close()


def test_a_chat_worker_gives_back_its_helpers_when_no_request_is_left(
    tiny_llama: str, release_off: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = release_off  # the release is off first: the worker keeps its helper
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, max_tokens=8, n_threads=2, temperature=0)
    try:
        llm.invoke("count with me")
        kept = _threads()
        monkeypatch.undo()  # the release back on
        llm.invoke("count with me")
        assert _settles_at(kept - 1) == kept - 1
        # and the next request starts a helper again, and answers the same
        assert llm.invoke("count with me").content == llm.invoke("count with me").content
        assert _settles_at(kept - 1) == kept - 1
    finally:
        llm.close()
        real()
