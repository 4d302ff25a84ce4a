"""The one module that talks to llama.cpp's C API (``llama_cpp.llama_cpp``).

It owns a model, a context and a reusable batch, and exposes the handful of
operations the worker needs: tokenize, decode a chunk at given positions, read
logits, trim/copy memory and save/restore sequence state. Keeping every ctypes
call here means the cache logic above it is plain Python.

An :class:`Engine` is not thread-safe: only its worker thread may use it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import re
import struct
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as C
import numpy as np

from langchain_llamacpp_local.errors import (
    DecodeError,
    ModelLoadError,
    ModelNotFoundError,
    NonFiniteOutputError,
    RequestCancelledError,
)
from langchain_llamacpp_local.llama import ggml_cpu, model_handle, vocab
from langchain_llamacpp_local.llama.adapters import check_adapter_file, not_a_file
from langchain_llamacpp_local.llama.backend import (
    aborting,
    capture_log,
    init_backend,
    log_reasons,
    route_mtmd_log,
)
from langchain_llamacpp_local.llama.context import (
    fill_batch,
    flash_attn_type,
    free_context,
    new_context,
)
from langchain_llamacpp_local.llama.gguf import (
    GGUFHeaderError,
    check_hparams,
    open_regular_file,
    read_gguf_metadata,
    read_hparams,
    read_tensor_data,
    read_tensor_infos,
)
from langchain_llamacpp_local.llama.rpc import DevicePlacement
from langchain_llamacpp_local.llama.settings import DEFAULT_MAX_CTX, KV_TYPES, check_load_settings
from langchain_llamacpp_local.llama.threads import (
    cpu_budget,
    default_cpu_view,
    log_thread_plan,
    plan_threads,
)
from langchain_llamacpp_local.llama.weights import (
    AMX,
    TensorInfo,
    WeightPlacement,
    plan_weight_placement,
)

logger = logging.getLogger(__name__)

#: Longest verify step :meth:`Engine._probe_verify_rows` tries (cost: a few decodes per k).
VERIFY_PROBE_MAX = 8
#: Prefix lengths after which it tries them (kernels round alike or not depending on data).
VERIFY_PROBE_PREFIXES = (37, 4, 20)

_GGUF_MAGIC = b"GGUF"


class MediaChunk:
    """An image's tokens from mtmd (owned copy), spanning ``n_pos`` KV positions."""

    def __init__(self, chunk: object, n_pos: int, n_tokens: int, digest: str) -> None:
        self.chunk = chunk
        self.n_pos = n_pos
        self.n_tokens = n_tokens
        self.digest = digest

    def __del__(self) -> None:
        chunk, self.chunk = self.chunk, None
        if chunk:
            try:
                from llama_cpp import mtmd_cpp as M

                M.mtmd_input_chunk_free(chunk)
            except Exception:  # interpreter shutdown
                pass


#: ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: a sequence's state without its trimmable KV
#: (what a checkpoint of recurrent or sliding-window memory saves).
PARTIAL_ONLY = 1


class MemoryKind(str, Enum):
    """What the context's memory lets us do with a cached prefix."""

    PARTIAL = "partial"  # attention KV: any suffix can be trimmed
    FULL_ONLY = "full_only"  # recurrent/hybrid: only whole sequences can be removed
    SWA = "swa"  # sliding-window KV: trim works, but old positions get pruned


@dataclass(frozen=True)
class LoadConfig:
    """Everything that decides how a model is loaded; two equal configs share one model."""

    model_path: str
    n_ctx: int | None = None
    n_batch: int = 512
    n_ubatch: int | None = None
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_gpu_layers: int = 0
    flash_attn: bool | None = None
    type_k: str | None = None
    type_v: str | None = None
    swa_full: bool = False
    n_seq_max: int = 1
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
    # weights in ggml's AMX buffer type: None/False keep them out (weight_placement.py)
    cpu_amx: bool | None = None
    # bit-exact mode: flash attention off by default and the exactness probes at load
    # (the worker also decodes on a fixed grid and in exact groups; see chunking)
    deterministic: bool = False
    # LoRA adapters (lora.py): (name, absolute path, default scale), loaded once per
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
        "n_seq_max",
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

#: Exactness probe results per (model file identity, llama.cpp build, context settings):
#: reloading the same model in deterministic mode does not probe again.
_PROBE_CACHE: dict[tuple[object, ...], tuple[int, int]] = {}


# --------------------------------------------------------------------------- engine


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
    if magic != _GGUF_MAGIC:
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
    settings = {k: v for k, v in vars(config).items() if k != "n_seq_max"}
    check_load_settings({**settings, "n_slots": config.n_seq_max})


