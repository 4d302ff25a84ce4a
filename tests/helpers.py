"""Small helpers several test modules share: waiting on the registry, counting worker
threads, the worker serving a model (the one place tests reach for it), breaking a
worker, and closing an instance while a call runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from langchain_llamacpp_local.runtime.worker import ModelWorker


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Polls ``cond`` until it holds or ``timeout`` seconds pass: workers and keep-alive
    timers finish on their own threads, a little after the call that started them."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def worker_threads() -> int:
    """The live worker threads of the process (each named ``llamacpp-worker...``)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("llamacpp-worker"))


def worker_of(llm: Any) -> ModelWorker | None:
    """The worker serving ``llm`` now (None before it loads), for a test that needs the
    worker itself: its identity, a call on its thread, or its read-only ``stats()``."""
    return llm._worker  # type: ignore[no-any-return]


def make_worker_fail(llm: Any) -> Any:
    """Loads ``llm`` and makes its worker's next decode fail inside llama.cpp's step, so
    that the worker dies; returns that worker."""
    llm.load()
    worker = worker_of(llm)
    assert worker is not None

    def break_engine(state: Any) -> None:
        def fail(*_a: Any, **_k: Any) -> None:
            raise OSError("simulated llama.cpp failure")

        state.engine.decode_batch = fail

    worker.call(break_engine)
    return worker


def close_while_running(
    call: Callable[[], object],
    close: Callable[[], None],
    *,
    started: threading.Event | None = None,
    timeout: float = 60.0,
    stop_within: float = 60.0,
) -> tuple[BaseException | None, float]:
    """Runs ``call`` on another thread and ``close()`` while it runs: once ``started`` is
    set (by the call, when it is really running rather than merely submitted) or else 0.5 s
    after the start. Returns what the call raised (None when it returned) and how many
    seconds ``close()`` took; fails if the call has not started within ``timeout`` s or
    still runs ``stop_within`` s after ``close()``."""
    outcome: list[BaseException | None] = []
    running = started or threading.Event()

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            running.set()

    t = threading.Thread(target=run)
    t.start()
    if started is None:
        time.sleep(0.5)
    else:
        assert started.wait(timeout), "the call never started"
    t0 = time.perf_counter()
    close()
    waited = time.perf_counter() - t0
    t.join(stop_within)
    assert not t.is_alive(), f"the call still runs {stop_within:.0f} s after close()"
    assert len(outcome) == 1, outcome
    return outcome[0], waited


def reply_of(msg: Any) -> tuple[object, ...]:
    """What a greedy reply must contain, to compare with another: its text, the tokens it
    generated and why it ended (one model answers one prompt the same way each time it
    decodes it afresh)."""
    return (
        msg.content,
        msg.usage_metadata["output_tokens"],
        msg.response_metadata["finish_reason"],
    )


def assert_generated(msg: Any, max_tokens: int) -> None:
    """A whole reply, not just a returned one: ``max_tokens`` tokens generated (cut there)
    or at most that many ending at the end of generation, and its text."""
    finish = msg.response_metadata["finish_reason"]
    n = msg.usage_metadata["output_tokens"]
    assert isinstance(msg.content, str)
    assert (finish == "length" and n == max_tokens) or (finish == "stop" and n <= max_tokens), (
        finish,
        n,
        max_tokens,
    )


def cached_tokens(msg: Any) -> int:
    """The prompt tokens a reply read from the cache (``usage_metadata``'s ``cache_read``)."""
    return msg.usage_metadata["input_token_details"]["cache_read"]  # type: ignore[no-any-return]
