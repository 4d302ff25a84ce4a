"""Streaming parser cost per token, at the start and at the end of a long generation.

For every output format (each family's record, ``auto`` learned from a template, and
plain content), a generation of reasoning, then content, then one tool call with a long
argument is fed to :class:`StreamParser` in token-sized pieces (3 and 4 characters in
turn). The cost per token (CPU time of the thread, the best of 3 runs) of the first 1,000
pieces (reasoning) is compared with that of the last 1,000 (the end of the call's
argument): a parser that reads again what it has
settled gets slower as the output grows. The end of generation (``finish``, which parses
the whole text once for the final result) is timed on its own.

Prints a table (format, first-1000 µs/token, last-1000 µs/token, ratio, finish ms) and
writes it as JSON to ``benchmarks/results/parsers.json``. Model-free and single-threaded.
``--tokens`` sets the stream's length (16,000 by default), ``--formats`` picks formats.
``--stream-args`` streams the call's arguments as they are written
(``stream_tool_args=True``; written to ``parsers_stream_args.json``) and compares the
first 1,000 tokens of the long argument with its last 1,000 (the call's end left out):
each token there does the argument stream's work, the same at the end of a long argument
as at its start.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from langchain_llamacpp_local.chat.prompts import resolve_format
from langchain_llamacpp_local.formats import FORMATS, StreamParser
from langchain_llamacpp_local.formats.registry import FAMILIES
from langchain_llamacpp_local.templates.chat_template import ChatTemplate

#: one tool call per format, ``{ARG}`` the long argument's place
DSML_MARKER = "｜DSML｜"
HY_MARKER = ":opensource"
MM_MARKER = "]<]minimax[>["
_JSON = '{"name": "get_weather", "arguments": {"city": "{ARG}"}}'
CALLS: dict[str, str] = {
    "hermes": f"<tool_call>\n{_JSON}\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\n{ARG}\n</parameter>\n"
    "</function>\n</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "{ARG}"}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "{ARG}"}',
    "pythonic": '<|tool_call_start|>[get_weather(city="{ARG}")]<|tool_call_end|>',
    "granite": f"<|tool_call|>[{_JSON}]",
    "functionary_v3_2": '>>>get_weather\n{"city": "{ARG}"}',
    "deepseek_r1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "{ARG}"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "command_r7b": '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
    '"parameters": {"city": "{ARG}"}}]<|END_ACTION|>',
    "gpt_oss": "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
    '<|constrain|>json<|message|>{"city": "{ARG}"}',
    "generic": '{"tool_call": {"name": "get_weather", "arguments": {"city": "{ARG}"}}}',
    "content": "",
    "ministral_3": '[TOOL_CALLS]get_weather[ARGS]{"city": "{ARG}"}',
    "seed_oss": "<seed:tool_call>\n<function=get_weather>\n<parameter=city>{ARG}</parameter>\n"
    "</function>\n</seed:tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{ARG}</arg_value>\n"
    "</tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
    "{ARG}</parameter>\n</invoke>\n</minimax:tool_call>",
    "deepseek_v3_1": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "{ARG}"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "deepseek_v3_2": f'<{DSML_MARKER}function_calls>\n<{DSML_MARKER}invoke name="get_weather">\n'
    f'<{DSML_MARKER}parameter name="city" string="true">{{ARG}}</{DSML_MARKER}parameter>\n'
    f"</{DSML_MARKER}invoke>\n</{DSML_MARKER}function_calls>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "{ARG}"}<|tool_call_end|><|tool_calls_section_end|>',
    "nemotron_v2": f"<TOOLCALL>[{_JSON}]</TOOLCALL>",
    "apertus": '<|tools_prefix|>[{"get_weather": {"city": "{ARG}"}}]<|tools_suffix|>',
    "apriel": f"<tool_calls>[{_JSON}]</tool_calls>",
    "firefunction_v2": f" functools[{_JSON}]",
    "functionary_v3_1": '<function=get_weather>{"city": "{ARG}"}</function>',
    "cohere2moe": '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", '
    '"parameters": {"city": "{ARG}"}}]<|END_ACTION|>',
    "command_r_plus": 'Action: ```json\n[{"tool_name": "get_weather", "parameters": '
    '{"city": "{ARG}"}}]\n```',
    "minimax_m1": f"<tool_calls>\n{_JSON}\n</tool_calls>",
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>{ARG}<|"|>}<tool_call|>',
    "minimax_m3": f'{MM_MARKER}<tool_call>{MM_MARKER}<invoke name="get_weather">{MM_MARKER}<city>{{ARG}}{MM_MARKER}</city>'
    f"{MM_MARKER}</invoke>{MM_MARKER}</tool_call>",
    "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>{ARG}<|close|>argument<|sep|>'
    "<|close|>call<|sep|><|close|>tools<|sep|>",
    "gigachat_v3": f"<|message_sep|>\n\nfunction call<|role_sep|>\n{_JSON}",
    "gigachat_v3_1": f"<|function_call|>{_JSON}",
    "muse_glimmer": "<|eom|><|start|>assistant to=functions<|message|><atem:function_calls>"
    '<atem:invoke name="get_weather"><atem:parameter name="city">{ARG}</atem:parameter>'
    "</atem:invoke></atem:function_calls><|eom|>",
    "hy3": f"<tool_calls{HY_MARKER}>\n<tool_call{HY_MARKER}>get_weather<tool_sep{HY_MARKER}>\n<arg_key{HY_MARKER}>city"
    f"</arg_key{HY_MARKER}>\n<arg_value{HY_MARKER}>{{ARG}}</arg_value{HY_MARKER}>\n</tool_call{HY_MARKER}>\n"
    f"</tool_calls{HY_MARKER}>",
    "solar_open": "<|tool_calls|><|tool_call:begin|>abc<|tool_call:name|>get_weather"
    '<|tool_call:args|>{"city": "{ARG}"}<|tool_call:end|>',
    "minicpm5": '<function name="get_weather"><param name="city">{ARG}</param></function>',
    "auto": f"<call>{_JSON}</call>",
}
#: a made-up template whose syntax (``<call>{json}</call>``) the analysis learns
AUTO_TEMPLATE = (
    "{%- if tools %}<|sys|>Tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<call>"
    '{{ {"name": tc.function.name, "arguments": tc.function.arguments} | tojson }}</call>'
    "{% endfor %}{%- else %}{{ m.content }}{% endif %}<|end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
#: formats whose call is the whole output (no content before it)
WHOLE = {"generic"}
PROSE = "The weather question needs a lookup, so the city comes first. "


def _think(fmt: str) -> tuple[str, str] | None:
    """The format's think-block markers as a generation writes them (None: it has none)."""
    if fmt == "gpt_oss":
        return (
            "<|channel|>analysis<|message|>",
            "<|end|><|start|>assistant<|channel|>final<|message|>",
        )
    if fmt == "muse_glimmer":
        return " to=self<|message|>", "<|eom|><|start|>assistant to=user<|message|>"
    if fmt == "auto":
        return None
    family = FAMILIES[fmt]
    if family.spec is None:
        return "<think>", "</think>"
    return family.spec.think


