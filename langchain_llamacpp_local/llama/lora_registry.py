"""The LoRA adapters of each loaded model: loaded once per (model, file), checked before
llama.cpp reads them, shared by the model's contexts and freed just before the model."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.errors import ModelLoadError, ModelNotFoundError
from langchain_llamacpp_local.llama.adapters import check_adapter_file, not_a_file
from langchain_llamacpp_local.llama.gguf import (
    read_gguf_metadata,
    read_tensor_data,
    read_tensor_infos,
)
from langchain_llamacpp_local.llama.model_handle import model_address

# LoRA adapters per loaded model, by absolute path: loaded on first use by any context
# of the model, freed just before it (see :func:`.loading.load_model`'s ``free``).
_adapters: dict[int, dict[str, object]] = {}
_adapters_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A parent's loader may have held the lock at a fork (a child loads its own models)."""
    global _adapters_lock
    _adapters_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def free_adapters(model: object) -> None:
    with _adapters_lock:
        loaded = _adapters.pop(model_address(model), {})
    for adapter in loaded.values():
        C.llama_adapter_lora_free(adapter)


def loaded_adapter_paths() -> list[str]:
    """The files of every adapter loaded now, one entry per (model, file)."""
    with _adapters_lock:
        return [path for per_model in _adapters.values() for path in per_model]


def load_adapter(model: object, model_path: str, path: str) -> object:
    """The ``llama_adapter_lora`` for ``path`` on ``model``, loaded once per model.

    The file is checked first (:func:`adapters.check_adapter_file`: architecture, tensor names and
    shapes against the base model), so a wrong or corrupt adapter is a
    :class:`ModelLoadError` naming it, never an abort inside llama.cpp.
    """
    with _adapters_lock:
        loaded = _adapters.setdefault(model_address(model), {})
        adapter = loaded.get(path)
        if adapter is not None:
            return adapter
        why = not_a_file(path)
        if why is not None:
            raise ModelLoadError(f"LoRA adapter {path} is {why}")
        if not Path(path).is_file():
            raise ModelNotFoundError(path, [path], message=f"LoRA adapter file not found: {path}")
        arch = (read_gguf_metadata(model_path, ["general.architecture"]) or {}).get(
            "general.architecture", ""
        )
        model_tensors = {name: shape for name, _t, shape in read_tensor_infos(model_path)}
        check_adapter_file(
            path,
            str(arch),
            model_tensors,
            lambda p: read_gguf_metadata(
                p, ["general.type", "general.architecture", "adapter.type", "adapter.lora.alpha"]
            ),
            read_tensor_infos,
            read_tensor_data,
        )
        adapter = C.llama_adapter_lora_init(model, path.encode())
        if not adapter:
            raise ModelLoadError(
                f"llama.cpp could not load the LoRA adapter {path} (corrupt, or made for "
                "another base model; enable DEBUG logging on "
                "'langchain_llamacpp_local.llama_cpp' for its reason)"
            )
        loaded[path] = adapter
        return adapter


def alora_invocation_tokens(adapter: object) -> list[int]:
    """An activated LoRA's invocation tokens ([] for a plain LoRA)."""
    n = int(C.llama_adapter_get_alora_n_invocation_tokens(adapter))
    if n <= 0:
        return []
    ptr = C.llama_adapter_get_alora_invocation_tokens(adapter)
    return [int(ptr[i]) for i in range(n)] if ptr else []
