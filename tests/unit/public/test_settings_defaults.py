"""One source per setting: the public classes share one settings base and take their
defaults from the settings dataclasses they fill, so a default cannot drift."""

from __future__ import annotations

import dataclasses

import pytest

from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings, LlamaCppRerank
from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.chat.request_options import CALL_OPTIONS, SAMPLING_OPTIONS
from langchain_llamacpp_local.llama.embedding import EmbeddingConfig
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.settings_base import ModelSettings, settings_from

#: Fields whose public meaning differs from the config field of the same name.
_DIFFERENT = {
    "n_slots",
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


def test_call_options_are_named_by_the_settings_they_fill() -> None:
    """What a call may override is what the sampler and the job take: a new
    SamplingParams or ChatJob field is a call option without being listed again, and
    each sampling field is a model field under the same name."""
    sampling = {f.name for f in dataclasses.fields(SamplingParams)} - {
        "grammar_lazy_triggers",  # the prompt's (lazy tool-call grammars), never a setting
    }
    assert set(SAMPLING_OPTIONS) == sampling
    assert sampling <= set(ChatLlamaCpp.model_fields)
    job_state = {"messages", "sampling", "max_tokens_default", "stop", "deadline", "cancel"}
    job_state |= {"reuse_owner"}  # the model instance's, never a call's
    job_options = {f.name for f in dataclasses.fields(ChatJob)} - job_state
    assert sampling | job_options <= CALL_OPTIONS
    # identifying params carry the sampling fields, whatever their order
    llm = ChatLlamaCpp(model_path="m.gguf", temperature=0.25, top_k=7)
    params = llm._identifying_params
    assert {k: params[k] for k in sampling} == {k: getattr(llm, k) for k in sampling}


def test_the_chat_model_takes_its_lifecycle_from_the_base() -> None:
    for name in ("__enter__", "__exit__"):
        assert name not in vars(ChatLlamaCpp), name
        assert getattr(ChatLlamaCpp, name) is getattr(ModelSettings, name)


def test_settings_from_fills_a_dataclass_from_the_fields_of_its_names() -> None:
    llm = ChatLlamaCpp(
        model_path="m.gguf", n_ctx=64, n_batch=32, flash_attn=True, checkpoint_min_step=9
    )
    load = settings_from(llm, LoadConfig, model_path="/m.gguf", n_slots=1)
    assert (load.model_path, load.n_slots, llm.n_slots) == ("/m.gguf", 1, 4)  # overrides win
    assert (load.n_ctx, load.n_batch, load.flash_attn) == (64, 32, True)
    assert settings_from(llm, CacheOptions).checkpoint_min_step == 9
    emb = LlamaCppEmbeddings(model_path="e.gguf", n_ctx=128, pooling="cls")
    config = settings_from(emb, EmbeddingConfig, model_path="e.gguf", pooling="mean")
    assert (config.n_ctx, config.pooling) == (128, "mean")
    # a config field that is no model field keeps the config's own default
    assert config.fast_pooling == EmbeddingConfig.fast_pooling
