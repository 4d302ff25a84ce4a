"""``stream_tool_args=True`` end to end: argument fragments while the call is written.

A tiny model that prints an exact text (:mod:`tests.printing_model`) drives the real
request path (template, grammar, worker, parser, LangChain chunk merging). For several
families, JSON and markup (each printing one of llama.cpp's recorded outputs for its
template, or a long note): a call's arguments arrive in several chunks under one
``index``, the merged stream equals ``invoke`` (sync and async), and a call cut off by
``max_tokens`` ends in ``invalid_tool_calls``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.formats import detect_format
from langchain_llamacpp_local.formats.registry import FAMILIES
from tests.llama_cpp_cases import TEMPLATES, case_id, load_cases
from tests.printing_model import write_printing_llama

QWEN = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
QWEN_CODER = (TEMPLATES / "Qwen3-Coder.jinja").read_text(encoding="utf-8")
LONG = "a fairly long note about the weather in Paris, then Lyon, then Marseille"
NOTE = f'<tool_call>\n{{"name": "write_note", "arguments": {{"text": "{LONG}"}}}}\n</tool_call>'
NOTE_MARKUP = (
    "<tool_call>\n<function=write_note>\n<parameter=text>\n"
    f"{LONG}\n</parameter>\n</function>\n</tool_call>"
)
NOTE_TOOL = {
    "type": "function",
    "function": {
        "name": "write_note",
        "description": "Write a note.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
}
#: families whose recorded outputs stream their arguments (JSON and markup), printed
#: as recorded (not rewritten by a lazy grammar: see test_stream_equals_invoke.py)
FAMILIES_STREAMED = [
    "hermes",
    "qwen3_coder",
    "glm45",
    "minimax_m2",
    "kimi_k2",
    "gpt_oss",
    "nemotron_v2",
]


def _merged(chunks: list[Any]) -> AIMessageChunk:
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert isinstance(total, AIMessageChunk)
    return total


def _view(msg: BaseMessage) -> dict[str, Any]:
    """What a caller reads of a message (ids differ between two requests)."""
    assert isinstance(msg, AIMessage)

    def key(c: dict[str, Any]) -> tuple[Any, ...]:
        return (c["name"], c["args"], bool(c["id"]))

    return {
        "content": msg.content,
        "reasoning": msg.additional_kwargs.get("reasoning_content"),
        "tool_calls": [key(c) for c in msg.tool_calls],
        "invalid_tool_calls": [key(c) for c in msg.invalid_tool_calls],
    }


def _fragments(chunks: list[Any], index: int = 0) -> list[dict[str, Any]]:
    return [tc for c in chunks for tc in c.tool_call_chunks if tc["index"] == index]


def _cases() -> list[dict[str, Any]]:
    """The shortest recorded case per streamed family whose call has arguments."""
    by_fmt: dict[str, dict[str, Any]] = {}
    for case in load_cases()["cases"]:
        if case["is_partial"] or not case["expect"]["tool_calls"] or not case["tools"]:
            continue
        if len(str(case["expect"]["tool_calls"][0]["arguments"])) < 8:
            continue
        fmt = detect_format((TEMPLATES / case["template"]).read_text(encoding="utf-8"))
        if fmt == "glm45" and case["template"] != "GLM-4.6.jinja":
            continue  # (the others' prompts end on a piece of the printed text)
        have = by_fmt.get(fmt)
        if fmt in FAMILIES_STREAMED and (have is None or len(case["input"]) < len(have["input"])):
            by_fmt[fmt] = {**case, "_fmt": fmt}
    return [by_fmt[k] for k in sorted(by_fmt)]


CASES = _cases()


def _case_model(case: dict[str, Any], tmp_path: Path) -> tuple[ChatLlamaCpp, Any]:
    template = (TEMPLATES / case["template"]).read_text(encoding="utf-8")
    path, _ = write_printing_llama(
        tmp_path / "m.gguf",
        case["input"],
        chat_template=template,
        cuts=FAMILIES[case["_fmt"]].triggers,
    )
    reasoning = None if case["reasoning_format"] == "none" else bool(case["enable_thinking"])
    llm = ChatLlamaCpp(
        model_path=str(path),
        temperature=0,
        n_ctx=8192,
        max_tokens=len(case["input"]) + 8,
        reasoning=reasoning,
        stream_tool_args=True,
    )
    tools = [{"type": "function", "function": t} for t in case["tools"]]
    return llm, llm.bind_tools(tools, parallel_tool_calls=case["parallel_tool_calls"] or None)


def test_the_recorded_cases_cover_json_and_markup_families() -> None:
    assert {"hermes", "qwen3_coder", "glm45", "kimi_k2"} <= {c["_fmt"] for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['_fmt']}-{case_id(c)}")
def test_streamed_arguments_merge_to_invoke_sync_and_async(
    case: dict[str, Any], tmp_path: Path
) -> None:
    llm, bound = _case_model(case, tmp_path)
    ref = bound.invoke("Hey there!")
    assert ref.tool_calls, ref
    chunks = list(bound.stream("Hey there!"))
    assert _view(_merged(chunks)) == _view(ref)
    # the first call's arguments came in several chunks, its id and name in the first
    first = _fragments(chunks)
    assert len(first) > 1 and first[0]["name"] == ref.tool_calls[0]["name"], first
    assert first[0]["id"] and all(f["name"] is None for f in first[1:])
    # the option changes how calls arrive, not what they are
    plain = bound.invoke("Hey there!", stream_tool_args=False)
    assert _view(plain) == _view(ref)
    whole = list(bound.stream("Hey there!", stream_tool_args=False))
    assert len(_fragments(whole)) == 1

    async def run() -> tuple[AIMessage, list[Any]]:
        got = await bound.ainvoke("Hey there!")
        return got, [c async for c in bound.astream("Hey there!")]

    aref, achunks = asyncio.run(run())
    assert _view(aref) == _view(ref)
    assert _view(_merged(achunks)) == _view(ref)
    assert len(_fragments(achunks)) > 1


@pytest.mark.parametrize(("text", "template"), [(NOTE, QWEN), (NOTE_MARKUP, QWEN_CODER)])
def test_a_long_argument_arrives_while_written(text: str, template: str, tmp_path: Path) -> None:
    path, _ = write_printing_llama(
        tmp_path / "note.gguf", text, chat_template=template, cuts=("<tool_call>",)
    )
    llm = ChatLlamaCpp(
        model_path=str(path), temperature=0, n_ctx=2048, max_tokens=400, stream_tool_args=True
    )
    bound = llm.bind_tools([NOTE_TOOL], tool_choice="any")
    chunks = list(bound.stream("note it"))
    ref = bound.invoke("note it")
    assert [(c["name"], c["args"]) for c in ref.tool_calls] == [("write_note", {"text": LONG})]
    assert _view(_merged(chunks)) == _view(ref)
    # partway through, the merged chunks already hold the start of the note
    frags = _fragments(chunks)
    partial = _merged([c for c in chunks if c.tool_call_chunks][: len(frags) // 2])
    (call,) = partial.tool_calls
    assert call["name"] == "write_note" and LONG.startswith(call["args"]["text"])
    assert 0 < len(call["args"]["text"]) < len(LONG)


@pytest.mark.parametrize("max_tokens", [16, 30])
@pytest.mark.parametrize(("text", "template"), [(NOTE, QWEN), (NOTE_MARKUP, QWEN_CODER)])
def test_a_cut_off_streamed_call_ends_invalid(
    text: str, template: str, max_tokens: int, tmp_path: Path
) -> None:
    path, _ = write_printing_llama(
        tmp_path / "note.gguf", text, chat_template=template, cuts=("<tool_call>",)
    )
    llm = ChatLlamaCpp(
        model_path=str(path),
        temperature=0,
        n_ctx=1024,
        max_tokens=max_tokens,
        stream_tool_args=True,
    )
    bound = llm.bind_tools([NOTE_TOOL], tool_choice="any")
    chunks = list(bound.stream("note it"))
    total = _merged(chunks)
    assert total.response_metadata["finish_reason"] == "length"
    assert total.tool_calls == [] and len(total.invalid_tool_calls) == 1
    assert total.invalid_tool_calls[0]["name"] == "write_note"
    ref = bound.invoke("note it")
    assert _view(total) == _view(ref)
    assert ref.invalid_tool_calls[0]["error"]  # invoke keeps the reason

    async def run() -> list[Any]:
        return [c async for c in bound.astream("note it")]

    atotal = _merged(asyncio.run(run()))
    assert atotal.tool_calls == [] and _view(atotal) == _view(ref)


def test_an_agent_runs_a_streamed_call_whole_and_never_a_cut_off_one(tmp_path: Path) -> None:
    """``create_agent(...).stream(stream_mode="messages")`` with the option: the chunks
    carry the arguments as written; the tool runs once with the whole arguments, and not
    at all when the call is cut off."""
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool

    runs: list[str] = []

    @tool
    def write_note(text: str) -> str:
        """Write a note."""
        runs.append(text)
        return "saved"

    path, _ = write_printing_llama(
        tmp_path / "note.gguf", NOTE, chat_template=QWEN, cuts=("<tool_call>",)
    )
    for max_tokens, expect in ((24, []), (200, [LONG])):
        runs.clear()
        llm = ChatLlamaCpp(
            model_path=str(path),
            temperature=0,
            n_ctx=1024,
            max_tokens=max_tokens,
            stream_tool_args=True,
        )
        agent = create_agent(llm, tools=[write_note])
        chunks: list[Any] = []
        try:
            for chunk, _meta in agent.stream(
                {"messages": [HumanMessage("note it")]},
                stream_mode="messages",
                config={"recursion_limit": 4},
            ):
                if isinstance(chunk, AIMessageChunk):
                    chunks.append(chunk)
        except Exception as exc:  # the scripted model calls the tool again and again
            assert "ecursion" in str(exc), exc
        assert runs[:1] == expect
        assert len(_fragments(chunks)) > 1
