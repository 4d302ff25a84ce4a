"""Unit tests are model-free unless marked: a test that loads a llama.cpp model (weights
or vocabulary) without the ``model`` marker fails, so that ``pytest tests/unit -m "not
model"`` stays a run of seconds. Tests that need a model belong in tests/integration.

The guard counts loads through llama-cpp-python's ``llama_model_load_from_file`` in this
process; a model loaded in a subprocess is not seen."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as C
import pytest

_loads = [0]
_loads_before = pytest.StashKey[int]()


def _counting(load: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        _loads[0] += 1
        return load(*args, **kwargs)

    return counted


C.llama_model_load_from_file = _counting(C.llama_model_load_from_file)
llama_cpp.llama_model_load_from_file = C.llama_model_load_from_file


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_loads_before] = _loads[0]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report: pytest.TestReport = yield
    if (
        call.when == "teardown"
        and report.passed
        and _loads[0] != item.stash.get(_loads_before, _loads[0])
        and item.get_closest_marker("model") is None
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} loaded a llama.cpp model without the `model` marker: move it "
            "to tests/integration/<layer> (or mark it @pytest.mark.model)"
        )
    return report
