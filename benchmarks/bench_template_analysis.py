"""What learning a tool-call syntax from the template costs (no model needed).

- analysis: the differential analysis of each of llama.cpp's templates, against
  compiling the same template (both happen once per loaded model);
- parsing: ``tool_parsers.parse`` with the learned format ``auto`` against the
  hand-written ``hermes`` parser, on the same Hermes-style output.

    python benchmarks/bench_template_analysis.py [--quick]

Prints a JSON dict of figures (medians; ratios are learned / hand-written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from langchain_llamacpp_local.formats import parse  # noqa: E402
from langchain_llamacpp_local.formats.auto import analyze_template_full  # noqa: E402
from langchain_llamacpp_local.templates.chat_template import ChatTemplate  # noqa: E402

TEMPLATES = ROOT / "tests" / "data" / "llama_cpp_templates"
HERMES = "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"
OUTPUT = (
    "Let me look that up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    "<tool_call>\n"
    '{"name": "search_docs", "arguments": {"query": "hello world", "limit": 5}}\n</tool_call>'
)


def _time(fn: Callable[[], object], repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8 templates, fewer parse runs")
    ap.add_argument(
        "--out", type=Path, default=None, help="default: results/template_analysis.json"
    )
    args = ap.parse_args()
    paths = sorted(TEMPLATES.glob("*.jinja"))
    if args.quick:
        paths = paths[:: max(1, len(paths) // 8)]
    compile_s, analysis_s = [], []
    for p in paths:
        src = p.read_text(encoding="utf-8")
        t = time.perf_counter()
        tpl = ChatTemplate(src, origin=p.name)
        compile_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        analyze_template_full(tpl)
        analysis_s.append(time.perf_counter() - t)

    analysis = analyze_template_full(ChatTemplate((TEMPLATES / HERMES).read_text(encoding="utf-8")))
    repeat = 50 if args.quick else 500
    auto = _time(lambda: parse(OUTPUT, "auto", analysis=analysis), repeat)
    hermes = _time(lambda: parse(OUTPUT, "hermes"), repeat)
    figures = {
        "templates": len(paths),
        "compile_ms_median": round(1000 * statistics.median(compile_s), 2),
        "analysis_ms_median": round(1000 * statistics.median(analysis_s), 2),
        "analysis_ms_max": round(1000 * max(analysis_s), 2),
        "analysis_over_compile": round(
            statistics.median(analysis_s) / statistics.median(compile_s), 2
        ),
        "parse_auto_us": round(1e6 * auto, 1),
        "parse_hermes_us": round(1e6 * hermes, 1),
        "parse_auto_over_hermes": round(auto / hermes, 2),
    }
    print(json.dumps(figures, indent=2))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import write_results

    settings = {"quick": args.quick, "parse_repeats": repeat}
    write_results("template_analysis", figures, settings=settings, out=args.out)


if __name__ == "__main__":
    main()
