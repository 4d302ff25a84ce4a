"""LoRA configuration, prefix keys and adapter grouping (pure Python, no model)."""

from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from langchain_llamacpp_local.cache.slots import common_prefix_len
from langchain_llamacpp_local.errors import ModelLoadError
from langchain_llamacpp_local.llama.adapters import check_adapter_file
from langchain_llamacpp_local.runtime.lora import (
    AdapterSpec,
    KeyedToken,
    activate,
    alora_start,
    key_tokens,
    parse_adapters,
    plan_adapter_groups,
    request_key,
    resolve_adapter_path,
)

SPECS = (AdapterSpec("sql", "/s.gguf", 0.0), AdapterSpec("router", "/r.gguf", 0.8))


def test_parse_adapters() -> None:
    specs = parse_adapters({"sql": "s.gguf", "router": {"path": "r.gguf", "scale": 0.8}})
    assert specs == (AdapterSpec("sql", "s.gguf", 0.0), AdapterSpec("router", "r.gguf", 0.8))
    assert parse_adapters({"x": {"path": "x.gguf"}}) == (AdapterSpec("x", "x.gguf", 1.0),)
    for bad in ({"x": 3}, {"x": {"scale": 1}}, {"x": {"path": "p", "scal": 1}}, {"": "p"}):
        with pytest.raises(ValueError):
            parse_adapters(bad)
    with pytest.raises(ValueError, match="finite"):
        parse_adapters({"x": {"path": "p", "scale": float("inf")}})


def test_request_key_defaults_replacement_and_errors() -> None:
    assert request_key(SPECS, None) == (("router", 0.8),)  # defaults; scale 0 is off
    assert request_key(SPECS, {"sql": 1.0}) == (("sql", 1.0),)  # replaces the defaults
    assert request_key(SPECS, {}) == ()
    # declaration order, whatever the request's order; zero scales dropped
    assert request_key(SPECS, {"router": 0.5, "sql": 2}) == (("sql", 2.0), ("router", 0.5))
    assert request_key(SPECS, {"router": 0.0}) == ()
    assert request_key(SPECS, "sql") == (("sql", 1.0),)
    assert request_key(SPECS, ["sql", "router"]) == (("sql", 1.0), ("router", 1.0))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'chat'.*'sql', 'router'"):
        request_key(SPECS, {"chat": 1.0})
    with pytest.raises(ValueError, match="has none"):
        request_key((), {"chat": 1.0})
    with pytest.raises(ValueError, match="number"):
        request_key(SPECS, {"sql": "high"})


def test_keyed_tokens_separate_adapter_sets() -> None:
    toks = [1, 5, 6, 7]
    a = key_tokens(toks, (("a", 1.0),))
    b = key_tokens(toks, (("b", 1.0),))
    assert key_tokens(toks, ()) is toks
    assert common_prefix_len(a, toks) == common_prefix_len(a, b) == 0
    assert common_prefix_len(a, key_tokens(toks, (("a", 1.0),))) == 4
    assert common_prefix_len(a, key_tokens(toks, (("a", 0.5),))) == 0
    assert a[0] != 1 and not (a[0] == 1) and not (1 == a[0])  # never the plain token
    assert int(a[0]) == 1 and isinstance(a[0], int)
    assert pickle.loads(pickle.dumps(a[0])) == a[0]
    # an activated LoRA keys from its invocation start: the prefix stays shared
    late = key_tokens(toks, (("a", 1.0),), 2)
    assert common_prefix_len(late, toks) == 2
    assert isinstance(late[2], KeyedToken)
    img = key_tokens([("media", "d", 0), 5], (("a", 1.0),))
    assert img[0] != ("media", "d", 0)


def test_alora_activation() -> None:
    toks = [1, 9, 8, 7, 9, 8, 6]
    assert alora_start(toks, [9, 8]) == 4  # the last occurrence
    assert alora_start(toks, [8, 9, 9]) is None
    alora = {"act": [9, 8]}
    assert activate((("act", 1.0),), alora, toks) == ((("act", 1.0),), 4)
    assert activate((("act", 1.0),), alora, [1, 2]) == ((), 0)  # absent: off
    assert activate((("x", 1.0),), alora, toks) == ((("x", 1.0),), 0)
    with pytest.raises(ValueError, match="cannot run with other adapters"):
        activate((("act", 1.0), ("x", 1.0)), alora, toks)


