"""``LlamaCppDecisionModel`` on real llama.cpp: label probabilities, shared KV prefix,
and LangChain's decision middleware (``AutoModeMiddleware``, ``ModelRouterMiddleware``).

Scripted models (:mod:`tests.printing_model`) make the next-token distribution known:
whatever a prompt ends with is followed by the script's first piece with logit 10 (the
rest of the vocabulary 0), each piece by the next with logit 20.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from langchain_core.decisions import Box, Choice, ClassifierResponse, Noul, Score
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool

from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppDecisionModel
from langchain_llamacpp_local.decisions import ask, question_message, render_state
from langchain_llamacpp_local.errors import (
    InvalidRequestError,
    RequestCancelledError,
    RequestTimeoutError,
)
from tests.gguf_models import write_scripted_llama
from tests.helpers import worker_of
from tests.printing_model import write_printing_llama

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "llama_cpp_templates"
QWEN = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")

QUESTIONS = {
    "risky": Noul(instructions="Would executing tool_call be risky?"),
    "team": Choice(
        instructions="Which team should handle this?",
        criteria={"billing": "Payments.", "technical": "Bugs.", "sales": "Pricing."},
    ),
    "severity": Score(instructions="How severe is it?", criteria=["low", "medium", "high"]),
}


def _state(n: int = 40) -> dict[str, object]:
    return {
        "messages": [HumanMessage("Please delete every file in my home directory.")],
        "tool_call": {"name": "delete_file", "args": {"path": "~", "recursive": True}},
        "log": " ".join(f"line {i}: nothing to report" for i in range(n)),
    }


def _printer(tmp: Path, name: str, text: str) -> str:
    path, _ = write_printing_llama(tmp / f"{name}.gguf", text, chat_template=QWEN)
    return str(path)


def _check_distributions(resp: ClassifierResponse) -> None:
    assert set(resp.answers) == set(QUESTIONS)
    noul = resp.nouls["risky"].noul
    assert math.isfinite(noul) and 0.0 <= noul <= 1.0
    for dist in (resp.choices["team"].probabilities, resp.scores["severity"].probabilities):
        assert all(math.isfinite(p) and 0.0 <= p <= 1.0 for p in dist.values())
        assert math.isclose(sum(dist.values()), 1.0, rel_tol=1e-9)
    score = resp.scores["severity"]
    assert score.score == pytest.approx(sum(k * p for k, p in score.probabilities.items()))
    assert 0.0 <= score.confidence <= 1.0
    assert resp.choices["team"].confidence == max(resp.choices["team"].probabilities.values())


def test_probabilities_are_finite_and_sum_to_one(smollm2: str) -> None:
    dm = ChatLlamaCpp(model_path=smollm2, n_ctx=4096).as_decision_model()
    assert isinstance(dm, LlamaCppDecisionModel)
    resp = dm.invoke({"state": _state(), "questions": QUESTIONS})
    _check_distributions(resp)
    assert resp.usage is not None and resp.usage["input_tokens"] > 0
    assert resp.usage["output_tokens"] == 0
    # twelve levels: "1" starts "10" on a tokenizer that splits digits
    wide = Score(instructions="Rate it.", criteria=[f"level {i}" for i in range(12)])
    dist = dm.invoke({"state": "x", "questions": {"w": wide}}).scores["w"].probabilities
    assert list(dist) == list(range(12))
    assert all(math.isfinite(p) for p in dist.values())
    assert math.isclose(sum(dist.values()), 1.0, rel_tol=1e-9)


async def test_probabilities_async_equal_sync(smollm2: str) -> None:
    dm = ChatLlamaCpp(model_path=smollm2, n_ctx=4096).as_decision_model()
    ref = dm.invoke({"state": _state(), "questions": QUESTIONS})
    got = await dm.ainvoke({"state": _state(), "questions": QUESTIONS})
    _check_distributions(got)
    assert got.nouls["risky"].noul == pytest.approx(ref.nouls["risky"].noul, abs=1e-3)
    assert got.choices["team"].choice == ref.choices["team"].choice


@pytest.mark.parametrize(("script", "high"), [("yes, that is risky", True), ("no", False)])
def test_noul_follows_the_scripted_next_token(tmp_path: Path, script: str, high: bool) -> None:
    dm = ChatLlamaCpp(model_path=_printer(tmp_path, "judge", script)).as_decision_model()
    p = dm.invoke({"state": "rm -rf ~", "questions": {"q": Noul(instructions="Risky?")}})
    noul = p.nouls["q"].noul
    assert noul > 0.999 if high else noul < 0.001


def test_multi_token_labels_are_scored_as_sequences(tmp_path: Path) -> None:
    """ "ab" and "ac" share their first token: only the second one tells them apart."""
    path = write_scripted_llama(
        tmp_path / "ac.gguf",
        transitions={"a": {"c": 20.0}},
        default_next="a",
        chat_template=QWEN,
    )
    dm = ChatLlamaCpp(model_path=str(path)).as_decision_model()
    q = Choice(instructions="Which?", criteria={"ab": None, "ac": None})
    resp = dm.invoke({"state": "x", "questions": {"q": q}})
    assert resp.choices["q"].choice == "ac"
    assert resp.choices["q"].probabilities["ac"] > 0.999


def test_a_label_that_starts_another_is_scored_to_the_end_of_the_turn(tmp_path: Path) -> None:
    """With "a" and "ab" allowed, "a" followed by "b" is not the answer "a": each label
    counts only with the end of the turn after it (here the model ends after "ab")."""
    path = write_scripted_llama(
        tmp_path / "ab.gguf",
        transitions={"a": {"b": 20.0}, "b": {"</s>": 20.0}},
        default_next="a",
        chat_template=QWEN,
    )
    dm = ChatLlamaCpp(model_path=str(path)).as_decision_model()
    q = Choice(instructions="Which?", criteria={"a": None, "ab": None})
    resp = dm.invoke({"state": "x", "questions": {"q": q}})
    assert resp.choices["q"].probabilities["ab"] > 0.999


def test_questions_share_the_state_prefix(smollm2: str) -> None:
    """The second and third questions read the state from the KV cache; asking again
    reads all three prompts from it."""
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=4096)
    dm = llm.as_decision_model()
    state = _state(120)
    text, media = render_state(state)
    a = llm.render_prompt([question_message(text, media, "first")]).tokens
    b = llm.render_prompt([question_message(text, media, "second")]).tokens
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared > 1000  # the state is most of each prompt

    first = dm.invoke({"state": state, "questions": QUESTIONS})
    assert first.usage is not None
    assert first.usage["input_token_details"]["cache_read"] >= 2 * shared
    again = dm.invoke({"state": state, "questions": QUESTIONS})
    assert again.usage is not None
    n_in = again.usage["input_tokens"]
    assert again.usage["input_token_details"]["cache_read"] >= n_in - 3
    # the cached answers are the fresh ones
    assert again.nouls["risky"].noul == pytest.approx(first.nouls["risky"].noul, abs=1e-3)


@pytest.mark.parametrize("kind", ["tiny_mamba", "tiny_hybrid", "gemma"])
def test_memory_that_cannot_be_trimmed(kind: str, request: pytest.FixtureRequest) -> None:
    """Recurrent memory (and Gemma 3's sliding window): label tokens are rolled back
    from a saved state and the second question resumes from the checkpoint at the end
    of the state; in deterministic mode a cached answer is the fresh one exactly."""
    path = request.getfixturevalue(kind)
    dm = ChatLlamaCpp(model_path=path, n_ctx=2048, deterministic=True).as_decision_model()
    state = "word " * 300
    qs = {"one": Noul(instructions="First?"), "two": QUESTIONS["team"]}
    resp = dm.invoke({"state": state, "questions": qs})
    assert math.isclose(sum(resp.choices["two"].probabilities.values()), 1.0)
    assert resp.usage is not None and resp.usage["input_token_details"]["cache_read"] > 250
    again = dm.invoke({"state": state, "questions": qs})
    assert again.usage is not None
    assert (
        again.usage["input_token_details"]["cache_read"]
        > resp.usage["input_token_details"]["cache_read"]
    )
    assert again.answers == resp.answers


def test_deterministic_cached_answers_equal_fresh_ones(tiny_llama: str) -> None:
    """In deterministic mode a question that found the state cached computes exactly
    what it computes alone on a fresh model."""
    from langchain_llamacpp_local.runtime import registry

    llm = ChatLlamaCpp(model_path=tiny_llama, deterministic=True, n_ctx=2048)
    state = "word " * 250
    both = llm.as_decision_model().invoke({"state": state, "questions": QUESTIONS})
    assert both.usage is not None and both.usage["input_token_details"]["cache_read"] > 1000
    for qid in ("team", "severity"):  # they read the state from the first one's cache
        registry.unload()
        alone = llm.as_decision_model().invoke({"state": state, "questions": {qid: QUESTIONS[qid]}})
        assert alone.answers[qid] == both.answers[qid]


def test_a_question_waits_for_a_busy_slot_and_changes_no_reply(tmp_path: Path) -> None:
    """One slot, held by a streaming chat: the question waits for it; both answers are
    what each gets alone."""

    script = "yes " + " ".join(f"w{i}" for i in range(150))
    llm = ChatLlamaCpp(model_path=_printer(tmp_path, "busy", script), n_slots=1, temperature=0)
    dm = llm.as_decision_model()
    request = {"state": "rm -rf ~", "questions": {"q": Noul(instructions="Risky?")}}
    alone = dm.invoke(request).nouls["q"].noul
    solo = llm.invoke("hi").content
    started = threading.Event()
    chunks: list[str] = []

    def chat() -> None:
        for chunk in llm.stream("hi"):
            chunks.append(str(chunk.content))
            started.set()

    worker = threading.Thread(target=chat)
    worker.start()
    assert started.wait(60)
    assert dm.invoke(request).nouls["q"].noul == pytest.approx(alone, rel=1e-6)
    worker.join(60)
    assert "".join(chunks) == solo


def test_prompts_reach_the_disk_cache(tiny_llama: str, tmp_path: Path) -> None:
    """As a finished chat request's conversation: a freshly loaded model finds the
    question's prompt on disk."""
    from langchain_llamacpp_local.cache import disk as disk_cache
    from langchain_llamacpp_local.runtime import registry

    request = {"state": "word " * 100, "questions": {"q": QUESTIONS["team"]}}
    llm = ChatLlamaCpp(model_path=tiny_llama, prompt_cache_dir=str(tmp_path / "cache"))
    first = llm.as_decision_model().invoke(request)
    registry.unload()
    assert disk_cache.flush(30)
    again = llm.as_decision_model().invoke(request)
    registry.unload()
    assert first.usage is not None and again.usage is not None
    assert first.usage["input_token_details"]["cache_read"] == 0
    assert again.usage["input_token_details"]["cache_read"] >= again.usage["input_tokens"] - 2
    assert again.choices["q"].choice == first.choices["q"].choice


def test_bad_requests_name_the_problem_and_the_worker_keeps_serving(smollm2: str) -> None:
    dm = ChatLlamaCpp(model_path=smollm2, n_ctx=4096).as_decision_model()
    with pytest.raises(InvalidRequestError, match="Box questions are not supported"):
        dm.invoke({"state": "x", "questions": {"b": Box(instructions="the cat")}})
    with pytest.raises(InvalidRequestError, match="at least one question"):
        dm.invoke({"state": "x", "questions": {}})
    image = {"type": "image", "base64": "AAAA", "mime_type": "image/png"}
    with pytest.raises(InvalidRequestError, match="vision projector|image"):
        dm.invoke({"state": {"shot": image}, "questions": {"q": Noul(instructions="ok?")}})
    resp = dm.invoke({"state": "x", "questions": {"q": Noul(instructions="ok?")}})
    assert 0.0 <= resp.nouls["q"].noul <= 1.0


def test_timeout_covers_the_request(smollm2: str) -> None:
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=8192).load()
    slow = llm.model_copy(update={"timeout": 0.05}).as_decision_model()
    with pytest.raises(RequestTimeoutError):
        slow.invoke({"state": _state(400), "questions": QUESTIONS})
    resp = llm.as_decision_model().invoke({"state": "x", "questions": {"q": QUESTIONS["risky"]}})
    assert 0.0 <= resp.nouls["q"].noul <= 1.0


