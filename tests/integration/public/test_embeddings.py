"""LlamaCppEmbeddings on real llama.cpp: tiny generated GGUFs (a causal llama, a BERT
encoder) for exact checks, and Gemma 3 270M with mean pooling.

Exactness notes: with flash attention llama.cpp rounds attention through f16, and
its kernels differ between batch shapes, so vectors from different batchings agree
to about 1e-3; with ``flash_attn=False`` they agree to about 1e-4 (values are O(1)), and is what the
pooling and batching comparisons below use.
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_tests.integration_tests import EmbeddingsIntegrationTests

from langchain_llamacpp_local import (
    ChatLlamaCpp,
    ContextOverflowError,
    LlamaCppEmbeddings,
    RequestCancelledError,
)
from langchain_llamacpp_local.embeddings import postprocess
from langchain_llamacpp_local.llama import model_handle
from langchain_llamacpp_local.llama.embedding import (
    EmbeddingConfig,
    EmbeddingEngine,
    head_skips,
)
from tests.gguf_models import BOS_ID, EOS_ID, write_tiny_bert, write_tiny_llama
from tests.helpers import assert_generated

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog, twice, and then rests in the sun.",
    "x",
    "Prices of ünïcode ✓ goods rose 🙂",
    "",
    "Embeddings map text to vectors.",
]
EXACT = {"flash_attn": False}
ATOL = 1e-3  # vectors are O(1); a wrong token or text differs by O(1)


@functools.cache
def _models_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="emb-models-"))


@functools.cache
def tiny_bert_path() -> str:
    return str(write_tiny_bert(_models_dir() / "tiny-bert.gguf"))


@functools.cache
def tiny_llama_path() -> str:
    return str(write_tiny_llama(_models_dir() / "tiny-llama-emb.gguf"))


MODELS = {"bert": tiny_bert_path, "llama": tiny_llama_path}


def _engine(kind: str, **kw: Any) -> EmbeddingEngine:
    return EmbeddingEngine(EmbeddingConfig(model_path=MODELS[kind](), **kw))


def _tokens(eng: EmbeddingEngine, texts: list[str]) -> list[list[int]]:
    return [eng.tokenize(t) for t in texts]


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


# --------------------------------------------------------------------------- standard suite


class TestLlamaCppEmbeddingsStandard(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[LlamaCppEmbeddings]:
        return LlamaCppEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"model_path": tiny_bert_path()}


class TestLlamaCppEmbeddingsStandardCausal(EmbeddingsIntegrationTests):
    @property
    def embeddings_class(self) -> type[LlamaCppEmbeddings]:
        return LlamaCppEmbeddings

    @property
    def embedding_model_params(self) -> dict[str, Any]:
        return {"model_path": tiny_llama_path(), "pooling": "last"}


# --------------------------------------------------------------------------- shapes and norms


@pytest.mark.parametrize(
    ("kind", "pooling"), [("bert", None), ("bert", "cls"), ("llama", None), ("llama", "last")]
)
def test_one_unit_vector_per_text(kind: str, pooling: str | None) -> None:
    emb = LlamaCppEmbeddings(model_path=MODELS[kind](), pooling=pooling)
    vectors = emb.embed_documents(TEXTS)
    assert len(vectors) == len(TEXTS)
    assert all(len(v) == 64 and all(isinstance(x, float) for x in v) for v in vectors)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert len({tuple(np.round(v, 4)) for v in vectors}) == len(TEXTS)  # all distinct
    query = emb.embed_query(TEXTS[0])
    assert len(query) == 64
    assert emb.embed_documents([]) == []
    emb.close()


def test_pooling_comes_from_the_gguf_or_defaults_to_mean() -> None:
    assert _engine("bert").pooling == "mean" and _engine("bert").gguf_pooling == "mean"
    cls_path = str(write_tiny_bert(_models_dir() / "tiny-bert-cls.gguf", pooling="cls"))
    assert EmbeddingEngine(EmbeddingConfig(cls_path)).pooling == "cls"
    llama = _engine("llama")
    assert llama.gguf_pooling is None and llama.pooling == "mean" and llama.causal
    assert llama.fast_pooling  # causal: pooled here, output head skipped
    assert not _engine("bert").fast_pooling  # no output head: llama.cpp pools


# --------------------------------------------------------------------------- pooling is right


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooling_equals_llama_cpp_per_token_vectors(kind: str, pooling: str) -> None:
    """Each pooled vector is the mean / first / last of the per-token rows that a
    pooling-NONE context on the same model returns, text by text."""
    per_token = _engine(kind, pooling="none", **EXACT)
    pooled = _engine(kind, pooling=pooling, **EXACT)
    toks = _tokens(pooled, TEXTS)
    got = pooled.embed(toks)
    for i, t in enumerate(toks):
        rows = per_token.token_vectors(t)
        assert rows.shape == (len(t), 64)
        want = {"mean": rows.mean(axis=0), "cls": rows[0], "last": rows[-1]}[pooling]
        np.testing.assert_allclose(got[i], want, atol=ATOL, err_msg=f"text {i}")


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_fast_pooling_equals_llama_cpp_pooling(pooling: str) -> None:
    """Causal model: numpy pooling with the output head skipped gives llama.cpp's own
    in-graph pooling (a context created with that pooling type)."""
    fast = _engine("llama", pooling=pooling, **EXACT)
    native = _engine("llama", pooling=pooling, fast_pooling=False, **EXACT)
    assert fast.fast_pooling and not native.fast_pooling
    toks = _tokens(fast, TEXTS)
    skips = head_skips()
    got = fast.embed(toks)
    assert head_skips() == skips + 1  # one decode, stopped before the output head
    np.testing.assert_allclose(got, native.embed(toks), atol=ATOL)
    assert head_skips() == skips + 1  # llama.cpp's pooling runs the whole graph


# --------------------------------------------------------------------------- batching


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_batching_equals_one_text_at_a_time(kind: str) -> None:
    many = LlamaCppEmbeddings(model_path=MODELS[kind](), **EXACT)
    texts = TEXTS * 3
    batched = np.array(many.embed_documents(texts))
    single = np.array([many.embed_documents([t])[0] for t in texts])
    np.testing.assert_allclose(batched, single, atol=ATOL)
    # a tight budget: several llama_decode calls, some with one text each
    tight = LlamaCppEmbeddings(model_path=MODELS[kind](), n_ctx=80, n_seq_max=3, **EXACT)
    assert tight._get_engine().n_batch == 81  # rounded up to a multiple of n_seq_max
    np.testing.assert_allclose(np.array(tight.embed_documents(texts)), batched, atol=ATOL)


@pytest.mark.parametrize("kind", ["bert", "llama", "gemma"])
def test_deterministic_vectors_do_not_depend_on_the_batch(kind: str, request: Any) -> None:
    """deterministic=True: a text's vector is bit for bit the same alone or among others."""
    path = request.getfixturevalue("gemma") if kind == "gemma" else MODELS[kind]()
    emb = LlamaCppEmbeddings(model_path=path, deterministic=True)
    texts = TEXTS * 2
    batched = np.array(emb.embed_documents(texts))
    single = np.array([emb.embed_query(t) for t in texts])
    assert np.array_equal(batched, single)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_default_settings_batching_agrees_closely(kind: str) -> None:
    emb = LlamaCppEmbeddings(model_path=MODELS[kind]())
    batched = np.array(emb.embed_documents(TEXTS))
    single = np.array([emb.embed_query(t) for t in TEXTS])
    assert np.min(np.sum(batched * single, axis=1)) > 0.9999  # cosine


