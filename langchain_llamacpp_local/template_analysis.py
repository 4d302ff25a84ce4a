"""Learn a chat template's reasoning and tool-call syntax by rendering it.

A Python port of llama.cpp's differential "auto-parser" analysis
(``common/chat-diff-analyzer.cpp``, ``chat-auto-parser-helpers.cpp``,
``chat-auto-parser-generator.cpp``; see ``docs/template-analysis.md``). The
template is rendered with pairs of synthetic conversations that differ in one
thing (a sentinel tool name, argument name or value, call id, reasoning or
content); the differences between the two renders are the markers around that
thing. From them :func:`analyze_template` builds a frozen
:class:`TemplateAnalysis` (reasoning markers R1-R3, content wrappers C1, the
tool-call layout T1-T7), and :func:`parse_with_analysis` splits model output
with it, so a model whose template no hand-written parser knows still gets its
tool calls parsed.

Everything here is pure (no model): rendering goes through
``templates.ChatTemplate`` and a template that fails to render a probe simply
teaches nothing from that probe, as in llama.cpp. Parsing never raises on model
output: malformed calls come back with an ``error`` and their raw text.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from langchain_llamacpp_local.templates import ChatTemplate, ChatTemplateError

__all__ = [
    "AnalysisCall",
    "AnalysisParse",
    "DiffSplit",
    "TemplateAnalysis",
    "after_common_suffix",
    "analyze_template",
    "calculate_diff_split",
    "parse_with_analysis",
    "segmentize_markers",
    "until_common_prefix",
]

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
USER_MSG_TWO = "V_USER_MSG Hello END_V"
ASSISTANT_MSG = "A_ASST_MSG I can help END_A"
THINKING_CONTENT = "REASON_PART I am thinking END_R"
TOOL_RESULT = "T_TOOL_RESULT 42 END_T"
CALL_ID_001 = "call00001"
CALL_ID_002 = "call00002"
CALL_ID_999 = "call99999"


# =========================================================================== diff helpers


@dataclass(frozen=True)
class Segment:
    """A piece of rendered text: a ``<...>``/``[...]`` marker or plain text."""

    marker: bool
    value: str


def segmentize_markers(text: str) -> list[Segment]:
    """Split text into markers (``<...>``, ``[...]``) and the text between them."""
    out: list[Segment] = []
    in_marker = False
    opener = ""
    last = 0
    for pos, ch in enumerate(text):
        if not in_marker and ch in "<[":
            if last < pos:
                out.append(Segment(False, text[last:pos]))
            last = pos
            in_marker = True
            opener = ch
        elif in_marker and ((opener == "<" and ch == ">") or (opener == "[" and ch == "]")):
            out.append(Segment(True, text[last : pos + 1]))
            last = pos + 1
            in_marker = False
    if last < len(text):
        out.append(Segment(False, text[last:]))
    return out


def _prune_whitespace_segments(segments: list[Segment]) -> list[Segment]:
    return [s for s in segments if s.value.strip()]


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _common_suffix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(reversed(a), reversed(b), strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class DiffSplit:
    """Two texts as ``prefix + left + suffix`` and ``prefix + right + suffix``."""

    prefix: str = ""
    suffix: str = ""
    left: str = ""
    right: str = ""


def calculate_diff_split(left: str, right: str) -> DiffSplit:
    """Common prefix/suffix and the differing middles, never cutting a marker in two.

    A faithful port of ``calculate_diff_split`` (chat-auto-parser-helpers.cpp:87):
    markers are compared whole, plain text character by character.
    """
    ls, rs = segmentize_markers(left), segmentize_markers(right)
    if not ls:
        return DiffSplit(right=right)
    if not rs:
        return DiffSplit(left=left)
    prefix, suffix = "", ""
    l0, l1, r0, r1 = 0, len(ls) - 1, 0, len(rs) - 1
    l_done = r_done = False
    while l0 != l1 and r0 != r1:
        advanced = False
        if ls[l0] == rs[r0]:
            prefix += ls[l0].value
            l0 += 1
            r0 += 1
            advanced = True
        if ls[l1] == rs[r1]:
            suffix = ls[l1].value + suffix
            if l0 != l1:
                l1 -= 1
            else:
                l_done = True
            if r0 != r1:
                r1 -= 1
            else:
                r_done = True
            advanced = True
        if not advanced:
            break
    if l0 == l1 and r0 != r1:
        if ls[l0] == rs[r1]:
            suffix = rs[r1].value + suffix
            r1 -= 1
            l_done = True
        elif ls[l0] == rs[r0]:
            prefix += rs[r0].value
            r0 += 1
            l_done = True
    elif r0 == r1 and l0 != l1:
        if ls[l1] == rs[r0]:
            suffix = ls[l1].value + suffix
            l1 -= 1
            r_done = True
        elif ls[l0] == rs[r0]:
            prefix += ls[l0].value
            l0 += 1
            r_done = True
    elif l0 == l1 and r0 == r1 and ls[l0] == rs[r0] and ls[l0].marker:
        prefix += rs[r0].value
        l_done = r_done = True

    text_suffix_ok = not ls[l1].marker and not rs[r1].marker
    text_prefix_ok = not rs[r0].marker and not ls[l0].marker
    rem_l = "".join(s.value for s in ls[l0 : (l1 if l_done else l1 + 1)])
    rem_r = "".join(s.value for s in rs[r0 : (r1 if r_done else r1 + 1)])
    suf_len = _common_suffix_len(rem_l, rem_r) if text_suffix_ok else 0
    pre_len = (
        _common_prefix_len(rem_l[: len(rem_l) - suf_len], rem_r[: len(rem_r) - suf_len])
        if text_prefix_ok
        else 0
    )
    prefix += rem_l[:pre_len]
    suffix = rem_l[len(rem_l) - suf_len :] + suffix
    d_left = rem_l[pre_len : len(rem_l) - suf_len]
    d_right = rem_r[pre_len : len(rem_r) - suf_len]
    if not d_left and not d_right:
        return DiffSplit(prefix=left)
    if not d_left and d_right and right.startswith(left):
        return DiffSplit(prefix=left, right=right[len(left) :])
    return DiffSplit(prefix, suffix, d_left, d_right)


def until_common_prefix(full: str, left: str, right: str) -> str:
    """``full`` up to the first occurrence of the common prefix of ``left`` and ``right``."""
    n = _common_prefix_len(left, right)
    if n == 0:
        return ""
    pos = full.find(left[:n])
    return "" if pos < 0 else full[:pos]


def after_common_suffix(full: str, left: str, right: str) -> str:
    """``full`` after the last occurrence of the common suffix of ``left`` and ``right``."""
    n = _common_suffix_len(left, right)
    if n == 0:
        return ""
    common = left[len(left) - n :]
    pos = full.rfind(common)
    return "" if pos < 0 else full[pos + n :]


# --------------------------------------------------------------------------- PEG stand-ins
# llama.cpp matches these shapes with small PEG parsers; plain regexes suffice
# because every repetition there is possessive and markers are unambiguous.

_MARKER = r"(?:<[^>]*>|\[[^\]]*\])"
_MARKER_RE = re.compile(_MARKER)


def _marker_at(text: str, pos: int) -> re.Match[str] | None:
    return _MARKER_RE.match(text, pos)


def _until_marker(text: str, start: int = 0) -> int:
    """Index of the first complete marker at or after ``start`` (len(text) if none)."""
    m = _MARKER_RE.search(text, start)
    return m.start() if m else len(text)


def _last_marker_tail(text: str) -> str | None:
    """The last marker of ``text`` and everything after it (llama.cpp's ``last_marker``)."""
    last = None
    for m in _MARKER_RE.finditer(text):
        last = m
    return text[last.start() :] if last else None


def _last_marker(text: str) -> str:
    last = None
    for m in _MARKER_RE.finditer(text):
        last = m
    return last.group(0) if last else ""


def _first_marker(text: str) -> str:
    m = _MARKER_RE.search(text)
    return m.group(0) if m else ""


def _wrapped(text: str, needle: str) -> tuple[str, str] | None:
    """``marker + space + needle + space + marker + space`` anywhere: (pre, post)."""
    m = re.search(rf"({_MARKER}\s*){re.escape(needle)}(\s*{_MARKER}\s*)", text)
    return (m.group(1), m.group(2)) if m else None


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
    content: str | None = "", calls: list[dict[str, Any]] | None = None, **extra: Any
) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = calls
    m.update(extra)
    return m


