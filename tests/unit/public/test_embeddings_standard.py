"""langchain-tests' standard embeddings unit suite: construction is cheap and loads nothing."""

from __future__ import annotations

from typing import Any

from langchain_tests.unit_tests import EmbeddingsUnitTests

from langchain_llamacpp_local import LlamaCppEmbeddings
from langchain_llamacpp_local.llama import model_handle
from langchain_llamacpp_local.runtime import registry
from tests.conftest import gemma_path


class TestLlamaCppEmbeddingsUnit(EmbeddingsUnitTests):
    @property
    def embeddings_class(self) -> type[LlamaCppEmbeddings]:
        return LlamaCppEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"model_path": gemma_path()}


def test_construction_loads_nothing() -> None:
    loads = model_handle.model_refcounts()
    LlamaCppEmbeddings(model_path=gemma_path(), dimensions=64)
    assert registry.loaded_models() == [] and model_handle.model_refcounts() == loads
