"""Hostile or runaway templates stop at a limit with a ChatTemplateError naming it (issue 12 #6)."""

from __future__ import annotations

import time

import pytest

from langchain_llamacpp_local.templates import (
    ChatTemplate,
    ChatTemplateError,
    RenderLimits,
    select_template,
)

MSGS = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("source", "limit"),
    [
        ("{% for i in range(10**9) %}{% endfor %}", r"range\(\) of 1000000000 items exceeds"),
        ("{{ 'a' * 200000000 }}", "repetition producing 200000000 items exceeds"),
        ("{{ [1, 2] * 100000000 }}", "repetition producing 200000000 items exceeds"),
        ("{{ 10 ** 1000000 }}", r"10 \*\* 1000000 exceeds the cap of 4096 bits"),
        ("{{ lipsum(n=20000) }}", r"lipsum\(n=20000, min=20, max=100\) exceeds"),
        ("{{ 'a' | center(1000000000) }}", "filter 'do_center' argument 1000000000 exceeds"),
        ("{{ 'a'.ljust(1000000000) }}", r"ljust\(1000000000\) exceeds"),
        ("{{ '%01000000000d' % 1 }}", "field width of a million or more"),
        ("{{ '{:>1000000000}'.format(1) }}", "field width of a million or more"),
        ("{{ messages | tojson(indent=100000) }}", r"tojson\(indent=100000\) exceeds"),
    ],
)
def test_each_limit_raises_naming_it(source: str, limit: str) -> None:
    tpl = ChatTemplate(source, origin="override")
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=rf"'override': .*{limit}"):
        tpl.render(MSGS)
    assert time.monotonic() - start < 2.0


def test_nested_loops_stop_at_the_time_limit() -> None:
    tpl = ChatTemplate(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        origin="override",
        limits=RenderLimits(timeout_s=0.3),
    )
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"exceeded its time limit of 0\.3 s"):
        tpl.render(MSGS)
    assert time.monotonic() - start < 2.0


def test_recursive_macro_loops_stop_at_the_time_limit() -> None:
    source = (
        "{% macro f(n) %}{% for i in range(1000) %}{% if n %}{{ f(n - 1) }}{% endif %}"
        "{% endfor %}{% endmacro %}{{ f(50) }}"
    )
    tpl = ChatTemplate(source, origin="override", limits=RenderLimits(timeout_s=0.3))
    with pytest.raises(ChatTemplateError, match="time limit"):
        tpl.render(MSGS)


def test_doubling_strings_stop_at_the_size_cap() -> None:
    source = "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    tpl = ChatTemplate(source, origin="override", limits=RenderLimits(max_output_chars=1 << 20))
    with pytest.raises(ChatTemplateError, match="concatenated string of .* exceeds the cap"):
        tpl.render(MSGS)
    plus = source.replace("ns.s ~ ns.s", "ns.s + ns.s")
    with pytest.raises(ChatTemplateError, match="'\\+' result of .* exceeds the cap"):
        ChatTemplate(plus, limits=RenderLimits(max_output_chars=1 << 20)).render(MSGS)


def test_output_size_cap() -> None:
    tpl = ChatTemplate(
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        origin="override",
        limits=RenderLimits(max_output_chars=1_000_000),
    )
    with pytest.raises(ChatTemplateError, match="output cap of 1000000 characters"):
        tpl.render(MSGS)


def test_limits_do_not_touch_normal_templates() -> None:
    tpl = ChatTemplate(
        "{% for m in messages %}{{ '=' * 10 ~ m.content | center(20) ~ 2 ** 10 }}{% endfor %}"
        "{{ range(5) | list | tojson }}{{ lipsum(1, html=false) | length > 0 }}"
    )
    out = tpl.render(MSGS)
    assert out.startswith("==========         hi         1024[0, 1, 2, 3, 4]True")


def test_a_template_after_a_limit_renders_again() -> None:
    bad = ChatTemplate("{{ 'a' * 200000000 }}")
    good = ChatTemplate("{{ messages[0].content }}")
    with pytest.raises(ChatTemplateError):
        bad.render(MSGS)
    assert good.render(MSGS) == "hi"


def test_chatml_typo_is_an_error_naming_the_builtins() -> None:
    with pytest.raises(ValueError, match=r"'chatmlx' is not a built-in template name .*chatml"):
        select_template({}, override="chatmlx")
    # a name never becomes template source; Jinja source still works
    assert select_template({}, override="{{ messages[0].content }}").render(MSGS) == "hi"
    assert select_template({}, override=" ChatML ").origin == "builtin:chatml"
    # a GGUF named variant is still found by name
    meta = {"tokenizer.chat_template.rag": "RAG {{ messages[0].content }}"}
    assert select_template(meta, override="rag").render(MSGS) == "RAG hi"


def test_deeply_nested_gguf_template_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    deep = "{% if true %}" * 3000 + "x" + "{% endif %}" * 3000
    meta = {"tokenizer.chat_template": deep, "general.architecture": "gemma3"}
    tpl = select_template(meta)
    assert tpl.origin == "builtin:gemma"
    assert "nested too deeply" in caplog.text and "falling back" in caplog.text
    with pytest.raises(ChatTemplateError, match="nested too deeply"):
        select_template(meta, override=deep)


def test_probes_stop_at_the_first_limit() -> None:
    """A runaway template with system and tool messages costs one time limit, not one per probe."""
    tpl = ChatTemplate(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        "{{ tool_calls }}",
        origin="override",
        limits=RenderLimits(timeout_s=0.3),
    )
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "r"},
    ]
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="time limit") as info:
        tpl.render(messages)
    assert info.value.limit
    assert time.monotonic() - start < 1.5


def test_large_numbers_are_fine_where_nothing_is_allocated() -> None:
    tpl = ChatTemplate(
        "{{ nothing | default(10000000) }} {{ 1700000000 | string }} {{ [5000000, 1] | max }}"
        " {{ 'abc' | truncate(100000000) }} {{ ('%d' | format(123456789)) }}"
    )
    assert tpl.render(MSGS) == "10000000 1700000000 5000000 abc 123456789"
    with pytest.raises(ChatTemplateError, match="filter 'do_indent' argument"):
        ChatTemplate("{{ 'a\\nb' | indent(100000000) }}").render(MSGS)
    with pytest.raises(ChatTemplateError, match="field width"):
        ChatTemplate("{{ '%01000000000d' | format(1) }}").render(MSGS)


def test_tools_nested_past_the_recursion_limit_are_a_template_error() -> None:
    # a tool schema 2000 objects deep: copying it for the template would hit Python's
    # recursion limit; it must be a clear error, not a bare RecursionError
    node: dict[str, object] = {"type": "string"}
    for _ in range(2000):
        node = {"type": "object", "properties": {"x": node}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": node}}]
    tpl = ChatTemplate("{{ messages[0].content }}{{ tools | length }}")
    with pytest.raises(ChatTemplateError, match="nest too deeply"):
        tpl.render(MSGS, tools=tools)
    assert tpl.render(MSGS, tools=[]) == "hi0"
