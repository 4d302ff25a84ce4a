"""The differential analysis itself: probe renders, diffs, a :class:`TemplateAnalysis`.

Port of llama.cpp's ``common/chat-diff-analyzer.cpp`` (R1-R3 reasoning, C1
content, T1-T7 tool calls, the workarounds) with the capabilities llama.cpp reads
from its Jinja engine (``jinja/caps.cpp``) probed from renders instead.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from langchain_llamacpp_local.formats.auto.diff import (
    MARKER,
    MARKER_RE,
    DiffSplit,
    calculate_diff_split,
    common_text_prefix_len,
    first_marker,
    last_marker_of,
    last_marker_tail,
    marker_at,
    prune_whitespace_segments,
    segmentize_markers,
    until_common_prefix,
    until_marker,
    wrapped_between,
)
from langchain_llamacpp_local.templates.chat_template import ChatTemplate, ChatTemplateError

logger = logging.getLogger(__name__)

ToolFormat = Literal["none", "json", "tag_json", "tag_tagged"]
ReasoningMode = Literal["none", "tag", "tools_only"]
ContentMode = Literal["plain", "always_wrapped", "wrapped_with_reasoning"]
CallIdPosition = Literal["none", "pre_func_name", "between_func_and_args", "post_args"]

# Sentinels of chat-diff-analyzer.cpp:25-35: chosen so that no two share a
# prefix or suffix, which keeps the character-level diffs exact.
FUN_FIRST = "FFF_FIRST_FUN_F"
FUN_SECOND = "SSS_SECOND_FUN_S"
ARG_FIRST = "AA_ARG_FST_AA"
ARG_SECOND = "BB_ARG_SND_BB"
USER_MSG = "U_USER_MSG Hello END_U"
ASSISTANT_MSG = "A_ASST_MSG I can help END_A"
THINKING_CONTENT = "REASON_PART I am thinking END_R"
TOOL_RESULT = "T_TOOL_RESULT 42 END_T"
CALL_ID_001 = "call00001"
CALL_ID_002 = "call00002"
CALL_ID_999 = "call99999"


# =========================================================================== the analysis


@dataclass(frozen=True)
class TemplateAnalysis:
    """What a chat template teaches its model to write (llama.cpp's ``autoparser``).

    Marker strings keep the whitespace the template renders around them (as in
    llama.cpp); the parser matches them whitespace-tolerantly.
    """

    tool_format: ToolFormat = "none"
    # reasoning (R1-R3)
    reasoning_mode: ReasoningMode = "none"
    reasoning_start: str = ""
    reasoning_end: str = ""
    generation_prompt: str = ""
    prompt_opens_reasoning: bool = False
    # content (C1)
    content_mode: ContentMode = "plain"
    content_start: str = ""
    content_end: str = ""
    # tool-call layout (T1-T3)
    section_start: str = ""
    section_end: str = ""
    per_call_start: str = ""
    per_call_end: str = ""
    call_separator: str = ""
    name_prefix: str = ""
    name_suffix: str = ""
    args_separator: str = ""
    function_close: str = ""
    # arguments (T4-T6)
    arg_encoding: Literal["json", "tagged"] = "json"
    args_start: str = ""
    args_end: str = ""
    arg_name_prefix: str = ""
    arg_name_suffix: str = ""
    arg_value_prefix: str = ""
    arg_value_suffix: str = ""
    arg_separator: str = ""
    # call ids (T7)
    call_id_position: CallIdPosition = "none"
    call_id_prefix: str = ""
    call_id_suffix: str = ""
    # JSON_NATIVE layout
    function_field: str = "function"
    name_field: str = "name"
    args_field: str = "arguments"
    id_field: str = ""
    gen_id_field: str = ""
    fun_name_is_key: bool = False
    tools_array_wrapped: bool = False
    parameter_order: tuple[str, ...] = ()
    openai_wrapper_trigger: bool = False
    # template capabilities (probed)
    supports_tool_calls: bool = False
    supports_parallel_calls: bool = False
    arguments_as_string: bool = False
    content_none_with_calls: bool = False
    tool_role_native: bool = False
    turn_end: str = ""
    preserved_tokens: tuple[str, ...] = ()

    @property
    def trigger(self) -> str:
        """The marker that opens tool calls ('' when calls are bare JSON)."""
        marker = (self.section_start or self.per_call_start).strip()
        if not marker and self.tool_format != "json":
            marker = self.name_prefix.strip()
        return marker

    @property
    def grammar_triggers(self) -> tuple[str, ...]:
        """Words that start a lazy tool-call grammar (chat-auto-parser-generator.cpp:70-94):
        none for bare-JSON formats, which llama.cpp only constrains when a call is required."""
        if self.tool_format == "none" or not self.trigger:
            return ()
        if self.openai_wrapper_trigger:
            return (self.trigger, '{"type": "function",')
        return (self.trigger,)

    @property
    def markers(self) -> tuple[str, ...]:
        """Every non-empty marker (trimmed): held back while half-written in a stream."""
        return self.preserved_tokens

    def opens_reasoning(self, prompt: str) -> bool:
        """Whether a rendered prompt leaves a reasoning block open (thinking prefilled)."""
        return bool(self.reasoning_prefill(prompt))

    def reasoning_prefill(self, prompt: str) -> str:
        """The part of a generation prompt the parser must see before the model's output.

        llama.cpp parses ``generation_prompt + output`` after consuming the prompt up
        to the reasoning start marker (chat.cpp:1459, chat-peg-parser.cpp:869): when
        the prompt opens a reasoning block that it does not close, that block's start
        (and any boilerplate after it, Apriel's "Here are my reasoning steps:") belongs
        to the reasoning.
        """
        start, end = self.reasoning_start.strip(), self.reasoning_end.strip()
        if self.reasoning_mode == "none" or not start or not end:
            return ""
        i = prompt.find(start)
        if i < 0 or end in prompt[i + len(start) :]:
            return ""
        return prompt[i:]


class _Renderer:
    """Renders probe conversations; ``None`` for a probe the template rejects."""

    def __init__(
        self, template: ChatTemplate, args_as_string: bool = False, none_content: bool = False
    ) -> None:
        self.template = template
        self.args_as_string = args_as_string
        self.none_content = none_content
        self._memo: dict[str, str | None] = {}  # the probes repeat: render each once

    def __call__(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        enable_thinking: bool = True,
    ) -> str | None:
        key = json.dumps(
            [messages, tools, add_generation_prompt, enable_thinking], sort_keys=True, default=str
        )
        if key not in self._memo:
            self._memo[key] = self._render(messages, tools, add_generation_prompt, enable_thinking)
        return self._memo[key]

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> str | None:
        msgs = _stringify(messages) if self.args_as_string else messages
        if self.none_content:
            msgs = [
                {**m, "content": None} if m.get("tool_calls") and m.get("content") == "" else m
                for m in msgs
            ]
        try:
            return self.template.render(
                copy.deepcopy(msgs),
                tools=copy.deepcopy(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
            )
        except ChatTemplateError as exc:
            logger.debug("template probe failed: %s", exc)
            return None
        except Exception as exc:  # a template is untrusted code: any failure means "no answer"
            logger.debug("template probe failed: %s: %s", type(exc).__name__, exc)
            return None


def _stringify(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c["function"]
                if not isinstance(fn.get("arguments"), str):
                    c = {
                        **c,
                        "function": {
                            **fn,
                            "arguments": json.dumps(fn["arguments"], ensure_ascii=False),
                        },
                    }
                calls.append(c)
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


@dataclass
class _Compared:
    diff: DiffSplit
    a: str
    b: str


def _compare(render: _Renderer, a: dict[str, Any], b: dict[str, Any]) -> _Compared | None:
    """Render two probe variants (keyword dicts for the renderer) and diff them."""
    out_a, out_b = render(**a), render(**b)
    if out_a is None or out_b is None:
        return None
    return _Compared(calculate_diff_split(out_a, out_b), out_a, out_b)


# Probe data (chat-diff-analyzer.cpp:186-229).
_PARAMS_SCHEMA = {
    "type": "object",
    "properties": {
        ARG_FIRST: {"type": "string", "description": "First argument"},
        ARG_SECOND: {"type": "string", "description": "Second argument"},
    },
    "required": [],
}
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": FUN_FIRST,
            "description": "Test function foo",
            "parameters": _PARAMS_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": FUN_SECOND,
            "description": "Test function bar",
            "parameters": _PARAMS_SCHEMA,
        },
    },
]
_USER = {"role": "user", "content": USER_MSG}


def _call(name: str, args: dict[str, Any], cid: str = CALL_ID_001) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _asst(
    content: str | list[dict[str, Any]] | None = "",
    calls: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = calls
    m.update(extra)
    return m


_CALL_ONE = _call(FUN_FIRST, {ARG_FIRST: "XXXX"})
_CALL_ONE_OTHER_VAL = _call(FUN_FIRST, {ARG_FIRST: "YYYY"})
_CALL_OTHER_ARG = _call(FUN_FIRST, {ARG_SECOND: "YYYY"})
_CALL_FIRST = _call(FUN_FIRST, {ARG_FIRST: "XXXX", ARG_SECOND: "YYYY"})
_CALL_SECOND = _call(FUN_SECOND, {ARG_FIRST: "XXXX", ARG_SECOND: "YYYY"}, CALL_ID_002)
_CALL_FIRST_ALT_ID = _call(FUN_FIRST, {ARG_FIRST: "XXXX", ARG_SECOND: "YYYY"}, CALL_ID_999)


def _with_tools(*msgs: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [_USER, *msgs], "tools": _TOOLS}


@dataclass
class _State:
    """Mutable working copy of the analysis (frozen into TemplateAnalysis at the end)."""

    fields: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        f = self.__dict__["fields"]
        if name in f:
            return f[name]
        return getattr(_DEFAULT, name)

    def set(self, **kw: Any) -> None:
        self.fields.update(kw)


_DEFAULT = TemplateAnalysis()


# --------------------------------------------------------------------------- capabilities


def _probe_caps(template: ChatTemplate) -> tuple[bool, bool, bool, bool, bool]:
    """(supports tool calls, arguments as JSON string, ``content=None`` needed with
    calls, parallel calls, native tool role).

    llama.cpp (jinja/caps.cpp) watches which fields the template reads; here the
    renders are inspected instead: a tool call whose name shows up is supported,
    and dict arguments that come out as a Python ``repr`` (or fail) mean the
    template wants a JSON string.
    """
    tools = [
        {
            "type": "function",
            "function": {"name": n, "description": "d", "parameters": _PARAMS_SCHEMA},
        }
        for n in ("tool_one_x", "tool_two_y")
    ]
    one = [_call("tool_one_x", {"arg_probe": "value_probe"})]
    user = {"role": "user", "content": "User message"}
    supports, as_string, none_content = False, False, False
    for nc in (False, True):
        for stringify in (False, True):
            r = _Renderer(template, stringify, nc)
            cmp = _compare(
                r,
                {"messages": [user, _asst("Plain answer")], "tools": tools},
                {"messages": [user, _asst("", one)], "tools": tools},
            )
            out = cmp.diff.right if cmp is not None else None
            if out is not None and "tool_one_x" in out:
                repr_args = "{'arg_probe'" in out
                if not repr_args or stringify:
                    supports, as_string, none_content = True, stringify, nc
                    break
        if supports:
            break
    if not supports:
        return False, False, False, False, False
    render = _Renderer(template, as_string, none_content)
    two = [
        _call("tool_one_x", {"arg_probe": "value_probe"}),
        _call("tool_two_y", {"arg_probe": "v2"}, CALL_ID_002),
    ]
    cmp = _compare(
        render,
        {"messages": [user, _asst("", one)], "tools": tools},
        {"messages": [user, _asst("", two)], "tools": tools},
    )
    parallel = cmp is not None and "tool_two_y" in cmp.diff.right
    out = render(
        [
            user,
            _asst("", one),
            {"role": "tool", "content": TOOL_RESULT, "tool_call_id": CALL_ID_001},
        ],
        tools,
    )
    native_tool = out is not None and TOOL_RESULT in out
    return supports, as_string, none_content, parallel, native_tool


# --------------------------------------------------------------------------- R1-R3 reasoning


def _reasoning_presence(st: _State, render: _Renderer) -> None:
    """R1: assistant message with vs without ``reasoning_content`` (chat-diff-analyzer.cpp:468)."""
    plain = _asst(ASSISTANT_MSG)
    variants = (
        _asst(ASSISTANT_MSG, reasoning_content=THINKING_CONTENT),
        # Unlike llama.cpp, also the thinking content block some templates read
        # instead (Ministral/Magistral: ``[THINK]...[/THINK]``).
        _asst(
            [
                {"type": "thinking", "thinking": THINKING_CONTENT},
                {"type": "text", "text": ASSISTANT_MSG},
            ]
        ),
    )
    for thought in variants:
        cmp = _compare(render, {"messages": [_USER, plain]}, {"messages": [_USER, thought]})
        if cmp is not None and THINKING_CONTENT in cmp.diff.right:
            break
    else:
        return
    w = wrapped_between(cmp.b, THINKING_CONTENT)
    if w and w[0] and w[1]:
        st.set(reasoning_mode="tag", reasoning_start=w[0], reasoning_end=w[1])
        return
    m = re.search(rf"{re.escape(THINKING_CONTENT)}\s*(?:({MARKER}\s*))?", cmp.b)
    if m and m.group(1):
        st.set(reasoning_mode="tag", reasoning_end=m.group(1))


def _thinking_enabled(st: _State, render: _Renderer) -> None:
    """R2: generation prompt with ``enable_thinking`` false vs true (chat-diff-analyzer.cpp:522)."""
    a = {"messages": [_USER], "add_generation_prompt": True, "enable_thinking": False}
    cmp = _compare(render, a, {**a, "enable_thinking": True})
    if cmp is None:
        return
    d = cmp.diff
    lt, rt = d.left.strip(), d.right.strip()
    if not lt and d.right:
        if rt and cmp.b.endswith(rt) and not st.reasoning_start:
            st.set(reasoning_start=d.right, reasoning_mode="tag")
    elif not rt and d.left:
        if lt and cmp.a.endswith(lt) and not st.reasoning_end:
            seg = prune_whitespace_segments(segmentize_markers(cmp.a))
            if len(seg) >= 2 and seg[-1].value == lt and seg[-2].marker:
                st.set(reasoning_start=seg[-2].value)
            st.set(reasoning_end=d.left, reasoning_mode="tag")
    elif lt and rt:
        # Tail anchoring: one prompt's tail reappears in the other followed by markers.
        for base, ext in ((cmp.b, cmp.a), (cmp.a, cmp.b)):
            n = min(len(base), 64)
            anchor = base[len(base) - n :]
            pos = ext.rfind(anchor)
            if pos < 0 or pos + n >= len(ext):
                continue
            extra = ext[pos + n :].strip()
            if not extra:
                continue
            seg = prune_whitespace_segments(segmentize_markers(extra))
            if len(seg) == 2 and seg[0].marker and seg[1].marker:
                if not st.reasoning_start:
                    st.set(reasoning_start=seg[0].value)
                if not st.reasoning_end:
                    st.set(reasoning_end=seg[1].value)
                st.set(reasoning_mode="tag")
                break
    if st.reasoning_mode == "none" and not st.reasoning_start and st.reasoning_end:
        st.set(reasoning_mode="tag")


def _reasoning_scope(st: _State, render: _Renderer) -> None:
    """R3: reasoning next to content vs next to tool calls: TOOLS_ONLY (chat-diff-analyzer.cpp:607)."""
    with_content = _asst(ASSISTANT_MSG, reasoning_content=THINKING_CONTENT)
    with_tools = _asst(
        None,
        [_call(FUN_FIRST, {ARG_FIRST: "VVVV", ARG_SECOND: "XXXX"})],
        reasoning_content=THINKING_CONTENT,
    )
    cmp = _compare(render, _with_tools(with_content), _with_tools(with_tools))
    if cmp is None:
        return
    if THINKING_CONTENT not in cmp.a and THINKING_CONTENT in cmp.b:
        st.set(reasoning_mode="tools_only")
        m = re.search(rf"({MARKER}\s*){re.escape(THINKING_CONTENT)}\s*({MARKER}\s*)", cmp.b)
        if m:
            st.set(reasoning_start=m.group(1), reasoning_end=m.group(2))
            return
        m = re.search(rf"{re.escape(THINKING_CONTENT)}\s*(?:({MARKER}\s*))?", cmp.b)
        if m:
            st.set(reasoning_end=m.group(1) or "")
        else:
            st.set(reasoning_mode="none")


# --------------------------------------------------------------------------- C1 content


def _content(st: _State, render: _Renderer) -> None:
    """C1: content-only vs tool-call and vs reasoning messages (chat-diff-analyzer.cpp:661)."""
    base = _with_tools(_asst(ASSISTANT_MSG))
    c_tools = _compare(
        render, base, _with_tools(_asst("", [_call("test_func", {"arg1": "value1"})]))
    )
    c_reason = _compare(render, base, _with_tools(_asst("", reasoning_content=THINKING_CONTENT)))
    if c_tools is None or c_reason is None:
        return
    dt, dr = c_tools.diff, c_reason.diff
    plain = False
    if dt.left.strip() == ASSISTANT_MSG:
        # PEG ``space() + literal(dr.left) + ...`` over dr.left: fails only when it starts with whitespace
        if not dr.left[:1].isspace():
            plain = True
        elif st.reasoning_mode != "none" and st.reasoning_end:
            if re.search(rf"{re.escape(st.reasoning_end)}\s*{re.escape(ASSISTANT_MSG)}", dr.left):
                plain = True
    start = end = ""
    if not plain:
        rdiff = dr.left
        if st.reasoning_end and st.reasoning_end in rdiff:
            rdiff = rdiff[rdiff.find(st.reasoning_end) + len(st.reasoning_end) :]
        pure = rdiff if len(rdiff) > len(dt.left) else dt.left
        w = wrapped_between(pure, ASSISTANT_MSG)
        if w:
            start, end = w
    if start or end:
        st.set(content_mode="always_wrapped", content_start=start, content_end=end)


# --------------------------------------------------------------------------- T1-T7 tools


def _in_json(haystack: str, needle: str) -> bool:
    return re.search(rf"[{{:]\s*\"{re.escape(needle)}\"", haystack) is not None


def _tool_calls(st: _State, render: _Renderer, parallel: bool) -> None:
    """T1: no call vs one call; classify JSON_NATIVE / TAG_WITH_JSON / TAG_WITH_TAGGED."""
    cmp = _compare(render, _with_tools(_asst(ASSISTANT_MSG)), _with_tools(_asst("", [_CALL_FIRST])))
    if cmp is None or not cmp.diff.right:
        return
    haystack = cmp.diff.right
    if _in_json(haystack, FUN_FIRST):
        st.set(tool_format="json")
    elif _in_json(haystack, ARG_FIRST):
        st.set(tool_format="tag_json")
    else:
        st.set(tool_format="tag_tagged")
    clean = haystack
    if st.reasoning_start and st.reasoning_start in clean:
        i = clean.find(st.reasoning_start)
        clean = clean[:i] + clean[i + len(st.reasoning_start) :]
    if st.reasoning_end and st.reasoning_end in clean:
        i = clean.find(st.reasoning_end)
        clean = clean[:i] + clean[i + len(st.reasoning_end) :]
    if st.tool_format == "json":
        _json_native(st, clean)
        if parallel:
            _per_call_markers(st, render, json_native=True)
    else:
        _non_json(st, clean)
    st.set(section_end=st.section_end.strip(), per_call_end=st.per_call_end.strip())


def _json_native(st: _State, clean: str) -> None:
    """Field names and section markers of a whole-JSON call (chat-diff-analyzer.cpp:924)."""
    j0, j1 = clean.find("{"), clean.rfind("}")
    if j0 < 0 or j1 < j0:
        st.set(tool_format="none")
        return
    cut = clean[j0 : j1 + 1]
    try:
        obj = json.loads(cut)
    except ValueError:
        try:
            obj, n = json.JSONDecoder().raw_decode(clean, j0)
            cut = clean[j0:n]
            j1 = n - 1
        except ValueError:
            st.set(tool_format="none")
            return
    if not isinstance(obj, dict):
        st.set(tool_format="none")
        return
    f: dict[str, Any] = {}

    def register(prefix: str, key: str, value: Any) -> None:
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, str) and "call0000" in value:
            f["id_field"] = path
        elif isinstance(value, str) and value == FUN_FIRST:
            f["name_field"] = path
        elif ARG_FIRST in json.dumps(value):
            f["args_field"] = path
        elif "id" in key:
            f["gen_id_field"] = path

    for key, value in obj.items():
        if key == FUN_FIRST:
            f.update(fun_name_is_key=True, name_field="", args_field="")
            continue
        if isinstance(value, dict) and ARG_FIRST not in json.dumps(value):
            f["function_field"] = key
            for k2, v2 in value.items():
                register(key, k2, v2)
        register("", key, value)
    m = re.search(r"(\[\s*)" + re.escape(cut) + r"(\s*\])", clean)
    if m:
        f["tools_array_wrapped"] = True
        j0 -= len(m.group(1))
        j1 += len(m.group(2))
    j1 += 1
    st.set(**f)
    located = sorted(
        (clean.find(name), name)
        for name in (st.name_field, st.args_field, st.id_field, st.gen_id_field)
        if name
    )
    section_end = clean[j1:].strip()
    if st.tools_array_wrapped and section_end == "]":
        section_end = ""
    st.set(
        parameter_order=tuple(n for _, n in located),
        section_start=clean[:j0].lstrip(),
        section_end=section_end,
    )


def _fun_marker(clean: str, fun: str) -> tuple[str, str] | None:
    """The tag holding the function name, e.g. ``<function=NAME>\\n``: (whole, prefix)."""
    f = re.escape(fun)
    m = re.search(rf"(<(?:(?!{f})[^>])*){f}(?!\s*<)[^>]*>\s*", clean)
    if m:
        return m.group(0), m.group(1)
    m = re.search(rf"(\[(?:(?!{f})[^\]])*){f}(?!\s*\[[^\]]*\])\s*", clean)
    if m:
        return m.group(0), m.group(1)
    return None


def _non_json(st: _State, clean: str) -> None:
    """Section and per-call markers of a tag format (chat-diff-analyzer.cpp:1009)."""
    found = _fun_marker(clean, FUN_FIRST)
    fun_marker, fun_pre = found if found else (FUN_FIRST, "")
    fm = re.escape(fun_marker)
    sec_start = call_start = call_end = sec_end = ""
    m = re.search(rf"({MARKER}\s*)({MARKER}\s*)(.*?){fm}(.*)\Z", clean, re.S)
    if m:
        sec_start, call_start, rest = m.group(1), m.group(2), m.group(4)
        e = re.search(rf"({MARKER}\s*)({MARKER}\s*)\Z", rest)
        if e:
            call_end, sec_end = e.group(1), e.group(2)
        st.set(name_prefix=fun_pre + st.name_prefix)
    else:
        m = re.search(rf"({MARKER}\s*){fm}(.*)\Z", clean, re.S)
        if m:
            sec_start, rest = m.group(1), m.group(2)
            e = re.search(rf"({MARKER}\s*)\Z", rest)
            if e:
                sec_end = e.group(1)
    st.set(
        per_call_start=call_start,
        per_call_end=call_end,
        section_start=sec_start,
        section_end=sec_end,
    )


def _per_call_markers(st: _State, render: _Renderer, *, json_native: bool = False) -> None:
    """T2: one call vs two; section markers repeated per call become per-call markers.

    A JSON-native format's are repeated when the second call's text holds them at all;
    a tag format's when that text starts with them, and an end marker written once
    whatever the number of calls ends the section instead."""
    cmp = _compare(
        render,
        _with_tools(_asst("", [_CALL_FIRST])),
        _with_tools(_asst("", [_CALL_FIRST, _CALL_SECOND])),
    )
    if cmp is None:
        return
    if json_native:
        repeated = st.section_start in cmp.diff.right
    else:
        second = calculate_diff_split(cmp.diff.suffix, cmp.diff.right).right.lstrip()
        repeated = second.startswith(st.section_start)
    if st.section_start and repeated:
        st.set(
            per_call_start=st.section_start,
            per_call_end=st.section_end,
            section_start="",
            section_end="",
        )
    if st.per_call_end and not json_native:
        one, two = cmp.a.count(st.per_call_end), cmp.b.count(st.per_call_end)
        if one > 0 and one == two:
            st.set(section_end=st.per_call_end, per_call_end="")


def _function_markers(st: _State, render: _Renderer) -> None:
    """T3: FUN_FIRST vs FUN_SECOND: name prefix/suffix and the call closer (chat-diff-analyzer.cpp:1120)."""
    params = _with_tools(_asst("", [_CALL_FIRST]))
    cmp = _compare(render, params, _with_tools(_asst("", [_CALL_SECOND])))
    if cmp is None:
        return
    d = cmp.diff
    if FUN_FIRST not in d.left or FUN_SECOND not in d.right:
        return
    prefix_marker = st.per_call_start or st.section_start
    name_prefix, name_suffix, args_sep, close = st.name_prefix, "", st.args_separator, ""
    if prefix_marker and prefix_marker in d.prefix:
        name_prefix = d.prefix[d.prefix.rfind(prefix_marker) + len(prefix_marker) :]
    i = d.left.find(FUN_FIRST)
    after = i + len(FUN_FIRST)
    name_prefix += d.left[:i]
    name_suffix = d.left[after : until_marker(d.left, after)]
    if st.tool_format == "tag_json":
        s, pos = d.suffix, 0
        while pos < len(s):
            mk = marker_at(s, pos)
            if mk:
                pos = mk.end()
            elif s[pos] not in "{[":
                pos += 1
            else:
                break
        if MARKER_RE.search(s, pos):
            name_suffix += s[:pos]
    else:
        ext = d.suffix[: until_marker(d.suffix)]
        name_suffix += ext
        m = re.search(rf"{MARKER}\s*(?:{ARG_FIRST}|{ARG_SECOND})", d.suffix[len(ext) :])
        if m:
            args_sep = d.suffix[len(ext) :][: m.start()].strip()
    suffix_marker = st.per_call_end or st.section_end
    closer = ""
    if not suffix_marker:
        nt = _compare(render, params, _with_tools(_asst(ASSISTANT_MSG)))
        if nt is not None:
            closer = nt.diff.left[nt.diff.left.find("YYYY") + 4 :]
    else:
        k = d.suffix.find(suffix_marker)
        closer = d.suffix if k < 0 else d.suffix[:k]
    if closer:
        if st.tool_format == "tag_tagged":
            m = re.match(rf"(?s).*?YYYY\s*{MARKER}\s*(.*)\Z", closer)
            if m:
                close = m.group(1)
        elif st.tool_format == "tag_json" and "YYYY" in closer:
            post = closer[closer.find("YYYY") + 4 :]
            pos = max(post.rfind("}"), post.rfind("]"))
            if 0 <= pos < len(post) - 1:
                close = post[pos + 1 :].lstrip()
    st.set(
        name_prefix=name_prefix,
        name_suffix=name_suffix,
        args_separator=args_sep,
        function_close=close.lstrip(),
    )


def _argument_names(st: _State, render: _Renderer) -> None:
    """A1: ARG_FIRST vs ARG_SECOND: the tag around an argument name (chat-diff-analyzer.cpp:1270)."""
    cmp = _compare(
        render, _with_tools(_asst("", [_CALL_ONE])), _with_tools(_asst("", [_CALL_OTHER_ARG]))
    )
    if cmp is None:
        return
    d = cmp.diff
    if not d.left or not d.right:
        return
    lm = re.match(rf"(?s)(.*?){ARG_FIRST}([^\"X]*)", d.left)
    rm = re.match(rf"(?s)(.*?){ARG_SECOND}([^\"Y]*)", d.right)
    if lm and rm and lm.group(1) and lm.group(1) == rm.group(1) and lm.group(2) == rm.group(2):
        st.set(arg_name_prefix=lm.group(1), arg_name_suffix=lm.group(2))
    elif d.left.startswith(ARG_FIRST) and d.right.startswith(ARG_SECOND):
        tail = last_marker_tail(d.prefix)
        st.set(arg_name_prefix=tail if tail is not None else d.prefix)
        after_first = d.left[len(ARG_FIRST) :] + d.suffix
        m = re.match(rf"(?s)((?:(?!{MARKER}).)*{MARKER}\s*)", after_first)
        if m:
            st.set(arg_name_suffix=m.group(1))


def _argument_values(st: _State, render: _Renderer) -> None:
    """A2: value XXXX vs YYYY: the tags around an argument value (chat-diff-analyzer.cpp:1327)."""
    cmp = _compare(
        render, _with_tools(_asst("", [_CALL_ONE])), _with_tools(_asst("", [_CALL_ONE_OTHER_VAL]))
    )
    if cmp is None:
        return
    d = cmp.diff
    if d.left != "XXXX" or d.right != "YYYY":
        return
    ending = ARG_FIRST + st.arg_name_suffix
    prefix = d.prefix
    if ending in prefix:
        prefix = prefix[prefix.rfind(ending) + len(ending) :]
    if prefix:
        tail = last_marker_tail(prefix)
        st.set(arg_value_prefix=tail if tail is not None else prefix)
    value_suffix = d.suffix
    end_marker = st.function_close or st.per_call_end or st.section_end
    if end_marker and end_marker in value_suffix:
        value_suffix = value_suffix[: value_suffix.find(end_marker)]
    if value_suffix.strip():
        st.set(arg_value_suffix=value_suffix)


def _argument_separator(st: _State, render: _Renderer) -> None:
    """T5: one argument vs two (chat-diff-analyzer.cpp:1387); the sentinels share no
    prefix, so like llama.cpp this finds no separator and whitespace is tolerated."""
    cmp = _compare(
        render, _with_tools(_asst("", [_CALL_ONE])), _with_tools(_asst("", [_CALL_FIRST]))
    )
    if cmp is not None and cmp.diff.right:
        st.set(arg_separator=until_common_prefix(cmp.diff.right, ARG_FIRST, ARG_SECOND))


def _call_ids(st: _State, render: _Renderer) -> None:
    """T7: call00001 vs call99999: where the call id goes (chat-diff-analyzer.cpp:1473)."""
    cmp = _compare(
        render, _with_tools(_asst("", [_CALL_FIRST])), _with_tools(_asst("", [_CALL_FIRST_ALT_ID]))
    )
    if cmp is None:
        return
    d = cmp.diff
    if not d.left and not d.right:
        return
    common_id = CALL_ID_001[: common_text_prefix_len(CALL_ID_001, CALL_ID_999)]
    # Unlike llama.cpp, ignore the tool definitions before the user message: they
    # hold the function name too and would hide a call id written before the name.
    u = d.prefix.rfind(USER_MSG)
    in_prefix, in_suffix = d.prefix.rfind(FUN_FIRST, max(u, 0)), d.suffix.find(FUN_FIRST)
    pos: CallIdPosition = "none"
    id_prefix = id_suffix = ""
    if in_prefix >= 0 and in_suffix < 0:
        args_in_prefix = d.prefix.find("{", in_prefix)
        args_in_suffix = d.suffix.find("{")
        if args_in_suffix >= 0 and args_in_prefix < 0:
            pos = "between_func_and_args"
            after_func = d.prefix[in_prefix + len(FUN_FIRST) :]
            m = re.search(
                rf"({MARKER})(?:(?!{MARKER})(?!{re.escape(common_id)}).)*{re.escape(common_id)}",
                after_func,
                re.S,
            )
            id_prefix = m.group(1) if m else last_marker_of(after_func)
            m = re.match(rf"(?s)(?:(?!{MARKER})[^{{])*({MARKER})", d.suffix)
            if m:
                id_suffix = m.group(1)
        elif args_in_prefix >= 0:
            pos = "post_args"
            after_args = d.prefix[args_in_prefix:]
            brace = after_args.rfind("}")
            if brace >= 0:
                id_prefix = last_marker_of(after_args[brace + 1 :])
            id_suffix = first_marker(d.suffix)
    elif in_suffix >= 0 and in_prefix < 0:
        pos = "pre_func_name"
        id_prefix = last_marker_of(d.prefix)
        id_suffix = first_marker(d.suffix[:in_suffix])
    if id_prefix == st.args_end:
        id_prefix = ""
    if id_suffix == st.args_start:
        id_suffix = ""
    st.set(call_id_position=pos, call_id_prefix=id_prefix, call_id_suffix=id_suffix)
    if (
        pos == "pre_func_name"
        and id_suffix
        and common_id in st.name_prefix
        and id_suffix in st.name_prefix
    ):
        # T3 saw the id's tail as part of the name prefix: keep what follows the id
        st.set(name_prefix=st.name_prefix[st.name_prefix.rfind(id_suffix) + len(id_suffix) :])
    if pos != "none" and id_suffix and st.per_call_end.startswith(id_suffix):
        st.set(per_call_end="")


def _call_separator(st: _State, render: _Renderer) -> None:
    """What the template writes between two consecutive calls (after per-call end)."""
    end, start = st.per_call_end.strip(), st.per_call_start.strip()
    if not end or not start:
        return
    out = render(**_with_tools(_asst("", [_CALL_FIRST, _CALL_SECOND])))
    if out is None:
        return
    i = out.find(FUN_SECOND)
    j = out.rfind(start, 0, i)
    k = out.rfind(end, 0, j)
    if i >= 0 and j >= 0 and k >= 0:
        st.set(call_separator=out[k + len(end) : j])


# --------------------------------------------------------------------------- workarounds


def _workarounds(st: _State, src: str) -> None:
    """Post-hoc patches for templates the diffs misread (chat-diff-analyzer.cpp:37-182)."""
    if (
        "content.split('</think>')" in src
        and "reasoning_content" not in src
        and "<SPECIAL_12>" not in src
        and st.reasoning_mode == "none"
    ):
        st.set(reasoning_mode="tag", reasoning_start="<think>", reasoning_end="</think>")
    if (
        "Write your thoughts between <think></think> and write your response between <response></response>"
        in src
    ):
        st.set(
            reasoning_mode="tag",
            reasoning_start="<think>",
            reasoning_end="</think>",
            content_mode="wrapped_with_reasoning",
            content_start="<response>",
            content_end="</response>",
        )
    if "<|CHATBOT_TOKEN|>" in src and "<|END_OF_TURN_TOKEN|>" in src and not st.content_start:
        st.set(
            content_mode="always_wrapped",
            content_start="<|CHATBOT_TOKEN|>",
            content_end="<|END_OF_TURN_TOKEN|>",
        )
    if (
        'set has_code_interpreter = tools | selectattr("type", "equalto", "code_interpreter") | list | length > 0'
        in src
    ):
        st.set(
            content_mode="plain",
            content_end="",
            name_prefix="",
            section_start="",
            section_end="",
            per_call_start="<function=",
            per_call_end="</function>",
            function_close="",
        )
    if (
        "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'"
        in src
    ):
        st.set(
            section_start="<｜tool▁calls▁begin｜>",
            section_end="<｜tool▁calls▁end｜>",
            per_call_start="<｜tool▁call▁begin｜>function",
            name_prefix="<｜tool▁sep｜>",
            per_call_end="<｜tool▁call▁end｜>",
            function_close="```",
        )
    if all(t in src for t in ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOL_RESPONSE>")):
        st.set(
            tool_format="json",
            section_start="",
            section_end="",
            per_call_start="<TOOLCALL>",
            per_call_end="</TOOLCALL>",
            tools_array_wrapped=True,
            content_mode="plain",
            content_start="",
            content_end="",
            reasoning_mode="tag",
            reasoning_start="<think>\n",
            reasoning_end="</think>",
        )
    if 'Respond in the format {"name": function name' in src and "Do not use variables." in src:
        st.set(openai_wrapper_trigger=True)
    if "laguna_glm_thinking" in src:
        st.set(
            reasoning_start=st.reasoning_start.strip(),
            reasoning_end=st.reasoning_end.strip(),
            arg_value_prefix=st.arg_value_prefix.strip(),
            arg_value_suffix=st.arg_value_suffix.strip(),
            arg_separator=st.arg_separator.strip(),
        )
    if "Bailing V3 chat template" in src:
        st.set(arg_value_suffix=st.arg_value_suffix.strip())


def _preserved(st: _State) -> tuple[str, ...]:
    out: list[str] = []
    for name in (
        "reasoning_start",
        "reasoning_end",
        "content_start",
        "content_end",
        "section_start",
        "section_end",
        "per_call_start",
        "per_call_end",
        "name_prefix",
        "name_suffix",
        "args_separator",
        "function_close",
        "args_start",
        "args_end",
        "arg_name_prefix",
        "arg_name_suffix",
        "arg_separator",
        "arg_value_prefix",
        "arg_value_suffix",
        "call_id_prefix",
        "call_id_suffix",
    ):
        tok = getattr(st, name).strip()
        if tok and tok not in out:
            out.append(tok)
    return tuple(out)


def _turn_end(st: _State, render: _Renderer) -> None:
    """The marker that ends an assistant turn (``<|im_end|>``...): generation normally
    stops on it, but a model that spells it out must not leave it in the content."""
    out = render(messages=[_USER, _asst(ASSISTANT_MSG)])
    if out is None or ASSISTANT_MSG not in out:
        return
    after = out[out.rfind(ASSISTANT_MSG) + len(ASSISTANT_MSG) :]
    for seg in segmentize_markers(after):
        if seg.value.strip():
            if seg.marker and seg.value not in (st.content_end.strip(), st.reasoning_end.strip()):
                st.set(turn_end=seg.value)
            return


def _generation_prompt(render: _Renderer) -> str:
    a = {"messages": [_USER], "add_generation_prompt": False}
    cmp = _compare(render, a, {**a, "add_generation_prompt": True})
    return cmp.diff.right if cmp is not None else ""


def analyze_template_full(
    source: str | ChatTemplate, *, bos_token: str = "", eos_token: str = ""
) -> TemplateAnalysis:
    """Run every comparison; ``tool_format == "none"`` when no tool calls were found.

    ``source`` is the template text or an already compiled ``ChatTemplate`` (its
    own BOS/EOS are used then; compiling costs more than the analysis). Raises
    :class:`~langchain_llamacpp_local.templates.chat_template.ChatTemplateError` only when the
    template does not compile; render failures just skip that probe.
    """
    if isinstance(source, ChatTemplate):
        template = source
        source = template.source
    else:
        template = ChatTemplate(source, origin="analysis", bos_token=bos_token, eos_token=eos_token)
    supports, as_string, none_content, parallel, native_tool = _probe_caps(template)
    render = _Renderer(template, as_string, none_content)
    st = _State()
    st.set(
        supports_tool_calls=supports,
        arguments_as_string=as_string,
        content_none_with_calls=none_content,
        supports_parallel_calls=parallel,
        tool_role_native=native_tool,
    )
    _reasoning_presence(st, render)
    _thinking_enabled(st, render)
    if supports:
        _reasoning_scope(st, render)
    _content(st, render)
    if supports:
        _tool_calls(st, render, parallel)
        if st.tool_format not in ("none", "json"):
            if parallel:
                _per_call_markers(st, render)
            _function_markers(st, render)
            if st.tool_format == "tag_tagged":
                _argument_names(st, render)
                _argument_values(st, render)
            _argument_separator(st, render)
            _call_ids(st, render)
        if st.tool_format != "none":
            _call_separator(st, render)
    _turn_end(st, render)
    _workarounds(st, source)
    prompt = _generation_prompt(render)
    fields = dict(st.fields)
    fields["arg_encoding"] = "tagged" if st.tool_format == "tag_tagged" else "json"
    fields["preserved_tokens"] = _preserved(st)
    fields["generation_prompt"] = prompt
    result = TemplateAnalysis(**fields)
    return replace(result, prompt_opens_reasoning=result.opens_reasoning(prompt))


@functools.lru_cache(maxsize=16)
def analyze_template(
    source: str | ChatTemplate, *, bos_token: str = "", eos_token: str = ""
) -> TemplateAnalysis | None:
    """The tool-call format a template teaches, learned from its renders; ``None``
    when the template shows no tool calls (or does not compile). Cached: a few
    dozen renders per template, done once per loaded model."""
    try:
        result = analyze_template_full(source, bos_token=bos_token, eos_token=eos_token)
    except ChatTemplateError as exc:
        logger.debug("template analysis skipped: %s", exc)
        return None
    return result if result.tool_format != "none" else None
