"""How many CPU threads llama.cpp may use, and how they wait.

Two parts, each for a different failure of the naive ``os.cpu_count()`` default:

* :func:`read_cpu_view` reads the CPUs this process may really use: its affinity mask,
  a cgroup v1/v2 CPU quota (a container started with ``--cpus=2`` on a 64-core host),
  and physical cores rather than SMT siblings (and performance cores on hybrid Intel
  CPUs, as llama.cpp's ``cpu_get_num_math`` does). :func:`plan_threads` is the pure
  decision on top of it; an explicit ``n_threads``/``n_threads_batch`` always wins.
* :class:`CpuBudget` is the process-wide budget shared by every context (chat models,
  embeddings, rerankers): the threads that decode at the same time never add up to more
  than the CPUs the process may use, and when another program keeps a CPU busy
  (measured as time this process's decoding thread waits for a CPU) the budget shrinks
  until that CPU is free again. A thread team that is larger than the CPUs it gets
  spins at every one of the hundreds of barriers a token costs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- the CPUs


@dataclass(frozen=True)
class CpuView:
    """The CPUs this process may use, as the operating system describes them."""

    affinity: int
    """CPUs in the process's affinity mask (``os.sched_getaffinity``)."""
    quota: float | None = None
    """The cgroup CPU quota in CPUs (``cpu.max`` or ``cfs_quota_us``); None: none set."""
    cores: int | None = None
    """Physical cores among the affinity CPUs (SMT siblings counted once, efficiency
    cores of a hybrid CPU left out); None: the topology could not be read."""


@dataclass(frozen=True)
class ThreadPlan:
    """Threads per context: ``n_threads`` for one-token steps (generation, memory-bound)
    and ``n_threads_batch`` for prompt steps (compute-bound)."""

    n_threads: int
    n_threads_batch: int
    usable: int
    """CPUs this process may keep busy: the size of the process-wide budget."""
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {
            "n_threads": self.n_threads,
            "n_threads_batch": self.n_threads_batch,
            "usable_cpus": self.usable,
            "reason": self.reason,
        }


def usable_cpus(view: CpuView) -> int:
    """CPUs the process can keep busy at once: the affinity mask, cut to the cgroup
    quota (rounded down: a thread team larger than the quota is throttled in the middle
    of a graph, and every other thread then waits at the next barrier)."""
    n = max(1, view.affinity)
    if view.quota is not None:
        n = min(n, max(1, math.floor(view.quota + 1e-9)))
    return n


#: The most threads a default team gets, however many CPUs the process may use: every
#: barrier of a token waits for the slowest thread of the team, and past a few dozen
#: threads a token's small matrices are split finer than a thread's start-up costs
#: (llama.cpp's own tools are run with at most this many in practice; ggml refuses
#: teams over 512). A mask or quota claiming thousands of CPUs no longer makes teams
#: that size; an explicit setting is taken as it is.
MAX_AUTO_THREADS = 64


