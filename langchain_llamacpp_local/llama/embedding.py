"""A llama.cpp context that turns token lists into one vector (or rerank score) each.

It shares the ``llama_model`` of any chat model on the same file and load
settings (:func:`loading.load_model`) but owns its own context, created with
``embeddings=True``, a unified KV cache and up to ``n_seq_max`` sequences:
many texts go through one ``llama_decode`` as separate sequences, and the
memory is cleared after each batch, so nothing is kept between calls.

Pooling follows the GGUF (``<arch>.pooling_type``; ``mean`` when it names
none, as for generative models) unless overridden. llama.cpp pools inside the
graph, but for a *causal* model an embedding context also runs the output
head (``n_vocab`` logits) for every token, which costs more than the rest of a
small model. For those models the context is created without pooling, an eval
callback stops the graph once the final hidden state (``t_embd``) is computed,
and the mean/first/last row is taken here with numpy: the same numbers as
llama.cpp's pooling (tested), at prefill speed.

Every public call (:meth:`tokenize`, :meth:`embed`, :meth:`token_vectors`) and
:meth:`close` take the engine's one (re-entrant) lock, so callers on several
threads take turns and nothing is freed under a running call; a caller that
needs several calls to see one context (tokenize, then embed) holds
:attr:`lock` around them (:meth:`using`). A call on a closed engine raises
:class:`~.errors.RequestCancelledError`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import llama_cpp.llama_cpp as C
import numpy as np

from langchain_llamacpp_local.errors import (
    ContextOverflowError,
    DecodeError,
    RequestCancelledError,
)
from langchain_llamacpp_local.llama import loading, vocab
from langchain_llamacpp_local.llama.context import (
    fill_batch,
    flash_attn_type,
    free_context,
    new_context,
)
from langchain_llamacpp_local.llama.omp import ran_team, release_team
from langchain_llamacpp_local.llama.settings import MAX_SEQ
from langchain_llamacpp_local.llama.threads import (
    cpu_budget,
    default_cpu_view,
    log_thread_plan,
    plan_threads,
)

logger = logging.getLogger(__name__)

#: llama.cpp's ``enum llama_pooling_type`` by name.
POOLING_TYPES: dict[str, int] = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
_POOLING_NAMES = {v: k for k, v in POOLING_TYPES.items()}


#: Default longest text in tokens, as llama.cpp's server (its default n_ubatch).
DEFAULT_MAX_TOKENS = 512

# In a pooling-NONE embedding context llama.cpp's build_pooling names the final normed
# hidden state (t_embd, "result_norm" in the model graph) "result_embd_pooled"; the
# output head is computed after it.
_T_EMBD = b"result_embd_pooled"


@dataclass(frozen=True)
class EmbeddingConfig:
    """Everything that decides an embedding context; equal configs share one engine."""

    model_path: str
    pooling: str | None = None  # None: the GGUF's, or mean when it names none
    n_ctx: int | None = None  # longest text in tokens (default: min(trained, 512))
    n_batch: int | None = None  # tokens per llama_decode (default and minimum: n_ctx)
    n_seq_max: int = MAX_SEQ  # texts per llama_decode
    n_threads: int | None = None
    n_gpu_layers: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    cpu_amx: bool | None = None  # weights in the AMX buffer type (weights.py)
    flash_attn: bool | None = None
    fast_pooling: bool = True  # causal models: pool in numpy, skip the output head
    # one text per llama_decode: a text's vector does not depend on the texts beside it
    deterministic: bool = False

    def load_config(self) -> loading.LoadConfig:
        """The model-loading part, so a chat model with the same settings shares the weights."""
        return loading.LoadConfig(
            model_path=self.model_path,
            n_gpu_layers=self.n_gpu_layers,
            use_mmap=self.use_mmap,
            use_mlock=self.use_mlock,
            cpu_amx=self.cpu_amx,
        )


def pack(lengths: Sequence[int], n_batch: int, n_seq_max: int) -> list[tuple[int, int]]:
    """Split texts (by token count) into consecutive ``[start, end)`` groups for one decode each.

    A group holds at most ``n_seq_max`` texts and ``n_batch`` tokens; every
    length must already be between 1 and ``n_batch``.
    """
    groups: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, n in enumerate(lengths):
        if not 0 < n <= n_batch:
            raise ValueError(f"text {i} has {n} tokens; each must have 1..{n_batch}")
        if i > start and (used + n > n_batch or i - start >= n_seq_max):
            groups.append((start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        groups.append((start, len(lengths)))
    return groups


def pool(rows: np.ndarray, offsets: Sequence[int], pooling: str) -> np.ndarray:
    """Pool per-token rows (``[n_tokens, dim]``) of consecutive texts starting at ``offsets``.

    ``mean`` averages a text's rows, ``cls`` takes its first and ``last`` its
    last, as llama.cpp's pooling does.
    """
    bounds = [*offsets, len(rows)]
    out = np.empty((len(offsets), rows.shape[1]), dtype=np.float32)
    for k in range(len(offsets)):
        a, b = bounds[k], bounds[k + 1]
        if pooling == "mean":
            out[k] = rows[a:b].mean(axis=0, dtype=np.float64)
        elif pooling == "cls":
            out[k] = rows[a]
        elif pooling == "last":
            out[k] = rows[b - 1]
        else:
            raise ValueError(f"cannot pool {pooling!r} here")
    return out


_ggml_get_name = C._lib.ggml_get_name
_ggml_get_name.restype = ctypes.c_char_p
_ggml_get_name.argtypes = [ctypes.c_void_p]


@C.ggml_backend_sched_eval_callback
def _stop_after_t_embd(tensor: int, ask: bool, _user: ctypes.c_void_p) -> bool:
    """Compute the graph up to the embeddings (``t_embd``) and cancel the rest (the output head).

    Asked for every node (``ask``), it wants only ``t_embd``; shown that node's
    value, returning False makes ggml's scheduler skip the remaining nodes.
    """
    if ask:
        return _ggml_get_name(tensor) == _T_EMBD
    _head_skips[0] += 1
    return False


_head_skips = [0]


def head_skips() -> int:
    """How many graph computations stopped before the output head (diagnostics, tests)."""
    return _head_skips[0]


class EmbeddingEngine:
    """An embedding (or reranking) context on a shared model (see module docstring)."""

    def __init__(self, config: EmbeddingConfig) -> None:
        if config.pooling is not None and config.pooling not in POOLING_TYPES:
            raise ValueError(
                f"pooling={config.pooling!r} is not a pooling type; use one of "
                f"{sorted(POOLING_TYPES)}"
            )
        if config.n_seq_max < 1:
            raise ValueError(f"n_seq_max must be at least 1, got {config.n_seq_max}")
        self.config = config
        self.lock = threading.RLock()
        self.ctx = None
        self._batch: C.llama_batch | None = None
        self._model_ref = loading.load_model(config.load_config())
        try:
            self._init_context()
        except BaseException:
            self.close()
            raise

    def _init_context(self) -> None:
        config = self.config
        model = self.model = self._model_ref.model
        self.vocab = C.llama_model_get_vocab(model)
        meta = vocab.read_metadata(model)
        self.arch = meta.get("general.architecture") or ""
        self.name = meta.get("general.name") or os.path.basename(config.model_path)
        self.n_ctx_train = int(C.llama_model_n_ctx_train(model))
        self.n_embd = int(C.llama_model_n_embd_out(model))
        self.n_cls_out = int(C.llama_model_n_cls_out(model))
        self.causal = (meta.get(f"{self.arch}.attention.causal") or "true") != "false"
        gguf_pool = meta.get(f"{self.arch}.pooling_type")
        self.gguf_pooling = _POOLING_NAMES.get(int(gguf_pool)) if gguf_pool else None
        self.pooling = config.pooling or (
            self.gguf_pooling if self.gguf_pooling not in (None, "none") else "mean"
        )
        self.rerank_template = C.llama_model_chat_template(model, b"rerank")

        n_ctx = config.n_ctx or min(self.n_ctx_train or DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS)
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be at least 1, got {n_ctx}")
        if self.n_ctx_train and n_ctx > self.n_ctx_train:
            raise ValueError(
                f"n_ctx={n_ctx} exceeds the {self.n_ctx_train} positions {self.name} was trained on"
            )
        n_batch = config.n_batch or n_ctx
        if n_batch < n_ctx:
            raise ValueError(
                f"n_batch={n_batch} is smaller than n_ctx={n_ctx}: a text is embedded in one "
                "llama_decode, so n_batch must hold the longest text"
            )
        # The fast path: causal models pool here, skipping the n_vocab output head;
        # not for models whose pooled vector goes through extra dense layers.
        dense = any(".dense_2" in k or ".dense_3" in k for k in meta)
        int_embd = int(C.llama_model_n_embd(model))
        self.fast_pooling = (
            config.fast_pooling
            and self.causal
            and self.pooling in ("mean", "cls", "last")
            and not dense
            and self.n_embd == int_embd
        )
        ctx_pooling = "none" if self.fast_pooling else self.pooling

        n_seq = max(1, min(config.n_seq_max, MAX_SEQ, n_batch))
        # llama.cpp reserves its graphs for n_ubatch tokens over n_seq_max sequences and
        # rounds the tokens up to a multiple of the sequences: a pooled graph then fails
        # an assert (abort) unless n_batch already is one.
        n_batch = -(-n_batch // n_seq) * n_seq
        cparams = C.llama_context_default_params()
        cparams.n_ctx = n_batch  # one batch at a time; memory is cleared after each
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch  # pooling and non-causal attention need a whole text per ubatch
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True
        cparams.embeddings = True
        cparams.pooling_type = POOLING_TYPES[ctx_pooling]
        # texts are prompt steps (compute-bound): the batch thread count for both
        self.thread_plan = plan = plan_threads(
            default_cpu_view(), config.n_threads, config.n_threads
        )
        log_thread_plan(plan)
        self._threads_set = plan.n_threads_batch
        # a deterministic context keeps one team size (as chat's, engine.py): the
        # budget would change it with the load of the process's other models
        self._budget = (
            cpu_budget() if config.n_threads is None and not config.deterministic else None
        )
        cparams.n_threads = plan.n_threads_batch
        cparams.n_threads_batch = plan.n_threads_batch
        cparams.no_perf = True
        if config.flash_attn is not None:
            cparams.flash_attn_type = flash_attn_type(config.flash_attn)
        if self.fast_pooling:
            cparams.cb_eval = _stop_after_t_embd
        self.ctx = ctx = new_context(
            model, cparams, f"an embedding context of {n_batch} tokens for {config.model_path}"
        )
        self.n_ctx = n_ctx
        self.n_batch = int(C.llama_n_batch(ctx))
        self.n_seq_max = int(C.llama_n_seq_max(ctx))
        self.mem = C.llama_get_memory(ctx)
        self._batch = C.llama_batch_init(self.n_batch, 0, 1)
        self.add_bos = bool(C.llama_vocab_get_add_bos(self.vocab))
        self.add_eos = bool(C.llama_vocab_get_add_eos(self.vocab))
        self.add_sep = bool(C.llama_vocab_get_add_sep(self.vocab))
        self.bos_id = int(C.llama_vocab_bos(self.vocab))
        self.eos_id = int(C.llama_vocab_eos(self.vocab))
        self.sep_id = int(C.llama_vocab_sep(self.vocab))
        logger.debug(
            "embedding context for %s: pooling=%s (gguf %s, %s) n_ctx=%d n_batch=%d n_seq_max=%d",
            config.model_path,
            self.pooling,
            self.gguf_pooling,
            "numpy, output head skipped" if self.fast_pooling else "llama.cpp",
            self.n_ctx,
            self.n_batch,
            self.n_seq_max,
        )

    # ------------------------------------------------------------------ tokens

    @contextmanager
    def using(self) -> Iterator[EmbeddingEngine]:
        """Hold the engine open (its lock) across several calls; raises if it is closed."""
        with self.lock:
            self._check_open()
            yield self

    def _check_open(self) -> None:
        if self.ctx is None:
            raise RequestCancelledError(
                f"the embedding context of {os.path.basename(self.config.model_path)} was "
                "closed (close() ran before or during this call)"
            )

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        with self.lock:
            self._check_open()
            return self._tokenize(text, add_special, parse_special)

    def _tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return vocab.tokenize(
            self.vocab, text, add_special=add_special, parse_special=parse_special
        )

    def fit(self, tokens: list[int], index: int, *, truncate: bool) -> list[int]:
        """``tokens`` if they fit ``n_ctx``; cut to fit with ``truncate`` (keeping a final
        EOS/SEP). An empty text of a model that adds no special tokens is its end-of-text
        token alone: one empty document gets a vector like any other, not an error that
        fails the whole batch."""
        if not tokens:
            for special in (self.eos_id, self.bos_id):
                if special >= 0:
                    return [special]
            raise ValueError(
                f"text {index} is empty and {self.name} adds no special tokens, so there is "
                "nothing to embed"
            )
        if len(tokens) <= self.n_ctx:
            return tokens
        if not truncate:
            raise ContextOverflowError(
                f"text {index} is {len(tokens)} tokens long; the limit is n_ctx={self.n_ctx} "
                "(pass truncate=True to cut it, or raise n_ctx)"
            )
        tail = [tokens[-1]] if self.add_eos and tokens[-1] in (self.eos_id, self.sep_id) else []
        return tokens[: self.n_ctx - len(tail)] + tail

    # ------------------------------------------------------------------ embedding

    def embed(
        self,
        token_lists: Sequence[Sequence[int]],
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> np.ndarray:
        """One pooled row per token list (``[n, n_embd]``, or ``[n, n_cls_out]`` for ``rank``).

        The rows are llama.cpp's raw output: normalise them yourself. ``cancelled`` is
        asked before each batch (the caller's ``close()``): it raises
        :class:`~.errors.RequestCancelledError` there.
        """
        if self.pooling == "none":
            raise ValueError("pooling 'none' gives one vector per token: use token_vectors()")
        width = self.n_cls_out if self.pooling == "rank" else self.n_embd
        out = np.empty((len(token_lists), width), dtype=np.float32)
        lengths = [len(t) for t in token_lists]
        try:
            with self.lock:
                self._check_open()
                per_call = 1 if self.config.deterministic else self.n_seq_max
                for start, end in pack(lengths, self.n_batch, per_call):
                    if cancelled is not None and cancelled():
                        raise RequestCancelledError("the call was cancelled by close()")
                    out[start:end] = self._embed_group(token_lists[start:end], width)
        finally:
            # the caller's thread is done decoding: its OpenMP helpers go (see .omp)
            release_team()
        return out

    def token_vectors(self, tokens: Sequence[int]) -> np.ndarray:
        """The per-token output rows (``[n_tokens, n_embd]``) of one text; needs pooling ``none``."""
        if self.pooling != "none":
            raise ValueError("token_vectors() needs an engine with pooling='none'")
        pack([len(tokens)], self.n_batch, 1)  # validates the length
        try:
            with self.lock:
                self._check_open()
                self._decode([tokens])
                try:
                    return self._rows(len(tokens)).copy()
                finally:
                    self._clear()
        finally:
            release_team()

    def _embed_group(self, group: Sequence[Sequence[int]], width: int) -> np.ndarray:
        self._decode(group)
        try:
            if self.fast_pooling:
                offsets = np.cumsum([0, *(len(t) for t in group[:-1])]).tolist()
                return pool(self._rows(sum(len(t) for t in group)), offsets, self.pooling)
            out = np.empty((len(group), width), dtype=np.float32)
            for s in range(len(group)):
                ptr = C.llama_get_embeddings_seq(self.ctx, s)
                if not ptr:
                    raise DecodeError(f"llama.cpp returned no pooled output for sequence {s}")
                out[s] = np.ctypeslib.as_array(ptr, shape=(width,))
            return out
        finally:
            self._clear()

    def _rows(self, n_tokens: int) -> np.ndarray:
        ptr = C.llama_get_embeddings(self.ctx)
        if not ptr:
            raise DecodeError("llama.cpp returned no token embeddings")
        return np.ctypeslib.as_array(ptr, shape=(n_tokens, self.n_embd))

    def _decode(self, group: Sequence[Sequence[int]]) -> None:
        """One ``llama_decode`` of the texts in ``group``, text ``s`` as sequence ``s``."""
        batch = self._batch
        assert batch is not None
        tokens = [tok for text in group for tok in text]
        positions = [pos for text in group for pos in range(len(text))]
        seq_ids = [s for s, text in enumerate(group) for _ in text]
        # pooled embeddings need every token as an output
        fill_batch(batch, tokens, positions, seq_ids, [True] * len(tokens))
        if self._budget is not None:
            with self._budget.threads(id(self), self.thread_plan.n_threads_batch) as got:
                if got != self._threads_set:
                    C.llama_set_n_threads(self.ctx, got, got)
                    self._threads_set = got
                rc = C.llama_decode(self.ctx, batch)
        else:
            rc = C.llama_decode(self.ctx, batch)
        ran_team(self._threads_set)
        if rc != 0:
            self._clear()
            raise DecodeError(f"llama_decode failed with code {rc} on an embedding batch")

    def _clear(self) -> None:
        if self.mem:
            C.llama_memory_clear(self.mem, True)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Free the context; the model goes when its last user releases it. Idempotent.

        A call running on another thread holds the lock: close() waits for it, and a
        later call raises :class:`~.errors.RequestCancelledError`. To stop a running
        call sooner, pass it a ``cancelled`` check (:meth:`embed`), as the LangChain
        classes do for their own ``close()``. (No abort callback inside the decode:
        llama.cpp calls it after every graph node, each call a wait for the GIL.)"""
        with self.lock:
            free_context(self.ctx, self._batch)
            self.ctx = self._batch = None
            self._model_ref.release()

    @property
    def closed(self) -> bool:
        return self.ctx is None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the bindings may be gone
            pass
