"""Integration tests: every test here drives real llama.cpp on a loaded model, so each
carries the ``model`` marker (added in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gguf_models import write_tiny_llama
from tests.sampling_support import TinyModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyModel]:
    """The tiny llama loaded bare, to sample under grammars without a worker."""
    m = TinyModel(write_tiny_llama(tmp_path_factory.mktemp("sampling") / "tiny.gguf"))
    yield m
    m.close()
