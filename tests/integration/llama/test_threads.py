"""Thread defaults on real llama.cpp: a confined process loads with the matching team size,
an explicit setting wins, and two models in one process share the CPU budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings
from langchain_llamacpp_local.llama import threads as T

REPO = Path(__file__).resolve().parents[3]

_CONFINED = """
import json, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from langchain_llamacpp_local import ChatLlamaCpp
llm = ChatLlamaCpp(model_path=sys.argv[1], n_ctx=256, max_tokens=4, temperature=0)
llm.invoke("hello")
print(json.dumps({"threads": llm.model_info.threads}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity masks")
def test_a_process_confined_to_one_cpu_loads_one_thread_per_team(tiny_llama: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", _CONFINED, tiny_llama],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["threads"]["n_threads"] == 1
    assert out["threads"]["n_threads_batch"] == 1
    assert out["threads"]["usable_cpus"] == 1
    assert "1 CPUs in the affinity mask" in out["threads"]["reason"]


def test_model_info_reports_the_default_plan(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, max_tokens=2)
    expected = T.plan_threads(T.default_cpu_view())
    assert llm.model_info.threads == expected.as_dict()


def test_an_explicit_thread_count_wins(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, max_tokens=2, n_threads=3)
    info = llm.model_info.threads
    assert (info["n_threads"], info["n_threads_batch"]) == (3, 3)
    assert "explicit" in str(info["reason"])


def test_a_chat_model_and_embeddings_busy_at_once_share_the_budget(tiny_llama: str) -> None:
    """Both decode at the same time from two threads: each gets its share of the budget
    (never more threads in flight than the budget holds) and both answer correctly."""
    budget = T.cpu_budget()
    seen: list[int] = []
    original = budget.threads

    def watch(team: int, want: int):  # type: ignore[no-untyped-def]
        cm = original(team, want)

        class _Watch:
            def __enter__(self) -> int:
                n = cm.__enter__()
                seen.append(budget._in_use)
                return n

            def __exit__(self, *exc: object) -> None:
                cm.__exit__(*exc)

        return _Watch()

    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=512, max_tokens=48, temperature=0)
    emb = LlamaCppEmbeddings(model_path=tiny_llama, n_ctx=128)
    solo_text = llm.invoke("count with me").content
    solo_vecs = emb.embed_documents([f"text {i}" for i in range(40)])
    budget.threads = watch  # type: ignore[method-assign]
    try:
        results: dict[str, object] = {}

        def chat() -> None:
            results["chat"] = llm.invoke("count with me").content

        def embed() -> None:
            results["emb"] = emb.embed_documents([f"text {i}" for i in range(40)])

        workers = [threading.Thread(target=chat), threading.Thread(target=embed)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
    finally:
        del budget.threads
        llm.close()
        emb.close()
    assert results["chat"] == solo_text
    assert results["emb"] == solo_vecs
    assert seen and max(seen) <= budget.usable


def test_a_deterministic_embedding_context_keeps_one_team_size(tiny_llama: str) -> None:
    """As a deterministic chat context: it never asks the shared CPU budget (whose grant
    follows the other models' load), so its team size, and its numbers, stay fixed."""
    budget = T.cpu_budget()
    asked: list[int] = []
    original = budget.threads

    def count(team: int, want: int):  # type: ignore[no-untyped-def]
        asked.append(team)
        return original(team, want)

    fixed = LlamaCppEmbeddings(model_path=tiny_llama, n_ctx=128, deterministic=True)
    budgeted = LlamaCppEmbeddings(model_path=tiny_llama, n_ctx=128)
    budget.threads = count  # type: ignore[method-assign]
    try:
        fixed.embed_documents(["one", "two"])
        assert asked == []
        budgeted.embed_documents(["one", "two"])
        assert asked  # the same model without deterministic does use the budget
    finally:
        del budget.threads
        fixed.close()
        budgeted.close()
