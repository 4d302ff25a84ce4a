"""Body readers of the families whose calls are markup tags (Qwen3-Coder, Seed-OSS,
MiniMax M2, DeepSeek DSML, MiniCPM5, Muse, GLM, Hy3, Kimi K3).

Each family's tags are one :class:`~.arg_stream.markup.Tags` record: the body reader's
patterns are built from it and its argument stream reads it, so a marker is written once.
The syntaxes follow llama.cpp 0.3.36's parsers (``common/parsers/*.cpp``).
"""

from __future__ import annotations

import re

from langchain_llamacpp_local.formats.arg_stream.markup import Tags, markup, pairs, sep_pairs
from langchain_llamacpp_local.formats.base import Options, ParsedCall, typed_value
from langchain_llamacpp_local.formats.families import invoke_calls, split_calls
from langchain_llamacpp_local.formats.syntax import reads

_e = re.escape


def tagged_args(
    inner: str,
    pattern: re.Pattern[str],
    name: str | None,
    opts: Options,
    raw: str,
    closed: bool,
    final: bool,
) -> ParsedCall:
    """Arguments written as tagged key/value pairs, typed by the tool's schema."""
    args: dict[str, object] = {}
    for m in pattern.finditer(inner):
        key, value = m.group("k").strip(), m.group("v")
        if value.startswith("<![CDATA[") and value.endswith("]]>"):
            value = value[len("<![CDATA[") : -len("]]>")]
        if m.groupdict().get("s") is not None:  # DSML: string="true|false"
            args[key] = value if m.group("s") == "true" else typed_value(value, None)
        else:
            args[key] = typed_value(value, opts.param_types(name, key))
    if not closed:
        if final:
            return ParsedCall(name, None, raw, error="unterminated tool call")
        return ParsedCall(name, None, raw, complete=False)
    return ParsedCall(name, args, raw)


# --------------------------------------------------------------------------- key/value pairs

GLM = Tags(
    "", "</tool_call>", "<arg_key>", "</arg_value>", key_stop="</arg_key>", value_open="<arg_value>"
)
_GLM_ARG = re.compile(
    rf"{_e(GLM.param_open)}(?P<k>.*?){_e(GLM.key_stop)}\s*{_e(GLM.value_open)}(?P<v>.*?){_e(GLM.param_close)}",
    re.S,
)


@reads(stream=pairs(GLM))
def glm_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``NAME<arg_key>k</arg_key><arg_value>v</arg_value>...`` (GLM 4.5+, Ling, Laguna)."""
    m = re.match(rf"\s*([^<\n]+?)\s*(?={_e(GLM.param_open)}|\n|$)", region)
    name = m.group(1) if m else None
    named = m is not None and (final or m.end() < len(region))
    if not final:
        return [ParsedCall(name if named else None, None, region, complete=False)]
    if not name:
        return [ParsedCall(None, None, region, error="tool call has no name")]
    return [tagged_args(region, _GLM_ARG, name, opts, region, True, final)]


HY_MARKER = ":opensource"
HY3 = Tags(
    f"<tool_call{HY_MARKER}>",
    f"</tool_call{HY_MARKER}>",
    f"<arg_key{HY_MARKER}>",
    f"</arg_value{HY_MARKER}>",
    name_stop=f"<tool_sep{HY_MARKER}>",
    key_stop=f"</arg_key{HY_MARKER}>",
    value_open=f"<arg_value{HY_MARKER}>",
)
_HY_ARG = re.compile(
    rf"{_e(HY3.param_open)}(?P<k>.*?){_e(HY3.key_stop)}\s*{_e(HY3.value_open)}(?P<v>.*?){_e(HY3.param_close)}",
    re.S,
)


@reads(closers=(HY3.call_close, HY3.call_open), stream=sep_pairs(HY3))
def hy3_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<tool_call:opensource>NAME<tool_sep:opensource><arg_key:...>k</arg_key:...><arg_value:...>v...``."""

    def one(s: str, fin: bool) -> list[ParsedCall]:
        head, found, body = s.partition(HY3.name_stop)
        if not found:
            return [ParsedCall(None, None, s, error="no tool name" if fin else None, complete=fin)]
        return [tagged_args(body, _HY_ARG, head.strip(), opts, s, fin, fin)]

    return split_calls(region, HY3.call_open, HY3.call_close, final, one)


