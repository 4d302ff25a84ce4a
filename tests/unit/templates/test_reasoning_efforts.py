"""``reasoning_effort`` in the names and values each chat template of the test data
reads: every template that reads an effort or a thinking switch renders a different
prompt for each level it knows, and never an error for one of OpenAI's efforts."""

from __future__ import annotations

from pathlib import Path

import pytest

from langchain_llamacpp_local.chat.prompts import template_kwargs
from langchain_llamacpp_local.chat.request_options import EFFORTS
from langchain_llamacpp_local.templates.chat_template import ChatTemplate
from langchain_llamacpp_local.templates.efforts import (
    EFFORT_VARIABLES,
    SWITCH_VARIABLES,
    known_values,
)

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "llama_cpp_templates"
MSGS = [{"role": "user", "content": "hi"}]

#: per template reading an effort variable or a switch beyond ``enable_thinking``: the
#: efforts that render the same prompt, group by group (different groups differ)
GROUPS: dict[str, list[set[str]]] = {
    "Cohere2MoE.jinja": [{"none", "minimal"}, {"low", "medium", "high"}],
    # thinking=false; thinking_effort low | high (it has no medium and rejects it)
    "Kimi-K3.jinja": [{"none", "minimal"}, {"low"}, {"medium", "high"}],
    # thinking_mode disabled | adaptive | enabled
    "MiniMax-M3.jinja": [{"none", "minimal"}, {"low"}, {"medium", "high"}],
    "deepseek-ai-DeepSeek-V3.1.jinja": [{"none", "minimal"}, {"low", "medium", "high"}],
    "deepseek-ai-DeepSeek-V3.2.jinja": [{"none", "minimal"}, {"low", "medium", "high"}],
    # V4 reads only "max", which is not one of OpenAI's efforts
    "deepseek-ai-DeepSeek-V4.jinja": [{"none", "minimal"}, {"low", "medium", "high"}],
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": [
        {"none", "minimal"},
        {"low", "medium"},
        {"high"},
    ],
    "ibm-granite-granite-3.3-2B-Instruct.jinja": [{"none", "minimal"}, {"low", "medium", "high"}],
    "muse-glimmer.jinja": [{e} for e in EFFORTS],
    "openai-gpt-oss-120b.jinja": [{e} for e in EFFORTS],
    # no_think | low | high (it raises on any other value)
    "tencent-Hy3.jinja": [{"none", "minimal"}, {"low"}, {"medium", "high"}],
    # its own "low" and "minimal" turn thinking off
    "upstage-Solar-Open-100B.jinja": [{"none", "minimal", "low"}, {"medium", "high"}],
}


def _template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(), origin=name, bos_token="<s>")


def _render(t: ChatTemplate, **options: object) -> str:
    return t.render(MSGS, **template_kwargs(t, {}, **options))  # type: ignore[arg-type]


def _reads_effort(t: ChatTemplate) -> bool:
    return bool(t.variables & {*EFFORT_VARIABLES, *SWITCH_VARIABLES})


def test_every_template_that_reads_an_effort_is_checked() -> None:
    reading = {p.name for p in TEMPLATES.glob("*.jinja") if _reads_effort(_template(p.name))}
    assert reading == set(GROUPS)


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_each_level_the_template_knows_renders_its_own_prompt(name: str) -> None:
    t = _template(name)
    prompts = {e: _render(t, effort=e) for e in EFFORTS}
    groups = GROUPS[name]
    assert set().union(*groups) == set(EFFORTS)
    for group in groups:
        assert len({prompts[e] for e in group}) == 1, group
    assert len({prompts[next(iter(g))] for g in groups}) == len(groups)


@pytest.mark.parametrize(
    ("name", "effort", "shown"),
    [
        ("tencent-Hy3.jinja", "medium", "reasoning_effort:high"),
        ("tencent-Hy3.jinja", "low", "reasoning_effort:low"),
        ("tencent-Hy3.jinja", "none", "<think:opensource></think:opensource>"),
        ("upstage-Solar-Open-100B.jinja", "none", "<|begin|>assistant<|think|><|end|>"),
        ("MiniMax-M3.jinja", "none", "Current thinking mode: disabled"),
        ("MiniMax-M3.jinja", "high", "Current thinking mode: enabled"),
        ("Kimi-K3.jinja", "medium", "thinking_effort=high"),
        ("muse-glimmer.jinja", "low", "Reasoning strength: low."),
        ("openai-gpt-oss-120b.jinja", "high", "Reasoning: high"),
    ],
)
def test_the_template_gets_its_own_value(name: str, effort: str, shown: str) -> None:
    assert shown in _render(_template(name), effort=effort)


def test_kimi_k3_turns_thinking_off() -> None:
    t = _template("Kimi-K3.jinja")
    assert _render(t, effort="none").endswith("<|open|>response<|sep|>")
    assert _render(t, effort="high").endswith("<|open|>think<|sep|>")


def test_the_values_a_template_compares_are_read() -> None:
    hy3 = (TEMPLATES / "tencent-Hy3.jinja").read_text()
    known, closed = known_values(hy3, "reasoning_effort")
    assert {"no_think", "low", "high"} <= known and closed
    solar = (TEMPLATES / "upstage-Solar-Open-100B.jinja").read_text()
    assert known_values(solar, "reasoning_effort") == (frozenset({"low", "minimal"}), False)


@pytest.mark.parametrize(
    "name", sorted(p.name for p in TEMPLATES.glob("*.jinja") if "enable_thinking" in p.read_text())
)
def test_switch_templates_think_or_not_by_effort(name: str) -> None:
    t = _template(name)
    if "enable_thinking" not in t.variables:
        pytest.skip("sets enable_thinking itself")
    assert _render(t, effort="none") == _render(t, effort="minimal")
    assert _render(t, effort="none") != _render(t, effort="high")


def test_budget_zero_turns_a_thinking_mode_off() -> None:
    t = _template("MiniMax-M3.jinja")
    assert "Current thinking mode: disabled" in _render(t, budget=0)
    assert "Current thinking mode: disabled" not in _render(t)


def test_the_callers_template_kwargs_win() -> None:
    t = _template("tencent-Hy3.jinja")
    kwargs = template_kwargs(t, {"reasoning_effort": "low"}, effort="high")
    assert kwargs["reasoning_effort"] == "low"


def test_an_unknown_effort_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        template_kwargs(_template("tencent-Hy3.jinja"), {}, effort="max")


def test_seed_oss_is_told_its_budget() -> None:
    t = _template("ByteDance-Seed-OSS.jinja")
    assert "your thinking budget is 0" in _render(t, budget=0)
    assert "the thinking budget, which is 512" in _render(t, budget=512)
    assert "thinking budget" not in _render(t)
