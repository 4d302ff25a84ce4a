"""What every llama.cpp context of this package does the same way: its creation, its
flash-attention setting and the filling of a ``llama_batch``.

Shared by the chat context (:mod:`.engine`) and the embedding context (:mod:`.embedding`).
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Sequence
from typing import Any

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.errors import ModelLoadError


def flash_attn_type(flash: bool | None) -> int:
    """llama.cpp's flash-attention setting: its own choice ("auto") for ``None``."""
    if flash is None:
        return int(C.LLAMA_FLASH_ATTN_TYPE_AUTO)
    return int(C.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else C.LLAMA_FLASH_ATTN_TYPE_DISABLED)


def new_context(model: Any, cparams: Any, what: str) -> Any:
    """``llama_init_from_model``, or a :class:`ModelLoadError` saying which ``what``
    (e.g. "a context of 4096 tokens for model.gguf") could not be created."""
    ctx = C.llama_init_from_model(model, cparams)
    if not ctx:
        raise ModelLoadError(
            f"llama.cpp could not create {what} (out of memory or unsupported settings)"
        )
    return ctx


def fill_batch(
    batch: Any,
    tokens: Sequence[int],
    positions: Sequence[int],
    seq_ids: Sequence[int],
    outputs: Sequence[bool],
) -> None:
    """Write one sequence id per token into ``batch`` (allocated for at least
    ``len(tokens)`` tokens); ``outputs[i]`` asks for token ``i``'s logits or embedding.

    The token, position and output columns are copied in whole (one ``memmove`` each);
    the sequence ids, one small array per token in llama.cpp's batch, one by one."""
    n = len(tokens)
    if n == 1:  # a generation step: four stores beat building three arrays
        batch.token[0] = tokens[0]
        batch.pos[0] = positions[0]
        batch.logits[0] = 1 if outputs[0] else 0
        batch.n_seq_id[0] = 1
        batch.seq_id[0][0] = seq_ids[0]
        batch.n_tokens = 1
        return
    _copy_column(batch.token, tokens, "i")
    _copy_column(batch.pos, positions, "i")
    _copy_column(batch.logits, [1 if o else 0 for o in outputs], "b")
    n_seq_id, seq_id = batch.n_seq_id, batch.seq_id
    for i in range(n):
        n_seq_id[i] = 1
        seq_id[i][0] = seq_ids[i]
    batch.n_tokens = n


def _copy_column(dest: Any, values: Sequence[int], code: str) -> None:
    """``values`` into the C array ``dest`` points to (``code``: the ``array`` type of
    its elements, int32 or int8)."""
    arr = array.array(code, values)
    if arr:
        ctypes.memmove(dest, arr.buffer_info()[0], len(arr) * arr.itemsize)


def free_context(ctx: Any, batch: Any) -> None:
    """Free a context and its batch (either may be ``None``: already freed)."""
    if batch is not None:
        C.llama_batch_free(batch)
    if ctx:
        C.llama_free(ctx)
