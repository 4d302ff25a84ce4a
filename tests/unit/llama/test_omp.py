"""When a thread ends its OpenMP pool (llama.omp), without a model: only after a team of
several threads, once per team, and per thread."""

from __future__ import annotations

import threading

import pytest

from langchain_llamacpp_local.llama import omp


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []

    def pause(kind: int) -> int:
        seen.append(kind)
        return 0

    monkeypatch.setattr(omp, "_pause", lambda: pause)
    omp.release_team()  # whatever this thread ran before
    seen.clear()
    return seen


def test_a_one_thread_decode_leaves_nothing_to_end(calls: list[int]) -> None:
    omp.ran_team(1)
    omp.release_team()
    assert calls == []


def test_a_team_is_ended_once(calls: list[int]) -> None:
    omp.ran_team(2)
    omp.ran_team(4)
    omp.release_team()
    assert calls == [1]  # omp_pause_soft
    omp.release_team()
    assert calls == [1]  # nothing left to end
    omp.ran_team(2)
    omp.release_team()
    assert calls == [1, 1]  # a new team, ended again


def test_each_thread_ends_only_its_own_team(calls: list[int]) -> None:
    omp.ran_team(2)
    other = threading.Thread(target=omp.release_team)
    other.start()
    other.join()
    assert calls == []  # the other thread ran no team
    omp.release_team()
    assert calls == [1]
