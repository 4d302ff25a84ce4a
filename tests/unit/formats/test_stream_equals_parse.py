"""Streamed deltas, merged as LangChain merges ``AIMessageChunk``s, equal the one-shot parse.

For every family (llama.cpp's recorded outputs, ``tests/data/llama_cpp_chat_cases.json``,
each cut at a random point as ``max_tokens`` would and fed in random chunk sizes): the
merged chunks' content, reasoning, tool calls and invalid calls (ids included) are the
parser's final result, which equals :func:`parse` of the same text; a call that is not
complete and valid is never sent as one.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessageChunk

from langchain_llamacpp_local.chat.messages import delta_message as _delta_message
from langchain_llamacpp_local.formats import (
    FORMATS,
    ParsedOutput,
    StreamParser,
    detect_format,
    parse,
    parsers,
)
from langchain_llamacpp_local.formats.base import read_as_arguments
from langchain_llamacpp_local.formats.registry import FAMILIES
from langchain_llamacpp_local.formats.stream_parser import stream_markers
from tests.llama_cpp_cases import _settings, _template, case_id, load_cases

from .test_tool_parsers import RECORDED

CASES = [c for c in load_cases()["cases"] if not c["is_partial"]]


def _fmt(case: dict[str, Any]) -> str:
    return detect_format(_template(case["template"]).source)


def _merge(deltas: list[Any]) -> AIMessageChunk:
    total = AIMessageChunk(content="")
    for d in deltas:
        total = total + _delta_message(d)
        # at every point, what LangChain reads as calls were sent whole and valid
        for tc in total.tool_call_chunks:
            assert tc["args"], tc  # never a name alone ({} arguments)
    return total


def _view(
    content: Any, reasoning: Any, calls: list[Any], bad: list[Any], ids: bool = True
) -> dict[str, Any]:
    return {
        "content": str(content).strip(),
        "reasoning": (reasoning or "").strip() or None,
        "calls": [(c["name"], c["args"], c["id"] if ids else None) for c in calls],
        "invalid": [(c["name"], c["args"], c["id"] if ids else None) for c in bad],
    }


def _of(out: ParsedOutput, ids: bool = True) -> dict[str, Any]:
    return _view(out.content, out.reasoning, out.tool_calls, out.invalid_tool_calls, ids)


def check_stream(text: str, fmt: str, opts: dict[str, Any], rng: random.Random) -> None:
    sp = StreamParser(fmt, **opts)
    deltas = []
    pos = 0
    while pos < len(text):
        n = rng.randint(1, 8)
        deltas += sp.feed(text[pos : pos + n])
        pos += n
    deltas += sp.finish()
    total = _merge(deltas)
    streamed = _view(
        total.content,
        total.additional_kwargs.get("reasoning_content"),
        total.tool_calls,
        total.invalid_tool_calls,
    )
    assert streamed == _of(sp.result)
    assert _of(sp.result, ids=False) == _of(parse(text, fmt, **opts), ids=False)
    for bad in sp.result.invalid_tool_calls:
        assert not read_as_arguments(bad["args"]), bad


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CASES), st.floats(0.0, 1.0), st.integers(0, 2**32))
def test_cut_and_chunked_outputs_stream_to_the_parse(case: dict, cut: float, seed: int) -> None:
    text = case["input"][: round(len(case["input"]) * cut)]
    check_stream(text, _fmt(case), _settings(case), random.Random(seed))


@pytest.mark.parametrize("case", CASES[::3], ids=case_id)
def test_recorded_outputs_stream_to_the_parse(case: dict) -> None:
    for seed in range(3):
        check_stream(case["input"], _fmt(case), _settings(case), random.Random(seed))


TRUNCATED_NOTE = '<tool_call>\n{"name": "write_note", "arguments": {"text": "a fairly long n'


def test_a_cut_off_call_streams_as_an_invalid_call() -> None:
    """Cut off by max_tokens, a call's JSON must not merge into a valid-looking call."""
    sp = StreamParser("hermes")
    deltas = sp.feed(TRUNCATED_NOTE) + sp.finish()
    total = _merge(deltas)
    assert total.tool_calls == [] and sp.result.tool_calls == []
    (bad,) = total.invalid_tool_calls
    assert bad["name"] == "write_note" and bad["args"] == sp.result.invalid_tool_calls[0]["args"]
    assert bad["args"].startswith("<tool_call>")


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>{"name": "P", "arguments": "oops"}</tool_call>'),
        ("hermes", '{"name": "P", "arguments": 3}'),
        ("llama3_json", '{"name": "P", "parameters": 3}'),
        ("mistral", '[TOOL_CALLS][{"name": "P", "arguments": 3}]'),
        ("nemotron_v2", '<TOOLCALL>[{"name": "P", "arguments": [1]}]</TOOLCALL>'),
        ("hermes", "<tool_call></tool_call>"),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.P:0"),
    ],
)
def test_invalid_calls_are_never_read_as_calls(fmt: str, text: str) -> None:
    out = parse(text, fmt)
    assert out.tool_calls == []
    for bad in out.invalid_tool_calls:
        assert not read_as_arguments(bad["args"]), bad
    check_stream(text, fmt, {}, random.Random(0))