# --------------------------------------------------------------------------- inputs


def test_too_long_text_is_an_error_naming_it() -> None:
    emb = LlamaCppEmbeddings(model_path=tiny_bert_path(), n_ctx=16)
    with pytest.raises(
        ContextOverflowError, match=r"text 1 is 42 tokens long; the limit is n_ctx=16"
    ):
        emb.embed_documents(["short", "y" * 40])
    emb.embed_documents(["still serving"])


def test_truncate_keeps_the_first_tokens_and_the_final_eos() -> None:
    eng = _engine("bert", n_ctx=16, **EXACT)
    full = eng.tokenize("z" * 40)
    assert full[0] == BOS_ID and full[-1] == EOS_ID and len(full) == 42
    cut = eng.fit(full, 0, truncate=True)
    assert cut == full[:15] + [EOS_ID]
    emb = LlamaCppEmbeddings(model_path=tiny_bert_path(), n_ctx=16, truncate=True, **EXACT)
    np.testing.assert_allclose(emb.embed_query("z" * 40), _unit(eng.embed([cut])[0]), atol=ATOL)


def test_empty_text_embeds_the_special_tokens_alone() -> None:
    for kind, specials in (("bert", [BOS_ID, EOS_ID]), ("llama", [BOS_ID])):
        eng = _engine(kind, **EXACT)
        assert eng.tokenize("") == specials
        emb = LlamaCppEmbeddings(model_path=MODELS[kind](), **EXACT)
        np.testing.assert_allclose(emb.embed_query(""), _unit(eng.embed([specials])[0]), atol=ATOL)


