"""What one idle OpenMP helper pool costs a chat model's decode (docs/configuration.md#threads).

    python benchmarks/bench_omp_pool.py            # 12 alternating replies, SmolLM2

The main thread starts a no-op parallel region of 2 threads (libgomp's ``GOMP_parallel``
with libc's ``free`` on NULL), so it holds a pool of one helper doing nothing, or ends it
(``omp_pause_resource_all``); a ``ChatLlamaCpp`` reply of 96 greedy tokens is decoded in
each state, the two taking turns. The package's own release is switched off here, so the
worker keeps its pool as it did before the release existed: with 2 usable CPUs, the two
pools then outnumber them and libgomp shortens every barrier's spin. Prints the median
reply decode rate (its ``timings``) in each state, with the CPU flags and threads.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from bench_contention import smollm2_path  # noqa: E402
from machine import (  # noqa: E402
    STORY_PROMPT,
    flags_line,
    machine_info,
    thread_settings,
    write_results,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replies", type=int, default=12)
    ap.add_argument("--out", type=Path, default=None, help="default: results/omp_pool.json")
    args = ap.parse_args()

    from langchain_llamacpp_local import ChatLlamaCpp
    from langchain_llamacpp_local.llama import omp

    pause = omp._pause()
    if pause is None:
        sys.exit("llama.cpp is not built with libgomp here: nothing to measure")
    omp._pause = lambda: None  # type: ignore[assignment]  # the worker keeps its pool
    lib = ctypes.CDLL(None)
    parallel = ctypes.CDLL("libgomp.so.1").GOMP_parallel
    parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    free = ctypes.cast(lib.free, ctypes.c_void_p)

    llm = ChatLlamaCpp(model_path=smollm2_path(), n_ctx=1024, temperature=0).load()
    rates: dict[str, list[float]] = {"one idle pool beside": [], "none": []}
    for i in range(args.replies):
        if i % 2 == 0:
            parallel(free, None, 2, 0)
            state = "one idle pool beside"
        else:
            pause(1)
            state = "none"
        msg = llm.invoke(STORY_PROMPT, max_tokens=96, stop=[])
        rates[state].append(msg.response_metadata["timings"]["predicted_per_second"])
    info = machine_info(smollm2_path())
    print(flags_line(info))
    out = {
        "machine": info,
        "threads": llm.model_info.threads,
        "thread_settings": thread_settings(),
        "decode_tok_s": {k: statistics.median(v) for k, v in rates.items()},
        "runs": rates,
    }
    print(json.dumps(out, indent=2))
    settings = {"replies": args.replies, "max_tokens": 96, "n_ctx": 1024}
    write_results("omp_pool", out, settings=settings, out=args.out, machine=info)


if __name__ == "__main__":
    main()
