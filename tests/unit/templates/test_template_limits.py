"""Hostile or runaway templates stop at a limit with a ChatTemplateError naming it."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from langchain_llamacpp_local.errors import ChatTemplateError
from langchain_llamacpp_local.templates.builtin_templates import select_template
from langchain_llamacpp_local.templates.chat_template import ChatTemplate
from langchain_llamacpp_local.templates.sandbox import RenderLimits

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


# ----------------------------------------------------------------- limits before allocation

_ISOLATED = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from langchain_llamacpp_local.templates.chat_template import ChatTemplate, ChatTemplateError
for source in sys.argv[1:]:
    try:
        ChatTemplate(source, origin="override").render([{"role": "user", "content": "hi"}])
        print("RENDERED", flush=True)
    except ChatTemplateError as exc:
        print("ERROR", exc, flush=True)
"""


def _render_isolated(*sources: str, timeout: float = 20.0) -> list[str]:
    """Render in a child process with a 3 GiB address-space limit and a time limit: an
    allocation or a GIL-holding big-int operation the sandbox lets through kills or stalls
    the child, which fails the test instead of the test run."""
    import subprocess
    import sys

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _ISOLATED, *sources],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"rendering {sources!r} ran past {timeout} s (the sandbox let it run)")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, (
        f"the child died ({proc.returncode}) at {sources[len(lines)]!r}: {proc.stderr[-2000:]}"
    )
    return lines


BOMBS = [
    "{{ 2000000000 * 'a' }}",  # the count first: refused as 'a' * 2000000000 is
    "{{ 2000000000 * ['a'] }}",
    "{{ '%*s' % (4000000000, 'x') }}",
    "{{ '%.*f' % (4000000000, 1.5) }}",
    "{{ '{:>{}}'.format('x', 4000000000) }}",
    "{{ '{:>{w}}'.format('x', w=4000000000) }}",
    "{{ '%*s' | format(4000000000, 'x') }}",
    "{{ (['x' * 1000000] * 1000000) | join }}",
    "{{ ''.join(['x' * 1000000] * 1000000) }}",
    "{{ ('x' * 1000000).replace('x', 'y' * 10000) }}",
    "{{ ('x' * 1000000) | replace('x', 'y' * 10000) }}",
    "{{ ['x' * 1000000] * 1000000 }}",
    "{{ (['x' * 1000000] * 1000000) | string }}",
    "{{ 'a' ~ (['x' * 1000000] * 1000000) }}",
    "{{ '%s' % [['x' * 1000000] * 1000000] }}",
    "{{ (['x' * 1000000] * 1000000) | tojson }}",
    "{{ (['x' * 1000000] * 1000000) | pprint }}",
]


def test_size_is_predicted_before_the_allocation() -> None:
    for source, line in zip(BOMBS, _render_isolated(*BOMBS), strict=True):
        assert line.startswith("ERROR") and "exceeds the cap" in line, (source, line)


def test_big_integer_products_are_capped() -> None:
    source = (
        "{% set ns = namespace(x=2 ** 2000) %}{% for i in range(12) %}"
        "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x // 3 }}"
    )
    (out,) = _render_isolated(source, timeout=10.0)
    assert out.startswith("ERROR") and "exceeds the cap of 4096 bits" in out, out
    # caller data cannot smuggle a huge integer past the cap either
    tpl = ChatTemplate("{{ n // 7 }}", origin="override")
    with pytest.raises(ChatTemplateError, match="integer of .* bits exceeds the cap"):
        tpl.render(MSGS, n=1 << 100_000)
    assert ChatTemplate("{{ (2 ** 64) * 3 // 2 - 1 }}").render(MSGS) == str(3 * 2**63 - 1)


# ----------------------------------------------------------------- one budget per request


