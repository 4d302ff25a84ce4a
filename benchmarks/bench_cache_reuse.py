"""Chunk reuse after a history edit (``cache_reuse``): time to first token after the edit.

    python benchmarks/bench_cache_reuse.py          # writes results/cache_reuse.json
    python benchmarks/bench_cache_reuse.py --quick  # tiny sizes: a smoke run

SmolLM2-135M-Instruct. A 40-turn agent conversation (``--turns``; each turn a user
request, a tool result quoted in the assistant's reply, about ``--turn-tokens`` (150)
tokens a turn: about 6,000 tokens) is kept under a budget of ``--budget`` tokens
(by default its own size, so each new turn pushes it over) each way in turn:

* ``trim``: ``langchain_core.messages.trim_messages`` (``strategy="last"``,
  ``include_system=True``, ``start_on="human"``), which drops the oldest turns;
* ``summarize``: langchain's ``SummarizationMiddleware`` itself (``trigger`` at the
  budget, ``keep`` 70 % of it), with a fixed summary text as its ``summarizer`` (the
  summary's own generation is not what is measured): the oldest messages become one
  "Here is a summary of the conversation to date" user message.

Per edit (``--edits``, 3): the conversation grows by one turn past the budget (a
request and the assistant's reply), is read once (warm, as when the reply was
generated), is edited, and the next turn's time to first token is measured, with
``cache_reuse=--reuse`` (256), with it off, and with ``llama_cpp.Llama``'s
``create_chat_completion`` (its own prefix cache) on the same prompts. Reported per
run: the median time to first token, the tokens after the edit (the prompt from where
it left the cache) and the share of them moved rather than read. Goal: with reuse at
least 3x faster than off where at least 80 % of the tokens after the edit are reusable.
llama.cpp's walk moves chunks only up to the first new token, so a summary inserted
before the kept turns makes nothing after it reusable: the ``summarize`` figures say
so rather than hide it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_arrival import git_commit, smollm2_path  # noqa: E402

SYSTEM = (
    "You are an operations agent. Tools: search_tickets(query), read_ticket(id), "
    "update_ticket(id, status), notify(team, text). Quote tool results you rely on, "
    "keep answers short, and never invent a ticket. "
)
SUMMARY = (
    "The user asked about a series of tickets; each was looked up with read_ticket and "
    "its status reported. No ticket was changed. Next: answer the latest request."
)
WORDS = (
    "queue latency backup replica invoice printer badge laptop router license mailbox "
    "firewall database cluster rollout certificate vendor payroll calendar dashboard"
).split()


def turn(i: int, tokens: int) -> tuple[str, str]:
    """Turn ``i``: a request and a reply of about ``tokens`` tokens together."""
    topic = WORDS[i % len(WORDS)]
    request = f"Request {i}: check ticket T-{1000 + i} about the {topic} and report its status."
    detail = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(max(1, tokens // 2 - 30)))
    reply = (
        f"read_ticket(T-{1000 + i}) returned: status open, owner team {i % 7}, notes: "
        f"{detail}. The {topic} ticket T-{1000 + i} is open; nothing else changed."
    )
    return request, reply


def conversation(n: int, tokens: int) -> list[Any]:
    from langchain_core.messages import AIMessage, HumanMessage

    out: list[Any] = []
    for i in range(n):
        request, reply = turn(i, tokens)
        out += [HumanMessage(request), AIMessage(reply)]
    return out


def trim_edit(llm: Any, system: Any, history: list[Any], budget: int) -> list[Any]:
    from langchain_core.messages import trim_messages

    return trim_messages(  # type: ignore[no-any-return]
        [system, *history],
        max_tokens=budget,
        token_counter=llm,
        strategy="last",
        include_system=True,
        start_on="human",
    )[1:]


def summarize_edit(llm: Any, system: Any, history: list[Any], budget: int) -> list[Any]:
    from langchain.agents.middleware import SummarizationMiddleware
    from langchain_core.messages import RemoveMessage

    mw = SummarizationMiddleware(
        model=llm,
        trigger=("tokens", budget),
        keep=("tokens", int(budget * 0.7)),
        token_counter=llm.get_num_tokens_from_messages,
        summarizer=lambda _messages: SUMMARY,
    )
    update = mw.before_model({"messages": list(history)}, None)  # type: ignore[arg-type]
    if update is None:
        return history
    return [m for m in update["messages"] if not isinstance(m, RemoveMessage)]


EDITS = {"trim": trim_edit, "summarize": summarize_edit}


def ttft_ours(llm: Any, messages: list[Any], **kw: Any) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    first = None
    last: Any = None
    for chunk in llm.stream(messages, max_tokens=4, **kw):
        if first is None and chunk.content:
            first = time.perf_counter() - t0
        last = chunk if last is None else last + chunk
    usage = last.usage_metadata
    cache = last.response_metadata.get("cache", {})
    return (first or time.perf_counter() - t0), {
        "input_tokens": usage["input_tokens"],
        "cache_read": usage["input_token_details"]["cache_read"],
        "moved": cache.get("moved_tokens", 0),
        "reuse_off": cache.get("reuse_off"),
        "left_cache_at": (cache.get("miss") or {}).get("token"),
    }


def ttft_llama(llama: Any, messages: list[Any]) -> float:
    from langchain_core.messages import convert_to_openai_messages

    t0 = time.perf_counter()
    for chunk in llama.create_chat_completion(
        convert_to_openai_messages(messages), temperature=0, max_tokens=4, stream=True
    ):
        if chunk["choices"][0]["delta"].get("content"):
            return time.perf_counter() - t0
    return time.perf_counter() - t0


def prompts(
    llm: Any, way: str, args: argparse.Namespace, tag: str
) -> list[tuple[list[Any], list[Any]]]:
    """Per edit: (the turn read before the edit: the conversation, its newest request
    and the assistant's reply; the edited conversation plus the next request). ``tag``
    opens the system prompt: each run's conversation is new to the model's caches (the
    instances of one model share them)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    system = SystemMessage(f"Run {tag}. {SYSTEM}")
    history = conversation(args.turns, args.turn_tokens)
    budget = args.budget or llm.get_num_tokens_from_messages([system, *history]) + 10
    out = []
    for e in range(args.edits):
        request, reply = turn(args.turns + e, args.turn_tokens)
        full = [*history, HumanMessage(request), AIMessage(reply)]
        edited = EDITS[way](llm, system, full, budget)
        nxt, _ = turn(args.turns + e + 1, args.turn_tokens)
        out.append(([system, *full], [system, *edited, HumanMessage(nxt)]))
        history = edited
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--turn-tokens", type=int, default=150)
    ap.add_argument(
        "--budget", type=int, default=0, help="0: the first conversation's tokens, plus 10"
    )
    ap.add_argument("--edits", type=int, default=3)
    ap.add_argument("--reuse", type=int, default=256)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--out", default=str(RESULTS / "cache_reuse.json"))
    args = ap.parse_args()
    if args.quick:
        args.turns, args.turn_tokens, args.edits = 6, 60, 1
        args.reuse, args.n_ctx = 32, 2048

    import llama_cpp
    from machine import avoid_amx_in_llama, flags_line, machine_info, write_results

    from langchain_llamacpp_local import ChatLlamaCpp

    path = smollm2_path()
    info = machine_info(path)
    print(flags_line(info))
    runs: dict[str, Any] = {}
    for way in EDITS:
        row: dict[str, Any] = {}
        for mode, reuse in (("reuse_on", args.reuse), ("reuse_off", 0)):
            llm = ChatLlamaCpp(
                model_path=path, n_ctx=args.n_ctx, n_slots=1, temperature=0.0, cache_reuse=reuse
            ).load()
            try:
                times, facts = [], []
                for before, after in prompts(llm, way, args, f"{way}-{mode}"):
                    llm.invoke(before, max_tokens=1)  # the turn before the edit, cached
                    t, f = ttft_ours(llm, after)
                    times.append(t * 1000)
                    facts.append(f)
            finally:
                llm.close()
            after_edit = [f["input_tokens"] - (f["left_cache_at"] or 0) for f in facts]
            share = [f["moved"] / n if n else 0.0 for f, n in zip(facts, after_edit, strict=True)]
            row[mode] = {
                "ttft_ms": times,
                "median_ttft_ms": statistics.median(times),
                "turns": facts,
                "tokens_after_edit": after_edit,
                "moved_share": share,
            }
        avoid_amx_in_llama()
        llama = llama_cpp.Llama(model_path=path, n_ctx=args.n_ctx, verbose=False)
        helper = ChatLlamaCpp(model_path=path, n_ctx=args.n_ctx)  # counts tokens for the edits
        times = []
        for before, after in prompts(helper, way, args, f"{way}-llama"):
            ttft_llama(llama, before)
            times.append(ttft_llama(llama, after) * 1000)
        helper.close()
        del llama
        row["llama_cpp_python"] = {"ttft_ms": times, "median_ttft_ms": statistics.median(times)}
        on, off = row["reuse_on"]["median_ttft_ms"], row["reuse_off"]["median_ttft_ms"]
        row["speedup_on_vs_off"] = off / on if on else None
        row["speedup_on_vs_llama"] = row["llama_cpp_python"]["median_ttft_ms"] / on if on else None
        row["median_moved_share"] = statistics.median(row["reuse_on"]["moved_share"])
        runs[way] = row
        print(
            f"{way}: time to first token after the edit {on:.0f} ms with reuse, {off:.0f} ms "
            f"without ({row['speedup_on_vs_off']:.2f}x), Llama "
            f"{row['llama_cpp_python']['median_ttft_ms']:.0f} ms; "
            f"{row['median_moved_share']:.0%} of the tokens after the edit moved"
        )
    result = {
        "model": Path(path).name,
        "git_commit": git_commit(),
        "goal": ">= 3x faster than reuse off where >= 80% of the tokens after the edit moved",
        "goal_met": {
            way: (r["speedup_on_vs_off"] or 0) >= 3
            for way, r in runs.items()
            if r["median_moved_share"] >= 0.8
        },
        "runs": runs,
    }
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_results("cache_reuse", result, settings=settings, out=args.out, machine=info)


if __name__ == "__main__":
    main()