def test_wrong_input_types_are_rejected() -> None:
    emb = LlamaCppEmbeddings(model_path=tiny_bert_path())
    with pytest.raises(TypeError, match="list of strings"):
        emb.embed_documents("one string")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        emb.embed_documents(["ok", None])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="text must be a string"):
        emb.embed_query(3)  # type: ignore[arg-type]


def test_query_and_document_prefixes() -> None:
    plain = LlamaCppEmbeddings(model_path=tiny_bert_path(), **EXACT)
    pre = LlamaCppEmbeddings(
        model_path=tiny_bert_path(), query_prefix="query: ", document_prefix="passage: ", **EXACT
    )
    np.testing.assert_allclose(pre.embed_query("cats"), plain.embed_query("query: cats"), atol=ATOL)
    np.testing.assert_allclose(
        pre.embed_documents(["cats"])[0], plain.embed_documents(["passage: cats"])[0], atol=ATOL
    )
    assert not np.allclose(pre.embed_query("cats"), pre.embed_documents(["cats"])[0])


def test_dimensions_and_normalize() -> None:
    raw = LlamaCppEmbeddings(model_path=tiny_bert_path(), normalize=False, **EXACT)
    short = LlamaCppEmbeddings(model_path=tiny_bert_path(), dimensions=16, **EXACT)
    r = np.array(raw.embed_query("matryoshka"))
    assert abs(np.linalg.norm(r) - 1.0) > 0.01  # really not normalised
    s = np.array(short.embed_query("matryoshka"))
    assert s.shape == (16,)
    np.testing.assert_allclose(s, _unit(r[:16]), atol=ATOL)
    with pytest.raises(ValueError, match="dimensions=65 exceeds the model's 64"):
        LlamaCppEmbeddings(model_path=tiny_bert_path(), dimensions=65).embed_query("x")


def test_bad_settings_are_errors() -> None:
    with pytest.raises(ValueError, match="exceeds the 512 positions"):
        LlamaCppEmbeddings(model_path=tiny_bert_path(), n_ctx=1024).load()
    with pytest.raises(ValueError, match="n_batch=8 is smaller than n_ctx=16"):
        LlamaCppEmbeddings(model_path=tiny_bert_path(), n_ctx=16, n_batch=8).load()


# --------------------------------------------------------------------------- concurrency


def test_threads_take_turns_on_one_context() -> None:
    emb = LlamaCppEmbeddings(model_path=tiny_llama_path(), **EXACT)
    want = np.array(emb.embed_documents(TEXTS))
    results: dict[int, list[list[float]]] = {}

    def work(i: int) -> None:
        results[i] = emb.embed_documents(TEXTS[i % 3 :] + TEXTS[: i % 3])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, got in results.items():
        k = i % 3
        np.testing.assert_allclose(np.array(got), np.roll(want, -k, axis=0), atol=ATOL)
    assert len(results) == 6


async def test_async_forms_run_off_the_loop() -> None:
    emb = LlamaCppEmbeddings(model_path=tiny_bert_path(), **EXACT)
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    tick_task = asyncio.create_task(ticker())
    docs, query = await asyncio.gather(emb.aembed_documents(TEXTS * 20), emb.aembed_query(TEXTS[0]))
    done.set()
    await tick_task
    assert ticks > 1  # the loop kept running while the model loaded and embedded
    np.testing.assert_allclose(docs[: len(TEXTS)], emb.embed_documents(TEXTS), atol=ATOL)
    np.testing.assert_allclose(query, emb.embed_query(TEXTS[0]), atol=ATOL)


# --------------------------------------------------------------------------- sharing with chat