def _timed(fn: Callable[[], object]) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def test_probes_and_render_share_one_budget() -> None:
    source = "{% for i in range(30000) %}{% endfor %}{{ messages[-1].content }}{{ tool_calls }}"
    tpl = ChatTemplate(source, origin="override")
    tpl.render(MSGS)  # compiled; later renders are the render alone
    # each duration is the least of a few tries: a busy machine (CI's other tests) only
    # ever adds time, and a preempted try would otherwise set the budget
    once = min(_timed(lambda: tpl.render(MSGS)) for _ in range(3))
    messages = [
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
    # each render fits in the limit, the probes plus the render do not: the budget sits
    # between the two (geometric mean), measured on an unlimited twin of the template
    # (a twin's probes are remembered after its first render: a new twin for each try)
    probed = min(
        _timed(lambda k=k: ChatTemplate(source + " " * k, origin="override").render(messages))
        for k in (2, 3, 4)
    )
    assert probed > 4 * once  # the probes are several renders (about 9 here)
    budget = (once * probed) ** 0.5
    slow = ChatTemplate(source + " ", origin="override", limits=RenderLimits(timeout_s=budget))
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="time limit"):
        slow.render(messages)
    assert time.monotonic() - start < budget + 1.0
    # the failed probe is remembered: the next requests fail at once (the least of three
    # tries: each would take the whole budget again if the probes ran again)

    def fails() -> None:
        with pytest.raises(ChatTemplateError, match="time limit"):
            slow.render(messages)

    assert min(_timed(fails) for _ in range(3)) < budget


def test_wordwrap_checks_the_deadline_inside() -> None:
    tpl = ChatTemplate(
        "{{ ('x' * 300000) | wordwrap(1) | length }}",
        origin="override",
        limits=RenderLimits(timeout_s=0.3),
    )
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="time limit"):
        tpl.render(MSGS)
    assert time.monotonic() - start < 1.5
    assert ChatTemplate("{{ 'aa bb cc' | wordwrap(2) }}").render(MSGS) == "aa\nbb\ncc"


def test_compiling_is_bounded() -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="template source of .* exceeds the cap"):
        ChatTemplate("{{ x }}" * 200_000, origin="override")
    with pytest.raises(ChatTemplateError, match="time limit"):
        ChatTemplate("{{ y }}" * 60_000, origin="override", limits=RenderLimits(timeout_s=0.05))
    assert time.monotonic() - start < 3.0


def test_compiled_templates_are_cached_per_source(monkeypatch: pytest.MonkeyPatch) -> None:
    from langchain_llamacpp_local.templates import chat_template

    compiled: list[str] = []  # compilations counted, not timed
    compile_once = chat_template._compile

    def counting(source: str, limits: RenderLimits) -> object:
        compiled.append(source)
        return compile_once(source, limits)

    monkeypatch.setattr(chat_template, "_compile", counting)
    source = "{{ messages[0].content }} cached " + "{{ 1 }}" * 3000
    chat_template._compiled.pop(source, None)
    first = ChatTemplate(source, origin="a")
    second = ChatTemplate(source, origin="b")
    assert compiled == [source]
    assert second._template is first._template
    assert second.render(MSGS).startswith("hi cached 1")


def test_a_cancelled_request_stops_the_template() -> None:
    from langchain_llamacpp_local.templates.sandbox import request_budget

    tpl = ChatTemplate(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        origin="override",
    )
    stop_at = time.monotonic() + 0.2
    start = time.monotonic()
    with request_budget(tpl.limits, cancelled=lambda: time.monotonic() > stop_at):
        with pytest.raises(ChatTemplateError, match="cancelled"):
            tpl.render(MSGS)
    assert time.monotonic() - start < 1.0


# ----------------------------------------------------------------- each cap, at it and one past it

_SMALL = RenderLimits(
    max_output_chars=100,
    max_range=10,
    max_repeat=10,
    max_pow_bits=64,
    max_int_bits=100,
    max_source_chars=60,
    max_lipsum=3,
)

