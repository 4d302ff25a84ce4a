"""A stream's concatenated chunks equal ``invoke``'s message, per tool-call family.

A tiny model that prints an exact text (:mod:`tests.printing_model`) drives the real
request path (template, grammar, worker, parser, LangChain chunk merging). Each family
prints one of llama.cpp's recorded outputs for its template (``tests/test-chat.cpp``,
the line is in the test id); a cut-off call must stay an invalid call when streamed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.chat.messages import aggregate as _aggregate
from langchain_llamacpp_local.formats import detect_format
from langchain_llamacpp_local.formats.registry import FAMILIES
from tests.llama_cpp_cases import TEMPLATES, case_id, load_cases
from tests.printing_model import write_printing_llama

QWEN = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
NOTE = (
    '<tool_call>\n{"name": "write_note", "arguments": {"text": "a fairly long note"}}\n</tool_call>'
)

calls_run: list[dict[str, Any]] = []


def write_note(text: str = "") -> str:
    """Write a note."""
    calls_run.append({"text": text})
    return "saved"


def _merged(chunks: list[Any]) -> AIMessageChunk:
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert isinstance(total, AIMessageChunk)
    return total


def _raw_chunks(bound: Any, text: str) -> list[Any]:
    """The request path's generation chunks for a bound model (what invoke aggregates)."""
    return list(bound.bound._stream([HumanMessage(text)], **bound.kwargs))


def _view(msg: BaseMessage, ids: bool = True) -> dict[str, Any]:
    """What a caller reads of a message (invalid calls' reasons exist only in invoke's)."""
    assert isinstance(msg, AIMessage)

    def key(c: dict[str, Any]) -> tuple[Any, ...]:
        return (c["name"], c["args"], c["id"] if ids else bool(c["id"]))

    return {
        "content": msg.content,
        "reasoning": msg.additional_kwargs.get("reasoning_content"),
        "tool_calls": [key(c) for c in msg.tool_calls],
        "invalid_tool_calls": [key(c) for c in msg.invalid_tool_calls],
    }


@pytest.fixture(scope="module")
def note_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path, _ = write_printing_llama(
        tmp_path_factory.mktemp("printing") / "note.gguf",
        NOTE,
        chat_template=QWEN,
        cuts=("<tool_call>",),
    )
    return str(path)


@pytest.mark.parametrize("max_tokens", [12, 200])
@pytest.mark.parametrize("streaming", [None, True])
def test_cut_off_forced_call_streams_as_the_invalid_call_invoke_gives(
    note_model: str, max_tokens: int, streaming: bool | None
) -> None:
    """``streaming=True`` makes invoke itself merge the chunks (LangChain's path)."""
    extra = {} if streaming is None else {"streaming": streaming}
    llm = ChatLlamaCpp(
        model_path=note_model, temperature=0, n_ctx=1024, max_tokens=max_tokens, **extra
    )
    bound = llm.bind_tools([write_note], tool_choice="any")
    ref = bound.invoke("hi")
    chunks = list(bound.stream("hi"))
    total = _merged(chunks)
    assert _view(total, ids=False) == _view(ref, ids=False)
    assert total.response_metadata["finish_reason"] == ref.response_metadata["finish_reason"]
    if max_tokens == 200:
        assert ref.tool_calls == [
            {**ref.tool_calls[0], "name": "write_note", "args": {"text": "a fairly long note"}}
        ]
        return
    assert ref.response_metadata["finish_reason"] == "length"
    assert total.tool_calls == ref.tool_calls == []
    (bad,) = ref.invalid_tool_calls
    # the chunks' arguments join to exactly the invalid call's raw text
    parts = [tc["args"] or "" for c in chunks for tc in c.tool_call_chunks]
    assert "".join(parts) == bad["args"] and bad["args"].startswith("<tool_call>")
    assert bad["error"] or streaming  # invoke's own aggregation keeps the reason
    # one step of the request path, invoke's aggregation and LangChain's chunk merging
    # of the same chunks, agree on ids too
    raw = _raw_chunks(bound, "hi")
    assert _view(_aggregate(raw).generations[0].message) == _view(_merged([c.message for c in raw]))


def test_agent_never_runs_a_tool_with_a_cut_off_call(note_model: str) -> None:
    from langchain.agents import create_agent

    llm = ChatLlamaCpp(model_path=note_model, temperature=0, n_ctx=1024, max_tokens=24)
    agent = create_agent(llm, tools=[write_note])
    calls_run.clear()
    messages = []
    for chunk, _meta in agent.stream(
        {"messages": [HumanMessage("note it")]},
        stream_mode="messages",
        config={"recursion_limit": 6},
    ):
        messages.append(chunk)
    assert calls_run == []  # the tool never ran with the wrapper as its arguments
    ai = [m for m in messages if isinstance(m, AIMessageChunk)]
    merged = _merged(ai)
    assert merged.tool_calls == [] and len(merged.invalid_tool_calls) == 1
    # the whole call written, the agent runs the tool with its real arguments
    full = ChatLlamaCpp(model_path=note_model, temperature=0, n_ctx=1024, max_tokens=200)
    agent = create_agent(full, tools=[write_note])
    with pytest.raises(Exception, match="[Rr]ecursion"):
        for _ in agent.stream(
            {"messages": [HumanMessage("note it")]},
            stream_mode="messages",
            config={"recursion_limit": 4},
        ):
            pass
    assert calls_run and calls_run[0] == {"text": "a fairly long note"}


