"""What the engine core is handed and what it answers: token-level requests and typed
reply items.

The front end (``chat/``) turns a chat request into an :class:`EngineRequest`: prompt
tokens, images at their positions, a built sampler, stop strings, limits and cache
options. The worker decodes it and answers on the request's :class:`Channel` with
:class:`TextDelta` items (stop strings already applied) and one :class:`Finished` or
:class:`Failed`; parsing, usage and messages are the front end's (``chat/reply.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from langchain_llamacpp_local.errors import RequestCancelledError, RequestTimeoutError
from langchain_llamacpp_local.llama.abort import CancelCheck, CancelFlag, is_cancelled
from langchain_llamacpp_local.llama.sampling import Sampler, SamplingParams
from langchain_llamacpp_local.runtime.channel import Channel
from langchain_llamacpp_local.runtime.scheduler import DEFAULT_STALL_BUDGET_MS
from langchain_llamacpp_local.runtime.thinking import ThinkPlan


@dataclass
class EngineRequest:
    """One generation request at the token level, as the worker runs it."""

    tokens: list[Any]  # token ids, and ("media", digest, k) entries for image positions
    sampling: SamplingParams
    #: most tokens generated (the front end fitted it to the window: see chat/frontend.py)
    max_new: int
    stop: list[str] = field(default_factory=list)
    media: dict[int, Any] = field(default_factory=dict)  # start position -> MediaChunk
    #: checkpoint points (where the last user message starts)
    boundaries: tuple[int, ...] = ()
    marks: list[int] = field(default_factory=list)  # chunking.marker_cuts of ``tokens``
    #: LoRA adapters applied, ((name, scale), ...); None: the model has none configured
    lora: tuple[tuple[str, float], ...] | None = None
    lora_start: int = 0  # where the adapters take effect (an activated LoRA's invocation)
    cache_prompt: bool = True
    #: llama.cpp's ``n_cache_reuse``: after the common prefix, cached chunks of at least
    #: this many tokens that match the prompt are moved, not read (0: off)
    cache_reuse: int = 0
    #: the conversation the request belongs to (the front end's key): chunks are moved
    #: only within one conversation; None: none are
    reuse_owner: str | None = None
    #: "ngram" (prompt lookup) or "draft" (the worker's draft model); None: off
    speculative: str | None = None
    speculative_max_draft: int = 16
    logprobs: bool = False
    top_logprobs: int = 0
    #: send a :class:`PromptProgress` after each prompt piece (a caller with callbacks)
    prompt_progress: bool = False
    #: the family's thinking markers as token ids: thinking tokens are counted (and
    #: bounded by its budget); None: the output has no thinking block we know
    think: ThinkPlan | None = None
    #: the sampler chain, built by the front end (grammar compiled off the decode loop);
    #: None: the worker builds it from ``sampling``. The worker owns and closes it.
    sampler: Sampler | None = None
    #: "interactive" (a caller waits on it: planned first) or "background" (its prompt
    #: is read after interactive prompts, until it has waited long enough)
    priority: str = "interactive"
    #: while this request generates, the longest a step may take (the prompt pieces of
    #: others are cut to fit, runtime.scheduler); None: its tokens may wait for whole pieces
    stall_budget_ms: float | None = DEFAULT_STALL_BUDGET_MS
    deadline: float | None = None
    cancel: threading.Event = field(default_factory=CancelFlag)
    channel: Channel = field(default_factory=Channel)

    def cancelled(self) -> bool:
        return is_cancelled(self.cancel, self.deadline)

    def close_sampler(self) -> None:
        """Free a sampler the worker never took (the request failed before it started)."""
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            sampler.close()


@dataclass
class ScoreRequest(EngineRequest):
    """A decision question: read the prompt like a chat request's, then score each
    answer label's tokens after it (:mod:`~.scoring`) instead of sampling.

    The worker admits it and reads its prompt in the same steps and pieces as a chat
    request's, beside the running streams; the labels are scored a bounded amount per
    step, so a cancel or deadline stops it between labels. It answers with one
    :class:`LabelScores` (or :class:`Failed`). It always runs on the base model."""

    #: each answer label's tokens, as the model would write them after the prompt
    labels: tuple[tuple[int, ...], ...] = ()
    #: score each label up to the end of the model's turn (one label's tokens start
    #: another's: :func:`~.scoring.prefix_free`)
    to_end: bool = False


@dataclass(frozen=True)
class LabelScores:
    """The answer to a :class:`ScoreRequest`: each label's sequence log-probability (in
    the request's label order), and its usage."""

    logprobs: tuple[float, ...]
    n_prompt: int
    n_cached: int
    n_label_tokens: int
    final: ClassVar[bool] = True