_CALL_ZERO = _call(FUN_FIRST, {})
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
    thought = _asst(ASSISTANT_MSG, reasoning_content=THINKING_CONTENT)
    cmp = _compare(render, {"messages": [_USER, plain]}, {"messages": [_USER, thought]})
    if cmp is None or THINKING_CONTENT not in cmp.diff.right:
        return
    w = _wrapped(cmp.b, THINKING_CONTENT)
    if w and w[0] and w[1]:
        st.set(reasoning_mode="tag", reasoning_start=w[0], reasoning_end=w[1])
        return
    m = re.search(rf"{re.escape(THINKING_CONTENT)}\s*(?:({_MARKER}\s*))?", cmp.b)
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
            seg = _prune_whitespace_segments(segmentize_markers(cmp.a))
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
            seg = _prune_whitespace_segments(segmentize_markers(extra))
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
        m = re.search(rf"({_MARKER}\s*){re.escape(THINKING_CONTENT)}\s*({_MARKER}\s*)", cmp.b)
        if m:
            st.set(reasoning_start=m.group(1), reasoning_end=m.group(2))
            return
        m = re.search(rf"{re.escape(THINKING_CONTENT)}\s*(?:({_MARKER}\s*))?", cmp.b)
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
        w = _wrapped(pure, ASSISTANT_MSG)
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
            _json_native_parallel(st, render)
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


