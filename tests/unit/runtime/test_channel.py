"""The reply channel: a whole-reply reader is not woken for each piece of text."""

from __future__ import annotations

import asyncio
import threading
import time

from langchain_llamacpp_local.runtime.channel import Channel
from langchain_llamacpp_local.runtime.requests import (
    Finished,
    PromptProgress,
    TextDelta,
    Timings,
)


def _finished() -> Finished:
    return Finished(
        finish_reason="stop",
        n_prompt=1,
        n_cached=0,
        n_generated=3,
        timings=Timings(0.0, 0.0, 0.0, 3.0, 0.0, 0.0),
    )


def test_a_streaming_reader_is_woken_for_each_text_item() -> None:
    ch = Channel()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(ch.get(timeout=5)))
    t.start()
    time.sleep(0.05)
    ch.put(TextDelta("a"))
    t.join(5)
    assert got and isinstance(got[0], TextDelta)


def test_a_whole_reply_reader_sleeps_through_text_and_reads_it_all_in_order() -> None:
    ch = Channel()
    ch.wake_for_text(False)
    woke: list[float] = []
    items: list[object] = []

    def reader() -> None:
        items.append(ch.get(timeout=5))
        woke.append(time.monotonic())
        while not getattr(items[-1], "final", False):
            items.append(ch.get(timeout=0))

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.05)
    for piece in "abc":
        ch.put(TextDelta(piece))
    time.sleep(0.2)
    assert not woke  # three text items queued, the reader still asleep
    done = time.monotonic()
    ch.put(_finished())
    t.join(5)
    assert woke and woke[0] >= done
    assert [getattr(i, "text", None) for i in items[:3]] == ["a", "b", "c"]
    assert isinstance(items[3], Finished)


def test_prompt_progress_still_wakes_a_whole_reply_reader() -> None:
    ch = Channel()
    ch.wake_for_text(False)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(ch.get(timeout=5)))
    t.start()
    time.sleep(0.05)
    ch.put(PromptProgress(total=10, cached=0, processed=5))
    t.join(5)
    assert got and isinstance(got[0], PromptProgress)


def test_an_async_whole_reply_reader_is_resumed_only_by_the_end() -> None:
    async def main() -> list[object]:
        ch = Channel()
        ch.bind_loop()
        ch.wake_for_text(False)
        first = asyncio.ensure_future(ch.aget())
        await asyncio.sleep(0.05)  # the reader waits

        def producer() -> None:
            for piece in "abc":
                ch.put(TextDelta(piece))

        t = threading.Thread(target=producer)
        t.start()
        t.join(5)
        await asyncio.sleep(0.2)
        assert not first.done()  # text alone does not resume it
        ch.put(_finished())
        out = [await asyncio.wait_for(first, 5)]
        while not getattr(out[-1], "final", False):
            out.append(await ch.aget())
        return out

    out = asyncio.run(main())
    assert [getattr(i, "text", None) for i in out[:3]] == ["a", "b", "c"]
    assert isinstance(out[3], Finished)


def test_the_producer_waits_for_a_streaming_reader_to_take_the_text_and_wait_again() -> None:
    ch = Channel()
    taken: list[float] = []

    def reader() -> None:
        ch.get(timeout=5)
        time.sleep(0.05)  # the reader's own work on the item
        taken.append(time.monotonic())
        ch.get(timeout=5)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.05)
    ch.put(TextDelta("a"))
    assert ch.wait_reader(5)
    done = time.monotonic()
    assert taken and done >= taken[0]  # not before the reader came back for more
    ch.put(_finished())
    t.join(5)


def test_waiting_for_a_reader_that_does_not_come_ends_at_the_timeout() -> None:
    ch = Channel()
    ch.put(TextDelta("a"))  # nobody reads
    t0 = time.monotonic()
    assert not ch.wait_reader(0.05)
    assert 0.04 <= time.monotonic() - t0 < 2


def test_a_whole_reply_reader_is_never_waited_for() -> None:
    ch = Channel()
    ch.wake_for_text(False)
    ch.put(TextDelta("a"))
    t0 = time.monotonic()
    assert not ch.wait_reader(5)
    assert time.monotonic() - t0 < 1


def test_the_producer_waits_for_an_async_reader_too() -> None:
    async def main() -> bool:
        ch = Channel()
        ch.bind_loop()
        first = asyncio.ensure_future(ch.aget())
        await asyncio.sleep(0.05)
        result: list[bool] = []

        def producer() -> None:
            ch.put(TextDelta("a"))
            result.append(ch.wait_reader(5))

        t = threading.Thread(target=producer)
        t.start()
        await asyncio.wait_for(first, 5)
        second = asyncio.ensure_future(ch.aget())  # back for more: the producer goes on
        await asyncio.to_thread(t.join, 5)
        ch.put(_finished())
        await asyncio.wait_for(second, 5)
        return result[0]

    assert asyncio.run(main())
