"""What llama.cpp accepts at load, checked before anything reaches it.

llama.cpp answers many bad load values with a ``GGML_ASSERT`` (the process dies) or
silently with something else (``n_ctx=2**32+1`` wraps to 1). These are pure functions
raising ``ValueError``/``TypeError`` whose message names the setting, testable without a
model; :func:`langchain_llamacpp_local.llama.loading.check_load_config` runs them for
every load, whoever builds the config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: llama.cpp's GGML_MAX_N_THREADS.
MAX_THREADS = 512
#: llama.cpp's LLAMA_MAX_SEQ.
MAX_SEQ = 256
#: Positions are int32 in llama.cpp (``llama_pos``).
_INT32_MAX = 2**31 - 1


#: KV cache types accepted by ``type_k``/``type_v`` by name (ggml type ids).
KV_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "iq4_nl": 20,
}

#: Default cap on ``n_ctx`` when the caller leaves it to the model's training length:
#: a 128k-token KV cache would take gigabytes that a chat rarely needs.
DEFAULT_MAX_CTX = 8192
#: Tokens per ``llama_decode`` unless ``n_batch`` is given (llama.cpp's own default).
DEFAULT_N_BATCH = 512


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an integer setting named ``name``, within ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
    return value


def check_finite(name: str, value: Any, *, lo: float | None = None) -> float:
    """``value`` as a finite float setting named ``name``, at least ``lo``."""
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
    n_slots = check_int("n_slots", s.get("n_slots", 1), lo=1, hi=MAX_SEQ)
    n_ctx = s.get("n_ctx")
    if n_ctx is not None:
        check_int("n_ctx", n_ctx, hi=_INT32_MAX)
        if n_ctx < max(n_slots, 1):
            raise ValueError(
                f"n_ctx must be at least n_slots={n_slots} (llama.cpp needs room for one "
                f"token per slot), got {n_ctx}"
            )
    n_batch = check_int("n_batch", s.get("n_batch", DEFAULT_N_BATCH), lo=1, hi=_INT32_MAX)
    if n_batch < n_slots:
        raise ValueError(
            f"n_batch={n_batch} is smaller than n_slots={n_slots}: a batch must hold one "
            "token of every slot (raise n_batch or lower n_slots)"
        )
    n_ubatch = s.get("n_ubatch")
    if n_ubatch is not None:
        check_int("n_ubatch", n_ubatch, lo=1, hi=_INT32_MAX)
        if n_ubatch < n_slots:
            raise ValueError(
                f"n_ubatch={n_ubatch} is smaller than n_slots={n_slots}: a micro-batch "
                "must hold one token of every slot"
            )
    for name in ("n_threads", "n_threads_batch"):
        if s.get(name) is not None:
            check_int(name, s[name], lo=1, hi=MAX_THREADS)
    check_int("n_gpu_layers", s.get("n_gpu_layers", 0), lo=-1, hi=_INT32_MAX)
    for name in ("rope_freq_base", "rope_freq_scale"):
        check_finite(name, s.get(name, 0.0), lo=0.0)
    for name in ("image_min_tokens", "image_max_tokens"):
        if s.get(name) is not None:
            check_int(name, s[name], lo=1, hi=_INT32_MAX)
    lo_img, hi_img = s.get("image_min_tokens"), s.get("image_max_tokens")
    if lo_img is not None and hi_img is not None and lo_img > hi_img:
        raise ValueError(f"image_min_tokens={lo_img} is above image_max_tokens={hi_img}")
    for name in ("type_k", "type_v"):
        value = s.get(name)
        if value is not None:
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
            check_int(name, s[name], lo=0)
    if "checkpoint_min_step" in s:
        check_int("checkpoint_min_step", s["checkpoint_min_step"], lo=1)
