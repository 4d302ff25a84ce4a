"""Tool-call and reasoning parsers: recorded outputs of every format, streaming, fuzzing."""

from __future__ import annotations

import json
import random
import zlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from langchain_llamacpp_local.formats import (
    FORMATS,
    StreamParser,
    detect_format,
    parse,
)
from langchain_llamacpp_local.formats.registry import FAMILIES

W = {"city": "Paris"}
A = {"a": 1, "b": 2}
DS = {
    "cb": "<｜tool▁calls▁begin｜>",
    "ce": "<｜tool▁calls▁end｜>",
    "b": "<｜tool▁call▁begin｜>",
    "e": "<｜tool▁call▁end｜>",
    "s": "<｜tool▁sep｜>",
}

# (format, model output, content, reasoning (with reasoning=True), [(name, args)], n_invalid)
RECORDED = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        None,
        [("get_weather", W)],
        0,
    ),
    (
        "hermes",
        '<think>need two tools</think><tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>\n'
        '<tool_call>{"name":"add","arguments":"{\\"a\\": 1, \\"b\\": 2}"}</tool_call>',
        "",
        "need two tools",
        [("get_weather", W), ("add", A)],
        0,
    ),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par', "", None, [], 1),
    ("hermes", '<tool_call>{"name": get_weather}</tool_call> trailing', "trailing", None, [], 1),
    (
        "hermes",
        '<function=get_weather>{"city": "Paris"}</function>',
        "",
        None,
        [("get_weather", W)],
        0,
    ),
    ("hermes", "Just text, no tools.", "Just text, no tools.", None, [], 0),
    # a JSON array in one tag is every call in it, not the first
    (
        "hermes",
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>',
        "",
        None,
        [("get_weather", W), ("add", A)],
        0,
    ),
    # arguments that are not a JSON object are an invalid call (LangChain's args are a dict)
    ("hermes", '<function=get_weather>["Paris"]</function>', "", None, [], 1),
    ("hermes", '<function=get_weather>"Paris"</function>', "", None, [], 1),
    (
        "hermes",
        '<tool_call><function=get_weather>["Paris"]</function></tool_call>',
        "",
        None,
        [],
        1,
    ),
    # a whole output that is a JSON object with a "name" but neither "arguments" nor
    # "parameters" is an answer, not a call (llama.cpp's JSON tool-call grammar requires the
    # arguments key: common/chat-peg-parser.cpp build_json_tools_flat_keys)
    ("hermes", '{"name": "Paris"}', '{"name": "Paris"}', None, [], 0),
    ("hermes", '{"name": "get_weather"}', '{"name": "get_weather"}', None, [], 0),
    (
        "hermes",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        None,
        [("get_weather", W)],
        0,
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "",
        None,
        [("get_weather", W)],
        0,
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "",
        None,
        [("add", A), ("get_weather", W)],
        0,
    ),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1", "", None, [], 1),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        None,
        [("get_weather", W)],
        0,
    ),
    (
        "llama3_json",
        '<|python_tag|>{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}',
        "",
        None,
        [("add", A)],
        0,
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}',
        "",
        None,
        [("get_weather", W), ("add", A)],
        0,
    ),
    ("llama3_json", "The answer is 4.", "The answer is 4.", None, [], 0),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
        "",
        None,
        [("get_weather", W)],
        0,
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
        "",
        None,
        [("get_weather", W), ("add", A)],
        0,
    ),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci', "", None, [], 1),
    (
        "pythonic",
        '[get_weather(city="Paris"), add(a=1, b=2)]',
        "",
        None,
        [("get_weather", W), ("add", A)],
        0,
    ),
    (
        "pythonic",
        '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>Checking.',
        "Checking.",
        None,
        [("get_weather", W)],
        0,
    ),
    ("pythonic", "[1, 2, 3] is a list", "[1, 2, 3] is a list", None, [], 0),
    (
        "granite",
        '<think>plan</think><response>Sure.</response><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "Sure.",
        "plan",
        [("get_weather", W)],
        0,
    ),
    (
        "functionary_v3_2",
        '>>>get_weather\n{"city": "Paris"}>>>add\n{"a": 1, "b": 2}',
        "",
        None,
        [("get_weather", W), ("add", A)],
        0,
    ),
    ("functionary_v3_2", ">>>all\nHello there", "Hello there", None, [], 0),
    (
        "deepseek_r1",
        f"<think>hmm</think>{DS['cb']}{DS['b']}function{DS['s']}get_weather\n```json\n"
        f'{{"city": "Paris"}}\n```{DS["e"]}{DS["ce"]}',
        "",
        "hmm",
        [("get_weather", W)],
        0,
    ),
    (
        "command_r7b",
        '<|START_THINKING|>plan<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", "tool_name": "add", '
        '"parameters": {"a": 1, "b": 2}}]<|END_ACTION|>',
        "",
        "plan",
        [("add", A)],
        0,
    ),
    ("command_r7b", "<|START_RESPONSE|>Hi!<|END_RESPONSE|>", "Hi!", None, [], 0),
    (
        "gpt_oss",
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
        ' <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        "",
        "think",
        [("get_weather", W)],
        0,
    ),
    (
        "gpt_oss",
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Done.",
        "Done.",
        "think",
        [],
        0,
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}',
        "",
        None,
        [("add", A)],
        0,
    ),
    (
        "generic",
        '```json\n{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}\n```',
        "",
        None,
        [("get_weather", W)],
        0,
    ),
    ("generic", '{"response": "All good."}', "All good.", None, [], 0),
]