def cancel_check(job: Any) -> Callable[[], bool]:
    """What a decode of ``job`` (anything with ``cancel``, ``deadline`` and
    ``cancelled()``) watches: with a :class:`CancelFlag`, a check the flag tells at once
    when a caller sets it (nothing polls it); else ``job.cancelled``, polled."""
    if isinstance(job.cancel, CancelFlag):
        return CancelCheck(job.cancel, job.deadline)
    return job.cancelled  # type: ignore[no-any-return]


def cancel_error(job: Any) -> BaseException:
    """The error a cancelled request (anything with a ``deadline``) ends with: a
    timeout or a cancellation."""
    if job.deadline is not None and time.monotonic() >= job.deadline:
        return RequestTimeoutError("the request timed out")
    return RequestCancelledError("the request was cancelled")


# --------------------------------------------------------------------------- replies


@dataclass
class TextDelta:
    """Generated text past the stop-string matcher, with the log-probabilities of the
    tokens sampled since the previous item (None when they were not asked for)."""

    text: str
    logprobs: list[dict[str, Any]] | None = None
    final: ClassVar[bool] = False
    #: a reader of the whole reply need not be woken for it (Channel.wake_for_text)
    batchable: ClassVar[bool] = True


@dataclass(frozen=True)
class Timings:
    """A reply's timings, as llama.cpp's server reports them (``draft_*``: only when
    the request speculated)."""

    prompt_n: float  # prompt tokens decoded (the cached ones are not)
    prompt_ms: float
    prompt_per_second: float
    predicted_n: float
    predicted_ms: float
    predicted_per_second: float
    draft_n: float | None = None
    draft_n_accepted: float | None = None


@dataclass(frozen=True)
class SpeculationReport:
    """What speculative decoding did for a reply: its kind, draft tokens proposed and
    accepted."""

    kind: str
    drafted: int
    accepted: int


@dataclass(frozen=True)
class CacheReport:
    """Where a request's kept prefix came from (``"slot"``, ``"host_ram"``, ``"disk"``;
    None: nothing was cached), whether the prompt left the cached prompt (a miss) and at
    which of its own tokens. Nothing of the cached candidate itself: it may be another
    caller's conversation."""

    source: str | None
    missed: bool
    at: int
    #: with ``cache_reuse`` on: the tokens moved rather than read (None: reuse was off)
    moved: int | None = None
    #: with ``cache_reuse`` on, why it could not apply (None: it applied or was off)
    reuse_off: str | None = None


@dataclass
class Finished:
    """The last item of a reply: why generation ended, counts and timings."""

    finish_reason: str
    n_prompt: int
    n_cached: int
    n_generated: int
    timings: Timings
    #: log-probabilities no text item carried (an end-of-generation token); None when
    #: they were not asked for
    logprobs: list[dict[str, Any]] | None = None
    speculative: SpeculationReport | None = None  # when the request speculated
    lora: dict[str, float] | None = None  # adapters applied (name -> scale), when configured
    cache: CacheReport | None = None
    #: generated tokens inside the thinking block (markers excluded); None: not counted
    n_reasoning: int | None = None
    final: ClassVar[bool] = True


@dataclass
class PromptProgress:
    """Prompt reading so far, sent after each prompt piece when the request asks
    (llama.cpp's ``return_progress``): ``processed`` counts the tokens read this call,
    ``cached`` those kept from the cache; ``cached + processed`` reaches ``total``."""

    total: int
    cached: int
    processed: int
    final: ClassVar[bool] = False


@dataclass
class Failed:
    """The last item of a reply that ended in an error."""

    error: BaseException
    final: ClassVar[bool] = True


ReplyItem = TextDelta | PromptProgress | Finished | Failed | LabelScores
