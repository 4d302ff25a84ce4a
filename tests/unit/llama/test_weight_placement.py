"""The CPU weight-placement decision, with the machine's buffer types given as input.

Runs on any CPU: whether this machine has AMX does not matter, the decision is a pure
function of what the CPU back-end offers, the user's choice and the weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings, LlamaCppRerank
from langchain_llamacpp_local.llama.draft import draft_config
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.settings import check_load_settings
from langchain_llamacpp_local.llama.weights import (
    AMX,
    CPU_REPACK,
    TensorInfo,
    is_matmul_weight,
    names_regex,
    plan_weight_placement,
)

Q4_K, Q6_K, F32 = 12, 14, 0

WEIGHTS = [
    TensorInfo("token_embd.weight", Q6_K, (640, 262144)),
    TensorInfo("output_norm.weight", F32, (640,)),
    TensorInfo("output.weight", Q4_K, (640, 262144)),
    *(
        TensorInfo(f"blk.{i}.{stem}.weight", Q4_K, (640, 2048))
        for i in range(12)
        for stem in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")
    ),
    *(TensorInfo(f"blk.{i}.attn_norm.weight", F32, (640,)) for i in range(12)),
    TensorInfo("blk.3.ffn_gate.weight", Q6_K, (640, 2047)),  # a shape repack refuses
    TensorInfo("blk.0.ssm_conv1d.weight", Q4_K, (4, 1536)),  # not a matmul weight
]


def accepts(t: TensorInfo) -> bool:
    """Stands for ggml's answer: Q4_K/Q6_K with rows in groups of 8."""
    return t.ggml_type in (Q4_K, Q6_K) and t.shape[1] % 8 == 0


def test_without_amx_llama_cpp_places_the_weights() -> None:
    plan = plan_weight_placement(
        extra_bufts=[CPU_REPACK], cpu_amx=None, tensors=WEIGHTS, repack_accepts=accepts
    )
    assert plan.use_extra_bufts and plan.overrides == () and plan.avoided == ()


@pytest.mark.parametrize("cpu_amx", [None, False])
def test_with_amx_no_weight_goes_to_amx_and_repacking_stays(cpu_amx: bool | None) -> None:
    plan = plan_weight_placement(
        extra_bufts=[AMX, CPU_REPACK], cpu_amx=cpu_amx, tensors=WEIGHTS, repack_accepts=accepts
    )
    # extra types off: nothing can land in AMX; repacking comes back through overrides
    assert not plan.use_extra_bufts and plan.avoided == (AMX,)
    assert [b for _, b in plan.overrides] == [CPU_REPACK]
    pattern = re.compile(plan.overrides[0][0])
    repacked = {t.name for t in WEIGHTS if pattern.search(t.name)}
    expected = {
        t.name for t in WEIGHTS if len(t.shape) == 2 and is_matmul_weight(t.name) and accepts(t)
    }
    assert repacked == expected
    assert "output.weight" in repacked and "blk.11.ffn_down.weight" in repacked
    assert not repacked & {
        "token_embd.weight",  # read by GET_ROWS: a repacked copy cannot be read back
        "blk.3.ffn_gate.weight",
        "blk.0.ssm_conv1d.weight",
        "output_norm.weight",
    }


def test_with_amx_opted_in_llama_cpp_places_the_weights() -> None:
    plan = plan_weight_placement(
        extra_bufts=[AMX, CPU_REPACK], cpu_amx=True, tensors=WEIGHTS, repack_accepts=accepts
    )
    assert plan.use_extra_bufts and plan.overrides == () and plan.avoided == ()


def test_with_amx_and_no_repack_type_nothing_is_overridden() -> None:
    plan = plan_weight_placement(
        extra_bufts=[AMX], cpu_amx=None, tensors=WEIGHTS, repack_accepts=accepts
    )
    assert not plan.use_extra_bufts and plan.overrides == ()


@pytest.mark.parametrize(
    ("name", "matmul"),
    [
        ("blk.0.attn_q.weight", True),
        ("blk.17.attn_output.weight", True),
        ("blk.2.ffn_down.weight", True),
        ("blk.2.ffn_up_shexp.weight", True),
        ("blk.5.ssm_in.weight", True),
        ("output.weight", True),
        ("token_embd.weight", False),
        ("blk.0.attn_norm.weight", False),
        ("blk.0.attn_q_norm.weight", False),
        ("blk.0.ffn_norm.weight", False),
        ("blk.0.ffn_gate_inp.weight", False),
        ("blk.0.attn_sinks.weight", False),
        ("blk.0.attn_q.bias", False),
        ("per_layer_token_embd.weight", False),
    ],
)
def test_matmul_weights_by_name(name: str, matmul: bool) -> None:
    assert is_matmul_weight(name) is matmul


def test_names_regex_matches_exactly_the_names() -> None:
    names = [f"blk.{i}.attn_q.weight" for i in (0, 1, 10, 11)] + ["output.weight"]
    pattern = re.compile(names_regex(names))
    assert all(pattern.search(n) for n in names)
    for other in (
        "blk.2.attn_q.weight",
        "blk.1.attn_q.weightx",
        "xoutput.weight",
        "blk.100.attn_q.weight",
    ):
        assert not pattern.search(other), other
    assert len(names_regex([f"blk.{i}.ffn_up.weight" for i in range(200)])) < 1000


def test_cpu_amx_is_validated(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cpu_amx"):
        check_load_settings({"cpu_amx": "yes"})
    check_load_settings({"cpu_amx": True})
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    for cls in (ChatLlamaCpp, LlamaCppEmbeddings, LlamaCppRerank):
        with pytest.raises(ValueError, match="cpu_amx"):
            cls(model_path=str(model), cpu_amx="yes")


def test_every_engine_follows_the_choice(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    emb = LlamaCppEmbeddings(model_path=str(model), cpu_amx=True)
    assert emb._config().load_config().cpu_amx is True
    target = LoadConfig(model_path=str(model), cpu_amx=True)
    assert draft_config(target, str(model)).cpu_amx is True
    # part of the weights' identity: a model loaded with AMX is not shared with one without
    assert target.model_key() != LoadConfig(model_path=str(model)).model_key()
