"""Weight placement on real llama.cpp: what llama.cpp reports it did with the weights.

The AMX decision itself is tested in unit/llama/test_weight_placement.py. Here Gemma
3 270M (Q4_K_M: the weights llama.cpp repacks) is loaded and the load log's buffer
sizes, routed through :mod:`logging`, are read back.
"""

from __future__ import annotations

import logging

import llama_cpp.llama_cpp as C
import numpy as np
import pytest

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.llama import ggml_cpu, loading
from langchain_llamacpp_local.llama.loading import LoadConfig

pytestmark = pytest.mark.gemma

AMX_MACHINE = ("AMX", "CPU_REPACK")  # what ggml registers on an Intel CPU with AMX


def _buffers(config: LoadConfig, extra: tuple[str, ...] | None) -> dict[str, float]:
    ref = loading.load_model(config, extra_bufts=extra)
    try:
        return loading.weight_buffers(ref.model)
    finally:
        ref.release()


def test_the_default_engine_has_no_weight_in_amx(gemma: str) -> None:
    llm = ChatLlamaCpp(model_path=gemma, n_ctx=256, max_tokens=1, temperature=0)
    try:
        buffers = llm.model_info.weight_buffers
    finally:
        llm.close()
        llm.unload()
    assert buffers, "llama.cpp reported no weight buffer"
    assert "AMX" not in buffers
    if "CPU_REPACK" in ggml_cpu.extra_buffer_types():
        assert buffers.get("CPU_REPACK", 0) > 0  # the Q4_K weights stay repacked


def test_the_amx_avoiding_placement_keeps_every_repacked_weight(
    gemma: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Decided as on an AMX machine, applied here: llama.cpp must report the same
    repacked weights as its own placement without AMX, through explicit overrides."""
    if "CPU_REPACK" not in ggml_cpu.extra_buffer_types():
        pytest.skip("this llama.cpp build has no CPU_REPACK buffer type")
    config = LoadConfig(model_path=gemma)
    plan = loading.plan_weights(config, AMX_MACHINE)
    assert not plan.use_extra_bufts and plan.overrides
    with caplog.at_level(logging.DEBUG, logger="langchain_llamacpp_local.llama_cpp"):
        avoided = _buffers(config, AMX_MACHINE)
    overridden = [r for r in caplog.records if "buffer type overridden to CPU_REPACK" in r.message]
    assert "AMX" not in avoided and avoided["CPU_REPACK"] > 0
    if "AMX" not in ggml_cpu.extra_buffer_types():
        # llama.cpp's own choice on a machine without AMX: the same buffers. (On one with
        # AMX its own choice is AMX; what it would do without cannot be asked of it, so
        # the 27 overrides below are the check there.)
        assert avoided == _buffers(config, ("CPU_REPACK",))
    assert len(overridden) == 27  # Gemma 3 270M Q4_K_M: its 27 Q4_K matrices
    # and without the overrides nothing would have been repacked
    assert "CPU_REPACK" not in _buffers(config, ("AMX",))


def test_the_placement_gives_the_same_logits(gemma: str) -> None:
    """The probes and every decode run on the placement actually loaded: the same
    weights in the same buffer types compute the same numbers."""
    if "AMX" in ggml_cpu.extra_buffer_types():
        # the reference is llama.cpp's own placement on a machine without AMX: here that
        # would put the weights in AMX, whose kernel dies (SIGILL) on this CPU
        pytest.skip("this machine has AMX: llama.cpp's own placement cannot run here")
    tokens = list(range(2, 40))

    def logits(extra: tuple[str, ...] | None) -> np.ndarray:
        ref = loading.load_model(LoadConfig(model_path=gemma, n_ctx=128), extra_bufts=extra)
        try:
            cparams = C.llama_context_default_params()
            cparams.n_ctx, cparams.n_batch, cparams.n_threads = 128, 64, 1
            ctx = C.llama_init_from_model(ref.model, cparams)
            ids = (C.llama_token * len(tokens))(*tokens)  # kept alive: the batch points into it
            batch = C.llama_batch_get_one(ids, len(tokens))
            assert C.llama_decode(ctx, batch) == 0
            n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(ref.model))
            out = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
            C.llama_free(ctx)
            return out
        finally:
            ref.release()

    assert np.array_equal(logits(("CPU_REPACK",)), logits(AMX_MACHINE))
