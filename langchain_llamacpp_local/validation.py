"""Checks of user-supplied settings, before anything reaches llama.cpp.

llama.cpp answers many bad values with a ``GGML_ASSERT`` (the process dies) or
silently with something else (``n_ctx=2**32+1`` wraps to 1). Everything here is a
pure function raising ``ValueError``/``TypeError`` whose message names the setting,
so it is testable without a model.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from langchain_llamacpp_local.cache.slot_memory import CacheOptions
from langchain_llamacpp_local.chat.request_options import (
    CALL_OPTIONS,
    ChatDefaults,
    CheckedCall,
    sampling_params,
    speculative_of,
)
from langchain_llamacpp_local.llama.json_grammar import (
    MAX_SCHEMA_NESTING,
    check_grammar,
    nesting_depth,
)
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.settings import check_int, check_load_settings
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.runtime.lora import parse_adapters, request_key
from langchain_llamacpp_local.runtime.scheduler import PRIORITIES

__all__ = [
    "check_call",
    "check_call_options",
    "check_chat_settings",
    "check_constructor_arguments",
    "check_dimensions",
    "check_encodable",
    "check_grammar_alone",
    "check_keep_alive_option",
    "check_max_loaded_models",
    "check_model_choice",
    "check_placement",
    "check_prompt_cache_dir",
    "check_retry_options",
    "check_text",
    "check_texts",
    "check_tool_nesting",
    "check_speculative",
    "check_timeout",
    "closest_name",
    "duration_seconds",
    "normalize_stop",
    "unknown_names_error",
]


#: Parameters of langchain-community's llama.cpp classes that are no field here, each
#: with what to use instead (docs/migration.md): spelling similarity would point them
#: at an unrelated field (``grammar_path`` is not ``mmproj_path``).
COMMUNITY_HINTS: dict[str, str] = {
    "grammar_path": "pass the grammar's text as grammar=..., or build one from a schema: "
    "use with_structured_output() or bind_tools(tool_choice=...)",
    "model_kwargs": "llama.cpp settings are fields of their own (n_ctx=, n_gpu_layers=, "
    "chat_template=, chat_template_kwargs=...)",
    "chat_format": "use chat_template= (the GGUF's own template is the default)",
    "chat_handler": "use chat_template= and mmproj_path= for vision models",
    "lora_path": "use lora_adapters={'name': path} (docs/lora.md)",
    "lora_base": "use lora_adapters={'name': path} (docs/lora.md)",
    "lora_scale": "use lora_adapters={'name': {'path': ..., 'scale': s}} (docs/lora.md)",
    "f16_kv": "use type_k=/type_v= ('f16' is the default)",
    "last_n_tokens_size": "use penalty_last_n=",
    "logits_all": "use logprobs=True (and top_logprobs=)",
    "n_parts": "no longer a llama.cpp setting",
    "vocab_only": "get_token_ids() reads only the vocabulary when the model is not loaded",
    "suffix": "not supported for chat",
    "echo": "not supported for chat",
    "client": "the instance loads and shares its model itself",
}

#: How alike (difflib's ratio) a name must be to a valid one to be suggested: typos
#: (``n_gpu_layer``, ``temprature``) are well above it, unrelated names sharing a
#: suffix (``model_kwargs``/``model_path``: 0.64) below.
SIMILARITY_CUTOFF = 0.75


def closest_name(name: str, valid: Iterable[str]) -> str | None:
    """The valid name ``name`` most likely misspells, if any is close."""
    matches = difflib.get_close_matches(name, list(valid), n=1, cutoff=SIMILARITY_CUTOFF)
    return matches[0] if matches else None


def unknown_names_error(unknown: Iterable[str], valid: Iterable[str], what: str) -> TypeError:
    """A ``TypeError`` listing ``unknown`` names, each with its closest valid one (or,
    for a langchain-community parameter, what replaces it)."""
    valid = sorted(set(valid))
    parts = []
    for name in sorted(unknown):
        hint = COMMUNITY_HINTS.get(name)
        guess = closest_name(name, valid)
        if hint is not None:
            parts.append(f"{name!r} ({hint})")
        elif guess:
            parts.append(f"{name!r} (did you mean {guess!r}?)")
        else:
            parts.append(repr(name))
    return TypeError(f"unexpected {what}: {', '.join(parts)}")


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


def check_timeout(value: Any) -> float | None:
    """``timeout``: None (no limit) or a finite number of seconds > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"timeout must be a finite number of seconds > 0 (None: no limit), got {value!r}"
        )
    return float(value)


