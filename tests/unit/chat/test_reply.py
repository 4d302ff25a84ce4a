"""The reply reader (chat/reply.py): parsing, logprobs and usage from the worker's typed
items, without a model."""

from __future__ import annotations

import pytest

from langchain_llamacpp_local.chat.prompts import PreparedPrompt
from langchain_llamacpp_local.chat.reply import Delta, Done, Reply
from langchain_llamacpp_local.errors import DecodeError
from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.runtime.requests import (
    CacheReport,
    EngineRequest,
    Failed,
    Finished,
    SpeculationReport,
    TextDelta,
    Timings,
)


def _lp(tok: str) -> dict:
    return {"token": tok, "logprob": -1.0, "bytes": list(tok.encode()), "top_logprobs": []}


def _reply(*, logprobs: bool, reasoning: bool | None = None) -> Reply:
    prepared = PreparedPrompt(
        text="", tokens=[1], sampling=SamplingParams(), stop=[], reasoning=reasoning
    )
    req = EngineRequest(tokens=[1], sampling=SamplingParams(), max_new=8, logprobs=logprobs)
    return Reply(req, prepared, "tiny")


def _finished(**kw: object) -> Finished:
    timings = Timings(3.0, 1.0, 3000.0, 2.0, 1.0, 2000.0)
    base = dict(n_prompt=5, n_cached=2, n_generated=3, timings=timings)
    return Finished("stop", **{**base, **kw})  # type: ignore[arg-type]


def test_pieces_carry_the_logprobs_of_the_tokens_since_the_last_piece() -> None:
    reply = _reply(logprobs=True, reasoning=True)
    # the first text opens a think block: no piece yet, its logprobs wait for one
    assert reply.handle(TextDelta("<think>", [_lp("<think>")])) == []
    (item, *_) = reply.handle(TextDelta("plan", [_lp("plan")]))
    piece = item.piece
    assert isinstance(item, Delta) and piece.kind == "reasoning" and piece.text == "plan"
    assert [e["token"] for e in piece.logprobs] == ["<think>", "plan"]
    reply.handle(TextDelta("</think>", [_lp("</think>")]))
    out = reply.handle(TextDelta("Hi", [_lp("Hi")]))
    assert [(type(d), d.piece.kind, d.piece.text) for d in out] == [(Delta, "content", "Hi")]
    assert [e["token"] for e in out[0].piece.logprobs] == ["</think>", "Hi"]
    *pieces, done = reply.handle(_finished(logprobs=[_lp("<eos>")]))
    assert pieces == [] and isinstance(done, Done)
    assert [e["token"] for e in done.logprobs] == ["<eos>"]  # no piece carried it
    assert done.usage == {
        "input_tokens": 5,
        "output_tokens": 3,
        "total_tokens": 8,
        "input_token_details": {"cache_read": 2},
        "output_token_details": {"reasoning": 0},  # as OpenAI reports no thinking
    }
    assert (done.model_name, done.finish_reason) == ("tiny", "stop")
    assert done.parsed is not None and done.parsed.reasoning == "plan"


def test_without_logprobs_nothing_carries_them() -> None:
    reply = _reply(logprobs=False)
    (item,) = reply.handle(TextDelta("Hello"))
    assert isinstance(item, Delta) and (item.piece.text, item.piece.logprobs) == ("Hello", None)
    spec = SpeculationReport("ngram", 0, 0)
    (done,) = reply.handle(_finished(speculative=spec, lora={"a": 1.0}))
    assert isinstance(done, Done) and done.logprobs is None and done.parsed is None
    assert (done.speculative, done.lora) == (spec, {"a": 1.0})


def test_a_failed_reply_raises_its_error() -> None:
    reply = _reply(logprobs=False)
    with pytest.raises(DecodeError, match="boom"):
        reply.handle(Failed(DecodeError("boom")))
    assert Failed(DecodeError("x")).final and _finished().final
    assert not TextDelta("x").final


def test_stream_tool_args_reaches_the_parser_from_the_model_and_the_call() -> None:
    """The field and the call option fill the job; the prepared prompt's parser then
    streams a call's arguments while they are written, and a cut-off call ends invalid."""
    from types import SimpleNamespace

    from langchain_core.messages import HumanMessage

    from langchain_llamacpp_local import ChatLlamaCpp
    from langchain_llamacpp_local.chat.request_options import build_job, check_call

    fields = {k: f.default for k, f in ChatLlamaCpp.model_fields.items()}
    model = SimpleNamespace(**fields, model_fields_set=set(), reuse_scope="scope")
    assert model.stream_tool_args is False
    msgs = [HumanMessage("hi")]
    assert build_job(model, msgs, check_call({}, None, model)).stream_tool_args is False
    job = build_job(model, msgs, check_call({"stream_tool_args": True}, None, model))
    assert job.stream_tool_args is True
    model.stream_tool_args = True
    job = build_job(model, msgs, check_call({"stream_tool_args": False}, None, model))
    assert job.stream_tool_args is False
    with pytest.raises(TypeError, match="stream_tool_args"):
        check_call({"stream_tool_args": "yes"}, None, model)

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    prepared = PreparedPrompt(
        text="",
        tokens=[1],
        sampling=SamplingParams(),
        stop=[],
        parse_format="hermes",
        tools=(tool,),
        calls=True,
        stream_args=True,
    )
    req = EngineRequest(tokens=[1], sampling=SamplingParams(), max_new=8)
    reply = Reply(req, prepared, "tiny")
    out = []
    for piece in ('<tool_call>{"name": "f", ', '"arguments": {"text": "a lo', "ng note"):
        out += reply.handle(TextDelta(piece))
    frags = [d.piece for d in out if isinstance(d, Delta) and d.piece.kind == "tool_call"]
    assert frags[0].name == "f" and "".join(d.args for d in frags) == '{"text":"a long note'
    *last, done = reply.handle(_finished())
    (spoil,) = last
    assert spoil.piece.args == '"]' and done.parsed.tool_calls == []
    (bad,) = done.parsed.invalid_tool_calls
    assert bad["args"] == '{"text":"a long note"]'


def test_a_miss_the_unloaded_model_cannot_explain_leaves_the_reply_whole() -> None:
    """The worker finished, then the model was unloaded (evicted by another model, or
    closed) before the caller read the end: the reply is still returned, its miss says
    why it has no place in the messages."""
    from langchain_llamacpp_local.chat.reply import UNLOADED
    from langchain_llamacpp_local.errors import WorkerDeadError

    reply = _reply(logprobs=False)

    def gone(*_a: object) -> dict:
        raise WorkerDeadError("the model worker has stopped")

    reply.explain_miss = gone
    cache = CacheReport(source="slot", missed=True, at=1)
    out = reply.handle(_finished(cache=cache))
    done = out[-1]
    assert isinstance(done, Done)
    assert done.miss == {"cause": f"not explained: {UNLOADED}"}
    assert done.cache.missed is True
