"""A second, small GGUF that proposes draft tokens for speculative decoding.

The draft model runs in its own llama.cpp context with one KV stream per slot of
the target, so each slot's draft sequence follows that slot's tokens. For every
step the worker hands it the slot's full token history; the draft keeps the
longest prefix its context already holds, decodes only the new tokens and then
greedily generates up to ``n_max`` tokens, stopping early once its confidence
drops below ``p_min`` (as llama.cpp's ``common_speculative`` draft does).

The draft tokens it decoded stay in its context: the next call usually extends
them (the target accepted a prefix and added one token), so only the rejected
tail is trimmed then (``seq_rm``). Memory that cannot be trimmed (recurrent,
hybrid) is rolled back to a checkpoint of the recurrent state taken right after
the history was decoded, so a rejected draft never forces a re-read.

A draft must never fail the target's request: a history longer than the draft's
window or a failed draft decode gives no draft (``[]``), not an error.

Implements :class:`~langchain_llamacpp_local.runtime.speculative.Proposer`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import llama_cpp.llama_cpp as C
import numpy as np

from langchain_llamacpp_local.errors import DecodeError, IncompatibleDraftModelError
from langchain_llamacpp_local.llama.engine import PARTIAL_ONLY, Engine
from langchain_llamacpp_local.llama.loading import LoadConfig, load_model
from langchain_llamacpp_local.llama.probes import MemoryKind

logger = logging.getLogger(__name__)

#: llama.cpp's limits (common/speculative.cpp): vocab sizes may differ by this much
#: (extra special tokens), and token texts must match from this id on.
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5

#: llama.cpp's draft samples with top-k 10 and reads the top token's probability
#: among those candidates; ``p_min`` compares against the same figure.
DRAFT_TOP_K = 10


def draft_config(target: LoadConfig, draft_path: str, *, n_ctx: int | None = None) -> LoadConfig:
    """The draft's load settings, derived from the target's.

    Same slots (one KV stream each), threads, batch size and GPU offload; a window
    of ``n_ctx`` (the target's window by default, pass ``target_engine.n_ctx``);
    flash attention off (exact rows, as the target's default); a full-size SWA
    cache so sliding-window drafts can be trimmed; no projector, no RPC devices,
    default KV types and RoPE (those describe the target's file).
    """
    return LoadConfig(
        model_path=draft_path,
        n_ctx=n_ctx if n_ctx is not None else target.n_ctx,
        n_batch=target.n_batch,
        n_ubatch=target.n_ubatch,
        n_threads=target.n_threads,
        n_threads_batch=target.n_threads_batch,
        n_gpu_layers=target.n_gpu_layers,
        flash_attn=False,
        swa_full=True,
        n_slots=target.n_slots,
        kv_unified=False,
        use_mmap=target.use_mmap,
        use_mlock=target.use_mlock,
        cpu_amx=target.cpu_amx,
    )


def vocab_mismatch(target_vocab: object, draft_vocab: object) -> str | None:
    """Why two llama.cpp vocabularies cannot share token ids, or None if they can.

    The checks of llama.cpp's ``common_speculative_are_compatible``: vocab type,
    BOS/EOS use and ids, size difference, token texts from id 5 on.
    """
    t_type, d_type = C.llama_vocab_type(target_vocab), C.llama_vocab_type(draft_vocab)
    if t_type != d_type:
        return f"vocabulary type differs (target {t_type}, draft {d_type})"
    for name, add_fn, id_fn in (
        ("BOS", C.llama_vocab_get_add_bos, C.llama_vocab_bos),
        ("EOS", C.llama_vocab_get_add_eos, C.llama_vocab_eos),
    ):
        t_add, d_add = bool(add_fn(target_vocab)), bool(add_fn(draft_vocab))
        if t_add != d_add:
            return f"add_{name.lower()} differs (target {t_add}, draft {d_add})"
        t_id, d_id = id_fn(target_vocab), id_fn(draft_vocab)
        if t_add and t_id != d_id:
            return f"{name} token id differs (target {t_id}, draft {d_id})"
    n_t, n_d = C.llama_vocab_n_tokens(target_vocab), C.llama_vocab_n_tokens(draft_vocab)
    if abs(n_t - n_d) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        return (
            f"vocabulary sizes differ by {abs(n_t - n_d)} tokens (target {n_t}, draft {n_d}; "
            f"at most {SPEC_VOCAB_MAX_SIZE_DIFFERENCE} allowed)"
        )
    for i in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(n_t, n_d)):
        t_text = C.llama_vocab_get_text(target_vocab, i)
        d_text = C.llama_vocab_get_text(draft_vocab, i)
        if t_text != d_text:
            return f"token {i} differs (target {t_text!r}, draft {d_text!r})"
    return None


def top_probability(logits: np.ndarray, top_k: int = DRAFT_TOP_K) -> tuple[int, float]:
    """The argmax token and its probability among the ``top_k`` most likely ones."""
    k = min(top_k, logits.shape[0])
    top = np.argpartition(logits, -k)[-k:]
    vals = logits[top].astype(np.float64)
    best = int(top[int(np.argmax(vals))])
    # lowest id among equal maxima, as a full argmax would pick
    best = int(np.flatnonzero(logits == logits[best])[0])
    exp = np.exp(vals - vals.max())
    return best, float(1.0 / exp.sum())


def _token_ids(entries: Sequence[object], n_vocab: int) -> list[int] | None:
    """``entries`` as token ids of a ``n_vocab`` vocabulary, or None if one is not
    (an image position of a multimodal prompt, an id past the draft's vocabulary)."""
    out: list[int] = []
    for e in entries:
        if isinstance(e, (tuple, str, bytes)):
            return None
        try:
            t = int(e)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return None
        if not 0 <= t < n_vocab:
            return None
        out.append(t)
    return out


class DraftModel:
    """Draft tokens from a small compatible model (see the module docstring)."""

    def __init__(self, config: LoadConfig, target: Engine, *, p_min: float = 0.75) -> None:
        """``config``: the draft's own load settings, or the target's with
        ``draft_model_path`` set (the draft's are then derived by :func:`draft_config`)."""
        if config.draft_model_path:
            config = draft_config(config, config.draft_model_path, n_ctx=target.n_ctx)
        if config.n_slots != target.n_slots:
            raise ValueError(
                f"the draft model needs one sequence per target slot: n_slots="
                f"{config.n_slots}, the target has {target.n_slots}"
            )
        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"p_min={p_min!r} must be between 0 and 1")
        self.p_min = p_min
        self.target_n_vocab = target.n_vocab
        # Check the vocabulary on the bare model before building a context for it.
        ref = load_model(config)
        try:
            why = vocab_mismatch(target.vocab, C.llama_model_get_vocab(ref.model))
            if why is not None:
                raise IncompatibleDraftModelError(
                    f"draft model {config.model_path} cannot draft for "
                    f"{target.config.model_path}: {why}"
                )
            self.engine: Engine | None = Engine(config)
        finally:
            ref.release()  # the engine holds its own reference
        # the draft decodes on its target's thread, between the target's decodes: one
        # team of the process-wide CPU budget, not two that would split the CPUs
        self.engine.team = target.team
        self.n_ctx = self.engine.n_ctx
        self.trimmable = self.engine.memory_kind is MemoryKind.PARTIAL
        self._held: dict[int, list[int]] = {}  # tokens each draft sequence holds
        self._checkpoint: dict[int, tuple[int, bytes]] = {}  # (n_tokens, recurrent state)
        #: tokens decoded into the draft context (history and drafts), for metrics/tests
        self.n_decoded = 0
        logger.debug(
            "draft model %s: window %d, %d sequences, memory %s",
            config.model_path,
            self.n_ctx,
            self.engine.n_slots,
            self.engine.memory_kind.value,
        )

    # ------------------------------------------------------------------ Proposer

    def propose(self, seq_id: int, history: Sequence[int], n_max: int) -> list[int]:
        """Up to ``n_max`` greedy draft tokens that may follow ``history``.

        ``history`` ends with the last sampled token, not yet decoded by the target.
        """
        eng = self.engine
        if eng is None or n_max <= 0 or not history:
            return []
        if not 0 <= seq_id < eng.n_slots:
            raise ValueError(f"seq_id {seq_id} out of range (0..{eng.n_slots - 1})")
        n_hist = len(history)
        # history takes positions 0..n_hist-1, the drafts after it (the last one undecoded)
        n_max = min(n_max, self.n_ctx - n_hist + 1)
        if n_hist > self.n_ctx or n_max <= 0:
            return []
        try:
            n_keep = self._rewind(seq_id, history)
            new = _token_ids(history[n_keep:], eng.n_vocab)
            if new is None:
                logger.debug("history entry the draft cannot read (image, id): no draft")
                self.forget(seq_id)
                return []
            eng.decode(new, n_keep, seq_id, logits_last=True)
            self.n_decoded += len(new)
            held = self._held.setdefault(seq_id, [])
            held.extend(new)
            if not self.trimmable:
                self._checkpoint[seq_id] = (n_hist, eng.state_get(seq_id, PARTIAL_ONLY))
            return self._generate(seq_id, n_hist, n_max, held)
        except DecodeError:
            logger.debug("draft decode failed for sequence %d: no draft", seq_id, exc_info=True)
            self.forget(seq_id)
            return []

    def forget(self, seq_id: int) -> None:
        """Clear the draft sequence (its slot was reset or reused)."""
        self._held.pop(seq_id, None)
        self._checkpoint.pop(seq_id, None)
        if self.engine is not None:
            self.engine.seq_rm(seq_id, -1, -1)

    def close(self) -> None:
        """Free the draft context and its model reference (idempotent)."""
        eng, self.engine = self.engine, None
        self._held.clear()
        self._checkpoint.clear()
        if eng is not None:
            eng.close()

    # ------------------------------------------------------------------ internals

    def _rewind(self, seq_id: int, history: Sequence[int]) -> int:
        """Trim the sequence to its longest reusable prefix of ``history``; its length.

        At least the last history token is always re-decoded: its logits start the draft.
        """
        eng = self.engine
        assert eng is not None
        held = self._held.get(seq_id, [])
        limit = min(len(held), len(history) - 1)
        n_keep = 0
        while n_keep < limit and held[n_keep] == history[n_keep]:
            n_keep += 1
        if n_keep == len(held):
            return n_keep
        if self.trimmable and eng.seq_rm(seq_id, n_keep, -1):
            del held[n_keep:]
            return n_keep
        ck = self._checkpoint.get(seq_id)
        if ck is not None and ck[0] <= n_keep and eng.state_set(ck[1], seq_id, PARTIAL_ONLY):
            if eng.seq_rm(seq_id, ck[0], -1):
                del held[ck[0] :]
                return ck[0]
        self.forget(seq_id)
        return 0

    def _generate(self, seq_id: int, n_hist: int, n_max: int, held: list[int]) -> list[int]:
        """Greedy drafting from the logits of the history's last token."""
        eng = self.engine
        assert eng is not None
        drafts: list[int] = []
        while True:
            token, p = top_probability(eng.logits(-1))
            if p < self.p_min or token >= self.target_n_vocab:
                break
            drafts.append(token)
            if len(drafts) >= n_max or eng.is_eog(token):
                break
            eng.decode_batch([token], [n_hist + len(drafts) - 1], [seq_id], [True])
            self.n_decoded += 1
            held.append(token)
        return drafts
