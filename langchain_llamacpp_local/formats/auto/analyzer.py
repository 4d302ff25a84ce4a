"""The differential analysis itself: probe renders, diffs, a :class:`TemplateAnalysis`.

Port of llama.cpp's ``common/chat-diff-analyzer.cpp`` (R1-R3 reasoning, C1
content, the workarounds here; T1-T7 tool calls in :mod:`.tool_probes`) with the
capabilities llama.cpp reads from its Jinja engine (``jinja/caps.cpp``) probed from
renders instead. What the steps share (the renderer, the probe data, the working
state) is in :mod:`.probes`.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import replace

from langchain_llamacpp_local.formats.auto.diff import (
    MARKER,
    prune_whitespace_segments,
    segmentize_markers,
    wrapped_between,
)
from langchain_llamacpp_local.formats.auto.probes import (
    ARG_FIRST,
    ARG_SECOND,
    ASSISTANT_MSG,
    CALL_ID_001,
    CALL_ID_002,
    FUN_FIRST,
    PARAMS_SCHEMA,
    THINKING_CONTENT,
    TOOL_RESULT,
    USER,
    Renderer,
    State,
    TemplateAnalysis,
    assistant,
    compare,
    probe_call,
    tools_probe,
)
from langchain_llamacpp_local.formats.auto.tool_probes import probe_tool_calls
from langchain_llamacpp_local.templates.chat_template import ChatTemplate, ChatTemplateError

logger = logging.getLogger(__name__)


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
            "function": {"name": n, "description": "d", "parameters": PARAMS_SCHEMA},
        }
        for n in ("tool_one_x", "tool_two_y")
    ]
    one = [probe_call("tool_one_x", {"arg_probe": "value_probe"})]
    user = {"role": "user", "content": "User message"}
    supports, as_string, none_content = False, False, False
    for nc in (False, True):
        for stringify in (False, True):
            r = Renderer(template, stringify, nc)
            cmp = compare(
                r,
                {"messages": [user, assistant("Plain answer")], "tools": tools},
                {"messages": [user, assistant("", one)], "tools": tools},
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
    render = Renderer(template, as_string, none_content)
    two = [
        probe_call("tool_one_x", {"arg_probe": "value_probe"}),
        probe_call("tool_two_y", {"arg_probe": "v2"}, CALL_ID_002),
    ]
    cmp = compare(
        render,
        {"messages": [user, assistant("", one)], "tools": tools},
        {"messages": [user, assistant("", two)], "tools": tools},
    )
    parallel = cmp is not None and "tool_two_y" in cmp.diff.right
    out = render(
        [
            user,
            assistant("", one),
            {"role": "tool", "content": TOOL_RESULT, "tool_call_id": CALL_ID_001},
        ],
        tools,
    )
    native_tool = out is not None and TOOL_RESULT in out
    return supports, as_string, none_content, parallel, native_tool


# --------------------------------------------------------------------------- R1-R3 reasoning


def _reasoning_presence(st: State, render: Renderer) -> None:
    """R1: assistant message with vs without ``reasoning_content`` (chat-diff-analyzer.cpp:468)."""
    plain = assistant(ASSISTANT_MSG)
    variants = (
        assistant(ASSISTANT_MSG, reasoning_content=THINKING_CONTENT),
        # Unlike llama.cpp, also the thinking content block some templates read
        # instead (Ministral/Magistral: ``[THINK]...[/THINK]``).
        assistant(
            [
                {"type": "thinking", "thinking": THINKING_CONTENT},
                {"type": "text", "text": ASSISTANT_MSG},
            ]
        ),
    )
    for thought in variants:
        cmp = compare(render, {"messages": [USER, plain]}, {"messages": [USER, thought]})
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


def _thinking_enabled(st: State, render: Renderer) -> None:
    """R2: generation prompt with ``enable_thinking`` false vs true (chat-diff-analyzer.cpp:522)."""
    a = {"messages": [USER], "add_generation_prompt": True, "enable_thinking": False}
    cmp = compare(render, a, {**a, "enable_thinking": True})
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


def _reasoning_scope(st: State, render: Renderer) -> None:
    """R3: reasoning next to content vs next to tool calls: TOOLS_ONLY (chat-diff-analyzer.cpp:607)."""
    with_content = assistant(ASSISTANT_MSG, reasoning_content=THINKING_CONTENT)
    with_tools = assistant(
        None,
        [probe_call(FUN_FIRST, {ARG_FIRST: "VVVV", ARG_SECOND: "XXXX"})],
        reasoning_content=THINKING_CONTENT,
    )
    cmp = compare(render, tools_probe(with_content), tools_probe(with_tools))
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


def _content(st: State, render: Renderer) -> None:
    """C1: content-only vs tool-call and vs reasoning messages (chat-diff-analyzer.cpp:661)."""
    base = tools_probe(assistant(ASSISTANT_MSG))
    c_tools = compare(
        render, base, tools_probe(assistant("", [probe_call("test_func", {"arg1": "value1"})]))
    )
    c_reason = compare(render, base, tools_probe(assistant("", reasoning_content=THINKING_CONTENT)))
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


# --------------------------------------------------------------------------- workarounds


def _workarounds(st: State, src: str) -> None:
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


def _preserved(st: State) -> tuple[str, ...]:
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


def _turn_end(st: State, render: Renderer) -> None:
    """The marker that ends an assistant turn (``<|im_end|>``...): generation normally
    stops on it, but a model that spells it out must not leave it in the content."""
    out = render(messages=[USER, assistant(ASSISTANT_MSG)])
    if out is None or ASSISTANT_MSG not in out:
        return
    after = out[out.rfind(ASSISTANT_MSG) + len(ASSISTANT_MSG) :]
    for seg in segmentize_markers(after):
        if seg.value.strip():
            if seg.marker and seg.value not in (st.content_end.strip(), st.reasoning_end.strip()):
                st.set(turn_end=seg.value)
            return


def _generation_prompt(render: Renderer) -> str:
    a = {"messages": [USER], "add_generation_prompt": False}
    cmp = compare(render, a, {**a, "add_generation_prompt": True})
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
    render = Renderer(template, as_string, none_content)
    st = State()
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
        probe_tool_calls(st, render, parallel)
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
