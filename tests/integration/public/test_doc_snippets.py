"""Every ```python block in README.md and docs/*.md runs as a reader would copy it.

Each snippet runs alone, in a fresh namespace, in a temporary working folder whose
``HOME`` is a temporary home. The model files the snippets name are there, as links to
the suite's test models (:data:`SUBSTITUTES` says which stands for which), so a snippet
runs unchanged: ``model.gguf`` is SmolLM2-135M-Instruct, a vision model is the tiny
llama with a tiny projector, a thinking model is a scripted model with the family's
chat template that prints a thought and an answer. ``~/models`` holds the models named
by name (docs/models.md, docs/lora.md).

A snippet that cannot run here (it needs a network, RPC servers, a GPU) carries a
marker on the line before its fence, ``<!-- snippet: skip (why) -->``, and is reported
as skipped with that reason. One that needs a newer LangChain than Python 3.10 can
install says so, ``<!-- snippet: requires langchain_core.decisions -->`` (modules or
``module.Name``, comma-separated), and is skipped only where that is missing. Any other
snippet that raises fails the test.
"""

from __future__ import annotations

import functools
import importlib
import io
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import smollm2_path
from tests.gguf_models import (
    write_tiny_audio_mmproj,
    write_tiny_bert,
    write_tiny_llama,
    write_tiny_lora,
    write_tiny_mmproj,
)
from tests.printing_model import write_printing_llama

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEMPLATES = ROOT / "tests" / "data" / "llama_cpp_templates"
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
SKIP = re.compile(r"<!--\s*snippet:\s*skip\s*\((.+)\)\s*-->")
REQUIRES = re.compile(r"<!--\s*snippet:\s*requires\s+(.+?)\s*-->")


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    code: str
    skip: str | None
    requires: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def snippets() -> list[Snippet]:
    """The python blocks of every page, with the skip reason of the line before each."""
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = SKIP.search(before)
            needs = REQUIRES.search(before)
            requires = tuple(x.strip() for x in needs.group(1).split(",")) if needs else ()
            line = text.count("\n", 0, m.start()) + 1
            name = str(page.relative_to(ROOT))
            out.append(Snippet(name, line, m.group(1), skip.group(1) if skip else None, requires))
    return out


def missing(spec: str) -> bool:
    """Whether ``spec`` (a module, or ``module.Name``) cannot be imported here."""
    try:
        importlib.import_module(spec)
    except ImportError:
        module, _, name = spec.rpartition(".")
        try:
            return not hasattr(importlib.import_module(module), name)
        except ImportError:
            return True
    return False


@functools.cache
def _dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="doc-snippet-models-"))


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


@functools.cache
def tiny_llama() -> str:
    return str(write_tiny_llama(_dir() / "tiny-llama.gguf"))


@functools.cache
def tiny_mmproj() -> str:
    return str(write_tiny_mmproj(_dir() / "tiny-mmproj.gguf", text_n_embd=64))


@functools.cache
def tiny_audio_mmproj() -> str:
    return str(write_tiny_audio_mmproj(_dir() / "tiny-audio-mmproj.gguf", text_n_embd=64))


@functools.cache
def question_wav() -> str:
    from tests.wav_files import pcm_wav, tone

    path = _dir() / "question.wav"
    path.write_bytes(pcm_wav(tone(1.5)))
    return str(path)


@functools.cache
def thinking_qwen3() -> str:
    """A Qwen3-templated model that thinks, then answers; its markers are single tokens,
    as Qwen3's are, so the thinking tokens are counted."""
    marks = ("<think>", " Two and two", " make four.", "</think>")
    path, _ = write_printing_llama(
        _dir() / "qwen3-thinking.gguf",
        "".join(marks) + "4",
        chat_template=_template("Qwen-Qwen3-0.6B.jinja"),
        size=64,
        cuts=marks,
    )
    return str(path)


@functools.cache
def thinking_gpt_oss() -> str:
    """A gpt-oss-templated model that writes an analysis, then its final answer."""
    text = (
        "<|channel|>analysis<|message|>Two and two make four.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>4"
    )
    path, _ = write_printing_llama(
        _dir() / "gpt-oss-thinking.gguf",
        text,
        chat_template=_template("openai-gpt-oss-120b.jinja"),
        cuts=("<|message|>", "<|end|>", "<|start|>", "<|channel|>"),
    )
    return str(path)


@functools.cache
def embedder() -> str:
    return str(write_tiny_bert(_dir() / "tiny-embedder.gguf"))


@functools.cache
def reranker() -> str:
    return str(write_tiny_bert(_dir() / "tiny-reranker.gguf", rerank=True))


@functools.cache
def lora(seed: int) -> str:
    return str(write_tiny_lora(_dir() / f"tiny-lora-{seed}.gguf", seed=seed))


