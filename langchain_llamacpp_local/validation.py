"""Checks of user-supplied settings, before anything reaches llama.cpp.

llama.cpp answers many bad values with a ``GGML_ASSERT`` (the process dies) or
silently with something else (``n_ctx=2**32+1`` wraps to 1). Everything here is a
pure function raising ``ValueError``/``TypeError`` whose message names the setting,
so it is testable without a model.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "MAX_THREADS",
    "check_call_options",
    "check_load_settings",
    "check_speculative",
    "check_timeout",
    "closest_name",
    "keep_alive_seconds",
    "normalize_stop",
    "unknown_names_error",
]

#: llama.cpp's GGML_MAX_N_THREADS.
MAX_THREADS = 512
#: llama.cpp's LLAMA_MAX_SEQ.
MAX_SEQ = 256
#: Positions are int32 in llama.cpp (``llama_pos``).
_INT32_MAX = 2**31 - 1


#: ``keep_alive`` past this (ten years, or ``inf``) means "forever", as a negative value
#: does: a timestamp that far away overflows the clock functions that wait for it.
MAX_KEEP_ALIVE = 10 * 365 * 24 * 3600.0


def keep_alive_seconds(value: float) -> float:
    """``keep_alive`` seconds bounded: negative, ``inf`` or past :data:`MAX_KEEP_ALIVE`
    mean "stay loaded" (-1.0); ``nan`` is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"keep_alive must be seconds or a duration like '5m', not {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int too large for a float: as good as forever
        return -1.0
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number of seconds, not nan")
    if seconds < 0 or seconds > MAX_KEEP_ALIVE:
        return -1.0
    return seconds


def closest_name(name: str, valid: Iterable[str]) -> str | None:
    """The valid name ``name`` most likely misspells, if any is close."""
    matches = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_names_error(unknown: Iterable[str], valid: Iterable[str], what: str) -> TypeError:
    """A ``TypeError`` listing ``unknown`` names, each with its closest valid one."""
    valid = sorted(set(valid))
    parts = []
    for name in sorted(unknown):
        guess = closest_name(name, valid)
        parts.append(f"{name!r} (did you mean {guess!r}?)" if guess else repr(name))
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


def _int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def _finite(name: str, value: Any, *, lo: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return float(value)


def check_load_settings(s: Mapping[str, Any]) -> None:
    """Validate the load settings of a ``ChatLlamaCpp`` (or ``LoadConfig``) by name.

    The rules are llama.cpp's own limits, which it enforces by aborting: the
    worst-case graph it reserves at context creation has one output per sequence,
    so ``n_batch`` (after the ``min(n_batch, n_ctx)`` clamp) and ``n_ubatch`` must
    hold ``n_slots`` tokens; ``n_ctx`` is a ``uint32`` and positions are ``int32``.
    """
    n_slots = _int("n_slots", s.get("n_slots", 1), lo=1, hi=MAX_SEQ)
    n_ctx = s.get("n_ctx")
    if n_ctx is not None:
        _int("n_ctx", n_ctx, hi=_INT32_MAX)
        if n_ctx < max(n_slots, 1):
            raise ValueError(
                f"n_ctx must be at least n_slots={n_slots} (llama.cpp needs room for one "
                f"token per slot), got {n_ctx}"
            )
    n_batch = _int("n_batch", s.get("n_batch", 512), lo=1, hi=_INT32_MAX)
    if n_batch < n_slots:
        raise ValueError(
            f"n_batch={n_batch} is smaller than n_slots={n_slots}: a batch must hold one "
            "token of every slot (raise n_batch or lower n_slots)"
        )
    n_ubatch = s.get("n_ubatch")
    if n_ubatch is not None:
        _int("n_ubatch", n_ubatch, lo=1, hi=_INT32_MAX)
        if n_ubatch < n_slots:
            raise ValueError(
                f"n_ubatch={n_ubatch} is smaller than n_slots={n_slots}: a micro-batch "
                "must hold one token of every slot"
            )
    for name in ("n_threads", "n_threads_batch"):
        if s.get(name) is not None:
            _int(name, s[name], lo=1, hi=MAX_THREADS)
    _int("n_gpu_layers", s.get("n_gpu_layers", 0), lo=-1, hi=_INT32_MAX)
    for name in ("rope_freq_base", "rope_freq_scale"):
        _finite(name, s.get(name, 0.0), lo=0.0)
    for name in ("image_min_tokens", "image_max_tokens"):
        if s.get(name) is not None:
            _int(name, s[name], lo=1, hi=_INT32_MAX)
    lo_img, hi_img = s.get("image_min_tokens"), s.get("image_max_tokens")
    if lo_img is not None and hi_img is not None and lo_img > hi_img:
        raise ValueError(f"image_min_tokens={lo_img} is above image_max_tokens={hi_img}")
    for name in ("type_k", "type_v"):
        value = s.get(name)
        if value is not None:
            from langchain_llamacpp_local.llama.engine import KV_TYPES

            if not isinstance(value, str) or value.lower() not in KV_TYPES:
                raise ValueError(
                    f"{name}={value!r} is not a KV cache type; use one of {sorted(KV_TYPES)}"
                )
    cpu_amx = s.get("cpu_amx")
    if cpu_amx is not None and not isinstance(cpu_amx, bool):
        raise TypeError(f"cpu_amx must be True, False or None, got {cpu_amx!r}")
    for name in (
        "prompt_cache_bytes",
        "prompt_cache_dir_bytes",
        "checkpoint_max_count",
        "checkpoint_max_bytes",
    ):
        if name in s:
            _int(name, s[name], lo=0)
    if "checkpoint_min_step" in s:
        _int("checkpoint_min_step", s["checkpoint_min_step"], lo=1)


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
        _int("top_logprobs", top, lo=0, hi=100)
    for name in ("logprobs", "cache_prompt", "parallel_tool_calls"):
        value = kwargs.get(name)
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    tmpl = kwargs.get("chat_template")
    if tmpl is not None and not isinstance(tmpl, str):
        raise TypeError(f"chat_template must be a string, got {type(tmpl).__name__}")


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
    _int("speculative_max_draft", max_draft, lo=1, hi=MAX_DRAFT)
