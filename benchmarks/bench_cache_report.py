"""What the cache report costs on a hit: the extra work per request, beside a turn.

    python benchmarks/bench_cache_report.py            # the full run (SmolLM2-135M-Instruct)
    python benchmarks/bench_cache_report.py --quick    # tiny sizes: a smoke run of the script

On a hit (the whole cached prompt is a prefix of the new one) the report adds, per
request: on the worker one prefix comparison of the prompt with the chosen candidate
(``common_prefix_len``, block-wise) and a dict; on the front end the bookkeeping of the
template-argument check (hashing the conversation's opening turn and the template
arguments, one LRU update) and the miss-warning test, but no rendering and no
detokenizing (``explain_miss`` runs on a miss only). Recorded: the median time of that
comparison for the prompt's length, the median time of the front end's bookkeeping for
the same conversation, the median time of a hit turn (``invoke`` of a conversation one
turn longer than the cached one), the ratio of their sum to the turn, and a check that
no hit turn ran ``explain_miss``. Goal: the ratio below 0.1 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage  # noqa: E402

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402
from langchain_llamacpp_local.cache.slots import common_prefix_len  # noqa: E402
from langchain_llamacpp_local.chat import cache_report, frontend  # noqa: E402


def _convo(turns: int, system_chars: int) -> list[BaseMessage]:
    msgs: list[BaseMessage] = [SystemMessage(("A long system prompt. " * 200)[:system_chars])]
    for i in range(turns):
        msgs += [HumanMessage(f"question {i}"), AIMessage(f"answer {i}")]
    return [*msgs, HumanMessage(f"question {turns}")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="default: results/cache_report.json")
    args = ap.parse_args()
    if args.quick:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tests.gguf_models import write_tiny_llama

        model = str(write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny.gguf"))
        turns, system_chars = 3, 400
    else:
        from tests.conftest import smollm2_path

        model = args.model or smollm2_path()
        turns, system_chars = 12, 4000
    llm = ChatLlamaCpp(model_path=model, temperature=0.0, max_tokens=1, n_slots=1)
    explained = 0
    original = frontend.Frontend.explain_miss

    def counting(self: Any, *a: Any) -> Any:
        nonlocal explained
        explained += 1
        return original(self, *a)

    frontend.Frontend.explain_miss = counting  # type: ignore[method-assign]
    turn_s: list[float] = []
    n_prompt = 0
    llm.invoke(_convo(0, system_chars))
    for t in range(1, turns + 1):
        t0 = time.perf_counter()
        msg = llm.invoke(_convo(t, system_chars))
        turn_s.append(time.perf_counter() - t0)
        n_prompt = msg.usage_metadata["input_tokens"]  # type: ignore[index]
    tokens = list(range(n_prompt))
    cached = tokens[:-8]
    cmp_s = []
    for _ in range(200):
        t0 = time.perf_counter()
        common_prefix_len(cached, tokens)
        cmp_s.append(time.perf_counter() - t0)
    # the front end's per-call work on a hit, on the template messages of the last turn
    job = llm._make_job(_convo(turns, system_chars), None, {})
    last = cache_report.LastKwargs()
    warned = cache_report.MissWarnings()
    hit = {"source": "slot", "mismatch": [], "at": n_prompt}
    usage = {"input_tokens": n_prompt, "input_token_details": {"cache_read": n_prompt - 8}}
    fe_s = []
    for _ in range(200):
        t0 = time.perf_counter()
        last.changed(
            cache_report.conversation_key(job.messages),
            cache_report.job_kwargs_key(job),
        )
        cache_report.warn_on_miss(hit, usage, 0, job.messages, warned)
        fe_s.append(time.perf_counter() - t0)
    report_s = statistics.median(cmp_s) + statistics.median(fe_s)
    result = {
        "model": model,
        "prompt_tokens": n_prompt,
        "turn_median_s": statistics.median(turn_s),
        "report_compare_median_s": statistics.median(cmp_s),
        "report_frontend_median_s": statistics.median(fe_s),
        "ratio": report_s / statistics.median(turn_s),
        "explain_miss_calls_on_hits": explained,
    }
    print(json.dumps(result, indent=2))
    print(
        f"cache report on a hit: {report_s * 1e6:.1f} us of a {statistics.median(turn_s) * 1e3:.1f}"
        f" ms turn ({result['ratio']:.4%}); explain_miss ran {explained} times on hits"
    )
    if not args.quick:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from machine import write_results

        settings = {"model": Path(model).name, "turns": turns, "system_chars": system_chars}
        write_results("cache_report", result, settings=settings, out=args.out)


if __name__ == "__main__":
    main()