def _json_native_parallel(st: _State, render: _Renderer) -> None:
    cmp = _compare(
        render,
        _with_tools(_asst("", [_CALL_FIRST])),
        _with_tools(_asst("", [_CALL_FIRST, _CALL_SECOND])),
    )
    if cmp is None:
        return
    if st.section_start and st.section_start in cmp.diff.right:
        st.set(
            per_call_start=st.section_start,
            per_call_end=st.section_end,
            section_start="",
            section_end="",
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
    m = re.search(rf"({_MARKER}\s*)({_MARKER}\s*)(.*?){fm}(.*)\Z", clean, re.S)
    if m:
        sec_start, call_start, rest = m.group(1), m.group(2), m.group(4)
        e = re.search(rf"({_MARKER}\s*)({_MARKER}\s*)\Z", rest)
        if e:
            call_end, sec_end = e.group(1), e.group(2)
        st.set(name_prefix=fun_pre + st.name_prefix)
    else:
        m = re.search(rf"({_MARKER}\s*){fm}(.*)\Z", clean, re.S)
        if m:
            sec_start, rest = m.group(1), m.group(2)
            e = re.search(rf"({_MARKER}\s*)\Z", rest)
            if e:
                sec_end = e.group(1)
    st.set(
        per_call_start=call_start,
        per_call_end=call_end,
        section_start=sec_start,
        section_end=sec_end,
    )


def _per_call_markers(st: _State, render: _Renderer) -> None:
    """T2: one call vs two; section markers repeated per call become per-call markers."""
    cmp = _compare(
        render,
        _with_tools(_asst("", [_CALL_FIRST])),
        _with_tools(_asst("", [_CALL_FIRST, _CALL_SECOND])),
    )
    if cmp is None:
        return
    second = calculate_diff_split(cmp.diff.suffix, cmp.diff.right).right.lstrip()
    if st.section_start and second.startswith(st.section_start):
        st.set(
            per_call_start=st.section_start,
            per_call_end=st.section_end,
            section_start="",
            section_end="",
        )
    if st.per_call_end:
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
    name_suffix = d.left[after : _until_marker(d.left, after)]
    if st.tool_format == "tag_json":
        s, pos = d.suffix, 0
        while pos < len(s):
            mk = _marker_at(s, pos)
            if mk:
                pos = mk.end()
            elif s[pos] not in "{[":
                pos += 1
            else:
                break
        if _MARKER_RE.search(s, pos):
            name_suffix += s[:pos]
    else:
        ext = d.suffix[: _until_marker(d.suffix)]
        name_suffix += ext
        m = re.search(rf"{_MARKER}\s*(?:{ARG_FIRST}|{ARG_SECOND})", d.suffix[len(ext) :])
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
            m = re.match(rf"(?s).*?YYYY\s*{_MARKER}\s*(.*)\Z", closer)
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
        tail = _last_marker_tail(d.prefix)
        st.set(arg_name_prefix=tail if tail is not None else d.prefix)
        after_first = d.left[len(ARG_FIRST) :] + d.suffix
        m = re.match(rf"(?s)((?:(?!{_MARKER}).)*{_MARKER}\s*)", after_first)
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
        tail = _last_marker_tail(prefix)
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
    common_id = CALL_ID_001[: _common_prefix_len(CALL_ID_001, CALL_ID_999)]
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
                rf"({_MARKER})(?:(?!{_MARKER})(?!{re.escape(common_id)}).)*{re.escape(common_id)}",
                after_func,
                re.S,
            )
            id_prefix = m.group(1) if m else _last_marker(after_func)
            m = re.match(rf"(?s)(?:(?!{_MARKER})[^{{])*({_MARKER})", d.suffix)
            if m:
                id_suffix = m.group(1)
        elif args_in_prefix >= 0:
            pos = "post_args"
            after_args = d.prefix[args_in_prefix:]
            brace = after_args.rfind("}")
            if brace >= 0:
                id_prefix = _last_marker(after_args[brace + 1 :])
            id_suffix = _first_marker(d.suffix)
    elif in_suffix >= 0 and in_prefix < 0:
        pos = "pre_func_name"
        id_prefix = _last_marker(d.prefix)
        id_suffix = _first_marker(d.suffix[:in_suffix])
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
    :class:`~langchain_llamacpp_local.templates.ChatTemplateError` only when the
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


# =========================================================================== the parser


@dataclass
class AnalysisCall:
    """One parsed call; field names match ``tool_parsers._Call``."""

    name: str | None
    args: dict[str, Any] | None
    raw: str
    id: str | None = None
    error: str | None = None
    complete: bool = True


@dataclass
class AnalysisParse:
    """A generation (or the stream so far) split with a :class:`TemplateAnalysis`.

    ``held``/``reasoning_held``: trailing characters of ``content``/``reasoning``
    that may be a half-written marker and must not be streamed yet. ``settled``
    is False while the tail is an unfinished call or reasoning block.
    """

    content: str
    reasoning: str | None = None
    calls: list[AnalysisCall] = field(default_factory=list)
    held: int = 0
    reasoning_held: int = 0
    settled: bool = True


def _flex(marker: str) -> str:
    """Regex for a marker, tolerant of whitespace and of a changing number (``:0``, ``:1``)."""
    core = marker.strip()
    if not core:
        return ""
    parts = re.split(r'(\s+|\d+|="[^"<>]*")', core)
    out = []
    for p in parts:
        if not p:
            continue
        if p.isspace():
            out.append(r"\s*")
        elif p.isdigit():
            out.append(r"\d+")
        elif p.startswith('="'):
            out.append(r'="[^"<>]*"')  # an attribute value (DSML's string="true"/"false")
        else:
            out.append(re.escape(p))
    return "".join(out)