# --------------------------------------------------------------------------- function tags


def xml_function_calls(
    region: str, final: bool, opts: Options, tags: Tags, name: str, arg: re.Pattern[str]
) -> list[ParsedCall]:
    """The calls of a region in ``tags``, a call's name matching ``name``, its
    parameters ``arg``."""
    out: list[ParsedCall] = []
    open_re = rf"{_e(tags.call_open)}(?P<name>{name}){_e(tags.name_stop + tags.name_tails[0])}"
    close = tags.call_close
    for m in re.finditer(open_re + r"(?P<body>.*?)(?P<close>" + _e(close) + r"|$)", region, re.S):
        closed = bool(m.group("close"))
        if (
            not closed
            and not final
            and not m.group("body").strip()
            and not m.group(0).endswith(">")
        ):
            out.append(ParsedCall(None, None, m.group(0), complete=False))
            continue
        name_read = m.group("name").strip()
        out.append(tagged_args(m.group("body"), arg, name_read, opts, m.group(0), closed, final))
    if not out and region.strip():
        if final:
            out.append(ParsedCall(None, None, region.strip(), error="cannot read the tool call"))
        else:
            out.append(ParsedCall(None, None, region, complete=False))
    return out


def _param(tags: Tags, key: str, value: str, framing: str = "") -> re.Pattern[str]:
    """A parameter of ``tags``: the key matching ``key`` up to the tag's end, the value
    ``value`` (``framing``: what may stand around it)."""
    stop = _e(tags.key_stop + tags.key_tails[0])
    return re.compile(
        rf"{_e(tags.param_open)}(?P<k>{key}){stop}{framing}(?P<v>{value}){framing}{_e(tags.param_close)}",
        re.S,
    )


QWEN = Tags("<function=", "</function>", "<parameter=", "</parameter>", framed=True)
_QWEN_PARAM = _param(QWEN, r"[^>\n]+", ".*?", r"\n?")


@reads(closers=(QWEN.call_close,), stream=markup(QWEN))
def qwen3_coder_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<function=NAME>\\n<parameter=k>\\nv\\n</parameter>\\n</function>`` (Qwen3-Coder, Qwen3.5, Seed-OSS)."""
    return xml_function_calls(region, final, opts, QWEN, r"[^>\n]+", _QWEN_PARAM)


SEED = Tags(QWEN.call_open, QWEN.call_close, QWEN.param_open, QWEN.param_close)
_SEED_PARAM = _param(SEED, r"[^>\n]+", ".*?")


@reads(closers=(SEED.call_close,), stream=markup(SEED))
def seed_oss_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """Seed-OSS: like Qwen3-Coder, but parameter values are verbatim (no newline framing)."""
    return xml_function_calls(region, final, opts, SEED, r"[^>\n]+", _SEED_PARAM)


MINIMAX = Tags.quoted('<invoke name="', "</invoke>", '<parameter name="', "</parameter>")
_MINIMAX_PARAM = _param(MINIMAX, '[^"]*', ".*?")


@reads(closers=(MINIMAX.call_close,), stream=markup(MINIMAX))
def minimax_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<invoke name="X"><parameter name="k">v</parameter></invoke>`` (MiniMax M2)."""
    return xml_function_calls(region, final, opts, MINIMAX, '[^"]*', _MINIMAX_PARAM)


