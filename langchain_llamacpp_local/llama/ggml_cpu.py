"""ggml's CPU back-end as its registry describes it: extra buffer types and features.

llama-cpp-python binds none of this, so the few ggml functions needed are bound here,
in libllama's symbol scope (as :mod:`.rpc` does for the RPC back-end). What this module
answers is asked of ggml itself, never guessed: which extra buffer types the CPU device
registered on this machine, what the build compiled in, and whether ``CPU_REPACK``
accepts a given weight (the check llama.cpp makes when it places a weight).
"""

from __future__ import annotations

import ctypes
import os
import threading
from functools import cache

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.llama.weights import CPU_REPACK, TensorInfo

_DEV_TYPE_CPU = 0  # GGML_BACKEND_DEVICE_TYPE_CPU
_GGML_TYPE_F32 = 0
#: The ggml types this llama.cpp build knows (ggml indexes a table with the type).
_GGML_TYPE_COUNT = int(getattr(C, "GGML_TYPE_COUNT", 43))
#: Largest dimension probed: real weights are far smaller; ggml asserts on overflow.
_MAX_DIM = 1 << 32
#: Rows of the activation llama.cpp pairs with a weight to ask whether a buffer type
#: takes it (``weight_buft_supported`` in llama-model-loader.cpp).
_PROBE_ROWS = 512
#: ``struct ggml_tensor`` starts with ``enum ggml_type type`` then the buffer pointer.
_TENSOR_BUFFER_OFFSET = 8


class _InitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


class _Feature(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


class BuftOverride(ctypes.Structure):
    """``struct llama_model_tensor_buft_override``: a name pattern and a buffer type."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class _Ggml:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, s, z, i64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int64

        def fn(name: str, restype: object, *argtypes: object) -> ctypes._CFuncPtr:
            return ctypes.CFUNCTYPE(restype, *argtypes)((name, lib))  # type: ignore[arg-type]

        self.dev_by_type = fn("ggml_backend_dev_by_type", p, ctypes.c_int)
        self.dev_backend_reg = fn("ggml_backend_dev_backend_reg", p, p)
        self.reg_get_proc_address = fn("ggml_backend_reg_get_proc_address", p, p, s)
        self.dev_supports_op = fn("ggml_backend_dev_supports_op", ctypes.c_bool, p, p)
        self.buft_name = fn("ggml_backend_buft_name", s, p)
        self.buft_alloc_buffer = fn("ggml_backend_buft_alloc_buffer", p, p, z)
        self.buffer_free = fn("ggml_backend_buffer_free", None, p)
        self.init = fn("ggml_init", p, _InitParams)
        self.free = fn("ggml_free", None, p)
        self.new_tensor_2d = fn("ggml_new_tensor_2d", p, p, ctypes.c_int, i64, i64)
        self.mul_mat = fn("ggml_mul_mat", p, p, p, p)
        self.blck_size = fn("ggml_blck_size", i64, ctypes.c_int)
        self.type_name = fn("ggml_type_name", s, ctypes.c_int)


@cache
def _ggml() -> _Ggml:
    return _Ggml(C._lib)


def _cpu_device() -> int:
    dev = _ggml().dev_by_type(_DEV_TYPE_CPU)
    if not dev:
        raise RuntimeError("ggml has no CPU device")
    return int(dev)


@cache
def extra_buffer_types() -> dict[str, int]:
    """The CPU device's extra buffer types on this machine, by name, in llama.cpp's order
    of preference (e.g. ``{"AMX": ..., "CPU_REPACK": ...}``)."""
    g = _ggml()
    dev = _cpu_device()
    addr = g.reg_get_proc_address(g.dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    if not addr:
        return {}
    get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(addr)
    array = get(dev)
    out: dict[str, int] = {}
    i = 0
    while array and array[i]:
        buft = int(array[i])
        out[g.buft_name(buft).decode()] = buft
        i += 1
    return out


@cache
def cpu_features() -> dict[str, str]:
    """What the CPU back-end was built with and runs on (ggml's ``get_features``:
    ``AVX2``, ``AVX512``, ``AMX_INT8``, ``REPACK``...)."""
    g = _ggml()
    addr = g.reg_get_proc_address(g.dev_backend_reg(_cpu_device()), b"ggml_backend_get_features")
    if not addr:
        return {}
    get = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)(addr)
    features = get(g.dev_backend_reg(_cpu_device()))
    out: dict[str, str] = {}
    i = 0
    while features and features[i].name:
        out[features[i].name.decode()] = (features[i].value or b"").decode()
        i += 1
    return out


_probe_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A parent's thread may have held the lock at a fork."""
    global _probe_lock
    _probe_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@cache
def _accepts(buft_name: str, ggml_type: int, ne0: int, ne1: int) -> bool:
    g = _ggml()
    buft = extra_buffer_types().get(buft_name)
    if buft is None:
        return False
    # A context of tensor headers only (no data), as llama.cpp builds to ask a device.
    ctx = g.init(_InitParams(mem_size=16 * 1024, mem_buffer=None, no_alloc=True))
    if not ctx:
        raise MemoryError("ggml_init failed")
    buffer = None
    try:
        weight = g.new_tensor_2d(ctx, ggml_type, ne0, ne1)
        activation = g.new_tensor_2d(ctx, _GGML_TYPE_F32, ne0, _PROBE_ROWS)
        op = g.mul_mat(ctx, weight, activation)
        buffer = g.buft_alloc_buffer(buft, 0)  # an empty buffer: only its type is read
        if not buffer:
            return False
        slot = ctypes.c_void_p.from_address(weight + _TENSOR_BUFFER_OFFSET)
        slot.value = buffer
        try:
            return bool(g.dev_supports_op(_cpu_device(), op))
        finally:
            slot.value = None
    finally:
        if buffer:
            g.buffer_free(buffer)
        g.free(ctx)


def _valid_shape(ggml_type: int, ne0: int, ne1: int) -> bool:
    """Whether ggml can describe the tensor at all (it aborts the process otherwise):
    a known type whose block divides the row, and sizes in range."""
    if not 0 <= ggml_type < _GGML_TYPE_COUNT or not (0 < ne0 < _MAX_DIM and 0 < ne1 < _MAX_DIM):
        return False
    g = _ggml()
    if not g.type_name(ggml_type):
        return False
    block = int(g.blck_size(ggml_type))
    return block > 0 and ne0 % block == 0


def repack_accepts(tensor: TensorInfo) -> bool:
    """Whether ggml's ``CPU_REPACK`` buffer type takes ``tensor`` as a matmul weight."""
    if len(tensor.shape) != 2 or not _valid_shape(tensor.ggml_type, *tensor.shape):
        return False
    with _probe_lock:
        return _accepts(CPU_REPACK, tensor.ggml_type, tensor.shape[0], tensor.shape[1])