def _held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that could start one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


def _schema_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Tool name → {parameter → JSON schema} (accepts OpenAI tool dicts or bare functions)."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _may_be_string(schema: Any) -> bool:
    if not isinstance(schema, Mapping):
        return False
    t = schema.get("type")
    if t == "string" or (isinstance(t, list) and "string" in t):
        return True
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return True
    for key in ("anyOf", "oneOf"):
        if any(_may_be_string(s) for s in schema.get(key) or ()):
            return True
    return False


_PY_LITERALS = {"True": True, "False": False, "None": None}


def _typed_value(text: str, schema: Any, has_schema: bool) -> Any:
    """A tagged argument value: verbatim for string parameters, else JSON (or the text)."""
    if has_schema and _may_be_string(schema):
        t = schema.get("type") if isinstance(schema, Mapping) else None
        if t == "string" or t is None:
            return text
        try:  # a union including string: a valid non-string JSON value wins
            val = json.loads(text)
        except ValueError:
            return text
        return val if not isinstance(val, str) else text
    s = text.strip()
    try:
        return json.loads(s)
    except ValueError:
        pass
    if s in _PY_LITERALS:
        return _PY_LITERALS[s]
    return text


def _args_obj(value: Any) -> dict[str, Any] | None:
    if isinstance(value, dict):
        return value
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            decoded = json.loads(value) if value.strip() else {}
        except ValueError:
            return None
        return decoded if isinstance(decoded, dict) else None
    return None


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split(".") if path else ():
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


class _Incomplete(Exception):
    """The text ends inside a call (streaming): hold it back."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self.name = name


class _Malformed(Exception):
    """The call does not follow the template's syntax."""


