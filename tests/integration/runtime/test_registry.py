"""The model registry on real tiny GGUFs: keep-alive, the loaded-model budget, per-call
models, and loads that are interrupted or race the garbage collector."""

from __future__ import annotations

import _thread
import asyncio
import gc
import hashlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from langchain_core.runnables import ConfigurableField

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.resolution.model_resolution import ModelNotFoundError
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.runtime.registry import live_workers, load_count, loaded_models
from tests.gguf_models import write_tiny_llama, write_tiny_mmproj
from tests.helpers import reply_of, wait_for, worker_of, worker_threads

FAST: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4, "n_ctx": 512, "n_slots": 2}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("registry_models")
    write_tiny_llama(d / "alpha.gguf", seed=1)
    write_tiny_llama(d / "beta.gguf", seed=2)
    return d


@pytest.fixture(scope="module")
def answers(models: Path) -> dict[tuple[str, str], tuple[object, ...]]:
    """Each tiny model's greedy reply to the prompts the tests send, from its first load:
    a reply after an eviction, a timeout or a reload must be this one."""
    out = {}
    for name in ("alpha", "beta"):
        llm = ChatLlamaCpp(model=name, models_dir=str(models), **FAST)
        for prompt in ("hi", "again"):
            out[name, prompt] = reply_of(llm.invoke(prompt, cache_prompt=False))
        llm.unload()
    return out


@pytest.fixture(autouse=True)
def _nothing_loaded() -> Iterator[None]:
    registry.unload()  # models earlier tests left in their keep-alive time
    yield
    registry.unload()


def _loaded_names() -> list[str]:
    return [Path(m.model_path).name for m in loaded_models()]


@contextmanager
def _busy(llm: ChatLlamaCpp) -> Iterator[None]:
    """``llm``'s model with a request on it whose reply cannot finish before the block
    ends (its worker is held), so the request's lease is held until then."""
    llm.load()
    worker = worker_of(llm)
    assert worker is not None
    path = worker.config.model_path
    gate, inside = threading.Event(), threading.Event()

    def hold(_state: Any) -> None:
        inside.set()
        gate.wait(60)

    threads = [threading.Thread(target=worker.call, args=(hold,))]
    threads[0].start()
    try:
        assert inside.wait(60)
        threads.append(threading.Thread(target=llm.invoke, args=("busy",)))
        threads[1].start()
        assert wait_for(lambda: any(m.model_path == path and m.active for m in loaded_models()))
        yield
    finally:
        gate.set()
        for t in threads:
            t.join(60)


def test_two_models_evict_each_other_only_when_idle(
    models: Path, answers: dict[tuple[str, str], tuple[object, ...]]
) -> None:
    a = ChatLlamaCpp(model="alpha", models_dir=str(models), max_loaded_models=1, **FAST)
    b = ChatLlamaCpp(model="beta", models_dir=str(models), max_loaded_models=1, **FAST)
    a.invoke("warm up")
    loads = load_count()
    result: dict[str, Any] = {}
    with _busy(a):  # alpha has a running request
        t = threading.Thread(target=lambda: result.setdefault("b", b.invoke("hi")))
        t.start()
        time.sleep(0.5)
        assert t.is_alive(), "beta must wait while alpha is busy"
        assert _loaded_names() == ["alpha.gguf"] and load_count() == loads
    # alpha is idle: beta may evict it
    t.join(30)
    assert not t.is_alive()
    assert result["b"].response_metadata["model_name"] == "beta"
    assert _loaded_names() == ["beta.gguf"] and load_count() == loads + 1
    # and back: alpha evicts the idle beta
    assert reply_of(a.invoke("again")) == answers["alpha", "again"]
    assert _loaded_names() == ["alpha.gguf"] and load_count() == loads + 2


def test_waiting_for_room_respects_the_request_timeout(
    models: Path, answers: dict[tuple[str, str], tuple[object, ...]]
) -> None:
    a = ChatLlamaCpp(model="alpha", models_dir=str(models), max_loaded_models=1, **FAST)
    b = ChatLlamaCpp(model="beta", models_dir=str(models), max_loaded_models=1, **FAST)
    with _busy(a), pytest.raises(TimeoutError, match="max_loaded_models=1"):
        b.invoke("hi", timeout=0.3)
    # the timed-out wait left nothing behind
    assert reply_of(b.invoke("hi")) == answers["beta", "hi"]