@pytest.mark.parametrize(("fmt", "text", "content", "reasoning", "calls", "n_invalid"), RECORDED)
def test_recorded_outputs(
    fmt: str, text: str, content: str, reasoning: str | None, calls: list, n_invalid: int
) -> None:
    out = parse(text, fmt, reasoning=True)
    assert out.content == content
    assert out.reasoning == reasoning
    assert [(c["name"], c["args"]) for c in out.tool_calls] == calls
    assert len(out.invalid_tool_calls) == n_invalid
    ids = [c["id"] for c in out.tool_calls]
    assert all(ids) and len(set(ids)) == len(ids)
    for bad in out.invalid_tool_calls:
        assert bad["args"] and bad["error"]  # the raw text is kept, with a reason


def test_reasoning_modes() -> None:
    text = "<think>secret plan</think>The answer."
    assert parse(text, "hermes", reasoning=None).content == text  # left as generated
    # thinking was not asked for, the model thought anyway: returned as reasoning (as llama.cpp does)
    assert parse(text, "hermes", reasoning=False).content == "The answer."
    assert parse(text, "hermes", reasoning=False).reasoning == "secret plan"
    on = parse(text, "hermes", reasoning=True)
    assert (on.content, on.reasoning) == ("The answer.", "secret plan")
    # the prompt already opened the think block
    opened = parse("still thinking</think>Done", "content", reasoning=True, think_open=True)
    assert (opened.content, opened.reasoning) == ("Done", "still thinking")
    unfinished = parse("<think>never closed", "content", reasoning=True)
    assert unfinished.reasoning == "never closed" and unfinished.content == ""


@pytest.mark.parametrize(
    "text",
    [
        "[f(a=1j)]",
        "[f(a={1, 2})]",
        "[f(a=b'x')]",
        "[f(a={(1, 2): 3})]",
        "[f(a=1e999)]",
        "[f(a=-1e999, b=2)]",
    ],
)
def test_pythonic_values_that_are_not_json_give_an_invalid_call(text: str) -> None:
    """``ast.literal_eval`` output that JSON cannot carry never raises."""
    for fmt in ("pythonic",):
        out = parse(text, fmt)
        assert out.tool_calls == [] and len(out.invalid_tool_calls) == 1
        assert "not" in out.invalid_tool_calls[0]["error"]
        sp = StreamParser(fmt)
        deltas = sp.feed(text) + sp.finish()
        assert [d.name for d in deltas if d.name] == ["f"] and sp.result.invalid_tool_calls


def test_pythonic_reads_json_literals() -> None:
    out = parse("[f(a=true, b=null, c=false, d=[true])]", "pythonic")
    assert out.tool_calls[0]["args"] == {"a": True, "b": None, "c": False, "d": [True]}


def test_schema_aware_typing_keeps_string_parameters_as_strings() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "s": {"type": "string"},
                        "n": {"type": "integer"},
                        "q": {"type": "string"},
                    },
                },
            },
        }
    ]
    text = (
        "<tool_call>\n<function=f>\n<parameter=s>\n5123123\n</parameter>\n<parameter=n>\n7\n</parameter>\n"
        '<parameter=q>\n"foo"\n</parameter>\n</function>\n</tool_call>'
    )
    assert parse(text, "qwen3_coder", tools=tools).tool_calls[0]["args"] == {
        "s": "5123123",
        "n": 7,
        "q": '"foo"',
    }
    # without the schema a number-looking value is read as JSON
    assert parse(text, "qwen3_coder").tool_calls[0]["args"]["s"] == 5123123


def test_prefill_opens_reasoning_and_recipients() -> None:
    out = parse(
        "plan</think>Done", "hermes", reasoning=True, prefill="<|im_start|>assistant\n<think>\n"
    )
    assert (out.content, out.reasoning) == ("Done", "plan")
    out = parse(
        'get_weather\n{"city": "Paris"}',
        "functionary_v3_2",
        prefill="<|start_header_id|>assistant<|end_header_id|>\n\n>>>",
    )
    assert [(c["name"], c["args"]) for c in out.tool_calls] == [("get_weather", W)]


