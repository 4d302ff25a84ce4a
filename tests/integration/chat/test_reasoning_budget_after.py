"""After a forced end of thinking the answer is still what the request asked for: tool
calls are read, a JSON-schema grammar constrains the answer (and lets the block close),
and speculative decoding gives the same output as plain decoding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage
from pydantic import BaseModel

from langchain_llamacpp_local import ChatLlamaCpp
from tests.gguf_models import write_scripted_llama

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "llama_cpp_templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
R1 = (TEMPLATES / "llama-cpp-deepseek-r1.jinja").read_text()
THOUGHTS = [f" t{i}" for i in range(8)]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class Answer(BaseModel):
    a: int


ANSWER = '{"a": 1}'


def _printing(path: Path, pieces: list[str], template: str) -> str:
    """A model printing ``pieces`` (each one token), whatever the prompt."""
    transitions = {p: {n: 20.0} for p, n in zip(pieces, [*pieces[1:], "</s>"], strict=True)}
    return str(
        write_scripted_llama(
            path,
            transitions=transitions,
            extra_tokens=tuple(pieces),
            default_next=pieces[0],
            chat_template=template,
            n_ctx_train=8192,
        )
    )


#: family: (template, thinking pieces, call pieces); a lazy grammar's trigger ends on a
#: token boundary, as llama.cpp requires. MiniMax M2's prompt opens the block itself.
CALLING: dict[str, tuple[str, list[str], list[str]]] = {
    "hermes": (
        QWEN3,
        ["<think>", *THOUGHTS, "</think>"],
        ["<tool_call>", "\n" + CALL, "\n</tool_call>"],
    ),
    "seed_oss": (
        (TEMPLATES / "ByteDance-Seed-OSS.jinja").read_text(),
        ["<seed:think>", *THOUGHTS, "</seed:think>"],
        [
            "<seed:tool_call>",
            "\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>",
            "\n</seed:tool_call>",
        ],
    ),
    "minimax_m2": (
        (TEMPLATES / "MiniMax-M2.jinja").read_text(),
        [*THOUGHTS, "</think>"],
        [
            "<minimax:tool_call>",
            '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n',
            "</invoke>\n</minimax:tool_call>",
        ],
    ),
}


@pytest.fixture(scope="module", params=sorted(CALLING))
def calling(request: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Thinks, then calls ``get_weather`` in the family's syntax."""
    template, thinking, call = CALLING[request.param]
    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    return _printing(path, [*thinking, *call], template)


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def answering(request: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Thinks, then writes ``ANSWER``; DeepSeek R1's prompt opens the block itself."""
    if request.param == "qwen3":
        pieces, template = ["<think>", *THOUGHTS, "</think>", ANSWER], QWEN3
    else:
        pieces, template = [*THOUGHTS, "</think>", ANSWER], R1
    return _printing(tmp_path_factory.mktemp(request.param) / "m.gguf", pieces, template)


def _llm(path: str, **kw: Any) -> ChatLlamaCpp:
    base: dict[str, Any] = {"temperature": 0, "reasoning": True, "max_tokens": 64, "n_ctx": 4096}
    return ChatLlamaCpp(model_path=path, **{**base, **kw})


def _reasoning(out: AIMessage) -> tuple[str, int]:
    assert out.usage_metadata is not None
    n = out.usage_metadata.get("output_token_details", {}).get("reasoning", 0)
    return (out.additional_kwargs.get("reasoning_content") or "").strip(), n


@pytest.mark.parametrize("budget", [0, 3, None])
def test_a_tool_call_follows_the_forced_end(calling: str, budget: int | None) -> None:
    llm = _llm(calling).bind_tools([WEATHER])
    out = llm.invoke("weather?", reasoning_budget=budget)
    assert isinstance(out, AIMessage)
    assert [(c["name"], c["args"]) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    thought = THOUGHTS if budget is None else THOUGHTS[:budget]
    assert _reasoning(out) == ("".join(thought).strip(), len(thought))
    streamed = None
    for chunk in llm.stream("weather?", reasoning_budget=budget):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize("budget", [0, 2, None])
def test_a_json_schema_answer_follows_the_forced_end(answering: str, budget: int | None) -> None:
    llm = _llm(answering)
    fmt = {"type": "json_schema", "json_schema": {"schema": Answer.model_json_schema()}}
    out = llm.invoke("a?", reasoning_budget=budget, response_format=fmt)
    assert json.loads(str(out.content)) == {"a": 1}
    thought = THOUGHTS if budget is None else THOUGHTS[:budget]
    assert _reasoning(out) == ("".join(thought).strip(), len(thought))
    # the same through with_structured_output, the budget set on the instance
    structured = _llm(answering, reasoning_budget=budget).with_structured_output(
        Answer, method="json_schema", include_raw=True
    )
    got = structured.invoke("a?")
    assert got["parsed"] == Answer(a=1)
    assert _reasoning(got["raw"]) == ("".join(thought).strip(), len(thought))


@pytest.mark.parametrize("speculative", ["draft", "ngram"])
def test_speculative_decoding_gives_the_plain_answer(answering: str, speculative: str) -> None:
    """The draft model is the model itself: it proposes more thinking where the budget
    forces the end, and those drafts must not be taken."""
    plain = _llm(answering, logprobs=True)
    spec = _llm(answering, logprobs=True, draft_model_path=answering)
    try:
        for budget in (1, 3, None):
            ref = plain.invoke("a?", reasoning_budget=budget, cache_prompt=False)
            got = spec.invoke(
                "a?", reasoning_budget=budget, cache_prompt=False, speculative=speculative
            )
            assert got.content == ref.content == ANSWER
            assert _reasoning(got) == _reasoning(ref)
            ids = [e["id"] for e in got.response_metadata["logprobs"]["content"]]
            assert ids == [e["id"] for e in ref.response_metadata["logprobs"]["content"]]
            if speculative == "draft":
                assert got.response_metadata["speculative"]["accepted"] > 0
    finally:
        plain.close()
        spec.close()
