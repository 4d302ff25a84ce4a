"""The prompt cache on disk on real llama.cpp: a new process starts warm.

Each test writes with one model instance, frees it (a new worker has an empty host-RAM
cache, like a new process) and reads with another; one test uses real new processes.
With ``deterministic=True`` an answer equals a cold instance's (no cache directory) bit
for bit. By default a warm answer may differ from a cold one in rounding (as any warm
request does), so it is compared with the same conversation continued in RAM: restoring
the file must give exactly what the slot would have held.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.cache import disk as disk_cache
from langchain_llamacpp_local.runtime import registry
from tests.compare import GREEDY as _GREEDY
from tests.compare import assert_identical, assert_same_greedy
from tests.gguf_models import write_tiny_llama
from tests.helpers import cached_tokens

ROOT = Path(__file__).resolve().parents[3]
GREEDY: dict[str, Any] = {**_GREEDY, "max_tokens": 8}
PREAMBLE = SystemMessage(
    "You are an agent with tools. "
    + " ".join(f"Rule {i}: answer briefly and cite the tool you used." for i in range(10))
)


def _call(path: str, msgs: list[BaseMessage], cache_dir: Path | None, **kw: Any) -> BaseMessage:
    """One call on a freshly loaded model (nothing in RAM), its files written after."""
    llm = ChatLlamaCpp(
        model_path=path, prompt_cache_dir=str(cache_dir) if cache_dir else None, **GREEDY, **kw
    )
    try:
        return llm.invoke(msgs)
    finally:
        llm.close()
        registry.unload()
        assert disk_cache.flush(30)


def _reference(
    path: str, first: list[BaseMessage], msgs: list[BaseMessage], **kw: Any
) -> BaseMessage:
    """What ``msgs`` gives: read cold (deterministic), or continued in RAM after ``first``."""
    if kw.get("deterministic"):
        return _call(path, msgs, None, **kw)
    llm = ChatLlamaCpp(model_path=path, **GREEDY, **kw)
    try:
        llm.invoke(first)
        return llm.invoke(msgs)
    finally:
        llm.close()
        registry.unload()


_SCRIPT = """
import json, sys
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_llamacpp_local import ChatLlamaCpp
path, cache_dir, question, preamble = sys.argv[1:5]
llm = ChatLlamaCpp(model_path=path, prompt_cache_dir=cache_dir or None, temperature=0,
                   max_tokens=8, logprobs=True, top_logprobs=2, deterministic=True)
out = llm.invoke([SystemMessage(preamble), HumanMessage(question)])
print(json.dumps({"content": out.content, "usage": out.usage_metadata,
                  "logprobs": out.response_metadata["logprobs"]["content"]}))
