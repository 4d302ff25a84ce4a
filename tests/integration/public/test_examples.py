"""Every script in examples/ runs, on its default model, and prints what it promises.

Each runs as a user runs it (``python examples/NAME.py``) in a subprocess, with
``LLAMACPP_EXAMPLE_MAX_TOKENS`` capping its replies so the suite stays quick.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.gguf_models import write_tiny_mmproj

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))

pytestmark = [pytest.mark.examples, pytest.mark.smollm2]


def run_example(name: str, *args: str, max_tokens: int = 16) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "LLAMACPP_EXAMPLE_MAX_TOKENS": str(max_tokens),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_every_example_has_a_test() -> None:
    tested = {n[len("test_") :] + ".py" for n in globals() if n.startswith("test_")}
    assert set(EXAMPLES) <= tested, set(EXAMPLES) - tested


def test_streaming_chat(smollm2: str) -> None:
    out = run_example("streaming_chat.py")
    turns = re.findall(
        r"\[turn (\d)\] user: .*\nassistant: (.+)\n  -> prompt (\d+) tokens, (\d+) from the KV "
        r"cache, (\d+) decoded; (\d+) generated",
        out,
    )
    assert [t[0] for t in turns] == ["1", "2", "3", "4"], out
    for i, (_, reply, prompt, cached, decoded, generated) in enumerate(turns):
        assert reply.strip() and "<|im_" not in reply  # an answer, no template markup
        assert int(prompt) == int(cached) + int(decoded) and 0 < int(generated) <= 16
        assert (int(cached) > 0) == (i > 0)  # each turn reuses the conversation so far


def test_async_chat(smollm2: str) -> None:
    out = run_example("async_chat.py")
    assert re.search(r"^\[a\] ", out, re.M) and re.search(r"^\[b\] ", out, re.M)
    a = re.search(r"\nA: (.+) \nB: (.+)\n", out)
    assert a and a.group(1).strip() and a.group(2).strip(), out
    assert "cancelled after 0.5 s; the model is free again:" in out


def test_langgraph_chat(smollm2: str) -> None:
    out = run_example("langgraph_chat.py")
    assert re.search(r"^PRO: \S", out, re.M) and re.search(r"^CON: \S", out, re.M), out


def test_structured_extraction(smollm2: str) -> None:
    out = run_example("structured_extraction.py", max_tokens=48)
    for method in ("json_schema", "function_calling"):
        m = re.search(rf"{method}: Person\(name='([^']+)', age=(\d+), city='([^']+)'\)", out)
        assert m, out


def test_retrieval_qa(smollm2: str) -> None:
    out = run_example("retrieval_qa.py")
    retrieved = re.findall(r"^retrieved: (.+)$", out, re.M)
    assert len(retrieved) == 2 and all(r.rstrip() in _notes() for r in retrieved), out
    assert re.search(r"^answer: \S", out, re.M), out


def test_agent_with_tools(smollm2: str) -> None:
    """One tool call, its result, then the answer tool: no GraphRecursionError."""
    out = run_example("agent_with_tools.py", max_tokens=64)
    lines = out.splitlines()
    assert lines[0].startswith("human: What is the weather in Paris?"), out
    assert "'name': 'get_weather'" in lines[1] and lines[2].startswith(" tool: It is 18"), out
    assert "'name': 'Answer'" in lines[3], out
    assert re.search(r"^structured response: answer='.+'$", out, re.M), out


@pytest.mark.parametrize("max_tokens", [4, 128])
def test_image_question(tiny_llama: str, tmp_path: Path, max_tokens: int) -> None:
    """Needs a vision model: the tiny one (random weights) checks the plumbing. Its
    128-token reply holds ``<s>`` look-alikes, which the follow-up sends back beside
    the image as plain text."""
    mmproj = write_tiny_mmproj(tmp_path / "mmproj.gguf", text_n_embd=64)
    image = tmp_path / "red.png"
    Image.new("RGB", (32, 32), (200, 30, 30)).save(image)
    out = run_example(
        "image_question.py", tiny_llama, str(mmproj), str(image), max_tokens=max_tokens
    )
    usage = re.findall(r"\(prompt (\d+) tokens, (\d+) from the cache\)", out)
    assert len(usage) == 2 and out.count("assistant: ") == 2, out
    (p1, c1), (p2, c2) = ((int(a), int(b)) for a, b in usage)
    assert c1 == 0 and p2 > p1 and 0 < c2 < p2  # the follow-up reuses the cached prompt


def _notes() -> set[str]:
    src = (ROOT / "examples" / "retrieval_qa.py").read_text()
    return set(re.findall(r'^    "(.+)",$', src, re.M))
