"""Pure parts of embeddings and reranking: batching, pooling, normalisation, model sharing."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from pydantic import ValidationError

from langchain_llamacpp_local import LlamaCppEmbeddings, LlamaCppRerank
from langchain_llamacpp_local.embeddings import PREFIXES, postprocess
from langchain_llamacpp_local.llama import model_handle
from langchain_llamacpp_local.llama.embedding import pack, pool
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.validation import check_texts


def test_pack_respects_token_and_sequence_budgets() -> None:
    lengths = [3, 4, 2, 5, 1, 1, 1, 6]
    groups = pack(lengths, n_batch=8, n_seq_max=3)
    assert groups == [(0, 2), (2, 5), (5, 8)]  # 3+4 | 2+5+1 | 1+1+6
    covered = [i for a, b in groups for i in range(a, b)]
    assert covered == list(range(len(lengths)))
    for a, b in groups:
        assert sum(lengths[a:b]) <= 8 and b - a <= 3


def test_pack_one_text_per_group_and_empty_input() -> None:
    assert pack([8, 8, 8], n_batch=8, n_seq_max=256) == [(0, 1), (1, 2), (2, 3)]
    assert pack([], n_batch=8, n_seq_max=4) == []


@pytest.mark.parametrize("bad", [0, 9])
def test_pack_rejects_lengths_outside_the_batch(bad: int) -> None:
    with pytest.raises(ValueError, match="text 1 has"):
        pack([2, bad], n_batch=8, n_seq_max=4)


def test_pool_mean_cls_last() -> None:
    rows = np.arange(12, dtype=np.float32).reshape(6, 2)  # texts of 2, 3 and 1 tokens
    offsets = [0, 2, 5]
    np.testing.assert_allclose(pool(rows, offsets, "mean"), [[1, 2], [6, 7], [10, 11]])
    np.testing.assert_array_equal(pool(rows, offsets, "cls"), [[0, 1], [4, 5], [10, 11]])
    np.testing.assert_array_equal(pool(rows, offsets, "last"), [[2, 3], [8, 9], [10, 11]])
    with pytest.raises(ValueError, match="rank"):
        pool(rows, offsets, "rank")


def test_postprocess_truncates_then_normalises() -> None:
    v = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    full = postprocess(v, dimensions=None, normalize=True)
    np.testing.assert_allclose(full[0], [3 / 13, 4 / 13, 12 / 13], rtol=1e-6)
    np.testing.assert_array_equal(full[1], [0, 0, 0])  # zero stays zero, no NaN
    short = postprocess(v, dimensions=2, normalize=True)
    np.testing.assert_allclose(short[0], [0.6, 0.8], rtol=1e-6)
    raw = postprocess(v, dimensions=2, normalize=False)
    np.testing.assert_array_equal(raw[0], [3, 4])
    with pytest.raises(ValueError, match="dimensions=4"):
        postprocess(v, dimensions=4, normalize=True)


def test_check_texts_names_the_bad_item() -> None:
    assert check_texts(("a", "b")) == ["a", "b"]
    with pytest.raises(TypeError, match="list of strings, got str"):
        check_texts("abc")
    with pytest.raises(TypeError, match=r"texts\[1\] must be a string, got int"):
        check_texts(["a", 1])


def test_prefix_presets_are_constructor_arguments() -> None:
    for name, prefixes in PREFIXES.items():
        emb = LlamaCppEmbeddings(model_path="unused.gguf", **prefixes)
        assert emb.query_prefix == prefixes["query_prefix"], name


def test_unknown_and_invalid_arguments_are_rejected() -> None:
    with pytest.raises(TypeError, match="'n_gpu_layer' \\(did you mean 'n_gpu_layers'"):
        LlamaCppEmbeddings(model_path="m.gguf", n_gpu_layer=1)
    with pytest.raises(ValidationError, match="pooling"):
        LlamaCppEmbeddings(model_path="m.gguf", pooling="max")
    with pytest.raises(ValidationError, match="dimensions"):
        LlamaCppEmbeddings(model_path="m.gguf", dimensions=0)
    with pytest.raises(ValidationError, match="n_seq_max"):
        LlamaCppEmbeddings(model_path="m.gguf", n_seq_max=1000)
    with pytest.raises(ValidationError, match="top_n"):
        LlamaCppRerank(model_path="m.gguf", top_n=-1)


def test_model_key_ignores_context_settings_only() -> None:
    a = LoadConfig(model_path="m.gguf", n_ctx=128, n_batch=64, n_slots=4, flash_attn=True)
    b = LoadConfig(model_path="m.gguf")
    assert a.model_key() == b.model_key()
    assert LoadConfig(model_path="m.gguf", n_gpu_layers=5).model_key() != b.model_key()
    assert LoadConfig(model_path="other.gguf").model_key() != b.model_key()


class _Loads:
    """A stand-in *loader* (not an engine): counts loads and frees of plain objects."""

    def __init__(self) -> None:
        self.loaded: list[object] = []
        self.freed: list[object] = []

    def load(self) -> object:
        obj = object()
        self.loaded.append(obj)
        return obj


def test_model_handle_shares_one_load_and_frees_with_the_last_reference() -> None:
    loads = _Loads()
    r1 = model_handle.acquire("k-share", loads.load, loads.freed.append)
    r2 = model_handle.acquire("k-share", loads.load, loads.freed.append)
    assert r1.model is r2.model and len(loads.loaded) == 1
    assert model_handle.model_refcounts()["k-share"] == 2
    r1.release()
    r1.release()  # idempotent
    assert loads.freed == [] and model_handle.model_refcounts()["k-share"] == 1
    r2.release()
    assert loads.freed == loads.loaded and "k-share" not in model_handle.model_refcounts()
    r3 = model_handle.acquire("k-share", loads.load, loads.freed.append)  # loads again
    assert len(loads.loaded) == 2 and r3.model is loads.loaded[1]
    r3.release()


def test_model_handle_failed_load_leaves_nothing_and_can_retry() -> None:
    def fail() -> object:
        raise RuntimeError("corrupt")

    with pytest.raises(RuntimeError, match="corrupt"):
        model_handle.acquire("k-fail", fail, lambda _m: None)
    assert "k-fail" not in model_handle.model_refcounts()
    loads = _Loads()
    ref = model_handle.acquire("k-fail", loads.load, loads.freed.append)
    assert ref.model is loads.loaded[0]
    ref.release()


def test_model_handle_concurrent_acquires_load_once() -> None:
    loads = _Loads()
    gate = threading.Event()

    def slow_load() -> object:
        gate.wait(5)
        return loads.load()

    refs: list[model_handle.ModelRef] = []
    threads = [
        threading.Thread(
            target=lambda: refs.append(
                model_handle.acquire("k-conc", slow_load, loads.freed.append)
            )
        )
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert len(refs) == 4 and len(loads.loaded) == 1
    assert all(r.model is loads.loaded[0] for r in refs)
    for r in refs:
        r.release()
    assert loads.freed == loads.loaded
