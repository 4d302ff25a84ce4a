"""The README's benchmark figures are the results files' figures.

Every row of the README's benchmark table names its file under ``benchmarks/results/``;
each number in the row's figure cells must be that file's value, rounded as written.
:data:`README_ROWS` says where in the file each number comes from, in the order the row
shows them; a row without an entry, or a number without a source, fails. The
speculative, LoRA and parser rows of docs/benchmarks.md are checked the same way for
their headline figures. No model is loaded: this reads text and JSON only.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"
NUMBER = re.compile(r"\d+(?:\.\d+)?")
OURS = "langchain-llamacpp-local"
COMMUNITY = "langchain-community ChatLlamaCpp"
LLAMA = "llama-cpp-python create_chat_completion"


@functools.cache
def result(name: str) -> Any:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


Source = Callable[[Any], float]

#: README row (the start of its first cell) -> its file and, per number shown, its source.
README_ROWS: dict[str, tuple[str, list[Source]]] = {
    "3 sub-agents taking turns": (
        "results.json",
        [
            lambda r: r["interleaved"][OURS]["last_turn_median_s"],
            lambda r: r["interleaved"][COMMUNITY]["last_turn_median_s"],
            lambda r: r["interleaved"][LLAMA]["last_turn_median_s"],
        ],
    ),
    "agent loop, 10 turns": (
        "results.json",
        [
            lambda r: r["agent_loop_summary"][OURS]["median_ttft_s"],
            lambda r: r["agent_loop_summary"][COMMUNITY]["median_ttft_s"],
            lambda r: r["agent_loop_summary"][LLAMA]["median_ttft_s"],
        ],
    ),
    "4 concurrent generations": ("results.json", [lambda r: r["concurrent"]["speedup"]]),
    "5 sub-agents sharing": ("shared_prefix.json", [lambda r: r["most_at_once"]]),
    "after `trim_messages` drops the oldest turn": (
        "cache_reuse.json",
        [
            lambda r: r["runs"]["trim"]["reuse_on"]["median_ttft_ms"] / 1000,
            lambda r: r["runs"]["trim"]["llama_cpp_python"]["median_ttft_ms"] / 1000,
        ],
    ),
    "a 3,900-token prompt arriving beside 2 streams": (
        "arrival_stall.json",
        [lambda r: max(run["largest_gap_ms"] for run in r["results"]["chat"]["runs"])],
    ),
    "6 short calls beside 2 busy processes": (
        "contention.json",
        [
            lambda r: r["summary"]["ours"]["busy2"]["short_calls_s"],
            lambda r: r["summary"]["llama"]["busy2"]["short_calls_s"],
        ],
    ),
    "n-gram speculation, quoting a tool result": (
        "speculative.json",
        [
            lambda r: r["quote"]["ours_ngram"]["speedup"],
            lambda r: r["quote"]["raw_lookup"]["speedup"],
        ],
    ),
    "LoRA adapter per request": (
        "lora.json",
        [
            lambda r: r["rss_mib"]["added_by_adapter_instance"],
            lambda r: r["rss_mib"]["added_by_second_model"],
        ],
    ),
}


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows (cells, stripped) of the first table after ``heading``."""
    section = text.split(heading, 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # after the header and the |---| line


def readme_rows() -> list[list[str]]:
    return table_rows((ROOT / "README.md").read_text(encoding="utf-8"), "## Benchmarks")


def agrees(shown: str, value: float) -> bool:
    """``shown`` is ``value`` rounded to as many decimals as ``shown`` has."""
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return abs(round(value, decimals) - float(shown)) < 10 ** -(decimals + 3)


def test_every_readme_row_names_an_existing_results_file() -> None:
    rows = readme_rows()
    assert len(rows) >= 4
    for cells in rows:
        named = re.findall(r"`([\w.-]+\.json)`", cells[-1])
        assert len(named) == 1, f"row names no results file: {cells[0]}"
        assert (RESULTS / named[0]).is_file(), named[0]


def test_every_readme_row_is_checked() -> None:
    labels = [cells[0] for cells in readme_rows()]
    unchecked = [label for label in labels if not any(label.startswith(k) for k in README_ROWS)]
    assert not unchecked, unchecked
    stale = [k for k in README_ROWS if not any(label.startswith(k) for label in labels)]
    assert not stale, stale


@pytest.mark.parametrize("label", list(README_ROWS))
def test_readme_figures_agree_with_their_file(label: str) -> None:
    cells = next(c for c in readme_rows() if c[0].startswith(label))
    file, sources = README_ROWS[label]
    assert f"`{file}`" in cells[-1], (label, cells[-1])
    shown = [n for cell in cells[1:-1] for n in NUMBER.findall(cell)]
    assert len(shown) == len(sources), (label, shown)
    for number, source in zip(shown, sources, strict=True):
        value = source(result(file))
        assert agrees(number, value), f"{label}: README shows {number}, {file} has {value}"


def test_the_readme_chart_exists() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (ROOT / path).is_file(), path


def _benchmarks_row(start: str) -> str:
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| " + start)]
    assert len(rows) == 1, start
    return rows[0]


def test_speculative_row_is_the_files() -> None:
    row = _benchmarks_row("speculative decoding")
    assert "`benchmarks/results/speculative.json`" in row
    r = result("speculative.json")
    quote = r["quote"]["ours_ngram"]
    for shown in (
        f"rewrite a code block {r['rewrite']['ours_ngram']['speedup']:.2f}×",
        f"acceptance {r['rewrite']['ours_ngram']['acceptance']:.2f}",
        f"{r['rewrite']['ours_ngram']['tok_s']:.1f} against {r['rewrite']['ours_plain']['tok_s']:.1f}",
        f"quote a tool result {quote['speedup']:.2f}× (acceptance {quote['acceptance']:.2f}",
        f"{quote['tok_s']:.1f} tok/s",
        f"prose {r['prose']['ours_ngram']['speedup']:.2f}× ({r['prose']['ours_ngram']['tok_s']:.1f}",
        f"{r['rewrite']['raw_lookup']['speedup']:.2f}× ({r['rewrite']['raw_lookup']['tok_s']:.1f}",
        f"{r['quote']['raw_lookup']['speedup']:.2f}× ({r['quote']['raw_lookup']['tok_s']:.1f}",
        f"{r['prose']['raw_lookup']['speedup']:.2f}× ({r['prose']['raw_lookup']['tok_s']:.1f}",
        f"num_pred_tokens={r['lookup_tokens']}",
        f"up to {r['max_draft']} tokens",
    ):
        assert shown in row, shown


def test_lora_row_is_the_files() -> None:
    row = _benchmarks_row("LoRA: switch adapter")
    assert "`benchmarks/results/lora.json`" in row
    r = result("lora.json")
    for shown in (
        f"rank-{r['lora_rank']} adapter, a {r['prompt_tokens']}-token prompt",
        f"added memory {r['rss_mib']['added_by_adapter_instance']:.0f} MiB",
        f"against {r['rss_mib']['added_by_second_model']:.0f} MiB for a second model",
        f"load {r['load_s']['adapter_instance']:.2f} s against {r['load_s']['second_model']:.2f} s",
        f"{r['ttft_ms']['adapter_on'] / 1000:.2f} s with the adapter against "
        f"{r['ttft_ms']['second_model'] / 1000:.2f} s on the second model",
        f"{r['ttft_ms']['adapter_off_same_model'] / 1000:.2f} s with the adapter off",
    ):
        assert shown in row, shown


def test_parsers_row_is_the_files() -> None:
    row = _benchmarks_row("streaming parse cost")
    assert "`benchmarks/results/parsers.json`" in row
    rows = {x["format"]: x for x in result("parsers.json")["rows"]}
    assert f"at most {max(x['ratio'] for x in rows.values()):.2f}× the first 1,000" in row
    for fmt in ("hermes", "qwen3_coder", "minimax_m3"):
        assert f"{fmt} {rows[fmt]['ratio']:.2f}×" in row, fmt
    finish = sorted(x["finish_ms"] for x in rows.values())
    assert f"({finish[0]:.2f}–{finish[-1]:.2f} ms" in row


def test_contention_tables_say_llama_generates_on_one_thread() -> None:
    """`Llama` runs at its default one generation thread against our two: the tables
    that compare them say so, as the results file records."""
    r = result("contention.json")
    llama_threads = {run["threads"]["n_threads"] for run in r["runs"]["llama"]["idle"]}
    ours_threads = {run["threads"]["n_threads"] for run in r["runs"]["ours"]["idle"]}
    assert llama_threads == {1} and ours_threads == {2}
    busy = _benchmarks_row("workload (ours: 2 threads")
    assert "`Llama`: its default 1 thread for generation" in busy
    assert "ours 2 threads, `Llama` its default 1" in _benchmarks_row("decode, one 96-token reply")
    readme = next(c[0] for c in readme_rows() if c[0].startswith("6 short calls"))
    assert "`Llama` at its default 1 generation thread, ours 2" in readme


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """The README's second command is the one `.ci/run` runs, character for character."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert len(commands) == 2 and "examples/streaming_chat.py" in commands[0]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert commands[1] in ci


#: Scripts whose results file is named at run time: bench_contention.py (``--out``, by
#: default contention.json) and bench_parsers.py (parsers.json, or
#: parsers_stream_args.json with ``--stream-args``).
_NAMED_AT_RUN_TIME = {"bench_contention.py", "bench_parsers.py"}


def test_every_benchmark_writes_its_results_file() -> None:
    """Each script records its figures in ``results/<name>.json`` through
    ``machine.write_results`` (settings, machine, threads, commit), not only on stdout."""
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    assert len(scripts) >= 15
    for script in scripts:
        source = script.read_text(encoding="utf-8")
        names = re.findall(r"write_results\(\s*\"(\w+)\"", source)
        if script.name in _NAMED_AT_RUN_TIME:
            assert "write_results(" in source, script.name
        else:
            # one file per kind of run, each named after the script
            stem = script.stem.removeprefix("bench_")
            assert names and all(n.startswith(stem) for n in names), (script.name, names)
    run = (ROOT / "benchmarks" / "run.py").read_text(encoding="utf-8")
    assert re.search(r"write_results\(\s*\"results\"", run)
