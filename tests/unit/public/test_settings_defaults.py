"""One source per setting: the public classes share one settings base and take their
defaults from the settings dataclasses they fill, so a default cannot drift."""

from __future__ import annotations

import dataclasses

import pytest

from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings, LlamaCppRerank
from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.llama.embedding import EmbeddingConfig
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.settings_base import ModelSettings

#: Fields whose public meaning differs from the config field of the same name.
_DIFFERENT = {
    "n_seq_max",
    "kv_unified",
    "model_path",
    "pooling",
    "rpc_servers",  # a list field, a tuple in the config
    "tensor_split",
    "lora_adapters",
    "max_tokens",  # the job is given the field's value or the call's
}


@pytest.mark.parametrize("cls", [ChatLlamaCpp, LlamaCppEmbeddings, LlamaCppRerank])
def test_the_three_classes_share_one_settings_base(cls: type) -> None:
    assert issubclass(cls, ModelSettings)
    for name in ("model", "model_path", "keep_alive", "n_gpu_layers", "use_mmap", "cpu_amx"):
        assert name in cls.model_fields


def test_embeddings_and_rerank_declare_no_shared_field_themselves() -> None:
    shared = set(LlamaCppEmbeddings.model_fields) & set(LlamaCppRerank.model_fields)
    own = {"truncate"}  # documented per class: a text, or a document beside its query
    for cls in (LlamaCppEmbeddings, LlamaCppRerank):
        declared = set(vars(cls).get("__annotations__", {}))
        assert declared & shared <= own, cls.__name__
        assert "_engine_config" not in vars(cls), "the context's config is built in one place"


@pytest.mark.parametrize(
    ("cls", "configs"),
    [
        (ChatLlamaCpp, (LoadConfig, SamplingParams, CacheOptions, ChatJob)),
        (LlamaCppEmbeddings, (EmbeddingConfig,)),
        (LlamaCppRerank, (EmbeddingConfig,)),
    ],
)
def test_public_defaults_are_the_settings_dataclasses_defaults(
    cls: type, configs: tuple[type, ...]
) -> None:
    checked = 0
    for config in configs:
        for f in dataclasses.fields(config):
            if f.name in _DIFFERENT or f.name not in cls.model_fields:
                continue
            if f.default is dataclasses.MISSING:
                continue
            assert cls.model_fields[f.name].default == f.default, f"{cls.__name__}.{f.name}"
            checked += 1
    assert checked >= 5