#: (case, source at the cap, source one past it, the error naming the cap); variables
#: ``s60``/``s40``/``s41``/``s98``/``s99`` are strings of that many characters, ``i100``/``i101``
#: integers of that many bits
CAP_CASES = [
    (
        "range",
        "{{ range(10) | list | length }}",
        "{{ range(11) | list | length }}",
        r"range\(\) of 11 items exceeds the cap of 10",
    ),
    (
        "range step",
        "{{ range(0, 20, 2) | list | length }}",
        "{{ range(0, 21, 2) | list | length }}",
        r"range\(\) of 11 items exceeds the cap of 10",
    ),
    ("str * int", "{{ 'a' * 10 }}", "{{ 'a' * 11 }}", "repetition producing 11 items"),
    ("int * str", "{{ 10 * 'a' }}", "{{ 11 * 'a' }}", "repetition producing 11 items"),
    (
        "list * int",
        "{{ ([0] * 10) | length }}",
        "{{ ([0] * 11) | length }}",
        "repetition producing 11 items",
    ),
    (
        "int * list",
        "{{ (10 * [0]) | length }}",
        "{{ (11 * [0]) | length }}",
        "repetition producing 11 items",
    ),
    ("long str * int", "{{ 'ab' * 5 }}", "{{ 3 * 'abcd' }}", "repetition producing 12 items"),
    (
        "'%*s' width",
        "{{ '%*s' % (10, 'x') }}",
        "{{ '%*s' % (11, 'x') }}",
        "width or precision of 11 exceeds the cap of 10",
    ),
    (
        "format width",
        "{{ '{:>10}'.format('x') }}",
        "{{ '{:>11}'.format('x') }}",
        "width or precision of 11 exceeds the cap of 10",
    ),
    (
        "center",
        "{{ 'a' | center(10) }}",
        "{{ 'a' | center(11) }}",
        "'do_center' argument 11 exceeds the cap of 10",
    ),
    ("ljust", "{{ 'a'.ljust(10) }}", "{{ 'a'.ljust(11) }}", r"ljust\(11\) exceeds the cap of 10"),
    ("int ** int", "{{ 2 ** 32 }}", "{{ 2 ** 33 }}", r"2 \*\* 33 exceeds the cap of 64 bits"),
    (
        "int * int",
        "{{ (2 ** 31) * (2 ** 31) }}",
        "{{ (2 ** 31) * (2 ** 32) }}",
        "product of about 65 bits exceeds the cap of 64 bits",
    ),
    (
        "int operand",
        "{{ i100 // 7 > 0 }}",
        "{{ i101 // 7 > 0 }}",
        "integer of 101 bits exceeds the cap of 100 bits",
    ),
    (
        "tojson indent",
        "{{ [1] | tojson(indent=64) | length }}",
        "{{ [1] | tojson(indent=65) | length }}",
        r"tojson\(indent=65\) exceeds the cap of 64",
    ),
    ("output", "{{ s60 }}{{ s40 }}", "{{ s60 }}{{ s41 }}", "output cap of 100 characters"),
    (
        "~",
        "{{ (s60 ~ s40) | length }}",
        "{{ (s60 ~ s41) | length }}",
        "concatenated string of 101 characters exceeds the cap of 100",
    ),
    (
        "+",
        "{{ (s60 + s40) | length }}",
        "{{ (s60 + s41) | length }}",
        r"'\+' result of 101 items exceeds the cap of 100",
    ),
    (
        "join",
        "{{ [s60, s40] | join | length }}",
        "{{ [s60, s41] | join | length }}",
        "join\\(\\) result of 101 characters exceeds the cap of 100",
    ),
    (
        "str.join",
        "{{ ''.join([s60, s40]) | length }}",
        "{{ ''.join([s60, s41]) | length }}",
        "join\\(\\) result of 101 characters exceeds the cap of 100",
    ),
    (
        "replace",
        "{{ s60.replace('x', 'xx', 40) | length }}",
        "{{ s60.replace('x', 'xx', 41) | length }}",
        r"replace\(\) result of 101 characters exceeds the cap of 100",
    ),
    (
        "replace filter",
        "{{ s60 | replace('x', 'xx', 40) | length }}",
        "{{ s60 | replace('x', 'xx', 41) | length }}",
        r"replace\(\) result of 101 characters exceeds the cap of 100",
    ),
    # the '%' prediction is an upper bound: the format's own text plus each value
    (
        "'%s' %",
        "{{ ('%s' % s98) | length }}",
        "{{ ('%s' % s99) | length }}",
        "'%' formatted string of 101 characters exceeds the cap of 100",
    ),
    (
        "str.format",
        "{{ '{}{}'.format(s60, s40) | length }}",
        "{{ '{}{}'.format(s60, s41) | length }}",
        "formatted string of 101 characters exceeds the cap of 100",
    ),
]