def plan_threads(
    view: CpuView, n_threads: int | None = None, n_threads_batch: int | None = None
) -> ThreadPlan:
    """The threads a context gets by default, from what the process may use.

    Both kinds of step default to one thread per usable physical core: SMT siblings
    share a core's vector units, which llama.cpp's kernels already fill (llama.cpp's own
    tools count physical cores too). Measured on a 2-CPU machine, generation with both
    CPUs is 1.5-1.7x one CPU, so nothing is held back on an idle machine; on a busy one
    the process-wide :class:`CpuBudget` lowers the threads in use, not this plan.
    Default teams are capped at :data:`MAX_AUTO_THREADS`.
    An explicit setting always wins, and ``n_threads_batch`` follows an explicit
    ``n_threads`` when only that is given, as llama-cpp-python does not, but as a user
    who pins one number expects.
    """
    usable = usable_cpus(view)
    cores = usable if view.cores is None else max(1, min(usable, view.cores))
    why = [f"{view.affinity} CPUs in the affinity mask"]
    if view.quota is not None:
        why.append(f"cgroup quota {view.quota:g} CPUs")
    if view.cores is not None and view.cores < view.affinity:
        why.append(f"{view.cores} physical cores")
    if cores > MAX_AUTO_THREADS:
        cores = MAX_AUTO_THREADS
        why.append(f"capped at {MAX_AUTO_THREADS} threads")
    gen = n_threads if n_threads is not None else cores
    batch = n_threads_batch if n_threads_batch is not None else (n_threads or cores)
    if n_threads is not None or n_threads_batch is not None:
        why.append("explicit setting")
    return ThreadPlan(gen, batch, usable, ", ".join(why))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (the kernel's CPU list format) as a set of CPU numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a = int(lo)
        out.update(range(a, int(hi) + 1) if hi else (a,))
    return out


def parse_cgroup_v2_max(text: str) -> float | None:
    """``cpu.max`` (``"max 100000"`` or ``"200000 100000"``) as CPUs, None for no limit."""
    parts = text.split()
    if len(parts) < 1 or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100000
    quota = int(parts[0])
    return quota / period if quota > 0 and period > 0 else None


def parse_cgroup_v1(quota_text: str, period_text: str) -> float | None:
    """``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` as CPUs (a quota of -1: no limit)."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return quota / period if quota > 0 and period > 0 else None


def _cgroup_dirs(root: Path, rel: str, mount: Path) -> list[Path]:
    """The cgroup's own directory and its ancestors (a limit anywhere up the tree
    applies), tried both under the process's cgroup path and at the mount's root (a
    container usually sees its own cgroup mounted at the root)."""
    rel = rel.strip().lstrip("/")
    dirs: list[Path] = []
    if rel:
        p = Path(rel)
        while True:
            dirs.append(root / mount.relative_to("/") / p)
            if p == p.parent or str(p.parent) == ".":
                break
            p = p.parent
    dirs.append(root / mount.relative_to("/"))
    return dirs


def read_cgroup_quota(root: Path = Path("/")) -> float | None:
    """The tightest CPU quota of this process's cgroups (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``), in CPUs; None when none is set or none can be read."""
    cgroup = _read(root / "proc/self/cgroup")
    if cgroup is None:
        return None
    limits: list[float] = []
    for line in cgroup.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hid == "0" and controllers == "":
            for d in _cgroup_dirs(root, rel, Path("/sys/fs/cgroup")):
                text = _read(d / "cpu.max")
                if text is not None:
                    with contextlib.suppress(ValueError):
                        q = parse_cgroup_v2_max(text)
                        if q is not None:
                            limits.append(q)
        elif "cpu" in controllers.split(","):
            for name in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                for d in _cgroup_dirs(root, rel, Path("/sys/fs/cgroup") / name):
                    q_text, p_text = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                    if q_text is not None and p_text is not None:
                        with contextlib.suppress(ValueError):
                            q = parse_cgroup_v1(q_text, p_text)
                            if q is not None:
                                limits.append(q)
    return min(limits) if limits else None


def count_cores(cpus: set[int], root: Path = Path("/")) -> int | None:
    """Physical cores among ``cpus``: SMT siblings share one core; on a hybrid Intel CPU
    only performance cores count when any of ``cpus`` is one (llama.cpp's choice:
    efficiency cores slow every barrier down to their pace)."""
    sysfs = root / "sys/devices/system/cpu"
    p_cores = _read(root / "sys/devices/cpu_core/cpus")
    if p_cores is not None:
        with contextlib.suppress(ValueError):
            performance = parse_cpu_list(p_cores) & cpus
            if performance:
                cpus = performance
    seen: set[frozenset[int]] = set()
    for cpu in cpus:
        text = _read(sysfs / f"cpu{cpu}/topology/core_cpus_list") or _read(
            sysfs / f"cpu{cpu}/topology/thread_siblings_list"
        )
        if text is None:
            return None
        try:
            seen.add(frozenset(parse_cpu_list(text) & cpus) or frozenset({cpu}))
        except ValueError:
            return None
    return len(seen) or None


def read_cpu_view(root: Path = Path("/")) -> CpuView:
    """The CPUs this process may use (``root`` lets tests read a made-up ``/sys``)."""
    try:
        cpus = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = set(range(os.cpu_count() or 1))
    return CpuView(len(cpus), read_cgroup_quota(root), count_cores(cpus, root))


_plan_lock = threading.Lock()
_default_view: CpuView | None = None


def default_cpu_view() -> CpuView:
    """This process's :class:`CpuView`, read once (affinity changes after the first
    load are not followed: a running thread team keeps its size)."""
    global _default_view
    with _plan_lock:
        if _default_view is None:
            _default_view = read_cpu_view()
        return _default_view


