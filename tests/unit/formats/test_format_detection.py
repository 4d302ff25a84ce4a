"""The format chosen for each of llama.cpp's real templates matches llama.cpp's handler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from langchain_llamacpp_local.formats import FORMATS, detect_format, detect_handler

DATA = Path(__file__).resolve().parents[2] / "data"
EXPECTED = json.loads((DATA / "llama_cpp_template_formats.json").read_text(encoding="utf-8"))[
    "templates"
]
TEMPLATES = sorted(p.name for p in (DATA / "llama_cpp_templates").glob("*.jinja"))


def test_every_template_has_an_expectation() -> None:
    assert sorted(EXPECTED) == TEMPLATES
    # every models/templates/*.jinja of llama.cpp @0c1e57098, and newer llama.cpp's MiroThinker
    assert len(TEMPLATES) == 71


@pytest.mark.parametrize("name", TEMPLATES)
def test_handler_and_format(name: str) -> None:
    source = (DATA / "llama_cpp_templates" / name).read_text(encoding="utf-8")
    assert detect_handler(source) == EXPECTED[name]["llama_cpp_handler"]
    assert detect_format(source) == EXPECTED[name]["format"]
    assert EXPECTED[name]["format"] in FORMATS


def test_specialized_order_matters() -> None:
    # Ministral 3 needs [SYSTEM_PROMPT]+[TOOL_CALLS]+[ARGS] and no [CALL_ID] (Mistral Small 3.2 has it)
    assert detect_handler("[SYSTEM_PROMPT][TOOL_CALLS][ARGS]") == "ministral_3"
    assert detect_handler("[SYSTEM_PROMPT][TOOL_CALLS][ARGS][CALL_ID]") == "autoparser"
    # GPT-OSS wins over everything after it
    assert detect_handler("<|channel|> <tool_call><function=<parameter=") == "gpt_oss"
    # Qwen3-Coder excludes templates writing no newline between its tags
    src = "<tool_call> <function= <parameter= '<tool_call><function=' ~ tool_call.name ~ '>'"
    assert detect_handler(src) == "autoparser"
    assert detect_handler("") == "autoparser" and detect_format("") == "generic"
