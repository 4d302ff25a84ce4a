"""What a benchmark figure depends on besides the code: CPU flags and weight placement.

Every benchmark records this next to its figures, so runs on different machines can be
told apart: the CPU's AVX2 / AVX-512 / AMX flags, what ggml's CPU back-end was built with,
the extra buffer types it registered, and where llama.cpp put a model's weights.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

_FLAG = re.compile(r"^(avx2|avx512\w*|amx\w*)$")

#: Where every benchmark writes its figures by default: ``results/<name>.json``.
RESULTS = Path(__file__).resolve().parent / "results"
_ROOT = RESULTS.parents[1]


def cpu_flags() -> list[str]:
    """The AVX2, AVX-512 and AMX flags of this CPU (Linux ``/proc/cpuinfo``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(f for f in line.split(":", 1)[1].split() if _FLAG.match(f))
    return sorted(flags)


def machine_info(model_path: str | None = None) -> dict[str, Any]:
    """The machine's description; with ``model_path``, also that model's weight placement
    (the decision and the buffer sizes llama.cpp reported when loading it)."""
    from langchain_llamacpp_local.llama import ggml_cpu, loading

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "ggml_cpu_features": sorted(ggml_cpu.cpu_features()),
        "cpu_extra_buffer_types": list(ggml_cpu.extra_buffer_types()),
    }
    if model_path is not None:
        config = loading.LoadConfig(model_path=model_path)
        ref = loading.load_model(config)
        try:
            info["weight_buffers_mib"] = loading.weight_buffers(ref.model)
        finally:
            ref.release()
        info["weight_placement"] = loading.plan_weights(config).reason
    return info


def flags_line(info: dict[str, Any]) -> str:
    """One line for a benchmark's printout."""
    flags = " ".join(info["cpu_flags"]) or "no AVX2/AVX-512/AMX"
    line = f"CPU flags: {flags}; CPU extra buffer types: {info['cpu_extra_buffer_types']}"
    if "weight_buffers_mib" in info:
        line += f"; weights (MiB): {info['weight_buffers_mib']}"
    return line


def thread_settings() -> dict[str, Any]:
    """What decides how the CPU threads run: the CPUs this process may use, the package's
    default plan, and the OpenMP wait settings in force."""
    from langchain_llamacpp_local.llama import threads

    view = threads.read_cpu_view()
    return {
        "affinity_cpus": view.affinity,
        "cgroup_quota_cpus": view.quota,
        "physical_cores": view.cores,
        "default_plan": threads.plan_threads(view).as_dict(),
        "openmp_env": {k: os.environ.get(k) for k in threads.WAIT_VARIABLES},
    }


def avoid_amx_in_llama() -> str | None:
    """Make llama-cpp-python's ``Llama`` (and classes built on it) load with llama.cpp's
    placement minus the AMX buffer type, where this machine has one.

    Its AMX kernel dies on some CPUs (SIGILL or SIGSEGV at the first decode, see
    docs/configuration.md), which would leave the contenders built on ``Llama`` without
    any figure; every other placement stays llama.cpp's. Returns what was done, or None.
    """
    import ctypes

    import llama_cpp
    import llama_cpp.llama_cpp as C

    from langchain_llamacpp_local.llama import ggml_cpu, loading

    if "AMX" not in ggml_cpu.extra_buffer_types():
        return None
    if getattr(llama_cpp.Llama.__init__, "_avoids_amx", False):
        return _AVOIDED
    default = C.llama_model_default_params
    keep: list[Any] = []

    def params_for(path: str) -> Any:
        plan = loading.plan_weights(loading.LoadConfig(model_path=path))
        params = default()
        params.use_extra_bufts = plan.use_extra_bufts
        overrides = loading.buft_overrides(plan)
        if overrides is not None:
            keep.append(overrides)
            params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        return params

    original_init = llama_cpp.Llama.__init__

    def init(self: Any, model_path: str, *args: Any, **kwargs: Any) -> None:
        C.llama_model_default_params = lambda: params_for(model_path)  # type: ignore[assignment]
        try:
            original_init(self, model_path, *args, **kwargs)
        finally:
            C.llama_model_default_params = default  # type: ignore[assignment]

    init._avoids_amx = True  # type: ignore[attr-defined]
    llama_cpp.Llama.__init__ = init  # type: ignore[method-assign]
    return _AVOIDED


_AVOIDED = "Llama loads without the AMX buffer type (its kernel crashes on this CPU)"


STORY_PROMPT = "Write a long story about the sea."


