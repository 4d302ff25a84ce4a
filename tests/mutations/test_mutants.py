"""The mutation check runs with the suite: every listed mutant is caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.mutations.run_mutants import MUTANTS

SCRIPT = Path(__file__).with_name("run_mutants.py")


def test_every_listed_mutant_is_caught() -> None:
    """The script copies the package and tests, checks the named tests pass unchanged,
    then that each mutant makes them fail (model-free tests only: seconds)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert f"{len(MUTANTS)} of {len(MUTANTS)} mutants caught" in proc.stdout


def test_each_mutant_changes_its_module_and_names_its_tests() -> None:
    root = SCRIPT.resolve().parents[2] / "langchain_llamacpp_local"
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    for mutant in MUTANTS:
        assert mutant.original != mutant.mutated and mutant.tests, mutant.name
        assert (root / mutant.file).read_text().count(mutant.original) == 1, mutant.name
        for node in mutant.tests:
            assert (SCRIPT.resolve().parents[2] / node.split("::")[0]).is_file(), node