def _kv_type(name: str | None, field: str) -> int | None:
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
        overrides = _buft_overrides(weights)
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
        _weight_buffers[_address(model)] = _buffer_sizes([text for _, text in lines])
        return model

    def free(model: object) -> None:
        _weight_buffers.pop(_address(model), None)
        _free_adapters(model)  # adapters hold the model's tensors: before the model
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


def _address(model: object) -> int:
    return int(ctypes.cast(model, ctypes.c_void_p).value or 0)


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
    return dict(_weight_buffers.get(_address(model), {}))


def plan_weights(config: LoadConfig, extra_bufts: Sequence[str] | None = None) -> WeightPlacement:
    """The weight placement for ``config`` (see :mod:`.weight_placement`).

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


def _buft_overrides(plan: WeightPlacement) -> ctypes.Array[ggml_cpu.BuftOverride] | None:
    """llama.cpp's NULL-terminated ``tensor_buft_overrides`` array for ``plan``."""
    if not plan.overrides:
        return None
    bufts = ggml_cpu.extra_buffer_types()
    array = (ggml_cpu.BuftOverride * (len(plan.overrides) + 1))()
    for i, (pattern, buft_name) in enumerate(plan.overrides):
        array[i].pattern = pattern.encode()
        array[i].buft = bufts[buft_name]
    return array


# LoRA adapters per loaded model, by absolute path: loaded on first use by any context
# of the model, freed just before it (see load_model's ``free``).
_adapters: dict[int, dict[str, object]] = {}
_adapters_lock = threading.Lock()


def _free_adapters(model: object) -> None:
    with _adapters_lock:
        loaded = _adapters.pop(_address(model), {})
    for adapter in loaded.values():
        C.llama_adapter_lora_free(adapter)


def load_adapter(model: object, model_path: str, path: str) -> object:
    """The ``llama_adapter_lora`` for ``path`` on ``model``, loaded once per model.

    The file is checked first (:func:`adapters.check_adapter_file`: architecture, tensor names and
    shapes against the base model), so a wrong or corrupt adapter is a
    :class:`ModelLoadError` naming it, never an abort inside llama.cpp.
    """
    with _adapters_lock:
        loaded = _adapters.setdefault(_address(model), {})
        adapter = loaded.get(path)
        if adapter is not None:
            return adapter
        why = not_a_file(path)
        if why is not None:
            raise ModelLoadError(f"LoRA adapter {path} is {why}")
        if not Path(path).is_file():
            raise ModelNotFoundError(path, [path], message=f"LoRA adapter file not found: {path}")
        arch = (read_gguf_metadata(model_path, ["general.architecture"]) or {}).get(
            "general.architecture", ""
        )
        model_tensors = {name: shape for name, _t, shape in read_tensor_infos(model_path)}
        check_adapter_file(
            path,
            str(arch),
            model_tensors,
            lambda p: read_gguf_metadata(
                p, ["general.type", "general.architecture", "adapter.type", "adapter.lora.alpha"]
            ),
            read_tensor_infos,
            read_tensor_data,
        )
        adapter = C.llama_adapter_lora_init(model, path.encode())
        if not adapter:
            raise ModelLoadError(
                f"llama.cpp could not load the LoRA adapter {path} (corrupt, or made for "
                "another base model; enable DEBUG logging on "
                "'langchain_llamacpp_local.llama_cpp' for its reason)"
            )
        loaded[path] = adapter
        return adapter


def alora_invocation_tokens(adapter: object) -> list[int]:
    """An activated LoRA's invocation tokens ([] for a plain LoRA)."""
    n = int(C.llama_adapter_get_alora_n_invocation_tokens(adapter))
    if n <= 0:
        return []
    ptr = C.llama_adapter_get_alora_invocation_tokens(adapter)
    return [int(ptr[i]) for i in range(n)] if ptr else []