@functools.cache
def photo() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(buf, format="PNG")
    path = _dir() / "photo.png"
    path.write_bytes(buf.getvalue())
    return str(path)


#: The files the snippets name, in the working folder, and the test model each stands for.
SUBSTITUTES: dict[str, Callable[[], str]] = {
    # instruct models: SmolLM2-135M-Instruct (ChatML, tool prompt)
    "model.gguf": smollm2_path,
    "SmolLM2-135M-Instruct.Q4_1.gguf": smollm2_path,
    "qwen2.5-1.5b-instruct-q4_k_m.gguf": smollm2_path,
    "qwen2.5-7b-instruct-q4_k_m.gguf": smollm2_path,
    # vision: the tiny llama and a tiny projector of its width
    "vision-model.gguf": tiny_llama,
    "mmproj.gguf": tiny_mmproj,
    "gemma-3-4b-it-q4_k_m.gguf": tiny_llama,
    "mmproj-gemma-3-4b.gguf": tiny_mmproj,
    "photo.png": photo,
    # audio: the tiny llama and a tiny Ultravox-style audio projector of its width
    "ultravox-v0_5-llama-3_2-1b-q4_k_m.gguf": tiny_llama,
    "mmproj-ultravox-v0_5-llama-3_2-1b-f16.gguf": tiny_audio_mmproj,
    "question.wav": question_wav,
    # a chat template file (docs/template-analysis.md): Qwen 2.5's, Hermes-style calls
    "chat_template.jinja": lambda: str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"),
    # thinking models: scripted, with the family's own template
    "gpt-oss-20b.gguf": thinking_gpt_oss,
    "Qwen3-8B-Q4_K_M.gguf": thinking_qwen3,
    # embeddings and reranking: tiny BERT encoders
    "nomic-embed-text-v1.5.Q8_0.gguf": embedder,
    "bge-reranker-v2-m3-Q8_0.gguf": reranker,
    # LoRA adapters of the tiny llama (docs/lora.md's base "qwen3" is the tiny llama)
    "sql-lora.gguf": lambda: lora(1),
    "router.gguf": lambda: lora(2),
}

#: Models named by name, in ``~/models`` (docs/models.md, docs/lora.md).
MODELS_DIR: dict[str, Callable[[], str]] = {
    "qwen3.gguf": tiny_llama,
    "qwen3-4b.gguf": smollm2_path,
    "gemma3.gguf": smollm2_path,
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working folder holding every substitute, and a home with ``~/models``."""
    base = tmp_path_factory.mktemp("doc-snippets")
    work = base / "work"
    models = base / "home" / "models"
    models.mkdir(parents=True)
    work.mkdir()
    for name, make in SUBSTITUTES.items():
        (work / name).symlink_to(make())
    for name, make in MODELS_DIR.items():
        (models / name).symlink_to(make())
    return work


@pytest.fixture
def in_workdir(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = workdir.parent / "home"
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("LLAMACPP_MODELS_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield workdir


ALL = snippets()


def test_the_pages_have_snippets() -> None:
    pages = {s.page for s in ALL}
    assert "README.md" in pages and len(ALL) >= 20, pages


@pytest.mark.smollm2
@pytest.mark.timeout(300)
@pytest.mark.parametrize("snippet", ALL, ids=[s.id for s in ALL])
def test_snippet_runs(snippet: Snippet, in_workdir: Path) -> None:
    if snippet.skip:
        pytest.skip(snippet.skip)
    absent = [spec for spec in snippet.requires if missing(spec)]
    if absent:
        pytest.skip(f"needs {', '.join(absent)}")
    code = compile(snippet.code, snippet.id, "exec")
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(code, namespace)  # noqa: S102 - the documentation's own code


def test_every_substitute_is_named_by_a_snippet() -> None:
    """The map holds no stale entry: each file it provides appears in some snippet."""
    text = "\n".join(s.code for s in ALL)
    unused = [n for n in [*SUBSTITUTES, *MODELS_DIR] if n.removesuffix(".gguf") not in text]
    assert not unused, unused


def test_markers_are_read() -> None:
    """The RPC snippet is skipped with its reason; the decision snippets name what they
    need, which this environment (langchain-core 1.8) has."""
    rpc = [s for s in ALL if s.page == "docs/distributed.md"]
    assert [s.skip for s in rpc] == ["needs RPC servers at 10.0.0.5 and 10.0.0.6"]
    decisions = [s for s in ALL if s.page == "docs/decisions.md"]
    assert all("langchain_core.decisions" in s.requires for s in decisions), decisions
    assert missing("langchain_core.no_such_module") and missing("json.no_such_name")
    assert not missing("langchain_core.messages.HumanMessage")
