"""Read a few GGUF header values without loading the model.

Constructing a chat model must stay cheap (no weights loaded), yet its
``profile`` wants the trained context length and the model's name. Those keys
sit near the start of the header, before the large tokenizer arrays, so this
reader stops as soon as it has what was asked for.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from langchain_llamacpp_local.errors import GGUFHeaderError

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _check_room(f: BinaryIO, n: int, what: str) -> None:
    """Refuse a length that runs past the end of the file before reading or seeking it
    (a crafted 2**63 would otherwise be a MemoryError or OverflowError)."""
    pos = f.tell()
    size = os.fstat(f.fileno()).st_size
    if n > size - pos:
        raise GGUFHeaderError(
            f"truncated or corrupt GGUF header: {what} of {n} bytes at offset {pos} runs past "
            f"the end of the {size}-byte file"
        )


def _read_str(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    _check_room(f, n, "a string")
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated GGUF header")
    return data.decode("utf-8", errors="replace")


_MAX_KEPT_ARRAY = 65536


def _read_value(f: BinaryIO, vtype: int, keep: bool) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        if not keep:
            n = _read(f, "<Q")
            _check_room(f, n, "a string")
            f.seek(n, 1)
            return None
        return _read_str(f)
    if vtype == _ARRAY:
        itype = _read(f, "<I")
        n = _read(f, "<Q")
        if itype in _SCALARS and (not keep or n > _MAX_KEPT_ARRAY):
            _check_room(f, n * struct.calcsize(_SCALARS[itype]), f"an array of {n} values")
            f.seek(n * struct.calcsize(_SCALARS[itype]), 1)
            return None
        _check_room(f, n, f"an array of {n} values")  # every value takes a byte at least
        if itype == _STRING and not keep:
            _skip_strings(f, n)
            return None
        items = [_read_value(f, itype, keep) for _ in range(n)]
        return items if keep else None
    raise ValueError(f"unknown GGUF value type {vtype}")


_U64 = struct.Struct("<Q")


def _skip_strings(f: BinaryIO, n: int) -> None:
    """Skip an array of ``n`` strings (a 262k-token vocabulary) via mmap: fast enough
    to read every key of a header on each load."""
    pos = f.tell()
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        size = len(mm)
        unpack = _U64.unpack_from
        for _ in range(n):
            if pos + 8 > size:
                raise ValueError("truncated GGUF header")
            pos += 8 + unpack(mm, pos)[0]
    if pos > size:
        raise ValueError("truncated GGUF header")
    f.seek(pos)


def open_regular_file(path: str | Path) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file.

    Opened non-blocking and checked with ``fstat`` (no race with a swapped path): a
    FIFO or a character device as ``model_path`` would otherwise block forever.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ValueError(f"{path} is {kind} (a FIFO, device or socket cannot be a model)")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_gguf_metadata(
    path: str | Path, keys: Iterable[str] | None = None, *, arrays: bool = False
) -> dict[str, Any]:
    """Return the requested metadata keys (all scalar keys if ``keys`` is None; with
    ``arrays``, matching arrays of up to 65536 scalars too).

    Suffix patterns are allowed: a key starting with ``*.`` matches any prefix, so
    ``"*.context_length"`` finds ``llama.context_length`` or ``gemma3.context_length``.
    Raises ``ValueError`` for a file that is not GGUF.
    """
    wanted = set(keys) if keys is not None else None
    with open_regular_file(path) as f:
        try:
            return _read_metadata(f, path, wanted, arrays)
        except GGUFHeaderError as exc:
            raise GGUFHeaderError(f"{path}: {exc}") from None
        except (OverflowError, MemoryError, struct.error) as exc:
            raise GGUFHeaderError(
                f"{path}: corrupt GGUF header ({type(exc).__name__}: {exc})"
            ) from None


def _read_metadata(
    f: BinaryIO, path: str | Path, wanted: set[str] | None, arrays: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if f.read(4) != b"GGUF":
        raise ValueError(f"not a GGUF file: {path}")
    version = _read(f, "<I")
    if version < 2:
        raise ValueError(f"unsupported GGUF version {version}: {path}")
    _read(f, "<Q")  # tensor count
    n_kv = _read(f, "<Q")
    for _ in range(n_kv):
        key = _read_str(f)
        vtype = _read(f, "<I")
        match = (
            wanted is None
            or key in wanted
            or any(w.startswith("*.") and key.endswith(w[1:]) for w in wanted)
        )
        value = _read_value(f, vtype, keep=match and (arrays or vtype != _ARRAY))
        if match and value is not None:
            out[key] = value
            if wanted is not None and _satisfied(wanted, out):
                break
    return out


def projector_inputs(path: str | Path) -> tuple[bool, bool] | None:
    """What a projector reads, ``(images, audio)``, from the header keys mtmd reads
    (``clip.has_vision_encoder``, ``clip.has_audio_encoder``), without loading it; None
    when the file cannot be read or names neither."""
    keys = ("clip.has_vision_encoder", "clip.has_audio_encoder")
    try:
        meta = read_gguf_metadata(Path(path).expanduser(), keys)
    except (OSError, ValueError):
        return None
    if not any(k in meta for k in keys):
        return None
    return bool(meta.get(keys[0], False)), bool(meta.get(keys[1], False))


def _satisfied(wanted: set[str], found: dict[str, Any]) -> bool:
    for w in wanted:
        if w.startswith("*."):
            if not any(k.endswith(w[1:]) for k in found):
                return False
        elif w not in found:
            return False
    return True


#: llama.cpp's LLAMA_MAX_LAYERS / LLAMA_MAX_EXPERTS (src/llama-hparams.h).
MAX_LAYERS = 512
MAX_EXPERTS = 1024
_ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


def check_hparams(meta: dict[str, Any]) -> None:
    """Check the header values llama.cpp's ``load_hparams`` asserts on (``GGML_ASSERT``
    kills the process) and raise ``ValueError`` naming the key instead.

    ``meta`` holds the file's scalar keys and small arrays (see :func:`read_gguf_metadata`).
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch == "clip":
        return  # no architecture: llama.cpp refuses it cleanly; clip has no hparams

    def num(key: str, default: int | None = None) -> int | None:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            return None
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{arch}.{key} must be a number, got {v!r}")
            if v < 0:
                raise ValueError(f"{arch}.{key} is negative ({v})")
        return int(max(values, default=0))

    n_layer = num("block_count")
    if n_layer is not None and not 0 < n_layer <= MAX_LAYERS:
        raise ValueError(f"{arch}.block_count={n_layer} is outside 1..{MAX_LAYERS}")
    for key in ("nextn_predict_layers", "posnet.block_count", "convnext.block_count"):
        n = num(key)
        if n is not None and n_layer is not None and n > n_layer:
            raise ValueError(f"{arch}.{key}={n} exceeds {arch}.block_count={n_layer}")
    n_expert = num("expert_count", 0) or 0
    used = num("expert_used_count", 0) or 0
    groups = num("expert_group_count", 0) or 0
    group_used = num("expert_group_used_count", 0) or 0
    if n_expert > MAX_EXPERTS:
        raise ValueError(f"{arch}.expert_count={n_expert} is over {MAX_EXPERTS}")
    if used > n_expert:
        raise ValueError(f"{arch}.expert_used_count={used} exceeds expert_count={n_expert}")
    if n_expert > 0:
        if used == 0:
            raise ValueError(f"{arch}.expert_used_count must be > 0 with {n_expert} experts")
        if groups >= n_expert:
            raise ValueError(f"{arch}.expert_group_count={groups} must be < expert_count")
        if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
            raise ValueError(
                f"{arch}.expert_group_count={groups} / expert_group_used_count={group_used} "
                f"do not fit expert_count={n_expert}"
            )
    elif groups:
        raise ValueError(f"{arch}.expert_group_count={groups} without experts")
    rope = meta.get(f"{arch}.rope.scaling.type")
    if rope is not None and rope not in _ROPE_SCALING_TYPES:
        raise ValueError(
            f"{arch}.rope.scaling.type={rope!r} is not one of {list(_ROPE_SCALING_TYPES)}"
        )


