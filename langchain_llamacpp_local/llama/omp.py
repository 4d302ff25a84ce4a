"""Giving back a thread's OpenMP helper threads when it stops decoding.

In pip's llama.cpp build, ggml's CPU back-end runs every graph in an OpenMP parallel
region, and libgomp keeps a pool of helper threads for each thread that has started one:
a model's worker, or a caller's thread that embedded texts. The pool lives as long as
that thread. libgomp counts every pooled thread, and while the count exceeds the CPUs
the process may use, each barrier spins 100 iterations instead of about 3 ms before it
sleeps in the kernel (``do_spin`` in libgomp's ``config/linux/wait.h``). A decode has
hundreds of barriers per token, and each one then waits to be woken.

One idle pool beside a busy one is enough to trip that count when the busy team uses
all the CPUs. A chat worker's decode ran at 49 instead of 63 tok/s (SmolLM2, 2 CPUs,
benchmarks/bench_omp_pool.py) while one other thread of the process held a pool doing
nothing, and would stay that slow for as long as that thread lived.

So a thread gives its pool back (``omp_pause_resource_all``, which ends the calling
thread's pool) when it stops decoding: a model's worker when no request is left, an
embedding call when it returns. The teams that decode at the same time stay within the
usable CPUs through :class:`~.threads.CpuBudget`, so the count stays within them too. The
next parallel region starts its helpers again, in tens of microseconds.

Only for libgomp. LLVM's libomp (``__kmpc_*``) has no such count: its threads go to sleep
after ``KMP_BLOCKTIME`` whatever the pools hold.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from functools import cache

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.llama.ggml_cpu import cpu_features

logger = logging.getLogger(__name__)

#: ``omp_pause_soft`` (libgomp treats every kind the same: the calling thread's pool ends)
_OMP_PAUSE_SOFT = 1


class _Pool(threading.local):
    #: whether this thread has run a team of several threads since its pool last ended
    pooled = False


_pool = _Pool()


@cache
def _pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all``, looked up through libllama's dependencies
    (the OpenMP runtime ggml's CPU back-end links), or None: no OpenMP, or LLVM's libomp."""
    try:
        if cpu_features().get("OPENMP") != "1":
            return None
    except Exception:  # a build without the CPU registry's features: nothing to release
        return None
    lib = C._lib
    try:
        lib["__kmpc_fork_call"]
    except AttributeError:
        pass
    else:
        return None  # LLVM's libomp
    try:
        fn = lib["omp_pause_resource_all"]
    except AttributeError:
        return None  # an OpenMP runtime older than 5.0
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int]
    return fn  # type: ignore[no-any-return]


def ran_team(n_threads: int) -> None:
    """Note that this thread just ran a decode with ``n_threads`` threads."""
    if n_threads > 1:
        _pool.pooled = True


def release_team() -> None:
    """End this thread's OpenMP helper pool, if it has one (call when it stops decoding)."""
    if not _pool.pooled:
        return
    _pool.pooled = False
    fn = _pause()
    if fn is not None and fn(_OMP_PAUSE_SOFT) != 0:
        logger.debug("omp_pause_resource_all refused: this thread is inside a parallel region")
