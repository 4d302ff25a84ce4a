"""Tests for sampling.py, text_stream.py and json_grammar.py without a model: parameter
validation, stop strings, UTF-8 streaming and grammar building (generation under grammars:
tests/integration/llama/test_sampling.py)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from langchain_llamacpp_local.errors import InvalidSamplingParams
from langchain_llamacpp_local.formats.grammars import tool_call_grammar
from langchain_llamacpp_local.llama.json_grammar import json_schema_to_grammar
from langchain_llamacpp_local.llama.sampling import SamplingParams, chain_plan
from langchain_llamacpp_local.llama.text_stream import StopMatcher, Utf8Decoder
from tests.sampling_support import TOOLS, Person

# ----------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("top_k", -1),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("presence_penalty", float("-inf")),
        ("frequency_penalty", float("nan")),
        ("penalty_last_n", -2),
        ("seed", -5),
        ("top_k", "many"),
        ("temperature", True),
    ],
)
def test_sampling_params_reject_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, InvalidSamplingParams)


def test_sampling_params_defaults_and_edges() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert p.seed == -1 and p.grammar is None and p.grammar_lazy_triggers == ()
    assert not p.penalties_active
    edge = SamplingParams(temperature=0, top_p=1, min_p=0, top_k=0, penalty_last_n=-1)
    assert isinstance(edge.temperature, float) and edge.temperature == 0.0
    assert SamplingParams(repeat_penalty=1.1).penalties_active
    assert not SamplingParams(repeat_penalty=1.1, penalty_last_n=0).penalties_active
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    # replace() validates again.
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=2.0)
    q = p.replace(grammar='root ::= "x"', grammar_lazy_triggers=["<x>"])
    assert q.grammar_lazy_triggers == ("<x>",)
    with pytest.raises(ValueError, match="grammar_lazy_triggers"):
        SamplingParams(grammar_lazy_triggers=("x",))
    with pytest.raises(ValueError, match="grammar_lazy_triggers"):
        SamplingParams(grammar='root ::= "x"', grammar_lazy_triggers=("",))


# ----------------------------------------------------------------------------- StopMatcher


def _expected_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _run_stop(chunks: list[str], stops: list[str]) -> tuple[str, bool]:
    """Feed chunks like the worker does, checking the streaming invariants at each step."""
    full = "".join(chunks)
    expected, _ = _expected_cut(full, stops)
    longest = max((len(s) for s in stops), default=0)
    m = StopMatcher(stops)
    out, fed = "", ""
    for chunk in chunks:
        fed += chunk
        piece, stopped = m.feed(chunk)
        out += piece
        # never emits anything that is not part of the final answer ...
        assert expected.startswith(out), (chunks, stops, out)
        if stopped:
            assert m.feed("more text") == ("", True)
            assert m.flush() == ""
            return out, True
        # ... and holds back no more than a stop string could still need
        assert len(fed) - len(out) < max(longest, 1), (chunks, stops, out)
    out += m.flush()  # a stop that matched while a longer, earlier one could complete
    return out, m.stopped


def test_stop_in_one_chunk() -> None:
    m = StopMatcher(["</s>", "STOP"])
    assert m.feed("hello STOP world") == ("hello ", True)
    assert m.feed("x") == ("", True)
    assert m.flush() == ""


def test_stop_split_over_chunks_holds_back_prefix() -> None:
    m = StopMatcher(["<|end|>"])
    assert m.feed("abc<|") == ("abc", False)
    assert m.feed("en") == ("", False)
    assert m.feed("d|>tail") == ("", True)


def test_false_alarm_prefix_is_released() -> None:
    m = StopMatcher(["<|end|>"])
    assert m.feed("a<|en") == ("a", False)
    assert m.feed("x") == ("<|enx", False)
    assert m.flush() == ""


def test_no_stop_flush_returns_everything() -> None:
    m = StopMatcher(["###"])
    out = "".join(m.feed(c)[0] for c in ["ab", "#", "#"])
    assert out + m.flush() == "ab##"
    empty = StopMatcher([])
    assert empty.feed("abc") == ("abc", False)
    assert empty.flush() == ""
    assert StopMatcher([""]).feed("abc") == ("abc", False)  # empty stops are ignored


def test_overlapping_stops_cut_at_earliest_occurrence() -> None:
    # "bc" completes first, but "abcd" starts earlier and may still complete.
    assert _run_stop(["a", "b", "c", "d", "e"], ["abcd", "bc"]) == ("", True)
    assert _run_stop(["a", "b", "c", "x", "e"], ["abcd", "bc"]) == ("a", True)
    # Generation ends while waiting: flush cuts at the stop that did match.
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("zabc") == ("z", False)
    assert m.flush() == "a"  # "zabc" cut at "bc"
    assert m.stopped
    assert _run_stop(["aa", "ab"], ["aab"]) == ("a", True)
    assert _run_stop(["xaa", "a"], ["aaa", "aa"]) == ("x", True)


@pytest.mark.parametrize(
    ("text", "stops"),
    [
        ("Hello world<|im_end|>ignored", ["<|im_end|>"]),
        ("answer: 42\n\nUser: hi", ["\n\nUser:", "\nUser"]),
        ("aaab", ["aab", "ab"]),
        ("no stop at all <|im_en", ["<|im_end|>"]),
        ("emoji 😀 stop😀 here", ["stop😀"]),
    ],
)
def test_stop_every_split_point(text: str, stops: list[str]) -> None:
    expected = _expected_cut(text, stops)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _run_stop([text[:i], text[i:j], text[j:]], stops) == expected
    assert _run_stop(list(text), stops) == expected


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc<>", max_size=30),
    stops=st.lists(st.text(alphabet="abc<>", min_size=1, max_size=5), max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_stop_matcher_property(text: str, stops: list[str], cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert _run_stop(chunks, stops) == _expected_cut(text, stops)


# ----------------------------------------------------------------------------- Utf8Decoder

_SAMPLES = ["héllo", "😀👍🏽", "漢字かな交じり文", "a\u0301 ∑ 𝔘𝔫𝔦", "mixed 中文 and emoji 🎉!"]


@pytest.mark.parametrize("text", _SAMPLES)
def test_utf8_every_byte_boundary(text: str) -> None:
    data = text.encode("utf-8")
    for i in range(len(data) + 1):
        d = Utf8Decoder()
        first = d.feed(data[:i])
        assert "\ufffd" not in first
        assert first + d.feed(data[i:]) + d.flush() == text
    d = Utf8Decoder()
    pieces = [d.feed(bytes([b])) for b in data]
    assert "".join(pieces) + d.flush() == text
    # a complete character is emitted as soon as its last byte arrives
    assert "".join(pieces[:-1]) == text[:-1]


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.characters(exclude_categories=["Cs"]), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=80)),
)
def test_utf8_property(text: str, cuts: list[int]) -> None:
    data = text.encode("utf-8")
    points = sorted({min(c, len(data)) for c in cuts})
    d = Utf8Decoder()
    out = "".join(
        d.feed(data[a:b]) for a, b in zip([0, *points], [*points, len(data)], strict=True)
    )
    assert out + d.flush() == text


def test_utf8_incomplete_tail_becomes_replacement() -> None:
    d = Utf8Decoder()
    assert d.feed(b"ok" + "😀".encode()[:2]) == "ok"
    assert d.flush() == "\ufffd"
    assert d.feed(b"x") == "x"  # usable again after flush
    assert d.feed(b"\xff") == "\ufffd"


# ----------------------------------------------------------------------------- grammars (pure)


def test_json_schema_to_grammar_resolves_defs() -> None:
    g = json_schema_to_grammar(Person.model_json_schema())
    assert g.count("root ::=") == 1
    assert '"\\"green\\""' in g  # enum from $defs
    assert "ref-Address" in g and "ref-Pet" in g


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"$ref": "https://example.com/schema.json"}, "ref"),
        ({"$ref": "#/$defs/Missing", "$defs": {}}, "Missing"),
        ({"type": "object", "properties": {"x": False}}, "false"),
        ({"type": "frobnicate"}, "frobnicate"),
        ({"type": "string", "pattern": "^(?=a)b$"}, "Unsupported pattern"),
        ({"type": "object", "properties": {"x": 3}}, "3"),
    ],
)
def test_json_schema_to_grammar_errors(schema: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        json_schema_to_grammar(schema)


def test_json_schema_to_grammar_needs_a_dict() -> None:
    with pytest.raises(ValueError, match="dict"):
        json_schema_to_grammar("{}")  # type: ignore[arg-type]


def test_tool_call_grammar_name_and_fallback() -> None:
    g, fmt = tool_call_grammar(TOOLS, "some_unknown_format")
    assert fmt == "generic" and "tool_calls" in g
    g, fmt = tool_call_grammar(TOOLS, "hermes", parallel=False, name="now")
    assert fmt == "hermes" and '"\\"now\\""' in g and "get_weather" not in g
    with pytest.raises(ValueError, match="nope"):
        tool_call_grammar(TOOLS, "hermes", name="nope")
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_grammar([], "hermes")


# ----------------------------------------------------------------------------- added samplers


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dry_multiplier", -0.5),
        ("dry_multiplier", float("nan")),
        ("dry_base", 0.99),
        ("dry_allowed_length", -1),
        ("dry_allowed_length", 2.5),
        ("dry_penalty_last_n", -2),
        ("dry_sequence_breakers", "\n"),
        ("dry_sequence_breakers", ["ok", 3]),
        ("dry_sequence_breakers", ["z" * 41]),
        ("dry_sequence_breakers", ["a\0b"]),
        ("dry_sequence_breakers", ["x"] * 33),
        ("top_n_sigma", 0.0),
        ("top_n_sigma", -2.0),
        ("typical_p", 0.0),
        ("typical_p", 1.1),
        ("xtc_probability", -0.1),
        ("xtc_probability", 1.01),
        ("xtc_threshold", 0.51),
        ("xtc_threshold", -0.1),
        ("dynatemp_range", -1.0),
        ("dynatemp_exponent", 0.0),
        ("mirostat", 3),
        ("mirostat", -1),
        ("mirostat", True),
        ("mirostat_tau", 0.0),
        ("mirostat_eta", 0.0),
        ("mirostat_eta", 2.0),
        ("logit_bias", {"a": float("nan")}),
        ("logit_bias", {"a": float("inf")}),
        ("logit_bias", {"a": True}),
        ("logit_bias", {"a": "+inf"}),
        ("logit_bias", {"a": 2e6}),
        ("logit_bias", {True: 1.0}),
        ("logit_bias", {-3: 1.0}),
        ("logit_bias", {"": 1.0}),
        ("logit_bias", {"\0": 1.0}),
        ("logit_bias", {"\udcff": 1.0}),
        ("logit_bias", {2.0: 1.0}),
        ("logit_bias", [(1, 2, 3)]),
        ("logit_bias", "a"),
        ("grammar", 3),
    ],
)
def test_added_samplers_reject_bad_values(field: str, value: Any) -> None:
    with pytest.raises(InvalidSamplingParams, match=field):
        SamplingParams(**{field: value})


def test_added_samplers_default_off_and_normalize() -> None:
    p = SamplingParams()
    assert not p.dry_active and not p.xtc_active
    assert (p.top_n_sigma, p.typical_p, p.dynatemp_range, p.mirostat) == (-1.0, 1.0, 0.0, 0)
    assert p.logit_bias is None and p.dry_sequence_breakers == ("\n", ":", '"', "*")
    q = SamplingParams(
        logit_bias={"7": "-inf", "ab": 2, 5: False, 9: -1}, dry_sequence_breakers=["x"]
    )
    assert q.logit_bias == ((7, -math.inf), ("ab", 2.0), (5, -math.inf), (9, -1.0))
    assert q.dry_sequence_breakers == ("x",)
    assert SamplingParams(logit_bias=[(1, 2.0)]).logit_bias == ((1, 2.0),)
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert q.replace(seed=3).logit_bias == q.logit_bias  # normalized values pass again


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mirostat": 2, "repeat_penalty": 1.1}, "the penalties"),
        ({"mirostat": 1, "dry_multiplier": 0.8}, "dry_multiplier"),
        ({"mirostat": 1, "xtc_probability": 0.5}, "xtc_probability"),
        ({"mirostat": 2, "typical_p": 0.5, "top_n_sigma": 1.0}, "top_n_sigma, typical_p"),
        ({"mirostat": 2, "dynatemp_range": 0.5}, "dynatemp_range"),
        ({"mirostat": 2, "temperature": 0}, "temperature=0 is greedy"),
        ({"dynatemp_range": 0.5, "temperature": 0}, "temperature=0 is greedy"),
    ],
)
def test_combinations_llama_cpp_would_ignore_are_refused(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSamplingParams, match=message):
        SamplingParams(**settings)


@pytest.mark.parametrize(
    ("settings", "plan"),
    [
        ({}, ("top-k", "top-p", "min-p", "temp", "dist")),
        ({"temperature": 0}, ("greedy",)),
        ({"temperature": 0, "repeat_penalty": 1.1}, ("penalties", "greedy")),
        # every sampler on: llama.cpp's common_sampler_init order
        (
            {
                "logit_bias": {1: 1.0},
                "repeat_penalty": 1.1,
                "dry_multiplier": 0.8,
                "top_n_sigma": 1.0,
                "typical_p": 0.9,
                "xtc_probability": 0.5,
                "dynatemp_range": 0.5,
            },
            (
                "logit-bias",
                "penalties",
                "dry",
                "top-n-sigma",
                "top-k",
                "typical",
                "top-p",
                "min-p",
                "xtc",
                "temp-ext",
                "dist",
            ),
        ),
        # greedy keeps what can change its pick: truncation only before typical/XTC
        ({"temperature": 0, "top_n_sigma": 1.0, "dry_multiplier": 1.0}, ("dry", "greedy")),
        (
            {"temperature": 0, "xtc_probability": 1.0},
            ("top-k", "top-p", "min-p", "xtc", "greedy"),
        ),
        ({"temperature": 0, "logit_bias": {"x": -1}}, ("logit-bias", "greedy")),
        ({"mirostat": 1, "logit_bias": {2: 1}}, ("logit-bias", "temp", "mirostat")),
        ({"mirostat": 2}, ("temp", "mirostat-v2")),
        (
            {"dry_multiplier": 0.8, "dry_penalty_last_n": 0},
            ("top-k", "top-p", "min-p", "temp", "dist"),
        ),
        ({"xtc_probability": 0.0, "top_k": 0, "top_p": 1, "min_p": 0}, ("temp", "dist")),
    ],
)
def test_chain_plan_follows_llama_cpp(settings: dict[str, Any], plan: tuple[str, ...]) -> None:
    assert chain_plan(SamplingParams(**settings)) == plan