def _render_small(source: str) -> str:
    variables = {
        "s60": "x" * 60,
        "s40": "x" * 40,
        "s41": "x" * 41,
        "s98": "x" * 98,
        "s99": "x" * 99,
        "i100": 1 << 99,
        "i101": 1 << 100,
    }
    return ChatTemplate(source, origin="override", limits=_SMALL).render(MSGS, **variables)


@pytest.mark.parametrize(
    ("case", "at_cap", "past_cap", "limit"), CAP_CASES, ids=[c[0] for c in CAP_CASES]
)
def test_each_cap_allows_its_value_and_refuses_one_more(
    case: str, at_cap: str, past_cap: str, limit: str
) -> None:
    """Every limit sits exactly at its cap: the cap itself renders, one more is refused
    with an error naming the cap (a ``<`` turned ``<=``, a cap checked for one operand
    order only, or a check loosened past the cap fails here)."""
    _render_small(at_cap)
    with pytest.raises(ChatTemplateError, match=limit) as info:
        _render_small(past_cap)
    assert info.value.limit


def test_the_source_cap_allows_its_length_and_refuses_one_more() -> None:
    at_cap = "{{ messages[0].content }}" + "x" * (_SMALL.max_source_chars - 25)
    assert len(at_cap) == _SMALL.max_source_chars
    assert ChatTemplate(at_cap, origin="override", limits=_SMALL).render(MSGS).startswith("hi")
    with pytest.raises(ChatTemplateError, match="source of 61 characters exceeds the cap of 60"):
        ChatTemplate(at_cap + "y", origin="override", limits=_SMALL)


def test_format_widths_below_a_million_pass_the_pattern_check() -> None:
    """The format-string check refuses widths of seven digits or more; six digits go on to
    the width cap (a million by default), and render."""
    assert ChatTemplate("{{ ('%999999d' % 1) | length }}").render(MSGS) == "999999"
    with pytest.raises(ChatTemplateError, match="a million or more"):
        ChatTemplate("{{ ('%1000000d' % 1) | length }}").render(MSGS)


def test_lipsum_allows_its_cap_and_refuses_one_more() -> None:
    limits = RenderLimits(max_lipsum=3)

    def lipsum(args: str) -> str:
        return ChatTemplate(f"{{{{ lipsum({args}) | length > 0 }}}}", limits=limits).render(MSGS)

    assert lipsum("3, min=5, max=30") == "True"
    for args, shown in (("4, min=5, max=30", "n=4"), ("3, min=5, max=31", "max=31")):
        with pytest.raises(ChatTemplateError, match=rf"lipsum\(.*{shown}.*\) exceeds the cap of 3"):
            lipsum(args)
    # a min past its cap is refused before lipsum runs (jinja would fail on min > max)
    with pytest.raises(ChatTemplateError, match=r"min=31, max=30\) exceeds the cap of 3"):
        lipsum("3, min=31, max=30")
