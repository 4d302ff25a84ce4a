"""``LlamaCppEmbeddings``: one vector per text from a local GGUF model, in-process.

The weights are shared with any :class:`~langchain_llamacpp_local.ChatLlamaCpp`
on the same file and load settings; the embedding context is separate, so
embedding calls never touch the chat model's slots or prompt cache.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import anyio
import numpy as np
from langchain_core.embeddings import Embeddings
from pydantic import ConfigDict, Field, PrivateAttr
from typing_extensions import Self

from langchain_llamacpp_local.errors import RequestCancelledError, model_errors
from langchain_llamacpp_local.llama.embedding import EmbeddingConfig, EmbeddingEngine
from langchain_llamacpp_local.llama.model_handle import model_file
from langchain_llamacpp_local.llama.settings import MAX_SEQ
from langchain_llamacpp_local.resolution.model_resolution import MMPROJ_NONE
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.settings_base import ModelSettings, settings_from
from langchain_llamacpp_local.validation import (
    check_dimensions,
    check_encodable,
    check_text,
    check_texts,
)

logger = logging.getLogger(__name__)

#: Query/document prefixes of common embedding models (their model cards), to pass
#: as ``LlamaCppEmbeddings(model_path=..., **PREFIXES["nomic"])``.
PREFIXES: dict[str, dict[str, str]] = {
    "nomic": {"query_prefix": "search_query: ", "document_prefix": "search_document: "},
    "e5": {"query_prefix": "query: ", "document_prefix": "passage: "},
    "embeddinggemma": {
        "query_prefix": "task: search result | query: ",
        "document_prefix": "title: none | text: ",
    },
    "bge": {
        "query_prefix": "Represent this sentence for searching relevant passages: ",
        "document_prefix": "",
    },
    "qwen3": {
        "query_prefix": (
            "Instruct: Given a web search query, retrieve relevant passages that answer "
            "the query\nQuery:"
        ),
        "document_prefix": "",
    },
    "mxbai": {
        "query_prefix": "Represent this sentence for searching relevant passages: ",
        "document_prefix": "",
    },
}


def postprocess(vectors: np.ndarray, *, dimensions: int | None, normalize: bool) -> np.ndarray:
    """Keep the first ``dimensions`` values (Matryoshka), then L2-normalise each row.

    Truncation comes first so the shortened vector is unit length again; an
    all-zero row stays zero instead of becoming NaN.
    """
    if dimensions is not None:
        if not 0 < dimensions <= vectors.shape[1]:
            raise ValueError(
                f"dimensions={dimensions} is outside 1..{vectors.shape[1]} (the model's size)"
            )
        vectors = vectors[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
        vectors = (vectors / np.where(norms > 0, norms, 1.0)).astype(np.float32)
    return vectors


class EngineHolder:
    """An embedding or rerank context as the model registry holds it (``alive`` and
    ``stop()``, as a chat worker): instances with equal settings share it, and it is
    freed after ``keep_alive`` seconds of idleness or when evicted."""

    def __init__(self, config: EmbeddingConfig) -> None:
        self.engine = EmbeddingEngine(config)

    @property
    def alive(self) -> bool:
        return not self.engine.closed

    def stop(self, timeout: float | None = None) -> None:
        """Free the context. The registry calls it only once no lease is held, so no
        call runs on it; a call still holding the engine's lock is waited for. Cancelling
        calls is each instance's own ``close()`` (docs/embeddings.md)."""
        self.engine.close()


