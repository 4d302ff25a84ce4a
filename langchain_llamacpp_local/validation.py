"""Checks of user-supplied settings, before anything reaches llama.cpp.

llama.cpp answers many bad values with a ``GGML_ASSERT`` (the process dies) or
silently with something else (``n_ctx=2**32+1`` wraps to 1). Everything here is a
pure function raising ``ValueError``/``TypeError`` whose message names the setting,
so it is testable without a model.

This module checks what the public classes are given (constructor arguments, texts,
placement, durations); a check lives with what it checks elsewhere: a call's options in
:mod:`.chat.request_options`, load settings in :mod:`.llama.settings`, LoRA adapters in
:mod:`.runtime.lora`, RPC endpoints in :mod:`.llama.rpc`. Importing it loads no chat code.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.errors import unknown_names_error
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.settings import check_load_settings
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.runtime.lora import parse_adapters, request_key

__all__ = [
    "check_chat_settings",
    "check_constructor_arguments",
    "check_dimensions",
    "check_encodable",
    "check_keep_alive_option",
    "check_max_loaded_models",
    "check_model_choice",
    "check_placement",
    "check_prompt_cache_dir",
    "check_retry_options",
    "check_text",
    "check_texts",
    "duration_seconds",
]


def check_argument_names(cls: Any, data: Any, what: str) -> None:
    """Refuse constructor arguments that are no field of the pydantic model ``cls``,
    naming the closest field (``n_gpu_layer=10`` must not be silently ignored)."""
    if not isinstance(data, dict):
        return
    valid: set[str] = set()
    for name, field in cls.model_fields.items():
        valid.add(name)
        if field.alias:
            valid.add(field.alias)
    unknown = [k for k in data if k not in valid]
    if unknown:
        raise unknown_names_error(unknown, valid, f"arguments for {what}")


def check_constructor_arguments(cls: Any, data: dict[str, Any], what: str) -> dict[str, Any]:
    """Refuse unknown constructor arguments (naming the closest field) and booleans
    given for numbers (``max_tokens=True`` would silently mean 1); a single ``stop``
    string is one stop string."""
    check_argument_names(cls, data, what)
    if "logprobs" in cls.model_fields:  # the chat model's (its call options' check)
        from langchain_llamacpp_local.chat.request_options import check_logprobs_flag

        check_logprobs_flag(data.get("logprobs"))
    for name, value in data.items():
        field = cls.model_fields.get(name)
        if field is None or not isinstance(value, bool):
            continue
        if field.annotation is not None and _is_number_annotation(field.annotation):
            raise TypeError(f"{name} must be a number, got {value!r}")
    if isinstance(data.get("stop"), str):
        data = {**data, "stop": [data["stop"]]}
    return data


def _is_number_annotation(annotation: Any) -> bool:
    args = getattr(annotation, "__args__", None) or (annotation,)
    return bool not in args and any(a in (int, float) for a in args)


def check_placement(
    rpc_servers: Sequence[str] | None,
    tensor_split: Sequence[float] | None,
    *,
    no_gpu_layers_asked: bool,
) -> None:
    """RPC/split settings llama.cpp would ignore or abort on (``no_gpu_layers_asked``:
    the caller passed ``n_gpu_layers=0``, which would leave the RPC devices unused)."""
    from langchain_llamacpp_local.llama.rpc import parse_endpoint, rpc_unavailable_reason

    if rpc_servers is not None:
        if not rpc_servers:
            raise ValueError("rpc_servers is empty; leave it None to run on this machine")
        endpoints = [parse_endpoint(e) for e in rpc_servers]
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"rpc_servers lists an endpoint twice: {rpc_servers}")
        reason = rpc_unavailable_reason()
        if reason:
            raise ValueError(f"rpc_servers needs llama.cpp's RPC backend: {reason}")
        if no_gpu_layers_asked:
            raise ValueError(
                "n_gpu_layers=0 keeps every layer on this machine, so rpc_servers would "
                "be unused; leave n_gpu_layers unset (all layers) or give a count"
            )
    if tensor_split is not None:
        if not tensor_split or any(not v >= 0 for v in tensor_split):
            raise ValueError("tensor_split needs one non-negative proportion per device")
        if sum(tensor_split) <= 0:
            raise ValueError("tensor_split proportions must not all be zero")


def check_max_loaded_models(value: int | None) -> None:
    """``max_loaded_models``: None (the default) or at least 1."""
    if value is not None and value < 1:
        raise ValueError("max_loaded_models must be at least 1 (or None for the default)")


def check_cache_miss_warning_tokens(value: int | None) -> None:
    """``cache_miss_warning_tokens``: None (off) or at least 0."""
    if value is not None and value < 0:
        raise ValueError("cache_miss_warning_tokens must be at least 0 (or None: no warning)")


def check_encodable(text: str, what: str) -> str:
    """``text`` if it is valid Unicode; else a ValueError naming the text and character
    (a lone surrogate, e.g. from a badly decoded file, has no UTF-8 form)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode: character {exc.start} is "
            f"{text[exc.start]!r} ({exc.reason}); a lone surrogate cannot be embedded"
        ) from None
    return text


def check_texts(texts: object, what: str = "texts") -> list[str]:
    """``texts`` as a list of strings, or a ``TypeError`` naming the first bad item."""
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{what} must be a list of strings, got {type(texts).__name__}")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"{what}[{i}] must be a string, got {type(t).__name__}")
    return list(texts)


