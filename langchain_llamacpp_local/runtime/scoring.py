"""Answer-label scoring on the worker thread: next-token probabilities, not sampled text.

A decision question (:mod:`langchain_llamacpp_local.decisions`) is a prompt plus a set
of answer labels. :func:`score_labels` runs through ``ModelWorker.call`` between
steps: it takes a free slot from :class:`~..cache.slot_memory.SlotMemory` (which keeps
the longest cached prefix, so questions about one state share its KV entries), reads
only the uncached suffix, and reads each label's log-probability from the full
vocabulary row (log-softmax in numpy, never a sampler's filtered logits). A label of
several tokens is scored as a sequence, teacher-forced: its tokens are decoded after
the prompt and removed again through SlotMemory's verify rollback, so the slot ends
holding exactly the prompt, reusable by the next question or chat. The slot is then
free like a finished request's.

The probability math is pure (:func:`log_softmax`, :func:`label_distribution`,
:func:`prefix_free`) and tested without a model.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from langchain_llamacpp_local.errors import (
    ContextOverflowError,
    DecodeError,
    ImageInputError,
    InvalidRequestError,
    RequestCancelledError,
)
from langchain_llamacpp_local.runtime.requests import EngineRequest, cancel_check, cancel_error
from langchain_llamacpp_local.runtime.scheduler import PromptRead, plan_piece

if TYPE_CHECKING:
    from langchain_llamacpp_local.cache.slot_memory import SlotMemory
    from langchain_llamacpp_local.cache.slots import Slot
    from langchain_llamacpp_local.llama.engine import Engine

logger = logging.getLogger(__name__)

#: What a label is tokenized after: the generation prompts of chat templates end with a
#: newline, so a label's tokens are the ones the model would write there (and a
#: tokenizer's space prefix lands on the anchor, not on the label).
_ANCHOR = "\n"


# --------------------------------------------------------------------------- pure math


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of a full vocabulary row, in float64 (stable: max subtracted)."""
    row = np.asarray(logits, dtype=np.float64)
    if not np.all(np.isfinite(row)):
        raise DecodeError("the model produced non-finite logits for an answer")
    shifted = row - row.max()
    return shifted - math.log(float(np.exp(shifted).sum()))


def logsumexp(values: Sequence[float]) -> float:
    """``log(sum(exp(v)))`` without overflow (``-inf`` for no finite value)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0 or not np.any(np.isfinite(arr)):
        return -math.inf
    top = float(arr.max())
    return top + math.log(float(np.exp(arr - top).sum()))


def label_distribution(logprobs: Sequence[float]) -> list[float]:
    """The labels' sequence log-probabilities renormalised over the allowed answers.

    Always finite, in [0, 1] and summing to 1: labels the model gives no mass at all
    (every log-probability ``-inf``) share it equally rather than dividing by zero."""
    if not logprobs:
        raise InvalidRequestError("a question needs at least one answer label")
    total = logsumexp(logprobs)
    if not math.isfinite(total):
        return [1.0 / len(logprobs)] * len(logprobs)
    probs = [math.exp(lp - total) if math.isfinite(lp) else 0.0 for lp in logprobs]
    s = sum(probs)
    return [min(1.0, max(0.0, p / s)) for p in probs]


def prefix_free(label_tokens: Sequence[Sequence[int]]) -> bool:
    """Whether no label's tokens start another's (``"1"`` vs ``"10"`` split by digits).

    When one does, "the answer starts with label A" includes "starts with label B",
    so each label is scored up to the end of the model's turn instead."""
    seqs = sorted(tuple(t) for t in label_tokens)
    return all(b[: len(a)] != a for a, b in zip(seqs, seqs[1:], strict=False))


# --------------------------------------------------------------------------- worker side


@dataclass(frozen=True)
class LabelScores:
    """One question's result: each label's sequence log-probability, and its usage."""

    logprobs: tuple[float, ...]
    n_prompt: int
    n_cached: int
    n_label_tokens: int