# --------------------------------------------------------------------------- closing markers

P_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "P",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            },
        },
    }
]
SNEAKY = {"name": "a </tool_call> b", "age": 3}


def _j(value: Any) -> str:
    return json.dumps(value)


# a closing marker spelled inside a JSON (or Gemma 4) string does not end the call
CLOSERS = [
    ("hermes", f'<tool_call>{{"name": "P", "arguments": {_j(SNEAKY)}}}</tool_call> after'),
    ("hermes", f"<function=P>{_j({'name': 'x </function> y', 'age': 3})}</function> after"),
    (
        "nemotron_v2",
        f'<TOOLCALL>[{{"name": "P", "arguments": {_j({"name": "</TOOLCALL>", "age": 3})}}}]</TOOLCALL> after',
    ),
    (
        "apriel",
        f'<tool_calls>[{{"name": "P", "arguments": {_j({"name": "</tool_calls>", "age": 3})}}}]</tool_calls> after',
    ),
    (
        "minimax_m1",
        f'<tool_calls>\n{{"name": "P", "arguments": {_j({"name": "</tool_calls>", "age": 3})}}}\n</tool_calls> after',
    ),
    (
        "apertus",
        f'<|tools_prefix|>[{{"P": {_j({"name": "<|tools_suffix|>", "age": 3})}}}]<|tools_suffix|> after',
    ),
    (
        "command_r7b",
        f'<|START_ACTION|>[{{"tool_call_id": "0", "tool_name": "P", "parameters": {_j({"name": "<|END_ACTION|>", "age": 3})}}}]<|END_ACTION|> after',
    ),
    (
        "deepseek_v3_1",
        f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>P<｜tool▁sep｜>{_j({'name': '<｜tool▁calls▁end｜>', 'age': 3})}<｜tool▁call▁end｜><｜tool▁calls▁end｜> after",
    ),
    (
        "kimi_k2",
        f"<|tool_calls_section_begin|><|tool_call_begin|>functions.P:0<|tool_call_argument_begin|>{_j({'name': '<|tool_calls_section_end|>', 'age': 3})}<|tool_call_end|><|tool_calls_section_end|> after",
    ),
    (
        "solar_open",
        f"<|tool_call:begin|>x<|tool_call:name|>P<|tool_call:args|>{_j({'name': '<|tool_call:end|>', 'age': 3})}<|tool_call:end|> after",
    ),
    ("gemma4", '<|tool_call>call:P{name:<|"|>a <tool_call|> b<|"|>,age:3}<tool_call|> after'),
]


@pytest.mark.parametrize(("fmt", "text"), CLOSERS, ids=[f for f, _ in CLOSERS])
def test_closing_marker_inside_a_string_does_not_end_the_call(fmt: str, text: str) -> None:
    out = parse(text, fmt, tools=P_TOOL)
    assert out.invalid_tool_calls == [] and out.content == "after", out
    (call,) = out.tool_calls
    assert call["name"] == "P" and call["args"]["age"] == 3
    assert "<" in call["args"]["name"]
    for seed in range(5):
        check_stream(text, fmt, {"tools": P_TOOL}, random.Random(seed))


def test_malformed_quotes_still_end_at_the_marker() -> None:
    """An unbalanced quote must not swallow the text after the call."""
    text = '<tool_call>{"name": "P", "arguments": {"name": "a}}</tool_call> after'
    out = parse(text, "hermes")
    assert out.content == "after" and len(out.invalid_tool_calls) == 1
    check_stream(text, "hermes", {}, random.Random(1))