def check_priority(value: Any) -> None:
    """``priority``: "interactive" or "background"."""
    if value not in PRIORITIES:
        raise ValueError(f"priority must be one of {list(PRIORITIES)}, got {value!r}")


def check_stall_budget(value: Any) -> None:
    """``stall_budget_ms``: None (off) or a finite number of milliseconds > 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"stall_budget_ms must be a number of milliseconds or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"stall_budget_ms must be a finite number of milliseconds > 0 (None: off), "
            f"got {value!r}"
        )


def check_max_tokens(value: Any) -> int | None:
    """``max_tokens``: None (until the model stops or the context is full) or an int > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_tokens must be a positive integer or None, got {value!r}")
    if value <= 0:
        raise ValueError(f"max_tokens must be positive or None, got {value}")
    return value


def normalize_stop(value: Any, name: str = "stop") -> list[str]:
    """Stop strings as a list: a single string is one stop string (not its characters)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a string or a list of strings, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{name} must hold strings only, got {item!r}")
    return [v for v in value if v]


def check_tool_nesting(index: int, tool: Mapping[str, Any]) -> None:
    """Refuse a tool nested deeper than a schema may be (:data:`MAX_SCHEMA_NESTING`).

    Every way a tool reaches the model (its description written into the prompt,
    the template given a copy, the grammar of its call) walks the schema recursively;
    a schema nested past that limit would fail in one of them with a bare
    ``RecursionError``, so it is refused up front, naming its depth.
    """
    fn = tool.get("function")
    wrapped = isinstance(fn, Mapping)  # {"type": "function", "function": {..., "parameters"}}
    depth = nesting_depth(tool) - (2 if wrapped else 1)  # the schema's own depth
    if depth > MAX_SCHEMA_NESTING:
        name = fn.get("name") if wrapped else tool.get("name")
        raise ValueError(
            f"the schema of tools[{index}] ({name!r}) nests {depth} objects/arrays deep, "
            f"more than the {MAX_SCHEMA_NESTING} allowed (each schema level is about two: "
            "'properties' and the property's schema)"
        )


def check_budget_message(value: Any) -> None:
    """``reasoning_budget_message``: None or text that has a UTF-8 form (it is
    tokenized as plain text, written into the reply's thinking block)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(
            f"reasoning_budget_message must be a string, got {type(value).__name__} {value!r}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"reasoning_budget_message is not valid Unicode: character {exc.start} is "
            f"{value[exc.start]!r} ({exc.reason})"
        ) from None


def check_call_options(kwargs: Mapping[str, Any]) -> None:
    """Type checks of per-call options whose wrong types would fail obscurely later."""
    tools = kwargs.get("tools")
    if tools is not None:
        if not isinstance(tools, (list, tuple)):
            raise TypeError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise TypeError(
                    f"tools[{i}] must be a dict (bind_tools converts tools), got "
                    f"{type(tool).__name__}"
                )
            check_tool_nesting(i, tool)
    rf = kwargs.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise TypeError(
            "response_format must be a dict such as {'type': 'json_object'}, got "
            f"{type(rf).__name__}"
        )
    ctk = kwargs.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(ctk).__name__}")
    top = kwargs.get("top_logprobs")
    if top is not None:
        check_int("top_logprobs", top, lo=0, hi=100)
    check_logprobs_flag(kwargs.get("logprobs"))
    for name in ("logprobs", "cache_prompt", "parallel_tool_calls", "stream_tool_args"):
        value = kwargs.get(name)
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    tmpl = kwargs.get("chat_template")
    if tmpl is not None and not isinstance(tmpl, str):
        raise TypeError(f"chat_template must be a string, got {type(tmpl).__name__}")
    if "priority" in kwargs:
        check_priority(kwargs["priority"])
    if "stall_budget_ms" in kwargs:
        check_stall_budget(kwargs["stall_budget_ms"])


