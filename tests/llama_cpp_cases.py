"""Run llama.cpp's recorded chat parse cases (``tests/data/llama_cpp_chat_cases.json``).

Each case is a model output recorded in llama.cpp's ``tests/test-chat.cpp`` with the
content, reasoning and tool calls llama.cpp's parser returns for it. Like llama.cpp, the
generation prompt the template appends (``<think>\\n``, ``>>>``...) is known to the parser,
the comparison strips content/reasoning and compares tool arguments as JSON.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path
from typing import Any

from langchain_llamacpp_local.formats import ParsedOutput, StreamParser, detect_format, parse
from langchain_llamacpp_local.templates.chat_template import ChatTemplate, ChatTemplateError

DATA = Path(__file__).resolve().parent / "data"
TEMPLATES = DATA / "llama_cpp_templates"


def load_cases() -> dict[str, Any]:
    return json.loads((DATA / "llama_cpp_chat_cases.json").read_text(encoding="utf-8"))


def case_id(case: dict[str, Any]) -> str:
    return f"{case['template']}@{case['source'].rsplit(':', 1)[1]}"


@cache
def template_file(name: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
    """llama.cpp's template file ``name``, one instance per process for every module that
    reads it: the package keeps compiled templates in a bounded cache, which one pass over
    all the files would turn over before the next module asked for the same ones."""
    source = TEMPLATES.joinpath(name).read_text(encoding="utf-8")
    return ChatTemplate(source, origin=name, bos_token=bos_token, eos_token=eos_token)


def _template(name: str) -> ChatTemplate:
    # the instances the template tests use; a generation prompt is the end of a render,
    # the same with these tokens as without them for every case
    return template_file(name, bos_token="<s>", eos_token="</s>")


@cache
def _generation_prompt(name: str, tools_json: str, thinking: bool) -> str:
    """What the template appends for ``add_generation_prompt`` (llama.cpp's suffix diff)."""
    tpl = _template(name)
    tools = [{"type": "function", "function": t} for t in json.loads(tools_json)] or None
    msgs = [{"role": "user", "content": "Hey there!"}]
    try:
        without = tpl.render(
            msgs, tools=tools, add_generation_prompt=False, enable_thinking=thinking
        )
        with_gen = tpl.render(
            msgs, tools=tools, add_generation_prompt=True, enable_thinking=thinking
        )
    except ChatTemplateError:
        # rendering is the templates' own test (test_templates.py); the parser needs only
        # the prompt's end, so fall back to rendering without tools, then to none
        return _generation_prompt(name, "[]", thinking) if tools else ""
    n = 0
    while n < min(len(without), len(with_gen)) and without[n] == with_gen[n]:
        n += 1
    return with_gen[n:]


def _settings(case: dict[str, Any]) -> dict[str, Any]:
    tools = [{"type": "function", "function": t} for t in case["tools"]]
    extract = case["reasoning_format"] != "none"
    return {
        "reasoning": (bool(case["enable_thinking"]) if extract else None),
        "tools": tools,  # an empty list: no tools bound (llama.cpp reads no calls then)
        "prefill": _generation_prompt(
            case["template"], json.dumps(case["tools"]), case["enable_thinking"]
        ),
    }


def _norm_args(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return ""  # partial JSON: llama.cpp's comparison ignores it
    return args


def _as_msg(out: ParsedOutput) -> dict[str, Any]:
    calls = [{"name": c["name"], "arguments": c["args"], "id": c["id"]} for c in out.tool_calls]
    calls += [
        {"name": c["name"] or "", "arguments": _norm_args(c["args"]), "id": c["id"]}
        for c in out.invalid_tool_calls
    ]
    return {
        "content": out.content.strip(),
        "reasoning": (out.reasoning or "").strip(),
        "tool_calls": calls,
    }


def _check(expect: dict[str, Any], got: dict[str, Any]) -> str | None:
    if expect["content"].strip() != got["content"]:
        return f"content {got['content']!r} != {expect['content'].strip()!r}"
    if expect["reasoning"].strip() != got["reasoning"]:
        return f"reasoning {got['reasoning']!r} != {expect['reasoning'].strip()!r}"
    if len(expect["tool_calls"]) != len(got["tool_calls"]):
        return f"tool calls {got['tool_calls']!r} != {expect['tool_calls']!r}"
    for e, g in zip(expect["tool_calls"], got["tool_calls"], strict=False):
        if e["name"] != g["name"] or _norm_args(e["arguments"]) != _norm_args(g["arguments"]):
            return f"tool call {g!r} != {e!r}"
        if e["id"] and e["id"] != g["id"]:
            return f"tool call id {g['id']!r} != {e['id']!r}"
    return None


def _stream(case: dict[str, Any], fmt: str, settings: dict[str, Any], seed: int) -> dict[str, Any]:
    parser = StreamParser(fmt, **settings)
    rng = random.Random(seed)
    text = case["input"]
    content, reasoning = [], []
    calls: dict[int, dict[str, Any]] = {}
    deltas = []
    pos = 0
    while pos < len(text):
        n = rng.randint(1, 6)
        deltas += parser.feed(text[pos : pos + n])
        pos += n
    if case["is_partial"]:
        result = None
    else:
        deltas += parser.finish()
        result = parser.result
    for d in deltas:
        if d.kind == "content":
            content.append(d.text)
        elif d.kind == "reasoning":
            reasoning.append(d.text)
        else:
            call = calls.setdefault(d.index or 0, {"name": "", "arguments": "", "id": ""})
            call["name"] = d.name or call["name"]
            call["id"] = d.id or call["id"]
            call["arguments"] += d.args
    msg = {
        "content": "".join(content).strip(),
        "reasoning": "".join(reasoning).strip(),
        "tool_calls": [calls[k] for k in sorted(calls)],
    }
    if result is not None:
        final = _as_msg(result)
        if final != {**msg, "tool_calls": final["tool_calls"]} or len(final["tool_calls"]) != len(
            msg["tool_calls"]
        ):
            return {
                **msg,
                "content": f"<stream deltas differ from the streamed result: {final!r} vs {msg!r}>",
            }
    return msg


def run_case(case: dict[str, Any], seed: int = 0) -> str | None:
    """None when the case passes one-shot and streamed; else the first difference."""
    fmt = detect_format(_template(case["template"]).source)
    settings = _settings(case)
    if not case["is_partial"]:
        err = _check(case["expect"], _as_msg(parse(case["input"], fmt, **settings)))
        if err:
            return f"one-shot: {err}"
    else:
        err = _check(case["expect"], _as_msg(parse(case["input"], fmt, partial=True, **settings)))
        if err:
            return f"partial: {err}"
    expect = case["expect"]
    streamed = _stream(case, fmt, settings, seed)
    if case["is_partial"]:
        # a stream sends a call only once it is complete (LangChain would read a partial
        # one as a call): the calls streamed so far are the expected ones written whole
        n = len(streamed["tool_calls"])
        expect = {**expect, "tool_calls": expect["tool_calls"][:n]}
    err = _check(expect, streamed)
    return f"streamed: {err}" if err else None
