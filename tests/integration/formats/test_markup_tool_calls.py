"""Forced tool calls and function-calling structured output through ``ChatLlamaCpp`` for
the families that write calls in their own markup, each with its real chat template.

The model has random weights: only the grammar makes its output a call, so a call that
the family's parser reads back with schema-typed arguments shows that the grammar is
the family's own syntax and that llama.cpp accepted it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.formats import detect_format
from langchain_llamacpp_local.formats.registry import FAMILIES as RECORDS
from langchain_llamacpp_local.formats.registry import Markup
from tests.gguf_models import write_tiny_llama

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "llama_cpp_templates"
FAMILIES = {
    "qwen3_coder": "Qwen3-Coder.jinja",
    "seed_oss": "ByteDance-Seed-OSS.jinja",
    "glm45": "GLM-4.6.jinja",
    "minimax_m2": "MiniMax-M2.jinja",
    "deepseek_v3_2": "deepseek-ai-DeepSeek-V3.2.jinja",
    "kimi_k2": "Kimi-K2-Instruct.jinja",
    "gemma4": "google-gemma-4-31B-it.jinja",
    "ministral_3": "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
    "deepseek_v3_1": "deepseek-ai-DeepSeek-V3.1.jinja",
    "solar_open": "upstage-Solar-Open-100B.jinja",
    "hy3": "tencent-Hy3.jinja",
    "minicpm5": "openbmb-MiniCPM5-1B.jinja",
}


@tool
def forecast(city: str = Field(max_length=5), days: int = 1, unit: Literal["c", "f"] = "c") -> str:
    """Weather forecast for a city."""
    return f"{city}: sunny for {days} days"


class Reading(BaseModel):
    """A measurement."""

    place: Literal["home", "away"]
    count: int
    ok: bool


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("markup") / "tiny.gguf"))


def test_every_markup_family_is_covered() -> None:
    assert set(FAMILIES) == {f.name for f in RECORDS.values() if isinstance(f.grammar, Markup)}


@pytest.mark.parametrize("fmt", sorted(FAMILIES))
def test_forced_call_and_structured_output(tiny_path: str, fmt: str) -> None:
    source = (TEMPLATES / FAMILIES[fmt]).read_text()
    assert detect_format(source) == fmt
    # reasoning=False: a thinking template leaves a random model room to think first,
    # where it would wander until max_tokens; this test is about the call's grammar
    llm = ChatLlamaCpp(
        model_path=tiny_path,
        temperature=0,
        max_tokens=700,
        n_ctx=4096,
        chat_template=source,
        reasoning=False,
    )
    bound = llm.bind_tools([forecast], tool_choice="forecast")
    msg = bound.invoke("Weather in Paris?")
    assert not msg.invalid_tool_calls, msg
    [call] = msg.tool_calls
    assert call["name"] == "forecast" and call["id"]
    args = call["args"]
    assert set(args) >= {"city"} and isinstance(args["city"], str), args
    assert isinstance(args.get("days", 1), int) and args.get("unit", "c") in ("c", "f"), args

    reading = llm.with_structured_output(Reading, method="function_calling").invoke("Read it.")
    assert isinstance(reading, Reading)  # validated: types and the enum held


def test_auto_with_free_form_arguments_leaves_the_model_free(tiny_path: str) -> None:
    """Arguments with no ``properties`` cannot be written one tag each: with
    ``tool_choice="auto"`` the model then gets no lazy grammar (and a forced call the
    generic JSON object), and the request is served."""
    free = {
        "type": "function",
        "function": {
            "name": "free",
            "description": "Any integers by name.",
            "parameters": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
    }
    source = (TEMPLATES / FAMILIES["qwen3_coder"]).read_text()
    llm = ChatLlamaCpp(
        model_path=tiny_path, temperature=0, max_tokens=8, n_ctx=4096, chat_template=source
    )
    assert llm.bind_tools([free]).invoke("hi").response_metadata["finish_reason"]
    forced = llm.bind_tools([free], tool_choice="free").invoke("hi", max_tokens=300)
    assert [c["name"] for c in forced.tool_calls] == ["free"], forced
