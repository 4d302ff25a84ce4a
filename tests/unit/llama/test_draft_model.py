"""Pure helpers of the draft-model proposer (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from langchain_llamacpp_local.llama.draft import draft_config, top_probability
from langchain_llamacpp_local.llama.loading import LoadConfig


def test_top_probability_is_normalised_over_the_top_ten() -> None:
    logits = np.zeros(100, dtype=np.float32)
    logits[7] = np.log(9.0)  # 9 : 1 against each of the 9 next-best (all 0)
    token, p = top_probability(logits)
    assert token == 7
    assert p == pytest.approx(0.5)


def test_top_probability_breaks_ties_like_argmax() -> None:
    logits = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    token, p = top_probability(logits)
    assert token == int(np.argmax(logits)) == 1
    assert p == pytest.approx(np.exp(3) / (2 * np.exp(3) + np.exp(1) + 1))


def test_draft_config_follows_the_target() -> None:
    target = LoadConfig(
        model_path="big.gguf",
        n_ctx=4096,
        n_batch=256,
        n_threads=3,
        n_gpu_layers=-1,
        n_slots=4,
        kv_unified=True,
        type_k="q8_0",
        flash_attn=True,
        mmproj_path="proj.gguf",
        rpc_servers=("host:50052",),
    )
    cfg = draft_config(target, "small.gguf", n_ctx=4352)
    assert cfg.model_path == "small.gguf"
    assert (cfg.n_ctx, cfg.n_batch, cfg.n_threads, cfg.n_gpu_layers, cfg.n_slots) == (
        4352,
        256,
        3,
        -1,
        4,
    )
    assert not cfg.kv_unified and cfg.flash_attn is False and cfg.swa_full
    assert cfg.type_k is None and cfg.mmproj_path is None and cfg.rpc_servers == ()
    assert draft_config(target, "small.gguf").n_ctx == 4096