DSML_MARKER = "｜DSML｜"
DSML = Tags.quoted(
    f'<{DSML_MARKER}invoke name="',
    f"</{DSML_MARKER}invoke>",
    f'<{DSML_MARKER}parameter name="',
    f"</{DSML_MARKER}parameter>",
    key_tails=(">", ' string="true">', ' string="false">'),
    modes=("schema", "raw", "json"),
)
_DSML_PARAM = re.compile(
    rf'{_e(DSML.param_open)}(?P<k>[^"]*)"(?: string="(?P<s>true|false)")?>(?P<v>.*?){_e(DSML.param_close)}',
    re.S,
)


@reads(closers=(DSML.call_close,), stream=markup(DSML))
def dsml_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """DeepSeek V3.2/V4 DSML: ``<｜DSML｜invoke name="X"><｜DSML｜parameter name="k" string="true">v...``."""
    return xml_function_calls(region, final, opts, DSML, '[^"]*', _DSML_PARAM)


#: the body reader gets its region back after "<function" (the region's start)
MINICPM = Tags.quoted(
    '<function name="',
    "</function>",
    '<param name="',
    "</param>",
    prefix="<function",
    cdata_close=True,
)
_MINICPM_PARAM = _param(MINICPM, '[^"]*', r"<!\[CDATA\[.*?\]\]>|.*?")


@reads(closers=(MINICPM.call_close,), stream=markup(MINICPM))
def minicpm5_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<function name="X"><param name="k">v</param></function>`` (MiniCPM5)."""
    return xml_function_calls(
        MINICPM.prefix + region, final, opts, MINICPM, '[^"]*', _MINICPM_PARAM
    )


MUSE = Tags.quoted(
    '<atem:invoke name="', "</atem:invoke>", '<atem:parameter name="', "</atem:parameter>"
)
_ATEM_PARAM = _param(MUSE, '[^"]*', ".*?")


@reads(closers=(MUSE.call_close,), stream=markup(MUSE))
def muse_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<atem:invoke name="X"><atem:parameter name="k">v</atem:parameter></atem:invoke>`` (Muse Glimmer)."""
    return xml_function_calls(region, final, opts, MUSE, '[^"]*', _ATEM_PARAM)


# --------------------------------------------------------------------------- Kimi K3

K3 = Tags(
    '<|open|>call tool="',
    "<|close|>call<|sep|>",
    '<|open|>argument key="',
    "<|close|>argument<|sep|>",
    name_stop='"',
    key_stop='"',
    bad="",
    name_tail_re=r"[^<]*",
    key_tail_re=r'(?: type="([^"]*)")?',
    tail_end="<|sep|>",
    cdata=False,
    strip_name=False,
)
_K3_ARG = re.compile(
    rf'{_e(K3.param_open)}(?P<k>[^"]*)"(?: type="(?P<t>[^"]*)")?{_e(K3.tail_end)}(?P<v>.*?){_e(K3.param_close)}',
    re.S,
)
_K3_CALL = rf'{_e(K3.call_open)}(?P<name>[^"]*)"[^<]*{_e(K3.tail_end)}(?P<body>.*?)(?P<close>{_e(K3.call_close)}|$)'


@reads(closers=(K3.call_close,), stream=markup(K3))
def kimi_k3_body(region: str, final: bool, opts: Options) -> list[ParsedCall]:
    """``<|open|>call tool="X" index="1"<|sep|><|open|>argument key="k" type="number"<|sep|>v<|close|>argument<|sep|>``."""

    def args_of(name: str, body: str) -> dict[str, object]:
        args: dict[str, object] = {}
        for a in _K3_ARG.finditer(body):
            t = a.group("t")
            types = (
                {"string"}
                if t == "string"
                else opts.param_types(name, a.group("k"))
                if t is None
                else {t, "integer"}
            )
            args[a.group("k")] = typed_value(a.group("v"), types)
        return args

    return invoke_calls(region, final, _K3_CALL, args_of)
