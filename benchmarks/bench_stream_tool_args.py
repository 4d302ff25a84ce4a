"""``invoke`` with ``stream_tool_args=True`` against ``invoke`` without it, on one long call.

A scripted model (it prints one exact text in pieces of 32 characters, tests/printing_model.py) writes a Hermes tool
call whose argument is ``--kib`` KiB long; each round times ``invoke`` with and without
the option on fresh instances of the same loaded model, in turn, and the ratio of the
medians is the figure (the option must not make ``invoke`` re-read its own argument
fragments: linear, not quadratic, in the argument's length).

    python benchmarks/bench_stream_tool_args.py [--kib 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402

QWEN25 = (
    Path(__file__).resolve().parent.parent
    / "tests/data/llama_cpp_templates/Qwen-Qwen2.5-7B-Instruct.jinja"
)
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "f",
        "description": "Takes one string.",
        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
    },
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kib", type=int, default=32, help="the argument's length in KiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="results file (default results/<name>.json)")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import flags_line, machine_info, write_results

    from tests.printing_model import write_printing_llama

    words = args.kib * 1024 // 6
    note = " ".join(f"w{i:05d}" for i in range(words))
    text = f'<tool_call>\n{{"name": "f", "arguments": {{"a": "{note}"}}}}\n</tool_call>'
    with tempfile.TemporaryDirectory() as tmp:
        path, pieces = write_printing_llama(
            Path(tmp) / "long.gguf",
            text,
            chat_template=QWEN25.read_text(encoding="utf-8"),
            size=32,
            cuts=("<tool_call>",),
        )
        times: dict[bool, list[float]] = {False: [], True: []}

        def once(streamed: bool) -> float:
            llm = ChatLlamaCpp(
                model_path=str(path),
                temperature=0,
                n_ctx=len(pieces) + 2048,
                max_tokens=len(pieces) + 8,
                stream_tool_args=streamed,
            ).bind_tools([TOOL])
            t0 = time.perf_counter()
            reply = llm.invoke("go")
            took = time.perf_counter() - t0
            if [c["args"] for c in reply.tool_calls] != [{"a": note}]:
                raise SystemExit(f"wrong reply with stream_tool_args={streamed}")
            return took

        once(False)  # warm-up: the load and the first prompt
        for r in range(args.rounds):
            for streamed in (False, True) if r % 2 == 0 else (True, False):
                times[streamed].append(once(streamed))
        info = machine_info(str(path))
    plain, streamed = statistics.median(times[False]), statistics.median(times[True])
    result = {
        "argument_characters": len(note),
        "tokens": len(pieces),
        "invoke_s": {"stream_tool_args=False": times[False], "stream_tool_args=True": times[True]},
        "median_s": {"stream_tool_args=False": plain, "stream_tool_args=True": streamed},
        "ratio_streamed_over_plain": streamed / plain,
    }
    print(flags_line(info))
    print(
        f"{len(note)}-character argument, {len(pieces)} tokens: invoke {plain:.3f} s without "
        f"the option, {streamed:.3f} s with it ({streamed / plain:.2f}x)"
    )
    write_results(
        "stream_tool_args",
        result,
        settings={"kib": args.kib, "rounds": args.rounds},
        out=args.out,
        machine=info,
    )


if __name__ == "__main__":
    main()
