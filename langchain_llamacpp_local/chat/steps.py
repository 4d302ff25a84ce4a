"""One call's logic, written once, run by a thread or by an event loop.

A call is a generator of *steps*: it yields either an output for its reader or a
:class:`Step`, the one thing it must wait for (blocking work, the next reply item, a
retry's pause, an async callback), and gets the step's result back. :func:`run` does
the steps on the calling thread; :func:`arun` runs blocking work on a worker-pool thread
and awaits the rest, so the event loop never waits. An error a step raises is raised in
the call where it yielded the step; closing the reader (``close()``, ``aclose()``, a
cancelled task) closes the call, whose ``finally`` blocks cancel its request and
release its lease.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio

from langchain_llamacpp_local.runtime.channel import Channel

T = TypeVar("T")
R = TypeVar("R")

#: A call: yields outputs (``T``) and :class:`Step` s, returns ``R``.
Steps = Generator[Any, Any, R]


class Step:
    """Something a call waits for: :meth:`wait` blocks the thread, :meth:`await_` does
    not block the event loop."""

    def wait(self) -> Any:
        raise NotImplementedError

    async def await_(self) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class OffLoop(Step, Generic[T]):
    """Blocking work (a load, preparing a prompt): run in place on a thread, on a
    worker-pool thread for an event loop."""

    fn: Callable[[], T]
    #: frees a result its caller never got (the task was cancelled while ``fn`` ran)
    undo: Callable[[T], None] | None = None
    #: a cancelled task need not wait for ``fn`` to return (waiting for room to load)
    abandon: bool = False

    def wait(self) -> T:
        return self.fn()

    async def await_(self) -> T:
        lock = threading.Lock()
        kept: list[T] = []
        left: list[bool] = []

        def run() -> T:
            got = self.fn()
            with lock:
                if not left:
                    kept.append(got)
                    return got
            if self.undo is not None:  # the caller left while this ran
                self.undo(got)
            return got

        try:
            return await anyio.to_thread.run_sync(run, abandon_on_cancel=self.abandon)
        except BaseException:
            with lock:
                left.append(True)
                lost = kept[:]
            if self.undo is not None:
                for got in lost:
                    self.undo(got)
            raise


@dataclass(frozen=True)
class Receive(Step):
    """The next item of a reply channel; ``TimeoutError`` past ``timeout`` seconds."""

    channel: Channel
    timeout: float | None

    def wait(self) -> Any:
        return self.channel.get(timeout=self.timeout)

    async def await_(self) -> Any:
        if self.timeout is None:
            return await self.channel.aget()
        with anyio.fail_after(self.timeout):
            return await self.channel.aget()


@dataclass(frozen=True)
class Sleep(Step):
    """A pause (before a retry)."""

    seconds: float

    def wait(self) -> None:
        time.sleep(self.seconds)

    async def await_(self) -> None:
        await anyio.sleep(self.seconds)


@dataclass(frozen=True)
class Notify(Step):
    """A callback: an async run manager's answers with an awaitable, which an event
    loop awaits (a thread has sync callbacks, which answer None)."""

    fn: Callable[[], Awaitable[None] | None]

    def wait(self) -> None:
        got = self.fn()
        if inspect.isawaitable(got):
            if inspect.iscoroutine(got):
                got.close()  # never run: no "never awaited" warning
            raise TypeError("an async callback in a sync call")

    async def await_(self) -> None:
        got = self.fn()
        if inspect.isawaitable(got):
            await got


def seconds_left(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (a ``time.monotonic()`` time; None: none)."""
    return None if deadline is None else max(deadline - time.monotonic(), 0)


class _Running(Generic[R]):
    """A call being run: iterating it gives what the call yields (outputs and steps);
    a step's outcome goes back in as :attr:`sent` or :attr:`error` (raised in the call,
    where it waits); :attr:`value` is what the call returned. Leaving the ``with``
    closes the call (its ``finally`` blocks run)."""

    def __init__(self, steps: Steps[R]) -> None:
        self.steps = steps
        self.sent: Any = None
        self.error: BaseException | None = None
        self.value: R | None = None

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        sent, error = self.sent, self.error
        self.sent = self.error = None
        try:
            return self.steps.throw(error) if error is not None else self.steps.send(sent)
        except StopIteration as stop:
            self.value = stop.value
            raise StopIteration from None

    def settle(self, wait: Callable[[], Any]) -> None:
        """Do a step on this thread: its result or its error goes back in."""
        try:
            self.sent = wait()
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> _Running[R]:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.steps.close()


def run(steps: Steps[R]) -> Generator[Any, None, R | None]:
    """The call's outputs, its steps done on this thread; returns what the call returns."""
    with _Running(steps) as call:
        for out in call:
            if isinstance(out, Step):
                call.settle(out.wait)
            else:
                yield out
        return call.value


async def arun(steps: Steps[R], returned: list[R | None] | None = None) -> AsyncIterator[Any]:
    """:func:`run` for an event loop; what the call returns goes into ``returned``."""
    with _Running(steps) as call:
        for out in call:
            if not isinstance(out, Step):
                yield out
                continue
            try:
                call.sent = await out.await_()
            except BaseException as exc:  # a cancelled task's too: the call cleans up
                call.error = exc
        if returned is not None:
            returned.append(call.value)


def result(steps: Steps[R]) -> R:
    """What a call without outputs returns, its steps done on this thread."""
    outputs = run(steps)
    try:
        out = next(outputs)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    outputs.close()
    raise TypeError(f"unexpected output {out!r}")


async def aresult(steps: Steps[R]) -> R:
    """:func:`result` for an event loop."""
    returned: list[R | None] = []
    async with aclosing(arun(steps, returned)) as outputs:  # type: ignore[type-var]
        async for out in outputs:
            raise TypeError(f"unexpected output {out!r}")
    return returned[0]  # type: ignore[return-value]


class Call(Generic[T]):
    """A call's outputs, read with ``for`` (on this thread) or ``async for`` (on an
    event loop, never blocking it); each reading runs the call anew."""

    def __init__(self, make: Callable[[], Steps[None]]) -> None:
        self._make = make

    def __iter__(self) -> Iterator[T]:
        return run(self._make())

    def __aiter__(self) -> AsyncIterator[T]:
        return arun(self._make())
