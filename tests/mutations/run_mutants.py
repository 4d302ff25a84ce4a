"""Mutation check: small, plausible bugs the model-free tests must catch.

Each :class:`Mutant` replaces one snippet of one module with a buggy variant. The
script copies the package and the tests to a temporary directory, runs the named
tests there once unchanged (they must pass), then applies each mutant in turn to the
copy alone, runs its tests and expects a failure; the working tree is never edited.
A mutant whose tests still pass "survived": the tests do not check what they claim.
A snippet no longer found in its module is reported as stale (the code moved on: the
table needs the new snippet).

    python tests/mutations/run_mutants.py            # every mutant
    python tests/mutations/run_mutants.py -k hermes  # the ones whose name contains it

Exit status 0 when every mutant is caught. Each run forks this process (which has
imported pytest and the heavy third-party modules, never the package) where it can,
so a mutant costs a fraction of a second; elsewhere it runs a fresh interpreter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = "langchain_llamacpp_local"
#: seconds one run of a mutant's tests may take before it counts as an error
RUN_TIMEOUT_S = 120


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    """The module, relative to the package."""
    original: str
    """A snippet found exactly once in the module."""
    mutated: str
    tests: tuple[str, ...]
    """pytest node ids (relative to the repository) that must fail with the mutant."""


_TP = "tests/unit/formats/test_tool_parsers.py::test_recorded_outputs"
_LIMITS = "tests/unit/templates/test_template_limits.py"
_CAPS = f"{_LIMITS}::test_each_cap_allows_its_value_and_refuses_one_more"
_REPORT = "tests/unit/chat/test_cache_report.py"
_SCHED = "tests/unit/runtime/test_scheduler.py"
_THREADS = "tests/unit/llama/test_threads.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "hermes: a JSON array in a tag cut to its first call",
        "formats/classic.py",
        "return [call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in obj]",
        "return [call_from_obj(o, json.dumps(o, ensure_ascii=False)) for o in obj[:1]]",
        (_TP,),
    ),
    Mutant(
        "hermes: non-object arguments accepted in <function=NAME>",
        "formats/classic.py",
        '    args, err = loads_lenient(m.group(3).strip() or "{}")\n'
        "    if err or not isinstance(args, dict):",
        '    args, err = loads_lenient(m.group(3).strip() or "{}")\n    if err:',
        (_TP,),
    ),
    Mutant(
        "hermes: non-object arguments accepted in <tool_call><function=NAME>",
        "formats/classic.py",
        '        args, err = loads_lenient(m.group(2) or "{}")\n'
        "        if err or not isinstance(args, dict):",
        '        args, err = loads_lenient(m.group(2) or "{}")\n        if err:',
        (_TP,),
    ),
    Mutant(
        'hermes: a bare {"name"} without arguments taken as a call',
        "formats/classic.py",
        '        or not ({"arguments", "parameters"} & obj.keys())\n',
        "",
        (_TP,),
    ),
    Mutant(
        "sandbox: repetition checked for str * int only, not int * str",
        "templates/sandbox.py",
        "for seq, count in ((left, right), (right, left)):",
        "for seq, count in ((left, right),):",
        (_CAPS,),
    ),
    Mutant(
        "sandbox: repetition allowed one item past its cap",
        "templates/sandbox.py",
        "if len(seq) * max(count, 0) > cap:",
        "if len(seq) * max(count, 0) > cap + 1:",
        (_CAPS,),
    ),
    Mutant(
        "sandbox: range() allowed to 10x its cap",
        "templates/sandbox.py",
        "if len(rng) > cap:",
        "if len(rng) > cap * 10:",
        (_CAPS,),
    ),
    Mutant(
        "sandbox: range() refused at its cap",
        "templates/sandbox.py",
        "if len(rng) > cap:",
        "if len(rng) >= cap:",
        (_CAPS,),
    ),
    Mutant(
        "sandbox: integer product allowed one bit past its cap",
        "templates/sandbox.py",
        "if left.bit_length() + right.bit_length() > cap:",
        "if left.bit_length() + right.bit_length() > cap + 1:",
        (_CAPS,),
    ),
    Mutant(
        "sandbox: integer operands allowed one bit past their cap",
        "templates/sandbox.py",
        "if isinstance(v, int) and v.bit_length() > cap:",
        "if isinstance(v, int) and v.bit_length() > cap + 1:",
        (_CAPS,),
    ),
    Mutant(
        "sandbox: size prediction allows one character past the cap",
        "templates/sandbox.py",
        "    if size > cap:\n",
        "    if size > cap + 1:\n",
        (_CAPS,),
    ),
    Mutant(
        "sandbox: '+' result allowed one item past the cap",
        "templates/sandbox.py",
        "if len(left) + len(right) > cap:",
        "if len(left) + len(right) > cap + 1:",
        (_CAPS,),
    ),
    Mutant(
        "sandbox: the rendered output refused at its cap",
        "templates/sandbox.py",
        "if size > limits.max_output_chars:",
        "if size >= limits.max_output_chars:",
        (_CAPS,),
    ),
    Mutant(
        "sandbox: template source allowed one character past its cap",
        "templates/sandbox.py",
        "if len(source) > limits.max_source_chars:",
        "if len(source) > limits.max_source_chars + 1:",
        (f"{_LIMITS}::test_the_source_cap_allows_its_length_and_refuses_one_more",),
    ),
    Mutant(
        "sandbox: lipsum paragraphs allowed one past the cap",
        "templates/sandbox.py",
        "if n > cap or max > cap * 10",
        "if n > cap + 1 or max > cap * 10",
        (f"{_LIMITS}::test_lipsum_allows_its_cap_and_refuses_one_more",),
    ),
    Mutant(
        "sandbox: '%' width allowed one past the cap",
        "templates/sandbox.py",
        "if isinstance(n, int) and abs(n) > wcap:",
        "if isinstance(n, int) and abs(n) > wcap + 1:",
        (_CAPS,),
    ),
    Mutant(
        "cache report: a span holds its end",
        "chat/cache_report.py",
        "self.start <= offset < self.end",
        "self.start <= offset <= self.end",
        (
            f"{_REPORT}::test_a_span_holds_its_start_and_not_its_end",
            f"{_REPORT}::test_a_new_turn_from_its_first_character_is_no_miss",
        ),
    ),
    Mutant(
        "cache report: the developer role left out of the system-prompt rule",
        "chat/cache_report.py",
        '(lambda p, _: p.role in ("system", "developer"), "system prompt changed")',
        '(lambda p, _: p.role in ("system",), "system prompt changed")',
        (f"{_REPORT}::test_a_changed_developer_message_is_a_changed_system_prompt",),
    ),
    Mutant(
        "scheduler: a checkpoint WINDOW_SLACK back counted as too far",
        "runtime/scheduler.py",
        "last < near[-1] - WINDOW_SLACK",
        "last <= near[-1] - WINDOW_SLACK",
        (f"{_SCHED}::test_window_checkpoint_boundaries_sit_at_the_slack",),
    ),
    Mutant(
        "scheduler: a target WINDOW_SLACK past the start not taken at it",
        "runtime/scheduler.py",
        "t <= start + WINDOW_SLACK",
        "t < start + WINDOW_SLACK",
        (f"{_SCHED}::test_window_checkpoint_boundaries_sit_at_the_slack",),
    ),
    Mutant(
        "scheduler: a group of exactly n_batch rows rides in the piece's call",
        "runtime/scheduler.py",
        "if len(group) < rules.n_batch and",
        "if len(group) <= rules.n_batch and",
        (f"{_SCHED}::test_a_group_of_n_batch_rows_leaves_no_room_to_ride",),
    ),
    Mutant(
        "CPU budget: the fast undo of a probe made dead code",
        "llama/threads.py",
        "(state.probing and mean > CONTENDED)",
        "(False and state.probing and mean > CONTENDED)",
        (
            f"{_THREADS}::test_a_probe_meeting_mild_contention_is_undone_within_quick_s_not_a_window",
        ),
    ),
)


class Stale(Exception):
    """A mutant's snippet is not found exactly once in its module."""


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".models")
    shutil.copytree(ROOT / PKG, dest / PKG, ignore=ignore)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _pytest_args(tests: tuple[str, ...]) -> list[str]:
    return [*tests, "-q", "-x", "--no-header", "-p", "no:randomly", "-p", "no:cacheprovider"]