def _cache_read(msg: Any) -> int:
    return msg.usage_metadata["input_token_details"]["cache_read"]


def test_shares_weights_with_chat_through_a_symlink(tmp_path: Path) -> None:
    """A model file reached through a link (as in Hugging Face's cache, where each name
    links to a hashed blob) is one key for chat and embeddings alike: one set of weights."""
    link = tmp_path / "linked.gguf"
    link.symlink_to(tiny_llama_path())
    chat = ChatLlamaCpp(model_path=str(link), n_slots=1, max_tokens=4, temperature=0)
    emb = LlamaCppEmbeddings(model_path=str(link))
    chat.load()
    emb.load()
    try:
        keys = [k for k in model_handle.model_refcounts() if "linked" in dict(k)["model_path"]]
        assert len(keys) == 1
        assert model_handle.model_refcounts()[keys[0]] >= 2
        assert emb.embed_query("hello")
        assert_generated(chat.invoke("hi"), 4)
    finally:
        emb.close()
        chat.close()


def test_shares_weights_with_chat_and_leaves_its_cache_alone() -> None:
    path = tiny_llama_path()
    chat = ChatLlamaCpp(model_path=path, n_slots=1, max_tokens=4, temperature=0)
    emb = LlamaCppEmbeddings(model_path=path)
    chat.load()
    emb.load()
    keys = [k for k in model_handle.model_refcounts() if dict(k)["model_path"] == path]
    assert len(keys) == 1  # one llama_model ...
    assert model_handle.model_refcounts()[keys[0]] >= 2  # ... used by both contexts

    prompt = "Tell me about the weather in the mountains today, please."

    def turn_pair(between: bool) -> tuple[int, int]:
        first = chat.invoke(prompt + " First.")
        if between:
            emb.embed_documents(TEXTS * 5)
        second = chat.invoke(prompt + " Second.")
        if between:
            emb.embed_query("in between")
        third = chat.invoke(prompt + " First.")
        assert first.content and third.content
        return _cache_read(second), _cache_read(third)

    without = turn_pair(between=False)
    with_embeddings = turn_pair(between=True)
    assert without[0] > 10
    assert with_embeddings == without
    chat.close()
    emb.close()


# --------------------------------------------------------------------------- Gemma 3 270M


@pytest.mark.gemma
def test_gemma_embeds_with_mean_pooling(gemma: str) -> None:
    emb = LlamaCppEmbeddings(model_path=gemma, n_seq_max=64)
    eng = emb._get_engine()
    assert eng.pooling == "mean" and eng.fast_pooling and eng.n_embd == 640
    skips = head_skips()
    texts = [
        "The cat sleeps on the warm windowsill.",
        "A kitten naps in the sun by the window.",
        "Quarterly earnings beat analyst expectations.",
        "",
    ]
    vectors = np.array(emb.embed_documents(texts))
    assert head_skips() == skips + 1  # Gemma's 262k-token output head was not computed
    assert vectors.shape == (4, 640)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    single = np.array([emb.embed_query(t) for t in texts])
    assert np.min(np.sum(vectors * single, axis=1)) > 0.999
    native = EmbeddingEngine(
        EmbeddingConfig(model_path=eng.config.model_path, pooling="mean", fast_pooling=False)
    )
    assert native.model == eng.model  # one llama_model for both contexts
    ref = postprocess(
        native.embed([native.tokenize(t) for t in texts]), dimensions=None, normalize=True
    )
    assert np.min(np.sum(vectors * ref, axis=1)) > 0.999
    emb.close()
    native.close()


def test_close_cancels_a_running_batch() -> None:
    """close() on another thread stops a running ``embed_documents`` before its next
    ``llama_decode`` (the call raises ``RequestCancelledError``, as a closed
    ``ChatLlamaCpp``'s calls do) instead of waiting for all its texts; the instance
    works again afterwards."""
    emb = LlamaCppEmbeddings(model_path=tiny_llama_path(), deterministic=True).load()
    texts = [f"text number {i} " * 8 for i in range(100)]  # one llama_decode per text
    t0 = time.perf_counter()
    want = emb.embed_documents(texts[:3])
    emb.embed_documents(texts)
    per_pass = time.perf_counter() - t0
    many = texts * max(2, int(6.0 / per_pass))  # some 6 s of work
    outcome: list[BaseException | None] = []

    def run(batch: list[str]) -> None:
        try:
            emb.embed_documents(batch)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    for _ in range(4):  # the first pass's timing can be skewed by other load: more work
        t = threading.Thread(target=run, args=(many,))
        t.start()
        time.sleep(0.5)
        if t.is_alive():
            break
        t.join()
        outcome.clear()
        many = many * 4
    t0 = time.perf_counter()
    emb.close()
    waited = time.perf_counter() - t0
    t.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], RequestCancelledError), outcome
    assert waited < 2.0, f"close() waited {waited:.1f} s for the running batch"
    np.testing.assert_allclose(emb.embed_documents(texts[:3]), want, atol=ATOL)