class _CallScanner:
    """Reads the calls of one tool region with the analysis' markers."""

    def __init__(
        self, a: TemplateAnalysis, text: str, final: bool, tools: Sequence[Mapping[str, Any]] | None
    ):
        self.a = a
        self.text = text
        self.final = final
        self.schemas = _schema_types(tools)
        self.names = sorted(self.schemas, key=len, reverse=True)

    # ---- low-level matching
    def _ws(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos].isspace():
            pos += 1
        return pos

    def _at(self, pos: int, marker: str) -> int | None:
        """End of ``marker`` at ``pos`` (after whitespace); None if absent; raises
        _Incomplete when the text ends inside it (streaming)."""
        pat = _flex(marker)
        if not pat:
            return pos
        p = self._ws(pos)
        m = re.compile(pat).match(self.text, p)
        if m:
            return m.end()
        rest = self.text[p:]
        if not self.final and (not rest or marker.strip().startswith(rest[: len(marker.strip())])):
            if len(rest) < len(marker.strip()):
                raise _Incomplete()
        return None

    def _need(self, pos: int, marker: str, what: str, name: str | None = None) -> int:
        try:
            end = self._at(pos, marker)
        except _Incomplete:
            raise _Incomplete(name) from None
        if end is None:
            if not self.final and self._ws(pos) >= len(self.text):
                raise _Incomplete(name)
            raise _Malformed(f"expected {marker.strip()!r} {what}")
        return end

    def _find(self, pos: int, marker: str) -> re.Match[str] | None:
        pat = _flex(marker)
        return re.compile(pat).search(self.text, pos) if pat else None

    # ---- one call
    def _name_end(self) -> str:
        """Regex for what ends a function name: the name suffix, or a call id that
        the template writes between name and arguments (Mistral's ``[CALL_ID]``)."""
        a = self.a
        alts = [p for p in (_flex(a.name_suffix),) if p]
        if a.call_id_position == "between_func_and_args" and a.call_id_prefix.strip():
            alts.append(_flex(a.call_id_prefix))
        return "|".join(f"(?:{p})" for p in alts)

    def name(self, pos: int) -> tuple[str, int, str | None]:
        """(function name, position after it and its suffix, call id written next to it)."""
        a = self.a
        pos = self._need(pos, a.name_prefix, "before the function name")
        pos = self._ws(pos) if not a.name_prefix.strip() else pos
        ender = self._name_end()
        name: str | None = None
        for n in self.names:
            if self.text.startswith(n, pos):
                end = pos + len(n)
                if end >= len(self.text) and not self.final:
                    raise _Incomplete(None)  # a longer name may follow
                if end < len(self.text) and re.match(r"[\w.\-:/]", self.text[end]):
                    continue  # only the start of a longer name
                if not ender:
                    return n, end, None
                if re.compile(ender).match(self.text, self._ws(end)):
                    name, pos = n, self._ws(end)
                    break
                if not self.final and len(self.text) - end <= len(a.name_suffix.strip()):
                    raise _Incomplete(None)
        if name is None:
            if ender:
                m = re.compile(r"([^\s<>\[\]{}\"',()]+?)\s*(?=" + ender + ")").match(self.text, pos)
                if m:
                    name, pos = m.group(1), m.end()
                elif not self.final and re.fullmatch(
                    r"[^\s<>\[\]{}\"',()]*\s*\S{0,64}", self.text[pos:]
                ):
                    raise _Incomplete(None)
                else:
                    raise _Malformed("cannot read the function name")
            else:
                m = re.compile(r"[^\s<>\[\]{}\"',()]+").match(self.text, pos)
                if not m:
                    if not self.final and pos >= len(self.text):
                        raise _Incomplete(None)
                    raise _Malformed("cannot read the function name")
                if not self.final and m.end() >= len(self.text):
                    raise _Incomplete(None)
                return m.group(0), m.end(), None
        cid = None
        if a.call_id_position == "between_func_and_args" and a.call_id_prefix.strip():
            m = re.compile(_flex(a.call_id_prefix)).match(self.text, pos)
            if m:
                stop = a.call_id_suffix if a.call_id_suffix.strip() else a.args_start
                e = self._find(m.end(), stop) if stop.strip() else None
                if e is None:
                    if not self.final:
                        raise _Incomplete(name)
                    raise _Malformed("unterminated call id")
                cid = self.text[m.end() : e.start()].strip()
                return name, (e.end() if a.call_id_suffix.strip() else e.start()), cid
        if a.name_suffix.strip():
            pos = self._need(pos, a.name_suffix, "after the function name", name)
        return name, pos, cid

    def json_args(self, pos: int, name: str) -> tuple[dict[str, Any], int]:
        a = self.a
        pos = self._need(pos, a.args_start, "before the arguments", name)
        p = self._ws(pos)
        try:
            val, end = json.JSONDecoder().raw_decode(self.text, p)
        except ValueError:
            if not self.final:
                raise _Incomplete(name) from None
            raise _Malformed("arguments are not valid JSON") from None
        args = _args_obj(val)
        if args is None:
            raise _Malformed("arguments are not a JSON object")
        end = self._need(end, a.args_end, "after the arguments", name)
        return args, end

    def tagged_args(self, pos: int, name: str) -> tuple[dict[str, Any], int]:
        a = self.a
        schema = self.schemas.get(name, {})
        has_schema = name in self.schemas
        args: dict[str, Any] = {}
        pos = self._need(pos, a.args_start, "before the arguments", name)
        key_pre, key_suf = _flex(a.arg_name_prefix), _flex(a.arg_name_suffix)
        val_pre, val_suf = _flex(a.arg_value_prefix), _flex(a.arg_value_suffix)
        if not key_suf and val_pre:  # the value's opening tag ends the name (``name="k">v``)
            key_suf, val_pre = val_pre, ""
        if not key_pre or not val_suf:
            raise _Malformed("the template's argument markers are unknown")
        while True:
            p = self._ws(pos)
            if a.arg_separator.strip():
                m = re.compile(_flex(a.arg_separator)).match(self.text, p)
                if m:
                    p = self._ws(m.end())
            m = re.compile(key_pre).match(self.text, p)
            if not m:
                rest = self.text[p:]
                if not self.final and a.arg_name_prefix.strip().startswith(rest):
                    raise _Incomplete(name)
                return args, pos
            k_end = re.compile(key_suf).search(self.text, m.end()) if key_suf else None
            if k_end is None:
                if not self.final:
                    raise _Incomplete(name)
                raise _Malformed("unterminated argument name")
            key = self.text[m.end() : k_end.start()].strip()
            v = k_end.end()
            if val_pre:
                vm = re.compile(r"\s*" + val_pre).match(self.text, v)
                if not vm:
                    if not self.final and len(self.text) - v < len(a.arg_value_prefix.strip()) + 2:
                        raise _Incomplete(name)
                    raise _Malformed(
                        f"expected {a.arg_value_prefix.strip()!r} after argument {key!r}"
                    )
                v = vm.end()
            ve = re.compile(val_suf).search(self.text, v)
            if ve is None:
                if not self.final:
                    raise _Incomplete(name)
                raise _Malformed(f"unterminated value of argument {key!r}")
            raw = self.text[v : ve.start()]
            # the template's own whitespace around the value is not part of it
            if (a.arg_value_prefix or a.arg_name_suffix).endswith("\n") and raw.startswith("\n"):
                raw = raw[1:]
            if a.arg_value_suffix.startswith("\n") and raw.endswith("\n"):
                raw = raw[:-1]
            args[key] = _typed_value(raw, schema.get(key), has_schema)
            pos = ve.end()

    def call(self, pos: int) -> tuple[AnalysisCall, int]:
        a = self.a
        start = pos
        cid: str | None = None
        if a.call_id_position == "pre_func_name" and a.call_id_suffix.strip():
            p = self._ws(pos)
            m = (
                re.compile(_flex(a.call_id_prefix)).match(self.text, p)
                if a.call_id_prefix.strip()
                else None
            )
            id_start = (
                m.end()
                if m
                else (p if a.call_id_prefix.strip() == a.per_call_start.strip() else -1)
            )
            if id_start >= 0:
                e = self._find(id_start, a.call_id_suffix)
                if e is None and not self.final:
                    raise _Incomplete(None)
                if e is not None:
                    cid, pos = self.text[id_start : e.start()].strip(), e.end()
        name, pos, own_id = self.name(pos)
        cid = own_id or cid
        pos = self._need(pos, a.args_separator, "after the function name", name)
        if a.tool_format == "tag_tagged":
            args, pos = self.tagged_args(pos, name)
        else:
            args, pos = self.json_args(pos, name)
        if a.call_id_position == "post_args" and a.call_id_prefix.strip():
            m = re.compile(r"\s*" + _flex(a.call_id_prefix)).match(self.text, pos)
            if m:
                e = self._find(m.end(), a.call_id_suffix) if a.call_id_suffix.strip() else None
                end = e.start() if e else self._eol(m.end())
                cid = self.text[m.end() : end].strip()
                pos = e.end() if e else end
        if a.function_close.strip():
            end = self._at(pos, a.function_close)
            if end is None:
                if not self.final and self._ws(pos) >= len(self.text):
                    raise _Incomplete(name)
                if self.final and self._ws(pos) >= len(self.text):
                    raise _Malformed(f"unterminated call (no {a.function_close.strip()!r})")
            else:
                pos = end
        return AnalysisCall(name, args, self.text[start:pos].strip(), id=cid), pos

    def _eol(self, pos: int) -> int:
        m = re.compile(r"[\s<\[{]").search(self.text, pos)
        return m.start() if m else len(self.text)


