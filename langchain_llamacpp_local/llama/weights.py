"""Which CPU buffer type holds each weight: the decision, as data.

ggml's CPU back-end offers "extra" buffer types that re-lay weights out for faster
kernels. llama.cpp gives each weight the first one that accepts it, in the order the
back-end lists them: on an Intel CPU with AMX (Sapphire Rapids and later) that is the
AMX type, then ``CPU_REPACK`` (the 4- and 8-row Q4_0/Q4_K/Q6_K/... GEMMs that make prompt
reading fast), then plain ``CPU``.

The AMX matrix kernel crashes the process (SIGSEGV in ``ggml_backend_amx_mul_mat``) on
Q4_K_M models on some of those CPUs: ggml-org/llama.cpp#20824, closed upstream without a
fix. So unless the user opts in (``cpu_amx=True``), no weight goes to AMX. llama.cpp has
no switch for one extra buffer type: an override to ``CPU`` searches the extra types
again (AMX first), and ``use_extra_bufts=False`` drops repacking too. The finest switch
that works is both together: extra types off, and an explicit ``CPU_REPACK`` override
for every weight the repack kernels accept (asked of ggml itself, see
:mod:`.ggml_cpu`), so the placement is what llama.cpp would choose with AMX left out.

This module decides; :func:`langchain_llamacpp_local.llama.loading.load_model` applies the
plan. It imports nothing from llama.cpp, so the decision is tested on any CPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

#: ggml's names of the CPU extra buffer types this module knows.
AMX = "AMX"
CPU_REPACK = "CPU_REPACK"


@dataclass(frozen=True)
class TensorInfo:
    """One weight as the GGUF header lists it."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # ggml order: ne[0] (row length) first


@dataclass(frozen=True)
class WeightPlacement:
    """How to load the weights: llama.cpp's ``use_extra_bufts`` and per-tensor overrides.

    ``overrides`` pairs a regular expression over tensor names (llama.cpp's
    ``tensor_buft_overrides``, searched with ``std::regex``) with a buffer type name.
    """

    use_extra_bufts: bool = True
    overrides: tuple[tuple[str, str], ...] = ()
    avoided: tuple[str, ...] = ()  # extra buffer types kept out of the placement
    reason: str = "llama.cpp's default placement"


# Weights that llama.cpp multiplies as the first operand of a MUL_MAT: the projections of
# the attention and feed-forward blocks (not their norms, sinks or biases), state-space
# in/out projections, and the output head. Others (token embeddings read by GET_ROWS,
# convolution kernels, norms) must not be repacked: the repack buffer keeps no readable
# copy of the data. Unknown names stay where llama.cpp's plain CPU type puts them.
_MATMUL_WEIGHT = re.compile(
    r"^(?:output|blk\.\d+\.(?:attn_(?!.*norm)(?!sinks)[a-z_]+|ffn_(?!.*norm)(?!gate_inp)"
    r"[a-z_]+|ssm_in|ssm_out|shortconv\.(?:in|out)_proj))\.weight$"
)


# Characters a name may have to be written into a pattern (escaping only the dot keeps
# the pattern valid for std::regex, whose identity escapes differ from Python's).
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.]+")


def is_matmul_weight(name: str) -> bool:
    """Whether llama.cpp uses the tensor ``name`` as a matrix-multiplication weight."""
    return _MATMUL_WEIGHT.match(name) is not None


def plan_weight_placement(
    *,
    extra_bufts: Sequence[str],
    cpu_amx: bool | None,
    tensors: Iterable[TensorInfo] = (),
    repack_accepts: Callable[[TensorInfo], bool] | None = None,
) -> WeightPlacement:
    """The placement for a model, given what the CPU back-end offers.

    ``extra_bufts`` are the extra buffer types ggml registered on this machine (AMX only
    where the build has the kernels and the CPU has the instructions); ``cpu_amx`` the
    user's choice (None: off while the upstream kernel is known to crash);
    ``repack_accepts`` says whether ``CPU_REPACK`` takes a weight (ggml's own check).
    """
    if AMX not in extra_bufts:
        return WeightPlacement(reason="no AMX buffer type on this machine")
    if cpu_amx:
        return WeightPlacement(reason="AMX allowed (cpu_amx=True)")
    names: list[str] = []
    if CPU_REPACK in extra_bufts and repack_accepts is not None:
        names = [
            t.name
            for t in tensors
            if len(t.shape) == 2
            and is_matmul_weight(t.name)
            and _SAFE_NAME.fullmatch(t.name)
            and repack_accepts(t)
        ]
    overrides = ((names_regex(names), CPU_REPACK),) if names else ()
    return WeightPlacement(
        use_extra_bufts=False,
        overrides=overrides,
        avoided=(AMX,),
        reason=(
            "AMX buffer type left out (its kernel crashes on some CPUs: "
            "ggml-org/llama.cpp#20824; cpu_amx=True opts in); "
            f"{len(names)} weights repacked explicitly"
        ),
    )


def names_regex(names: Iterable[str]) -> str:
    """A compact anchored regular expression matching exactly ``names``.

    Layer weights are grouped by their name with the layer number taken out
    (``blk\\.(?:0|1|7)\\.attn_q\\.weight``): llama.cpp compiles the pattern once per
    tensor, so it must stay short for models with hundreds of layers' weights.
    """
    by_stem: dict[str, list[int]] = {}
    plain: list[str] = []
    for name in sorted(set(names)):
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m:
            by_stem.setdefault(m.group(2), []).append(int(m.group(1)))
        else:
            plain.append(_escape(name))
    parts = [
        rf"blk\.(?:{'|'.join(str(i) for i in sorted(layers))})\.{_escape(stem)}"
        for stem, layers in sorted(by_stem.items())
    ]
    return "^(?:" + "|".join(parts + plain) + ")$"


def _escape(name: str) -> str:
    if not _SAFE_NAME.fullmatch(name):
        raise ValueError(f"tensor name {name!r} cannot be written into a pattern")
    return name.replace(".", r"\.")
