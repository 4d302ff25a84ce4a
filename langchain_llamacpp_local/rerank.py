"""``LlamaCppRerank``: reorder documents by a local reranker GGUF (pooling ``rank``).

Each (query, document) pair is one sequence, scored by the model's
classification head the way llama.cpp's ``/rerank`` endpoint does: with the
GGUF's ``rerank`` template when it has one (Qwen3-Reranker style), otherwise
``[BOS] query [EOS] [SEP] document [EOS]`` with the vocabulary's own special
tokens (BERT-style cross-encoders). Scores are the head's raw output (a logit
for BERT rerankers, a probability for Qwen3 ones): higher is more relevant.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import anyio
from langchain_core.callbacks import Callbacks
from langchain_core.documents import BaseDocumentCompressor, Document
from pydantic import Field

from langchain_llamacpp_local.embeddings import EngineUser
from langchain_llamacpp_local.errors import ContextOverflowError, model_errors
from langchain_llamacpp_local.llama.embedding import EmbeddingEngine
from langchain_llamacpp_local.validation import check_encodable, check_text, check_texts

_PLACEHOLDER = re.compile(r"(\{query\}|\{document\})")


class LlamaCppRerank(EngineUser, BaseDocumentCompressor):
    """Document compressor that scores (query, document) pairs with a reranker GGUF.

    ``compress_documents`` returns the ``top_n`` best documents, best first, as
    copies whose ``metadata["relevance_score"]`` holds the score; :meth:`rerank`
    gives the scores of plain strings in input order.

    Example:
        .. code-block:: python

            from langchain_llamacpp_local import LlamaCppRerank

            reranker = LlamaCppRerank(model_path="bge-reranker-v2-m3-Q8_0.gguf", top_n=3)
            best = reranker.compress_documents(docs, "How do I reset my password?")
    """

    # model / model_path: a reranker GGUF (its ``pooling_type`` must be ``rank``); the
    # other model and context settings: EngineUser
    top_n: int | None = Field(default=3, ge=0)
    """How many documents ``compress_documents`` keeps (None: all, reordered)."""
    score_threshold: float | None = None
    """Drop documents scoring below this (after ranking)."""
    truncate: bool = False
    """Cut a document that does not fit ``n_ctx`` with its query instead of raising."""

    # ------------------------------------------------------------------ lifecycle

    def _pooling(self) -> str | None:
        return "rank"

    def _unusable(self, eng: EmbeddingEngine) -> str | None:
        if eng.gguf_pooling != "rank":
            return (
                f"{eng.config.model_path} is not a reranker GGUF: its pooling_type is "
                f"{eng.gguf_pooling or 'unset'}, a reranker's is 'rank' (use "
                "LlamaCppEmbeddings for embedding models)"
            )
        return None

    # ------------------------------------------------------------------ scoring

    def _pair_tokens(self, eng: EmbeddingEngine, query: str, doc: str, index: int) -> list[int]:
        """The tokens of one pair, as llama.cpp's server builds them (see module docstring)."""
        if eng.rerank_template:
            parts = _PLACEHOLDER.split(eng.rerank_template.decode("utf-8", errors="replace"))
            d: list[int] = []
            d_start = 0
            tokens: list[int] = []
            for part in parts:
                if part == "{query}":
                    tokens += eng.tokenize(query, add_special=False)
                elif part == "{document}":
                    d_start = len(tokens)
                    d = eng.tokenize(doc, add_special=False)
                    tokens += d
                elif part:  # template text: its special tokens are real ones
                    tokens += eng.tokenize(part, add_special=False, parse_special=True)
            if len(tokens) > eng.n_ctx and self.truncate and d:
                cut = len(tokens) - eng.n_ctx
                if cut < len(d):
                    tokens = tokens[:d_start] + d[: len(d) - cut] + tokens[d_start + len(d) :]
        else:
            q = eng.tokenize(query, add_special=False)
            d = eng.tokenize(doc, add_special=False)
            eos = eng.eos_id if eng.eos_id >= 0 else eng.sep_id
            head = [eng.bos_id] if eng.add_bos else []
            head += q + ([eos] if eng.add_eos else []) + ([eng.sep_id] if eng.add_sep else [])
            tail = [eos] if eng.add_eos else []
            room = eng.n_ctx - len(head) - len(tail)
            if len(d) > room and self.truncate and room > 0:
                d = d[:room]
            tokens = head + d + tail
        if len(tokens) > eng.n_ctx:
            hint = (
                "truncate=True cuts only the document and the query alone leaves no room: "
                "shorten the query or raise n_ctx"
                if self.truncate
                else "pass truncate=True to cut the document, or raise n_ctx"
            )
            raise ContextOverflowError(
                f"document {index} with its query is {len(tokens)} tokens; the limit is "
                f"n_ctx={eng.n_ctx} ({hint})"
            )
        return tokens

    def rerank(self, query: str, documents: Sequence[str]) -> list[float]:
        """The relevance score of each document for ``query``, in input order."""
        with model_errors():
            return self._rerank(query, documents)

    def _rerank(self, query: str, documents: Sequence[str]) -> list[float]:
        check_text(query, "query")
        docs = check_texts(documents, "documents")
        if not docs:
            return []
        # one lease and lock across tokenizing and scoring: this instance's close() cancels
        # the call before its next batch; another instance's close() leaves it alone
        with self._call() as (eng, cancelled):
            check_encodable(query, "the query")
            pairs = [
                self._pair_tokens(eng, query, check_encodable(d, f"document {i}"), i)
                for i, d in enumerate(docs)
            ]
            rows = eng.embed(pairs, cancelled=cancelled)
        return [float(row[0]) for row in rows]

    def compress_documents(
        self,
        documents: Sequence[Document],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[Document]:
        """The ``top_n`` most relevant documents, best first, with ``relevance_score`` metadata."""
        docs = list(documents)
        scores = self.rerank(query, [d.page_content for d in docs])
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
        if self.score_threshold is not None:
            order = [i for i in order if scores[i] >= self.score_threshold]
        if self.top_n is not None:
            order = order[: self.top_n]
        return [
            Document(
                page_content=docs[i].page_content,
                metadata={**docs[i].metadata, "relevance_score": scores[i]},
                id=docs[i].id,
            )
            for i in order
        ]

    async def acompress_documents(
        self,
        documents: Sequence[Document],
        query: str,
        callbacks: Callbacks | None = None,
    ) -> Sequence[Document]:
        """:meth:`compress_documents` on a worker thread; the event loop keeps running."""
        return await anyio.to_thread.run_sync(
            lambda: self.compress_documents(documents, query, callbacks)
        )
