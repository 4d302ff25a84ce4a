"""The thread-count decision and the process-wide CPU budget, without a model.

The CPU view is read from a made-up ``/proc`` and ``/sys`` tree (cgroup v1 and v2
quotas, SMT siblings, hybrid Intel cores); the budget's decisions are pure functions of
what it observed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from langchain_llamacpp_local.llama import threads as T
from langchain_llamacpp_local.llama.threads import (
    ContentionState,
    CpuBudget,
    CpuView,
    next_limit,
    plan_threads,
    usable_cpus,
)


def _write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _topology(root: Path, siblings: list[str]) -> None:
    for cpu, text in enumerate(siblings):
        _write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list", text + "\n")


# ---------------------------------------------------------------- the decision


def test_defaults_are_one_thread_per_usable_core() -> None:
    plan = plan_threads(CpuView(affinity=8, quota=None, cores=8))
    assert (plan.n_threads, plan.n_threads_batch, plan.usable) == (8, 8, 8)


def test_affinity_mask_bounds_the_threads() -> None:
    plan = plan_threads(CpuView(affinity=1, quota=None, cores=1))
    assert (plan.n_threads, plan.n_threads_batch, plan.usable) == (1, 1, 1)


@pytest.mark.parametrize(
    ("quota", "expected"), [(2.0, 2), (1.5, 1), (0.5, 1), (2.999, 2), (64.0, 16)]
)
def test_cgroup_quota_bounds_the_threads_rounded_down(quota: float, expected: int) -> None:
    plan = plan_threads(CpuView(affinity=16, quota=quota, cores=16))
    assert plan.n_threads == plan.n_threads_batch == plan.usable == expected
    assert "cgroup quota" in plan.reason


def test_smt_siblings_count_once() -> None:
    plan = plan_threads(CpuView(affinity=16, quota=None, cores=8))
    assert (plan.n_threads, plan.n_threads_batch) == (8, 8)
    assert plan.usable == 16  # the budget still knows every CPU the process may use
    assert "8 physical cores" in plan.reason


def test_quota_below_the_cores_wins() -> None:
    assert plan_threads(CpuView(affinity=64, quota=2.0, cores=32)).n_threads == 2


@pytest.mark.parametrize(
    ("n_threads", "n_threads_batch", "expected"),
    [(3, None, (3, 3)), (None, 5, (1, 5)), (1, 6, (1, 6)), (12, None, (12, 12))],
)
def test_explicit_settings_always_win(
    n_threads: int | None, n_threads_batch: int | None, expected: tuple[int, int]
) -> None:
    plan = plan_threads(CpuView(affinity=4, quota=1.0, cores=4), n_threads, n_threads_batch)
    assert (plan.n_threads, plan.n_threads_batch) == expected
    assert "explicit" in plan.reason


def test_unknown_topology_uses_the_usable_cpus() -> None:
    assert usable_cpus(CpuView(affinity=6, quota=None, cores=None)) == 6
    assert plan_threads(CpuView(affinity=6, quota=None, cores=None)).n_threads == 6


# ---------------------------------------------------------------- reading /proc and /sys


def test_cgroup_v2_quota_is_read_up_the_tree(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/cgroup", "0::/system.slice/app.service\n")
    _write(tmp_path, "sys/fs/cgroup/system.slice/app.service/cpu.max", "max 100000\n")
    _write(tmp_path, "sys/fs/cgroup/system.slice/cpu.max", "250000 100000\n")
    assert T.read_cgroup_quota(tmp_path) == 2.5


def test_cgroup_v2_quota_mounted_at_the_root_in_a_container(tmp_path: Path) -> None:
    # docker run --cpus=2: the container sees its own cgroup at /sys/fs/cgroup
    _write(tmp_path, "proc/self/cgroup", "0::/\n")
    _write(tmp_path, "sys/fs/cgroup/cpu.max", "200000 100000\n")
    assert T.read_cgroup_quota(tmp_path) == 2.0


def test_cgroup_v2_without_a_limit(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/cgroup", "0::/user.slice\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/cpu.max", "max 100000\n")
    assert T.read_cgroup_quota(tmp_path) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "proc/self/cgroup",
        "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
    )
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert T.read_cgroup_quota(tmp_path) == 1.5


def test_cgroup_v1_unlimited(tmp_path: Path) -> None:
    _write(tmp_path, "proc/self/cgroup", "3:cpu,cpuacct:/\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert T.read_cgroup_quota(tmp_path) is None


def test_no_cgroup_files(tmp_path: Path) -> None:
    assert T.read_cgroup_quota(tmp_path) is None


def test_smt_siblings_from_sysfs(tmp_path: Path) -> None:
    # 4 cores, 2 threads each: cpu k and k+4 are siblings
    _topology(tmp_path, [f"{k % 4},{k % 4 + 4}" for k in range(8)])
    assert T.count_cores(set(range(8)), tmp_path) == 4
    # an affinity mask with both siblings of one core and one of another: 2 cores
    assert T.count_cores({0, 4, 1}, tmp_path) == 2


def test_hybrid_cpu_counts_performance_cores(tmp_path: Path) -> None:
    # 2 performance cores with SMT (cpus 0-3) and 4 efficiency cores (4-7)
    _topology(tmp_path, ["0-1", "0-1", "2-3", "2-3", "4", "5", "6", "7"])
    _write(tmp_path, "sys/devices/cpu_core/cpus", "0-3\n")
    assert T.count_cores(set(range(8)), tmp_path) == 2
    # confined to efficiency cores only: those are what there is
    assert T.count_cores({5, 6}, tmp_path) == 2


def test_unreadable_topology(tmp_path: Path) -> None:
    assert T.count_cores({0, 1}, tmp_path) is None


def test_cpu_list_format() -> None:
    assert T.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


# ---------------------------------------------------------------- the budget's decisions


def test_mild_contention_gives_a_cpu_back_after_a_window() -> None:
    state = ContentionState(usable=4, limit=4)
    for _ in range(T.WINDOW - 1):
        assert next_limit(state, 0.2, now=10.0) == 4
    assert next_limit(state, 0.2, now=10.0) == 3


def test_strong_contention_gives_a_cpu_back_at_once() -> None:
    state = ContentionState(usable=4, limit=4)
    assert next_limit(state, T.STRONG + 0.05, now=10.0, wall_s=0.2) == 3
    assert next_limit(state, T.STRONG + 0.05, now=10.0, wall_s=0.2) == 2


def test_a_brief_burst_of_another_program_is_no_reason_to_shrink() -> None:
    """Another process's threads spinning for a few milliseconds after their work take
    half of one short token, then nothing; sustained load keeps the share up over the
    few tokens of QUICK_S and lowers the limit then."""
    state = ContentionState(usable=2, limit=2)
    assert next_limit(state, 0.5, now=10.0, wall_s=0.008) == 2  # 4 ms lost
    for _ in range(40):
        assert next_limit(state, 0.0, now=10.0, wall_s=0.008) == 2
    fresh = ContentionState(usable=2, limit=2)
    steps = 0
    while fresh.limit == 2:
        next_limit(fresh, 0.5, now=11.0, wall_s=0.008)
        steps += 1
    assert steps * 0.008 >= T.QUICK_S and steps <= 5  # a few tokens, not a window


def test_a_lone_thread_waiting_for_a_cpu_is_no_reason_to_shrink() -> None:
    """A one-thread team has no barrier: its wait costs only the CPU time it lost."""
    state = ContentionState(usable=2, limit=2)
    for _ in range(3 * T.WINDOW):
        assert next_limit(state, 0.9, now=1.0, team=1) == 2
    # and a lowered limit is still tried again while only lone threads decode
    state = ContentionState(usable=2, limit=1, lowered_at=0.0)
    for _ in range(T.WINDOW):
        next_limit(state, 0.9, now=T.PROBE_AFTER_S + 1, team=1)
    assert state.limit == 2


def test_a_quiet_window_keeps_the_limit() -> None:
    state = ContentionState(usable=2, limit=2)
    for _ in range(3 * T.WINDOW):
        assert next_limit(state, 0.01, now=1.0) == 2


def test_the_limit_never_drops_below_one() -> None:
    state = ContentionState(usable=2, limit=1)
    for _ in range(4 * T.WINDOW):
        assert next_limit(state, 0.9, now=0.0) == 1


def test_a_lowered_limit_probes_one_more_cpu_later_and_keeps_it_if_quiet() -> None:
    state = ContentionState(usable=2, limit=1, lowered_at=0.0)
    for _ in range(T.WINDOW):
        next_limit(state, 0.0, now=T.PROBE_AFTER_S / 2)
    assert state.limit == 1  # too early to probe
    for _ in range(T.WINDOW):
        next_limit(state, 0.0, now=T.PROBE_AFTER_S + 1)
    assert state.limit == 2 and state.probing
    for _ in range(T.WINDOW):
        next_limit(state, 0.02, now=T.PROBE_AFTER_S + 2)
    assert state.limit == 2 and not state.probing


def test_tries_that_meet_the_load_again_come_ever_later_and_a_quiet_one_resets() -> None:
    """Beside programs that keep every CPU busy each try costs a token on a team too
    large for its CPUs: the wait between tries doubles while they fail (up to
    PROBE_MAX_S), and is back to PROBE_AFTER_S once a try stays quiet."""
    state = ContentionState(usable=2, limit=1, lowered_at=0.0)
    now = 0.0
    waits: list[float] = []
    for _ in range(8):
        lowered = state.lowered_at
        while state.limit == 1:  # quiet decodes on one thread until the next try
            now += 0.5
            next_limit(state, 0.0, now=now, wall_s=0.05)
            assert now < 1000
        waits.append(now - lowered)
        next_limit(state, 0.6, now=now, wall_s=0.1)  # the try meets the load
        assert state.limit == 1 and not state.probing
    assert waits[0] == pytest.approx(T.PROBE_AFTER_S, abs=0.5)
    assert all(b >= a for a, b in zip(waits, waits[1:], strict=False))
    assert waits[3] >= 8 * T.PROBE_AFTER_S
    assert waits[-1] == pytest.approx(T.PROBE_MAX_S, abs=0.5)  # capped
    # the load goes: the next try stays quiet, and the one after a later drop is soon
    while state.limit == 1:
        now += 0.5
        next_limit(state, 0.0, now=now, wall_s=0.05)
    for _ in range(T.WINDOW):
        next_limit(state, 0.0, now=now, wall_s=0.05)
    assert state.limit == 2 and not state.probing
    assert state.probe_after == T.PROBE_AFTER_S
    # a window-mean drop of a try doubles the wait too
    state = ContentionState(usable=2, limit=2, probing=True)
    for _ in range(T.WINDOW):
        next_limit(state, T.CONTENDED + 0.05, now=1.0)
    assert state.limit == 1 and state.probe_after == 2 * T.PROBE_AFTER_S


def test_a_probe_that_meets_contention_is_undone_at_once() -> None:
    state = ContentionState(usable=2, limit=1, lowered_at=0.0)
    for _ in range(T.WINDOW):
        next_limit(state, 0.0, now=10.0)
    assert state.limit == 2
    assert next_limit(state, 0.5, now=10.1, wall_s=0.2) == 1


def test_a_probe_meeting_mild_contention_is_undone_within_quick_s_not_a_window() -> None:
    """A share between CONTENDED and STRONG lowers a steady limit only when the window
    closes, but undoes a try of one more CPU as soon as the decodes span QUICK_S."""
    wall = 0.005
    share = (T.CONTENDED + T.STRONG) / 2

    def decodes_until_lowered(state: ContentionState) -> int:
        n = 0
        while state.limit == 2:
            next_limit(state, share, now=10.0, wall_s=wall)
            n += 1
            assert n < 10 * T.WINDOW_S / wall
        return n

    probing = decodes_until_lowered(ContentionState(usable=2, limit=2, probing=True))
    steady = decodes_until_lowered(ContentionState(usable=2, limit=2))
    assert probing * wall == pytest.approx(T.QUICK_S, abs=wall)
    assert steady * wall == pytest.approx(T.WINDOW_S, abs=wall)


# ---------------------------------------------------------------- the budget's mechanism


def test_one_busy_team_gets_every_cpu() -> None:
    budget = CpuBudget(4, adaptive=False)
    with budget.threads(team=1, want=4) as n:
        assert n == 4


def test_two_busy_teams_split_the_cpus_and_never_oversubscribe() -> None:
    budget = CpuBudget(2, adaptive=False)
    in_use: list[int] = []
    peak = [0]
    lock = threading.Lock()
    got: dict[int, set[int]] = {1: set(), 2: set()}
    stop = time.monotonic() + 0.5

    def run(team: int) -> None:
        while time.monotonic() < stop:
            with budget.threads(team, want=2) as n:
                with lock:
                    in_use.append(n)
                    peak[0] = max(peak[0], sum(in_use))
                got[team].add(n)
                time.sleep(0.002)
                with lock:
                    in_use.remove(n)

    workers = [threading.Thread(target=run, args=(t,)) for t in (1, 2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert peak[0] <= 2
    assert 1 in got[1] and 1 in got[2]  # both ran at the split size


def test_more_busy_teams_than_cpus_take_turns() -> None:
    budget = CpuBudget(1, adaptive=False)
    active = [0]
    peak = [0]
    lock = threading.Lock()

    def run(team: int) -> None:
        for _ in range(20):
            with budget.threads(team, want=1):
                with lock:
                    active[0] += 1
                    peak[0] = max(peak[0], active[0])
                time.sleep(0.001)
                with lock:
                    active[0] -= 1

    workers = [threading.Thread(target=run, args=(t,)) for t in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(10)
    assert peak[0] == 1


def test_a_team_alone_again_gets_every_cpu_back() -> None:
    budget = CpuBudget(2, adaptive=False)
    with budget.threads(1, 2) as n:
        assert n == 2
    with budget.threads(2, 2) as n:
        assert n == 1  # team 1 decoded a moment ago: it still counts as busy
    time.sleep(T.BUSY_FOR_S * 1.5)
    with budget.threads(1, 2) as n:
        assert n == 2


def test_a_team_inside_a_long_decode_still_counts_as_busy() -> None:
    """An embedding batch can hold one decode for seconds: another team arriving then
    gets its share at once instead of waiting for the whole decode."""
    budget = CpuBudget(2, adaptive=False)
    inside = threading.Event()
    release = threading.Event()

    def long_decode() -> None:
        with budget.threads(1, want=1):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=long_decode)
    t.start()
    inside.wait(10)
    time.sleep(T.BUSY_FOR_S * 2)  # long past the recent-decode window
    t0 = time.monotonic()
    with budget.threads(2, want=2) as n:
        waited = time.monotonic() - t0
    release.set()
    t.join(10)
    assert n == 1
    assert waited < 1.0


def test_one_long_decode_is_a_window_of_its_own() -> None:
    """A lowered budget tries a CPU more after one quiet prompt piece of seconds, not
    after eight of them; and one long contended piece lowers it as eight short ones do."""
    state = ContentionState(usable=2, limit=1, lowered_at=0.0)
    assert next_limit(state, 0.0, now=T.PROBE_AFTER_S + 1, team=1, wall_s=3.0) == 2
    loaded = ContentionState(usable=2, limit=2)
    assert next_limit(loaded, 0.2, now=10.0, wall_s=3.0) == 1
    # short decodes wait for a window's time of them, weighted by their time
    short = ContentionState(usable=2, limit=2)
    assert next_limit(short, 0.25, now=10.0, wall_s=0.01) == 2
    for _ in range(100):
        assert next_limit(short, 0.0, now=10.0, wall_s=0.001) == 2
    # the long-ish contended decode outweighs the quiet short ones
    assert next_limit(short, 0.3, now=10.0, wall_s=0.14) == 1


def test_a_limit_lowered_during_own_work_is_restored_when_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller preparing a prompt competes with the decodes for a CPU; once it is done
    the CPU is free again, so the next decodes get the whole team back (as a probe).
    Driven through ``threads()``, with the kernel's wait counter reporting a decode that
    waited for a CPU longer than it ran (past :data:`STRONG`)."""
    clock = iter(range(0, 10**12, 10**10))  # each read: 10 s more waiting
    monkeypatch.setattr(T, "_thread_wait_ns", lambda: next(clock))

    def contended_decode(budget: T.CpuBudget) -> None:
        with budget.threads(team=1, want=2) as n:
            assert n == budget.usable
            time.sleep(T.QUICK_S * 1.5)  # long enough to move the budget on its own

    budget = T.CpuBudget(2)
    with budget.own_work():
        contended_decode(budget)
        assert budget.limit == 1
    assert budget.limit == 2 and budget._state.probing
    # lowered by other programs' load alone: left to the probes
    contended_decode(budget)
    assert budget.limit == 1
    with budget.own_work():
        pass
    assert budget.limit == 1


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="no schedstat")
def test_each_thread_reads_its_own_wait_counter_from_a_file_it_keeps_open() -> None:
    """The counter is the calling thread's (``/proc/thread-self`` names the thread that
    opens it), read from a file opened once per thread and closed when the thread ends."""
    import os

    seen: dict[str, object] = {}

    def busy_then_read() -> None:
        first = T._thread_wait_ns()
        f = T._per_thread.schedstat
        second = T._thread_wait_ns()
        assert T._per_thread.schedstat is f  # not opened again
        assert f is not None and f.fd is not None
        seen["fd"] = f.fd
        seen["own"] = os.readlink(f"/proc/self/fd/{f.fd}")
        seen["tid"] = threading.get_native_id()
        seen["values"] = (first, second)

    t = threading.Thread(target=busy_then_read)
    t.start()
    t.join()
    first, second = seen["values"]  # type: ignore[misc]
    assert isinstance(first, int) and isinstance(second, int) and second >= first
    assert f"/task/{seen['tid']}/" in str(seen["own"])
    try:  # closed with its thread (the number may since name another file)
        now = os.readlink(f"/proc/self/fd/{seen['fd']}")
    except OSError:
        now = None
    assert now != seen["own"]
    mine = T._thread_wait_ns()
    assert mine is not None and T._per_thread.schedstat is not None


