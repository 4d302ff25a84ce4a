"""Speculative decoding on real llama.cpp: same output as without it, drafts accepted
where text repeats, rejected positions rolled back (seq_rm or a state restore).

The suite runs with ``LLAMACPP_LOCAL_CHECK_KV=1``: after every step the worker asserts
that each slot's tracked entries equal llama.cpp's memory, so a wrong rollback fails.

The tiny random-weight F32 models probe ``exact_verify_rows == 1`` (a multi-token step
rounds differently; F16/Q8_0/Q4_0 variants of them too), so with ``deterministic=True``
they do not speculate; their tests use the default mode and compare greedy
tokens. The scripted model (attention and FFN zeroed) verifies several tokens
exactly, so there the comparison is bit for bit.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool

from langchain_llamacpp_local import ChatLlamaCpp
from tests.compare import GREEDY, assert_identical, assert_same_greedy, ids
from tests.gguf_models import write_scripted_llama, write_tiny_llama

RAW = "{{ messages[-1].content }}"
CYCLE = "abcd efg."
TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "llama_cpp_templates"


def _spec(msg: Any) -> dict[str, Any]:
    return msg.response_metadata["speculative"]


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Prints ``CYCLE`` over and over from any of its characters; ``.`` may also end."""
    nxt = {c: {CYCLE[(i + 1) % len(CYCLE)]: 10.0} for i, c in enumerate(CYCLE)}
    nxt["."]["</s>"] = 9.0
    path = tmp_path_factory.mktemp("spec") / "cycle.gguf"
    return str(write_scripted_llama(path, transitions=nxt))


def _cycle_llm(path: str, **kw: Any) -> ChatLlamaCpp:
    base: dict[str, Any] = {"max_tokens": 40, "n_ctx": 512, "chat_template": RAW, **GREEDY}
    return ChatLlamaCpp(model_path=path, **{**base, **kw})


# --------------------------------------------------------------------------- scripted model


def test_repetitive_text_accepts_drafts_and_is_identical(cycle_model: str) -> None:
    llm = _cycle_llm(cycle_model)
    ref = llm.invoke("a", cache_prompt=False)
    got = llm.invoke("a", cache_prompt=False, speculative="ngram")
    assert got.content == ref.content == ("bcd efg." + CYCLE * 5)[:40]
    assert_identical(got, ref)
    spec = _spec(got)
    assert spec["type"] == "ngram" and spec["accepted"] > 0
    assert spec["accepted"] <= spec["drafted"]
    timings = got.response_metadata["timings"]
    assert timings["draft_n"] == spec["drafted"]
    assert timings["draft_n_accepted"] == spec["accepted"]
    assert "speculative" not in ref.response_metadata


def test_a_wrong_draft_is_rolled_back(cycle_model: str) -> None:
    """The prompt holds ``efg.abX`` : after ``efg.`` the draft says ``abX...`` and the
    model says ``abc``: two tokens accepted, the rest rejected and trimmed."""
    llm = _cycle_llm(cycle_model, speculative_max_draft=6)
    prompt = "efg.abXYZW e"
    ref = llm.invoke(prompt, cache_prompt=False)
    got = llm.invoke(prompt, cache_prompt=False, speculative="ngram")
    assert_identical(got, ref)
    spec = _spec(got)
    assert 0 < spec["accepted"] < spec["drafted"]
    # the slot (rolled back) continues exactly like a plain run
    history = [HumanMessage(prompt), AIMessage(got.content), HumanMessage("c")]
    assert_identical(
        llm.invoke(history, speculative="ngram"),
        llm.invoke(history, cache_prompt=False),
    )


