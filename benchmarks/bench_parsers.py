"""Streaming tool-call parser cost: time per streamed token for long generations.

``StreamParser`` re-scans the whole generation on every delta (as llama.cpp's server
re-parses it), so its cost grows with the output; this measures how much, per format,
for a reply of plain content followed by one tool call, fed 4 characters at a time
(about one token). Prints a JSON dict: microseconds per delta at each output length.
"""

from __future__ import annotations

import json
import time

from langchain_llamacpp_local.formats import StreamParser

CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
    "gpt_oss": '<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}',
}


def _run(fmt: str, n_chars: int) -> float:
    prefix = "<|channel|>final<|message|>" if fmt == "gpt_oss" else ""
    text = (
        prefix
        + ("The weather question needs a lookup. " * (n_chars // 37 + 1))[:n_chars]
        + CALLS[fmt]
    )
    sp = StreamParser(fmt)
    t = time.perf_counter()
    n = 0
    for i in range(0, len(text), 4):
        sp.feed(text[i : i + 4])
        n += 1
    sp.finish()
    assert sp.result.tool_calls, fmt
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    out = {
        f"{fmt}_us_per_delta_at_{n}_chars": round(_run(fmt, n), 1)
        for fmt in CALLS
        for n in (1000, 8000)
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