def test_a_lowered_limit_shrinks_the_teams_but_lets_them_run_side_by_side() -> None:
    """Beside other programs' load the limit drops to one thread per team: two busy
    models then decode on one thread each at the same time (a lone thread has no barrier
    to stall at), not by turns, where a chat reply waited for every embedding batch."""
    budget = CpuBudget(2, adaptive=False)
    budget._state.limit = 1
    inside = threading.Event()
    release = threading.Event()

    def long_decode() -> None:
        with budget.threads(1, want=2) as n:
            assert n == 1
            inside.set()
            release.wait(10)

    t = threading.Thread(target=long_decode)
    t.start()
    assert inside.wait(10)
    t0 = time.monotonic()
    with budget.threads(2, want=2) as n:
        waited = time.monotonic() - t0
    release.set()
    t.join(10)
    assert n == 1 and waited < 1.0
    assert budget._in_use == 0  # every thread given back


def test_one_thread_decodes_skip_the_wait_counter_and_still_let_a_lowered_limit_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lone thread's wait counts as quiet whatever it is, so its counter is not read
    (two reads a token saved when confined or lowered); its decodes still close quiet
    windows, so a lowered limit tries one more CPU again."""
    reads: list[int] = []
    monkeypatch.setattr(T, "_thread_wait_ns", lambda: reads.append(1) or 0)
    monkeypatch.setattr(T._per_thread, "unavailable", False)
    budget = T.CpuBudget(2)
    budget._state.limit = 1
    budget._state.lowered_at = time.monotonic() - 2 * T.PROBE_MAX_S
    for _ in range(T.WINDOW + 1):
        with budget.threads(team=1, want=2) as n:
            assert n == 1
            time.sleep(T.WINDOW_S / T.WINDOW)
        if budget.limit == 2:
            break
    assert budget.limit == 2 and budget._state.probing
    assert not reads
    with budget.threads(team=1, want=2) as n:  # two threads now: measured again
        assert n == 2
    assert len(reads) == 2
