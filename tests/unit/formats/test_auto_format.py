"""Templates no hand-written family knows: the syntax is learned by template_analysis."""

from __future__ import annotations

import pytest

from langchain_llamacpp_local.chat.prompts import resolve_format
from langchain_llamacpp_local.formats import StreamParser, parse
from langchain_llamacpp_local.templates.chat_template import ChatTemplate

# a made-up syntax: <call>{json}</call>, which none of the families writes
SRC = (
    "{%- if tools %}<|sys|>Tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<call>"
    '{{ {"name": tc.function.name, "arguments": tc.function.arguments} | tojson }}</call>{% endfor %}'
    "{%- else %}{{ m.content }}{% endif %}<|end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = 'Sure.<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>'


def test_unknown_syntax_is_learned_from_the_template() -> None:
    fmt, analysis = resolve_format(ChatTemplate(SRC, origin="custom"))
    assert fmt == "auto" and analysis is not None and analysis.trigger == "<call>"
    out = parse(TEXT, fmt, analysis=analysis)
    assert out.content == "Sure."
    assert [(c["name"], c["args"]) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    sp = StreamParser(fmt, analysis=analysis)
    deltas = [d for i in range(0, len(TEXT), 3) for d in sp.feed(TEXT[i : i + 3])] + sp.finish()
    assert "".join(d.text for d in deltas if d.kind == "content") == "Sure."
    assert sp.result.tool_calls[0]["args"] == {"city": "Paris"}
    assert "<call" not in "".join(d.text for d in deltas)


def test_known_families_and_tool_less_templates_are_not_analysed() -> None:
    hermes = ChatTemplate("{{ tools }}<tool_call>{{ messages }}</tool_call>", origin="h")
    assert resolve_format(hermes) == ("hermes", None)
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", origin="p")
    assert resolve_format(plain) == ("generic", None)


def test_auto_needs_its_analysis() -> None:
    with pytest.raises(ValueError, match="analysis"):
        parse(TEXT, "auto")