def test_keep_alive_zero_frees_the_model_after_the_call(
    models: Path, answers: dict[tuple[str, str], tuple[object, ...]]
) -> None:
    threads = worker_threads()
    llm = ChatLlamaCpp(model="alpha", models_dir=str(models), keep_alive=0, **FAST)
    assert reply_of(llm.invoke("hi")) == answers["alpha", "hi"]
    assert wait_for(lambda: live_workers() == 0), _loaded_names()
    assert wait_for(lambda: worker_threads() == threads)
    # per call, as Ollama's keep_alive request option
    keep = ChatLlamaCpp(model="alpha", models_dir=str(models), **FAST)
    keep.invoke("hi")
    assert live_workers() == 1
    keep.invoke("hi", keep_alive=0)
    assert wait_for(lambda: live_workers() == 0)


def test_keep_alive_seconds_and_forever(models: Path) -> None:
    # kept after the call (a keep_alive long enough that no stall of the test reaches it)
    short = ChatLlamaCpp(model="alpha", models_dir=str(models), keep_alive=60, **FAST)
    short.invoke("hi")
    assert [(m.active, m.keep_alive) for m in loaded_models()] == [(0, 60)]
    # a call's own keep_alive wins (as in Ollama): gone once idle for 0.5 s, and not
    # before (a lower bound: a busy machine only delays the unload)
    start = time.monotonic()
    short.invoke("hi", keep_alive=0.5)
    assert wait_for(lambda: live_workers() == 0)
    assert time.monotonic() - start >= 0.5
    forever = ChatLlamaCpp(model="beta", models_dir=str(models), keep_alive=-1, **FAST)
    forever.invoke("hi")
    time.sleep(0.6)
    assert _loaded_names() == ["beta.gguf"]
    assert forever.unload() == 1
    assert live_workers() == 0


def test_a_configurable_model_invoked_ten_times_loads_once(models: Path) -> None:
    base = ChatLlamaCpp(model="alpha", models_dir=str(models), **FAST)
    llm = base.configurable_fields(
        model=ConfigurableField(id="model"), temperature=ConfigurableField(id="temperature")
    )
    loads = load_count()
    outs = [
        # longer than the 64-position chunk grid: only whole grid cells are reused
        llm.invoke("same prompt " * 12, config={"configurable": {"temperature": 0.0}})
        for _ in range(10)
    ]
    assert load_count() == loads + 1
    # each call is a new instance, yet the cache survives between them
    assert outs[-1].usage_metadata["input_token_details"]["cache_read"] > 0  # type: ignore[index]
    assert len({o.content for o in outs}) == 1
    for i in range(10):
        name = ("alpha", "beta")[i % 2]
        out = llm.invoke("hi", config={"configurable": {"model": name}})
        assert out.response_metadata["model_name"] == name
    assert load_count() == loads + 2


def test_per_call_model_override(models: Path) -> None:
    llm = ChatLlamaCpp(model="alpha", models_dir=str(models), **FAST)
    beta = ChatLlamaCpp(model="beta", models_dir=str(models), **FAST)
    loads = load_count()
    own = llm.invoke("hi")
    other = llm.invoke("hi", model="beta")
    assert own.response_metadata["model_name"] == "alpha"
    assert other.response_metadata["model_name"] == "beta"
    assert other.content == beta.invoke("hi").content  # really beta, and not reloaded
    assert load_count() == loads + 2
    by_path = llm.invoke("hi", model=str(models / "beta.gguf"))
    assert by_path.content == other.content and load_count() == loads + 2
    with pytest.raises(ModelNotFoundError, match="'nope' not found"):
        llm.invoke("hi", model="nope")
    assert llm.invoke("hi").content == own.content  # still serving

    async def run() -> str:
        msg = await llm.ainvoke("hi", model="beta")
        return str(msg.response_metadata["model_name"])

    assert asyncio.run(run()) == "beta"
    assert load_count() == loads + 2