class EngineUser(ModelSettings):
    """What embeddings and rerank share: their context settings and the leased context."""

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=(), extra="forbid")

    # model / model_path, models_dir, keep_alive, validate_model_on_init: ModelSelection;
    # n_threads, n_gpu_layers, use_mmap, use_mlock, cpu_amx: ModelSettings
    n_ctx: int | None = Field(default=EmbeddingConfig.n_ctx, gt=0)
    """Longest input in tokens, a text or a (query, document) pair (default: the model's
    trained length, capped at 512)."""
    n_batch: int | None = Field(default=EmbeddingConfig.n_batch, gt=0)
    """Tokens per ``llama_decode`` (default and minimum: ``n_ctx``)."""
    n_seq_max: int = Field(default=EmbeddingConfig.n_seq_max, ge=1, le=MAX_SEQ)
    """Most texts (or pairs) per ``llama_decode``."""
    flash_attn: bool | None = EmbeddingConfig.flash_attn
    """Flash attention: True/False, or None to let llama.cpp decide."""
    deterministic: bool = EmbeddingConfig.deterministic
    """One text per ``llama_decode``: a text's result does not depend on the batch it
    would otherwise share (slower for many short texts)."""

    #: the cancel flags of this instance's running calls (:meth:`close` sets them)
    _running: set[threading.Event] = PrivateAttr(default_factory=set)
    #: the contexts this instance leased: the only ones its :meth:`close` frees (closing
    #: an instance that never ran resolves nothing, so it never downloads a model)
    _acquired: set[EmbeddingConfig] = PrivateAttr(default_factory=set)

    def _pooling(self) -> str | None:
        """The context's pooling (None: the GGUF's)."""
        raise NotImplementedError

    def _engine_config(self, model_path: str) -> EmbeddingConfig:
        return settings_from(self, EmbeddingConfig, model_path=model_path, pooling=self._pooling())

    def _unusable(self, eng: EmbeddingEngine) -> str | None:
        """Why this class can never use the context (a reranker for embeddings...), or
        None. Such a context is freed again, as no instance of this class can use it."""
        return None

    def _check_engine(self, eng: EmbeddingEngine) -> None:
        """Refuse a context that does not fit this instance's settings (its
        ``dimensions``...); the context stays loaded for the instances that fit it."""

    def _config(self) -> EmbeddingConfig:
        return self._engine_config(model_file(self._resolve(None, MMPROJ_NONE).model_path))

    def _lease(self) -> tuple[registry.Lease, EmbeddingEngine]:
        """Hold the shared context for one call, creating it (and loading the weights)
        if needed; a context this class cannot use is freed again."""
        config = self._config()
        lease = registry.acquire(
            config,
            None,
            keep_alive=self.keep_alive,
            factory=functools.partial(EngineHolder, config),
        )
        self._acquired.add(config)
        eng: EmbeddingEngine = lease.worker.engine  # type: ignore[attr-defined]
        why = self._unusable(eng)
        if why is not None:
            lease.release()
            registry.unload(config, None)
            raise ValueError(why)
        try:
            self._check_engine(eng)
        except BaseException:
            lease.release()  # other instances with these settings keep the context
            raise
        return lease, eng

    @contextmanager
    def _call(self) -> Iterator[tuple[EmbeddingEngine, Callable[[], bool]]]:
        """One call on the shared context: its lease and lock, and a cancel check that
        :meth:`close` of this instance (not another one sharing the context) sets. The
        flag exists before the lease, so a close() during the load cancels the call."""
        cancelled = threading.Event()
        self._running.add(cancelled)
        try:
            lease, engine = self._lease()
            if cancelled.is_set():  # close() ran during the load: free what it missed
                lease.release()
                self._acquired.discard(engine.config)
                registry.unload(engine.config, None)
                raise RequestCancelledError("the call was cancelled by close()")
            try:
                with engine.using() as eng:
                    yield eng, cancelled.is_set
            finally:
                lease.release()
        finally:
            self._running.discard(cancelled)

    def _get_engine(self) -> EmbeddingEngine:
        lease, eng = self._lease()
        lease.release()
        return eng

    def load(self) -> Self:
        """Load the model and create its context now (otherwise the first call does); it
        then stays loaded for ``keep_alive`` seconds of idleness."""
        self._get_engine()
        return self

    def close(self) -> None:
        """Cancel this instance's running calls (each raises ``RequestCancelledError``
        before its next batch, as ``ChatLlamaCpp.close()`` cancels its calls), then free
        the contexts it used once no call uses them; the next call creates one again.
        Calls of other instances sharing a context finish undisturbed. An instance
        that never ran has nothing to free (its model is not even resolved)."""
        for cancelled in list(self._running):
            cancelled.set()
        acquired = list(self._acquired)
        self._acquired.clear()
        for config in acquired:
            registry.unload(config, None)


