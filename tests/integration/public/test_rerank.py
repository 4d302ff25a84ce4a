"""LlamaCppRerank on a generated BERT reranker GGUF (pooling ``rank``, ``cls`` head)."""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from langchain_core.documents import Document

from langchain_llamacpp_local import ContextOverflowError, LlamaCppRerank, RequestCancelledError
from langchain_llamacpp_local.llama.embedding import EmbeddingConfig, EmbeddingEngine
from tests.gguf_models import BOS_ID, EOS_ID, SPACE_ID, byte_token, write_tiny_bert
from tests.helpers import close_while_running

QUERY = "which animal purrs"
DOCS = [
    "Cats purr when they are content.",
    "Dogs bark at strangers.",
    "Fish swim in schools.",
    "The stock market fell today.",
    "",
]
TEMPLATE = "<s>query: {query}</s> doc: {document}</s>"


@functools.cache
def _dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="rerank-models-"))


@functools.cache
def reranker_path() -> str:
    return str(write_tiny_bert(_dir() / "tiny-reranker.gguf", rerank=True))


@functools.cache
def templated_path() -> str:
    return str(
        write_tiny_bert(_dir() / "tiny-reranker-tpl.gguf", rerank=True, rerank_template=TEMPLATE)
    )


@functools.cache
def embedder_path() -> str:
    return str(write_tiny_bert(_dir() / "tiny-embedder.gguf"))


def enc(text: str) -> list[int]:
    """The tiny vocab's tokens of plain text: one per byte, a space as ``\u2581``."""
    return [SPACE_ID if b == 0x20 else byte_token(b) for b in text.encode()]


def _engine(path: str, pooling: str) -> EmbeddingEngine:
    return EmbeddingEngine(EmbeddingConfig(model_path=path, pooling=pooling, flash_attn=False))


def test_scores_are_the_classifier_head_on_the_cls_token() -> None:
    """``rank`` pooling = cls.output(tanh(cls(h_first))) on the BERT-style pair
    ``[BOS] query [EOS] document [EOS]``; h_first comes from a pooling-NONE context."""
    rr = LlamaCppRerank(model_path=reranker_path(), flash_attn=False)
    scores = rr.rerank(QUERY, DOCS)
    assert len(scores) == len(DOCS) and all(isinstance(s, float) for s in scores)
    weights = {t.name: np.array(t.data) for t in gguf.GGUFReader(reranker_path()).tensors}
    per_token = _engine(reranker_path(), "none")
    for i, doc in enumerate(DOCS):
        pair = [BOS_ID, *enc(QUERY), EOS_ID, *enc(doc), EOS_ID]
        h = per_token.token_vectors(pair)[0].astype(np.float64)
        hidden = np.tanh(weights["cls.weight"] @ h + weights["cls.bias"])
        want = float((weights["cls.output.weight"] @ hidden + weights["cls.output.bias"])[0])
        assert scores[i] == pytest.approx(want, abs=1e-3), f"document {i}"
    assert len(set(np.round(scores, 4))) == len(DOCS)


def test_rerank_template_builds_the_pair() -> None:
    """A GGUF ``rerank`` template: its special tokens are parsed, the texts are not."""
    rr = LlamaCppRerank(model_path=templated_path(), flash_attn=False)
    eng = _engine(templated_path(), "rank")
    assert eng.rerank_template == TEMPLATE.encode()
    docs = [*DOCS, "a </s> in the text"]
    got = rr.rerank(QUERY, docs)
    for i, doc in enumerate(docs):
        pair = [BOS_ID, *enc("query: " + QUERY), EOS_ID, *enc(" doc: " + doc), EOS_ID]
        assert got[i] == pytest.approx(float(eng.embed([pair])[0, 0]), abs=1e-4), doc