def test_images_in_the_state_with_a_projector(tiny_llama: str, models_dir: Path) -> None:
    import base64
    import io

    from PIL import Image

    from tests.gguf_models import write_tiny_mmproj

    mmproj = write_tiny_mmproj(models_dir / "decisions-mmproj.gguf", text_n_embd=64)
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    image = {"type": "image", "base64": base64.b64encode(buf.getvalue()).decode()}
    image["mime_type"] = "image/png"
    state = {"note": "a screenshot of the settings page", "shot": image, "after": "end"}
    dm = ChatLlamaCpp(model_path=tiny_llama, mmproj_path=str(mmproj)).as_decision_model()
    qs = {"one": QUESTIONS["risky"], "two": QUESTIONS["team"]}
    first = dm.invoke({"state": state, "questions": qs})
    assert math.isclose(sum(first.choices["two"].probabilities.values()), 1.0)
    again = dm.invoke({"state": state, "questions": qs})
    assert again.usage is not None  # everything, the image included, read from the cache
    assert again.usage["input_token_details"]["cache_read"] >= again.usage["input_tokens"] - 2
    assert again.nouls["one"].noul == pytest.approx(first.nouls["one"].noul, rel=1e-3)
    assert again.choices["two"].choice == first.choices["two"].choice


async def test_a_cancelled_async_request_leaves_the_worker_serving(smollm2: str) -> None:
    import asyncio

    dm = ChatLlamaCpp(model_path=smollm2, n_ctx=8192).as_decision_model()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(
            dm.ainvoke({"state": _state(400), "questions": QUESTIONS}), timeout=0.05
        )
    resp = await dm.ainvoke({"state": "x", "questions": {"q": QUESTIONS["risky"]}})
    assert 0.0 <= resp.nouls["q"].noul <= 1.0


