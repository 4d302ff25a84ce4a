"""Cancellation, concurrency and worker failure: never hang, never corrupt the cache."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from langchain_llamacpp_local import ChatLlamaCpp, RequestCancelledError, WorkerDeadError
from langchain_llamacpp_local.chat.frontend import frontend_for
from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.runtime.requests import EngineRequest, Failed
from tests.compare import GREEDY as _GREEDY
from tests.compare import assert_same_greedy, greedy_mismatch
from tests.helpers import (
    close_while_running,
    make_worker_fail,
    reply_of,
    worker_of,
    worker_threads,
)

GREEDY: dict[str, Any] = {**_GREEDY, "max_tokens": 16}


def test_breaking_a_stream_stops_generation_promptly(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=500, n_slots=1)
    expected = llm.invoke("after the cancel", max_tokens=16, cache_prompt=False).content
    # the next call is served right away: the cancelled one did not run to 500 tokens.
    # The least of three tries: one preempted by other work on a loaded machine (a
    # parallel test run) would say nothing about the cancel.
    waits = []
    for _ in range(3):
        t0 = time.perf_counter()
        n = 0
        for chunk in llm.stream("a long generation " * 4):
            if chunk.content:
                n += 1
            if n == 3:
                break
        broke = time.perf_counter()
        assert broke - t0 < 30
        out = llm.invoke("after the cancel", max_tokens=16, cache_prompt=False)
        waits.append(time.perf_counter() - broke)
        assert out.content == expected
    full = llm.invoke("a long generation " * 4)
    assert full.usage_metadata["output_tokens"] > 100  # type: ignore[index]
    assert min(waits) < (full.response_metadata["timings"]["predicted_ms"] / 1000) / 3


def test_breaking_a_gemma_stream_returns_within_a_decode_step(gemma: str) -> None:
    llm = ChatLlamaCpp(model_path=gemma, max_tokens=500, n_ctx=2048, **_GREEDY)

    def close_a_stream() -> float:
        n = 0
        gen = llm.stream("Write a very long story about a dragon.")
        for chunk in gen:
            if chunk.content:
                n += 1
            if n == 3:
                break
        t0 = time.perf_counter()
        gen.close()
        return time.perf_counter() - t0

    closes = [close_a_stream()]
    msgs = "Say hello."
    a = llm.invoke(msgs, max_tokens=8)
    b = llm.invoke(msgs, max_tokens=8, cache_prompt=False)
    assert_same_greedy(a, b, tol=0.1)
    timings = a.response_metadata["timings"]
    assert timings["prompt_ms"] < 5000
    closes += [close_a_stream() for _ in range(2)]
    # counted in decode steps, not seconds: the rest of the story is about 497 steps,
    # closing waits for one at most (the least of three tries: a try preempted by other
    # work on a loaded machine says nothing about the close)
    step_s = timings["predicted_ms"] / 1000 / timings["predicted_n"]
    assert min(closes) < 50 * step_s, (closes, step_s)


async def test_wait_for_timeout_cancels_ainvoke(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=1000, n_slots=1)
    await llm.ainvoke("warm up", max_tokens=2)
    expected = reply_of(await llm.ainvoke("served next", max_tokens=8, cache_prompt=False))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(llm.ainvoke("x " * 200), timeout=0.05)
    t0 = time.perf_counter()
    out = await llm.ainvoke("served next", max_tokens=8, cache_prompt=False)
    assert reply_of(out) == expected
    assert time.perf_counter() - t0 < 5


def test_timeout_field_raises_timeout_error(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=1500, timeout=0.05)
    expected = reply_of(llm.invoke("fine", timeout=None, max_tokens=4, cache_prompt=False))
    with pytest.raises(TimeoutError):
        llm.invoke("y " * 200)
    assert reply_of(llm.invoke("fine", timeout=None, max_tokens=4, cache_prompt=False)) == expected


def test_close_cancels_running_calls(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=1500)
    started = threading.Event()

    def run() -> None:
        for _ in llm.stream("z " * 100):
            started.set()

    # started: running, not merely submitted (a loaded machine is slow)
    error, _ = close_while_running(run, llm.close, started=started, stop_within=10)
    assert isinstance(error, RequestCancelledError), error


def test_threads_and_tasks_share_one_model(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=4, **GREEDY)
    prompts = [f"p{i}" for i in range(10)]
    expected = {p: llm.invoke(p, cache_prompt=False) for p in prompts}
    before = worker_threads()
    failures: list[str] = []

    def thread_body(k: int) -> None:
        for p in prompts:
            problem = greedy_mismatch(llm.invoke(p), expected[p], tol=0.02)
            if problem:
                failures.append(f"thread {k} {p}: {problem}")

    async def task_body(k: int) -> None:
        for p in prompts:
            problem = greedy_mismatch(await llm.ainvoke(p), expected[p], tol=0.02)
            if problem:
                failures.append(f"task {k} {p}: {problem}")

    async def tasks() -> None:
        await asyncio.gather(*(task_body(k) for k in range(8)))

    threads = [threading.Thread(target=thread_body, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    asyncio.run(tasks())
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert worker_threads() == before


def test_soak_with_random_cancels_stays_exact(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=2, max_tokens=24, **_GREEDY)
    prompts = [f"soak prompt {i} " * (1 + i % 5) for i in range(8)]
    expected = {p: llm.invoke(p, cache_prompt=False) for p in prompts}
    rng = random.Random(7)
    gc.collect()
    threads_before = threading.active_count()
    rss_before = _rss()
    for i in range(300):
        p = rng.choice(prompts)
        if rng.random() < 0.4:
            gen = llm.stream(p)
            for _ in range(rng.randint(0, 5)):
                next(gen, None)
            gen.close()
        else:
            problem = greedy_mismatch(llm.invoke(p), expected[p], tol=0.02)
            assert problem is None, f"request {i}: {problem}"
    for p in prompts:
        assert_same_greedy(llm.invoke(p), expected[p], tol=0.02)
    gc.collect()
    assert threading.active_count() == threads_before
    assert _rss() - rss_before < 100 * 2**20


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Poison(EngineRequest):
    """A request whose own bookkeeping raises inside the worker loop."""

    def cancelled(self) -> bool:
        raise RuntimeError("simulated broken request")


def test_a_broken_request_fails_alone(tiny_llama: str) -> None:
    from langchain_llamacpp_local.llama.sampling import SamplingParams

    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=1024, temperature=0, max_tokens=4)
    expected = reply_of(llm.invoke("still serving", cache_prompt=False))
    worker = worker_of(llm)
    assert worker is not None
    poison = _Poison(tokens=[1, 2, 3], sampling=SamplingParams(), max_new=4)
    worker.submit(poison)
    item = poison.channel.get(timeout=10)
    assert isinstance(item, Failed) and "simulated broken request" in repr(item.error)
    assert worker.alive
    assert reply_of(llm.invoke("still serving", cache_prompt=False)) == expected
    assert worker_of(llm) is worker


def test_dead_worker_fails_fast_and_reloads(tiny_llama: str) -> None:
    from langchain_llamacpp_local.llama.sampling import SamplingParams

    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=1024, temperature=0, max_tokens=4)
    expected = reply_of(llm.invoke("reloaded", cache_prompt=False))
    worker = make_worker_fail(llm)
    job = ChatJob(messages=[{"role": "user", "content": "x"}], sampling=SamplingParams())
    request, _ = frontend_for(worker).prepare(job)
    worker.submit(request)
    item = request.channel.get(timeout=10)
    assert isinstance(item, Failed) and isinstance(item.error, WorkerDeadError)
    assert not worker.alive
    with pytest.raises(WorkerDeadError):
        worker.submit(EngineRequest(tokens=[], sampling=SamplingParams(), max_new=1))
    # a new worker was started, and it answers as the first one did
    assert reply_of(llm.invoke("reloaded")) == expected
    assert worker_of(llm) is not worker


def test_interpreter_exit_is_clean(tiny_llama: str) -> None:
    code = f"""