def test_gpt_oss_call_ends_at_end_of_generation_and_builtins_are_not_content() -> None:
    # <|call|> is an end-of-generation token: the text stops right after the arguments
    out = parse(
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        "gpt_oss",
    )
    assert [(c["name"], c["args"]) for c in out.tool_calls] == [
        ("get_weather", W)
    ] and not out.invalid_tool_calls
    out = parse(
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=python<|channel|>commentary<|message|>print(1)",
        "gpt_oss",
        reasoning=True,
    )
    assert (out.content, out.reasoning, out.tool_calls) == ("", "x", [])
    # no tools, no reasoning asked: harmony markup never reaches content
    out = parse(
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>Hi",
        "gpt_oss",
        reasoning=False,
    )
    assert out.content == "Hi"


def test_mistral_ids_are_kept_and_unknown_format_errors() -> None:
    out = parse(next(r[1] for r in RECORDED if "a1b2c3d4e" in r[1]), "mistral")
    assert out.tool_calls[0]["id"] == "a1b2c3d4e"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse("x", "nope")


TEMPLATES = {
    "hermes": "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n</function>\n</tool_call>",
    "llama3_json": "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{%- if builtin_tools is defined %}"
    "<|python_tag|>{% endif %}",
    "mistral": "{%- if message.tool_calls %}[TOOL_CALLS][{% for tc in message.tool_calls %}{% endfor %}]",
    "pythonic": "You may call one or more functions. Format: [func_name1(params_name1=params_value1), "
    "func_name2(params)] <|tool_call_start|>",
    "granite": "{%- for tc in message.tool_calls %}<|tool_call|>{{ tc | tojson }}{% endfor %}",
    "functionary_v3_2": "{{ '>>>all\\n' + message['content'] }}{{ '>>>' + tool_call.function.name }}"
    "// Supported function definitions that should be called when necessary. >>>${recipient}",
    "deepseek_r1": "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] }}",
    "command_r7b": "<|START_THINKING|>{{ thought }}<|END_THINKING|><|START_ACTION|>[{{ calls }}]<|END_ACTION|>",
    "gpt_oss": "<|start|>assistant<|channel|>commentary to=functions.{{ name }}<|message|>",
    "generic": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
}


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_detect_format(fmt: str) -> None:
    assert detect_format(TEMPLATES[fmt]) == fmt


def _aggregate(
    fmt: str, text: str, cuts: list[int], reasoning: bool | None
) -> tuple[StreamParser, list]:
    sp = StreamParser(fmt, reasoning=reasoning)
    deltas = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        deltas += sp.feed(text[prev:c])
        prev = c
    deltas += sp.finish()
    return sp, deltas


def _check_stream(fmt: str, text: str, cuts: list[int], reasoning: bool | None) -> None:
    sp, deltas = _aggregate(fmt, text, cuts, reasoning)
    ref = parse(text, fmt, reasoning=reasoning)
    assert (
        "".join(d.text for d in deltas if d.kind == "content") == ref.content == sp.result.content
    )
    assert "".join(d.text for d in deltas if d.kind == "reasoning") == (ref.reasoning or "")
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.kind == "tool_call":
            c = calls.setdefault(d.index, {"name": None, "id": None, "args": ""})
            if d.name and c["name"] is None:
                assert c["args"] == "", "the name comes before the arguments"
                c["name"] = d.name
            c["id"] = c["id"] or d.id
            c["args"] += d.args
    valid = {c["id"]: c for c in sp.result.tool_calls}
    assert [(c["name"], c["args"]) for c in sp.result.tool_calls] == [
        (c["name"], c["args"]) for c in ref.tool_calls
    ]
    assert len(sp.result.invalid_tool_calls) == len(ref.invalid_tool_calls)
    for c in calls.values():
        if c["id"] in valid:
            assert json.loads(c["args"]) == valid[c["id"]]["args"]
            assert c["name"] == valid[c["id"]]["name"]
    # no half-written marker ever leaks into content
    content = "".join(d.text for d in deltas if d.kind == "content")
    for marker in FAMILIES[fmt].markers:
        if marker not in ref.content:
            assert marker not in content