# --------------------------------------------------------------------------- middleware

_CALL = '<tool_call>\n{"name": "delete_file", "arguments": {"path": "notes.txt"}}\n</tool_call>'


def _agent_model(tmp: Path) -> ChatLlamaCpp:
    path, _ = write_printing_llama(
        tmp / "caller.gguf", _CALL, chat_template=QWEN, cuts=("<tool_call>",)
    )
    return ChatLlamaCpp(model_path=str(path), temperature=0)


def _auto_mode_agent(tmp: Path, verdict: str, deleted: list[str]) -> object:
    from langchain.agents import create_agent
    from langchain.agents.middleware import AutoModeMiddleware

    @tool(return_direct=True)
    def delete_file(path: str) -> str:
        """Delete a file."""
        deleted.append(path)
        return f"deleted {path}"

    judge = ChatLlamaCpp(model_path=_printer(tmp, "judge", verdict)).as_decision_model()
    return create_agent(
        _agent_model(tmp),
        tools=[delete_file],
        middleware=[AutoModeMiddleware(tools=[delete_file], classifier=judge)],
    )


@pytest.mark.parametrize(("verdict", "blocked"), [("yes, risky", True), ("no", False)])
def test_auto_mode_blocks_risky_calls(tmp_path: Path, verdict: str, blocked: bool) -> None:
    deleted: list[str] = []
    agent = _auto_mode_agent(tmp_path, verdict, deleted)
    out = agent.invoke({"messages": [("user", "Delete notes.txt")]})  # type: ignore[attr-defined]
    tool_msg = next(m for m in out["messages"] if m.type == "tool")
    if blocked:
        assert deleted == [] and tool_msg.status == "error"
        assert "blocked" in tool_msg.content
    else:
        assert deleted == ["notes.txt"] and tool_msg.content == "deleted notes.txt"


