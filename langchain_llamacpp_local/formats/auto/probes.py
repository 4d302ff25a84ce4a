"""What the differential analysis works with: the :class:`TemplateAnalysis` it builds, the
sentinel names its probe conversations use, the :class:`Renderer` that renders them
(once each), :func:`compare` that diffs two renders, and the :class:`State` the steps
fill (:mod:`.analyzer` runs the steps, :mod:`.tool_probes` those of tool calls).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_llamacpp_local.formats.auto.diff import (
    DiffSplit,
    calculate_diff_split,
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


class Renderer:
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
class Compared:
    diff: DiffSplit
    a: str
    b: str


def compare(render: Renderer, a: dict[str, Any], b: dict[str, Any]) -> Compared | None:
    """Render two probe variants (keyword dicts for the renderer) and diff them."""
    out_a, out_b = render(**a), render(**b)
    if out_a is None or out_b is None:
        return None
    return Compared(calculate_diff_split(out_a, out_b), out_a, out_b)


# Probe data (chat-diff-analyzer.cpp:186-229).
PARAMS_SCHEMA = {
    "type": "object",
    "properties": {
        ARG_FIRST: {"type": "string", "description": "First argument"},
        ARG_SECOND: {"type": "string", "description": "Second argument"},
    },
    "required": [],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": FUN_FIRST,
            "description": "Test function foo",
            "parameters": PARAMS_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {
            "name": FUN_SECOND,
            "description": "Test function bar",
            "parameters": PARAMS_SCHEMA,
        },
    },
]
USER = {"role": "user", "content": USER_MSG}


def probe_call(name: str, args: dict[str, Any], cid: str = CALL_ID_001) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def assistant(
    content: str | list[dict[str, Any]] | None = "",
    calls: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = calls
    m.update(extra)
    return m


CALL_ONE = probe_call(FUN_FIRST, {ARG_FIRST: "XXXX"})
CALL_ONE_OTHER_VAL = probe_call(FUN_FIRST, {ARG_FIRST: "YYYY"})
CALL_OTHER_ARG = probe_call(FUN_FIRST, {ARG_SECOND: "YYYY"})
CALL_FIRST = probe_call(FUN_FIRST, {ARG_FIRST: "XXXX", ARG_SECOND: "YYYY"})
CALL_SECOND = probe_call(FUN_SECOND, {ARG_FIRST: "XXXX", ARG_SECOND: "YYYY"}, CALL_ID_002)
CALL_FIRST_ALT_ID = probe_call(FUN_FIRST, {ARG_FIRST: "XXXX", ARG_SECOND: "YYYY"}, CALL_ID_999)


def tools_probe(*msgs: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [USER, *msgs], "tools": TOOLS}


def compare_calls(
    render: Renderer, a: list[dict[str, Any]] | str, b: list[dict[str, Any]] | str
) -> Compared | None:
    """An assistant turn making the calls ``a`` (or answering the text ``a``) against one
    making ``b``, with the probe tools bound, rendered and diffed."""

    def turn(x: list[dict[str, Any]] | str) -> dict[str, Any]:
        return tools_probe(assistant(x) if isinstance(x, str) else assistant("", x))

    return compare(render, turn(a), turn(b))


@dataclass
class State:
    """Mutable working copy of the analysis (frozen into TemplateAnalysis at the end)."""

    fields: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        f = self.__dict__["fields"]
        if name in f:
            return f[name]
        return getattr(DEFAULT, name)

    def set(self, **kw: Any) -> None:
        self.fields.update(kw)


DEFAULT = TemplateAnalysis()
