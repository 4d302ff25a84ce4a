"""Run requests so that a loaded model's worker admits them together: it is held busy
until every one of them has queued."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import pytest

from langchain_llamacpp_local.chat import leases
from tests.helpers import worker_of

K = TypeVar("K", bound=Hashable)


def ask_together(
    llm: Any, monkeypatch: pytest.MonkeyPatch, asks: Mapping[K, Callable[[], Any]]
) -> dict[K, Any]:
    """Each of ``asks`` called on a thread of its own while ``llm``'s worker is held
    until all of them have queued; their results (or the exceptions they raised)."""
    worker = worker_of(llm)
    assert worker is not None, "load the model first"
    queued: list[object] = []
    all_in = threading.Event()
    original = leases._queue

    def queue(*a: Any, **k: Any) -> Any:
        reply = original(*a, **k)
        queued.append(reply)
        if len(queued) == len(asks):
            all_in.set()
        return reply

    monkeypatch.setattr(leases, "_queue", queue)
    hold = threading.Thread(target=worker.call, args=(lambda _s: all_in.wait(60),))
    hold.start()
    out: dict[K, Any] = {}

    def run(key: K) -> None:
        try:
            out[key] = asks[key]()
        except Exception as exc:
            out[key] = exc

    callers = [threading.Thread(target=run, args=(k,)) for k in asks]
    for t in callers:
        t.start()
    hold.join(90)
    for t in callers:
        t.join(90)
    assert all_in.is_set(), "the requests did not all queue while the worker was held"
    return out
