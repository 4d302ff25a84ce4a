"""LoRA adapter files checked against the base model before llama.cpp reads them.

llama.cpp aborts or fails obscurely on an adapter for another model; these checks are
llama-adapter.cpp's own, made first so the error names the file and the mismatch.
It also takes any ``adapter.lora.alpha`` and any tensor values: a non-finite or huge
one overflows the KV cache on the first decode, and in a unified KV pool that reaches
every other sequence (docs/lora.md, "Bounds"), so those are refused here too.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from langchain_llamacpp_local.errors import ModelLoadError

#: ggml types of LoRA tensors llama.cpp's matmuls take (convert_lora_to_gguf.py writes
#: F32/F16/BF16/Q8_0); others (F64, integer types) crash its kernels
ADAPTER_TENSOR_TYPES = {0: "F32", 1: "F16", 8: "Q8_0", 30: "BF16"}

#: The largest ``|alpha / rank|`` an adapter may declare: llama.cpp multiplies a
#: request's scale by it. Trained adapters use alpha of 1 to 2 x rank (a few units at
#: most); the same ceiling as a request's scale (lora.MAX_SCALE) keeps the product
#: within 1e4.
MAX_ALPHA_RATIO = 100.0

#: The largest magnitude an adapter's tensor values may have: f16's largest finite
#: value. convert_lora_to_gguf.py stores F16/BF16/Q8_0/F32 tensors of trained weights
#: (|w| well under 1); a value an F16 file could not hold is not a trained adapter, and
#: its products overflow the f16 KV cache at any scale.
MAX_TENSOR_VALUE = 65504.0

#: Values checked at a time: bounds the temporary arrays for a large adapter.
_CHUNK = 1 << 22


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be an adapter file although it exists (None: a regular file,
    or nothing there). ``stat`` follows links and never opens, so a FIFO cannot block."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory, not a file"
    return "not a regular file (a FIFO, device or socket cannot be an adapter)"


def check_adapter_file(
    path: str,
    arch: str,
    model_tensors: Mapping[str, tuple[int, ...]],
    read_meta: Callable[[str], Mapping[str, Any]],
    read_tensors: Callable[[str], list[tuple[str, int, tuple[int, ...]]]],
    read_data: Callable[[str], Iterable[tuple[str, int, np.ndarray]]] | None = None,
) -> None:
    """Refuse, with :class:`ModelLoadError` naming ``path``, an adapter llama.cpp would
    reject or abort on: not a LoRA GGUF, another architecture, tensors the base model
    lacks or of another shape (llama-adapter.cpp's checks, made before it runs); and
    one whose ``adapter.lora.alpha`` or tensor values (``read_data``: name, ggml type,
    raw bytes) are not finite or out of bounds (:data:`MAX_ALPHA_RATIO`,
    :data:`MAX_TENSOR_VALUE`)."""
    try:
        meta = read_meta(path)
        tensors = read_tensors(path)
    except (ValueError, OSError, UnicodeDecodeError, MemoryError) as exc:
        raise ModelLoadError(f"corrupt or unreadable LoRA adapter {path}: {exc}") from None
    except Exception as exc:  # struct.error and the like: a truncated header
        raise ModelLoadError(f"corrupt LoRA adapter {path}: {exc}") from None
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise ModelLoadError(
            f"{path} is not a LoRA adapter (general.type={meta.get('general.type')!r}, "
            f"adapter.type={meta.get('adapter.type')!r})"
        )
    if meta.get("general.architecture") != arch:
        raise ModelLoadError(
            f"LoRA adapter {path} is for architecture {meta.get('general.architecture')!r}, "
            f"the model is {arch!r}"
        )
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, ggml_type, shape in tensors:
        if ggml_type not in ADAPTER_TENSOR_TYPES and not name.endswith("_norm.weight"):
            raise ModelLoadError(
                f"LoRA adapter {path}: tensor {name!r} has ggml type {ggml_type}; llama.cpp "
                f"takes {', '.join(ADAPTER_TENSOR_TYPES.values())} adapter tensors"
            )
        for suffix in (".lora_a", ".lora_b"):
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], {})[suffix[-1]] = shape
                break
        else:
            if not name.endswith("_norm.weight"):
                raise ModelLoadError(f"LoRA adapter {path}: unexpected tensor {name!r}")
    if not pairs:
        raise ModelLoadError(f"LoRA adapter {path} has no lora_a/lora_b tensors")
    for base, ab in pairs.items():
        if set(ab) != {"a", "b"}:
            raise ModelLoadError(f"LoRA adapter {path}: {base!r} lacks its lora_a or lora_b")
        target = model_tensors.get(base)
        if target is None:
            raise ModelLoadError(
                f"LoRA adapter {path} was made for another base model: the model has no "
                f"tensor {base!r}"
            )
        a, b = ab["a"], ab["b"]
        if len(a) < 2 or len(b) < 2 or len(target) < 2:
            raise ModelLoadError(f"LoRA adapter {path}: {base!r} is not a matrix pair")
        if base.endswith("token_embd.weight"):
            ok = target[0] == b[1] and target[1] == a[1]
        else:
            ok = target[0] == a[0] and target[1] == b[1] and a[1] == b[0]
        if not ok:
            raise ModelLoadError(
                f"LoRA adapter {path} was made for another base model: {base!r} has shape "
                f"{list(target)}, the adapter's lora_a {list(a)} / lora_b {list(b)}"
            )
    _check_alpha(path, meta.get("adapter.lora.alpha"), min(ab["b"][0] for ab in pairs.values()))
    if read_data is not None:
        try:
            for name, ggml_type, raw in read_data(path):
                _check_values(path, name, ggml_type, raw)
        except (ValueError, OSError, MemoryError) as exc:
            raise ModelLoadError(f"corrupt or unreadable LoRA adapter {path}: {exc}") from None


def _check_alpha(path: str, alpha: Any, rank: int) -> None:
    """``alpha`` (absent or 0: llama.cpp uses the scale as is) finite and within
    :data:`MAX_ALPHA_RATIO` x ``rank``."""
    if alpha is None:
        return
    bound = MAX_ALPHA_RATIO * max(1, rank)
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float))
        or not math.isfinite(alpha)
        or abs(alpha) > bound
    ):
        raise ModelLoadError(
            f"LoRA adapter {path}: adapter.lora.alpha is {alpha!r}; it must be a finite "
            f"number within [-{bound:g}, {bound:g}] ({MAX_ALPHA_RATIO:g} x its rank {rank}: "
            "llama.cpp scales the adapter by scale x alpha / rank)"
        )


def _values(ggml_type: int, raw: np.ndarray) -> np.ndarray | None:
    """Float32 values that bound a tensor's (its block scales for Q8_0), or None."""
    if ggml_type == 0:
        return raw.view("<f4")
    if ggml_type == 1:
        return raw.view("<f2").astype(np.float32)
    if ggml_type == 30:  # bfloat16: the high half of a float32
        return (raw.view("<u2").astype(np.uint32) << 16).view("<f4")
    if ggml_type == 8:  # 34-byte blocks: an f16 scale d, then 32 int8 (|q| <= 128)
        return raw.reshape(-1, 34)[:, :2].copy().view("<f2").astype(np.float32).ravel() * 128
    return None


def _check_values(path: str, name: str, ggml_type: int, raw: np.ndarray) -> None:
    """Refuse a tensor holding NaN, inf or a value beyond :data:`MAX_TENSOR_VALUE`."""
    step = _CHUNK * (34 if ggml_type == 8 else 4)
    for i in range(0, len(raw), step):
        values = _values(ggml_type, raw[i : i + step])
        if values is None:
            return
        if not np.isfinite(values).all():
            raise ModelLoadError(f"LoRA adapter {path}: tensor {name!r} holds NaN or inf")
        peak = float(np.abs(values).max()) if values.size else 0.0
        if peak > MAX_TENSOR_VALUE:
            raise ModelLoadError(
                f"LoRA adapter {path}: tensor {name!r} holds {peak:g}, beyond "
                f"{MAX_TENSOR_VALUE:g} (f16's range; no trained adapter has such weights)"
            )