def test_plan_adapter_groups_is_fair() -> None:
    reqs = [("r1", "a"), ("r2", "b"), ("r3", "a"), ("r4", "c")]
    first = plan_adapter_groups(reqs, lambda r: r[1], 0)
    assert first == [[("r1", "a"), ("r3", "a")], [("r2", "b")], [("r4", "c")]]
    # every set decodes every step; the one going first rotates
    leaders = {plan_adapter_groups(reqs, lambda r: r[1], t)[0][0][1] for t in range(3)}
    assert leaders == {"a", "b", "c"}
    for t in range(5):
        groups = plan_adapter_groups(reqs, lambda r: r[1], t)
        assert sorted(r for g in groups for r in g) == sorted(reqs)
        assert all(len({r[1] for r in g}) == 1 for g in groups)
    assert plan_adapter_groups([], lambda r: r, 3) == []


def test_resolve_adapter_path(tmp_path: Path) -> None:
    (tmp_path / "sql.gguf").write_bytes(b"GGUF")
    assert resolve_adapter_path("sql", str(tmp_path)) == str(tmp_path / "sql.gguf")
    assert resolve_adapter_path(str(tmp_path / "sql.gguf"), None) == str(tmp_path / "sql.gguf")
    with pytest.raises(ModelLoadError, match="not found: nope"):
        resolve_adapter_path("nope", str(tmp_path))


def _check(meta: dict, tensors: list) -> None:
    model = {"blk.0.attn_q.weight": (64, 64), "token_embd.weight": (64, 260)}
    check_adapter_file("x.gguf", "llama", model, lambda _p: meta, lambda _p: tensors)


def test_check_adapter_file() -> None:
    meta = {"general.type": "adapter", "adapter.type": "lora", "general.architecture": "llama"}
    good = [("blk.0.attn_q.weight.lora_a", 0, (64, 4)), ("blk.0.attn_q.weight.lora_b", 0, (4, 64))]
    _check(meta, good)
    with pytest.raises(ModelLoadError, match="x.gguf is for architecture 'mamba'"):
        _check({**meta, "general.architecture": "mamba"}, good)
    with pytest.raises(ModelLoadError, match="not a LoRA adapter"):
        _check({**meta, "general.type": "model"}, good)
    with pytest.raises(ModelLoadError, match="another base model.*shape"):
        _check(meta, [(n, t, (32, 4) if n.endswith("a") else s) for n, t, s in good])
    with pytest.raises(ModelLoadError, match="no tensor 'blk.9"):
        _check(meta, [(n.replace("0", "9"), t, s) for n, t, s in good])
    with pytest.raises(ModelLoadError, match="lacks its lora_a or lora_b"):
        _check(meta, good[:1])

    def broken(_p: str) -> dict:
        raise ValueError("truncated")

    with pytest.raises(ModelLoadError, match="corrupt or unreadable LoRA adapter x.gguf"):
        check_adapter_file("x.gguf", "llama", {}, broken, lambda _p: [])


def test_check_adapter_file_refuses_tensor_types_llama_cpp_crashes_on() -> None:
    meta = {"general.type": "adapter", "adapter.type": "lora", "general.architecture": "llama"}
    f64 = [("blk.0.attn_q.weight.lora_a", 28, (64, 4)), ("blk.0.attn_q.weight.lora_b", 0, (4, 64))]
    with pytest.raises(
        ModelLoadError, match="x.gguf: tensor 'blk.0.attn_q.weight.lora_a' has ggml type 28"
    ):
        _check(meta, f64)


def test_scales_are_bounded_and_huge_numbers_are_a_value_error() -> None:
    assert request_key(SPECS, {"sql": 100, "router": -100.0}) == (
        ("sql", 100.0),
        ("router", -100.0),
    )
    for bad in (1e6, -1e6, 1e39, 100.001, 10**400, -(10**5000), math.inf, math.nan):
        with pytest.raises(ValueError, match=r"lora\['sql'\] must be a finite LoRA scale within"):
            request_key(SPECS, {"sql": bad})
        with pytest.raises(ValueError, match=r"lora_adapters\['x'\]\['scale'\]"):
            parse_adapters({"x": {"path": "p", "scale": bad}})
    with pytest.raises(ValueError, match="an integer of 1329 bits"):
        request_key(SPECS, {"sql": 10**400})


