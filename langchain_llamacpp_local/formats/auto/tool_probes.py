"""T1-T7: how a template writes tool calls, learned by comparing renders (llama.cpp's
``chat-diff-analyzer.cpp``): the call format, section and per-call markers, the
function name's markers, argument names and values, their separator, call ids, and what
stands between two calls. :func:`probe_tool_calls` runs them in order."""

from __future__ import annotations

import json
import re
from typing import Any

from langchain_llamacpp_local.formats.auto.diff import (
    MARKER,
    MARKER_RE,
    calculate_diff_split,
    common_text_prefix_len,
    first_marker,
    last_marker_of,
    last_marker_tail,
    marker_at,
    until_common_prefix,
    until_marker,
)
from langchain_llamacpp_local.formats.auto.probes import (
    ARG_FIRST,
    ARG_SECOND,
    ASSISTANT_MSG,
    CALL_FIRST,
    CALL_FIRST_ALT_ID,
    CALL_ID_001,
    CALL_ID_999,
    CALL_ONE,
    CALL_ONE_OTHER_VAL,
    CALL_OTHER_ARG,
    CALL_SECOND,
    FUN_FIRST,
    FUN_SECOND,
    USER_MSG,
    CallIdPosition,
    Renderer,
    State,
    assistant,
    compare,
    compare_calls,
    tools_probe,
)


def probe_tool_calls(st: State, render: Renderer, parallel: bool) -> None:
    """T1-T7 in order: each step reads what the ones before it learned."""
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


# --------------------------------------------------------------------------- T1-T7 tools


def _in_json(haystack: str, needle: str) -> bool:
    return re.search(rf"[{{:]\s*\"{re.escape(needle)}\"", haystack) is not None


def _tool_calls(st: State, render: Renderer, parallel: bool) -> None:
    """T1: no call vs one call; classify JSON_NATIVE / TAG_WITH_JSON / TAG_WITH_TAGGED."""
    cmp = compare_calls(render, ASSISTANT_MSG, [CALL_FIRST])
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


def _json_native(st: State, clean: str) -> None:
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


def _non_json(st: State, clean: str) -> None:
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


def _per_call_markers(st: State, render: Renderer, *, json_native: bool = False) -> None:
    """T2: one call vs two; section markers repeated per call become per-call markers.

    A JSON-native format's are repeated when the second call's text holds them at all;
    a tag format's when that text starts with them, and an end marker written once
    whatever the number of calls ends the section instead."""
    cmp = compare_calls(render, [CALL_FIRST], [CALL_FIRST, CALL_SECOND])
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


def _function_markers(st: State, render: Renderer) -> None:
    """T3: FUN_FIRST vs FUN_SECOND: name prefix/suffix and the call closer (chat-diff-analyzer.cpp:1120)."""
    params = tools_probe(assistant("", [CALL_FIRST]))
    cmp = compare(render, params, tools_probe(assistant("", [CALL_SECOND])))
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
        nt = compare(render, params, tools_probe(assistant(ASSISTANT_MSG)))
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


def _argument_names(st: State, render: Renderer) -> None:
    """A1: ARG_FIRST vs ARG_SECOND: the tag around an argument name (chat-diff-analyzer.cpp:1270)."""
    cmp = compare_calls(render, [CALL_ONE], [CALL_OTHER_ARG])
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


def _argument_values(st: State, render: Renderer) -> None:
    """A2: value XXXX vs YYYY: the tags around an argument value (chat-diff-analyzer.cpp:1327)."""
    cmp = compare_calls(render, [CALL_ONE], [CALL_ONE_OTHER_VAL])
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


def _argument_separator(st: State, render: Renderer) -> None:
    """T5: one argument vs two (chat-diff-analyzer.cpp:1387); the sentinels share no
    prefix, so like llama.cpp this finds no separator and whitespace is tolerated."""
    cmp = compare_calls(render, [CALL_ONE], [CALL_FIRST])
    if cmp is not None and cmp.diff.right:
        st.set(arg_separator=until_common_prefix(cmp.diff.right, ARG_FIRST, ARG_SECOND))


def _call_ids(st: State, render: Renderer) -> None:
    """T7: call00001 vs call99999: where the call id goes (chat-diff-analyzer.cpp:1473)."""
    cmp = compare_calls(render, [CALL_FIRST], [CALL_FIRST_ALT_ID])
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


def _call_separator(st: State, render: Renderer) -> None:
    """What the template writes between two consecutive calls (after per-call end)."""
    end, start = st.per_call_end.strip(), st.per_call_start.strip()
    if not end or not start:
        return
    out = render(**tools_probe(assistant("", [CALL_FIRST, CALL_SECOND])))
    if out is None:
        return
    i = out.find(FUN_SECOND)
    j = out.rfind(start, 0, i)
    k = out.rfind(end, 0, j)
    if i >= 0 and j >= 0 and k >= 0:
        st.set(call_separator=out[k + len(end) : j])