"""


def _process(
    path: str, cache_dir: Path | None, question: str, script: str = _SCRIPT, timeout: float = 300
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != disk_cache.ENV_DIR}
    done = subprocess.run(
        [sys.executable, "-c", script, path, str(cache_dir or ""), question, PREAMBLE.content],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_process_starts_from_the_saved_preamble(tiny_llama: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _process(tiny_llama, cache, "What is the weather in Paris?")
    assert first["usage"]["input_token_details"]["cache_read"] == 0
    assert list(cache.glob("*.llkv")), "the first process left no file"
    second = _process(tiny_llama, cache, "And in Rome?")
    cold = _process(tiny_llama, None, "And in Rome?")
    n_prompt = second["usage"]["input_tokens"]
    assert (
        second["usage"]["input_token_details"]["cache_read"] >= n_prompt - 64
    )  # all but the question
    assert second["content"] == cold["content"]
    assert second["logprobs"] == cold["logprobs"]  # restored equals read, bit for bit


def test_files_of_other_settings_or_models_are_skipped(tiny_llama: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    msgs = [PREAMBLE, HumanMessage("hello")]
    _call(tiny_llama, msgs, cache, n_ctx=1024)
    assert cached_tokens(_call(tiny_llama, msgs, cache, n_ctx=1024)) > 0
    assert cached_tokens(_call(tiny_llama, msgs, cache, n_ctx=2048)) == 0
    assert cached_tokens(_call(tiny_llama, msgs, cache, n_ctx=1024, rope_freq_base=20000.0)) == 0
    other = str(write_tiny_llama(tmp_path / "other.gguf", seed=1))
    assert cached_tokens(_call(other, msgs, cache, n_ctx=1024)) == 0


def test_a_corrupt_file_is_skipped_and_the_call_served(
    tiny_llama: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    msgs = [PREAMBLE, HumanMessage("hello")]
    cold = _call(tiny_llama, msgs, None, deterministic=True)
    _call(tiny_llama, msgs, cache, deterministic=True)
    for path in cache.glob("*.llkv"):
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0x55
        path.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="langchain_llamacpp_local.cache.disk"):
        out = _call(tiny_llama, msgs, cache, deterministic=True)
    assert cached_tokens(out) == 0
    assert any("checksum" in r.message for r in caplog.records)
    assert_identical(out, cold)


def _assert_restores(path: str, cache: Path, **kw: Any) -> None:
    """A conversation saved by one instance resumes from disk in the next, with another
    last message, and gives what the reference gives (see :func:`_reference`): bit for
    bit in deterministic mode; by default the same greedy tokens, as flash attention is
    off on the CPU and its matrix-multiply path rounds with the KV cells in use."""
    first = [PREAMBLE, HumanMessage("first question")]
    _call(path, first, cache, **kw)
    msgs = [PREAMBLE, HumanMessage("a different question")]
    warm = _call(path, msgs, cache, **kw)
    assert cached_tokens(warm) > 0
    if kw.get("deterministic"):
        assert_identical(warm, _reference(path, first, msgs, **kw))
    else:  # the default mode promises the tokens, not the last digits of a logit
        assert_same_greedy(warm, _reference(path, first, msgs, **kw))


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("model", ["tiny_mamba", "tiny_hybrid", "tiny_llama"])
def test_every_memory_kind_restores_from_disk(
    model: str, deterministic: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Recurrent and hybrid memory resume through the checkpoint at the last message's
    start, attention memory by trimming the restored state."""
    path = request.getfixturevalue(model)
    _assert_restores(path, tmp_path / "cache", deterministic=deterministic)


@pytest.mark.gemma
@pytest.mark.parametrize("deterministic", [True, False])
def test_gemma_sliding_window_restores_from_disk(
    gemma: str, tmp_path: Path, deterministic: bool
) -> None:
    _assert_restores(gemma, tmp_path / "cache", n_ctx=2048, deterministic=deterministic)


# ---------------------------------------------------------------- a hostile directory


def _split(path: Path) -> tuple[bytes, dict[str, Any], bytes, bytes]:
    """A cache file's magic, header, entries and state, as anyone who can read it sees."""
    blob = path.read_bytes()
    (n,) = struct.unpack_from("<I", blob, 8)
    header = json.loads(blob[12 : 12 + n])
    rest = blob[12 + n :]
    n_entries = 4 * header["n_entries"]
    return blob[:8], header, rest[:n_entries], rest[n_entries : n_entries + header["data"]]


def _only_file(cache: Path, before: set[Path]) -> Path:
    (path,) = set(cache.glob("*.llkv")) - before
    return path


def test_a_forged_file_does_not_change_the_answer(tiny_llama: str, tmp_path: Path) -> None:
    """Whoever can read a file can copy its header: a file claiming prompt P's tokens but
    holding prompt Q's state, with the digest recomputed, would answer P as if asked Q."""
    cache = tmp_path / "cache"
    asked = [PREAMBLE, HumanMessage("What is the capital of France?")]
    other = [PREAMBLE, HumanMessage("What is the capital of Italy? " + "Answer in one word. " * 4)]
    cold = _call(tiny_llama, asked, None, deterministic=True)
    _call(tiny_llama, asked, cache, deterministic=True)
    p_file = _only_file(cache, set())
    _call(tiny_llama, other, cache, deterministic=True)
    q_file = _only_file(cache, {p_file})
    magic, header, entries, _ = _split(p_file)
    *_, q_state = _split(q_file)
    header.update(data=len(q_state), checkpoints=[])
    head = json.dumps(header).encode()
    body = magic + struct.pack("<I", len(head)) + head + entries + q_state
    p_file.unlink()
    q_file.unlink()
    forged = cache / ("f" * 40 + ".llkv")
    forged.write_bytes(body + hashlib.blake2b(body, digest_size=32).digest())
    out = _call(tiny_llama, asked, cache, deterministic=True)
    assert_identical(out, cold)  # before: logprobs moved, e.g. -1.353 vs -1.415
    assert cached_tokens(out) == 0
    assert not forged.exists()