# --------------------------------------------------------------------------- single families

F_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL_JSON = '{"name": "f", "arguments": {"a": 1}}'

# (format, options, output, content, reasoning, [(name, args)])
FAMILY_FIXES = [
    # reasoning that does not end: a call inside Kimi K2's think block, more thinking after it
    (
        "kimi_k2",
        {"reasoning": True},
        "<think>Let me call<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
        '<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|><|tool_calls_section_end|>'
        "I'm still thinking</think>Done.",
        "Done.",
        "Let me callI'm still thinking",
        [("f", {"a": 1})],
    ),
    # GLM thinks again in the middle of its answer
    (
        "glm45",
        {"reasoning": True},
        "<think>first</think>Hello <think>second</think>world",
        "Hello world",
        "first\nsecond",
        [],
    ),
    # Hermes: a call inside a ```xml or ```json fence
    (
        "hermes",
        {},
        f"```xml\n<tool_call>\n{CALL_JSON}\n</tool_call>\n```",
        "",
        None,
        [("f", {"a": 1})],
    ),
    (
        "hermes",
        {},
        f"Sure.\n```json\n<tool_call>\n{CALL_JSON}\n</tool_call>\n```\nDone.",
        "Sure.\nDone.",
        None,
        [("f", {"a": 1})],
    ),
    # DeepSeek R1: the <｜tool▁calls｜> opener variant
    (
        "deepseek_r1",
        {},
        '<｜tool▁calls｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        None,
        [("f", {"a": 1})],
    ),
    # Functionary v3.2: raw Python after python\n is a python call
    (
        "functionary_v3_2",
        {"prefill": ">>>"},
        "python\nprint('hey')\nprint(1 + 1)",
        "",
        None,
        [("python", {"code": "print('hey')\nprint(1 + 1)"})],
    ),
]


@pytest.mark.parametrize(
    ("fmt", "opts", "text", "content", "reasoning", "calls"),
    FAMILY_FIXES,
    ids=[f"{f[0]}-{n}" for n, f in enumerate(FAMILY_FIXES)],
)
def test_single_family_outputs(
    fmt: str, opts: dict, text: str, content: str, reasoning: str | None, calls: list
) -> None:
    out = parse(text, fmt, **opts)
    assert out.content == content and out.reasoning == reasoning
    assert [(c["name"], c["args"]) for c in out.tool_calls] == calls
    assert out.invalid_tool_calls == []
    for seed in range(20):
        check_stream(text, fmt, opts, random.Random(seed))


# llama.cpp's recorded cases for these points (test-chat.cpp lines): Ling 3.0 calls
# written before the think block closes (4666, 4683, 4716, 4748); Muse Glimmer's
# "inform then act" (6380), markup quoted to the user (6391) and inside reasoning (6414)
CITED = {
    "inclusionai-ling-3.0-flash.jinja@4666",
    "inclusionai-ling-3.0-flash.jinja@4683",
    "inclusionai-ling-3.0-flash.jinja@4716",
    "inclusionai-ling-3.0-flash.jinja@4748",
    "muse-glimmer.jinja@6372",
    "muse-glimmer.jinja@6380",
    "muse-glimmer.jinja@6391",
    "muse-glimmer.jinja@6414",
}


@pytest.mark.parametrize("case", [c for c in CASES if case_id(c) in CITED], ids=case_id)
def test_cited_llama_cpp_cases(case: dict) -> None:
    from tests.llama_cpp_cases import run_case

    assert {case_id(c) for c in CASES} >= CITED
    for seed in range(10):
        assert run_case(case, seed) is None
        check_stream(case["input"], _fmt(case), _settings(case), random.Random(seed))


# --------------------------------------------------------------------------- every cut point

#: the option sets a family is streamed under: as generated, reasoning extracted or not,
#: the think block opened by the prompt, no tools bound (nothing is a call)
OPTION_SETS: list[dict[str, Any]] = [
    {},
    {"reasoning": True},
    {"reasoning": False},
    {"reasoning": True, "think_open": True},
    {"tools": []},
    {"reasoning": True, "tools": []},
]
PARSED_FORMATS = [f for f in FORMATS if f != "auto"]  # "auto" is learned from a template