def test_resolve_adapter_path_names_what_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a directory"):
        resolve_adapter_path(str(tmp_path), None)
    (tmp_path / "sub").mkdir()
    with pytest.raises(ModelLoadError, match="sub is a directory"):
        resolve_adapter_path("sub", str(tmp_path))
    with pytest.raises(ModelLoadError, match="/dev/zero is not a regular file"):
        resolve_adapter_path("/dev/zero", None)
    fifo = tmp_path / "f.gguf"
    os.mkfifo(fifo)  # stat only: never opened, so this cannot block
    with pytest.raises(ModelLoadError, match="f.gguf is not a regular file"):
        resolve_adapter_path("f", str(tmp_path))


META = {
    "general.type": "adapter",
    "adapter.type": "lora",
    "general.architecture": "llama",
}
PAIR = [("blk.0.attn_q.weight.lora_a", 0, (64, 4)), ("blk.0.attn_q.weight.lora_b", 0, (4, 64))]


def _check_data(meta: dict, data: list) -> None:
    model = {"blk.0.attn_q.weight": (64, 64)}
    check_adapter_file(
        "x.gguf", "llama", model, lambda _p: meta, lambda _p: PAIR, lambda _p: iter(data)
    )


def test_check_adapter_alpha() -> None:
    _check_data(META, [])  # no alpha: llama.cpp applies the scale as is
    _check_data({**META, "adapter.lora.alpha": 400.0}, [])  # rank 4: up to 100 x 4
    _check_data({**META, "adapter.lora.alpha": -8.0}, [])
    for bad in (math.nan, math.inf, -math.inf, 3e38, -3e38, 400.5):
        with pytest.raises(ModelLoadError, match="x.gguf: adapter.lora.alpha is"):
            _check_data({**META, "adapter.lora.alpha": bad}, [])


def _raw(values: list[float], dtype: str) -> np.ndarray:
    return np.array(values, dtype=dtype).view(np.uint8)


def _q8_0(d: float) -> np.ndarray:
    block = np.zeros(34, dtype=np.uint8)
    block[:2] = np.array([d], dtype="<f2").view(np.uint8)
    block[2:] = 5
    return np.concatenate([block, block])


def _bf16(values: list[float]) -> np.ndarray:
    return (np.array(values, dtype="<f4").view("<u4") >> 16).astype("<u2").view(np.uint8)


def test_check_adapter_tensor_values() -> None:
    name = "blk.0.attn_q.weight.lora_b"
    fine = [
        (name, 0, _raw([0.5, -1.0, 65504.0], "<f4")),
        (name, 1, _raw([0.5, -65504.0], "<f2")),
        (name, 30, _bf16([0.25, -3.0])),
        (name, 8, _q8_0(0.01)),
    ]
    _check_data(META, fine)
    with np.errstate(over="ignore"):
        bad = {
            "f32 nan": (name, 0, _raw([0.5, math.nan], "<f4")),
            "f32 inf": (name, 0, _raw([-math.inf], "<f4")),
            "f16 inf": (name, 1, _raw([1e5], "<f2")),
            "bf16 nan": (name, 30, _bf16([1.0, math.nan])),
            "q8_0 inf scale": (name, 8, _q8_0(math.inf)),
        }
    for label, item in bad.items():
        with pytest.raises(ModelLoadError, match=f"x.gguf: tensor '{name}' holds NaN or inf"):
            _check_data(META, [item])
        assert label
    for item in [(name, 0, _raw([1e6], "<f4")), (name, 30, _bf16([3e38])), (name, 8, _q8_0(600))]:
        with pytest.raises(ModelLoadError, match="beyond 65504"):
            _check_data(META, [item])


def test_read_tensor_data_matches_gguf(tmp_path: Path) -> None:
    """Offsets and alignment as the gguf package writes and reads them."""
    import gguf

    from langchain_llamacpp_local.llama.gguf import read_tensor_data

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("general.alignment", 64)
    arrays = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.linspace(-2, 2, 10).astype(np.float16),
        "c": np.arange(5, dtype=np.int32),  # another type: skipped
        "d": np.full((2, 3), 7.5, dtype=np.float32),
    }
    for k, v in arrays.items():
        w.add_tensor(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = {n: (t, raw) for n, t, raw in read_tensor_data(path)}
    assert sorted(got) == ["a", "b", "d"]
    assert np.array_equal(got["a"][1].view("<f4"), arrays["a"].ravel())
    assert np.array_equal(got["b"][1].view("<f2"), arrays["b"])
    assert np.array_equal(got["d"][1].view("<f4"), arrays["d"].ravel())
    data = path.read_bytes()
    path.write_bytes(data[: data.rindex(np.float32(7.5).tobytes()) - 4])  # d cut short
    with pytest.raises(ValueError, match="tensor 'd'.*runs past the end"):
        list(read_tensor_data(path))