@pytest.mark.parametrize(("fmt", "text"), [(r[0], r[1]) for r in RECORDED])
@pytest.mark.parametrize("reasoning", [None, True, False])
def test_stream_equals_parse_for_random_chunkings(
    fmt: str, text: str, reasoning: bool | None
) -> None:
    rng = random.Random(zlib.crc32(repr((fmt, text, reasoning)).encode()))  # the same every run
    for _ in range(15):
        cuts = sorted(
            rng.sample(range(1, max(2, len(text))), k=min(len(text) - 1, rng.randint(1, 12)))
        )
        _check_stream(fmt, text, cuts, reasoning)
    _check_stream(fmt, text, list(range(1, len(text))), reasoning)  # one character at a time


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    '{"name": "f", "arguments": {"x": 1}}',
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    ">>>",
    "all\n",
    "<|tool_call|>",
    "<|START_ACTION|>",
    "<|END_ACTION|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "to=functions.f",
    DS["b"],
    DS["s"],
    DS["cb"],
    "```json\n",
    "```",
    "<function=f>",
    "<parameter=x>",
    "</parameter>",
    "</function>",
    "[f(a=1)]",
    "{",
    "}",
    "[",
    "]",
    '"',
    "\n",
    " ",
    "[f(a=1j)]",
    "[f(a={1, 2})]",
    "[f(a=b'x')]",
    "[f(a={(1, 2): 3})]",
    "[f(a=1e999)]",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "functions.f:0",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    '<｜DSML｜invoke name="f">',
    "<|tool_call>call:f{",
    '<|"|>',
    "<tool_call|>",
    "<|channel>thought",
    "<channel|>",
    "[THINK]",
    "[/THINK]",
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    "<|START_TEXT|>",
    "<minimax:tool_call>",
    '<invoke name="f">',
    '<parameter name="x">',
    "<seed:tool_call>",
    "<TOOLCALL>",
    "<|tools_prefix|>",
    "]<]minimax[>[",
    "<|open|>tools<|sep|>",
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=8)), max_size=14).map(
    "".join
)


@settings(max_examples=150, deadline=None)
@given(
    texts,
    st.sampled_from([f for f in FORMATS if f != "auto"]),
    st.sampled_from([None, True, False]),
    st.booleans(),
)
def test_parse_never_raises(text: str, fmt: str, reasoning: bool | None, think_open: bool) -> None:
    out = parse(text, fmt, reasoning=reasoning, think_open=think_open)
    assert isinstance(out.content, str)
    for c in out.tool_calls:
        assert isinstance(c["args"], dict) and c["name"]


@settings(max_examples=150, deadline=None)
@given(
    texts,
    st.sampled_from([f for f in FORMATS if f != "auto"]),
    st.sampled_from([None, True, False]),
    st.lists(st.integers(1, 60), max_size=8),
)
# counterexamples the search found: a marker cut after its first characters was sent as
# content (the python tag), plain text before a harmony <|message|> taken back as a header
@example("<|python_tag|>print(1)", "functionary_v3_1", None, [2])
@example("Hi <|message|> x", "gpt_oss", None, [3])
def test_stream_parser_never_raises_and_matches_parse(
    text: str, fmt: str, reasoning: bool | None, cuts: list[int]
) -> None:
    _check_stream(fmt, text, [c for c in cuts if c < len(text)], reasoning)


_py_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.complex_numbers(),
        st.text(max_size=5),
        st.binary(max_size=5),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.frozensets(st.integers(), max_size=3),
        st.dictionaries(
            st.one_of(st.text(max_size=3), st.integers(), st.tuples(st.integers())),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.from_regex(r"[a-z]{1,5}", fullmatch=True), _py_values, max_size=3),
    st.booleans(),
)
def test_pythonic_calls_with_any_python_literal_never_raise(args: dict, streamed: bool) -> None:
    """Whatever literal the model writes, the result is a JSON-safe call or an invalid one."""
    text = "[f(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")]"
    if streamed:
        sp = StreamParser("pythonic")
        for i in range(0, len(text), 4):
            sp.feed(text[i : i + 4])
        sp.finish()
        out = sp.result
    else:
        out = parse(text, "pythonic")
    assert len(out.tool_calls) + len(out.invalid_tool_calls) <= 1
    for call in out.tool_calls:
        json.dumps(call["args"], allow_nan=False)  # always plain JSON data


def test_markup_never_leaks_into_content_without_tools() -> None:
    """No tools bound, thinking not asked for (reasoning=False, what prompts.py uses)."""
    cases = {
        "ministral_3": "[THINK]plan[/THINK]Hi",
        "command_r7b": "<|START_THINKING|>plan<|END_THINKING|><|START_RESPONSE|>Hi<|END_RESPONSE|>",
        "cohere2moe": "<|START_THINKING|>plan<|END_THINKING|><|START_TEXT|>Hi<|END_TEXT|>",
        "gemma4": "<|channel>thought\nplan<channel|>Hi",
        "gpt_oss": "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>final<|message|>Hi",
    }
    for fmt, text in cases.items():
        out = parse(text, fmt, reasoning=False)
        assert (out.content, out.reasoning) == ("Hi", "plan"), fmt
        sp = StreamParser(fmt, reasoning=False)
        deltas = [d for ch in text for d in sp.feed(ch)] + sp.finish()
        assert "".join(d.text for d in deltas if d.kind == "content") == "Hi", fmt
