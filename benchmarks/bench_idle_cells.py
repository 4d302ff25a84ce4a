"""What idle conversations kept in llama.cpp's memory cost two running streams.

    python benchmarks/bench_idle_cells.py        # writes results/idle_cells.json

Two SmolLM2 streams generate 200 tokens each, together, with 0, 1 or 2 idle
conversations of about 3,000 tokens left in the KV memory by earlier requests (read
together, so neither decodes alone and the package keeps both in the pool). Per case:
the streams' median gap between two tokens (they share each step's decode call, so it
is the step's time) and the cells the pool held (``ModelWorker.stats()``). Run for the
default unified pool (``kv_unified=True``: one pool of ``n_ctx`` cells, where every row
attends over every cell in use, other conversations' masked ones included, unless
flash attention is on) and for per-slot streams (``kv_unified=False``: each slot its
own ``n_ctx`` cells, a row attends only its own conversation's). Each case is a fresh
process-local model. Records the CPU flags and thread settings (benchmarks/machine.py).
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
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from bench_arrival import TWO_STREAMS, long_prompt, smollm2_path  # noqa: E402
from machine import flags_line, machine_info, thread_settings, write_results  # noqa: E402

from tests.helpers import worker_of  # noqa: E402

IDLE_TOKENS = 3000
STREAM_TOKENS = 200


def _stream(llm: Any, prompt: str, times: list[float]) -> None:
    for chunk in llm.stream(prompt, max_tokens=STREAM_TOKENS):
        if chunk.content:
            times.append(time.perf_counter())


def _together(fns: list[Any]) -> None:
    threads = [threading.Thread(target=f) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def one_case(path: str, unified: bool, n_idle: int, n_idle_tokens: int) -> dict[str, Any]:
    from langchain_llamacpp_local import ChatLlamaCpp

    llm = ChatLlamaCpp(
        model_path=path, n_slots=4, n_ctx=8192, kv_unified=unified, temperature=0.8, seed=1
    ).load()
    try:
        _stream(llm, "Warm up.", [])  # the first calls of a fresh context
        idle = [f"Document {i}.\n" + long_prompt(llm, n_idle_tokens) for i in range(n_idle)]
        _together([lambda p=p: llm.invoke(p, max_tokens=1) for p in idle])
        worker = worker_of(llm)
        assert worker is not None
        held_before = sum(s.n_past for s in worker.stats().slots)
        times: list[list[float]] = [[] for _ in TWO_STREAMS]
        _together(
            [lambda p=p, t=t: _stream(llm, p, t) for p, t in zip(TWO_STREAMS, times, strict=True)]
        )
        gaps = [(b - a) * 1000 for ts in times for a, b in zip(ts, ts[1:], strict=False)]
        return {
            "kv_unified": unified,
            "idle_conversations": n_idle,
            "cells_held_before_streams": held_before,
            "median_gap_ms": statistics.median(gaps),
            "stream_tokens": [len(t) for t in times],
        }
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--idle-tokens", type=int, default=IDLE_TOKENS)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = smollm2_path()
    info = machine_info(path)
    print(flags_line(info))
    cases = []
    for _ in range(args.rounds):
        for unified in (True, False):
            for n_idle in (0, 1, 2):
                r = one_case(path, unified, n_idle, args.idle_tokens)
                cases.append(r)
                print(
                    f"{'unified' if unified else 'per-slot'}: {n_idle} idle "
                    f"({r['cells_held_before_streams']} cells held): two streams' step "
                    f"{r['median_gap_ms']:.1f} ms (median gap)"
                )
    result = {"cases": cases, "thread_settings": thread_settings(), "machine": info}
    settings = {
        "idle_tokens": args.idle_tokens,
        "stream_tokens": STREAM_TOKENS,
        "n_ctx": 8192,
        "n_slots": 4,
        "rounds": args.rounds,
    }
    write_results("idle_cells", result, settings=settings, out=args.out, machine=info)


if __name__ == "__main__":
    main()