class LlamaCppEmbeddings(EngineUser, Embeddings):
    """Embeddings from a local GGUF model run in-process by llama.cpp.

    Exactly one vector per text: the model's pooling (``<arch>.pooling_type`` in
    the GGUF; ``mean`` for generative models, which name none) or ``pooling``,
    L2-normalised unless ``normalize=False``. Many texts go through one
    ``llama_decode`` as separate sequences. A text longer than ``n_ctx`` tokens is
    an error naming it, or is cut with ``truncate=True``. An empty text embeds the
    model's special tokens alone (BOS, and EOS for BERT-style models; a model that adds
    none embeds its end-of-text token).

    Setup:
        ``pip install langchain-llamacpp-local``

    Example:
        .. code-block:: python

            from langchain_llamacpp_local import LlamaCppEmbeddings
            from langchain_llamacpp_local.embeddings import PREFIXES

            emb = LlamaCppEmbeddings(model_path="nomic-embed-text-v1.5.Q8_0.gguf",
                                     **PREFIXES["nomic"])
            vectors = emb.embed_documents(["a cat", "a dog"])
            query = emb.embed_query("pets")
    """

    pooling: Literal["mean", "cls", "last"] | None = None
    """Pooling override; None uses the GGUF's ``pooling_type`` (``mean`` if it has none)."""
    normalize: bool = True
    """L2-normalise each vector (after ``dimensions``), as Ollama and llama.cpp's server do."""
    dimensions: int | None = Field(default=None, gt=0)
    """Keep only the first this many values (Matryoshka models), re-normalised."""
    query_prefix: str = ""
    """Text put before every query (e.g. ``"search_query: "`` for nomic; see ``PREFIXES``)."""
    document_prefix: str = ""
    """Text put before every document (e.g. ``"search_document: "`` for nomic)."""
    truncate: bool = False
    """Cut texts longer than ``n_ctx`` tokens instead of raising ``ContextOverflowError``."""
    # ------------------------------------------------------------------ lifecycle

    def _pooling(self) -> str | None:
        return self.pooling

    def _unusable(self, eng: EmbeddingEngine) -> str | None:
        if eng.pooling == "rank":
            return (
                f"{eng.config.model_path} is a reranker (pooling 'rank'): use LlamaCppRerank, "
                "or pass pooling='mean'/'cls'/'last' for its hidden states"
            )
        return None

    def _check_engine(self, eng: EmbeddingEngine) -> None:
        check_dimensions(self.dimensions, eng.n_embd)

    # ------------------------------------------------------------------ embedding

    def _embed(self, texts: list[str], prefix: str) -> list[list[float]]:
        if not texts:
            return []
        # tokenize and embed under a lease and the engine's lock: the context is freed
        # after this call, never under it; this instance's close() cancels it before
        # its next batch, another instance's close() leaves it alone
        with self._call() as (eng, cancelled):
            tokens = [
                eng.fit(
                    eng.tokenize(prefix + check_encodable(text, f"text {i}")),
                    i,
                    truncate=self.truncate,
                )
                for i, text in enumerate(texts)
            ]
            rows = eng.embed(tokens, cancelled=cancelled)
        vectors = postprocess(rows, dimensions=self.dimensions, normalize=self.normalize)
        return vectors.tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One vector per text, in order (``document_prefix`` is put before each)."""
        with model_errors():
            return self._embed(check_texts(texts), self.document_prefix)

    def embed_query(self, text: str) -> list[float]:
        """The vector of one query (``query_prefix`` is put before it)."""
        with model_errors():
            return self._embed([check_text(text)], self.query_prefix)[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """:meth:`embed_documents` on a worker thread; the event loop keeps running."""
        return await anyio.to_thread.run_sync(self.embed_documents, texts)

    async def aembed_query(self, text: str) -> list[float]:
        """:meth:`embed_query` on a worker thread; the event loop keeps running."""
        return await anyio.to_thread.run_sync(self.embed_query, text)
