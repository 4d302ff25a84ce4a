"""Flash attention on the CPU, on and off (docs/configuration.md, ``flash_attn``).

    python benchmarks/bench_flash_attn.py          # SmolLM2 and Gemma 3 270M, 3 rounds

Per model, two contexts that differ only in ``flash_attn``, taking turns (2 threads):

* a bare loop (``Engine``, no request path): a 3,000-token prompt read in ``n_batch``
  pieces (tokens/s), then 32 greedy tokens decoded over that history (tokens/s);
* ``ChatLlamaCpp`` (4 slots, one unified KV cache): a 96-token reply from a fresh
  context, then again after 3 other conversations of about 800 tokens were cached
  (their cells are masked for the reply: flash attention skips them, the
  matrix-multiply path attends over them). ``prompt_cache_bytes=0`` keeps them in
  their slots: with the host-RAM cache a request decoding alone has them parked.

Prints the medians and every run, with the CPU flags and thread settings.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from bench_contention import SYSTEM, gemma_path, smollm2_path  # noqa: E402
from machine import (  # noqa: E402
    STORY_PROMPT,
    flags_line,
    machine_info,
    thread_settings,
    write_results,
)

ROUNDS = 3


def bare(path: str) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    from langchain_llamacpp_local.llama.engine import Engine
    from langchain_llamacpp_local.llama.loading import LoadConfig

    engs = {
        fa: Engine(
            LoadConfig(model_path=path, n_ctx=4096, n_threads=2, n_threads_batch=2, flash_attn=fa)
        )
        for fa in (False, True)
    }
    text = "The harbour is busy with fishing boats and the gulls cry. " * 300
    toks = engs[False].tokenize(text, add_special=True)[:3000]
    runs: dict[str, dict[str, list[float]]] = {
        k: {"prompt_tok_s": [], "decode_at_3000_tok_s": []} for k in ("off", "on")
    }
    try:
        for _ in range(ROUNDS):
            for fa, eng in engs.items():
                r = runs["on" if fa else "off"]
                eng.clear()
                t0 = time.perf_counter()
                eng.decode(toks, 0, 0)
                r["prompt_tok_s"].append(len(toks) / (time.perf_counter() - t0))
                pos = len(toks)
                t0 = time.perf_counter()
                for _ in range(32):
                    row = llama_cpp.llama_get_logits_ith(eng.ctx, -1)
                    tok = int(np.ctypeslib.as_array(row, shape=(eng.n_vocab,)).argmax())
                    eng.decode([tok], pos, 0)
                    pos += 1
                r["decode_at_3000_tok_s"].append(32 / (time.perf_counter() - t0))
    finally:
        for eng in engs.values():
            eng.close()
    return runs


def chat(path: str) -> dict[str, Any]:
    from langchain_core.messages import HumanMessage

    from langchain_llamacpp_local import ChatLlamaCpp

    llms = {
        k: ChatLlamaCpp(
            model_path=path, n_ctx=4096, temperature=0, flash_attn=fa, prompt_cache_bytes=0
        ).load()
        for k, fa in (("off", False), ("on", True))
    }

    def rate(llm: Any) -> float:
        msg = llm.invoke(STORY_PROMPT, max_tokens=96, stop=[])
        return float(msg.response_metadata["timings"]["predicted_per_second"])

    runs: dict[str, dict[str, list[float]]] = {
        k: {"reply_fresh_tok_s": [], "reply_beside_3_cached_tok_s": []} for k in llms
    }
    try:
        for k, llm in llms.items():
            runs[k]["reply_fresh_tok_s"].append(rate(llm))
            for j in range(3):
                convo = [HumanMessage(f"Conversation {j}. " + SYSTEM * 6 + " Summarise.")]
                llm.invoke(convo, max_tokens=4)
        for _ in range(ROUNDS):
            for k, llm in llms.items():
                runs[k]["reply_beside_3_cached_tok_s"].append(rate(llm))
    finally:
        for llm in llms.values():
            llm.close()
    return runs


def main() -> None:
    out: dict[str, Any] = {"thread_settings": thread_settings(), "models": {}}
    for name, path in (("SmolLM2-135M-Instruct", smollm2_path()), ("Gemma 3 270M", gemma_path())):
        info = machine_info(path)
        print(name, flags_line(info), flush=True)
        runs = {**bare(path)}
        for k, v in chat(path).items():
            runs[k].update(v)
        out["models"][name] = {
            "machine": info,
            "median": {k: {m: statistics.median(x) for m, x in v.items()} for k, v in runs.items()},
            "runs": runs,
        }
        print(json.dumps(out["models"][name]["median"], indent=2), flush=True)
    write_results("flash_attn", out, settings={"models": list(out["models"])})


if __name__ == "__main__":
    main()