def test_end_of_generation_stop_string_and_length_inside_a_draft(cycle_model: str) -> None:
    llm = _cycle_llm(cycle_model)
    # "</s>" in the prompt is the EOS token: drafts carry it, the model may end there
    eos_first = write_scripted_llama(
        Path(cycle_model).with_name("eos.gguf"),
        transitions={
            **{c: {CYCLE[(i + 1) % len(CYCLE)]: 10.0} for i, c in enumerate(CYCLE[:-1])},
            ".": {"</s>": 10.0, "a": 9.0},
        },
    )
    eos = _cycle_llm(str(eos_first))
    prompt = "abcd efg.</s>abcd efg.</s>a"
    ref, got = (eos.invoke(prompt, cache_prompt=False, speculative=s) for s in (None, "ngram"))
    assert got.content == ref.content == "bcd efg."
    assert got.response_metadata["finish_reason"] == "stop"
    assert _spec(got)["accepted"] > 0
    assert_identical(got, ref)
    # a stop string in the middle of an accepted draft
    ref, got = (
        llm.invoke("abcd efg.a", stop=["g.ab"], cache_prompt=False, speculative=s)
        for s in (None, "ngram")
    )
    assert got.content == ref.content == "bcd ef"
    assert _spec(got)["drafted"] > 0
    # max_tokens inside a draft: the draft is cut to what may still be generated
    ref, got = (
        llm.invoke("abcd efg.a", max_tokens=11, cache_prompt=False, speculative=s)
        for s in (None, "ngram")
    )
    assert got.content == ref.content == "bcd efg.abc"
    assert got.response_metadata["finish_reason"] == "length"
    assert_identical(got, ref)


def test_streaming_reports_speculation_with_the_final_metadata(cycle_model: str) -> None:
    llm = _cycle_llm(cycle_model)
    ref = llm.invoke("a", cache_prompt=False)
    chunks = list(llm.stream("a", cache_prompt=False, speculative="ngram"))
    assert "".join(str(c.content) for c in chunks) == ref.content
    assert len([c for c in chunks if c.content]) > 1
    final = [c for c in chunks if "speculative" in c.response_metadata]
    assert len(final) == 1 and "finish_reason" in final[0].response_metadata  # with the rest
    assert _spec(final[0])["accepted"] > 0


def test_cancelled_speculative_stream_leaves_the_worker_serving(cycle_model: str) -> None:
    llm = _cycle_llm(cycle_model, max_tokens=400, speculative="ngram")
    gen = llm.stream("a")
    for _ in range(3):
        next(gen)
    gen.close()
    again = llm.invoke("a", max_tokens=20)
    assert again.content == ("bcd efg." + CYCLE * 3)[:20]