def test_gc_of_a_model_in_a_cycle_during_another_load_does_not_hang(models: Path) -> None:
    """Collecting a ChatLlamaCpp (and a stream it left open) inside a load
    used to run a weakref callback that took the lock the load was holding."""
    a = ChatLlamaCpp(model="alpha", models_dir=str(models), **FAST)
    b = ChatLlamaCpp(model="beta", models_dir=str(models), **FAST)
    done: list[Any] = []

    def scenario() -> None:
        owner = ChatLlamaCpp(model="alpha", models_dir=str(models), **FAST)
        stream = owner.stream("left open", max_tokens=50)
        next(stream)  # holds a lease on alpha
        cycle: dict[str, Any] = {"llm": owner, "stream": stream}
        cycle["self"] = cycle
        del owner, stream, cycle
        old = gc.get_threshold()
        gc.set_threshold(1)  # collect on (nearly) every allocation, inside the load too
        try:
            done.append(b.invoke("hi").content)
        finally:
            gc.set_threshold(*old)
        gc.collect()
        done.append(a.invoke("hi").content)

    t = threading.Thread(target=scenario, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the load hung"
    assert len(done) == 2
    # the collected stream gave its lease back: alpha is idle again
    assert wait_for(lambda: all(m.active == 0 for m in loaded_models()))


def test_an_interrupted_load_is_registered_and_reused(
    models: Path, answers: dict[tuple[str, str], tuple[object, ...]]
) -> None:
    """Ctrl-C while a model loads leaves it registered (reused, or freed
    after keep_alive), never loaded on a thread nobody can stop."""
    llm = ChatLlamaCpp(
        model="alpha", models_dir=str(models), n_ctx=384, temperature=0, max_tokens=4
    )
    config = llm._load_config()
    cache = llm._cache_options()
    fired: list[bool] = []

    def slow_progress(_p: float) -> None:
        if not fired:
            fired.append(True)
            _thread.interrupt_main()  # Ctrl-C in the caller while the load runs
            time.sleep(0.5)

    loads = load_count()
    with pytest.raises(KeyboardInterrupt):
        registry.acquire(config, cache, slow_progress, keep_alive=60)
    assert fired
    assert wait_for(lambda: _loaded_names() == ["alpha.gguf"])
    assert wait_for(lambda: loaded_models()[0].active == 0)  # nobody holds it
    assert load_count() == loads + 1
    assert reply_of(llm.invoke("hi")) == answers["alpha", "hi"]
    assert load_count() == loads + 1  # reused, not loaded again

    # with keep_alive=0 the finished load is freed at once: no stray worker thread
    registry.unload()
    threads = worker_threads()
    fired.clear()
    with pytest.raises(KeyboardInterrupt):
        registry.acquire(config, cache, slow_progress, keep_alive=0)
    assert wait_for(lambda: load_count() == loads + 2)
    assert wait_for(lambda: live_workers() == 0 and worker_threads() == threads)


@pytest.mark.gemma
async def test_a_cancelled_task_during_load_strands_nothing(gemma: str) -> None:
    llm = ChatLlamaCpp(model=gemma, n_ctx=640, temperature=0, max_tokens=2)
    loads = load_count()
    task = asyncio.create_task(llm.ainvoke("hi"))
    loop_ticks = 0
    while not any(t.name.startswith("llamacpp-load") for t in threading.enumerate()):
        await asyncio.sleep(0.001)
        loop_ticks += 1
        assert loop_ticks < 20000, "the load never started"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert wait_for(lambda: load_count() == loads + 1, 60)
    assert wait_for(lambda: bool(loaded_models()) and loaded_models()[0].active == 0)
    out = await llm.ainvoke("hi")
    assert load_count() == loads + 1  # the cancelled task's load was kept and reused
    # and it answers as a fresh decode on it does
    assert reply_of(out) == reply_of(await llm.ainvoke("hi", cache_prompt=False))
    assert out.usage_metadata["output_tokens"] == 2 and out.content


def test_unload_and_list(models: Path, answers: dict[tuple[str, str], tuple[object, ...]]) -> None:
    llm = ChatLlamaCpp(model="alpha", models_dir=str(models), **FAST)
    llm.load()
    assert _loaded_names() == ["alpha.gguf"]
    assert {"alpha", "beta"} <= {e.name for e in llm.list_models()}
    assert llm.unload() == 1 and live_workers() == 0
    assert reply_of(llm.invoke("hi")) == answers["alpha", "hi"]  # loads again on use
    assert ChatLlamaCpp.unload_all() == 1
    cache = CacheOptions()
    assert registry.unload(llm._load_config(), cache) == 0  # nothing left to free


def _hub_cache(root: Path, repo_id: str, files: dict[str, Path]) -> None:
    """Copy ``files`` into huggingface_hub's cache layout: blobs, snapshot symlinks, refs."""
    repo_dir = root / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo_dir / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (name.count("/") + 2) + "blobs") / blob.name)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)