def test_a_directory_others_can_write_is_refused(tiny_llama: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    llm = ChatLlamaCpp(model_path=tiny_llama, prompt_cache_dir=str(shared), max_tokens=2)
    try:
        with pytest.raises(ValueError, match=r"writable by its group and all users") as err:
            llm.invoke("hi")
        assert str(shared) in str(err.value) and "chmod go-w" in str(err.value)
    finally:
        llm.close()
        registry.unload()


_HOSTILE = """
import json, os, sys
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_llamacpp_local import ChatLlamaCpp
os.umask(0)
path, cache_dir, question, preamble = sys.argv[1:5]
llm = ChatLlamaCpp(model_path=path, prompt_cache_dir=cache_dir, temperature=0, max_tokens=8,
                   logprobs=True, top_logprobs=2, deterministic=True)
for _ in range(3):  # each reply writes a file: the directory is scanned again
    out = llm.invoke([SystemMessage(preamble), HumanMessage(question)])
print(json.dumps({"content": out.content, "usage": out.usage_metadata,
                  "logprobs": out.response_metadata["logprobs"]["content"]}))
"""


def test_a_hostile_directory_neither_hangs_nor_fails_a_call(
    tiny_llama: str, tmp_path: Path
) -> None:
    """FIFOs (a reader blocks until a writer comes), a symlink to one, malformed files of
    this very key, a sparse 1 TiB file and the user's own files: the calls are served as
    a cold process serves them, files stay private, and the user's files stay."""
    cache = tmp_path / "cache"
    question = "What is the weather in Paris?"
    _process(tiny_llama, cache, question)
    (real,) = cache.glob("*.llkv")
    magic, header, entries, state = _split(real)
    rest = real.read_bytes()[12 + len(json.dumps(header).encode()) :]

    def plant(name: str, head: Any, tail: bytes = rest) -> Path:
        blob = json.dumps(head).encode()
        path = cache / name
        path.write_bytes(magic + struct.pack("<I", len(blob)) + blob + tail)
        return path

    for i, bad in enumerate(
        [
            {k: v for k, v in header.items() if k != "exact"},
            {**header, "exact": "all"},
            {**header, "n_entries": 2**40},
            {**header, "n_entries": 2**62},
            {**header, "exact": 1e400},
        ]
    ):
        plant(f"{i:040x}.llkv", bad)
    huge = plant("a" * 40 + ".llkv", {**header, "data": header["data"] + 2**40})
    with open(huge, "r+b") as f:
        f.truncate(huge.stat().st_size + 2**40)
    os.mkfifo(cache / ("b" * 40 + ".llkv"))
    os.symlink(cache / ("b" * 40 + ".llkv"), cache / ("c" * 40 + ".llkv"))
    old = time.time() - 7200
    for name in ("notes.tmp", "draft.llkv.tmp", "mine.llkv"):
        (cache / name).write_text("the user's")
        os.utime(cache / name, (old, old))
    real.unlink()  # the calls below must not be helped by the good file

    warm = _process(tiny_llama, cache, question, script=_HOSTILE, timeout=90)
    cold = _process(tiny_llama, None, question)
    assert warm["content"] == cold["content"] and warm["logprobs"] == cold["logprobs"]
    for name in ("notes.tmp", "draft.llkv.tmp", "mine.llkv"):
        assert (cache / name).read_text() == "the user's"
    assert not huge.exists() and not (cache / f"{0:040x}.llkv").exists()
    written = [p for p in cache.glob("*.llkv") if stat.S_ISREG(p.lstat().st_mode)]
    written.remove(cache / "mine.llkv")
    assert written and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in written)
