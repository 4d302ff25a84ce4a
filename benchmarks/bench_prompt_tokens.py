"""A turn's tokenizing as an agent's conversation grows: each message once, or the
whole prompt again.

An agent loop sends its whole history at every turn. ``Llama`` (and llama.cpp's server)
tokenize the whole rendered prompt each time; ours tokenizes only the messages it has
not seen (:mod:`langchain_llamacpp_local.chat.prompt_tokens`). This runs a 40-turn
tool-using conversation (each turn: a reply with a tool call, a tool result of about
``--result-chars`` characters, the next question) through the real template and
vocabulary of SmolLM2-135M-Instruct (ChatML, BPE) and Gemma 3 270M (SentencePiece),
weights not loaded, and times each turn's tokenizing both ways (thread CPU time): ``whole`` is one ``llama_tokenize`` of the prompt, what ``Llama`` does;
``pieces`` is ours, the memo warmed by the turns before, as in a running agent. Each
turn's two token lists are checked equal.

Prints per-turn figures at turns 1, 10, 20 and 40, then the JSON it writes to
``benchmarks/results/prompt_tokens.json``. Model-free and single-threaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from langchain_llamacpp_local.chat.prompts import ChatFormat  # noqa: E402
from langchain_llamacpp_local.llama.vocab_model import VocabModel  # noqa: E402
from tests.conftest import gemma_path, smollm2_path  # noqa: E402

SYSTEM = (
    "You are an inventory assistant. Use the stock tool to look items up, one call per "
    "item, and answer with the count. "
) * 4


def _result(turn: int, chars: int) -> str:
    rows = [
        f'{{"sku": "item-{turn}-{i}", "warehouse": "north", "count": {i * 7}}}'
        for i in range(chars // 60 + 1)
    ]
    return "[" + ", ".join(rows)[:chars] + "]"


def conversation(turns: int, chars: int) -> list[list[dict[str, str]]]:
    """The message list each turn sends."""
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How many items of kind 0 are in stock?"},
    ]
    out = [list(history)]
    for t in range(turns - 1):
        call = (
            f'<tool_call>\n{{"name": "stock", "arguments": {{"item": "item {t}"}}}}\n</tool_call>'
        )
        history += [
            {"role": "assistant", "content": f"Let me check item {t}.\n{call}"},
            {
                "role": "user",
                "content": f"<tool_response>\n{_result(t, chars)}\n</tool_response>\nAnd item {t + 1}?",
            },
        ]
        out.append(list(history))
    return out


def _cpu(fn: Any) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def run_model(name: str, path: str, turns: int, chars: int) -> dict[str, Any]:
    vm = VocabModel(path)
    fmt = ChatFormat.from_engine(vm)  # type: ignore[arg-type]
    tok = fmt.tokenizer
    # what the first request waits for once, at load (the vocabulary's special tokens)
    tok.tokenize(vm, "")  # type: ignore[arg-type]
    rows = []
    for t, msgs in enumerate(conversation(turns, chars), start=1):
        text = fmt.template.render(msgs, add_generation_prompt=True)
        # ours: the turn's own call, the memo holding the turns before it
        t0 = time.thread_time()
        pieces = tok.tokenize(vm, text)  # type: ignore[arg-type]
        pieces_s = time.thread_time() - t0
        whole = vm.tokenize(text, add_special=True, parse_special=True)
        assert pieces == whole, f"{name} turn {t}: the pieces' tokens differ"
        whole_s = _cpu(lambda text=text: vm.tokenize(text, add_special=True, parse_special=True))
        rows.append(
            {
                "turn": t,
                "prompt_tokens": len(whole),
                "whole_ms": 1000 * whole_s,
                "pieces_ms": 1000 * pieces_s,
            }
        )
    return {"model": name, "cuts": list(tok.cuts or ()), "turns": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--result-chars", type=int, default=2000)
    ap.add_argument("--out", default=None, help="default: results/prompt_tokens.json")
    args = ap.parse_args()
    results = [
        run_model("SmolLM2-135M-Instruct", smollm2_path(), args.turns, args.result_chars),
        run_model("Gemma 3 270M", gemma_path(), args.turns, args.result_chars),
    ]
    for res in results:
        print(f"{res['model']} (cut before {', '.join(res['cuts'])}):")
        print("  turn  prompt tokens  whole ms  pieces ms")
        for row in res["turns"]:
            if row["turn"] in (1, 10, 20, args.turns):
                print(
                    f"  {row['turn']:4d}  {row['prompt_tokens']:13d}  {row['whole_ms']:8.2f}"
                    f"  {row['pieces_ms']:9.2f}"
                )
    recorded = {"turns": args.turns, "result_chars": args.result_chars}
    figures = {"args": recorded, "results": results}
    print(json.dumps(figures, indent=1))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import write_results

    write_results("prompt_tokens", figures, settings=recorded, out=args.out)


if __name__ == "__main__":
    main()
