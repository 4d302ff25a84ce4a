"""The disk cache's file format: a signed header, the entries, the state, checkpoints.

``magic | header length | JSON header | entries (int32) | state | checkpoints | digest``.
The header holds the key, the build, the secret's id and every size; the BLAKE2b digest,
keyed with the per-user secret (:mod:`.disk_key`), covers everything before it. A header
may claim anything, so every size is checked against the file before it is read, and the
digest before any of the record is used. A file that cannot restore comes back as
:class:`Unusable`, saying whether it is another key's (left alone) or broken (removed).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain_llamacpp_local.cache.checkpoints import Checkpoint
from langchain_llamacpp_local.cache.disk_key import OPEN_FLAGS, secret_id
from langchain_llamacpp_local.cache.host_ram import CachedPrompt

_MAGIC = b"LLCPPKV2"  # version 1 had an unkeyed digest: such files are removed
_OLD_MAGICS = (b"LLCPPKV1",)
SUFFIX = ".llkv"
#: The only names this package writes: cache files and their temporary files. Nothing
#: else in the directory is read or removed (it may be a folder the user keeps files in).
FILE_NAME = re.compile(r"[0-9a-f]{40}\.llkv")
TMP_NAME = re.compile(r"\.[0-9a-f]{40}\.llkv\.[0-9]+\.[0-9a-f]{8}\.tmp")
_DIGEST = 32
_LEN = struct.Struct("<I")
#: Longest header accepted (JSON: key, sizes, checkpoint table).
_MAX_HEADER = 1 << 20


@dataclass(frozen=True)
class Unusable:
    """Why a cache file cannot be restored, and what that means for the file."""

    why: str
    #: a valid file of another key, build or secret: not ours to judge or remove
    foreign: bool = False
    #: a FIFO, device or directory named like a cache file: skipped, never removed
    not_regular: bool = False


class _Corrupt(ValueError):
    """A file that is not one this process may restore."""


class _Foreign(_Corrupt):
    """A valid file of another key, build or secret: not ours to judge or remove."""


class _NotRegular(_Corrupt):
    """A FIFO, device or directory named like a cache file: skipped, never removed."""


def _unusable(exc: _Corrupt) -> Unusable:
    return Unusable(
        str(exc), foreign=isinstance(exc, _Foreign), not_regular=isinstance(exc, _NotRegular)
    )


def file_name(key: str, secret: bytes, entries: tuple[int, ...]) -> str:
    """The name of the file of ``entries`` under ``key``: content-addressed, keyed with the
    secret (a name reveals nothing of the prompt)."""
    h = hashlib.blake2b(digest_size=20, key=secret)
    h.update(key.encode())
    h.update(struct.pack(f"<{len(entries)}i", *entries))
    return h.hexdigest() + SUFFIX


def read_header(
    path: Path, key: str, build: str, signer: str, max_size: int
) -> tuple[dict[str, Any], tuple[int, ...], int] | Unusable:
    """The header, entries and size of the cache file ``path`` (its state unread), or why
    it is unusable; ``signer`` is the secret's id (:func:`.disk_key.secret_id`). Raises
    ``OSError`` when it cannot be opened."""
    try:
        fd, st = _open_regular(path, max_size)
        with os.fdopen(fd, "rb") as f:
            header, entries, _ = _read_header(f, key, build, signer, st.st_size)
    except _Corrupt as exc:
        return _unusable(exc)
    return header, entries, st.st_size


def read_record(
    path: Path, key: str, build: str, secret: bytes, max_size: int
) -> CachedPrompt | Unusable:
    """The verified record in the cache file ``path``, touched as just used (the LRU's
    clock), or why it is unusable. Raises ``OSError`` when it cannot be read."""
    try:
        fd, st = _open_regular(path, max_size)
        with os.fdopen(fd, "rb") as f:
            blob = f.read(st.st_size + 1)
            with contextlib.suppress(OSError, NotImplementedError):
                os.utime(f.fileno())  # last use, for the LRU
        return _decode(blob, key, build, secret)
    except _Corrupt as exc:
        return _unusable(exc)


def encode(key: str, build: str, item: CachedPrompt, *, secret: bytes) -> bytes:
    header = json.dumps(
        {
            "key": key,
            "build": build,
            "secret": secret_id(secret),
            "n_entries": len(item.entries),
            "exact": item.exact,
            "data": len(item.data),
            "checkpoints": [[c.n_tokens, c.pos_min, c.pos_max, c.size] for c in item.checkpoints],
            # how many entries were the last request's prompt (the rest its reply): a
            # later turn that leaves the reply is no cache miss (the cache report)
            **({"n_prompt": item.n_prompt} if item.n_prompt is not None else {}),
        }
    ).encode()
    entries = struct.pack(f"<{len(item.entries)}i", *item.entries)
    body = b"".join(
        [_MAGIC, _LEN.pack(len(header)), header, entries, item.data]
        + [c.data for c in item.checkpoints]
    )
    return body + hashlib.blake2b(body, digest_size=_DIGEST, key=secret).digest()


def _int(header: dict[str, Any], name: str, low: int, high: int) -> int:
    value = header.get(name)
    if type(value) is not int or not low <= value <= high:
        raise _Corrupt(f"bad header: {name}={value!r:.40}")
    return value


def _read_header(
    f: Any, key: str, build: str, secret: str, size: int
) -> tuple[dict[str, Any], tuple[int, ...], int]:
    """The header and entries of an open cache file of ``size`` bytes (digest included);
    checks magic, key, build and secret, and that every size fits the file before
    reading it (a header may claim anything)."""
    magic = f.read(len(_MAGIC))
    if magic in _OLD_MAGICS:
        raise _Corrupt("written by an older version (unsigned)")
    if magic != _MAGIC:
        raise _Corrupt("not a cache file")
    raw = f.read(_LEN.size)
    if len(raw) != _LEN.size:
        raise _Corrupt("truncated header")
    (n_header,) = _LEN.unpack(raw)
    offset = len(_MAGIC) + _LEN.size + n_header
    if n_header > _MAX_HEADER or offset + _DIGEST > size:
        raise _Corrupt("bad header size")
    blob = f.read(n_header)
    if len(blob) != n_header:
        raise _Corrupt("truncated header")
    try:
        header = json.loads(blob)
    except (ValueError, RecursionError) as exc:
        raise _Corrupt(f"bad header: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise _Corrupt("bad header")
    if header.get("key") != key:
        raise _Foreign("written for another model or other settings")
    if header.get("build") != build:
        raise _Foreign("written by another llama.cpp build")
    if header.get("secret") != secret:
        raise _Foreign("signed with another key")
    room = size - offset - _DIGEST
    n = _int(header, "n_entries", 0, room // 4)
    _int(header, "exact", 0, n)
    if "n_prompt" in header:  # absent in files of earlier versions
        _int(header, "n_prompt", 0, n)
    room -= 4 * n
    room -= _int(header, "data", 0, room)
    checkpoints = header.get("checkpoints")
    if not isinstance(checkpoints, list):
        raise _Corrupt("bad header: checkpoints")
    for c in checkpoints:
        if not (isinstance(c, list) and len(c) == 4 and all(type(v) is int for v in c)):
            raise _Corrupt("bad header: checkpoint")
        if not (0 <= c[0] <= n and 0 <= c[3] <= room):
            raise _Corrupt("bad header: checkpoint sizes")
        room -= c[3]
    if room != 0:
        raise _Corrupt("sizes do not add up (truncated or corrupt)")
    raw = f.read(4 * n)
    if len(raw) != 4 * n:
        raise _Corrupt("truncated entries")
    return header, struct.unpack(f"<{n}i", raw), offset + 4 * n


def _decode(blob: bytes, key: str, build: str, secret: bytes) -> CachedPrompt:
    """The record in a whole cache file, verified before any of it is used."""
    if len(blob) < len(_MAGIC) + _LEN.size + _DIGEST:
        raise _Corrupt("truncated file")
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    header, entries, offset = _read_header(
        io.BytesIO(body), key, build, secret_id(secret), len(blob)
    )
    expected = hashlib.blake2b(body, digest_size=_DIGEST, key=secret).digest()
    if not hmac.compare_digest(expected, digest):
        raise _Corrupt("checksum mismatch (corrupt, or not written with this user's key)")
    data = body[offset : offset + header["data"]]
    pos = offset + header["data"]
    checkpoints = []
    for n_tokens, pos_min, pos_max, size in header["checkpoints"]:
        checkpoints.append(Checkpoint(n_tokens, pos_min, pos_max, body[pos : pos + size]))
        pos += size
    return CachedPrompt(entries, data, checkpoints, header["exact"], header.get("n_prompt"))


def _open_regular(path: Path, max_size: int) -> tuple[int, os.stat_result]:
    """A descriptor of ``path`` if it is a regular file of at most ``max_size`` bytes:
    opened without following a symlink or blocking on a FIFO, checked with ``fstat``."""
    fd = os.open(path, OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotRegular("not a regular file")
        if st.st_size > max_size:
            raise _Corrupt(f"{st.st_size} bytes, more than the budget of {max_size}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def remove_file(path: Path) -> None:
    """Delete ``path`` if it is a regular file (only the package's own files go)."""
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            path.unlink()
