"""Reading a reply on the caller's side: parsing, logprobs, usage and the final item.

The worker sends text past its stop strings (:class:`TextDelta`) and one
:class:`Finished` or :class:`Failed`; this module runs the request's incremental output
parser over that text, gives each parsed piece the logprobs of the tokens sampled since
the last piece, and builds usage, timings and the parser's final result (llama.cpp's
``task_result_state``, vLLM's output processor). The parser's cost never lands on the
thread that decodes for every slot. What the caller gets is typed: :class:`Delta`,
:class:`Progress` and one :class:`Done`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from langchain_llamacpp_local.chat.prompts import OutputParser, PreparedPrompt
from langchain_llamacpp_local.chat.steps import Receive, Steps, seconds_left
from langchain_llamacpp_local.errors import RequestTimeoutError, WorkerDeadError
from langchain_llamacpp_local.formats import DeltaKind, ParsedOutput, StreamDelta
from langchain_llamacpp_local.runtime.requests import (
    CacheReport,
    EngineRequest,
    Failed,
    Finished,
    PromptProgress,
    ReplyItem,
    SpeculationReport,
    TextDelta,
    Timings,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    """A parsed piece of the reply: content, reasoning or a tool call's fragment."""

    piece: StreamDelta


@dataclass(frozen=True)
class Progress:
    """Prompt reading so far: ``processed`` tokens read this call, ``cached`` kept from
    the cache, of ``total``."""

    total: int
    cached: int
    processed: int


@dataclass(frozen=True)
class Done:
    """The end of a reply as the caller sees it: why generation ended, usage, timings."""

    finish_reason: str
    usage: dict[str, Any]
    timings: Timings
    model_name: str
    logprobs: list[dict[str, Any]] | None = None
    #: the parser's final result, when tools or reasoning were parsed
    parsed: ParsedOutput | None = None
    speculative: SpeculationReport | None = None  # when the request speculated
    lora: dict[str, float] | None = None  # adapters applied (name -> scale), when configured
    cache: CacheReport | None = None  # the worker's cache report
    #: where a miss left the prompt's messages (``cache.missed`` and a front end to ask)
    miss: dict[str, Any] | None = None
    #: calls past the first that ``parallel_tool_calls=False`` left out (never silently)
    dropped_tool_calls: list[dict[str, Any]] | None = None


#: What a reply gives its caller, item by item.
Item = Delta | Progress | Done


def usage_of(fin: Finished) -> dict[str, Any]:
    """LangChain's ``usage_metadata`` of a finished reply."""
    usage: dict[str, Any] = {
        "input_tokens": fin.n_prompt,
        "output_tokens": fin.n_generated,
        "total_tokens": fin.n_prompt + fin.n_generated,
        "input_token_details": {"cache_read": fin.n_cached},
    }
    # as OpenAI reports it: 0 when the model did not think
    usage["output_token_details"] = {"reasoning": fin.n_reasoning or 0}
    return usage


#: Why a miss carries no place in the messages (reading it needs the model's vocabulary).
UNLOADED = "the model was unloaded before the reply was read"