_EOG: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _eog_tokens(eng: Engine) -> list[int]:
    """Every end-of-generation token of the vocabulary (found once per engine)."""
    found = _EOG.get(eng)
    if found is None:
        found = [t for t in range(eng.n_vocab) if eng.is_eog(t)]
        _EOG[eng] = found
    return found


def label_tokens(eng: Engine, label: str) -> list[int]:
    """``label``'s tokens as the model would write them after the generation prompt
    (special-token text in a label stays plain text)."""
    base = eng.tokenize(_ANCHOR, add_special=False, parse_special=False)
    both = eng.tokenize(_ANCHOR + label, add_special=False, parse_special=False)
    if both[: len(base)] == base:
        return [int(t) for t in both[len(base) :]]
    return [int(t) for t in eng.tokenize(label, add_special=False, parse_special=False)]


def score_labels(
    state: Any, job: EngineRequest, toks: Sequence[Sequence[int]], shared: int = 0
) -> LabelScores | None:
    """Score the labels (``toks``: each one's tokens, from :func:`label_tokens`) as the
    answer to ``job``'s prompt, prepared by the front end (run it on the worker thread).

    ``shared``: the prompt's first tokens common to every question of the request (a
    checkpoint is kept there where the memory cannot be trimmed). Returns None when no
    slot is free now (the caller retries); raises the request's error otherwise, the
    slot left holding what its memory holds."""
    eng: Engine | None = state.engine
    memory: SlotMemory | None = state.memory
    assert eng is not None and memory is not None
    if job.cancelled():
        raise cancel_error(job)
    if job.lora:
        raise InvalidRequestError("decision questions run on the base model: LoRA is not applied")
    terminate = not prefix_free(toks)
    longest = max(len(t) for t in toks) - (0 if terminate else 1)
    if longest > eng.n_batch:
        raise InvalidRequestError(
            f"an answer label of {longest + 1} tokens exceeds n_batch={eng.n_batch}"
        )
    busy: set[int] = state._busy()
    if len(busy) >= len(memory.slots):
        return None  # before any templating: the caller asks again
    tokens = job.tokens
    n_prompt = len(tokens)
    if n_prompt == 0:
        raise InvalidRequestError("the rendered prompt is empty")
    needed = n_prompt + longest
    if needed > eng.n_ctx:
        raise ContextOverflowError(
            f"the decision prompt of {n_prompt} tokens plus its longest answer label does "
            f"not fit the context window of {eng.n_ctx} tokens (raise n_ctx or shorten the state)"
        )
    reserved = sum(a.reserved for a in state.active)
    if eng.kv_unified and not memory.fits(needed, reserved):
        if not state.active:
            raise ContextOverflowError(
                f"the question needs {needed} positions of the "
                f"{eng.n_ctx_total}-position unified cache"
            )
        return None
    spans = [(p, m.n_pos) for p, m in job.media.items()]
    marks = job.marks
    slot, n_keep = memory.acquire(
        tokens,
        spans,
        busy,
        cache_prompt=job.cache_prompt,
        marks=marks,
        room=(needed, reserved) if eng.kv_unified else None,
    )
    boundaries = (shared,) if 0 < shared < n_prompt else ()
    targets = memory.checkpoint_targets(n_keep, tokens, boundaries, spans, slot, marks)
    first = _read_prompt(state, eng, memory, slot, job, marks, targets)
    logprobs = [
        float(first[t[0]]) + _label_tail(eng, memory, slot, job, t, terminate) for t in toks
    ]
    n_label = sum(len(t) - (0 if terminate else 1) for t in toks)
    _save(memory, slot)
    return LabelScores(tuple(logprobs), n_prompt, n_keep, n_label)


def _save(memory: SlotMemory, slot: Slot) -> None:
    """Offer the read prompt to the disk prompt cache, as a finished chat request's
    conversation is (the disk cache is an optimisation: a failure only logs)."""
    if memory.disk is None:
        return
    try:
        pending = memory.reserve_save(slot)
        if pending is not None:
            memory.persist(slot, pending)
    except Exception:
        logger.warning("prompt cache: could not save a decision prompt", exc_info=True)