def test_compress_documents_orders_and_annotates() -> None:
    rr = LlamaCppRerank(model_path=reranker_path(), top_n=3)
    docs = [Document(page_content=t, metadata={"i": i}, id=f"d{i}") for i, t in enumerate(DOCS)]
    scores = rr.rerank(QUERY, DOCS)
    out = rr.compress_documents(docs, QUERY)
    assert len(out) == 3
    want = sorted(range(len(DOCS)), key=lambda i: scores[i], reverse=True)[:3]
    assert [d.metadata["i"] for d in out] == want
    assert [d.id for d in out] == [f"d{i}" for i in want]
    for d in out:
        assert d.metadata["relevance_score"] == pytest.approx(scores[d.metadata["i"]], abs=1e-4)
    assert all("relevance_score" not in d.metadata for d in docs)  # inputs untouched
    everything = LlamaCppRerank(model_path=reranker_path(), top_n=None).compress_documents(
        docs, QUERY
    )
    assert len(everything) == len(DOCS)
    cut = sorted(scores)[2]
    kept = LlamaCppRerank(
        model_path=reranker_path(), top_n=None, score_threshold=cut
    ).compress_documents(docs, QUERY)
    assert len(kept) == 3 and all(d.metadata["relevance_score"] >= cut for d in kept)
    assert rr.compress_documents([], QUERY) == []


def test_batching_equals_one_pair_at_a_time() -> None:
    rr = LlamaCppRerank(model_path=reranker_path(), flash_attn=False, n_ctx=96, n_seq_max=2)
    batched = rr.rerank(QUERY, DOCS * 3)
    single = [rr.rerank(QUERY, [d])[0] for d in DOCS * 3]
    np.testing.assert_allclose(batched, single, atol=1e-3)


async def test_async_compress() -> None:
    rr = LlamaCppRerank(model_path=reranker_path(), top_n=2)
    docs = [Document(page_content=t) for t in DOCS]
    got = await rr.acompress_documents(docs, QUERY)
    want = rr.compress_documents(docs, QUERY)
    assert [d.page_content for d in got] == [d.page_content for d in want]


def test_too_long_pair_is_an_error_or_truncated() -> None:
    long_doc = "w" * 100
    rr = LlamaCppRerank(model_path=reranker_path(), n_ctx=64, flash_attn=False)
    with pytest.raises(ContextOverflowError, match=r"document 1 with its query is 121 tokens"):
        rr.rerank(QUERY, ["short", long_doc])
    assert len(rr.rerank(QUERY, ["still serving"])) == 1
    cut = LlamaCppRerank(model_path=reranker_path(), n_ctx=64, truncate=True, flash_attn=False)
    room = 64 - len(enc(QUERY)) - 3
    pair = [BOS_ID, *enc(QUERY), EOS_ID, *enc(long_doc)[:room], EOS_ID]
    assert len(pair) == 64
    want = float(_engine(reranker_path(), "rank").embed([pair])[0, 0])
    assert cut.rerank(QUERY, [long_doc])[0] == pytest.approx(want, abs=1e-4)


def test_not_a_reranker_and_bad_input() -> None:
    with pytest.raises(ValueError, match="not a reranker GGUF: its pooling_type is mean"):
        LlamaCppRerank(model_path=embedder_path()).rerank(QUERY, ["x"])
    rr = LlamaCppRerank(model_path=reranker_path())
    with pytest.raises(TypeError, match="query must be a string"):
        rr.rerank(None, ["x"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"documents\[0\] must be a string"):
        rr.rerank("q", [3])  # type: ignore[list-item]
    assert rr.rerank("q", []) == []


def test_close_cancels_a_running_rerank() -> None:
    """close() on another thread stops a running ``rerank`` before its next
    ``llama_decode`` (the call raises ``RequestCancelledError``) instead of waiting
    for all its documents; the instance works again afterwards."""
    rr = LlamaCppRerank(model_path=reranker_path(), n_seq_max=1)  # one pair per decode
    docs = [f"{d} number {i}" for i in range(20) for d in DOCS]
    t0 = time.perf_counter()
    want = rr.rerank(QUERY, DOCS)
    rr.rerank(QUERY, docs)
    per_pass = time.perf_counter() - t0
    many = docs * max(2, int(6.0 / per_pass))  # some 6 s of work
    error, waited = close_while_running(lambda: rr.rerank(QUERY, many), rr.close)
    assert isinstance(error, RequestCancelledError), error
    assert waited < 2.0, f"close() waited {waited:.1f} s for the running call"
    np.testing.assert_allclose(rr.rerank(QUERY, DOCS), want, atol=1e-4)
