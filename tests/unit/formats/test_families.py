"""Each tool-call family's record is complete and agrees with the code that reads it.

Detection, the parsers, the grammar builder and the prompt preparation all read
:data:`~langchain_llamacpp_local.formats.registry.FAMILIES`; these checks make sure a
record added there is whole. Grammars are sampled on a real model, per family, by
test_markup_grammars.py and test_tool_grammars.py, which take their families from the
same records.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from langchain_llamacpp_local.formats import FORMATS, StreamParser, detect_format, parse
from langchain_llamacpp_local.formats.auto import analyze_template
from langchain_llamacpp_local.formats.grammars import tool_call_grammar
from langchain_llamacpp_local.formats.registry import FAMILIES, JsonCalls, Markup
from langchain_llamacpp_local.llama.json_grammar import check_grammar

DATA = Path(__file__).resolve().parents[2] / "data"
EXPECTED = json.loads((DATA / "llama_cpp_template_formats.json").read_text(encoding="utf-8"))[
    "templates"
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
WITH_TRIGGERS = [(f.name, t) for f in FAMILIES.values() for t in f.triggers]
CLUES = [(f.name, needles) for f in FAMILIES.values() for _rank, needles in f.clues]


def test_formats_are_the_records() -> None:
    assert FORMATS == (*FAMILIES, "auto")
    assert all(name == f.name for name, f in FAMILIES.items())


def test_every_llama_cpp_handler_names_one_family() -> None:
    owners: dict[str, list[str]] = {}
    for f in FAMILIES.values():
        for h in f.handlers:
            owners.setdefault(h, []).append(f.name)
    assert all(len(names) == 1 for names in owners.values()), owners
    seen = {e["llama_cpp_handler"] for e in EXPECTED.values()} - {"autoparser"}
    assert seen <= owners.keys()


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in ("generic", "content")])
def test_every_family_can_be_detected(name: str) -> None:
    family = FAMILIES[name]
    assert family.handlers or family.clues, f"{name}: no template ever selects it"


@pytest.mark.parametrize(("name", "needles"), CLUES)
def test_a_template_with_only_a_clue_selects_its_family(
    name: str, needles: tuple[str, ...]
) -> None:
    # the ranks keep llama.cpp's order without shadowing a family behind an earlier one
    assert detect_format(" ".join(needles)) == name


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_grammar_and_triggers_agree(name: str) -> None:
    family = FAMILIES[name]
    shape = family.grammar
    if shape is None:
        assert not family.triggers  # no grammar to switch on
        return
    grammar, used = tool_call_grammar(TOOLS, name, parallel=False)
    assert used == name
    check_grammar(grammar)
    if isinstance(shape, Markup):
        assert family.triggers, f"{name}: a markup grammar needs the markers that start it"
    elif shape.opening:
        # a lazy grammar starts where the forced one does
        assert family.triggers and all(shape.opening.startswith(t) for t in family.triggers)
    else:  # the whole output is the JSON (llama3_json, generic): nothing to wait for
        assert not family.triggers
    assert isinstance(shape, JsonCalls | Markup)


@pytest.mark.parametrize(("name", "trigger"), WITH_TRIGGERS)
def test_parser_holds_back_a_half_written_trigger(name: str, trigger: str) -> None:
    # the parser knows the marker a lazy grammar starts at: while it is being written it
    # never reaches the streamed content
    for k in range(1, len(trigger)):
        sp = StreamParser(name, tools=TOOLS)
        deltas = sp.feed("Hello. " + trigger[:k])
        streamed = "".join(d.text for d in deltas if d.kind == "content")
        assert trigger[:k] not in streamed, (k, streamed)


def test_learned_and_hand_written_parsers_type_arguments_alike() -> None:
    # one typing rule for tagged values: Seed-OSS read by its own parser and by the
    # auto-parser (which learns the same syntax from the template) give the same arguments
    source = (DATA / "llama_cpp_templates" / "ByteDance-Seed-OSS.jinja").read_text(encoding="utf-8")
    analysis = analyze_template(source)
    assert analysis is not None and analysis.tool_format == "tag_tagged"
    props = {
        "n": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "q": {"type": ["string", "null"]},
        "flag": {"type": "boolean"},
        "word": {"type": "string"},
        "free": {},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": props}}}]
    values = {"n": "5", "q": '"x"', "flag": "True", "word": "007", "free": "None"}
    text = (
        "<seed:tool_call>\n<function=f>\n"
        + "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in values.items())
        + "</function>\n</seed:tool_call>"
    )
    own = parse(text, "seed_oss", tools=tools).tool_calls
    learned = parse(text, "auto", tools=tools, analysis=analysis).tool_calls
    assert [c["args"] for c in learned] == [c["args"] for c in own]
    assert own[0]["args"] == {"n": 5, "q": "x", "flag": True, "word": "007", "free": None}
