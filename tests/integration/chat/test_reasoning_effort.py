"""``reasoning_effort`` reaches the chat template: as the variable templates read
(gpt-oss) and as the on/off switch of templates with only that (Qwen3)."""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage

from langchain_llamacpp_local import ChatLlamaCpp

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "llama_cpp_templates"
MSGS = [HumanMessage("hi")]


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def test_effort_reaches_a_template_that_reads_it(tiny_llama: str) -> None:
    oss = _template("openai-gpt-oss-120b.jinja")
    llm = ChatLlamaCpp(model_path=tiny_llama, chat_template=oss, reasoning_effort="high")
    assert "Reasoning: high" in llm.render_prompt(MSGS).text
    # per call, over the instance's
    assert "Reasoning: low" in llm.render_prompt(MSGS, reasoning_effort="low").text
    # an explicit template variable wins
    text = llm.render_prompt(MSGS, chat_template_kwargs={"reasoning_effort": "medium"}).text
    assert "Reasoning: medium" in text


def test_effort_maps_to_the_on_off_switch(tiny_llama: str) -> None:
    qwen = _template("Qwen-Qwen3-0.6B.jinja")
    llm = ChatLlamaCpp(model_path=tiny_llama, chat_template=qwen)
    default = llm.render_prompt(MSGS).text
    empty_think = "<think>\n\n</think>"
    assert empty_think not in default
    for effort in ("none", "minimal"):
        assert llm.render_prompt(MSGS, reasoning_effort=effort).text.endswith(empty_think + "\n\n")
    for effort in ("low", "medium", "high"):
        assert llm.render_prompt(MSGS, reasoning_effort=effort).text == default
    off = ChatLlamaCpp(model_path=tiny_llama, chat_template=qwen, reasoning_effort="none")
    assert empty_think in off.render_prompt(MSGS).text


def test_unknown_effort_is_refused(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama)
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        llm.render_prompt(MSGS, reasoning_effort="extreme")


@pytest.mark.parametrize(
    ("file", "effort", "shown"),
    [
        # Hy3 accepts only no_think / low / high and raises on anything else
        ("tencent-Hy3.jinja", "medium", "reasoning_effort:high"),
        ("tencent-Hy3.jinja", "low", "reasoning_effort:low"),
        ("tencent-Hy3.jinja", "none", "<think:opensource></think:opensource>"),
        # Solar Open's "minimal" is its "off"
        ("upstage-Solar-Open-100B.jinja", "none", "<|begin|>assistant<|think|><|end|>"),
        ("MiniMax-M3.jinja", "none", "Current thinking mode: disabled"),
        ("MiniMax-M3.jinja", "low", "Current thinking mode: adaptive"),
        ("MiniMax-M3.jinja", "high", "Current thinking mode: enabled"),
        ("Kimi-K3.jinja", "medium", "thinking_effort=high"),
        ("Kimi-K3.jinja", "low", "thinking_effort=low"),
        ("muse-glimmer.jinja", "low", "Reasoning strength: low."),
        ("deepseek-ai-DeepSeek-V4-Flash-0731.jinja", "high", "Reasoning Effort: Absolute"),
        ("ibm-granite-granite-3.3-2B-Instruct.jinja", "high", "write down your thoughts"),
    ],
)
def test_render_prompt_shows_the_templates_own_value(
    tiny_llama: str, file: str, effort: str, shown: str
) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, chat_template=_template(file))
    assert shown in llm.render_prompt(MSGS, reasoning_effort=effort).text


def test_budget_zero_turns_the_switches_off(tiny_llama: str) -> None:
    m3 = ChatLlamaCpp(model_path=tiny_llama, chat_template=_template("MiniMax-M3.jinja"))
    assert "Current thinking mode: disabled" in m3.render_prompt(MSGS, reasoning_budget=0).text
    cohere = ChatLlamaCpp(model_path=tiny_llama, chat_template=_template("Cohere2MoE.jinja"))
    assert cohere.render_prompt(MSGS).text.endswith("<|START_THINKING|>")
    assert not cohere.render_prompt(MSGS, reasoning_budget=0).text.endswith("<|START_THINKING|>")