def known_markers(fmt: str) -> list[str]:
    """Every marker and fixed string the family's record (and the stream's hold list) names."""
    family = FAMILIES[fmt]
    found = [*family.markers, *family.triggers, *stream_markers(fmt)]
    spec = family.spec
    if spec is not None:
        for start, end, _ in spec.regions:
            found += [start, end or ""]
        found += [*spec.strip, *spec.section, *spec.held, *spec.think_stops, spec.reasoning_lead]
        found += list(spec.think or ())
    grammar = family.grammar
    found += [getattr(grammar, "opening", ""), getattr(grammar, "closing", "")]
    return [m for m in dict.fromkeys(found) if m]


def _fork(sp: StreamParser) -> StreamParser:
    """The parser as it stands (its ids copied), to finish it here without ending ``sp``."""
    twin = copy.copy(sp)
    twin._ids = list(sp._ids)
    return twin


def _streamed(deltas: list[Any], result: ParsedOutput) -> dict[str, Any]:
    """The deltas merged (texts joined, each call read as the result says it is)."""
    return _SentSoFar().add(deltas).merged(result)


class _SentSoFar:
    """A stream's deltas split by kind as they come (each kind in order), so that a check
    after every cut reads each delta once rather than all of them again."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[Any] = []

    def add(self, deltas: list[Any]) -> _SentSoFar:
        for d in deltas:
            if d.kind == "content":
                self.content.append(d.text)
            elif d.kind == "reasoning":
                self.reasoning.append(d.text)
            elif d.kind == "tool_call":
                self.calls.append(d)
        return self

    def merged(self, result: ParsedOutput, more: list[Any] | None = None) -> dict[str, Any]:
        """``_streamed(deltas + more, result)`` for the deltas added so far."""
        tail = _SentSoFar().add(more or [])
        valid = {c["id"] for c in result.tool_calls}
        calls = [*self.calls, *tail.calls]
        return _view(
            "".join(self.content) + "".join(tail.content),
            "".join(self.reasoning) + "".join(tail.reasoning),
            [
                {"name": d.name, "args": json.loads(d.args), "id": d.id}
                for d in calls
                if d.id in valid
            ],
            [{"name": d.name, "args": d.args, "id": d.id} for d in calls if d.id not in valid],
        )


def stream_every_cut(text: str, fmt: str, opts: dict[str, Any], truncate: bool = False) -> None:
    """``text`` fed one character at a time, so every position is a cut between two
    chunks: after each, what was sent is the start of the parse (nothing sent is taken
    back); at the end the merged stream is the parse. With ``truncate``, the generation
    also ends at every position (as ``max_tokens`` would): each such stream is the
    parse of what was generated."""
    whole = parse(text, fmt, **opts)
    valid = {c["id"] for c in whole.tool_calls}
    sp = StreamParser(fmt, **opts)
    deltas: list[Any] = []
    so_far = _SentSoFar()
    for k in range(len(text) + 1):
        if k:
            new = sp.feed(text[k - 1])
            deltas += new
            so_far.add(new)
            for d in new:  # what _streamed(deltas, whole) would read of the calls
                if d.kind == "tool_call" and d.id in valid:
                    json.loads(d.args)
        sent = _view("".join(so_far.content), "".join(so_far.reasoning), [], [])
        assert whole.content.startswith(sent["content"]), (k, text[:k], sent, whole)
        assert (whole.reasoning or "").startswith(sent["reasoning"] or ""), (k, text[:k], sent)
        if truncate and k < len(text):
            cut = _fork(sp)
            tail = cut.finish()
            streamed = so_far.merged(cut.result, tail)  # _streamed(deltas + tail, ...)
            assert streamed == _of(cut.result), (k, text[:k])
            assert _of(cut.result, ids=False) == _of(parse(text[:k], fmt, **opts), ids=False)
    deltas += sp.finish()
    assert _streamed(deltas, sp.result) == _of(sp.result), text
    assert _of(sp.result, ids=False) == _of(whole, ids=False), text
    for bad in sp.result.invalid_tool_calls:
        assert not read_as_arguments(bad["args"]), bad


@pytest.mark.parametrize("fmt", PARSED_FORMATS)
def test_every_cut_of_every_marker_streams_to_the_parse(fmt: str) -> None:
    """Each marker the family knows, alone, inside text and after another of its markers,
    cut at every position as a chunk boundary and as the end of generation."""
    markers = known_markers(fmt)
    assert markers or fmt in ("generic", "content"), fmt
    for m in markers:
        for text in (m, f"Hi {m} x", f"{m}Hi"):
            for opts in OPTION_SETS:
                stream_every_cut(text, fmt, opts, truncate=True)
    for a, b in itertools.permutations(markers, 2):
        for opts in OPTION_SETS:
            stream_every_cut(f"{a}x{b}y", fmt, opts)


@pytest.mark.parametrize("fmt", PARSED_FORMATS)
def test_every_cut_of_the_recorded_outputs_streams_to_the_parse(fmt: str) -> None:
    """llama.cpp's recorded outputs (with their cases' settings) and this suite's recorded
    outputs, cut at every position."""
    for case in CASES:
        if _fmt(case) == fmt:
            stream_every_cut(case["input"], fmt, _settings(case))
    for rec_fmt, text, *_ in RECORDED:
        if rec_fmt == fmt:
            for opts in OPTION_SETS:
                stream_every_cut(text, fmt, opts)


# Counterexamples the property tests found, kept as explicit cases: (format, output, the
# cut that showed it)
COUNTEREXAMPLES = [
    # '<|python_tag|>' arriving cut after '<|': the '<|' was sent as content, then the tag
    # made the rest a python call and the parse's content was ''
    ("functionary_v3_1", "<|python_tag|>print(1)", 2),
    # plain text, then a harmony '<|message|>': sent as content, then read as a header
    ("gpt_oss", "Hi <|message|> x", 3),
    ("gpt_oss", "<think>x<|message|>y", 8),
]


@pytest.mark.parametrize(("fmt", "text", "cut"), COUNTEREXAMPLES)
def test_counterexamples_stream_to_the_parse(fmt: str, text: str, cut: int) -> None:
    for opts in OPTION_SETS:
        sp = StreamParser(fmt, **opts)
        deltas = sp.feed(text[:cut]) + sp.feed(text[cut:]) + sp.finish()
        assert _streamed(deltas, sp.result) == _of(sp.result)
        assert _of(sp.result, ids=False) == _of(parse(text, fmt, **opts), ids=False)
        stream_every_cut(text, fmt, opts, truncate=True)


def test_property_tests_are_derandomised_in_ci() -> None:
    """With CI set (as CI sets it) every property test searches the same examples, with no
    example database; without it the search stays random."""
    root = Path(__file__).resolve().parents[3]
    code = (
        "import tests.conftest; from hypothesis import settings; d = settings.default; "
        "print(d.derandomize, d.database is None, d.print_blob, d.deadline)"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    runs = {  # both interpreters at once
        expect: subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=root,
            env={**env, "CI": ci} if ci else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for ci, expect in (
            ("true", "True True True None"),
            (None, "False False True 0:00:00.200000"),
        )
    }
    for expect, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert stdout.strip() == expect, stderr


# --------------------------------------------------------------------------- work per delta


def _chars_read(fmt: str, n_tokens: int, monkeypatch: pytest.MonkeyPatch) -> float:
    """Characters the stream's scanners read per generated character, over a generation
    of reasoning, content and one call with a long argument (finish not counted)."""
    from benchmarks.bench_parsers import make_stream

    pieces, opts, arg = make_stream(fmt, n_tokens)
    read = [0]
    for name in ("_scan", "_scan_rest", "_scan_think"):
        real = getattr(parsers, name, None)
        if real is None:
            continue

        def counting(text: str, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            read[0] += len(text)
            return _real(text, *args, **kwargs)

        monkeypatch.setattr(parsers, name, counting)
    sp = StreamParser(fmt, **opts)
    for piece in pieces:
        sp.feed(piece)
    fed = read[0]
    monkeypatch.undo()
    sp.finish()
    if fmt != "content":
        assert [(c["name"], c["args"]) for c in sp.result.tool_calls] == [
            ("get_weather", {"city": arg})
        ]
    return fed / sum(len(p) for p in pieces)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_delta_reads_a_bounded_amount_of_text(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted, not timed: a stream four times as long reads no more text per generated
    character (the stream never reads again what it has settled; an open call is read
    again only where it may end)."""
    short = _chars_read(fmt, 1500, monkeypatch)
    long = _chars_read(fmt, 6000, monkeypatch)
    assert long <= 1.2 * short + 1, (fmt, short, long)