def _read_prompt(
    state: Any,
    eng: Engine,
    memory: SlotMemory,
    slot: Slot,
    job: EngineRequest,
    marks: Sequence[int],
    targets: list[int],
) -> np.ndarray:
    """Decode the prompt's uncached suffix in the worker's pieces (same cuts and
    checkpoints as a chat request) and return the log-softmax of its last row."""
    tokens = job.tokens
    media = job.media
    n_prompt = len(tokens)
    keep = frozenset(targets)
    rules = state.piece_rules
    eng.set_lora(())  # LoRA hook: questions read the base model
    while True:
        items = slot.checkpoints.items
        piece = plan_piece(
            None,
            PromptRead(
                n_past=slot.n_past,
                n_prompt=n_prompt,
                media={p: m.n_pos for p, m in media.items()},
                targets=tuple(targets),
                marks=tuple(marks),
                last_checkpoint=items[-1].n_tokens if items else None,
            ),
            rules,
        )
        for pos in piece.media:
            chunk = media[pos]
            if pos + chunk.n_pos >= n_prompt:
                raise ImageInputError("a prompt cannot end with an image: add text after it")
            try:
                eng.eval_media(chunk, pos, slot.seq_id)
            except DecodeError:
                memory.sync(slot)
                raise
            memory.record(slot, tokens[pos : pos + chunk.n_pos], exact=True)
        start, end = piece.start, piece.end
        if piece.targets_taken:
            del targets[: piece.targets_taken]
            if piece.checkpoint_at_start:
                memory.save_checkpoint(slot, keep)
        chunk_toks = tokens[start:end]
        try:
            eng.decode_batch(
                chunk_toks,
                range(start, end),
                [slot.seq_id] * len(chunk_toks),
                [i == n_prompt - 1 for i in range(start, end)],
                cancel=cancel_check(job) if len(chunk_toks) > 1 else None,
            )
        except (RequestCancelledError, DecodeError) as exc:
            memory.sync(slot)
            if isinstance(exc, RequestCancelledError) or job.cancelled():
                raise cancel_error(job) from None
            raise
        memory.record(slot, chunk_toks, exact=True)
        if slot.n_past < n_prompt:
            if targets and slot.n_past == targets[0]:
                targets.pop(0)
                memory.save_checkpoint(slot, keep)
            if job.cancelled():
                raise cancel_error(job)
            continue
        memory.seal_prompt(slot, n_prompt, marks)
        row = log_softmax(eng.logits(len(chunk_toks) - 1))
        if piece.window:
            memory.save_checkpoint(slot, keep)
        return row


def _label_tail(
    eng: Engine,
    memory: SlotMemory,
    slot: Slot,
    job: EngineRequest,
    toks: Sequence[int],
    terminate: bool,
) -> float:
    """Log-probability of a label's tokens after its first (and, with ``terminate``, of
    ending the turn after it): its tokens decoded after the prompt, read, removed."""
    rows = list(toks) if terminate else list(toks[:-1])
    if not rows:
        return 0.0
    step = memory.begin_verify(slot, rows)
    n = len(rows)
    try:
        eng.decode_batch(rows, range(step.n_past, step.n_past + n), [slot.seq_id] * n, [True] * n)
    except (RequestCancelledError, DecodeError) as exc:
        memory.abort_verify(step)
        memory.sync(slot)
        if isinstance(exc, RequestCancelledError) or job.cancelled():
            raise cancel_error(job) from None
        raise
    try:
        total = 0.0
        for i in range(len(toks) - 1):
            total += float(log_softmax(eng.logits(i))[toks[i + 1]])
        if terminate:
            end = log_softmax(eng.logits(n - 1))
            total += logsumexp([float(end[t]) for t in _eog_tokens(eng)])
    finally:
        # drop every label row again: the slot holds exactly the prompt
        memory.keep(step, 0, lambda _rows, _start: None)
    return total


__all__ = [
    "LabelScores",
    "label_distribution",
    "label_tokens",
    "log_softmax",
    "logsumexp",
    "prefix_free",
    "score_labels",
]
