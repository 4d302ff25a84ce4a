"""A call written once as steps (chat/steps.py), run by a thread and by an event loop:
the same outputs, errors raised where the call waits, and a reader that goes away
(close, aclose, a cancelled task) runs the call's cleanup. No model: the reply channel
is fed by hand."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from langchain_llamacpp_local.chat.steps import (
    Call,
    Notify,
    OffLoop,
    Receive,
    Sleep,
    Steps,
    aresult,
    result,
)
from langchain_llamacpp_local.runtime.channel import Channel


class _Log:
    """What a call did, for the assertions."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.notified: list[int] = []

    async def anotify(self, n: int) -> None:
        self.notified.append(n)

    def notify(self, n: int) -> None:
        self.notified.append(n)


def _call(log: _Log, channel: Channel, *, timeout: float | None = None, aware: bool) -> Steps[None]:
    """Reads items from ``channel`` until None, sending each as an output; a blocking
    step's result, a pause and a callback on the way."""
    try:
        got = yield OffLoop(lambda: threading.current_thread().name)
        log.events.append(f"off:{got != threading.current_thread().name}")
        yield Sleep(0.0)
        while True:
            try:
                item = yield Receive(channel, timeout)
            except TimeoutError:
                log.events.append("timeout")
                raise
            if item is None:
                return
            yield Notify(lambda i=item: (log.anotify if aware else log.notify)(i))
            yield item
    finally:
        log.events.append("cleanup")


def test_a_thread_and_an_event_loop_read_the_same_outputs() -> None:
    for aware in (False, True):
        log, ch = _Log(), Channel()
        for i in (1, 2, 3, None):
            ch.put(i)
        call: Call[int] = Call(lambda log=log, ch=ch, aware=aware: _call(log, ch, aware=aware))
        if aware:

            async def read(call: Call[int] = call) -> list[int]:
                return [x async for x in call]

            got = asyncio.run(read())
        else:
            got = list(call)
        assert got == [1, 2, 3] and log.notified == [1, 2, 3]
        # blocking work ran off the loop for the event loop only
        assert log.events == [f"off:{aware}", "cleanup"]


def test_an_async_callback_in_a_sync_call_is_refused() -> None:
    log, ch = _Log(), Channel()
    ch.put(1)
    with pytest.raises(TypeError, match="async callback"):
        list(Call(lambda: _call(log, ch, aware=True)))
    assert log.events[-1] == "cleanup"


def test_a_step_error_is_raised_where_the_call_waits() -> None:
    log, ch = _Log(), Channel()
    with pytest.raises(TimeoutError):
        list(Call(lambda: _call(log, ch, timeout=0.01, aware=False)))
    assert log.events[-2:] == ["timeout", "cleanup"]

    async def read() -> None:
        async for _ in Call(lambda: _call(log, Channel(), timeout=0.01, aware=True)):
            pass

    log.events.clear()
    with pytest.raises(TimeoutError):
        asyncio.run(read())
    assert log.events[-2:] == ["timeout", "cleanup"]


def test_closing_the_reader_runs_the_cleanup() -> None:
    log, ch = _Log(), Channel()
    ch.put(1)
    it = iter(Call(lambda: _call(log, ch, aware=False)))
    assert next(it) == 1 and "cleanup" not in log.events
    it.close()  # type: ignore[attr-defined]
    assert log.events[-1] == "cleanup"

    async def read() -> None:
        ch.put(2)
        ait = aiter(Call(lambda: _call(log, ch, aware=True)))
        assert await anext(ait) == 2
        await ait.aclose()  # type: ignore[attr-defined]

    log.events.clear()
    asyncio.run(read())
    assert log.events[-1] == "cleanup"


def test_a_cancelled_task_runs_the_cleanup_without_blocking_the_loop() -> None:
    log, ch = _Log(), Channel()

    async def main() -> int:
        async def read() -> None:
            async for _ in Call(lambda: _call(log, ch, aware=True)):
                pass

        task = asyncio.create_task(read())
        ticks = 0
        while "off:True" not in log.events:  # the loop runs while the call waits
            await asyncio.sleep(0.001)
        for _ in range(20):
            await asyncio.sleep(0.001)
            ticks += 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return ticks

    assert asyncio.run(main()) == 20
    assert log.events[-1] == "cleanup"


def test_a_result_cancelled_while_it_was_made_is_undone() -> None:
    """The task leaves while the blocking work runs; what the work makes is freed
    once, whether it ends before or after the task left."""
    undone: list[str] = []
    release = threading.Event()

    def slow() -> str:
        release.wait(5)
        return "lease"

    def get() -> Steps[str]:
        return (yield OffLoop(slow, undo=undone.append, abandon=True))  # type: ignore[no-any-return]

    async def main() -> None:
        task = asyncio.create_task(aresult(get()))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while not undone and time.monotonic() < deadline:
        time.sleep(0.01)
    assert undone == ["lease"]
    release.set()
    assert result(get()) == "lease"  # on a thread nothing is undone
    assert undone == ["lease"]


def test_a_call_without_outputs_returns_its_value_either_way() -> None:
    def answer() -> Steps[Any]:
        x = yield OffLoop(lambda: 20)
        yield Sleep(0.0)
        return x + 1

    assert result(answer()) == 21
    assert asyncio.run(aresult(answer())) == 21
