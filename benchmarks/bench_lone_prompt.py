"""A long prompt with nothing else running: this package against ``Llama``, and against
an earlier checkout of the package, in fresh processes taking turns.

    python benchmarks/bench_lone_prompt.py                     # ours against Llama
    python benchmarks/bench_lone_prompt.py --before ../old     # and an earlier checkout
    python benchmarks/bench_lone_prompt.py --quick             # tiny sizes: a smoke run

SmolLM2-135M-Instruct, ``n_ctx=8192``, one chat prompt of about ``--prompt-tokens``
(3,400) tokens, one token generated: the time is the prompt's read. Each contender runs
in a process of its own (the model loaded, one short warm-up call, then ``--prompts``
fresh prompts, none cached, the median kept); the contenders take turns for
``--rounds`` rounds so that a drift of the machine falls on all of them alike. Writes
``benchmarks/results/lone_prompt.json``; records the CPU flags and thread settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))

FILLER = (
    "The committee reviewed the quarterly figures for every warehouse in the northern "
    "region, noted the delays at the harbour and asked for a new schedule of deliveries. "
)


def prompt(i: int, words: int) -> list[dict[str, str]]:
    text = f"Report {i}. " + " ".join((FILLER * (words // 20 + 1)).split()[:words])
    return [{"role": "user", "content": text + "\nSummarise the report in one line."}]


def child(contender: str, root: str, n_prompts: int, words: int, n_ctx: int) -> None:
    """One contender in this process: the median seconds of a fresh prompt's read."""
    from bench_arrival import smollm2_path

    path = smollm2_path()
    times: list[float] = []
    n_tokens = None
    module = "llama_cpp"
    if contender == "llama":
        from llama_cpp import Llama

        llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=2, n_threads_batch=2, verbose=False)
        llm.create_chat_completion(prompt(-1, 8), max_tokens=1)
        for i in range(n_prompts):
            t0 = time.perf_counter()
            out = llm.create_chat_completion(prompt(i, words), max_tokens=1)
            times.append(time.perf_counter() - t0)
            n_tokens = out["usage"]["prompt_tokens"]
    else:
        sys.path.insert(0, root)
        import langchain_llamacpp_local
        from langchain_llamacpp_local import ChatLlamaCpp

        module = langchain_llamacpp_local.__file__
        llm = ChatLlamaCpp(model_path=path, n_ctx=n_ctx, max_tokens=1).load()
        llm.invoke(prompt(-1, 8))
        for i in range(n_prompts):
            t0 = time.perf_counter()
            msg = llm.invoke(prompt(i, words))
            times.append(time.perf_counter() - t0)
            n_tokens = (msg.usage_metadata or {}).get("input_tokens")
        llm.close()
    print(
        json.dumps(
            {
                "median_s": statistics.median(times),
                "times_s": times,
                "prompt_tokens": n_tokens,
                "module": module,
            }
        )
    )


def run_child(contender: str, root: Path, args: Any) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        contender,
        "--root",
        str(root),
        "--prompts",
        str(args.prompts),
        "--words",
        str(args.words),
        "--n-ctx",
        str(args.n_ctx),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=str(root))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("--before", default=None, help="an earlier checkout of the package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--words", type=int, default=2700, help="about 1.25 tokens a word")
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "lone_prompt.json"))
    args = ap.parse_args()
    if args.child:
        child(args.child, args.root, args.prompts, args.words, args.n_ctx)
        return
    if args.quick:
        args.rounds, args.prompts, args.words, args.n_ctx = 1, 1, 200, 1024
    from bench_arrival import git_commit, smollm2_path
    from machine import flags_line, machine_info, thread_settings, write_results

    info = machine_info(smollm2_path())
    print(flags_line(info))
    contenders: dict[str, Path] = {"ours": ROOT, "llama": ROOT}
    if args.before:
        contenders["before"] = Path(args.before).resolve()
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in contenders}
    for r in range(args.rounds):
        order = list(contenders)
        order = order[r % len(order) :] + order[: r % len(order)]
        for name in order:
            res = run_child("llama" if name == "llama" else "ours", contenders[name], args)
            runs[name].append(res)
            print(
                f"round {r + 1} {name}: {res['median_s']:.3f} s "
                f"({res['prompt_tokens']} prompt tokens)"
            )
    medians = {k: statistics.median(x["median_s"] for x in v) for k, v in runs.items()}
    ratios = {f"ours/{k}": medians["ours"] / medians[k] for k in medians if k != "ours"}
    per_round = {
        f"ours/{k}": [
            a["median_s"] / b["median_s"] for a, b in zip(runs["ours"], runs[k], strict=True)
        ]
        for k in runs
        if k != "ours"
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.3f} (rounds: {', '.join(f'{x:.3f}' for x in per_round[k])})")
    result = {
        "git_commit": git_commit(),
        "before": str(contenders.get("before")) if args.before else None,
        "runs": runs,
        "median_s": medians,
        "ratios": ratios,
        "per_round_ratios": per_round,
        "thread_settings": thread_settings(),
        "machine": info,
    }
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "child", "root")}
    write_results("lone_prompt", result, settings=settings, out=args.out, machine=info)


if __name__ == "__main__":
    main()