def _json_call(a: TemplateAnalysis, obj: Any, raw: str) -> list[AnalysisCall]:
    """Calls from one decoded JSON value of a JSON_NATIVE template."""
    items = obj if isinstance(obj, list) else [obj]
    out = []
    for o in items:
        r = json.dumps(o, ensure_ascii=False) if isinstance(obj, list) else raw
        if not isinstance(o, dict):
            out.append(AnalysisCall(None, None, r, error="tool call is not a JSON object"))
            continue
        if a.fun_name_is_key:
            if len(o) == 1:
                ((name, args_val),) = o.items()
                args = _args_obj(args_val)
                out.append(
                    AnalysisCall(
                        name,
                        args,
                        r,
                        error=None if args is not None else "arguments are not a JSON object",
                    )
                )
            else:
                out.append(AnalysisCall(None, None, r, error="expected one {name: arguments} pair"))
            continue
        name_field, args_field = a.name_field, a.args_field
        if a.function_field and a.function_field != "function" and "." not in name_field:
            name_field, args_field = (
                f"{a.function_field}.{name_field}",
                f"{a.function_field}.{args_field}",
            )
        name = _get_path(o, name_field)
        args_val = _get_path(o, args_field)
        if name is None:  # the usual spellings, for models that drift from their template
            src = o.get("function") if isinstance(o.get("function"), dict) else o
            name = src.get("name")
            args_val = next((src[k] for k in ("arguments", "parameters") if k in src), None)
        cid = _get_path(o, a.id_field) if a.id_field else None
        if cid is None and a.gen_id_field:
            cid = _get_path(o, a.gen_id_field)
        if not isinstance(name, str) or not name:
            out.append(AnalysisCall(None, None, r, error="tool call has no name"))
            continue
        args = _args_obj(args_val)
        err = None if args is not None else "arguments are not a JSON object"
        out.append(AnalysisCall(name, args, r, id=str(cid) if cid is not None else None, error=err))
    return out


def _scan_json_native(
    a: TemplateAnalysis, text: str, final: bool
) -> tuple[list[AnalysisCall], int, bool]:
    """(calls, end of the tool region, complete) for JSON calls starting at 0."""
    calls: list[AnalysisCall] = []
    pos = 0
    dec = json.JSONDecoder()
    sec_s, sec_e = _flex(a.section_start), _flex(a.section_end)
    call_s, call_e = _flex(a.per_call_start), _flex(a.per_call_end)

    def ws(p: int) -> int:
        while p < len(text) and (text[p].isspace() or text[p] in ",;"):
            p += 1
        return p

    if sec_s:
        m = re.compile(sec_s).match(text, ws(pos))
        if not m:
            return calls, 0, True
        pos = m.end()
    while True:
        p = ws(pos)
        if call_s:
            m = re.compile(call_s).match(text, p)
            if not m:
                if not final and a.per_call_start.strip().startswith(text[p:]) and p < len(text):
                    return calls, pos, False
                break
            p = ws(m.end())
        if p >= len(text):
            if call_s and p > pos and not final:
                return calls, pos, False
            if call_s and final and p > pos:
                calls.append(
                    AnalysisCall(None, None, text[pos:].strip(), error="unterminated tool call")
                )
                return calls, len(text), True
            break
        if text[p] not in "{[":
            if call_s and p > pos:
                calls.append(
                    AnalysisCall(None, None, text[p:].strip(), error="tool call is not JSON")
                )
                return calls, len(text), True
            break
        try:
            obj, end = dec.raw_decode(text, p)
        except ValueError:
            if not final:
                return calls, pos, False
            raw = text[p:]
            stop = re.compile(call_e or sec_e).search(raw) if (call_e or sec_e) else None
            raw = raw[: stop.start()] if stop else raw
            calls.append(AnalysisCall(None, None, raw.strip(), error="invalid JSON in tool call"))
            return calls, len(text), True
        calls.extend(_json_call(a, obj, text[p:end]))
        pos = end
        if call_e:
            m = re.compile(call_e).match(text, ws(pos))
            if m:
                pos = m.end()
            elif ws(pos) >= len(text):
                if not final:
                    return calls, pos, False
                for c in calls[-1:]:
                    c.error = c.error or f"unterminated tool call (no {a.per_call_end.strip()})"
                    c.args = None if c.error else c.args
                return calls, len(text), True
        if not call_s and not a.tools_array_wrapped:
            # bare JSON calls: keep reading while another object follows
            q = ws(pos)
            if q >= len(text) or text[q] != "{":
                break
    if sec_e:
        m = re.compile(sec_e).match(text, ws(pos))
        if m:
            pos = m.end()
        elif ws(pos) >= len(text) and not final:
            return calls, pos, False
    return calls, pos, True


