"""Hostile or unlucky inputs give clear errors; the process and the worker live.

Each test drives the real request path (llama.cpp on generated GGUFs). Cases that
used to kill the process run in a subprocess, so a regression shows as a failed
test instead of taking pytest down with it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.errors import ModelLoadError
from tests.gguf_models import write_scripted_llama, write_tiny_llama
from tests.helpers import reply_of

ROOT = Path(__file__).resolve().parents[3]
TEMPLATES = ROOT / "tests" / "data" / "llama_cpp_templates"


@pytest.fixture(autouse=True)
def _collect_garbage() -> None:
    """Collect cycles between tests: a worker collected while another model loads can
    deadlock the registry."""
    gc.collect()


def _run_isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (an abort there cannot kill pytest)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _patch_u32(path: Path, key: str, value: int) -> None:
    """Overwrite the uint32 value of header key ``key`` in place."""
    data = bytearray(path.read_bytes())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<I", data, at)[0] == 4, "not a uint32 key"
    struct.pack_into("<I", data, at + 4, value)
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- crafted GGUF


@pytest.mark.parametrize(
    ("patch", "extra", "message"),
    [
        ({"llama.block_count": 100000}, {}, "block_count=100000"),
        ({"llama.block_count": 0}, {}, "block_count=0"),
        ({}, {"llama.expert_count": 5000, "llama.expert_used_count": 2}, "expert_count=5000"),
        ({}, {"llama.expert_count": 4, "llama.expert_used_count": 9}, "expert_used_count=9"),
        ({}, {"llama.expert_used_count": 2}, "expert_used_count=2"),
        ({}, {"llama.nextn_predict_layers": 7}, "nextn_predict_layers=7"),
        ({}, {"llama.rope.scaling.type": "bogus"}, "rope.scaling.type"),
    ],
)
def test_crafted_gguf_header_is_a_load_error_not_an_abort(
    tmp_path: Path, patch: dict[str, int], extra: dict[str, Any], message: str
) -> None:
    path = write_tiny_llama(tmp_path / "crafted.gguf", extra_kv=extra)
    for key, value in patch.items():
        _patch_u32(path, key, value)
    proc = _run_isolated(
        f"""
        from langchain_llamacpp_local import ChatLlamaCpp
        from langchain_llamacpp_local.errors import ModelLoadError
        try:
            ChatLlamaCpp(model_path={str(path)!r}).load()
        except ModelLoadError as exc:
            print("MODEL_LOAD_ERROR", exc)
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "MODEL_LOAD_ERROR" in proc.stdout and message in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- FIFO model path


def _finishes(fn: Any, timeout: float = 20) -> Any:
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it blocks."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the call blocked"
    return out


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_or_device_model_path_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        out = _finishes(lambda p=path: ChatLlamaCpp(model_path=p))
        assert "value" in out, out
        llm = out["value"]
        assert "max_input_tokens" not in (llm.profile or {})
        out = _finishes(llm.load)
        assert isinstance(out.get("error"), ModelLoadError), out
        assert "not a file" in str(out["error"])


# --------------------------------------------------------------------------- grammar size


class _Long(BaseModel):
    text: str = Field(max_length=20000)
    code: str = Field(min_length=2, max_length=6, pattern=r"^[a-z]{2,6}$")
    tags: list[str] = Field(min_length=1, max_length=5000)


