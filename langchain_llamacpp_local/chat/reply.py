"""Reading a reply on the caller's side: parsing, logprobs, usage and the final item.

The worker sends text past its stop strings (:class:`TextDelta`) and one
:class:`Finished` or :class:`Failed`; this module runs the request's incremental output
parser over that text, gives each parsed piece the logprobs of the tokens sampled since
the last piece, and builds usage, timings and the parser's final result (llama.cpp's
``task_result_state``, vLLM's output processor). The parser's cost never lands on the
thread that decodes for every slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import anyio

from langchain_llamacpp_local.chat.prompts import OutputParser, PreparedPrompt
from langchain_llamacpp_local.errors import RequestTimeoutError, WorkerDeadError
from langchain_llamacpp_local.formats import StreamDelta
from langchain_llamacpp_local.runtime.requests import (
    EngineRequest,
    Failed,
    Finished,
    PromptProgress,
    TextDelta,
)

logger = logging.getLogger(__name__)


@dataclass
class Done:
    """The end of a reply as the caller sees it: why generation ended, usage, timings."""

    finish_reason: str
    usage: dict[str, Any]
    timings: dict[str, float]
    model_name: str
    logprobs: list[dict[str, Any]] | None = None
    parsed: Any = None  # the parser's final ParsedOutput, when tools or reasoning were parsed
    speculative: dict[str, Any] | None = None  # {"type", "drafted", "accepted"} when asked for
    lora: dict[str, float] | None = None  # adapters applied (name -> scale), when configured
    cache: dict[str, Any] | None = None  # the worker's cache report (see Finished.cache)
    #: calls past the first that ``parallel_tool_calls=False`` left out (never silently)
    dropped_tool_calls: list[dict[str, Any]] | None = None


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
    """The reply to one submitted request, as ``("delta", StreamDelta)`` items and one
    ``("done", Done)``; an error the worker reports is raised."""

    def __init__(self, request: EngineRequest, prepared: PreparedPrompt, model_name: str) -> None:
        self.request = request
        self.model_name = model_name
        self.parser: OutputParser = prepared.make_parser()
        #: logprobs of tokens no parsed piece has carried yet (None: not asked for)
        self._logprobs: list[dict[str, Any]] | None = [] if request.logprobs else None
        #: maps a cache miss to the prompt's messages (the front end's; None: not reported)
        self.explain_miss: Callable[[PreparedPrompt, dict[str, Any]], dict[str, Any]] | None = None
        self.prepared = prepared

    def _pieces(self, deltas: list[StreamDelta]) -> list[tuple[str, Any]]:
        """Parsed pieces; the first carries the logprobs of the tokens sampled since the
        last piece sent (as OpenAI streams them: each chunk its own). With one call
        allowed, pieces of later calls are held back (:meth:`_one_call`)."""
        out: list[tuple[str, Any]] = []
        for d in deltas:
            if d.kind == "tool_call" and not self.prepared.parallel and (d.index or 0) > 0:
                continue
            if self._logprobs:
                d = replace(d, logprobs=self._logprobs)
                self._logprobs = []
            out.append(("delta", d))
        return out

    def _one_call(self, parsed: Any) -> tuple[Any, list[dict[str, Any]] | None]:
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

    def handle(self, item: Any) -> list[tuple[str, Any]]:
        """What one reply item from the worker gives the caller."""
        if isinstance(item, TextDelta):
            if self._logprobs is not None and item.logprobs:
                self._logprobs.extend(item.logprobs)
            return self._pieces(self.parser.feed(item.text))
        if isinstance(item, Finished):
            if self._logprobs is not None and item.logprobs:
                self._logprobs.extend(item.logprobs)
            out = self._pieces(self.parser.finish())
            cache = item.cache
            if cache is not None and cache["missed"] and self.explain_miss is not None:
                try:
                    miss = self.explain_miss(self.prepared, cache)
                except WorkerDeadError:
                    # unloaded between the reply's end and its reading (evicted, closed):
                    # the reply stands; only the miss's place in the messages is unknown
                    miss = {"cause": f"not explained: {UNLOADED}"}
                cache = {**cache, "miss": miss}
            parsed, dropped = self._one_call(getattr(self.parser, "result", None))
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
                cache,
                dropped,
            )
            return [*out, ("done", done)]
        if isinstance(item, PromptProgress):
            progress = {"total": item.total, "cached": item.cached, "processed": item.processed}
            return [("progress", progress)]
        if isinstance(item, Failed):
            raise item.error
        raise TypeError(f"unexpected reply item {item!r}")

    def items(self) -> Iterator[tuple[str, Any]]:
        """The reply's items as they come; cancels the request if the reader goes away."""
        req = self.request
        finished = False
        try:
            while True:
                remaining = None if req.deadline is None else req.deadline - time.monotonic()
                try:
                    item = req.channel.get(
                        timeout=max(remaining, 0) if remaining is not None else None
                    )
                except TimeoutError:
                    req.cancel.set()
                    raise RequestTimeoutError("ChatLlamaCpp call timed out") from None
                finished = item.final
                yield from self.handle(item)
                if finished:
                    return
        finally:
            if not finished:
                req.cancel.set()

    async def aitems(self) -> AsyncIterator[tuple[str, Any]]:
        """:meth:`items` for an event loop (the channel bound to it first)."""
        req = self.request
        finished = False
        try:
            while True:
                remaining = None if req.deadline is None else req.deadline - time.monotonic()
                try:
                    if remaining is None:
                        item = await req.channel.aget()
                    else:
                        with anyio.fail_after(max(remaining, 0)):
                            item = await req.channel.aget()
                except TimeoutError:
                    req.cancel.set()
                    raise RequestTimeoutError("ChatLlamaCpp call timed out") from None
                finished = item.final
                for out in self.handle(item):
                    yield out
                if finished:
                    return
        finally:
            if not finished:
                req.cancel.set()
