"""llama.cpp's own chat parse cases (``tests/test-chat.cpp``), one-shot and streamed.

The cases are in ``tests/data/llama_cpp_chat_cases.json`` (each with the file and line it
came from; llama.cpp is MIT-licensed, see ``tests/data/llama_cpp_templates/LICENSE``),
extracted by ``tests/tools/extract_llama_cpp_chat_cases.py``. Cases llama.cpp tests on the
prompt side (continuation, response formats) are listed under ``unported`` with the reason;
known failures go in ``xfail`` (case id -> reason) and are listed in ``docs/tools.md``.
"""

from __future__ import annotations

import pytest

from tests.llama_cpp_cases import case_id, load_cases, run_case

DATA = load_cases()
CASES = DATA["cases"]
XFAIL: dict[str, str] = DATA.get("xfail", {})
SEEDS = (0, 1, 2)


def test_cases_are_complete_and_cited() -> None:
    assert len(CASES) >= 350
    for case in CASES + DATA["unported"]:
        assert case["source"].startswith("tests/test-chat.cpp:")
    for case in DATA["unported"]:
        assert case["reason"]  # nothing is skipped without a reason
    assert set(XFAIL) <= {case_id(c) for c in CASES}
    assert all(XFAIL.values())


def test_pass_rate_one_shot_and_streamed() -> None:
    """>= 98 % of the applicable cases pass one-shot and streamed in random chunk sizes."""
    failures = {}
    for case in CASES:
        for seed in SEEDS:
            err = run_case(case, seed)
            if err:
                failures[case_id(case)] = err
                break
    unexplained = {k: v for k, v in failures.items() if k not in XFAIL}
    assert not unexplained, unexplained
    assert len(failures) <= 0.02 * len(CASES)


@pytest.mark.parametrize("case", CASES[::7], ids=case_id)
def test_sample_case(case: dict) -> None:
    """A sample of single cases, for a readable failure report."""
    if case_id(case) in XFAIL:
        pytest.xfail(XFAIL[case_id(case)])
    assert run_case(case, seed=11) is None