def check_grammar_alone(grammar: Any, options: Mapping[str, Any]) -> None:
    """A user's ``grammar`` is the whole constraint: tools and ``response_format``
    build a grammar of their own, and one reply cannot follow two."""
    if grammar is None:
        return
    if not isinstance(grammar, str):
        raise TypeError(f"grammar must be a GBNF string or None, got {type(grammar).__name__}")
    check_grammar(grammar)  # size and nesting; llama.cpp parses it when the call runs
    clash = [name for name in ("tools", "response_format") if options.get(name)]
    if clash:
        raise ValueError(
            f"grammar cannot be combined with {' or '.join(clash)}: they constrain the "
            "reply with a grammar of their own (drop grammar=, or the tools / "
            "structured output)"
        )


def check_logprobs_flag(value: Any) -> None:
    """``logprobs`` is a switch; a count (``logprobs=5``, the legacy completions API's
    form) means ``top_logprobs``, so the error says so."""
    if isinstance(value, int) and not isinstance(value, bool):
        raise TypeError(
            f"logprobs must be True or False, got {value!r}; for the {value} most likely "
            f"alternatives of each token pass logprobs=True, top_logprobs={value}"
        )


def check_call(
    kwargs: dict[str, Any], stop: list[str] | None, defaults: ChatDefaults
) -> CheckedCall:
    """Every check of one chat call's options, before anything runs: unknown names,
    types, a grammar beside tools, ``tool_choice``, stop strings, limits, speculation
    and LoRA names and scales
    (the caller's errors, raised in that order). The model's fields fill what the call
    leaves out; they were checked at construction."""
    unknown = set(kwargs) - CALL_OPTIONS
    if unknown:
        raise unknown_names_error(unknown, CALL_OPTIONS, "keyword arguments for ChatLlamaCpp")
    options = {k: v for k, v in kwargs.items() if k != "ls_structured_output_format"}
    check_call_options(options)
    check_grammar_alone(options.get("grammar", defaults.grammar), options)
    if options.get("tool_choice") is not None:
        from langchain_llamacpp_local.chat.prompts import check_tool_choice

        check_tool_choice(options["tool_choice"], options.get("tools"))
    stops = normalize_stop(stop if stop is not None else defaults.stop)
    timeout = check_timeout(options.get("timeout", defaults.timeout))
    max_tokens = check_max_tokens(options.get("max_tokens", defaults.max_tokens))
    check_budget_message(options.get("reasoning_budget_message", defaults.reasoning_budget_message))
    speculative, max_draft = speculative_of(defaults, options)
    check_speculative(speculative, max_draft, draft_model=defaults.draft_model_path)
    specs = parse_adapters(defaults.lora_adapters)
    requested = options.get("lora", defaults.lora)
    return CheckedCall(
        options=options,
        stop=stops,
        timeout=timeout,
        max_tokens=max_tokens,
        speculative=speculative,
        speculative_max_draft=max_draft,
        lora=request_key(specs, requested) if specs or requested else None,
    )


#: Speculative decoding kinds (``ChatLlamaCpp.speculative``).
SPECULATIVE_KINDS = ("ngram", "draft")
#: Most draft tokens one verify step may carry (llama.cpp's server allows 16 by default).
MAX_DRAFT = 64


def check_speculative(kind: Any, max_draft: Any, *, draft_model: str | None) -> None:
    """``speculative``/``speculative_max_draft`` (constructor or per call)."""
    if kind is not None and kind not in SPECULATIVE_KINDS:
        raise ValueError(
            f"speculative={kind!r} is not a speculative decoding kind; use one of "
            f"{list(SPECULATIVE_KINDS)} or None"
        )
    if kind == "draft" and not draft_model:
        raise ValueError('speculative="draft" needs draft_model_path=... (a small GGUF)')
    check_int("speculative_max_draft", max_draft, lo=1, hi=MAX_DRAFT)


def check_constructor_arguments(cls: Any, data: dict[str, Any], what: str) -> dict[str, Any]:
    """Refuse unknown constructor arguments (naming the closest field) and booleans
    given for numbers (``max_tokens=True`` would silently mean 1); a single ``stop``
    string is one stop string."""
    check_argument_names(cls, data, what)
    if "logprobs" in cls.model_fields:
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
    sampling and the loaded-model limit."""
    check_load_settings(load_settings(model))
    check_max_tokens(model.max_tokens)
    check_timeout(model.timeout)
    check_call_options(
        {
            "top_logprobs": model.top_logprobs,
            "logprobs": model.logprobs,
            "priority": model.priority,
            "stall_budget_ms": model.stall_budget_ms,
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
