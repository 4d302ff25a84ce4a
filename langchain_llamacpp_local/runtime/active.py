"""The worker loop's records of its requests: queued (:class:`Waiting`), then holding a
slot (:class:`Active`).

Shared by the loop (:mod:`~.loop`) and the pieces it composes (admission, the output
pipeline, speculative verify), so none of them imports another to name a request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from langchain_llamacpp_local.cache.slots import Slot
from langchain_llamacpp_local.llama.sampling import Sampler
from langchain_llamacpp_local.llama.text_stream import StopMatcher, Utf8Decoder
from langchain_llamacpp_local.runtime.requests import CacheReport, EngineRequest
from langchain_llamacpp_local.runtime.scoring import LabelWork
from langchain_llamacpp_local.runtime.speculative import Speculation
from langchain_llamacpp_local.runtime.thinking import ThinkCounter

#: The worker thread's log, whichever of the loop's modules writes to it: a setting made
#: for it keeps covering all of the worker's messages.
WORKER_LOG = "langchain_llamacpp_local.runtime.worker"


@dataclass
class Waiting:
    """A queued request (its prompt prepared by the front end before it was queued)."""

    job: EngineRequest
    step: int = 0  # the worker's step count when it was queued (background aging)
    t_queued: float = 0.0  # the worker's clock then


@dataclass
class Active:
    """A request that owns a slot: reading its prompt or generating."""

    job: EngineRequest
    slot: Slot
    n_keep: int
    cache: CacheReport | None
    max_new: int
    targets: list[int]
    keep: frozenset[int]
    sampler: Sampler | None  # None: a scoring request (it never samples)
    decoder: Utf8Decoder = field(default_factory=Utf8Decoder)
    stopper: StopMatcher = field(default_factory=lambda: StopMatcher([]))
    logprobs: list[dict[str, Any]] | None = None
    logprobs_sent: int = 0  # entries of logprobs already sent with a text item
    marks: list[int] = field(default_factory=list)  # chunking.marker_cuts of the prompt
    n_gen: int = 0
    pending: int | None = None  # sampled token to decode in the next step
    t_start: float = field(default_factory=time.perf_counter)
    t_prefill: float = 0.0
    beside: int = 0  # prompt pieces read under a stall budget (beside streams)
    retried: bool = False
    text_sent: bool = False  # a text item of the reply went out
    spec: Speculation | None = None
    think: ThinkCounter | None = None
    labels: LabelWork | None = None  # a scoring request's labels (runtime.scoring)
    queued: Waiting | None = None  # when it was queued (background aging)

    @property
    def tokens(self) -> list[Any]:
        return self.job.tokens

    @property
    def media(self) -> dict[int, Any]:
        """Image chunks by the position where each starts."""
        return self.job.media

    @property
    def lora_start(self) -> int:
        return self.job.lora_start

    @property
    def prefilling(self) -> bool:
        return self.slot.n_past < len(self.job.tokens)

    @property
    def reserved(self) -> int:
        """KV positions this request may occupy until it ends (unified-cache admission)."""
        return len(self.job.tokens) + self.max_new


def lora_of(act: Active) -> tuple[tuple[str, float], ...]:
    """The adapter set ``act`` decodes with (``()``: the base model)."""
    return act.job.lora or ()
