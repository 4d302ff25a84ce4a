"""A long-running agent process: idle conversations parked beside a request that decodes
alone, or kept in the unified KV pool (docs/cache.md).

    python benchmarks/bench_parking.py             # 3 rounds, SmolLM2

Three contenders, each in a fresh process per round, taking turns in alternating order:
``ChatLlamaCpp`` with its defaults (idle conversations parked in host RAM while one
request decodes alone), the same with ``prompt_cache_bytes=0`` (no host-RAM cache:
everything stays in the pool, as before parking existed), and ``Llama`` with its
defaults. Each runs the agent loop of ``bench_contention.py`` (2 conversations of 6
turns) 4 times in one process, the first as warm-up, so the pool has served earlier
conversations, as an agent's process does after a while; then one 96-token reply
(streamed, rate measured by the caller). Prints the medians (agent-loop time to first
token, decode tokens/s) and every run, with the CPU flags and thread settings, and
writes them to ``benchmarks/results/parking.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from bench_contention import smollm2_path  # noqa: E402
from machine import flags_line, machine_info, thread_settings, write_results  # noqa: E402

CONTENDERS = ("parked", "kept", "llama")


def child(contender: str) -> dict[str, Any]:
    import bench_contention as bc

    path = smollm2_path()
    c: Any
    if contender == "llama":
        c = bc._Llama(path)
    elif contender == "parked":
        c = bc._Ours(path)
    else:
        from langchain_llamacpp_local import ChatLlamaCpp

        c = bc._Ours.__new__(bc._Ours)  # the same contender, without the host-RAM cache
        c.llm = ChatLlamaCpp(
            model_path=path, n_ctx=4096, temperature=0, prompt_cache_bytes=0
        ).load()
        c.threads = c.llm.model_info.threads
    bc.agent_loop(c)
    ttfts = [bc.agent_loop(c)["agent_loop_ttft_s"] for _ in range(3)]
    return {
        "agent_loop_ttft_s": statistics.median(ttfts),
        "decode_tok_s": bc.decode(c)["decode_tok_s"],
        "threads": c.threads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=CONTENDERS)
    ap.add_argument("--out", type=Path, default=None, help="default: results/parking.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in CONTENDERS}
    for r in range(args.rounds):
        order = CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]
        for k in order:
            res = subprocess.run(
                [sys.executable, __file__, "--child", k],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            runs[k].append(json.loads(res.stdout.strip().splitlines()[-1]))
    info = machine_info(smollm2_path())
    print(flags_line(info))
    med = {
        k: {
            m: statistics.median(float(x[m]) for x in v)
            for m in ("agent_loop_ttft_s", "decode_tok_s")
        }
        for k, v in runs.items()
    }
    out = {
        "machine": info,
        "thread_settings": thread_settings(),
        "medians": med,
        "ttft_over_llama": {
            k: med[k]["agent_loop_ttft_s"] / med["llama"]["agent_loop_ttft_s"]
            for k in ("parked", "kept")
        },
        "runs": runs,
    }
    print(json.dumps(out, indent=2))
    write_results("parking", out, settings={"rounds": args.rounds}, out=args.out, machine=info)


if __name__ == "__main__":
    main()