def check_text(value: object, what: str = "text") -> str:
    """``value`` if it is a string, else a ``TypeError`` naming it."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__}")
    return value


def check_dimensions(dimensions: int | None, n_embd: int) -> None:
    """``dimensions`` (Matryoshka truncation; pydantic checked it is > 0) within the
    loaded model's ``n_embd`` values."""
    if dimensions is not None and dimensions > n_embd:
        raise ValueError(f"dimensions={dimensions} exceeds the model's {n_embd} dimensions")


def check_retry_options(max_retries: Any, on_failure: Any) -> None:
    """``RetryInvalidToolCalls``' arguments."""
    if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
        raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
    if on_failure not in ("error", "end"):
        raise ValueError(f"on_failure must be 'error' or 'end', got {on_failure!r}")


# --------------------------------------------------------------------------- models

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def duration_seconds(value: Any) -> Any:
    """``keep_alive`` as seconds: a number, or an Ollama-style ``"30s"``/``"5m"``/``"1h"``."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be seconds or a duration like '5m', not {value!r}")
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m is None:
            raise ValueError(f"keep_alive must be seconds or a duration like '5m', not {value!r}")
        return registry.keep_alive_seconds(float(m.group(1)) * _UNIT_SECONDS[m.group(2)])
    if isinstance(value, (int, float)):
        return registry.keep_alive_seconds(value)  # nan refused; inf or past ten years: forever
    return value


def check_keep_alive_option(kwargs: Mapping[str, Any]) -> float | None:
    """A call's ``keep_alive=`` in seconds (None: the model's field)."""
    if "keep_alive" not in kwargs or kwargs["keep_alive"] is None:
        return None
    value = duration_seconds(kwargs["keep_alive"])
    if not isinstance(value, (int, float)):
        raise TypeError(f"keep_alive must be seconds or a duration like '5m', not {value!r}")
    return float(value)


def check_model_choice(model: str | None, model_path: str | None, *, has_model_name: bool) -> None:
    """Exactly one of ``model=`` and ``model_path=`` (``has_model_name``: the class has
    ``model_name=``, which is what a caller passing both usually meant)."""
    if model is None and model_path is None:
        raise ValueError(
            "pass model= (a GGUF path, a name in models_dir or a Hugging Face "
            "owner/repo[:QUANT]) or model_path="
        )
    if model is not None and model_path is not None:
        raise ValueError(
            "pass model= or model_path=, not both"
            + (" (model_name= sets the reported name)" if has_model_name else "")
        )


def check_prompt_cache_dir(value: str | None) -> str | None:
    """The prompt cache's directory as an absolute path: ``value``, else the
    ``LLAMACPP_PROMPT_CACHE_DIR`` environment variable, else None (off); a path that
    cannot be expanded or is no directory is an error naming where it came from."""
    from langchain_llamacpp_local.cache.disk import ENV_DIR

    raw = value or os.environ.get(ENV_DIR) or None
    if raw is None:
        return None
    setting = "prompt_cache_dir" if value else ENV_DIR
    try:
        path = Path(raw).expanduser()
    except RuntimeError as exc:  # "~user" of no such user, or no home directory
        raise ValueError(f"{setting}={str(raw)!r}: cannot expand '~': {exc}") from None
    if path.exists() and not path.is_dir():
        raise ValueError(f"{setting}={str(raw)!r} exists and is not a directory")
    return str(path.absolute())


def load_settings(model: Any) -> dict[str, Any]:
    """A chat model's load and cache settings by name (the fields named as
    :class:`LoadConfig`'s and :class:`CacheOptions`' fields, and ``n_slots``)."""
    fields = type(model).model_fields
    names = [
        f.name
        for config in (LoadConfig, CacheOptions)
        for f in dataclasses.fields(config)
        if f.name in fields
    ]
    return {**{name: getattr(model, name) for name in names}, "n_slots": model.n_slots}


def check_chat_settings(model: Any) -> None:
    """Every check of a ``ChatLlamaCpp``'s fields that pydantic's types do not make:
    load settings, limits, logprobs, speculation, placement, LoRA names and scales,
    sampling and the loaded-model limit. (The call options' checks are the chat
    layer's, imported here: importing this module loads no chat code.)"""
    from langchain_llamacpp_local.chat.request_options import (
        check_call_options,
        check_grammar_alone,
        check_max_tokens,
        check_speculative,
        check_timeout,
        sampling_params,
    )

    check_load_settings(load_settings(model))
    check_max_tokens(model.max_tokens)
    check_timeout(model.timeout)
    check_call_options(
        {
            "top_logprobs": model.top_logprobs,
            "logprobs": model.logprobs,
            "priority": model.priority,
            "stall_budget_ms": model.stall_budget_ms,
            "cache_reuse": model.cache_reuse,
        }
    )
    check_speculative(
        model.speculative, model.speculative_max_draft, draft_model=model.draft_model_path
    )
    check_placement(
        model.rpc_servers,
        model.tensor_split,
        no_gpu_layers_asked="n_gpu_layers" in model.model_fields_set and model.n_gpu_layers == 0,
    )
    request_key(parse_adapters(model.lora_adapters), model.lora)  # names and scales
    sampling_params(model)  # SamplingParams checks its values
    check_grammar_alone(model.grammar, {})
    check_max_loaded_models(model.max_loaded_models)
    check_cache_miss_warning_tokens(model.cache_miss_warning_tokens)