def test_close_cancels_only_its_own_instances_calls() -> None:
    """Two instances with equal settings share one context: ``close()`` of one cancels
    its own running call, never the other's, which finishes with the same vectors."""
    a = LlamaCppEmbeddings(model_path=tiny_llama_path(), deterministic=True).load()
    b = LlamaCppEmbeddings(model_path=tiny_llama_path(), deterministic=True)
    texts = [f"text number {i} " * 8 for i in range(60)]
    want = a.embed_documents(texts)
    t0 = time.perf_counter()
    a.embed_documents(texts)
    many = texts * max(2, int(3.0 / (time.perf_counter() - t0)))  # some 3 s of work
    outcome: list[object] = []
    finished: list[float] = []

    def run(batch: list[str]) -> None:
        try:
            outcome.append(b.embed_documents(batch))
        except BaseException as exc:
            outcome.append(exc)
        finished.append(time.perf_counter())

    for _ in range(4):  # the first pass's timing can be skewed by other load: more work
        t = threading.Thread(target=run, args=(many,))
        t.start()
        time.sleep(0.5)
        if t.is_alive():
            break
        t.join()
        outcome.clear()
        finished.clear()
        many = many * 4
    a.close()
    closed_at = time.perf_counter()
    t.join(60)
    assert finished and finished[0] > closed_at, "the other call ended before close()"
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    np.testing.assert_allclose(outcome[0][: len(texts)], want, atol=ATOL)


def test_close_of_an_instance_that_never_ran_frees_nothing() -> None:
    """``close()`` frees only the contexts its own instance used: closing an instance
    that never ran (here with the settings of a loaded one) neither resolves its model
    nor frees the context another instance holds."""
    a = LlamaCppEmbeddings(model_path=tiny_bert_path()).load()
    eng = a._get_engine()
    LlamaCppEmbeddings(model_path=tiny_bert_path()).close()
    assert not eng.closed
    a.embed_query("still here")
    assert a._get_engine() is eng  # the same context, not a new one
    a.close()
    assert eng.closed


def test_an_instance_refused_by_its_own_settings_leaves_the_shared_context() -> None:
    """``dimensions`` beyond the model's is this instance's error: the context it shares
    with other instances of equal settings stays loaded for them."""
    a = LlamaCppEmbeddings(model_path=tiny_bert_path()).load()
    eng = a._get_engine()
    with pytest.raises(ValueError, match="dimensions=65 exceeds the model's 64"):
        LlamaCppEmbeddings(model_path=tiny_bert_path(), dimensions=65).embed_query("x")
    assert not eng.closed
    assert a._get_engine() is eng
    a.close()


def test_close_during_the_load_cancels_the_call() -> None:
    """A call whose context is still being leased (loading) is cancelled by a
    ``close()`` that runs meanwhile: it raises ``RequestCancelledError`` right after the
    lease instead of running all its texts; the instance works again afterwards."""
    from langchain_llamacpp_local.runtime import registry

    emb = LlamaCppEmbeddings(model_path=tiny_bert_path())
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(emb.embed_documents(["a", "b"]))
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=run)
    closer = threading.Thread(target=emb.close)
    with registry._lock:  # the lease waits here, as behind a slow load
        t.start()
        deadline = time.monotonic() + 3.0
        while not emb._running and time.monotonic() < deadline:
            time.sleep(0.01)
        closer.start()  # (a thread: code that takes the registry's lock in close() waits)
        time.sleep(0.2)
    closer.join(30)
    t.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], RequestCancelledError), outcome
    assert len(emb.embed_documents(["a", "b"])) == 2
    emb.close()
