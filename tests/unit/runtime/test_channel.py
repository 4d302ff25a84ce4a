"""The reply channel: a whole-reply reader is not woken for each piece of text."""

from __future__ import annotations

import asyncio
import threading
import time

from langchain_llamacpp_local.runtime.channel import Channel
from langchain_llamacpp_local.runtime.requests import Finished, PromptProgress, TextDelta


def _finished() -> Finished:
    return Finished(finish_reason="stop", n_prompt=1, n_cached=0, n_generated=3, timings={})


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