# --------------------------------------------------------------------------- per family


def _family_cases() -> list[dict[str, Any]]:
    """The shortest recorded case with a tool call per output format (fewest tokens)."""
    by_fmt: dict[str, dict[str, Any]] = {}
    for case in load_cases()["cases"]:
        if case["is_partial"] or not case["expect"]["tool_calls"] or not case["tools"]:
            continue
        fmt = detect_format((TEMPLATES / case["template"]).read_text(encoding="utf-8"))
        have = by_fmt.get(fmt)
        if have is None or len(case["input"]) < len(have["input"]):
            by_fmt[fmt] = {**case, "_fmt": fmt}
    return [by_fmt[k] for k in sorted(by_fmt)]


FAMILY_CASES = _family_cases()
#: Formats whose printed text the request path changes (a lazy grammar's canonical JSON
#: spacing, the prompt's last token spelling a piece): only stream == invoke is checked.
REWRITTEN = {
    "apertus",
    "cohere2moe",
    "command_r7b",
    "deepseek_v3_1",
    "deepseek_v3_2",
    "gemma4",
    "gigachat_v3",
    "kimi_k3",
    "mistral",
}


@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: f"{c['_fmt']}-{case_id(c)}")
def test_family_stream_concatenation_equals_invoke(case: dict[str, Any], tmp_path: Path) -> None:
    template = (TEMPLATES / case["template"]).read_text(encoding="utf-8")
    triggers = FAMILIES[case["_fmt"]].triggers if case["_fmt"] in FAMILIES else ()
    path, _ = write_printing_llama(
        tmp_path / "m.gguf", case["input"], chat_template=template, cuts=triggers
    )
    reasoning = None if case["reasoning_format"] == "none" else bool(case["enable_thinking"])
    llm = ChatLlamaCpp(
        model_path=str(path),
        temperature=0,
        n_ctx=8192,
        max_tokens=len(case["input"]) + 8,
        reasoning=reasoning,
    )
    tools = [{"type": "function", "function": t} for t in case["tools"]]
    bound = llm.bind_tools(tools, parallel_tool_calls=case["parallel_tool_calls"] or None)
    # one request: its chunks as invoke aggregates them and as LangChain merges a stream
    raw = _raw_chunks(bound, "Hey there!")
    ref = _aggregate(raw).generations[0].message
    total = _merged([c.message for c in raw])
    assert _view(total) == _view(ref)  # content, reasoning, calls and ids
    if case["_fmt"] in REWRITTEN:
        return
    # what llama.cpp parses from the same output
    expect = case["expect"]
    assert [c["name"] for c in ref.tool_calls] == [c["name"] for c in expect["tool_calls"]]
    assert [c["args"] for c in ref.tool_calls] == [
        json.loads(c["arguments"]) for c in expect["tool_calls"]
    ]
    assert str(ref.content).strip() == expect["content"].strip()


# --------------------------------------------------------------------------- no tools bound

SEED_CALL = (
    "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
    "</function>\n</seed:tool_call>"
)
GLM_CALL = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
)
CMD_ACTION = 'Action: ```json\n[{"tool_name": "get_weather", "parameters": {"city": "Paris"}}]\n```'

#: (template, what the model prints, reasoning, content, reasoning content): llama.cpp's
#: no-tools parsers (tests/unit/formats/test_no_tools_output.py names them) remove the turn
#: wrappers, extract reasoning in the family's markers and leave call markup as content
NO_TOOLS = [
    (
        # the prompt opened the turn; its end is the end-of-generation token
        "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
        CMD_ACTION,
        None,
        CMD_ACTION,
        None,
    ),
    (
        "ByteDance-Seed-OSS.jinja",
        f"<seed:think>Look it up.</seed:think>Sure. {SEED_CALL}",
        True,
        f"Sure. {SEED_CALL}",
        "Look it up.",
    ),
    (
        # the prompt opens <think>: by default (llama.cpp's reasoning_format=auto) the
        # text before the call markup that ends the block is reasoning
        "inclusionai-ling-3.0-flash.jinja",
        f"Calling {GLM_CALL}<|role_end|>",
        None,
        GLM_CALL,
        "Calling",
    ),
    ("meetkai-functionary-medium-v3.2.jinja", "all\nHello there", None, "Hello there", None),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "<response>Hi.</response>", None, "Hi.", None),
]


@pytest.mark.parametrize(
    ("template", "text", "reasoning", "content", "thought"),
    NO_TOOLS,
    ids=[t[0].removesuffix(".jinja") for t in NO_TOOLS],
)
def test_no_tools_bound_output_is_content_in_the_familys_own_terms(
    template: str,
    text: str,
    reasoning: bool | None,
    content: str,
    thought: str | None,
    tmp_path: Path,
) -> None:
    source = (TEMPLATES / template).read_text(encoding="utf-8")
    path, _ = write_printing_llama(tmp_path / "m.gguf", text, chat_template=source)
    llm = ChatLlamaCpp(
        model_path=str(path),
        temperature=0,
        n_ctx=8192,
        max_tokens=len(text) + 8,
        reasoning=reasoning,
    )
    ref = llm.invoke("Hey there!")
    assert _view(ref, ids=False) == {
        "content": content,
        "reasoning": thought,
        "tool_calls": [],
        "invalid_tool_calls": [],
    }
    assert _view(_merged(list(llm.stream("Hey there!"))), ids=False) == _view(ref, ids=False)
