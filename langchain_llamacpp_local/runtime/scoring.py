"""Answer-label scoring: next-token probabilities, not sampled text.

A decision question (:mod:`langchain_llamacpp_local.decisions`) is a prompt plus a set
of answer labels. The caller's side makes it a
:class:`~langchain_llamacpp_local.runtime.requests.ScoreRequest`
(:func:`score_request`); the worker admits it like a chat request (a slot from
:class:`~..cache.slot_memory.SlotMemory`, which keeps the longest cached prefix, so
questions about one state share its KV entries) and reads its prompt in the same
planned pieces, beside the running streams. From the prompt's last row it reads each
label's first-token log-probability (log-softmax of the full vocabulary row in numpy,
never a sampler's filtered logits); :class:`LabelWork` then scores the rest of the
labels one decode call per worker step. A label of several tokens is scored as a
sequence, teacher-forced: its tokens are decoded after the prompt and removed again
through SlotMemory's verify rollback, so the slot ends holding exactly the prompt,
reusable by the next question or chat.

The probability math is pure (:func:`log_softmax`, :func:`label_distribution`,
:func:`prefix_free`) and tested without a model.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from langchain_llamacpp_local.errors import (
    ContextOverflowError,
    DecodeError,
    InvalidRequestError,
    RequestCancelledError,
)
from langchain_llamacpp_local.runtime.requests import EngineRequest, LabelScores, ScoreRequest

if TYPE_CHECKING:
    from langchain_llamacpp_local.cache.slot_memory import SlotMemory
    from langchain_llamacpp_local.cache.slots import Slot
    from langchain_llamacpp_local.llama.engine import Engine

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


# --------------------------------------------------------------------------- requests


def label_tokens(eng: Engine, label: str) -> list[int]:
    """``label``'s tokens as the model would write them after the generation prompt
    (special-token text in a label stays plain text)."""
    base = eng.tokenize(_ANCHOR, add_special=False, parse_special=False)
    both = eng.tokenize(_ANCHOR + label, add_special=False, parse_special=False)
    if both[: len(base)] == base:
        return [int(t) for t in both[len(base) :]]
    return [int(t) for t in eng.tokenize(label, add_special=False, parse_special=False)]


def label_rows(label: Sequence[int], to_end: bool) -> int:
    """Decode rows a label needs after the prompt: its tokens after the first (the
    prompt's last row scores that one), or all of them when scored to the turn's end."""
    return len(label) - (0 if to_end else 1)


def score_request(
    prepared: EngineRequest, labels: Sequence[Sequence[int]], shared: int = 0
) -> ScoreRequest:
    """The scoring request for a prepared chat request's prompt (made on the caller's
    side; the prepared request's sampler is freed: scoring never samples).

    ``labels``: each label's tokens (:func:`label_tokens`). ``shared``: the prompt's
    first tokens common to every question of the decision (a checkpoint is kept there
    where the memory cannot be trimmed). The request runs on the base model."""
    prepared.close_sampler()
    toks = tuple(tuple(int(t) for t in label) for label in labels)
    if not toks:
        raise InvalidRequestError("a question needs at least one answer label")
    if not all(toks):
        raise InvalidRequestError("an answer label tokenizes to no tokens")
    to_end = not prefix_free(toks)
    return ScoreRequest(
        tokens=prepared.tokens,
        sampling=prepared.sampling,
        # the positions the longest label's rows take after the prompt: what the
        # unified cache must leave room for, as a chat request's max_new
        max_new=max(label_rows(t, to_end) for t in toks),
        media=prepared.media,
        boundaries=(shared,) if 0 < shared < len(prepared.tokens) else (),
        marks=prepared.marks,
        cache_prompt=prepared.cache_prompt,
        # the caller's scheduling options: a decision asked as background work stays so
        priority=prepared.priority,
        stall_budget_ms=prepared.stall_budget_ms,
        deadline=prepared.deadline,
        cancel=prepared.cancel,
        channel=prepared.channel,
        labels=toks,
        to_end=to_end,
    )


# --------------------------------------------------------------------------- worker side


_EOG: weakref.WeakKeyDictionary[Engine, list[int]] = weakref.WeakKeyDictionary()


def _eog_tokens(eng: Engine) -> list[int]:
    """Every end-of-generation token of the vocabulary (found once per engine)."""
    found = _EOG.get(eng)
    if found is None:
        found = [t for t in range(eng.n_vocab) if eng.is_eog(t)]
        _EOG[eng] = found
    return found


@dataclass
class LabelWork:
    """A :class:`ScoreRequest`'s labels on the worker: scored once its prompt is read,
    at most one decode call per :meth:`step`, so the worker's other requests go on
    between labels and a cancel or deadline is seen before the next one."""

    job: ScoreRequest
    #: log-softmax of the prompt's last row (None: the prompt is still being read)
    first: np.ndarray | None = None
    logprobs: list[float] = field(default_factory=list)

    @classmethod
    def check(cls, eng: Engine, job: ScoreRequest) -> LabelWork:
        """The work for ``job``, refused before it takes a slot when its labels cannot
        be scored on this context."""
        if not job.labels or not all(job.labels):
            raise InvalidRequestError("a question needs answer labels of at least one token")
        longest = max(label_rows(t, job.to_end) for t in job.labels)
        if longest > eng.n_batch:
            raise InvalidRequestError(
                f"an answer label of {longest + 1} tokens exceeds n_batch={eng.n_batch}"
            )
        n_prompt = len(job.tokens)
        if n_prompt + longest > eng.n_ctx:
            raise ContextOverflowError(
                f"the decision prompt of {n_prompt} tokens plus its longest answer label does "
                f"not fit the context window of {eng.n_ctx} tokens (raise n_ctx or shorten "
                "the state)"
            )
        return cls(job)

    @property
    def reading(self) -> bool:
        """The prompt is read and labels remain: :meth:`step` has work."""
        return self.first is not None and not self.done

    @property
    def done(self) -> bool:
        return len(self.logprobs) == len(self.job.labels)

    def prompt_read(self, logits: np.ndarray) -> None:
        """Take the prompt's last row (each label's first token is scored from it)."""
        self.first = log_softmax(logits)

    def step(self, eng: Engine, memory: SlotMemory, slot: Slot) -> None:
        """Score the labels up to the next one that needs a decode call, that one
        included: one call at most. The slot ends holding exactly the prompt."""
        first = self.first
        assert first is not None
        labels = self.job.labels
        while not self.done:
            toks = labels[len(self.logprobs)]
            lp = float(first[toks[0]])
            decoded = label_rows(toks, self.job.to_end) > 0
            if decoded:
                lp += self._tail(eng, memory, slot, toks)
            self.logprobs.append(lp)
            if decoded:
                return

    def _tail(self, eng: Engine, memory: SlotMemory, slot: Slot, toks: Sequence[int]) -> float:
        """Log-probability of a label's tokens after its first (and, scored to the
        turn's end, of ending the turn after it): its tokens decoded after the prompt,
        read, removed."""
        to_end = self.job.to_end
        rows = list(toks) if to_end else list(toks[:-1])
        step = memory.begin_verify(slot, rows)
        n = len(rows)
        try:
            eng.set_lora(())  # LoRA hook: questions read the base model
            eng.decode_batch(
                rows, range(step.n_past, step.n_past + n), [slot.seq_id] * n, [True] * n
            )
        except (RequestCancelledError, DecodeError):
            memory.abort_verify(step)
            memory.sync(slot)
            raise
        try:
            total = 0.0
            for i in range(len(toks) - 1):
                total += float(log_softmax(eng.logits(i))[toks[i + 1]])
            if to_end:
                end = log_softmax(eng.logits(n - 1))
                total += logsumexp([float(end[t]) for t in _eog_tokens(eng)])
        finally:
            # drop every label row again: the slot holds exactly the prompt
            memory.keep(step, 0, lambda _rows, _start: None)
        return total

    def result(self, n_cached: int) -> LabelScores:
        """The answer, once :attr:`done`."""
        job = self.job
        return LabelScores(
            tuple(self.logprobs),
            len(job.tokens),
            n_cached,
            sum(label_rows(t, job.to_end) for t in job.labels),
        )


__all__ = [
    "LabelWork",
    "label_distribution",
    "label_rows",
    "label_tokens",
    "log_softmax",
    "logsumexp",
    "prefix_free",
    "score_request",
]