_logged_plans: set[ThreadPlan] = set()


def log_thread_plan(plan: ThreadPlan) -> None:
    """Log a thread plan once per process (every load of the same plan is silent)."""
    with _plan_lock:
        if plan in _logged_plans:
            return
        _logged_plans.add(plan)
    logger.info(
        "llama.cpp threads: %d for generation, %d for prompts (%s)",
        plan.n_threads,
        plan.n_threads_batch,
        plan.reason,
    )


# --------------------------------------------------------------------------- OpenMP

#: The variables that say how OpenMP threads wait. The package sets none of them: with
#: libgomp's default (spin about 3 ms, then sleep) and team sizes kept within the free
#: CPUs by :class:`CpuBudget`, shorter spinning measured slower both idle and beside a
#: CPU-bound process (docs/configuration.md#threads); a user's setting is left as it is.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


# --------------------------------------------------------------------------- budget


class _SchedstatFile:
    """The calling thread's ``/proc/thread-self/schedstat``, opened once: the path names
    the thread that opens it, and a ``pread`` of the open file costs a tenth of opening
    it again (two reads per decode step). Closed when its thread ends."""

    def __init__(self) -> None:
        self.fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def __del__(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


class _PerThread(threading.local):
    schedstat: _SchedstatFile | None = None
    unavailable = False


_per_thread = _PerThread()


def _thread_wait_ns() -> int | None:
    """The calling thread's time spent waiting for a CPU (Linux schedstat), or None
    where the kernel does not expose it."""
    local = _per_thread
    if local.unavailable:
        return None
    try:
        if local.schedstat is None:
            local.schedstat = _SchedstatFile()
        assert local.schedstat.fd is not None
        return int(os.pread(local.schedstat.fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):  # no such file where there is no os.pread
        local.unavailable = True
        return None


#: A decoding thread that waits for a CPU more than this share of the time shares its
#: CPUs with other programs: the budget gives one CPU back.
CONTENDED = 0.15
#: Decodes whose thread waited this share of their time give a CPU back at once: a team
#: that big a share too large costs more at every barrier than a window of decodes is
#: worth waiting for...
STRONG = 0.3
#: ...once they span this much decode time. A short burst of another program (another
#: process's OpenMP threads spin for milliseconds after their work) can take a third of
#: one 8 ms token and is gone at the next: one token's share alone moved the budget to
#: one thread for seconds (a bare decode loop's process and ours taking turns, 12 rounds:
#: ours at 0.62-0.77 of its rate in 9 of them), where sustained load keeps the share up
#: over the few tokens of this span.
QUICK_S = 0.03
#: How long the budget stays lowered before it tries one more CPU again...
PROBE_AFTER_S = 2.0
#: ...doubled after each try that met the load again, up to this: beside programs that
#: keep every CPU busy one token on a team too large for its CPUs waits at each of its
#: barriers for a descheduled thread (an ad-hoc trace: one SmolLM2 token took 3.5 s with two
#: CPU-bound processes on 2 CPUs, against 30 ms on one thread), so a try every 2 s
#: halved the decode rate there.
PROBE_MAX_S = 32.0
#: Decode time whose waits are averaged before the budget moves: one prompt piece of
#: seconds is a window of its own (counting decodes only, a lowered budget read eight
#: long pieces, tens of seconds, on one thread after the load that lowered it had
#: gone), and a brief burst of another program is a small share of it.
WINDOW_S = 0.25
#: A decode of unknown length counts as this share of a window.
WINDOW = 8
#: A team counts as busy this long after its last decode: two models decoding by turns
#: (a chat reply and an embedding batch) split the CPUs instead of oversubscribing them.
BUSY_FOR_S = 0.1


@dataclass
class ContentionState:
    """What the budget has seen of other programs' load (pure data)."""

    usable: int
    limit: int
    waits: list[float] = field(default_factory=list)
    #: decode time the window's waits were measured over (0 where not given)
    walls: list[float] = field(default_factory=list)
    lowered_at: float = 0.0
    probing: bool = False
    #: how long a lowered limit waits before its next try (doubles while tries fail)
    probe_after: float = PROBE_AFTER_S

    def new_window(self) -> None:
        """Forget the decodes averaged so far (after the limit moved)."""
        self.waits.clear()
        self.walls.clear()


def next_limit(
    state: ContentionState, wait_share: float, now: float, team: int = 2, wall_s: float = 0.0
) -> int:
    """Decide the budget's CPU limit after one decode by ``team`` threads that took
    ``wall_s`` seconds and whose calling thread waited ``wait_share`` of its time for a
    CPU. Pure: it updates ``state`` and returns the new limit.

    Only a team of several threads says anything: a lone thread has no barrier to wait
    at, so its wait costs no more than the CPU time it lost; it counts as quiet (so a
    lowered limit is still tried again). The decodes are averaged over a window
    (weighted by their time; a ``wall_s`` of 0, unknown, counts as 1/:data:`WINDOW` of
    it): past :data:`STRONG`, or past :data:`CONTENDED` while one more CPU is being
    tried, one CPU goes back as soon as the window spans :data:`QUICK_S`; else the
    window closes at :data:`WINDOW_S`. An uncontended limit below ``usable`` tries one more CPU
    :data:`PROBE_AFTER_S` seconds after it was lowered; each try undone by the load
    doubles that wait (up to :data:`PROBE_MAX_S`), a try that stays quiet resets it.
    """
    if team < 2:
        wait_share = 0.0
    state.waits.append(wait_share)
    state.walls.append(wall_s if wall_s > 0 else WINDOW_S / WINDOW)
    total = sum(state.walls)
    mean = sum(w * t for w, t in zip(state.waits, state.walls, strict=True)) / total
    if (
        state.limit > 1
        and total >= QUICK_S
        and (mean >= STRONG or (state.probing and mean > CONTENDED))
    ):
        return _give_one_back(state, now)
    if total < WINDOW_S:
        return state.limit
    state.new_window()
    if mean > CONTENDED and state.limit > 1:
        _give_one_back(state, now)
    elif mean <= CONTENDED:
        if state.probing:
            state.probe_after = PROBE_AFTER_S
        state.probing = False
        if state.limit < state.usable and now - state.lowered_at >= state.probe_after:
            state.limit += 1
            state.lowered_at = now
            state.probing = True
    return state.limit


def _give_one_back(state: ContentionState, now: float) -> int:
    """Lower the limit by one CPU at ``now``; a try of one more CPU that met the load
    doubles the wait before the next (up to :data:`PROBE_MAX_S`)."""
    if state.probing:
        state.probe_after = min(PROBE_MAX_S, state.probe_after * 2)
    state.probing = False
    state.new_window()
    state.limit -= 1
    state.lowered_at = now
    return state.limit


class CpuBudget:
    """The threads all of this process's llama.cpp contexts may use at once.

    A decode asks for its team size and gets ``min(want, fair share)``, where the fair
    share divides the current limit among the teams busy in the last
    :data:`BUSY_FOR_S` (at least one thread); it waits while the usable CPUs it needs
    are taken (more busy teams than CPUs then take turns). The limit starts at the
    usable CPUs and follows :func:`next_limit`: lowered by other programs' load, it
    shrinks the teams, and one-thread teams still run side by side.
    """

    def __init__(self, usable: int, *, adaptive: bool = True) -> None:
        self._cond = threading.Condition()
        self._in_use = 0
        self._busy: dict[int, float] = {}
        #: teams inside a decode now, with the threads they hold
        self._holding: dict[int, int] = {}
        self._state = ContentionState(usable=usable, limit=usable)
        self._adaptive = adaptive
        #: callers preparing a prompt now (this process's own CPU work), and whether the
        #: limit was lowered while one ran
        self._own = 0
        self._lowered_by_own = False
        #: decodes waiting for threads (woken when a decode gives its own back)
        self._waiting = 0

    @property
    def limit(self) -> int:
        return self._state.limit

    @property
    def usable(self) -> int:
        return self._state.usable

    def _share(self, team: int, want: int, now: float) -> int:
        """``team``'s share: the limit divided among the teams decoding now or a moment
        ago (a long decode, an embedding batch of seconds, keeps its team busy)."""
        if len(self._busy) != 1 or team not in self._busy:  # else: this team alone
            self._busy = {t: at for t, at in self._busy.items() if now - at < BUSY_FOR_S}
        self._busy[team] = now
        busy = len(self._busy.keys() | self._holding.keys()) if self._holding else len(self._busy)
        share = max(1, self._state.limit // busy)
        return max(1, min(want, share))

    @contextlib.contextmanager
    def own_work(self) -> Iterator[None]:
        """Bracket this process's own CPU work beside the decodes (a caller rendering and
        tokenizing a prompt). A limit lowered while it ran is restored when the last such
        work ends: the load that lowered it has gone, and otherwise the next prompt
        pieces (seconds each) would run on fewer threads until the next probe. Load from
        other programs lowers it again at the first contended decode (it is a probe)."""
        with self._cond:
            self._own += 1
        try:
            yield
        finally:
            with self._cond:
                self._own -= 1
                st = self._state
                if self._own == 0 and self._lowered_by_own and st.limit < st.usable:
                    logger.debug("CPU budget %d -> %d (own work ended)", st.limit, st.usable)
                    st.limit = st.usable
                    st.probing = True
                    st.new_window()
                    st.lowered_at = time.monotonic()
                if self._own == 0:
                    self._lowered_by_own = False
                self._cond.notify_all()

    def threads(self, team: int, want: int) -> _Hold:
        """Hold up to ``want`` threads for one decode of ``team`` (any id unique to a
        context): ``with budget.threads(team, want) as n`` gives the number to use."""
        return _Hold(self, team, want)

    def _take(self, hold: _Hold) -> int:
        team, want = hold.team, hold.want
        with self._cond:
            n = self._share(team, want, time.monotonic())
            # a lowered limit caps each team, not the total: lone threads have no barrier
            # to stall at, so two one-thread teams run side by side, not by turns
            while self._in_use + n > self._state.usable and self._in_use > 0:
                self._waiting += 1
                try:
                    self._cond.wait(0.05)
                finally:
                    self._waiting -= 1
                n = self._share(team, want, time.monotonic())
            self._in_use += n
            self._holding[team] = self._holding.get(team, 0) + n
        hold.n = n
        # a lone thread's wait counts as quiet (next_limit): its counter is not read
        hold.w0 = _thread_wait_ns() if self._adaptive and n > 1 else None
        hold.t0 = time.perf_counter_ns()
        return n

    def _give(self, hold: _Hold) -> None:
        wall = time.perf_counter_ns() - hold.t0
        w0, n, team = hold.w0, hold.n, hold.team
        w1 = _thread_wait_ns() if w0 is not None else None
        with self._cond:
            now = time.monotonic()
            self._in_use -= n
            left = self._holding.pop(team) - n
            if left:
                self._holding[team] = left
            self._busy[team] = now
            share: float | None = None
            if w0 is not None and w1 is not None:
                share = (w1 - w0) / wall if wall > 0 else None
            elif self._adaptive and n == 1 and wall > 0 and not _per_thread.unavailable:
                share = 0.0  # as next_limit counts any lone thread's wait
            if share is not None:
                before = self._state.limit
                after = next_limit(self._state, share, now, n, wall / 1e9)
                if after < before and self._own:
                    self._lowered_by_own = True
                if after != before:
                    logger.debug("CPU budget %d -> %d (other programs' load)", before, after)
            if self._waiting:
                self._cond.notify_all()


class _Hold:
    """One decode's hold on the budget's threads (the ``with`` of
    :meth:`CpuBudget.threads`): a plain object, not a generator, as it brackets every
    generated token."""

    __slots__ = ("budget", "team", "want", "n", "w0", "t0")

    def __init__(self, budget: CpuBudget, team: int, want: int) -> None:
        self.budget, self.team, self.want = budget, team, want
        self.n = 0
        self.w0: int | None = None
        self.t0 = 0

    def __enter__(self) -> int:
        return self.budget._take(self)

    def __exit__(self, *exc: object) -> None:
        self.budget._give(self)


_budget: CpuBudget | None = None


def cpu_budget() -> CpuBudget:
    """The process-wide budget, sized by :func:`default_cpu_view`."""
    global _budget
    view = default_cpu_view()
    with _plan_lock:
        if _budget is None:
            _budget = CpuBudget(usable_cpus(view))
        return _budget


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads, but inherits the budget with the
    threads of the decodes running at the fork counted as in use (every decode of the
    child would then wait for them forever), locks they may have held, and the decoding
    thread's open schedstat file (it names the parent's thread). It starts afresh."""
    global _budget, _plan_lock, _per_thread
    _plan_lock = threading.Lock()
    _budget = None
    _per_thread = _PerThread()


os.register_at_fork(after_in_child=_after_fork_in_child)