def _tokenize_parts(
    mtmd: object, chunks: object, parts: Sequence[tuple[str, bool] | None], bitmaps: list[object]
) -> int:
    """``mtmd_tokenize_from_parts``: each text part with its own ``parse_special``, the
    bitmaps in order at the ``None`` parts; BOS added as ``mtmd_tokenize`` adds it."""
    from llama_cpp import mtmd_cpp as M

    if sum(p is None for p in parts) != len(bitmaps):
        return 1
    keep: list[object] = []  # the buffers must outlive the call
    ptrs = []
    images = iter(bitmaps)
    for part in parts:
        if part is None:
            item = M.mtmd_input_part(text=None, bitmap=next(images))
        else:
            raw = part[0].encode("utf-8")
            inp = M.mtmd_input_text(
                text=raw, text_len=len(raw), add_special=False, parse_special=part[1]
            )
            keep += [raw, inp]
            item = M.mtmd_input_part(text=ctypes.pointer(inp), bitmap=None)
        keep.append(item)
        ptrs.append(ctypes.pointer(item))
    arr = (ctypes.POINTER(M.mtmd_input_part) * max(1, len(ptrs)))(*ptrs)
    return int(M.mtmd_tokenize_from_parts(mtmd, chunks, arr, len(ptrs), True))


