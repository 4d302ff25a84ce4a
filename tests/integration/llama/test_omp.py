"""A thread that stops decoding gives its OpenMP helper threads back (llama.omp): an
embedding call when it returns, a chat model's worker when no request is left. Counted
as the process's threads on real llama.cpp, by their ids: threads an earlier test left
may end meanwhile and must not count. Each test also shows the helper staying when the
release is switched off, so it cannot pass by accident."""

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


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _settles(cond: Callable[[], bool], within_s: float = 5.0) -> bool:
    """Whether ``cond`` holds, waiting up to ``within_s`` for it."""
    end = time.monotonic() + within_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


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
        before = _tids()
        emb.embed_documents(["one", "two", "three"])
        assert _tids() - before == set()  # no thread left behind

        monkeypatch.setattr(omp, "_pause", lambda: None)
        try:
            emb.embed_documents(["one", "two", "three"])
            assert len(_tids() - before) == 1  # this thread's pool: one helper
        finally:
            real(1)
        assert _tids() - before == set()
    finally:
        emb.close()


def test_a_chat_worker_gives_back_its_helpers_when_no_request_is_left(
    tiny_llama: str, release_off: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = release_off  # the release is off first: the worker keeps its helper
    before = _tids()
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, max_tokens=8, n_threads=2, temperature=0)
    try:
        llm.invoke("count with me")
        ours = _tids() - before  # the worker and its helper, kept
        monkeypatch.undo()  # the release back on
        llm.invoke("count with me")
        assert _settles(lambda: len(ours - _tids()) == 1)  # one of them ended: the helper
        left = ours & _tids()
        # and the next request starts a helper again, gives it back, and answers the same
        assert llm.invoke("count with me").content == llm.invoke("count with me").content
        assert _settles(lambda: _tids() - before == left)
    finally:
        llm.close()
        real()