def test_one_request_speculates_beside_one_that_does_not(cycle_model: str) -> None:
    llm = _cycle_llm(cycle_model, n_slots=2, max_tokens=120)
    prompts = ["a", " e"]
    solo = [llm.invoke(p, cache_prompt=False) for p in prompts]
    results: list[Any] = [None, None]

    def run(i: int) -> None:
        results[i] = llm.invoke(prompts[i], speculative="ngram" if i == 0 else None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for got, ref in zip(results, solo, strict=True):
        assert_identical(got, ref)
    assert _spec(results[0])["accepted"] > 0
    assert "speculative" not in results[1].response_metadata


# --------------------------------------------------------------------------- random weights


@pytest.mark.parametrize("arch", ["llama", "mamba", "hybrid"])
def test_random_model_rollback_matches_plain_decoding(arch: str, request: Any) -> None:
    """Random weights: drafts are mostly rejected, so every verify step rolls back
    (seq_rm for llama, a state restore and re-decode for Mamba and the hybrid)."""
    path = request.getfixturevalue(f"tiny_{arch}")
    llm = ChatLlamaCpp(
        model_path=path,
        chat_template=RAW,
        n_ctx=512,
        max_tokens=30,
        speculative_max_draft=6,
        **GREEDY,
    )
    seed = "The quick brown fox jumps over the lazy dog. "
    said = str(llm.invoke(seed, cache_prompt=False).content)
    prompt = seed + said + seed + said[:5]  # the model may say it again: drafts
    ref = llm.invoke(prompt, cache_prompt=False)
    got = llm.invoke(prompt, cache_prompt=False, speculative="ngram")
    assert_same_greedy(got, ref)
    assert _spec(got)["drafted"] > 0
    # continue the conversation from the slot the speculative turn left behind
    turn = [HumanMessage(prompt), AIMessage(got.content), HumanMessage(seed)]
    assert_same_greedy(llm.invoke(turn, speculative="ngram"), llm.invoke(turn, cache_prompt=False))


def test_exact_mode_does_not_speculate_where_the_probe_forbids_it(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(
        model_path=tiny_llama, chat_template=RAW, max_tokens=12, deterministic=True, **GREEDY
    )
    info = llm._lease(None, None)[0]
    try:
        rows = info.worker.stats().exact_verify_rows
    finally:
        info.release()
    assert rows == 1  # F32 tiny model: a multi-token step rounds differently
    prompt = "hello hello hello hello"
    got = llm.invoke(prompt, speculative="ngram", cache_prompt=False)
    assert _spec(got) == {"type": "ngram", "drafted": 0, "accepted": 0}
    assert_identical(got, llm.invoke(prompt, cache_prompt=False))


# --------------------------------------------------------------------------- grammars


@tool
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return city


def test_forced_tool_call_and_json_schema_with_speculation(tmp_path: Path) -> None:
    """The prompt repeats the tool's schema, so drafts of its names get verified under
    the grammar; the output is the same call as without speculation."""
    path = write_tiny_llama(
        tmp_path / "tools.gguf",
        chat_template=(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(),
    )
    llm = ChatLlamaCpp(model_path=str(path), max_tokens=60, n_ctx=2048, **GREEDY)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    q = "Weather in Paris? Call get_weather with city Paris."
    ref = bound.invoke(q, cache_prompt=False)
    got = bound.invoke(q, cache_prompt=False, speculative="ngram")
    assert ids(got) == ids(ref)
    assert got.tool_calls == ref.tool_calls or got.invalid_tool_calls == ref.invalid_tool_calls
    assert _spec(got)["accepted"] > 0
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    rf = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    q = 'Answer as {"city": ..., "country": ...}: where is the Eiffel tower?'
    ref = llm.invoke(q, response_format=rf, cache_prompt=False)
    got = llm.invoke(q, response_format=rf, cache_prompt=False, speculative="ngram")
    assert ids(got) == ids(ref) and got.content == ref.content


# --------------------------------------------------------------------------- Gemma


def test_gemma_exact_mode_and_fast_mode(gemma: str) -> None:
    """Gemma 3 270M Q4_K_M on x86: a 2-token verify step already rounds differently
    after some prefixes, so the probe allows 1 and exact mode does not speculate; with
    the default mode drafts are verified and accepted on text to repeat."""
    text = "The cat sat on the mat. The dog sat on the log. The bird sat on the branch."
    prompt = f"Repeat this text exactly, word for word:\n\n{text}"
    base: dict[str, Any] = {"model_path": gemma, "max_tokens": 24, "n_ctx": 1024, "n_slots": 1}
    exact = ChatLlamaCpp(**base, deterministic=True, **GREEDY)
    ref = exact.invoke(prompt, cache_prompt=False)
    got = exact.invoke(prompt, cache_prompt=False, speculative="ngram")
    assert_identical(got, ref)
    lease = exact._lease(None, None)[0]
    try:
        rows = lease.worker.stats().exact_verify_rows
    finally:
        lease.release()
    if rows < 2:
        assert _spec(got) == {"type": "ngram", "drafted": 0, "accepted": 0}
    fast = ChatLlamaCpp(**base, **GREEDY)
    got = fast.invoke(prompt, cache_prompt=False, speculative="ngram")
    # not exact: the same tokens, log-probabilities within rounding of a 4-bit model
    # (a multi-token step moved them by up to ~0.5 in the lead's measurements)
    assert_same_greedy(got, fast.invoke(prompt, cache_prompt=False), tol=1.0)
    assert _spec(got)["accepted"] > 0


def test_gemma_rollback_past_the_sliding_window_trims_like_llama_cpp(gemma: str) -> None:
    """Default mode, a sequence longer than Gemma's 512-position window: rejected
    draft rows are trimmed with ``seq_rm`` (no state copy per step, as llama.cpp's
    server does), and the tokens stay those of plain decoding. The suite's KV check
    asserts after every step that the slot holds what the worker tracks."""
    # the same few words in ever other orders: a copied n-gram's last occurrence
    # often continues differently, so drafts are partly rejected
    who, did, what = ["cat", "dog", "bird"], ["saw", "ate", "hid"], ["mat", "log", "hat"]
    text = " ".join(
        f"the {who[i % 3]} {did[i * 7 % 3]} the {what[i * 5 // 3 % 3]}." for i in range(90)
    )
    prompt = f"Copy this text exactly:\n\n{text}\n\nCopy:\n\n{text[:300]}"
    llm = ChatLlamaCpp(model_path=gemma, max_tokens=40, n_ctx=2048, n_slots=1, **GREEDY)
    n_prompt = llm.get_num_tokens(prompt)
    assert n_prompt > 512, n_prompt
    ref = llm.invoke(prompt, cache_prompt=False)
    got = llm.invoke(prompt, cache_prompt=False, speculative="ngram")
    assert_same_greedy(got, ref, tol=1.0)
    spec = _spec(got)
    assert spec["accepted"] > 0 and spec["drafted"] > spec["accepted"]  # rolled back too
    turn = [HumanMessage(prompt), AIMessage(got.content), HumanMessage("Again.")]
    assert_same_greedy(
        llm.invoke(turn, speculative="ngram"), llm.invoke(turn, cache_prompt=False), tol=1.0
    )


# --------------------------------------------------------------------------- images


def test_speculation_after_an_image_looks_only_at_the_text_after_it(
    cycle_model: str, models_dir: Path
) -> None:
    """Image positions are not tokens: the proposer sees the text after the last image
    (here text before it, an image, then the cycle to continue)."""
    import base64
    import io

    from PIL import Image

    from tests.gguf_models import write_tiny_mmproj

    mmproj = str(write_tiny_mmproj(models_dir / "spec-mmproj.gguf", text_n_embd=64))
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    image = {"type": "image", "base64": data, "mime_type": "image/png"}
    llm = _cycle_llm(cycle_model, mmproj_path=mmproj, n_slots=1)
    text = {"type": "text", "text": "abcd efg.abcd efg.a"}
    msgs = [HumanMessage(content=[{"type": "text", "text": "xyz"}, image, text])]
    ref = llm.invoke(msgs, cache_prompt=False)
    got = llm.invoke(msgs, cache_prompt=False, speculative="ngram")
    assert_identical(got, ref)
    assert got.content.startswith("bcd efg.")
    assert _spec(got)["accepted"] > 0


def test_worker_refuses_a_proposer_it_does_not_have_and_keeps_serving(cycle_model: str) -> None:
    from langchain_llamacpp_local.cache.slot_memory import CacheOptions
    from langchain_llamacpp_local.chat.frontend import frontend_for
    from langchain_llamacpp_local.chat.jobs import ChatJob
    from langchain_llamacpp_local.llama.loading import LoadConfig
    from langchain_llamacpp_local.llama.sampling import SamplingParams
    from langchain_llamacpp_local.runtime.requests import Failed, Finished
    from langchain_llamacpp_local.runtime.worker import ModelWorker

    worker = ModelWorker(LoadConfig(model_path=cycle_model, n_ctx=256), CacheOptions())
    try:
        frontend = frontend_for(worker)

        def job(**kw: Any) -> ChatJob:
            return ChatJob(
                messages=[{"role": "user", "content": "a"}],
                sampling=SamplingParams(temperature=0),
                max_tokens=5,
                chat_template=RAW,
                **kw,
            )

        refused = worker.submit(frontend.prepare(job(speculative="draft"))[0]).get()
        assert isinstance(refused, Failed) and "draft_model_path" in str(refused.error)
        items = []
        ch = worker.submit(frontend.prepare(job(speculative="ngram"))[0])
        while not items or not items[-1].final:
            items.append(ch.get())
        assert isinstance(items[-1], Finished)
        assert items[-1].speculative.kind == "ngram"
    finally:
        worker.stop()