async def test_auto_mode_blocks_risky_calls_async(tmp_path: Path) -> None:
    deleted: list[str] = []
    agent = _auto_mode_agent(tmp_path, "yes", deleted)
    out = await agent.ainvoke({"messages": [("user", "Delete notes.txt")]})  # type: ignore[attr-defined]
    assert deleted == [] and "blocked" in out["messages"][-1].content
    (tmp_path / "ok").mkdir()
    allowed = _auto_mode_agent(tmp_path / "ok", "no", deleted)
    await allowed.ainvoke({"messages": [("user", "Delete notes.txt")]})  # type: ignore[attr-defined]
    assert deleted == ["notes.txt"]


def _router_agent(tmp: Path, verdict: str) -> object:
    from langchain.agents import create_agent
    from langchain.agents.middleware import ModelChoice, ModelRouterMiddleware

    fast = ChatLlamaCpp(model_path=_printer(tmp, "fast", "the fast model answers"))
    strong = ChatLlamaCpp(model_path=_printer(tmp, "strong", "the strong model answers"))
    judge = ChatLlamaCpp(model_path=_printer(tmp, "router", verdict)).as_decision_model()
    router = ModelRouterMiddleware(
        choices={
            "fast": ModelChoice(model=fast, criteria="Simple tasks."),
            "strong": ModelChoice(model=strong, criteria="Hard tasks."),
        },
        instructions="Pick the model for the task.",
        classifier=judge,
    )
    return create_agent(fast, middleware=[router])