class Reply:
    """The reply to one submitted request, read with :meth:`read` (typed items, the
    last a :class:`Done`); an error the worker reports is raised."""

    def __init__(self, request: EngineRequest, prepared: PreparedPrompt, model_name: str) -> None:
        self.request = request
        self.model_name = model_name
        self.parser: OutputParser = prepared.make_parser()
        #: logprobs of tokens no parsed piece has carried yet (None: not asked for)
        self._logprobs: list[dict[str, Any]] | None = [] if request.logprobs else None
        #: maps a cache miss to the prompt's messages (the front end's; None: not reported)
        self.explain_miss: Callable[[PreparedPrompt, CacheReport], dict[str, Any]] | None = None
        self.prepared = prepared
        #: the worker's last item has been read
        self.finished = False

    def _pieces(self, deltas: list[StreamDelta]) -> list[Item]:
        """Parsed pieces; the first carries the logprobs of the tokens sampled since the
        last piece sent (as OpenAI streams them: each chunk its own). With one call
        allowed, pieces of later calls are held back (:meth:`_one_call`)."""
        out: list[Item] = []
        for d in deltas:
            if d.kind == DeltaKind.TOOL_CALL and not self.prepared.parallel and (d.index or 0) > 0:
                continue
            if self._logprobs:
                d = replace(d, logprobs=self._logprobs)
                self._logprobs = []
            out.append(Delta(d))
        return out

    def _one_call(
        self, parsed: ParsedOutput | None
    ) -> tuple[ParsedOutput | None, list[dict[str, Any]] | None]:
        """The parsed reply with the calls past the first left out when only one is
        allowed (``parallel_tool_calls=False``, or the default with one tool): the
        grammar let the model write one more so that it is not cut off unseen; it is
        logged and returned for ``response_metadata["dropped_tool_calls"]`` (an invalid
        one with its error)."""
        if parsed is None or self.prepared.parallel:
            return parsed, None
        valid, invalid = list(parsed.tool_calls), list(parsed.invalid_tool_calls)
        if len(valid) + len(invalid) < 2:
            return parsed, None
        keep_valid, keep_invalid = (valid[:1], []) if valid else ([], invalid[:1])
        dropped = [dict(c) for c in (*valid[len(keep_valid) :], *invalid[len(keep_invalid) :])]
        logger.warning(
            "the model made %d tool calls but only one is allowed (parallel_tool_calls); "
            "dropped %s: see response_metadata['dropped_tool_calls']",
            len(valid) + len(invalid),
            ", ".join(str(c.get("name")) for c in dropped),
        )
        kept = replace(parsed, tool_calls=keep_valid, invalid_tool_calls=keep_invalid)
        return kept, dropped

    def _miss(self, cache: CacheReport | None) -> dict[str, Any] | None:
        """Where a missed prompt left the cached one, in its messages (None: no miss)."""
        if cache is None or not cache.missed or self.explain_miss is None:
            return None
        try:
            return self.explain_miss(self.prepared, cache)
        except WorkerDeadError:
            # unloaded between the reply's end and its reading (evicted, closed): the
            # reply stands; only the miss's place in the messages is unknown
            return {"cause": f"not explained: {UNLOADED}"}

    def handle(self, item: ReplyItem) -> list[Item]:
        """What one reply item from the worker gives the caller."""
        match item:
            case TextDelta():
                if self._logprobs is not None and item.logprobs:
                    self._logprobs.extend(item.logprobs)
                return self._pieces(self.parser.feed(item.text))
            case Finished():
                if self._logprobs is not None and item.logprobs:
                    self._logprobs.extend(item.logprobs)
                out = self._pieces(self.parser.finish())
                parsed, dropped = self._one_call(self.parser.result)
                finish = item.finish_reason
                if finish == "stop" and parsed is not None and parsed.tool_calls:
                    finish = "tool_calls"  # as OpenAI and llama.cpp's server say
                done = Done(
                    finish,
                    usage_of(item),
                    item.timings,
                    self.model_name,
                    # the tokens no streamed piece carried (an end-of-generation token)
                    self._logprobs,
                    parsed,
                    item.speculative,
                    item.lora,
                    item.cache,
                    self._miss(item.cache),
                    dropped,
                )
                return [*out, done]
            case PromptProgress():
                return [Progress(item.total, item.cached, item.processed)]
            case Failed():
                raise item.error
        raise TypeError(f"unexpected reply item {item!r}")

    def read(self) -> Steps[list[Item]]:
        """What the worker's next item gives the caller (:attr:`finished` once it was
        the last); past the deadline the request is cancelled (``RequestTimeoutError``)."""
        item = yield from receive(self.request, "ChatLlamaCpp call timed out")
        self.finished = item.final
        return self.handle(item)

    def close(self) -> None:
        """The reader is gone: a reply not read to its end is cancelled."""
        if not self.finished:
            self.request.cancel.set()


def receive(request: EngineRequest, timeout_message: str) -> Steps[ReplyItem]:
    """The request's next reply item, waited for up to its deadline; past it the request
    is cancelled and ``RequestTimeoutError(timeout_message)`` raised."""
    try:
        return (yield Receive(request.channel, seconds_left(request.deadline)))  # type: ignore[no-any-return]
    except TimeoutError:
        request.cancel.set()
        raise RequestTimeoutError(timeout_message) from None