def test_a_hugging_face_split_gguf_and_its_mmproj_load_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end through huggingface_hub's offline cache: a split GGUF (3 parts) and,
    with ``mmproj_path="auto"``, the repo's projector."""
    constants = pytest.importorskip("huggingface_hub.constants")
    src = tmp_path / "src"
    src.mkdir()
    first = write_tiny_llama(src / "Tiny-F32.gguf", seed=3, split_max_tensors=8)
    parts = sorted(p for p in src.iterdir() if p.name.startswith("Tiny-F32-"))
    assert first == parts[0] and len(parts) == 3
    proj = write_tiny_mmproj(src / "mmproj-Tiny-F16.gguf", text_n_embd=64)
    cache = tmp_path / "hub"
    _hub_cache(cache, "acme/Tiny-GGUF", {p.name: p for p in [*parts, proj]})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    by_path = ChatLlamaCpp(model=str(first), keep_alive=0, **FAST).invoke("hi")
    llm = ChatLlamaCpp(model="acme/Tiny-GGUF:F32", mmproj_path="auto", **FAST)
    out = llm.invoke("hi")
    assert out.content == by_path.content
    assert out.response_metadata["model_name"] == "acme/Tiny-GGUF:F32"
    [loaded] = [m for m in loaded_models() if m.mmproj_path]
    assert Path(loaded.model_path).name == "Tiny-F32-00001-of-00003.gguf"
    assert Path(loaded.mmproj_path or "").name == "mmproj-Tiny-F16.gguf"
    assert "acme/Tiny-GGUF:F32" in {e.name for e in llm.list_models()}


@pytest.mark.parametrize(
    "huge", [1e10, float("inf"), "99999999h", 10**400], ids=["1e10", "inf", "h", "int"]
)
def test_a_huge_keep_alive_means_forever_and_the_reaper_lives(models: Path, huge: Any) -> None:
    llm = ChatLlamaCpp(model="alpha", models_dir=str(models), keep_alive=huge, **FAST)
    assert llm.keep_alive == -1.0  # "stay loaded", as a negative keep_alive
    llm.invoke("hi")
    other = ChatLlamaCpp(model="beta", models_dir=str(models), **FAST)
    other.invoke("hi", keep_alive=huge)  # per call too
    time.sleep(0.2)
    assert registry._reaper is not None and registry._reaper.is_alive()
    assert sorted(_loaded_names()) == ["alpha.gguf", "beta.gguf"]
    assert {m.keep_alive for m in loaded_models()} == {-1.0}
    # the reaper still frees what it should
    other.invoke("hi", keep_alive=0)
    assert wait_for(lambda: _loaded_names() == ["alpha.gguf"], timeout=5), _loaded_names()
    with pytest.raises(ValueError, match="nan"):
        ChatLlamaCpp(model="alpha", models_dir=str(models), keep_alive=float("nan"))


def test_loaded_models_does_not_swallow_releases(models: Path) -> None:
    """A release that loaded_models() applies still wakes the reaper: keep_alive=0 and an
    unload() asked for during a stream free the model."""
    llm = ChatLlamaCpp(model="alpha", models_dir=str(models), **FAST)
    for _ in range(3):
        llm.invoke("hi", keep_alive=0)
        loaded_models()  # right after the release, on the releasing thread
        assert wait_for(lambda: live_workers() == 0, timeout=3), _loaded_names()
    for _ in range(3):
        with _busy(llm):
            assert registry.unload() == 0  # busy: freed once idle
        loaded_models()
        assert wait_for(lambda: live_workers() == 0, timeout=3), _loaded_names()


def test_a_complete_reply_frees_its_model_though_its_stream_is_unread(
    models: Path, answers: dict[tuple[str, str], tuple[object, ...]]
) -> None:
    """A stream read only in part holds its model until the reply is complete, not until
    the generator is closed: keep_alive runs from there and another model may evict it
    (``max_loaded_models``); the unread chunks are all still there. Bounded by waits and
    a request timeout: it used to wait for ever."""
    short = ChatLlamaCpp(model="alpha", models_dir=str(models), keep_alive=0.3, **FAST)
    kept = short.stream("read one chunk only", max_tokens=20)
    next(kept)
    assert wait_for(lambda: live_workers() == 0), loaded_models()

    a = ChatLlamaCpp(model="alpha", models_dir=str(models), max_loaded_models=1, **FAST)
    b = ChatLlamaCpp(model="beta", models_dir=str(models), max_loaded_models=1, **FAST)
    stream = a.stream("read one chunk only", max_tokens=20)
    first = next(stream)
    assert wait_for(lambda: [m.active for m in loaded_models()] == [0]), loaded_models()
    assert reply_of(b.invoke("hi", timeout=20)) == answers["beta", "hi"]
    assert _loaded_names() == ["beta.gguf"]
    whole = first
    for chunk in stream:  # alpha is gone; its reply is all there
        whole += chunk
    assert whole.response_metadata["finish_reason"] == "length"
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] == 20
    kept.close()