import threading
from langchain_llamacpp_local import ChatLlamaCpp, RequestCancelledError
llm = ChatLlamaCpp(model_path={tiny_llama!r}, temperature=0, max_tokens=1500)
def run():
    try:
        for _ in llm.stream("exit while generating " * 20):
            pass
    except RequestCancelledError:  # the exit closes the model under the stream
        pass
threading.Thread(target=run, daemon=True).start()
import time; time.sleep(0.5)
print("bye")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "bye" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr  # no thread died of another error


def test_a_parser_failure_fails_its_request_only(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception while parsing model output is that request's error."""
    from langchain_llamacpp_local.chat import prompts

    # bit for bit beside a failing request: the deterministic mode's guarantee
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=2, deterministic=True, **GREEDY)
    ok_ref = llm.invoke("a healthy request", cache_prompt=False)
    real_feed = prompts.PlainParser.feed

    def feed(self: Any, delta: str) -> Any:
        if getattr(self, "poisoned", False):
            raise ValueError("simulated parser failure")
        return real_feed(self, delta)

    real_make = prompts.PreparedPrompt.make_parser

    def make_parser(self: Any) -> Any:
        parser = real_make(self)
        parser.poisoned = "poison" in self.text
        return parser

    monkeypatch.setattr(prompts.PlainParser, "feed", feed)
    monkeypatch.setattr(prompts.PreparedPrompt, "make_parser", make_parser)
    results: dict[str, Any] = {}

    def run(p: str) -> None:
        try:
            results[p] = llm.invoke(p)
        except Exception as exc:
            results[p] = exc

    threads = [threading.Thread(target=run, args=(p,)) for p in ("poison me", "a healthy request")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert isinstance(results["poison me"], ValueError)
    assert_same_greedy(results["a healthy request"], ok_ref, tol=0.0)
    assert worker_of(llm) is not None and worker_of(llm).alive


def test_a_timeout_stops_a_prompt_piece_mid_decode(smollm2: str) -> None:
    """One long prompt piece (a single ``llama_decode``) is stopped from inside by the
    native abort flag: the next request does not wait for the piece to finish."""
    llm = ChatLlamaCpp(
        model_path=smollm2, n_ctx=2048, n_batch=2048, n_ubatch=512, max_tokens=1, **_GREEDY
    ).load()
    prompt = "The committee reviewed the quarterly figures. " * 100
    t0 = time.perf_counter()
    whole = llm.invoke(prompt, cache_prompt=False)
    piece_s = time.perf_counter() - t0
    timings = whole.response_metadata["timings"]
    assert timings["prompt_n"] > 600

    def short() -> float:
        t1 = time.perf_counter()
        assert llm.invoke("Say hello.", max_tokens=4).content
        return time.perf_counter() - t1

    alone = min(short() for _ in range(3))
    waits = []
    for _ in range(3):  # the least of three tries: a loaded machine only adds time
        with pytest.raises(TimeoutError):
            llm.invoke(prompt, cache_prompt=False, timeout=0.2)
        waits.append(short())
    # the aborted piece would have held the worker for most of piece_s (both sides of
    # the comparison are measured here: no fixed figure)
    assert min(waits) < alone + piece_s / 3, (waits, alone, piece_s)