def _scan_tagged(
    a: TemplateAnalysis, text: str, final: bool, tools: Sequence[Mapping[str, Any]] | None
) -> tuple[list[AnalysisCall], int, bool]:
    """(calls, end of the tool region, complete) for tag formats starting at 0."""
    sc = _CallScanner(a, text, final, tools)
    calls: list[AnalysisCall] = []
    pos = 0
    bare = _bare_call_prefix(a)

    def bare_call_at(p: int) -> bool:
        return bool(bare) and re.compile(_flex(bare)).match(text, sc._ws(p)) is not None

    if a.section_start.strip():
        end = sc._at(pos, a.section_start)
        if end is None and not bare_call_at(pos):
            return calls, 0, True
        pos = end or 0
    while True:
        p = sc._ws(pos)
        opener_skipped = False
        if a.per_call_start.strip():
            try:
                end = sc._at(p, a.per_call_start)
            except _Incomplete:
                return calls, pos, False
            if end is None:
                if not bare_call_at(p):
                    break
                end, opener_skipped = p, True
            p = end
        elif calls:
            # calls without per-call markers follow each other (", " in llama.cpp)
            q = p
            if text.startswith(",", q):
                q = sc._ws(q + 1)
            try:
                if sc._at(q, a.name_prefix) is None or not a.name_prefix.strip():
                    break
            except _Incomplete:
                return calls, pos, False
            p = q
        if p >= len(text) and not final:
            return calls, pos, False
        try:
            call, end = sc.call(p)
        except _Incomplete as inc:
            calls.append(AnalysisCall(inc.name, None, text[p:].strip(), complete=False))
            return calls, pos, False
        except _Malformed as exc:
            stop = (
                sc._find(p, a.per_call_end or a.section_end)
                if (a.per_call_end or a.section_end).strip()
                else None
            )
            raw_end = stop.start() if stop else len(text)
            calls.append(AnalysisCall(None, None, text[p:raw_end].strip(), error=str(exc)))
            pos = stop.end() if stop else len(text)
            if not stop:
                return calls, pos, True
            continue
        if a.per_call_end.strip():
            try:
                e = sc._at(end, a.per_call_end)
            except _Incomplete:
                calls.append(replace(call, complete=False))
                return calls, pos, False
            if e is not None:
                end = e
            elif not opener_skipped and sc._ws(end) >= len(text):
                if not final:
                    calls.append(replace(call, complete=False))
                    return calls, pos, False
                calls.append(
                    replace(
                        call,
                        args=None,
                        error=f"unterminated tool call (no {a.per_call_end.strip()})",
                    )
                )
                return calls, len(text), True
        calls.append(call)
        pos = end
    if a.section_end.strip():
        try:
            e = sc._at(pos, a.section_end)
        except _Incomplete:
            return calls, pos, False
        if e is not None:
            pos = e
        elif sc._ws(pos) >= len(text) and not final:
            return calls, pos, False
    return calls, pos, True


def _tool_start(a: TemplateAnalysis, text: str, start: int = 0) -> int:
    """Where a tool-call region starts in ``text`` (-1 if nowhere)."""
    if a.tool_format == "none":
        return -1
    pats = [p for p in (_flex(a.trigger), _flex(_bare_call_prefix(a))) if p]
    if not pats:
        return -1
    m = re.compile("|".join(f"(?:{p})" for p in pats)).search(text, start)
    return m.start() if m else -1


def _bare_call_prefix(a: TemplateAnalysis) -> str:
    """A tag format's name prefix (``<function=``), accepted without the section or
    per-call opener that models sometimes skip (llama.cpp's Qwen3-Coder handler does)."""
    prefix = a.name_prefix.strip()
    if (
        a.tool_format in ("tag_json", "tag_tagged")
        and prefix[:1] in ("<", "[")
        and prefix != a.trigger
    ):
        return prefix
    return ""


