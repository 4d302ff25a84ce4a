"""Loading a model: the load settings, the checks before llama.cpp sees a file, the
shared ``llama_model`` and where its weights go.

Every model a context uses (chat, embeddings, draft) is loaded here, once per
:meth:`LoadConfig.model_key`, and freed with the LoRA adapters it holds.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.errors import ModelLoadError, ModelNotFoundError
from langchain_llamacpp_local.llama import ggml_cpu, model_handle
from langchain_llamacpp_local.llama.backend import capture_log, init_backend, log_reasons
from langchain_llamacpp_local.llama.gguf import (
    GGUFHeaderError,
    check_hparams,
    open_regular_file,
    read_hparams,
    read_tensor_infos,
)
from langchain_llamacpp_local.llama.lora_registry import free_adapters
from langchain_llamacpp_local.llama.model_handle import model_address
from langchain_llamacpp_local.llama.rpc import DevicePlacement
from langchain_llamacpp_local.llama.settings import DEFAULT_N_BATCH, KV_TYPES, check_load_settings
from langchain_llamacpp_local.llama.weights import (
    AMX,
    TensorInfo,
    WeightPlacement,
    plan_weight_placement,
)

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class LoadConfig:
    """Everything that decides how a model is loaded; two equal configs share one model."""

    model_path: str
    n_ctx: int | None = None
    n_batch: int = DEFAULT_N_BATCH
    n_ubatch: int | None = None
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_gpu_layers: int = 0
    flash_attn: bool | None = None
    type_k: str | None = None
    type_v: str | None = None
    swa_full: bool = False
    n_slots: int = 1
    kv_unified: bool = False
    use_mmap: bool = True
    use_mlock: bool = False
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    mmproj_path: str | None = None
    image_min_tokens: int | None = None
    image_max_tokens: int | None = None
    # placement across devices (see rpc.DevicePlacement): RPC endpoints of this model
    # only, and the proportion of layers per device (RPC devices first, then local GPUs)
    rpc_servers: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] | None = None
    # a second, small GGUF proposing draft tokens (speculative="draft"); the worker key
    # includes it, the target's weights do not depend on it
    draft_model_path: str | None = None
    # weights in ggml's AMX buffer type: None/False keep them out (weights.py)
    cpu_amx: bool | None = None
    # bit-exact mode: flash attention off by default and the exactness probes at load
    # (the worker also decodes on a fixed grid and in exact groups; see chunking)
    deterministic: bool = False
    # LoRA adapters (lora_registry.py): (name, absolute path, default scale), loaded once per
    # model and shared by its contexts; a context applies them per request
    lora_adapters: tuple[tuple[str, str, float], ...] = ()

    def model_key(self) -> tuple[tuple[str, object], ...]:
        """What decides the loaded weights: configs with equal keys share one ``llama_model``.

        Every field except the per-context ones in :data:`CONTEXT_FIELDS` counts, so a
        new load setting is part of the key unless it is listed there.
        """
        return tuple(
            (f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in CONTEXT_FIELDS
        )


#: LoadConfig fields that only shape a context (or the projector), not the weights.
CONTEXT_FIELDS = frozenset(
    {
        "n_ctx",
        "n_batch",
        "n_ubatch",
        "n_threads",
        "n_threads_batch",
        "flash_attn",
        "type_k",
        "type_v",
        "swa_full",
        "n_slots",
        "kv_unified",
        "rope_freq_base",
        "rope_freq_scale",
        "mmproj_path",
        "image_min_tokens",
        "image_max_tokens",
        "draft_model_path",
        "deterministic",
        "lora_adapters",
    }
)


def check_gguf_file(path: str) -> None:
    """Fail early, with a clear message, on a path llama.cpp would reject obscurely
    or abort the process on (a FIFO that blocks, a header value it asserts on)."""
    p = Path(path)
    if not p.exists():
        raise ModelNotFoundError(path, [path], message=f"model file not found: {path}")
    try:
        with open_regular_file(p) as f:
            magic = f.read(4)
    except ValueError as exc:
        raise ModelLoadError(f"model path is not a file: {exc}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read the model file {path}: {exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {path}")
    try:
        meta = read_hparams(p)
    except GGUFHeaderError as exc:  # a length past the end of the file: crafted or cut
        raise ModelLoadError(f"could not load the model: {exc}") from None
    except (ValueError, OSError, struct.error, UnicodeDecodeError):
        return  # unreadable header: llama.cpp's own loader reports it cleanly
    try:
        check_hparams(meta)
    except ValueError as exc:
        raise ModelLoadError(f"invalid GGUF header in {path}: {exc}") from None


def check_load_config(config: LoadConfig) -> None:
    """Refuse settings llama.cpp would abort on (also for direct :class:`Engine` use)."""
    check_load_settings(vars(config))


def kv_type(name: str | None, field: str) -> int | None:
    if name is None:
        return None
    try:
        return KV_TYPES[name.lower()]
    except KeyError:
        raise ValueError(
            f"{field}={name!r} is not a KV cache type; use one of {sorted(KV_TYPES)}"
        ) from None


def load_model(
    config: LoadConfig,
    progress: Callable[[float], None] | None = None,
    *,
    extra_bufts: Sequence[str] | None = None,
) -> model_handle.ModelRef:
    """A reference to the shared ``llama_model`` for ``config`` (loaded on first use).

    Chat and embedding contexts on the same file and load settings
    (:meth:`LoadConfig.model_key`) share one model; ``progress`` is only called
    when this call actually loads it. ``extra_bufts`` decides the weight placement as
    if the CPU back-end offered those buffer types (see :func:`plan_weights`).
    """
    init_backend()
    check_gguf_file(config.model_path)

    def load() -> object:
        mparams = C.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        mparams.use_mmap = config.use_mmap
        mparams.use_mlock = config.use_mlock
        progress_cb = None
        if progress is not None:

            def _progress(value: float, _user: ctypes.c_void_p) -> bool:
                try:
                    progress(float(value))
                except Exception:  # a UI callback must never break loading
                    logger.debug("progress callback failed", exc_info=True)
                return True

            progress_cb = C.llama_progress_callback(_progress)
            mparams.progress_callback = progress_cb
        placement = DevicePlacement(config.rpc_servers, config.tensor_split)
        placement.apply(mparams)
        weights = plan_weights(config, extra_bufts)
        mparams.use_extra_bufts = weights.use_extra_bufts
        overrides = buft_overrides(weights)
        if overrides is not None:
            mparams.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
        if weights.avoided:
            logger.info("%s: %s", config.model_path, weights.reason)
        with capture_log() as lines:
            model = C.llama_model_load_from_file(config.model_path.encode(), mparams)
        del progress_cb, overrides  # kept alive until the load returns
        if not model:
            placement.release()
            why = log_reasons(lines)
            raise ModelLoadError(
                f"llama.cpp could not load {config.model_path} (truncated, corrupt or an "
                "unsupported architecture)" + (f": {why}" if why else "")
            )
        placements[model] = placement
        _weight_buffers[model_address(model)] = _buffer_sizes([text for _, text in lines])
        return model

    def free(model: object) -> None:
        _weight_buffers.pop(model_address(model), None)
        free_adapters(model)  # adapters hold the model's tensors: before the model
        C.llama_model_free(model)
        placements.pop(model).release()  # after the model: it holds the RPC devices

    placements: dict[object, DevicePlacement] = {}
    key = config.model_key()
    if extra_bufts is not None:
        key = (*key, ("extra_bufts", tuple(extra_bufts)))
    return model_handle.acquire(key, load, free)


# Weight buffer sizes by buffer type name, per loaded model (see :func:`weight_buffers`).
_weight_buffers: dict[int, dict[str, float]] = {}
_BUFFER_SIZE = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s*([0-9.]+) MiB")


def _buffer_sizes(lines: Sequence[str]) -> dict[str, float]:
    sizes: dict[str, float] = {}
    for line in lines:
        m = _BUFFER_SIZE.search(line)
        if m:
            sizes[m.group(1)] = sizes.get(m.group(1), 0.0) + float(m.group(2))
    return sizes


def weight_buffers(model: object) -> dict[str, float]:
    """MiB of weights per buffer type llama.cpp reported when it loaded ``model``
    (``CPU_Mapped``, ``CPU_REPACK``, ``AMX``, a GPU's...)."""
    return dict(_weight_buffers.get(model_address(model), {}))


def plan_weights(config: LoadConfig, extra_bufts: Sequence[str] | None = None) -> WeightPlacement:
    """The weight placement for ``config`` (see :mod:`.weights`).

    ``extra_bufts`` are the CPU extra buffer types to decide for (default: the ones ggml
    registered on this machine); the tests pass them to check a decision on any CPU.
    """
    extra = tuple(ggml_cpu.extra_buffer_types()) if extra_bufts is None else tuple(extra_bufts)
    if AMX not in extra or config.cpu_amx:
        # nothing to avoid: no need to read the tensor table
        return plan_weight_placement(extra_bufts=extra, cpu_amx=config.cpu_amx)
    try:
        infos = read_tensor_infos(config.model_path)
    except (ValueError, OSError, struct.error, UnicodeDecodeError):
        infos = []  # unreadable table: llama.cpp's loader reports it; nothing to repack
    return plan_weight_placement(
        extra_bufts=extra,
        cpu_amx=config.cpu_amx,
        tensors=[TensorInfo(n, t, shape) for n, t, shape in infos],
        repack_accepts=ggml_cpu.repack_accepts,
    )


def buft_overrides(plan: WeightPlacement) -> ctypes.Array[ggml_cpu.BuftOverride] | None:
    """llama.cpp's NULL-terminated ``tensor_buft_overrides`` array for ``plan``."""
    if not plan.overrides:
        return None
    bufts = ggml_cpu.extra_buffer_types()
    array = (ggml_cpu.BuftOverride * (len(plan.overrides) + 1))()
    for i, (pattern, buft_name) in enumerate(plan.overrides):
        array[i].pattern = pattern.encode()
        array[i].buft = bufts[buft_name]
    return array


def flash_attn_setting(config: LoadConfig) -> bool | None:
    """Flash attention for ``config``: True/False, or None for llama.cpp's "auto".

    Unless set, it is on for a quantized V cache (which needs it, as in llama.cpp's
    auto), llama.cpp's auto when layers leave the CPU, and off on the CPU, as
    llama-cpp-python's ``Llama`` default: ggml's CPU kernel was slower for an agent
    turn's prompt piece on Gemma 3 270M (benchmarks/run.py) and far slower decoding
    over a small model's own long history (SmolLM2 at 3,000 tokens: 10.8 against
    34.1 tok/s, benchmarks/bench_flash_attn.py), though it skips the masked cells of
    other cached conversations, which the matrix-multiply path attends over
    (docs/configuration.md).
    Deterministic mode needs it off as well: the CPU kernel rounds a query row
    differently with the shape of its micro-batch, so a warm suffix would not match
    a fresh prompt (measured: up to 0.03 in a logit; 0.0 without it).
    """
    if config.flash_attn is not None:
        return config.flash_attn
    if (config.type_v or "f16").lower() not in ("f16", "f32", "bf16"):
        return True
    offloaded = bool(config.rpc_servers) or (
        config.n_gpu_layers != 0 and bool(C.llama_supports_gpu_offload())
    )
    if config.deterministic or not offloaded:
        return False
    return None