@pytest.mark.parametrize("route", ["fast", "strong"])
def test_model_router_routes_by_the_decision_model(tmp_path: Path, route: str) -> None:
    agent = _router_agent(tmp_path, route)
    out = agent.invoke({"messages": [("user", "Prove the theorem.")]})  # type: ignore[attr-defined]
    assert out["model_route"].choice == route
    assert out["messages"][-1].content == f"the {route} model answers"


async def test_model_router_routes_async(tmp_path: Path) -> None:
    agent = _router_agent(tmp_path, "strong")
    out = await agent.ainvoke({"messages": [("user", "Prove the theorem.")]})  # type: ignore[attr-defined]
    assert out["model_route"].choice == "strong"
    assert out["messages"][-1].content == "the strong model answers"


def test_the_docs_example_runs(smollm2: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "decisions.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    line = next(ln for ln in code.splitlines() if ln.startswith("MODEL = "))
    exec(compile(code.replace(line, f"MODEL = {smollm2!r}"), "decisions.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert 0.0 <= float(printed[0]) <= 1.0
    assert printed[1].split()[0] in ("billing", "technical", "sales")
    assert "cache_read" in printed[3]


# --------------------------------------------------------------------------- scheduling

#: 100 answer labels of several tokens each: scoring them takes 100 decode calls
MANY = Choice(instructions="Which option?", criteria={f"option {i}": None for i in range(100)})


def _many_cached(llm: ChatLlamaCpp) -> dict[str, Any]:
    """A decision request asking :data:`MANY`, its prompt cached by a chat call first:
    the request's time goes to its labels."""
    request: dict[str, Any] = {"state": "the user asked for an option", "questions": {"q": MANY}}
    text, media = render_state(request["state"])
    llm.invoke([question_message(text, media, ask("q", MANY).text)], max_tokens=1, reasoning=False)
    return request


def _recording_submits(monkeypatch: pytest.MonkeyPatch, on_score: Callable[[], None]) -> None:
    """Call ``on_score()`` when a scoring request reaches a worker's queue."""
    from langchain_llamacpp_local.runtime.requests import ScoreRequest
    from langchain_llamacpp_local.runtime.worker import ModelWorker

    submit = ModelWorker.submit

    def recording(self: ModelWorker, job: Any) -> Any:
        if isinstance(job, ScoreRequest):
            on_score()
        return submit(self, job)

    monkeypatch.setattr(ModelWorker, "submit", recording)


def test_a_stream_keeps_generating_while_a_decision_reads_its_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The question's prompt is read in the worker's pieces beside the stream: the
    stream's tokens go on between the question's arrival and its answer."""
    script = " ".join(f"w{i}" for i in range(1000))
    llm = ChatLlamaCpp(
        model_path=_printer(tmp_path, "stream", script),
        n_batch=64,
        n_ctx=2048,
        kv_unified=False,  # a window per slot: the question need not wait for KV room
        temperature=0,
    )
    dm = llm.as_decision_model()
    request = {"state": "word " * 300, "questions": {"q": Noul(instructions="Risky?")}}
    chunks: list[str] = []
    at_submit: list[int] = []
    _recording_submits(monkeypatch, lambda: at_submit.append(len(chunks)))
    started = threading.Event()

    def chat() -> None:
        try:
            for chunk in llm.stream("hi", max_tokens=1800):
                chunks.append(str(chunk.content))
                started.set()
        finally:
            started.set()

    streamer = threading.Thread(target=chat)
    streamer.start()
    try:
        assert started.wait(60)
        resp = dm.invoke(request)
        at_answer = len(chunks)
    finally:
        streamer.join(120)
    assert 0.0 <= resp.nouls["q"].noul <= 1.0
    assert resp.usage is not None and resp.usage["input_tokens"] > 1500
    (submitted,) = at_submit
    assert at_answer < len(chunks), (submitted, at_answer)  # still generating at the answer
    # about 1,500 prompt tokens in pieces of at most 64: one stream token per piece
    assert at_answer - submitted >= 10, (submitted, at_answer, len(chunks))
    assert "".join(chunks) == script


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_decision_of_100_labels_honours_its_timeout(smollm2: str, mode: str) -> None:
    """The labels are scored a decode call per worker step, the request's deadline seen
    between them: the caller gets RequestTimeoutError at its timeout, and the worker
    drops the question and serves on."""
    import asyncio
    import time

    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=4096).load()
    slow = llm.model_copy(update={"timeout": 1.0}).as_decision_model()
    request = _many_cached(llm)
    took = []
    for _ in range(3):  # the least of a few tries: a busy machine delays any one of them
        t0 = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            if mode == "sync":
                slow.invoke(request)
            else:
                asyncio.run(slow.ainvoke(request))
        took.append(time.monotonic() - t0)
        if took[-1] < 1.5:
            break
    assert min(took) < 1.5, took
    resp = llm.as_decision_model().invoke({"state": "x", "questions": {"q": QUESTIONS["risky"]}})
    assert 0.0 <= resp.nouls["q"].noul <= 1.0
    worker = worker_of(llm)
    assert worker is not None
    stats = worker.stats()
    assert stats.n_active == 0 and stats.n_pending == 0


@pytest.mark.parametrize("closing", ["chat model", "decision model"])
def test_close_stops_a_running_decision(
    smollm2: str, monkeypatch: pytest.MonkeyPatch, closing: str
) -> None:
    """``close()`` of the chat model (or of its decision model) cancels the question the
    worker is scoring: it raises RequestCancelledError instead of answering."""
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=4096).load()
    dm = llm.as_decision_model()
    request = _many_cached(llm)
    queued = threading.Event()
    _recording_submits(monkeypatch, queued.set)
    outcome: list[object] = []

    def decide() -> None:
        try:
            outcome.append(dm.invoke(request))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=decide)
    thread.start()
    assert queued.wait(60)
    (llm if closing == "chat model" else dm).close()
    thread.join(60)
    assert not thread.is_alive()
    (got,) = outcome
    assert isinstance(got, RequestCancelledError), got
    again = ChatLlamaCpp(model_path=smollm2, n_ctx=4096).as_decision_model()
    resp = again.invoke({"state": "x", "questions": {"q": QUESTIONS["risky"]}})
    assert 0.0 <= resp.nouls["q"].noul <= 1.0


@pytest.mark.parametrize("how", ["lora_adapters scale", "lora field"])
def test_decisions_run_on_the_base_model_beside_default_adapters(
    tmp_path: Path, tiny_llama: str, how: str
) -> None:
    """Adapters applied to every chat call by default are not applied to questions:
    the answers are the base model's."""
    from tests.gguf_models import write_tiny_lora

    adapter = str(write_tiny_lora(tmp_path / "a.gguf", seed=1))
    if how == "lora field":
        llm = ChatLlamaCpp(model_path=tiny_llama, lora_adapters={"a": adapter}, lora={"a": 0.5})
    else:
        llm = ChatLlamaCpp(
            model_path=tiny_llama, lora_adapters={"a": {"path": adapter, "scale": 1.0}}
        )
    request = {"state": "word " * 40, "questions": QUESTIONS}
    got = llm.as_decision_model().invoke(request)
    base = ChatLlamaCpp(model_path=tiny_llama).as_decision_model().invoke(request)
    _check_distributions(got)
    assert got.nouls["risky"].noul == pytest.approx(base.nouls["risky"].noul, abs=1e-4)
    for label, p in base.choices["team"].probabilities.items():
        assert got.choices["team"].probabilities[label] == pytest.approx(p, abs=1e-4)


def test_decisions_at_once_get_their_solo_answers(tiny_llama: str) -> None:
    """Questions of several callers run at once, each in its slot: their prompt pieces
    and label calls interleave step by step; in deterministic mode each answer is
    exactly the one it gets alone (here read from the cache the first round left)."""
    from concurrent.futures import ThreadPoolExecutor

    dm = ChatLlamaCpp(model_path=tiny_llama, deterministic=True, n_ctx=2048).as_decision_model()
    requests = [
        {"state": f"case {i}: " + "word " * (60 + 40 * i), "questions": QUESTIONS} for i in range(3)
    ]
    with ThreadPoolExecutor(3) as pool:  # first: their prompts are read together
        together = list(pool.map(lambda r: dm.invoke(r).answers, requests))
    alone = [dm.invoke(r).answers for r in requests]
    assert together == alone


@pytest.mark.smollm2
def test_dict_questions_and_cyclic_debiasing(smollm2: str) -> None:
    """Questions as plain dicts (the wire format) are validated; with ``debias="cyclic"``
    the answer does not depend on the order the options are given in (every rotation is
    asked and averaged), while without it the order moves the probabilities."""
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=4096)
    team = {
        "type": "choice",
        "instructions": "Which team should handle this?",
        "criteria": {"billing": "Payments.", "technical": "Bugs.", "sales": "Pricing."},
    }
    turned = {
        **team,
        "criteria": dict(list(team["criteria"].items())[1:] + [("billing", "Payments.")]),
    }
    fair = llm.as_decision_model(debias="cyclic")
    plain = llm.as_decision_model()

    def probs(dm: LlamaCppDecisionModel, q: dict[str, object]) -> dict[str, float]:
        resp = dm.invoke({"state": _state(), "questions": {"team": q}})
        return resp.choices["team"].probabilities

    a, b = probs(fair, team), probs(fair, turned)
    # the same prompts, averaged in another order (warm and fresh KV round apart a little)
    assert a == pytest.approx(b, abs=2e-3)
    c, d = probs(plain, team), probs(plain, turned)
    assert max(abs(c[k] - d[k]) for k in c) > 0.05
    with pytest.raises(InvalidRequestError, match="not a valid question"):
        plain.invoke({"state": "x", "questions": {"q": {"type": "noul"}}})