class BareLoop:
    """A bare llama.cpp decode loop (greedy argmax, no sampler, no request path) after
    :data:`STORY_PROMPT`: the floor a reply's decode rate is compared with. The team is
    explicit, so the loop stays outside the package's CPU budget."""

    def __init__(self, path: str, n_threads: int, n_threads_batch: int, n_ctx: int = 1024):
        from langchain_llamacpp_local.llama.engine import Engine
        from langchain_llamacpp_local.llama.loading import LoadConfig

        self.engine = Engine(
            LoadConfig(
                model_path=path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads_batch
            )
        )
        self.prompt = self.engine.tokenize(STORY_PROMPT, add_special=True)

    def rate(self, n: int) -> float:
        """Tokens/s of ``n`` decode steps after the prompt, from an empty memory."""
        import time

        import llama_cpp
        import numpy as np

        eng = self.engine
        eng.clear()
        eng.decode(self.prompt, 0, 0)
        t0 = time.perf_counter()
        pos = len(self.prompt)
        for _i in range(n):
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(eng.ctx, -1), shape=(eng.n_vocab,)
            )
            eng.decode([int(logits.argmax())], pos, 0)
            pos += 1
        return n / (time.perf_counter() - t0)

    def close(self) -> None:
        self.engine.close()


def bare_decode_rate(
    path: str, n_threads: int, n_threads_batch: int, n: int, *, n_ctx: int = 1024, runs: int = 3
) -> float:
    """The median of ``runs`` :meth:`BareLoop.rate` measurements of a fresh loop."""
    import statistics

    loop = BareLoop(path, n_threads, n_threads_batch, n_ctx)
    try:
        return statistics.median(loop.rate(n) for _ in range(runs))
    finally:
        loop.close()


def bare_decode_rate_fresh(
    path: str, n_threads: int, n_threads_batch: int, n: int, *, n_ctx: int = 1024, runs: int = 3
) -> float:
    """:func:`bare_decode_rate` in a process of its own, as raw llama.cpp runs beside
    nothing. In the benchmark's own process the loop would be a second thread running
    OpenMP teams: libgomp keeps each such thread's helpers, and once they outnumber the
    CPUs every barrier sleeps instead of spinning, which slowed both the loop and the
    reply measured after it by about a fifth (see ``llama/omp.py``)."""
    return _in_own_process(
        f"bare_decode_rate({path!r}, {n_threads}, {n_threads_batch}, {n}, "
        f"n_ctx={n_ctx}, runs={runs})"
    )


def reply_decode_rate(path: str, n: int, *, n_ctx: int = 1024, runs: int = 2) -> float:
    """Decode tokens/s of a greedy ``ChatLlamaCpp`` reply of ``n`` tokens to
    :data:`STORY_PROMPT` (the reply's own ``timings``), from a fresh model with the
    package's defaults; the median of ``runs`` replies."""
    import statistics

    from langchain_llamacpp_local import ChatLlamaCpp

    llm = ChatLlamaCpp(model_path=path, n_ctx=n_ctx, temperature=0).load()
    try:
        rates = []
        for _ in range(runs):
            msg = llm.invoke(STORY_PROMPT, max_tokens=n, stop=[])
            rates.append(float(msg.response_metadata["timings"]["predicted_per_second"]))
    finally:
        llm.close()
    return statistics.median(rates)


def reply_decode_rate_fresh(path: str, n: int, *, n_ctx: int = 1024, runs: int = 2) -> float:
    """:func:`reply_decode_rate` in a process of its own, as
    :func:`bare_decode_rate_fresh` runs the bare loop: each side alone in its process."""
    return _in_own_process(f"reply_decode_rate({path!r}, {n}, n_ctx={n_ctx}, runs={runs})")


def _in_own_process(call: str) -> float:
    """The float that ``call`` (an expression over this module's names) returns, run in
    a fresh Python process with this repository and this folder on its path."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = (
        "import json, sys\n"
        f"sys.path[:0] = [{str(root)!r}, {str(Path(__file__).resolve().parent)!r}]\n"
        "import machine\n"
        f"print(json.dumps(machine.{call}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(json.loads(res.stdout.strip().splitlines()[-1]))


def code_commit() -> dict[str, Any]:
    """The git commit the figures were measured at, and whether the package or the
    benchmarks had uncommitted changes (then the commit alone does not reproduce them)."""

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(
                ["git", *args], cwd=_ROOT, capture_output=True, text=True, check=True
            )
        except (OSError, subprocess.CalledProcessError):
            return None
        return res.stdout.strip()

    status = git("status", "--porcelain", "--", "langchain_llamacpp_local", "benchmarks")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
    }


def default_out(name: str) -> Path:
    """``benchmarks/results/<name>.json``: the file a benchmark writes unless told
    otherwise (``--out``), and the one the README's figures name."""
    return RESULTS / f"{name}.json"


def write_results(
    name: str,
    figures: dict[str, Any],
    *,
    settings: dict[str, Any],
    out: Path | str | None = None,
    machine: dict[str, Any] | None = None,
) -> Path:
    """Write ``figures`` to ``out`` (default :func:`default_out`) beside what they depend
    on: the benchmark's settings, the code's commit, when it ran, the machine (CPU flags,
    ggml's features; pass ``machine`` when it was read with a model's weight placement)
    and the thread settings. Keys already in ``figures`` win. Returns the path."""
    record: dict[str, Any] = {
        "benchmark": name,
        "settings": settings,
        "code": code_commit(),
        "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine if machine is not None else machine_info(),
        "thread_settings": thread_settings(),
    }
    record.update(figures)
    path = Path(out) if out is not None else default_out(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"results written to {path}", file=sys.stderr, flush=True)
    return path