def _text(fmt: str, n_chars: int) -> tuple[str, str]:
    """A generation of about ``n_chars``: reasoning, content, a call (its long argument)."""
    third = n_chars // 3
    arg = (PROSE * (third // len(PROSE) + 1))[:third].strip()
    think = _think(fmt)
    lead = ""
    if think is not None:
        start, end = think
        reasoning = (PROSE * (third // len(PROSE) + 1))[:third]
        lead = (start if fmt != "apriel" else "") + reasoning + end
    content = "" if fmt in WHOLE else (PROSE * (third // len(PROSE) + 1))[:third]
    if fmt == "muse_glimmer" and think is None:
        content = " to=user<|message|>" + content
    call = CALLS[fmt].replace("{ARG}", arg)
    return lead + content + call, arg


def _pieces(text: str) -> list[str]:
    out, pos, k = [], 0, 0
    while pos < len(text):
        size = 3 + k % 2
        out.append(text[pos : pos + size])
        pos, k = pos + size, k + 1
    return out


def _stream(
    fmt: str,
    pieces: list[str],
    kwargs: dict[str, Any],
    window: int,
    stream_args: bool = False,
    start: int = 0,
    end: int | None = None,
) -> tuple[float, float, float, StreamParser]:
    """CPU seconds of ``window`` feeds from piece ``start`` on, of the ``window`` feeds
    before piece ``end`` (the last ones by default) and of ``finish``."""
    sp = StreamParser(fmt, **kwargs, stream_args=stream_args)
    feed, clock = sp.feed, time.thread_time
    end = len(pieces) if end is None else end
    for p in pieces[:start]:
        feed(p)
    t = clock()
    for p in pieces[start : start + window]:
        feed(p)
    first = clock() - t
    for p in pieces[start + window : end - window]:
        feed(p)
    t = clock()
    for p in pieces[end - window : end]:
        feed(p)
    last = clock() - t
    for p in pieces[end:]:
        feed(p)
    t = clock()
    sp.finish()
    return first, last, clock() - t, sp


def make_stream(fmt: str, n_tokens: int) -> tuple[list[str], dict[str, Any], str]:
    """The pieces of a generation of about ``n_tokens`` tokens, the parser's options and
    the call's long argument."""
    text, arg = _text(fmt, int(n_tokens * 3.5))
    kwargs: dict[str, Any] = {"reasoning": True}
    if fmt == "auto":
        _, kwargs["analysis"] = resolve_format(ChatTemplate(AUTO_TEMPLATE, origin="bench"))
        kwargs["reasoning"] = None
    if fmt == "apriel":
        kwargs["think_open"] = True
    return _pieces(text), kwargs, arg


def run(
    fmt: str, n_tokens: int, window: int = 1000, repeat: int = 3, stream_args: bool = False
) -> dict[str, Any]:
    pieces, kwargs, arg = make_stream(fmt, n_tokens)
    text = "".join(pieces)
    window = min(window, len(pieces) // 3)
    start, end = 0, None
    if stream_args and fmt != "content":  # both windows inside the streamed argument
        ends = [sum(len(p) for p in pieces[: k + 1]) for k in range(len(pieces))]
        at = text.index(arg)
        start = next(k for k, e in enumerate(ends) if e > at) + 1
        end = next(k for k, e in enumerate(ends) if e >= at + len(arg)) - 1
        window = min(window, (end - start) // 3)
    # CPU time of this thread (other processes on a shared machine do not count), the
    # best of a few runs
    runs = [_stream(fmt, pieces, kwargs, window, stream_args, start, end) for _ in range(repeat)]
    first = min(r[0] for r in runs) / window * 1e6
    last = min(r[1] for r in runs) / window * 1e6
    finish_s = min(r[2] for r in runs)
    sp = runs[0][3]
    if fmt != "content":
        calls = sp.result.tool_calls
        assert len(calls) == 1 and calls[0]["name"] == "get_weather", (fmt, sp.result)
        assert calls[0]["args"] == {"city": arg}, (fmt, str(calls[0]["args"])[:200])
    return {
        "format": fmt,
        "tokens": len(pieces),
        "chars": len(text),
        "first_us_per_token": round(first, 2),
        "last_us_per_token": round(last, 2),
        "ratio": round(last / first, 2),
        "finish_ms": round(finish_s * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16000)
    ap.add_argument("--formats", nargs="*", default=list(FORMATS))
    ap.add_argument("--stream-args", action="store_true", help="stream_tool_args=True")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'format':18} {'first µs/tok':>13} {'last µs/tok':>12} {'ratio':>6} {'finish ms':>10}")
    for fmt in args.formats:
        row = run(fmt, args.tokens, stream_args=args.stream_args)
        rows.append(row)
        print(
            f"{fmt:18} {row['first_us_per_token']:13.2f} {row['last_us_per_token']:12.2f} "
            f"{row['ratio']:6.2f} {row['finish_ms']:10.2f}",
            flush=True,
        )
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"worst ratio: {worst['format']} {worst['ratio']}")
    from machine import write_results  # benchmarks/ is the script's own folder

    name = "parsers_stream_args" if args.stream_args else "parsers"
    summary = {"tokens": args.tokens, "stream_args": args.stream_args, "rows": rows}
    settings = {"tokens": args.tokens, "formats": args.formats, "stream_args": args.stream_args}
    write_results(name, summary, settings=settings, out=args.out)


if __name__ == "__main__":
    main()
