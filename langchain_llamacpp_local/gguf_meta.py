"""Read a few GGUF header values without loading the model.

Constructing a chat model must stay cheap (no weights loaded), yet its
``profile`` wants the trained context length and the model's name. Those keys
sit near the start of the header, before the large tokenizer arrays, so this
reader stops as soon as it has what was asked for.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

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


def _read_str(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated GGUF header")
    return data.decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int, keep: bool) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _read_str(f)
    if vtype == _ARRAY:
        itype = _read(f, "<I")
        n = _read(f, "<Q")
        if itype in _SCALARS and not keep:
            f.seek(n * struct.calcsize(_SCALARS[itype]), 1)
            return None
        items = [_read_value(f, itype, keep) for _ in range(n)]
        return items if keep else None
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf_metadata(path: str | Path, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """Return the requested metadata keys (all scalar keys if ``keys`` is None).

    Suffix patterns are allowed: a key starting with ``*.`` matches any prefix, so
    ``"*.context_length"`` finds ``llama.context_length`` or ``gemma3.context_length``.
    Raises ``ValueError`` for a file that is not GGUF.
    """
    wanted = set(keys) if keys is not None else None
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
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
            match = wanted is None or key in wanted or any(
                w.startswith("*.") and key.endswith(w[1:]) for w in wanted
            )
            value = _read_value(f, vtype, keep=match and vtype != _ARRAY)
            if match and value is not None:
                out[key] = value
                if wanted is not None and _satisfied(wanted, out):
                    break
    return out


def _satisfied(wanted: set[str], found: dict[str, Any]) -> bool:
    for w in wanted:
        if w.startswith("*."):
            if not any(k.endswith(w[1:]) for k in found):
                return False
        elif w not in found:
            return False
    return True
