"""Reply items to LangChain: streamed chunks, the ``invoke`` result and its message.

What ChatOpenAI's chunks carry, shaped the same way: content, reasoning in
``additional_kwargs``, tool-call chunks, per-piece logprobs, and on the last chunk usage,
timings and ``response_metadata``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from langchain_llamacpp_local.chat.reply import Delta, Done
from langchain_llamacpp_local.errors import RequestCancelledError
from langchain_llamacpp_local.formats import DeltaKind, StreamDelta

#: generation_info key of the parser's final result (merged chunks carry it to aggregate)
PARSED_KEY = "_llamacpp_parsed"


def chunk_of(item: Delta | Done, name: str | None = None) -> ChatGenerationChunk:
    """One reply item of :class:`~.reply.Reply` as a LangChain chunk; the last carries
    usage, timings and ``response_metadata``, and the parser's final result for
    :func:`aggregate`."""
    if isinstance(item, Delta):
        return ChatGenerationChunk(message=delta_message(item.piece))
    msg = AIMessageChunk(
        content="",
        usage_metadata=item.usage,  # type: ignore[arg-type]
        response_metadata=response_metadata(item, name),  # type: ignore[arg-type]
    )
    info: dict[str, Any] = {"finish_reason": item.finish_reason}
    if item.parsed is not None:
        info[PARSED_KEY] = item.parsed
    return ChatGenerationChunk(message=msg, generation_info=info)


def response_metadata(done: Done, name: str | None = None) -> dict[str, Any]:
    """The last chunk's ``response_metadata``: the one place the reply's typed reports
    (timings, speculation, cache) become the dicts LangChain callers read."""
    timings = {k: v for k, v in asdict(done.timings).items() if v is not None}
    meta: dict[str, Any] = {
        "model_name": name or done.model_name,
        "model_provider": "llamacpp",
        "finish_reason": done.finish_reason,
        "timings": timings,
    }
    if done.logprobs is not None:
        meta["logprobs"] = {"content": done.logprobs}
    if (spec := done.speculative) is not None:
        meta["speculative"] = {
            "type": spec.kind,
            "drafted": spec.drafted,
            "accepted": spec.accepted,
        }
    if done.lora is not None:
        meta["lora"] = done.lora
    if done.dropped_tool_calls:
        meta["dropped_tool_calls"] = done.dropped_tool_calls
    if done.cache is not None:
        meta["cache"] = {
            "source": done.cache.source,
            "cached_tokens": done.usage["input_token_details"]["cache_read"],
            "missed": done.cache.missed,
        }
        if done.cache.moved is not None:  # cache_reuse on: moved rather than read
            meta["cache"]["moved_tokens"] = done.cache.moved
            meta["cache"]["reuse_off"] = done.cache.reuse_off
        if done.miss is not None:
            meta["cache"]["miss"] = done.miss
    return meta


def delta_message(d: StreamDelta) -> AIMessageChunk:
    """One streamed piece; with ``logprobs``, those of its own tokens, shaped as
    ChatOpenAI's chunks carry them (merging the chunks concatenates the lists)."""
    meta: dict[str, Any] = {} if d.logprobs is None else {"logprobs": {"content": d.logprobs}}
    if d.kind == DeltaKind.CONTENT:
        return AIMessageChunk(content=d.text, response_metadata=meta)
    if d.kind == DeltaKind.REASONING:
        return AIMessageChunk(
            content="", additional_kwargs={"reasoning_content": d.text}, response_metadata=meta
        )
    return AIMessageChunk(
        content="",
        tool_call_chunks=[tool_call_chunk(name=d.name, args=d.args, id=d.id, index=d.index)],
        response_metadata=meta,
    )


def text_of(piece: StreamDelta) -> str:
    """The text ``on_llm_new_token`` gets for a piece (reasoning and calls: none)."""
    return piece.text if piece.kind == DeltaKind.CONTENT else ""


def _without_tool_chunks(chunk: ChatGenerationChunk) -> ChatGenerationChunk:
    """``chunk`` with no tool-call fragments (a copy, not validated again: linear)."""
    msg = chunk.message
    if not isinstance(msg, AIMessageChunk) or not msg.tool_call_chunks:
        return chunk
    bare = msg.model_copy(
        update={"tool_call_chunks": [], "tool_calls": [], "invalid_tool_calls": []}
    )
    return ChatGenerationChunk(message=bare, generation_info=chunk.generation_info)


def aggregate(chunks: list[ChatGenerationChunk]) -> ChatResult:
    """Merge streamed chunks into the ``invoke`` result.

    Tool calls come from the parser's final result: chunk merging would read a
    truncated call's arguments as valid partial JSON, where the parser reports
    it in ``invalid_tool_calls``.
    """
    if not chunks:
        raise RequestCancelledError("no reply from the model")
    if any(PARSED_KEY in (c.generation_info or {}) for c in chunks[-1:]):
        # the parser's result replaces the merged calls: merging argument fragments
        # would re-read the growing partial JSON at each one (quadratic in its length)
        chunks = [_without_tool_chunks(c) for c in chunks]
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    msg = total.message
    assert isinstance(msg, AIMessageChunk)
    info = dict(total.generation_info or {})
    parsed = info.pop(PARSED_KEY, None)
    invalid = list(parsed.invalid_tool_calls if parsed is not None else msg.invalid_tool_calls)
    if invalid and info.get("finish_reason") == "length":
        # the call still being written when the token limit came: say so
        last = invalid[-1]
        error = f"cut off by max_tokens before the call was complete ({last.get('error')})"
        invalid[-1] = {**last, "error": error}
    message = AIMessage(
        content=msg.content,
        additional_kwargs=msg.additional_kwargs,
        response_metadata=msg.response_metadata,
        usage_metadata=msg.usage_metadata,
        tool_calls=parsed.tool_calls if parsed is not None else msg.tool_calls,
        invalid_tool_calls=invalid,
        id=msg.id,
    )
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])
