"""Sub-agents that share a long preamble: how many generate at once, and in what time.

    python benchmarks/bench_shared_prefix.py          # writes results/shared_prefix.json
    python benchmarks/bench_shared_prefix.py --quick  # tiny sizes: a smoke run

SmolLM2-135M-Instruct, one unified KV pool of ``--n-ctx`` (8,192) positions and
``--agents`` (5) slots. Every agent streams an answer of ``--reply`` (48) tokens to a
question of its own after the same system prompt of about ``--preamble`` (4,000)
tokens (one tool list and instructions, the common shape of a multi-agent app). The
agents are started together from threads (each waits on one barrier); recorded per
agent: its first and last token. Reported: the most agents generating at once (their
first-to-last-token spans overlapping), the batch's total time, and the same agents
asked one at a time (the preamble then read once and reused from the cache by the
others: the sum of their times), so the batch's speed-up over one at a time; and the
same for as many unrelated short prompts, the speed-up batching gives where nothing is
shared (goal: the sub-agents' at least that). A fresh preamble each round (a round
number opens it), so every round reads it once. Public API only: the same script
measures any version of the package. Settings and the git commit are recorded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_arrival import git_commit, smollm2_path  # noqa: E402

RULES = (
    "You are one of several worker agents. Follow the team's rules: cite the record you "
    "used, keep answers short, never invent a record, ask the planner when unsure, and "
    "report the tool you would call with its arguments. "
)
TOPICS = ("boats", "mountains", "clocks", "bread", "rivers", "trains", "bees", "glass")


def preamble(llm: Any, round_no: int, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens that no earlier round used."""
    head = f"Session {round_no}. "
    per = max(1, len(llm.get_token_ids(RULES)))
    return head + RULES * max(1, tokens // per)


def _agent(
    llm: Any, messages: list[Any], reply: int, barrier: threading.Barrier, out: dict
) -> None:
    barrier.wait()
    t0 = time.perf_counter()
    times: list[float] = []
    for chunk in llm.stream(messages, max_tokens=reply):
        if chunk.content:
            times.append(time.perf_counter())
    out.update(start=t0, first=times[0] if times else None, last=times[-1] if times else None)
    out["tokens"] = len(times)


def together(llm: Any, conversations: list[list[Any]], reply: int) -> dict[str, Any]:
    """All ``conversations`` started at once: spans, overlap, total time."""
    barrier = threading.Barrier(len(conversations))
    outs: list[dict[str, Any]] = [{} for _ in conversations]
    threads = [
        threading.Thread(target=_agent, args=(llm, m, reply, barrier, o))
        for m, o in zip(conversations, outs, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    start = min(o["start"] for o in outs)
    spans = [(o["first"], o["last"]) for o in outs if o.get("first") is not None]
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    running = most = 0
    for _, d in events:
        running += d
        most = max(most, running)
    return {
        "total_ms": (max(b for _, b in spans) - start) * 1000 if spans else None,
        "most_at_once": most,
        "spans_ms": [[round((a - start) * 1000), round((b - start) * 1000)] for a, b in spans],
        "tokens": [o.get("tokens") for o in outs],
    }


def one_at_a_time(llm: Any, conversations: list[list[Any]], reply: int) -> float:
    t0 = time.perf_counter()
    for m in conversations:
        llm.invoke(m, max_tokens=reply)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--preamble", type=int, default=4000)
    ap.add_argument("--reply", type=int, default=48)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-limit", action="store_true", help="skip the raw llama.cpp batching limit")
    ap.add_argument("--out", default=str(RESULTS / "shared_prefix.json"))
    args = ap.parse_args()
    if args.quick:
        # the preamble once fits; three copies of it would not
        args.agents, args.preamble, args.reply, args.n_ctx, args.rounds = 3, 300, 8, 768, 1

    from langchain_core.messages import HumanMessage, SystemMessage
    from machine import flags_line, machine_info, thread_settings, write_results

    from langchain_llamacpp_local import ChatLlamaCpp

    path = smollm2_path()
    info = machine_info(path)
    print(flags_line(info))
    llm = ChatLlamaCpp(
        model_path=path, n_slots=args.agents, n_ctx=args.n_ctx, temperature=0.0
    ).load()
    questions = [f"In one sentence: what do you know about {t}?" for t in TOPICS]
    rounds = []
    round_no = 0
    threads = llm.model_info.threads
    try:
        llm.invoke("Hello", max_tokens=4)  # warm-up
        for _ in range(args.rounds):
            round_no += 1
            system = SystemMessage(preamble(llm, round_no, args.preamble))
            agents = [
                [system, HumanMessage(questions[i % len(questions)])] for i in range(args.agents)
            ]
            n_prompt = llm.render_prompt(agents[0]).n_tokens
            batch = together(llm, agents, args.reply)
            round_no += 1
            system = SystemMessage(preamble(llm, round_no, args.preamble))
            agents = [
                [system, HumanMessage(questions[i % len(questions)])] for i in range(args.agents)
            ]
            serial = one_at_a_time(llm, agents, args.reply)
            unrelated = [
                [HumanMessage(f"Round {round_no}, item {i}. " + questions[i % len(questions)])]
                for i in range(args.agents)
            ]
            round_no += 1
            short_batch = together(llm, unrelated, args.reply)
            unrelated = [
                [HumanMessage(f"Round {round_no}, item {i}. " + questions[i % len(questions)])]
                for i in range(args.agents)
            ]
            short_serial = one_at_a_time(llm, unrelated, args.reply)
            r = {
                "prompt_tokens": n_prompt,
                "agents": batch,
                "agents_one_at_a_time_ms": serial,
                "agents_speedup": serial / batch["total_ms"] if batch["total_ms"] else None,
                "short": short_batch,
                "short_one_at_a_time_ms": short_serial,
                "short_speedup": short_serial / short_batch["total_ms"]
                if short_batch["total_ms"]
                else None,
            }
            rounds.append(r)
            print(
                f"{args.agents} agents after {n_prompt} prompt tokens: {batch['most_at_once']} "
                f"at once, {batch['total_ms']:.0f} ms together against {serial:.0f} ms one at "
                f"a time ({r['agents_speedup']:.2f}x); {args.agents} short unrelated prompts: "
                f"{r['short_speedup']:.2f}x"
            )
        preamble_text = llm.render_prompt(
            [SystemMessage(preamble(llm, round_no + 1, args.preamble))]
        ).text
        question_texts = [questions[i % len(questions)] for i in range(args.agents)]
    finally:
        llm.close()
    limit = None
    if not args.no_limit:
        from raw_batching import batching_limit

        limit = batching_limit(
            path,
            preamble_text=preamble_text,
            questions=question_texts,
            reply=args.reply,
            n_ctx=args.n_ctx,
            n_threads=threads.get("n_threads", 2) if isinstance(threads, dict) else 2,
            rounds=args.rounds,
        )
        print(
            f"raw llama.cpp, {args.agents} sequences at once over one at a time: after the "
            f"shared preamble {limit['long_speedup']:.2f}x ({limit['with_preamble_speedup']:.2f}x "
            f"counting its read), short prompts {limit['short_speedup']:.2f}x"
        )
    speedups = [r["agents_speedup"] for r in rounds if r["agents_speedup"]]
    shorts = [r["short_speedup"] for r in rounds if r["short_speedup"]]
    result = {
        "model": Path(path).name,
        "git_commit": git_commit(),
        "settings": {
            "agents": args.agents,
            "n_slots": args.agents,
            "preamble_tokens_about": args.preamble,
            "reply": args.reply,
            "n_ctx": args.n_ctx,
            "rounds": args.rounds,
            "quick": args.quick,
        },
        "most_at_once": min((r["agents"]["most_at_once"] for r in rounds), default=0),
        "median_agents_speedup": statistics.median(speedups) if speedups else None,
        "median_short_speedup": statistics.median(shorts) if shorts else None,
        "goal": "all agents at once; agents' speed-up >= the short prompts' speed-up",
        "raw_llamacpp_limit": limit,
        "rounds": rounds,
        "threads": threads,
        "thread_settings": thread_settings(),
        "machine": info,
    }
    settings = result.pop("settings", None) or {k: v for k, v in vars(args).items() if k != "out"}
    write_results("shared_prefix", result, settings=settings, out=args.out, machine=info)


if __name__ == "__main__":
    main()