def flash_attn_setting(config: LoadConfig) -> bool | None:
    """Flash attention for ``config``: True/False, or None for llama.cpp's "auto".

    Unless set, it is on for a quantized V cache (which needs it, as in llama.cpp's
    auto), llama.cpp's auto when layers leave the CPU, and off on the CPU: ggml's CPU
    kernel reads a prompt piece one query row at a time and is slower there than the
    matrix-multiply path (benchmarks/run.py, as llama-cpp-python's ``Llama`` default).
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


class Engine(vocab.VocabMethods):
    """A loaded model with one persistent context (see module docstring)."""

    def __init__(self, config: LoadConfig, progress: Callable[[float], None] | None = None) -> None:
        init_backend()
        self.config = config
        check_load_config(config)
        type_k = _kv_type(config.type_k, "type_k")
        type_v = _kv_type(config.type_v, "type_v")

        self._model_ref = load_model(config, progress)
        self.model = model = self._model_ref.model
        self.weight_buffers = weight_buffers(model)
        self.ctx = None
        self.mtmd: object | None = None
        self._batch: C.llama_batch | None = None
        # the adapter set applied to the context (set_lora); () while probing
        self._lora_current: tuple[tuple[str, float], ...] = ()
        try:
            self.vocab = C.llama_model_get_vocab(model)
            self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
            self.n_ctx_train = C.llama_model_n_ctx_train(model)
            self.metadata = self._read_metadata()
            self.is_recurrent = bool(C.llama_model_is_recurrent(model))
            self.is_hybrid = bool(C.llama_model_is_hybrid(model))
            self.n_swa = int(C.llama_model_n_swa(model))

            # n_ctx is one conversation's window. Per-sequence KV streams (the default)
            # give each slot a window of its own, so the context holds n_ctx x n_slots.
            n_ctx = config.n_ctx or min(self.n_ctx_train or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)
            n_seq = config.n_seq_max
            cparams = C.llama_context_default_params()
            cparams.n_ctx = n_ctx if config.kv_unified else n_ctx * n_seq
            cparams.n_batch = min(config.n_batch, n_ctx)
            cparams.n_ubatch = min(config.n_ubatch or config.n_batch, cparams.n_batch)
            cparams.n_seq_max = n_seq
            cparams.kv_unified = config.kv_unified
            self.thread_plan = plan = plan_threads(
                default_cpu_view(), config.n_threads, config.n_threads_batch
            )
            log_thread_plan(plan)
            threads = plan.n_threads_batch
            cparams.n_threads = plan.n_threads
            cparams.n_threads_batch = plan.n_threads_batch
            #: decodes of this context (and of a draft model's, which runs on the same
            #: thread) draw threads from the process-wide budget under one id
            self.team = id(self)
            self._threads_set = (plan.n_threads, plan.n_threads_batch)
            # the process-wide budget, looked up once (not per decode); None for an
            # explicit setting, which always wins, and for deterministic mode, which
            # keeps one team size (its exactness probes are keyed by it)
            self._budget = (
                cpu_budget()
                if config.n_threads is None
                and config.n_threads_batch is None
                and not config.deterministic
                else None
            )
            cparams.swa_full = config.swa_full
            cparams.no_perf = True
            cparams.flash_attn_type = flash_attn_type(flash_attn_setting(config))
            if type_k is not None:
                cparams.type_k = type_k
            if type_v is not None:
                cparams.type_v = type_v
            if config.rope_freq_base:
                cparams.rope_freq_base = config.rope_freq_base
            if config.rope_freq_scale:
                cparams.rope_freq_scale = config.rope_freq_scale
            self._abort_flag: Callable[[], bool] | None = None
            self._abort_cb = C.ggml_abort_callback(self._should_abort)
            cparams.abort_callback = self._abort_cb
            ctx = new_context(
                model, cparams, f"a context of {n_ctx} tokens for {config.model_path}"
            )
            self.ctx = ctx
            self.kv_unified = config.kv_unified
            self.n_ctx_total = int(C.llama_n_ctx(ctx))
            # llama.cpp pads each stream to a multiple of 256: the window of one slot
            self.n_ctx = (
                self.n_ctx_total if self.kv_unified else min(n_ctx, self.n_ctx_total // n_seq)
            )
            self.n_batch = int(C.llama_n_batch(ctx))
            self.n_ubatch = int(C.llama_n_ubatch(ctx))
            self.n_seq_max = int(C.llama_n_seq_max(ctx))
            self.mem = C.llama_get_memory(ctx)
            self._batch = C.llama_batch_init(self.n_batch, 0, self.n_seq_max)
            self.add_bos = bool(C.llama_vocab_get_add_bos(self.vocab))
            self.bos_id = int(C.llama_vocab_bos(self.vocab))
            self.eos_id = int(C.llama_vocab_eos(self.vocab))
            self.memory_kind = self._probe_memory()
            # 0: not probed (only deterministic mode needs them)
            self.exact_rows = 0
            self.exact_verify_rows = 0
            if config.deterministic:
                self.exact_rows, self.exact_verify_rows = self._probe_exactness(threads)
            self.mtmd = self._load_mtmd(threads) if config.mmproj_path else None
            self._load_lora()
        except BaseException:
            self.close()
            raise
        logger.debug(
            "loaded %s: n_ctx=%d n_batch=%d n_ubatch=%d memory=%s n_swa=%d",
            config.model_path,
            self.n_ctx,
            self.n_batch,
            self.n_ubatch,
            self.memory_kind.value,
            self.n_swa,
        )

    def _load_lora(self) -> None:
        """Load (or share) this model's LoRA adapters; none is applied yet."""
        self.lora: dict[str, object] = {}
        self.lora_defaults: dict[str, float] = {}
        self.alora: dict[str, list[int]] = {}
        for name, path, scale in self.config.lora_adapters:
            try:
                adapter = load_adapter(self.model, self.config.model_path, path)
            except ModelLoadError as exc:
                raise ModelLoadError(f"LoRA adapter {name!r}: {exc}") from None
            self.lora[name] = adapter
            self.lora_defaults[name] = scale
            invocation = alora_invocation_tokens(adapter)
            if invocation:
                self.alora[name] = invocation

    def check_lora(self, lora: Sequence[tuple[str, float]]) -> None:
        """Raise ``ValueError`` if ``lora`` names an adapter this context did not load."""
        unknown = [n for n, _ in lora if n not in self.lora]
        if unknown:
            raise ValueError(
                f"unknown LoRA adapter {unknown[0]!r}: this model has "
                f"{sorted(self.lora) or 'none'} (lora_adapters=...)"
            )

    def set_lora(self, lora: Sequence[tuple[str, float]]) -> None:
        """Apply the adapter set ``lora`` ((name, scale) pairs) to the context for the
        decodes that follow; a no-op when it is already applied."""
        key = tuple(lora)
        if key == self._lora_current:
            return
        self.check_lora(key)
        n = len(key)
        adapters = (C.llama_adapter_lora_p_ctypes * max(1, n))(*(self.lora[k] for k, _ in key))
        scales = (ctypes.c_float * max(1, n))(*(s for _, s in key))
        rc = C.llama_set_adapters_lora(self.ctx, adapters if n else None, n, scales if n else None)
        if rc != 0:
            raise DecodeError(f"llama.cpp could not apply the LoRA adapters {key} (code {rc})")
        self._lora_current = key

    def _load_mtmd(self, threads: int) -> object:
        """The vision projector (llama.cpp mtmd), created next to the text model."""
        from llama_cpp import mtmd_cpp as M

        path = self.config.mmproj_path
        assert path is not None
        check_gguf_file(path)
        route_mtmd_log()
        params = M.mtmd_context_params_default()
        params.use_gpu = self.config.n_gpu_layers != 0
        params.n_threads = threads
        params.print_timings = False
        params.warmup = False
        if self.config.image_min_tokens is not None:
            params.image_min_tokens = self.config.image_min_tokens
        if self.config.image_max_tokens is not None:
            params.image_max_tokens = self.config.image_max_tokens
        with capture_log() as reasons:
            mctx = M.mtmd_init_from_file(path.encode(), self.model, params)
        if not mctx:
            why = log_reasons(reasons)
            raise ModelLoadError(
                f"llama.cpp could not load the projector {path} for this model"
                + (f": {why}" if why else "")
            )
        if not M.mtmd_support_vision(mctx):
            M.mtmd_free(mctx)
            raise ModelLoadError(f"{path} has no vision encoder")
        return mctx

    def tokenize_multimodal(
        self,
        text: str | Sequence[tuple[str, bool] | None],
        images: Sequence[tuple[int, int, bytes | bytearray, str]],
    ) -> tuple[list[Hashable], dict[int, MediaChunk]]:
        """Tokenize ``text`` whose media markers stand for ``images`` (w, h, rgb, digest).

        ``text`` is the prompt (special-token text parsed), or its parts: ``(text,
        parse_special)`` each tokenized on its own, ``None`` for each image in turn
        (``mtmd_tokenize_from_parts``: message text read as plain text).

        Returns one entry per KV position (image positions are ``("media", digest, k)``,
        so an unchanged image extends the common prefix) and the image chunks by the
        position where each starts.
        """
        from llama_cpp import mtmd_cpp as M

        if self.mtmd is None:
            raise ValueError(
                "this model has no vision projector: pass mmproj_path=... to send images"
            )
        bitmaps = []
        chunks = M.mtmd_input_chunks_init()
        try:
            for w, h, rgb, digest in images:
                # a pointer to the caller's pixels, not a copy: copying a large image
                # holds the GIL (mtmd copies it itself, in C, with the GIL released)
                pixels = np.frombuffer(rgb, dtype=np.uint8)
                if pixels.size != w * h * 3:
                    raise ValueError(f"a {w}x{h} image needs {w * h * 3} RGB bytes")
                bm = M.mtmd_bitmap_init(w, h, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
                if not bm:
                    raise ValueError(f"llama.cpp could not take a {w}x{h} image")
                M.mtmd_bitmap_set_id(bm, digest.encode())
                bitmaps.append(bm)
            if isinstance(text, str):
                raw = text.encode("utf-8")
                inp = M.mtmd_input_text(
                    text=raw, text_len=len(raw), add_special=True, parse_special=True
                )
                arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
                rc = M.mtmd_tokenize(self.mtmd, chunks, ctypes.byref(inp), arr, len(bitmaps))
            else:
                rc = _tokenize_parts(self.mtmd, chunks, text, bitmaps)
            if rc == 1:
                raise ValueError("the prompt's image markers do not match the number of images")
            if rc != 0:
                raise ValueError(f"llama.cpp could not preprocess the image (code {rc})")
            entries: list[Hashable] = []
            media: dict[int, MediaChunk] = {}
            for i in range(M.mtmd_input_chunks_size(chunks)):
                ch = M.mtmd_input_chunks_get(chunks, i)
                if M.mtmd_input_chunk_get_type(ch) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    ptr = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
                    entries.extend(ptr[: n.value])
                    continue
                n_pos = int(M.mtmd_input_chunk_get_n_pos(ch))
                cid = (M.mtmd_input_chunk_get_id(ch) or b"").decode()
                media[len(entries)] = MediaChunk(
                    M.mtmd_input_chunk_copy(ch),
                    n_pos,
                    int(M.mtmd_input_chunk_get_n_tokens(ch)),
                    cid,
                )
                entries.extend(("media", cid, k) for k in range(n_pos))
            return entries, media
        finally:
            for bm in bitmaps:
                M.mtmd_bitmap_free(bm)
            M.mtmd_input_chunks_free(chunks)

    def eval_media(self, media: MediaChunk, pos: int, seq_id: int) -> None:
        """Encode an image chunk and decode its embeddings at ``pos`` of ``seq_id``."""
        from llama_cpp import mtmd_cpp as M

        new_pos = C.llama_pos(0)
        rc = M.mtmd_helper_eval_chunk_single(
            self.mtmd,
            self.ctx,
            media.chunk,
            pos,
            seq_id,
            self.n_batch,
            False,  # mtmd ignores it for an image: the text after it is checked
            ctypes.byref(new_pos),
        )
        if rc != 0:
            raise DecodeError(f"evaluating an image chunk failed with code {rc}")

    # ------------------------------------------------------------------ metadata

    def _read_metadata(self) -> dict[str, str]:
        return vocab.read_metadata(self.model)

    # ------------------------------------------------------------------ memory probe

    def _probe_memory(self) -> MemoryKind:
        """Classify the memory the way llama.cpp's server does (common_context_can_seq_rm)."""
        kind = MemoryKind.PARTIAL
        if self.is_recurrent or self.is_hybrid:
            kind = MemoryKind.FULL_ONLY
        else:
            # Decode two tokens and try a partial trim: the reliable test for any new
            # memory type. SWA caches pass it but prune old positions later.
            tok = self.bos_id if self.bos_id >= 0 else 0
            self.decode([tok, tok], 0, 0, logits_last=False)
            if not C.llama_memory_seq_rm(self.mem, 0, 1, -1):
                kind = MemoryKind.FULL_ONLY
            elif self.n_swa > 0 and not self.config.swa_full:
                kind = MemoryKind.SWA
        C.llama_memory_clear(self.mem, True)
        return kind

    def _probe_exactness(self, threads: int) -> tuple[int, int]:
        """(exact_rows, exact_verify_rows), probed once per model file, build and settings."""
        st = os.stat(self.config.model_path)
        key = (
            os.path.realpath(self.config.model_path),
            st.st_size,
            st.st_mtime_ns,
            llama_cpp.__version__,
            C.llama_print_system_info(),
            threads,
            dataclasses.replace(self.config, model_path="", draft_model_path=None),
        )
        found = _PROBE_CACHE.get(key)
        if found is None:
            found = _PROBE_CACHE[key] = (self._probe_rows(), self._probe_verify_rows())
        return found

    def _probe_rows(self) -> int:
        """How many sequences may share a generation step without changing any one's logits.

        llama.cpp's CPU matmuls take a vector path for a one-row micro-batch and tiled
        or grouped kernels for several rows (F32/F16/Q8_0 via llamafile's GEMM; 4-row
        groups for repacked K-quants), which round differently. Distinct short
        sequences each take one step alone, then together in groups of 2.. n_seq_max;
        the answer is the largest size up to which every group matched bit for bit
        (1: never share). Measured: Gemma 3 270M Q4_K_M gives 3, the F32 test models 1.
        """
        k_max = min(self.n_seq_max, 8)
        if k_max < 2:
            return 1
        base = [self.bos_id if self.bos_id >= 0 else 0]
        n_vocab = max(2, min(self.n_vocab, 4096))
        prompts = [
            base + [(97 + 31 * s + 7 * i) % n_vocab for i in range(4 + 3 * s)] for s in range(k_max)
        ]
        best = 1

        def prime() -> None:  # recurrent state cannot be stepped back: start over
            C.llama_memory_clear(self.mem, True)
            for s, p in enumerate(prompts):
                self.decode(p[:-1], 0, s, logits_last=False)

        try:
            prime()
            solo = []
            for s, p in enumerate(prompts):
                self.decode_batch([p[-1]], [len(p) - 1], [s], [True])
                solo.append(self.logits(0))
            for k in range(2, k_max + 1):
                prime()
                pos = [len(p) - 1 for p in prompts[:k]]
                self.decode_batch([p[-1] for p in prompts[:k]], pos, list(range(k)), [True] * k)
                if not all(np.array_equal(self.logits(i), solo[i]) for i in range(k)):
                    break
                best = k
        except (DecodeError, RequestCancelledError):  # recurrent state cannot be stepped back
            best = 1
        finally:
            C.llama_memory_clear(self.mem, True)
        logger.debug("up to %d sequences share a generation step exactly", best)
        return best

    def _probe_verify_rows(self) -> int:
        """How many tokens of ONE sequence one decode may carry with exactly the logits
        (and the memory) that one-token steps would give: speculative verification.

        For k = 2.. ``VERIFY_PROBE_MAX``, after prefixes of a few lengths, decoding k
        tokens at once must give, row by row, the logits of k single steps, and the
        step after it must match too (the cached K/V or recurrent state is the same).
        Returns the largest k that held everywhere (1: a multi-token verify step
        changes logits). A probe can only find counterexamples: whether two kernels
        round alike depends on the data, so it tries several positions. Measured on
        x86: Gemma 3 270M Q4_K_M matches for k <= 3 after some prefixes and not even
        for k = 2 after others (33, 40 tokens), so it gets 1; the test models with
        zeroed attention get 8.
        """
        k_max = min(VERIFY_PROBE_MAX, self.n_batch, self.n_ubatch)
        heads = [h for h in VERIFY_PROBE_PREFIXES if h + k_max + 1 <= self.n_ctx]
        if k_max < 2 or not heads:
            return 1
        try:
            # k = 2 everywhere first: most CPU models fail there, after a few decodes
            best = self._verify_rows_upto(2, heads)
            if best == 2 and k_max > 2:
                best = self._verify_rows_upto(k_max, heads)
        except (DecodeError, RequestCancelledError):
            best = 1
        finally:
            C.llama_memory_clear(self.mem, True)
        logger.debug("a verify step of up to %d tokens of one sequence is exact", best)
        return best

    def _verify_rows_upto(self, best: int, heads: Sequence[int]) -> int:
        bos = [self.bos_id] if self.bos_id >= 0 else []
        n_vocab = max(2, min(self.n_vocab, 4096))

        def prime(toks: list[int], head: int) -> None:  # recurrent state: start over
            C.llama_memory_clear(self.mem, True)
            self.decode(toks[:head], 0, 0, logits_last=False)

        for c, head in enumerate(heads):
            toks = bos + [(53 + 29 * c + 11 * i) % n_vocab for i in range(head + best + 1)]
            prime(toks, head)
            solo = []
            for i in range(head, head + best + 1):
                self.decode_batch([toks[i]], [i], [0], [True])
                solo.append(self.logits(0))
            for k in range(2, best + 1):
                prime(toks, head)
                self.decode_batch(toks[head : head + k], range(head, head + k), [0] * k, [True] * k)
                same = all(np.array_equal(self.logits(i), solo[i]) for i in range(k))
                if same:  # and the state it left: the next single step
                    self.decode_batch([toks[head + k]], [head + k], [0], [True])
                    same = np.array_equal(self.logits(0), solo[k])
                if not same:
                    best = k - 1
                    break
            if best < 2:
                return 1
        return best

    # ------------------------------------------------------------------ decode

    def _should_abort(self, _data: ctypes.c_void_p) -> bool:
        flag = self._abort_flag
        if flag is not None and flag():
            aborting.active = True
            return True
        return False

    def decode(
        self,
        tokens: Sequence[int],
        pos0: int,
        seq_id: int,
        *,
        logits_last: bool = True,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        """Decode ``tokens`` of one sequence at positions ``pos0..`` in ``n_batch`` chunks.

        ``cancel`` is checked before each chunk and, through llama.cpp's abort
        callback, inside a long decode. Raises :class:`RequestCancelledError` or
        :class:`DecodeError`; the chunks decoded before that stay in the cache.
        """
        n = len(tokens)
        done = 0
        while done < n:
            if cancel is not None and cancel():
                raise RequestCancelledError("cancelled during prompt processing")
            chunk = min(self.n_batch, n - done)
            last = done + chunk == n
            self.decode_batch(
                tokens[done : done + chunk],
                range(pos0 + done, pos0 + done + chunk),
                [seq_id] * chunk,
                [logits_last and last and i == chunk - 1 for i in range(chunk)],
                cancel=cancel,
            )
            done += chunk

    def decode_batch(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seq_ids: Sequence[int],
        outputs: Sequence[bool],
        *,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        """One ``llama_decode`` of up to ``n_batch`` tokens from several sequences.

        This is the continuous-batching step: prompt chunks of some requests and
        the next token of others go through the model together. ``outputs[i]``
        asks for logits at batch index ``i`` (read them with :meth:`logits`).
        """
        batch = self._batch
        assert batch is not None
        n = len(tokens)
        if n == 0:
            return
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        fill_batch(batch, tokens, positions, seq_ids, outputs)
        self._abort_flag = cancel
        try:
            if self._budget is not None:
                plan = self.thread_plan
                want = plan.n_threads if n == 1 else plan.n_threads_batch
                with self._budget.threads(self.team, want) as got:
                    self._use_threads(min(plan.n_threads, got), min(plan.n_threads_batch, got))
                    rc = C.llama_decode(self.ctx, batch)
            else:
                rc = C.llama_decode(self.ctx, batch)
        finally:
            self._abort_flag = None
            aborting.active = False
        if rc == 2:
            raise RequestCancelledError("cancelled during decoding")
        if rc != 0:
            raise DecodeError(
                f"llama_decode failed with code {rc} "
                f"({'no KV slot for the batch' if rc == 1 else 'backend error'})"
            )
        if self._lora_current and any(outputs):
            self._check_finite([(i, seq_ids[i]) for i, out in enumerate(outputs) if out])

    def _check_finite(self, rows: Sequence[tuple[int, int]]) -> None:
        """After a decode under LoRA adapters: raise :class:`NonFiniteOutputError` if an
        output row (``(index, seq_id)`` pairs) holds NaN or inf, once the memory is wiped
        (:meth:`wipe_memory`).

        A scale within bounds can still overflow a pathological adapter's activations;
        the f16 KV cache then holds inf, and every sequence of a unified pool (every later
        one of a stream) multiplies those cells by a 0 attention weight: NaN. A sequence's
        last row attends to all its cells, so its logits show it. Checked here, before any
        other decode, and only under adapters: nothing else a request sends reaches the
        activations.
        """
        bad: set[int] = set()
        for i, seq in rows:
            if int(seq) not in bad:
                row = np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))
                if not np.isfinite(row).all():
                    bad.add(int(seq))
        if not bad:
            return
        adapters = dict(self._lora_current)
        lost = self.wipe_memory(bad)
        logger.warning(
            "LoRA adapters %s gave non-finite logits: KV memory wiped, %d other sequences lost",
            adapters,
            len(lost),
        )
        raise NonFiniteOutputError(
            f"the LoRA adapters {adapters} drove the model's activations out of range "
            "(NaN or inf logits): the request was stopped and its KV cells wiped, so no "
            "other request sees them. Lower the scale, or check the adapter file",
            frozenset(bad),
            lost,
        )

    def wipe_memory(self, drop: set[int]) -> frozenset[int]:
        """Zero every KV buffer, keeping every sequence but ``drop``: returns the
        sequences that could not be put back (their cells are gone).

        Removing a sequence's cells only marks them free; their data stays in the
        buffers and a masked cell is still multiplied (0 * inf = NaN). So the other
        sequences are copied out, the memory cleared with its data, and they are put back.
        """
        for seq in drop:
            self.seq_rm(seq, -1, -1)
        saved = [
            (seq, self.state_get(seq, 0))
            for seq in range(self.n_seq_max)
            if seq not in drop and self.seq_pos_max(seq) >= 0
        ]
        self.clear()
        lost: set[int] = set()
        for seq, data in saved:
            if not self.state_set(data, seq, 0):
                self.seq_rm(seq, -1, -1)
                lost.add(seq)
        return frozenset(lost)

    def _use_threads(self, n_threads: int, n_threads_batch: int) -> None:
        """Set the context's thread counts for the next decode (llama.cpp reads them
        per graph, so changing them between decodes is free)."""
        if (n_threads, n_threads_batch) != self._threads_set:
            C.llama_set_n_threads(self.ctx, n_threads, n_threads_batch)
            self._threads_set = (n_threads, n_threads_batch)

    def logits(self, idx: int = -1) -> np.ndarray:
        """A copy of the logits of output ``idx`` of the last decode (-1: the last one)."""
        ptr = C.llama_get_logits_ith(self.ctx, idx)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    # ------------------------------------------------------------------ memory

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        return bool(C.llama_memory_seq_rm(self.mem, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        C.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_min(self, seq_id: int) -> int:
        return int(C.llama_memory_seq_pos_min(self.mem, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(C.llama_memory_seq_pos_max(self.mem, seq_id))

    def clear(self) -> None:
        C.llama_memory_clear(self.mem, True)

    def state_size(self, seq_id: int, flags: int = 0) -> int:
        """Bytes of ``seq_id``'s state: llama.cpp counts them without copying any data."""
        return int(C.llama_state_seq_get_size_ext(self.ctx, seq_id, flags))

    def state_get(self, seq_id: int, flags: int = 0) -> bytearray:
        """``seq_id``'s state, copied once (it may be the whole KV cache of a conversation:
        no second copy into ``bytes``)."""
        size = self.state_size(seq_id, flags)
        raw = bytearray(size)  # slicing a ctypes array would build a list of ints
        buf = (ctypes.c_uint8 * size).from_buffer(raw)
        n = C.llama_state_seq_get_data_ext(self.ctx, buf, size, seq_id, flags)
        del buf
        del raw[n:]
        return raw

    def state_set(self, data: bytes, seq_id: int, flags: int = 0) -> bool:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return C.llama_state_seq_set_data_ext(self.ctx, buf, len(data), seq_id, flags) > 0

    def hold_model(self) -> model_handle.ModelRef:
        """Another counted reference to this engine's model (release it exactly once):
        the model and its vocabulary stay valid for its holder even after :meth:`close`."""

        def not_loaded() -> object:
            raise RuntimeError("the engine's model is no longer loaded")

        return model_handle.acquire(self._model_ref.key, not_loaded, lambda _model: None)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        if getattr(self, "mtmd", None):
            from llama_cpp import mtmd_cpp as M

            M.mtmd_free(self.mtmd)
            self.mtmd = None
        free_context(self.ctx, self._batch)
        self.ctx = self._batch = None
        self.model = None
        ref = getattr(self, "_model_ref", None)
        if ref is not None:
            ref.release()