def _run(copy: Path, tests: tuple[str, ...], log: Path) -> int:
    """pytest's exit status for ``tests`` run on the copy (output to ``log``)."""
    if not hasattr(os, "fork"):
        env = {**os.environ, "PYTHONPATH": str(copy)}
        with log.open("w") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", *_pytest_args(tests)],
                cwd=copy,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=RUN_TIMEOUT_S,
            )
        return proc.returncode
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: the copy first on the path, the package imported fresh
        code = 3
        try:
            import signal

            import pytest

            signal.alarm(RUN_TIMEOUT_S)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(copy)
            sys.path.insert(0, str(copy))
            os.environ["PYTHONPATH"] = str(copy)
            code = int(pytest.main(_pytest_args(tests)))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _apply(copy: Path, mutant: Mutant) -> str:
    """Write the mutant into the copy; returns the module's original text."""
    path = copy / PKG / mutant.file
    text = path.read_text()
    if text.count(mutant.original) != 1:
        raise Stale(f"{mutant.file}: the snippet occurs {text.count(mutant.original)} times")
    path.write_text(text.replace(mutant.original, mutant.mutated))
    return text


def run(mutants: tuple[Mutant, ...], verbose: bool = False) -> list[tuple[Mutant, str]]:
    """Each mutant with its outcome: "caught", "survived", "stale: ..." or "error ..."."""
    # the heavy third-party modules the tests import, loaded once here for every forked run
    # (one BLAS thread: a forked child has only the thread that forked)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import gguf  # noqa: F401
    import hypothesis  # noqa: F401
    import jinja2.sandbox  # noqa: F401
    import langchain_core.language_models  # noqa: F401
    import langchain_core.messages  # noqa: F401
    import pytest  # noqa: F401

    results: list[tuple[Mutant, str]] = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        copy = Path(tmp)
        _copy_tree(copy)
        log = copy / "pytest.log"
        every = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
        code = _run(copy, every, log)
        if code != 0:
            raise RuntimeError(f"the tests fail without a mutant ({code}):\n{log.read_text()}")
        for mutant in mutants:
            start = time.monotonic()
            try:
                original = _apply(copy, mutant)
            except Stale as exc:
                results.append((mutant, f"stale: {exc}"))
                continue
            try:
                code = _run(copy, mutant.tests, log)
            finally:
                (copy / PKG / mutant.file).write_text(original)
            outcome = {0: "survived", 1: "caught"}.get(code, f"error (pytest exit {code})")
            results.append((mutant, outcome))
            if verbose or outcome != "caught":
                print(f"{outcome:>9}  {mutant.name}  ({time.monotonic() - start:.1f} s)")
                if outcome != "caught":
                    print(log.read_text()[-3000:])
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only the mutants whose name contains this")
    parser.add_argument("-v", action="store_true", help="a line for every mutant")
    args = parser.parse_args(argv)
    chosen = tuple(m for m in MUTANTS if args.k.lower() in m.name.lower())
    results = run(chosen, verbose=args.v)
    missed = [(m, outcome) for m, outcome in results if outcome != "caught"]
    print(f"{len(results) - len(missed)} of {len(results)} mutants caught")
    for mutant, outcome in missed:
        print(f"  {outcome}: {mutant.name} ({mutant.file})")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