def read_hparams(path: str | Path) -> dict[str, Any]:
    """The header values :func:`check_hparams` looks at."""
    return read_gguf_metadata(path, _HPARAM_KEYS, arrays=True)


_HPARAM_KEYS = (
    "general.architecture",
    "*.block_count",
    "*.nextn_predict_layers",
    "*.expert_count",
    "*.expert_used_count",
    "*.expert_group_count",
    "*.expert_group_used_count",
    "*.rope.scaling.type",
)


#: Bounds on the tensor table of a GGUF (llama.cpp's own loader has similar ones).
MAX_TENSORS = 1 << 20
MAX_DIMS = 4


def read_tensor_infos(path: str | Path) -> list[tuple[str, int, tuple[int, ...]]]:
    """Every tensor's ``(name, ggml type, shape)`` from the header, in file order.

    The metadata is skipped (arrays through mmap); the data is never read.
    Raises ``ValueError`` for a header that is not a well-formed GGUF.
    """
    with open_regular_file(path) as f:
        return [(name, t, shape) for name, t, shape, _off in _tensor_table(f, path)[0]]


def _tensor_table(
    f: BinaryIO, path: str | Path
) -> tuple[list[tuple[str, int, tuple[int, ...], int]], int]:
    """The tensor table (name, type, shape, offset in the data section) and where the
    data section starts (``general.alignment``, default 32, as llama.cpp's loader)."""
    if f.read(4) != b"GGUF":
        raise ValueError(f"not a GGUF file: {path}")
    version = _read(f, "<I")
    if version < 2:
        raise ValueError(f"unsupported GGUF version {version}: {path}")
    n_tensors = _read(f, "<Q")
    n_kv = _read(f, "<Q")
    if n_tensors > MAX_TENSORS:
        raise ValueError(f"{n_tensors} tensors in {path} (at most {MAX_TENSORS})")
    alignment = 32
    for _ in range(n_kv):
        key = _read_str(f)
        value = _read_value(f, _read(f, "<I"), keep=key == "general.alignment")
        if key == "general.alignment":
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise ValueError(f"general.alignment {value!r} in {path} is not a power of 2")
            alignment = value
    out: list[tuple[str, int, tuple[int, ...], int]] = []
    for _ in range(n_tensors):
        name = _read_str(f)
        n_dims = _read(f, "<I")
        if not 0 < n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions in {path}")
        shape = tuple(_read(f, "<Q") for _ in range(n_dims))
        ggml_type = _read(f, "<I")
        offset = _read(f, "<Q")
        out.append((name, ggml_type, shape, offset))
    start = -(-f.tell() // alignment) * alignment
    return out, start


#: Bytes per block and values per block of the ggml types whose data
#: :func:`read_tensor_data` returns (F32, F16, Q8_0, BF16).
DATA_TYPES = {0: (4, 1), 1: (2, 1), 8: (34, 32), 30: (2, 1)}


def read_tensor_data(path: str | Path) -> Iterator[tuple[str, int, np.ndarray]]:
    """Each F32/F16/Q8_0/BF16 tensor's raw bytes (a read-only memory map, never a copy),
    as ``(name, ggml type, uint8 array)``; other types are skipped. A tensor whose data
    would run past the end of the file raises ``ValueError``."""
    with open_regular_file(path) as f:
        table, start = _tensor_table(f, path)
        size = os.fstat(f.fileno()).st_size
        if not table or start >= size:
            if table:
                raise ValueError(f"truncated GGUF: {path} has no tensor data")
            return
        data = np.memmap(f, dtype=np.uint8, mode="r")
        try:
            for name, ggml_type, shape, offset in table:
                if ggml_type not in DATA_TYPES:
                    continue
                block_bytes, block_values = DATA_TYPES[ggml_type]
                n_values = math.prod(shape)
                n_bytes = n_values // block_values * block_bytes
                begin = start + offset
                if n_values % block_values or begin + n_bytes > size:
                    raise ValueError(
                        f"truncated or corrupt GGUF: tensor {name!r} of {n_bytes} bytes at "
                        f"offset {begin} runs past the end of the {size}-byte file {path}"
                    )
                yield name, ggml_type, data[begin : begin + n_bytes]
        finally:
            del data
