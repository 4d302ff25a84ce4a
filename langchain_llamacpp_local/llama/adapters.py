"""LoRA adapter files checked against the base model before llama.cpp reads them.

llama.cpp aborts or fails obscurely on an adapter for another model; these checks are
llama-adapter.cpp's own, made first so the error names the file and the mismatch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from langchain_llamacpp_local.errors import ModelLoadError

#: ggml types of LoRA tensors llama.cpp's matmuls take (convert_lora_to_gguf.py writes
#: F32/F16/BF16/Q8_0); others (F64, integer types) crash its kernels
ADAPTER_TENSOR_TYPES = {0: "F32", 1: "F16", 8: "Q8_0", 30: "BF16"}


def check_adapter_file(
    path: str,
    arch: str,
    model_tensors: Mapping[str, tuple[int, ...]],
    read_meta: Callable[[str], Mapping[str, Any]],
    read_tensors: Callable[[str], list[tuple[str, int, tuple[int, ...]]]],
) -> None:
    """Refuse, with :class:`ModelLoadError` naming ``path``, an adapter llama.cpp would
    reject or abort on: not a LoRA GGUF, another architecture, tensors the base model
    lacks or of another shape (llama-adapter.cpp's checks, made before it runs)."""
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