def _split_reasoning(
    text: str, a: TemplateAnalysis, reasoning: bool | None, think_open: bool, final: bool
) -> tuple[str | None, str, bool]:
    """(reasoning, rest, finished) for the reasoning block at the start of the output."""
    start, end = a.reasoning_start.strip(), a.reasoning_end.strip()
    if reasoning is None or a.reasoning_mode == "none" or not end:
        return None, text, True
    s = text.lstrip()
    if think_open or s.startswith(end):  # a prompt that opened the block, said or not
        body = 0
    elif start and s.startswith(start):
        body = len(text) - len(s) + len(start)
    elif start and s and start.startswith(s) and not final:
        return "", "", False  # a half-written opening marker
    elif start:
        return None, text, True
    else:  # delimiter style: reasoning is everything before the end marker
        j = text.find(end)
        if j >= 0:
            return text[:j], text[j + len(end) :], True
        if final:
            return None, text, True
        return None, "", False
    j = text.find(end, body)
    if j >= 0:
        return text[body:j], text[j + len(end) :], True
    # Unterminated: a model may call a tool straight from its thoughts. Until the
    # end marker shows up (it may: a call can be quoted in the thoughts), a call
    # there is held back; at the end it is a call.
    k = _tool_start(a, text, body)
    if k >= 0:
        if final:
            return text[body:k], text[k:], True
        return text[body:k], "", False
    return text[body:], "", False


def _strip_content_markers(text: str, a: TemplateAnalysis) -> str:
    for m in (a.content_start, a.content_end):
        if m.strip():
            text = text.replace(m.strip(), "")
    return text


def _parse(
    text: str,
    a: TemplateAnalysis,
    final: bool,
    reasoning: bool | None,
    think_open: bool,
    tools: Sequence[Mapping[str, Any]] | None,
) -> AnalysisParse:
    r, rest, r_done = _split_reasoning(text, a, reasoning, think_open, final)
    markers = a.markers
    r_held = 0
    if r is not None and not r_done and not final:
        # the end marker, or a call the model writes straight from its thoughts
        r_held = _held_suffix(
            r, [m for m in (a.reasoning_end.strip(), a.trigger, _bare_call_prefix(a)) if m]
        )
    if not r_done and not final:
        return AnalysisParse("", r, [], 0, r_held, settled=False)
    if r is not None and not r.strip() and r_done:
        r = None if not r else ""  # an empty think block (e.g. prefilled ``<think></think>``)
    calls: list[AnalysisCall] = []
    trigger = a.trigger
    settled = True
    content = rest
    if a.tool_format != "none":
        if trigger or _bare_call_prefix(a):
            i = _tool_start(a, rest)
        else:
            opener = "[" if a.tools_array_wrapped else "{"
            i = rest.find(opener)
        if i >= 0:
            region = rest[i:]
            if a.tool_format == "json":
                if not trigger and not final:
                    calls, end, complete = [], 0, False
                else:
                    calls, end, complete = _scan_json_native(a, region, final)
            else:
                calls, end, complete = _scan_tagged(a, region, final, tools)
            if not trigger and final and (not calls or any(c.name is None for c in calls)):
                calls, end, complete = [], 0, True  # bare JSON that is not a call: plain content
                content = rest
            elif not complete:
                content = rest[:i]
                settled = False
            elif calls or end > 0:
                content = rest[:i] + region[end:]
            else:
                content = rest
    content = _strip_content_markers(content, a)
    turn_end = a.turn_end.strip()
    if turn_end and content.rstrip().endswith(turn_end):
        content = content.rstrip()[: -len(turn_end)]
    hold = (*markers, trigger, turn_end) if trigger else (*markers, turn_end)
    held = 0 if final else _held_suffix(content, [m for m in hold if m])
    return AnalysisParse(content, r, calls, held, r_held, settled)


def parse_with_analysis(
    text: str,
    analysis: TemplateAnalysis,
    *,
    final: bool,
    reasoning: bool | None,
    think_open: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    generation_prompt: str | None = None,
) -> AnalysisParse:
    """Split model output into content, reasoning and tool calls with a learned format.

    ``final=False`` parses a stream so far: an unfinished call or reasoning block
    makes ``settled`` False and is left out of ``content``; ``held`` trailing
    characters of ``content`` may be a half-written marker. ``reasoning=None``
    leaves think blocks in the content; otherwise a leading block is returned as
    reasoning (also when thinking was disabled but the model thought anyway, as
    llama.cpp does). ``think_open``: the prompt already opened the block; or pass
    the ``generation_prompt`` (what the template appended for
    ``add_generation_prompt``) and the parser sees what llama.cpp's does: the
    reasoning block it opened, boilerplate included, is parsed with the output.
    ``tools`` (OpenAI tool dicts) make tagged values schema-typed: a ``string``
    parameter stays a string. Never raises.
    """
    try:
        if generation_prompt is not None:
            prefill = analysis.reasoning_prefill(generation_prompt)
        elif think_open and analysis.reasoning_mode != "none":
            prefill = analysis.reasoning_start
        else:
            prefill = ""
        if prefill.strip():
            text, think_open = prefill + text, False
        return _parse(text, analysis, final, reasoning, think_open, tools)
    except Exception:  # defensive: model output must never crash a request
        logger.exception("analysis-driven parse failed; returning the text as content")
        return AnalysisParse(text, None, [], 0, 0, final)