def test_huge_schema_bounds_never_crash_the_process(tiny_llama: str) -> None:
    """MaxLength 20 000 (and friends) used to overflow llama.cpp's grammar parser stack."""
    proc = _run_isolated(
        f"""
        from pydantic import BaseModel, Field
        from langchain_llamacpp_local import ChatLlamaCpp

        class Long(BaseModel):
            text: str = Field(max_length=20000)
            more: str = Field(min_length=3000, max_length=3000)
            tags: list[str] = Field(min_length=1, max_length=5000)

        llm = ChatLlamaCpp(model_path={tiny_llama!r}, temperature=0, max_tokens=8, n_ctx=2048)
        raw = llm.with_structured_output(Long, include_raw=True).invoke("hi")
        print("RESULT", repr(raw["raw"].content[:40]))
        forced = llm.with_structured_output(Long, method="function_calling", include_raw=True)
        print("FORCED", forced.invoke("hi")["raw"].response_metadata["finish_reason"])
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESULT" in proc.stdout and "FORCED length" in proc.stdout, proc.stdout


def test_unenforceable_bound_is_a_clear_error_naming_the_field(tiny_llama: str) -> None:
    class TooLong(BaseModel):
        essay: str = Field(max_length=5_000_000)

    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=4, n_ctx=2048)
    with pytest.raises(ValueError, match="essay"):
        llm.with_structured_output(TooLong).invoke("hi")
    with pytest.raises(ValueError, match="essay"):
        llm.bind_tools([TooLong], tool_choice="TooLong").invoke("hi")
    assert llm.invoke("hi").response_metadata["finish_reason"] in ("stop", "length")


# --------------------------------------------------------------------------- lazy grammar


def test_lazy_tool_grammar_survives_many_overrunning_tokens(tmp_path: Path) -> None:
    """100 tokens complete ``<tool_call>`` and run past it, each likelier than the one
    that stops exactly at it: the sampler used to give up after 64 bans and kill the
    worker; now it bans them all and the grammar takes over at the trigger."""
    over = [f"ll>x{i}" for i in range(100)]
    path = write_scripted_llama(
        tmp_path / "overrun.gguf",
        extra_tokens=("<tool_ca", "ll>", *over),
        transitions={
            "\n": {"<tool_ca": 10.0},
            "<tool_ca": {**{o: 9.0 - i * 0.01 for i, o in enumerate(over)}, "ll>": 5.0},
        },
        chat_template=(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(),
    )

    def get_weather(city: str) -> str:
        """Weather in a city."""
        return city

    llm = ChatLlamaCpp(model_path=str(path), temperature=0, n_ctx=2048, max_tokens=12)
    assert llm.invoke("hi").content.startswith("<tool_call>x0")  # unconstrained: overruns
    msg = llm.bind_tools([get_weather]).invoke("hi")
    assert msg.response_metadata["finish_reason"] == "length"
    # the grammar took over right at the trigger: what follows is the forced call's JSON
    assert msg.invalid_tool_calls and msg.invalid_tool_calls[0]["args"].startswith("<tool_call>{")
    assert llm.invoke("hi").content.startswith("<tool_call>x0")  # the worker still serves


# --------------------------------------------------------------------------- penalty_last_n


@pytest.mark.parametrize("n", [-1, 0, 1, 2**31 - 1])
def test_penalty_last_n_maps_to_llama_cpp(tiny_llama: str, n: int) -> None:
    """-1 is the whole context, huge windows clamp to it (no 8 GB ring buffer)."""
    llm = ChatLlamaCpp(
        model_path=tiny_llama,
        temperature=0,
        max_tokens=6,
        n_ctx=256,
        repeat_penalty=1.3,
        penalty_last_n=n,
    )
    t0 = time.perf_counter()
    assert llm.invoke("hello").response_metadata["finish_reason"] in ("stop", "length")
    assert time.perf_counter() - t0 < 30


def test_penalty_whole_context_differs_from_off(tmp_path: Path) -> None:
    """With penalties on, -1 must penalize (it used to silently mean 'off')."""
    path = write_scripted_llama(
        tmp_path / "repeat.gguf",
        transitions={"a": {"a": 3.0, "b": 2.0}, "b": {"a": 3.0, "b": 2.0}},
    )
    base = {"model_path": str(path), "temperature": 0, "max_tokens": 6, "n_ctx": 256}
    plain = ChatLlamaCpp(**base, chat_template="{{ messages[0].content }}")
    assert plain.invoke("a").content == "aaaaaa"
    off = ChatLlamaCpp(
        **base, chat_template="{{ messages[0].content }}", penalty_last_n=0, presence_penalty=2.0
    )
    assert off.invoke("a").content == "aaaaaa"
    whole = ChatLlamaCpp(
        **base, chat_template="{{ messages[0].content }}", penalty_last_n=-1, presence_penalty=2.0
    )
    assert whole.invoke("a").content != "aaaaaa"


# --------------------------------------------------------------------------- config aborts


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_batch": 2},
        {"n_ctx": 1},
        {"n_ctx": 3},
        {"n_ctx": 2**32 + 1},
        {"n_ubatch": 2},
        {"n_threads": 0},
        {"n_threads_batch": -3},
        {"n_slots": 0},
        {"n_gpu_layers": -2},
    ],
)
def test_config_values_that_abort_llama_cpp_are_refused(tiny_llama: str, kwargs: dict) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        ChatLlamaCpp(model_path=tiny_llama, **kwargs)
    assert next(iter(kwargs)) in str(info.value)


def test_smallest_valid_configs_load_and_run(tiny_llama: str) -> None:
    """The lower limits are real: the smallest accepted settings work (in a subprocess,
    so an abort would be a failure, not a dead pytest)."""
    proc = _run_isolated(
        f"""
        from langchain_llamacpp_local import ChatLlamaCpp
        for kw in ({{"n_ctx": 4, "n_batch": 4}}, {{"n_batch": 4, "n_ubatch": 4}},
                   {{"n_slots": 1, "n_ctx": 1, "n_batch": 1}}, {{"n_threads": 1}}):
            llm = ChatLlamaCpp(model_path={tiny_llama!r}, temperature=0, max_tokens=2, **kw)
            try:
                llm.invoke("a")
            except ValueError as exc:  # the prompt may not fit a tiny context: fine
                assert "context" in str(exc), exc
            print("OK", kw)
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("OK") == 4


# --------------------------------------------------------------------------- event loop


def _record_threads(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """The threads that call ``module.name`` from now on (the work counted where it runs)."""
    threads: list[int] = []
    original = getattr(module, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return threads


async def _ticking(call: Any) -> tuple[float, float, int]:
    """Await ``call()`` beside a ticker on the loop: (the ticker's longest wait, the
    call's duration, the loop's thread)."""
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            worst = max(worst, now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    await call()
    took = time.perf_counter() - t0
    done = True
    await task
    return worst, took, threading.get_ident()


def test_first_ainvoke_does_not_block_the_event_loop(
    gemma: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading runs on threads: the loop's own thread never waits for the model (another
    thread acquires it, and the load has a thread of its own), and a ticker on the loop
    keeps ticking while the first ``ainvoke`` loads Gemma. Where the work runs is
    counted; the ticker's longest wait is compared with the call, not with a fixed figure
    (a loaded 2-core machine stalls any thread for a while)."""
    from langchain_llamacpp_local.runtime import registry

    acquired_on = _record_threads(monkeypatch, registry, "acquire")
    llm = ChatLlamaCpp(model_path=gemma, temperature=0, max_tokens=2, n_ctx=512)
    worst, took, loop_thread = asyncio.run(_ticking(lambda: llm.ainvoke("hi")))
    assert acquired_on and loop_thread not in acquired_on
    assert worst < took / 2, (worst, took)


def test_mtmd_clip_log_goes_through_logging(tmp_path: Path) -> None:
    """Mtmd/clip have their own logger in llama.cpp; it used to print to stderr."""
    proc = _run_isolated(
        f"""
        import logging
        from pathlib import Path
        from tests.gguf_models import write_tiny_llama, write_tiny_mmproj
        from langchain_llamacpp_local import ChatLlamaCpp

        seen = []
        class Keep(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())
        log = logging.getLogger("langchain_llamacpp_local.llama_cpp")
        log.addHandler(Keep())
        log.setLevel(logging.DEBUG)
        text = write_tiny_llama(Path({str(tmp_path / "t.gguf")!r}))
        proj = write_tiny_mmproj(Path({str(tmp_path / "p.gguf")!r}))
        ChatLlamaCpp(model_path=str(text), mmproj_path=str(proj)).load()
        print("CLIP_RECORDS", sum("clip" in m for m in seen))
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "clip" not in proc.stderr  # nothing printed behind logging's back
    n = int(proc.stdout.split("CLIP_RECORDS")[1].split()[0])
    assert n > 0


def test_image_decoding_does_not_block_the_event_loop(
    tmp_path: Path, tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large image is decoded (pillow) in a worker thread, not on the event loop."""
    import base64
    import io

    from PIL import Image

    from tests.gguf_models import write_tiny_mmproj

    buf = io.BytesIO()
    Image.new("RGB", (4000, 4000), (10, 200, 30)).save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    mmproj = str(write_tiny_mmproj(tmp_path / "mmproj.gguf"))
    llm = ChatLlamaCpp(
        model_path=tiny_llama,
        mmproj_path=mmproj,
        temperature=0,
        max_tokens=2,
        n_ctx=512,
        n_slots=1,
    )
    llm.load()
    msg = {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image", "base64": data, "mime_type": "image/png"},
        ],
    }

    from langchain_llamacpp_local.chat import images

    decoded_on = _record_threads(monkeypatch, images, "load_image")
    worst, took, loop_thread = asyncio.run(_ticking(lambda: llm.ainvoke([msg])))
    assert decoded_on and loop_thread not in decoded_on  # decoded on a thread of its own
    assert worst < took / 2, (worst, took)


def test_nothing_of_llama_cpp_runs_on_a_daemon_thread_after_the_exit_hook(
    tiny_llama: str,
) -> None:
    """The exit hook (``shutdown_all``) returns only once no load, worker or reaper
    thread is left: llama.cpp calls into Python (its log) from them, and a daemon thread
    entering Python while the interpreter finalizes is ended with ``pthread_exit``, whose
    unwinding through llama.cpp's C++ aborts the process. Here a load is in flight and a
    model freed just before is still being torn down when the hook runs."""
    proc = _run_isolated(
        f"""
        import threading, time
        from langchain_llamacpp_local import ChatLlamaCpp
        from langchain_llamacpp_local.runtime import registry

        def ours():
            return [
                t.name for t in threading.enumerate()
                if t.name.startswith(("llamacpp-load:", "llamacpp-worker:", "llamacpp-registry"))
            ]

        freed = ChatLlamaCpp(model_path={tiny_llama!r}, max_tokens=2, n_ctx=256).load()
        freed.invoke("hi")
        loading = ChatLlamaCpp(model_path={tiny_llama!r}, max_tokens=2, n_ctx=512)
        threading.Thread(target=loading.invoke, args=("hi",), daemon=True).start()
        until = time.monotonic() + 5
        while not any(n.startswith("llamacpp-load:") for n in ours()) and time.monotonic() < until:
            time.sleep(0.0005)
        threading.Thread(target=freed.close, daemon=True).start()
        registry.shutdown_all()
        print("LEFT", ours())
        try:
            ChatLlamaCpp(model_path={tiny_llama!r}, n_ctx=768).invoke("hi")
        except Exception as exc:
            print("AFTER", type(exc).__name__)
        print("STILL", ours())
        """,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LEFT []" in proc.stdout, proc.stdout
    # no load after the hook: a call then is cancelled, and starts no thread
    assert "AFTER RequestCancelledError" in proc.stdout and "STILL []" in proc.stdout


def test_close_during_embed_rerank_and_chat_never_kills_the_process(
    tmp_path: Path, tiny_llama: str
) -> None:
    """Close() on one thread while others embed, rerank and chat: every call ends with a
    result or a clear RequestCancelledError, and nothing is freed under a running call
    (a crash or abort kills the child, which fails the test)."""
    proc = _run_isolated(
        f"""
        import random, threading, time
        from pathlib import Path
        from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings, LlamaCppRerank
        from langchain_llamacpp_local.errors import RequestCancelledError
        from tests.gguf_models import write_tiny_bert

        d = Path({str(tmp_path)!r})
        emb = LlamaCppEmbeddings(model_path=str(write_tiny_bert(d / "e.gguf")), truncate=True)
        rr = LlamaCppRerank(
            model_path=str(write_tiny_bert(d / "r.gguf", rerank=True)), truncate=True
        )
        chat = ChatLlamaCpp(model_path={tiny_llama!r}, max_tokens=4, temperature=0)
        texts = ["hello world " * random.randint(1, 3000) for _ in range(24)]
        stop = time.monotonic() + 4.0
        ok, cancelled, other = [0], [0], []

        def hammer(call):
            while time.monotonic() < stop:
                try:
                    call()
                    ok[0] += 1
                except RequestCancelledError:
                    cancelled[0] += 1
                except Exception as exc:
                    other.append(repr(exc))

        calls = [
            lambda: emb.embed_documents(texts),
            lambda: emb.embed_query("q " * 50),
            lambda: rr.rerank("query", texts),
            lambda: chat.invoke("hi"),
        ]
        threads = [threading.Thread(target=hammer, args=(c,)) for c in calls * 2]
        for t in threads:
            t.start()
        while time.monotonic() < stop:
            for model in (emb, rr, chat):
                model.close()
            time.sleep(random.random() * 0.003)
        for t in threads:
            t.join()
        print("OK", ok[0], "CANCELLED", cancelled[0], "OTHER", other[:3])
        """,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OTHER []" in proc.stdout, proc.stdout
    assert int(proc.stdout.split()[1]) > 0, proc.stdout


@pytest.mark.parametrize("length", [2**62, 2**64 - 1, 10**9])
def test_a_crafted_key_length_is_a_load_error_naming_the_file(tmp_path: Path, length: int) -> None:
    path = write_tiny_llama(tmp_path / "huge-key.gguf")
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 24, length)  # the first key's length
    path.write_bytes(bytes(data))
    proc = _run_isolated(
        f"""
        from langchain_llamacpp_local import ChatLlamaCpp
        from langchain_llamacpp_local.errors import ModelLoadError
        try:
            ChatLlamaCpp(model_path={str(path)!r}, max_tokens=2).invoke("hi")
        except ModelLoadError as exc:
            print("MODEL_LOAD_ERROR", exc)
        """
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "MODEL_LOAD_ERROR" in out and str(path) in out and f"{length} bytes" in out, out


def test_unclear_inputs_get_errors_naming_the_problem(tmp_path: Path) -> None:
    from langchain_llamacpp_local import LlamaCppEmbeddings, LlamaCppRerank
    from langchain_llamacpp_local.errors import ContextOverflowError
    from langchain_llamacpp_local.resolution.model_resolution import ModelNotFoundError
    from tests.gguf_models import write_tiny_bert

    # a model name too long for the file system: a not-found report, not an OSError
    with pytest.raises(ModelNotFoundError, match=r"\(5000 characters\) not found") as info:
        ChatLlamaCpp(model="a" * 5000).invoke("hi")
    assert "File name too long" in str(info.value) and len(str(info.value)) < 1000
    # a port that str.isdigit() accepts but int() does not
    with pytest.raises(ValueError, match=r"port must be a number in 1\.\.65535, not '²'"):
        ChatLlamaCpp(model_path=str(tmp_path / "m.gguf"), rpc_servers=["h:²"])
    # a lone surrogate: the text and the character are named
    emb = LlamaCppEmbeddings(model_path=str(write_tiny_bert(tmp_path / "e.gguf")))
    with pytest.raises(ValueError, match=r"text 1 is not valid Unicode: character 2 is '\\ud800'"):
        emb.embed_documents(["fine", "ab\ud800c"])
    assert len(emb.embed_documents(["still serving"])) == 1
    # truncate=True with a query too long by itself: no advice to pass truncate=True
    rr = LlamaCppRerank(
        model_path=str(write_tiny_bert(tmp_path / "r.gguf", rerank=True)),
        n_ctx=32,
        truncate=True,
        flash_attn=False,
    )
    with pytest.raises(ContextOverflowError, match="shorten the query") as info:
        rr.rerank("q " * 100, ["doc"])
    assert "pass truncate=True" not in str(info.value)
    with pytest.raises(ValueError, match="document 0 is not valid Unicode"):
        rr.rerank("q", ["\udfff"])


def test_a_slow_template_stops_at_the_callers_timeout(tiny_llama: str) -> None:
    """The template's time is the request's: it ends at the caller's timeout, so a
    bystander on the same model is served within its own."""
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    llm = ChatLlamaCpp(model_path=tiny_llama, max_tokens=2, temperature=0, n_slots=1)
    llm.load()
    start = time.monotonic()
    with pytest.raises((TimeoutError, ValueError)):
        llm.invoke("hi", chat_template=slow, timeout=0.5)
    assert time.monotonic() - start < 2.0
    start = time.monotonic()
    served = llm.invoke("hi", timeout=3)
    assert time.monotonic() - start < 2.0
    assert reply_of(served) == reply_of(llm.invoke("hi", cache_prompt=False))  # a whole reply


def test_a_tool_schema_nested_too_deep_is_refused_naming_its_depth(tiny_llama: str) -> None:
    """1,000 schema levels on a template that cannot show tools (their description is
    written into the prompt): a ValueError naming the depth, and the worker serves on."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(1000):
        schema = {"type": "object", "properties": {"a": schema}}
    deep = {"type": "function", "function": {"name": "deep", "parameters": schema}}
    llm = ChatLlamaCpp(
        model_path=tiny_llama,
        max_tokens=2,
        chat_template="{% for m in messages %}{{ m.content }}\n{% endfor %}",
    )
    with pytest.raises(ValueError, match=r"tools\[0\] \('deep'\) nests 2001 objects/arrays deep"):
        llm.bind_tools([deep]).invoke("hi")
    with pytest.raises(ValueError, match="nests 2001"):
        llm.invoke("hi", tools=[deep])
    shallow = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    assert isinstance(llm.bind_tools([shallow]).invoke("hi").content, str)
    assert isinstance(llm.invoke("still serving").content, str)


def test_a_prompt_cache_dir_that_cannot_be_expanded_names_the_setting(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from langchain_llamacpp_local.cache.disk import ENV_DIR

    with pytest.raises(ValueError, match=r"prompt_cache_dir='~nosuchuser/x': cannot expand '~'"):
        ChatLlamaCpp(model_path=tiny_llama, prompt_cache_dir="~nosuchuser/x").invoke("hi")
    monkeypatch.setenv(ENV_DIR, "~nosuchuser/y")
    with pytest.raises(ValueError, match=rf"{ENV_DIR}='~nosuchuser/y': cannot expand '~'"):
        ChatLlamaCpp(model_path=tiny_llama, max_tokens=2).invoke("hi")
    monkeypatch.delenv(ENV_DIR)
    assert isinstance(ChatLlamaCpp(model_path=tiny_llama, max_tokens=2).invoke("hi").content, str)


# --------------------------------------------------------------------------- samplers

#: (setting, what the error names): each refused as a field and per call
_BAD_SAMPLERS: list[tuple[dict[str, Any], str]] = [
    ({"dry_multiplier": float("nan")}, "dry_multiplier must be finite"),
    ({"dry_multiplier": -1.0}, "dry_multiplier must be >= 0"),
    ({"dry_base": 0.5}, "dry_base must be >= 1"),
    ({"dry_allowed_length": -1}, "dry_allowed_length must be >= 0"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n must be -1"),
    ({"dry_sequence_breakers": ["x"] * 100_000}, "more than the 32 allowed"),
    ({"dry_sequence_breakers": ["y" * 41]}, "41 bytes long"),
    ({"dry_sequence_breakers": [""]}, r"dry_sequence_breakers\[0\] must be a non-empty"),
    ({"dry_sequence_breakers": ["\ud800"]}, "not valid Unicode"),
    ({"top_n_sigma": -0.5}, "top_n_sigma must be > 0"),
    ({"top_n_sigma": float("inf")}, "top_n_sigma must be finite"),
    ({"typical_p": 0.0}, r"typical_p must be in \(0, 1\]"),
    ({"xtc_probability": 1.5}, r"xtc_probability must be in \[0, 1\]"),
    ({"xtc_threshold": 0.7}, r"xtc_threshold must be in \[0, 0.5\]"),
    ({"dynatemp_range": -0.1}, "dynatemp_range must be >= 0"),
    ({"dynatemp_exponent": 0}, "dynatemp_exponent must be > 0"),
    ({"mirostat": 3}, "mirostat must be 0"),
    ({"mirostat_tau": float("nan")}, "mirostat_tau must be finite"),
    ({"mirostat_eta": 0}, r"mirostat_eta must be in \(0, 1\]"),
    ({"mirostat": 2, "repeat_penalty": 1.2, "temperature": 1.0}, "turn off the penalties"),
    ({"mirostat": 1, "temperature": 0}, "temperature=0 is greedy"),
    ({"logit_bias": {"a": float("nan")}}, r"logit_bias\['a'\] must be a finite number"),
    ({"logit_bias": {"a": float("inf")}}, r"logit_bias\['a'\] must be a finite number"),
    ({"logit_bias": {"a": 1e300}}, r"within \+-1e\+06"),
    ({"logit_bias": {"a": "lots"}}, "must be a number or -inf"),
    ({"logit_bias": {-1: 1.0}}, "token id -1 is negative"),
    ({"logit_bias": {"": 1.0}}, "text keys must be non-empty"),
    ({"logit_bias": {"x" * 5000: 1.0}}, "at most 256 characters"),
    ({"grammar": 'root ::= "a"\0'}, "NUL"),
]

#: settings only the loaded model's vocabulary (or grammar parser) can refuse
_BAD_FOR_THE_MODEL: list[tuple[dict[str, Any], str]] = [
    ({"logit_bias": {"hello": -1.0}}, r"'hello' is 5 tokens of this model"),
    ({"logit_bias": {"<|im_end|>": float("-inf")}}, "is 10 tokens of this model"),
    ({"logit_bias": {99_999: 1.0}}, "token id 99999 is not in this model's vocabulary"),
    ({"logit_bias": {"a": 1.0, "100": 2.0}}, "gives token 100 twice"),
    ({"grammar": "root ::= ("}, "invalid grammar"),
    ({"grammar": 'start ::= "x"'}, "invalid grammar"),
]


def test_bad_sampler_settings_get_clear_errors_and_the_worker_serves(tiny_llama: str) -> None:
    from langchain_core.exceptions import ModelInvalidRequestError

    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=3)
    ok = llm.invoke("hi").content
    for setting, message in _BAD_SAMPLERS:
        with pytest.raises((ValueError, TypeError)) as info:
            ChatLlamaCpp(model_path=tiny_llama, **setting)
        assert next(iter(setting)) in str(info.value), (setting, info.value)
        with pytest.raises(ModelInvalidRequestError, match=message):
            llm.invoke("hi", **setting)
    for setting, message in _BAD_FOR_THE_MODEL:
        with pytest.raises(ModelInvalidRequestError, match=message):
            llm.invoke("hi", **setting)
        assert ChatLlamaCpp(model_path=tiny_llama, **setting)  # checked when the call runs
    # wrong types per call, named
    for setting in (
        {"dry_sequence_breakers": "\n"},
        {"logit_bias": [1, 2]},
        {"logit_bias": "a"},
        {"logit_bias": {1.5: 1.0}},
        {"typical_p": "high"},
        {"mirostat": True},
        {"grammar": 5},
    ):
        with pytest.raises(ModelInvalidRequestError, match=next(iter(setting))):
            llm.invoke("hi", **setting)
    assert llm.invoke("hi").content == ok  # the worker still serves, unchanged


def test_a_grammar_is_refused_beside_tools_or_a_response_format(tiny_llama: str) -> None:
    from langchain_core.exceptions import ModelInvalidRequestError

    grammar = 'root ::= "yes" | "no"'
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=4)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(ModelInvalidRequestError, match="grammar cannot be combined with tools"):
        llm.invoke("hi", grammar=grammar, tools=[tool])
    with pytest.raises(ModelInvalidRequestError, match="with response_format"):
        llm.invoke("hi", grammar=grammar, response_format={"type": "json_object"})
    fixed = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=4, grammar=grammar)
    with pytest.raises(ModelInvalidRequestError, match="grammar cannot be combined with tools"):
        fixed.bind_tools([tool]).invoke("hi")

    class Answer(BaseModel):
        yes: bool

    with pytest.raises(ModelInvalidRequestError, match="grammar cannot be combined"):
        fixed.with_structured_output(Answer, method="json_schema").invoke("hi")
    assert fixed.invoke("hi").content in ("yes", "no")
    assert fixed.invoke("hi", grammar=None).content == llm.invoke("hi").content


# --------------------------------------------------------------------------- cache report privacy

SECRET = "Tr0ub4dor&3 is my bank password, remember it"
SHARED_SYSTEM = "You are the bank's assistant. Answer in one short sentence. " * 3
CACHE_SOURCES = ["slot copy", "single slot", "host RAM", "decision state", "disk"]


def _secret_ids_in(value: Any, ids: list[int]) -> bool:
    """Whether any list of ints inside ``value`` holds ``ids`` as a run."""
    if isinstance(value, dict):
        return any(_secret_ids_in(v, ids) for v in value.values())
    if isinstance(value, list | tuple):
        if value and all(isinstance(v, int) for v in value):
            k = len(ids)
            return any(list(value[i : i + k]) == ids for i in range(len(value) - k + 1))
        return any(_secret_ids_in(v, ids) for v in value)
    return False


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("source", CACHE_SOURCES)
def test_the_cache_report_never_shows_another_callers_conversation(
    tiny_llama: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    source: str,
    deterministic: bool,
) -> None:
    """Two instances share a model; Alice's secret sits in the cache where Bob's prompt
    leaves it. Bob's ``response_metadata["cache"]`` and every log line of his call name
    where his own prompt left the cache, never Alice's text or its token ids."""
    from langchain_core.decisions import Noul
    from langchain_core.messages import HumanMessage, SystemMessage

    from langchain_llamacpp_local.decisions import question_message

    settings: dict[str, Any] = {
        "model_path": tiny_llama,
        "temperature": 0.0,
        "max_tokens": 4,
        "deterministic": deterministic,
        "n_slots": 2 if source == "slot copy" else 1,
    }
    if source == "disk":
        settings["prompt_cache_dir"] = str(tmp_path / "cache")
    alice = ChatLlamaCpp(**settings)
    bob = ChatLlamaCpp(**settings, cache_miss_warning_tokens=0)
    expected = {"host RAM": "host_ram", "disk": "disk"}.get(source, "slot")
    bob_says: list[Any] = [SystemMessage(SHARED_SYSTEM), HumanMessage("What are your hours?")]
    if source == "decision state":
        alice.as_decision_model().invoke(
            {"state": SECRET, "questions": {"q": Noul(instructions="Is it a password?")}}
        )
        # a chat caller whose prompt starts as a decision's does, up to the state
        intro = str(question_message("", [], "").content).split("<state>")[0]
        bob_says = [HumanMessage(f"{intro}<state>\nWhat are your hours?")]
    elif source == "disk":
        # an earlier process wrote Alice's conversation to the disk cache
        proc = _run_isolated(
            f"""
            from langchain_llamacpp_local import ChatLlamaCpp
            from langchain_llamacpp_local.cache import disk
            from langchain_core.messages import HumanMessage, SystemMessage
            llm = ChatLlamaCpp(**{settings!r})
            llm.invoke([SystemMessage({SHARED_SYSTEM!r}), HumanMessage({SECRET!r})])
            assert disk.flush(30)
            print("WROTE")
            """
        )
        assert "WROTE" in proc.stdout, proc.stderr[-2000:]
    else:
        alice.invoke([SystemMessage(SHARED_SYSTEM), HumanMessage(SECRET)])
        if source == "host RAM":  # another conversation pushes Alice's out of the slot
            alice.invoke([SystemMessage("Another system prompt entirely."), HumanMessage("hi")])
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="langchain_llamacpp_local")
    reply = bob.invoke(bob_says)
    report = reply.response_metadata["cache"]
    assert report["source"] == expected and report["missed"] is True, report
    assert report["cached_tokens"] > 0
    # where Bob's own prompt left the cache is still named
    assert report["miss"]["prompt"].startswith("What are your hours")
    ids = bob.get_token_ids(SECRET[:16])
    for text in (json.dumps(reply.response_metadata), *(r.getMessage() for r in caplog.records)):
        assert "Tr0ub4dor" not in text and "bank password" not in text, text
    assert not _secret_ids_in(reply.response_metadata, ids)
    assert any("prompt cache miss" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- fork


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("busy", ["decode", "embedding batch", "decision"])
def test_a_child_forked_mid_decode_loads_a_model_and_serves(
    tiny_llama: str, tmp_path: Path, busy: str
) -> None:
    """A process forks while its model decodes (the threads of that decode counted as in
    use in the process-wide CPU budget, locks possibly held): the child loads models,
    the parent's settings included, and serves them. A hang is killed by an alarm."""
    from tests.gguf_models import write_tiny_bert

    bert = write_tiny_bert(tmp_path / "bert.gguf")
    other = write_tiny_llama(tmp_path / "other.gguf", seed=1)
    proc = _run_isolated(
        f"""
        import os, signal, threading, time
        from langchain_core.decisions import Choice
        from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings
        from langchain_llamacpp_local.llama import threads

        # other programs' load on the test machine must not shrink the decoding team
        # below every usable CPU: the fork is to find them all counted as in use
        usable = threads.usable_cpus(threads.default_cpu_view())
        threads._budget = threads.CpuBudget(usable, adaptive=False)
        chat = dict(model_path={tiny_llama!r}, n_ctx=2048, temperature=0.0)
        llm = ChatLlamaCpp(**chat, max_tokens=1500)
        emb = LlamaCppEmbeddings(model_path={str(bert)!r})
        llm.invoke("warm up", max_tokens=2)
        emb.embed_query("warm up")
        stop = threading.Event()

        def work():
            while not stop.is_set():
                if {busy!r} == "decode":
                    llm.invoke("tell me a long story")
                elif {busy!r} == "embedding batch":
                    emb.embed_documents(["a long enough document to embed " * 8] * 64)
                else:
                    labels = {{f"label{{i}}": None for i in range(40)}}
                    llm.as_decision_model().invoke(
                        {{"state": "a state " * 50,
                          "questions": {{"q": Choice(instructions="Which?", criteria=labels)}}}}
                    )

        threading.Thread(target=work, daemon=True).start()
        budget = threads.cpu_budget()
        until = time.monotonic() + 30
        while budget._in_use < usable and time.monotonic() < until:
            pass
        print("IN USE AT FORK", budget._in_use, "OF", usable, flush=True)
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a hang ends the child (status: killed by SIGALRM)
            try:
                fresh = ChatLlamaCpp(model_path={str(other)!r}, max_tokens=3, temperature=0.0)
                fresh.invoke("hi", timeout=30)
                ChatLlamaCpp(**chat, max_tokens=3).invoke("hello", timeout=30)
                LlamaCppEmbeddings(model_path={str(bert)!r}).embed_query("child")
                print("CHILD SERVED", flush=True)
                os._exit(0)
            except BaseException as exc:
                print("CHILD FAILED", repr(exc), flush=True)
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        stop.set()
        print("CHILD STATUS", status, flush=True)
        llm.invoke("the parent serves on", max_tokens=2)
        print("PARENT SERVED", flush=True)
        """,
        timeout=180,
    )
    out = proc.stdout
    # the fork found every usable CPU counted as in use (the case that hung)
    assert re.search(r"IN USE AT FORK (\d+) OF \1\n", out), out + proc.stderr[-2000:]
    assert "CHILD SERVED" in out and "CHILD STATUS 0" in out, out + proc.stderr[-2000:]
    assert "PARENT SERVED" in out, out + proc.stderr[-2000:]


def test_a_huge_affinity_mask_does_not_make_huge_thread_teams(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An affinity mask claiming 10,000 CPUs: the automatic plan is capped (an explicit
    setting still wins)."""
    from langchain_llamacpp_local.llama import threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(10_000)), raising=False)
    view = threads.read_cpu_view()
    assert view.affinity == 10_000
    plan = threads.plan_threads(view)
    assert plan.n_threads == plan.n_threads_batch <= 64
    assert "capped at" in plan.reason
    assert threads.plan_threads(view, n_threads=100).n_threads == 100


# --------------------------------------------------------------------------- tool-call arguments

QWEN25 = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
ANY_ARG_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "description": "f",
        "parameters": {"type": "object", "properties": {"a": {}}},
    },
}


@pytest.mark.parametrize("stream_tool_args", [False, True])
def test_tool_arguments_nested_too_deep_are_an_invalid_call(
    tmp_path: Path, stream_tool_args: bool
) -> None:
    """A call whose arguments nest 1,000 objects deep (past Python's JSON reader): an
    invalid call naming why, with and without ``stream_tool_args``, never a bare
    RecursionError; the stream's merged chunks hold no valid call either."""
    from langchain_core.messages import AIMessageChunk

    from tests.printing_model import write_printing_llama

    depth = 1000
    deep = '{"a": ' * depth + "1" + "}" * depth
    text = f'<tool_call>\n{{"name": "f", "arguments": {deep}}}\n</tool_call>'
    path, pieces = write_printing_llama(
        tmp_path / "deep.gguf",
        text,
        chat_template=QWEN25.read_text(encoding="utf-8"),
        cuts=("<tool_call>",),
    )
    llm = ChatLlamaCpp(
        model_path=str(path),
        temperature=0,
        n_ctx=4096,
        max_tokens=len(pieces) + 8,
        stream_tool_args=stream_tool_args,
    ).bind_tools([ANY_ARG_TOOL])
    reply = llm.invoke("go")
    assert reply.tool_calls == [] and len(reply.invalid_tool_calls) == 1, reply
    assert "nested too deep" in str(reply.invalid_tool_calls[0]["error"])
    merged: Any = None
    for chunk in llm.stream("go"):
        merged = chunk if merged is None else merged + chunk
    assert isinstance(merged, AIMessageChunk)
    assert merged.tool_calls == [] and merged.invalid_tool_calls


def test_invoke_with_streamed_tool_args_reads_the_arguments_in_linear_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``invoke`` with ``stream_tool_args=True`` keeps the parser's calls and does not
    merge the argument fragments (LangChain's merge re-reads the growing partial JSON at
    each fragment: quadratic). Counted as characters LangChain's partial-JSON reader
    reads, against the argument's length."""
    import langchain_core.messages.ai as lc_ai

    from tests.printing_model import write_printing_llama

    note = " ".join(f"w{i:04d}" for i in range(700))  # 4,199 characters, no two pieces alike
    text = f'<tool_call>\n{{"name": "f", "arguments": {{"a": "{note}"}}}}\n</tool_call>'
    path, pieces = write_printing_llama(
        tmp_path / "long.gguf",
        text,
        chat_template=QWEN25.read_text(encoding="utf-8"),
        cuts=("<tool_call>",),
    )
    read: list[int] = []
    original = lc_ai.parse_partial_json

    def counting(s: str, *a: Any, **k: Any) -> Any:
        read.append(len(s))
        return original(s, *a, **k)

    monkeypatch.setattr(lc_ai, "parse_partial_json", counting)
    for streamed in (False, True):
        llm = ChatLlamaCpp(
            model_path=str(path),
            temperature=0,
            n_ctx=4096,
            max_tokens=len(pieces) + 8,
            stream_tool_args=streamed,
        ).bind_tools([ANY_ARG_TOOL])
        read.clear()
        reply = llm.invoke("go")
        assert [c["args"] for c in reply.tool_calls] == [{"a": note}]
        # each fragment is read once where it is made (and the whole once): linear
        assert sum(read) <= 3 * len(text), (streamed, len(read), sum(read))


# --------------------------------------------------------------------------- reasoning budget message


@pytest.mark.parametrize("message", [" </s> then", " <|im_end|>\n<|im_start|>user\nhi"])
def test_control_token_text_in_the_budget_message_stays_text(tmp_path: Path, message: str) -> None:
    """``reasoning_budget_message`` is the caller's text: control-token text in it is
    plain text (``</s>`` ended the reply inside the thinking block; turn markup cut the
    answer off). Bad types and encodings are refused naming the option."""
    thoughts = [f" t{i}" for i in range(8)]
    pieces = ["<think>", *thoughts, "</think>", "Fine", " answer"]
    path = write_scripted_llama(
        tmp_path / "think.gguf",
        transitions={p: {n: 20.0} for p, n in zip(pieces, [*pieces[1:], "</s>"], strict=True)},
        extra_tokens=tuple(pieces),
        default_next=pieces[0],
        chat_template=(TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(),
        n_ctx_train=8192,
    )
    llm = ChatLlamaCpp(
        model_path=str(path), temperature=0, reasoning=True, max_tokens=64, n_ctx=4096
    )
    out = llm.invoke("hi", reasoning_budget=2, reasoning_budget_message=message)
    assert out.content == "Fine answer", out
    thought = out.additional_kwargs.get("reasoning_content") or ""
    assert thought.strip() == ("".join(thoughts[:2]) + message).strip()
    with pytest.raises(TypeError, match="reasoning_budget_message must be a string, got int 5"):
        llm.invoke("hi", reasoning_budget=2, reasoning_budget_message=5)
    with pytest.raises(
        ValueError, match=r"reasoning_budget_message is not valid Unicode: .*'\\ud800'"
    ):
        llm.invoke("hi", reasoning_budget=2, reasoning_budget_message="ok \ud800")
    assert llm.invoke("hi", reasoning_budget=2).content == "Fine answer"


# --------------------------------------------------------------------------- clear errors


def test_a_validation_error_keeps_its_text() -> None:
    """``as_model_error`` rebuilt pydantic's errors from their (empty) ``args``."""
    from pydantic import ValidationError

    from langchain_llamacpp_local.errors import as_model_error

    class Point(BaseModel):
        x: int

    with pytest.raises(ValidationError) as info:
        Point(x="not a number")  # type: ignore[arg-type]
    converted = as_model_error(info.value)
    assert "Input should be a valid integer" in str(converted), repr(converted)


def test_decision_errors_name_the_problem(tiny_llama: str) -> None:
    """A question id that is no string, a state nested 3,000 deep: errors naming them,
    before any question is scored; the model serves on."""
    from langchain_core.decisions import Noul

    from langchain_llamacpp_local.errors import InvalidRequestError

    llm = ChatLlamaCpp(model_path=tiny_llama, max_tokens=2, temperature=0.0)
    decider = llm.as_decision_model()
    question = Noul(instructions="Is it fine?")
    with pytest.raises(InvalidRequestError, match=r"question ids must be strings.*got 1 \(int\)"):
        decider.invoke({"state": "s", "questions": {1: question}})  # type: ignore[dict-item]
    deep: Any = "leaf"
    for _ in range(3000):
        deep = {"a": deep}
    with pytest.raises(InvalidRequestError, match="state: nested too deep to render"):
        decider.invoke({"state": deep, "questions": {"q": question}})
    assert decider.invoke({"state": "s", "questions": {"q": question}}).nouls["q"] is not None


def test_a_key_file_setting_naming_a_directory_names_it(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error named a file descriptor ("Is a directory: 7")."""
    from langchain_llamacpp_local.cache.disk import ENV_KEY_FILE

    key_dir = tmp_path / "a-directory"
    key_dir.mkdir()
    monkeypatch.setenv(ENV_KEY_FILE, str(key_dir))
    cached = ChatLlamaCpp(
        model_path=tiny_llama, max_tokens=2, prompt_cache_dir=str(tmp_path / "cache")
    )
    with pytest.raises(Exception, match=f"{key_dir}.* is a directory: {ENV_KEY_FILE}"):
        cached.invoke("hi")
    monkeypatch.delenv(ENV_KEY_FILE)
    assert isinstance(ChatLlamaCpp(model_path=tiny_llama, max_tokens=2).invoke("hi").content, str)


# --------------------------------------------------------------------------- model folders


def test_a_model_folder_is_listed_two_levels_deep_once_and_within_the_deadline(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model named by its folder: only the folder and its subfolders are listed (not
    the tree under them), the listing is remembered until a folder changes, a per-call
    ``model="/"`` lists nothing, and a slow listing stops at the request's timeout."""
    import shutil

    from langchain_llamacpp_local.errors import RequestTimeoutError
    from langchain_llamacpp_local.resolution.model_resolution import ModelNotFoundError

    folder = tmp_path / "my-model"
    (folder / "deep").mkdir(parents=True)
    shutil.copy(tiny_llama, folder / "model.gguf")
    below = folder / "deep"
    for level in range(6):  # a tree under the model's subfolder: never to be walked
        below = below / f"l{level}"
        below.mkdir()
        for i in range(20):
            (below / f"f{i}.txt").write_text("x")
    listed: list[str] = []
    real = os.scandir

    def counting(path: Any = ".") -> Any:
        listed.append(str(path))
        if len(listed) > 200:
            raise RuntimeError("the lookup walks the tree")
        return real(path)

    monkeypatch.setattr(os, "scandir", counting)
    llm = ChatLlamaCpp(model=str(folder), max_tokens=2, temperature=0.0)
    assert isinstance(llm.invoke("hi").content, str)
    assert set(listed) <= {str(folder), str(folder / "deep")}, listed
    listed.clear()
    assert isinstance(llm.invoke("again").content, str)
    assert listed == []  # remembered: the folders' times are unchanged
    (folder / "deep" / "readme.txt").write_text("a change")
    llm.invoke("after a change")
    assert str(folder) in listed or str(folder / "deep") in listed
    listed.clear()
    with pytest.raises(ModelNotFoundError, match="a file system root is not a model folder"):
        llm.invoke("hi", model="/")
    assert not [p for p in listed if p in ("/", "")], listed
    # a slow file system: the lookup stops at the request's timeout
    slow = tmp_path / "slow-model"
    for i in range(8):
        (slow / f"part{i}").mkdir(parents=True)
    shutil.copy(tiny_llama, slow / "model.gguf")

    def sluggish(path: Any = ".") -> Any:
        time.sleep(0.4)
        return real(path)

    monkeypatch.setattr(os, "scandir", sluggish)
    start = time.monotonic()
    with pytest.raises(RequestTimeoutError):
        llm.invoke("hi", model=str(slow), timeout=1.0)
    assert time.monotonic() - start < 2.2


def test_gpt_oss_output_without_a_header_streams_in_linear_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gpt-oss output that no channel header starts is content to its end: the stream
    parser reads each piece once instead of the whole output at every piece (40 KB in
    4-character pieces read 200M characters). Counted as characters the scanner reads."""
    from dataclasses import replace

    from langchain_llamacpp_local.formats.registry import FAMILIES
    from langchain_llamacpp_local.formats.stream_parser import StreamParser

    family = FAMILIES["gpt_oss"]
    assert family.scanner is not None
    real = family.scanner
    read: list[int] = []

    def counting(text: str, *a: Any) -> Any:
        read.append(len(text))
        return real(text, *a)

    monkeypatch.setitem(FAMILIES, "gpt_oss", replace(family, scanner=counting))
    text = ("Plain text, to=nobody <|not a header|> with no channel first. " * 700)[:40_000]
    parser = StreamParser("gpt_oss", reasoning=True)
    out = []
    for i in range(0, len(text), 4):
        out += parser.feed(text[i : i + 4])
    out += parser.finish()
    assert "".join(d.text for d in out if d.kind == "content") == text.strip()
    assert parser.result.content == text.strip()
    assert sum(read) <= 4 * len(text), (len(read), sum(read))


def test_hostile_audio_gets_clear_errors_and_the_worker_serves(
    tiny_llama: str, tmp_path: Path
) -> None:
    from langchain_core.exceptions import ModelInvalidRequestError
    from langchain_core.messages import HumanMessage

    from langchain_llamacpp_local.errors import AudioInputError
    from tests.gguf_models import write_tiny_audio_mmproj
    from tests.wav_files import audio_block, input_audio_part, pcm_wav, tone

    proj = str(write_tiny_audio_mmproj(tmp_path / "audio-mmproj.gguf"))
    model = ChatLlamaCpp(model_path=tiny_llama, mmproj_path=proj, max_tokens=4, temperature=0)
    wav = pcm_wav(tone(0.5))
    at = wav.index(b"data") + 4
    hour = wav[:at] + struct.pack("<I", 16_000 * 2 * 3600) + wav[at + 4 :]

    def ask(part: dict[str, Any]) -> list[Any]:
        return [HumanMessage(content=[{"type": "text", "text": "hear this"}, part])]

    cases = {
        "corrupt": (audio_block(b"RIFF\x10\x00\x00\x00WAVEfmt garbage!"), "WAV"),
        "truncated": (audio_block(wav[: len(wav) // 3]), "truncated"),
        "zero samples": (audio_block(pcm_wav(tone(0.0))), "no samples"),
        "an hour": (audio_block(hour), "exceeds the limit"),
        "not audio": (audio_block(b"%PDF-1.7\n" + b"x" * 100), "not a WAV file"),
        "mp3": (input_audio_part(b"ID3\x04" + b"\x00" * 64, fmt="mp3"), "accepted: WAV"),
        "flac": (audio_block(b"fLaC" + b"\x00" * 64, "audio/flac"), "accepted: WAV"),
    }
    for name, (part, message) in cases.items():
        with pytest.raises(AudioInputError, match=message) as info:
            model.invoke(ask(part))
        assert isinstance(info.value, ModelInvalidRequestError), name
    no_audio = ChatLlamaCpp(model_path=tiny_llama, mmproj_path="none", max_tokens=4)
    with pytest.raises(AudioInputError, match="no audio projector"):
        no_audio.invoke(ask(audio_block(wav)))
    assert no_audio.invoke("hello").content is not None
    # the worker keeps serving audio after every refusal
    reply = model.invoke(ask(audio_block(wav)))
    assert reply.usage_metadata["output_tokens"] > 0  # type: ignore[index]


def test_cache_reuse_refuses_bad_values_and_survives_repetitive_histories(
    tiny_llama: str,
) -> None:
    """``cache_reuse``: a negative, bool, text or float value is refused naming it (at
    construction and per call) and the worker keeps serving; histories built to make the
    chunk walk work hard (one token repeated, runs that fall one token short of the
    minimum) and the smallest and largest minimums keep the KV bookkeeping exact (checked
    after every step) and answer."""
    from langchain_core.exceptions import ModelInvalidRequestError
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    for value in (-1, True, "256", 2.5, None, 2**31):
        with pytest.raises((TypeError, ValueError), match="cache_reuse"):
            ChatLlamaCpp(model_path=tiny_llama, cache_reuse=value)
    llm = ChatLlamaCpp(model_path=tiny_llama, temperature=0, max_tokens=3, n_slots=1)
    ok = llm.invoke("hi").content
    for value in (-1, True, "256", 2.5, None):
        with pytest.raises(ModelInvalidRequestError, match="cache_reuse"):
            llm.invoke("hi", cache_reuse=value)
    assert llm.invoke("hi").content == ok
    n_min = 16
    histories = {
        "one token": ["a" * 200, "a" * 200, "a" * 200],
        "one short": [("b" * (n_min - 1) + "c") * 8 for _ in range(3)],
    }
    for name, turns in histories.items():
        for reuse in (1, n_min, 2**31 - 1):
            msgs: list[Any] = [SystemMessage("s")]
            for t in turns:
                msgs += [HumanMessage(t), AIMessage(t[::-1])]
            llm.invoke([*msgs, HumanMessage("q")], cache_reuse=reuse)
            trimmed = [msgs[0], *msgs[3:], HumanMessage("q")]
            reply = llm.invoke(trimmed, cache_reuse=reuse)
            cache = reply.response_metadata["cache"]
            assert cache["moved_tokens"] >= 0 and cache["reuse_off"] in (None, "media"), name
            if reuse == 2**31 - 1:
                assert cache["moved_tokens"] == 0, name
            else:  # the turns after the dropped one are kept or moved, not read
                read = reply.usage_metadata["input_tokens"] - cache["cached_tokens"]  # type: ignore[index]
                assert cache["moved_tokens"] > 0 and read < 60, (name, reuse, cache)
    assert llm.invoke("hi").content == ok
