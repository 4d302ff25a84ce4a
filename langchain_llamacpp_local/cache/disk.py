"""A prompt cache on disk: conversations' states that outlive the process.

The host-RAM cache (:mod:`.prompt_cache`) dies with the process, so every new process
(a command-line agent run, a notebook restart, a worker scaled from zero) would read its
system prompt and tools again from the first token. This tier keeps the same records
(:class:`~.prompt_cache.CachedPrompt`: the entries, the sequence state, its checkpoints)
in files under ``prompt_cache_dir``:

* **Content-addressed.** A file's name hashes the :func:`cache_key` (the model file's
  identity, every setting that changes what the KV cache holds, the llama.cpp build) and
  the token prefix. Only files with this process's key are listed, so a foreign model's
  or another build's state never reaches ``llama_state_seq_set_data``.
* **Safe by construction.** Files are written to a temporary name and renamed (a crash
  mid-write never leaves a file that restores; processes sharing the directory each
  write whole files); a header holds the key and the sizes, a BLAKE2b digest covers
  everything. A mismatched, truncated or corrupt file is skipped with one log line.
* **LRU under a byte budget.** Restoring a file touches it; the oldest go first, and a
  file whose prefix a newer file of the same conversation extends is dropped.
* **Off the reply's path.** When a reply is done the worker sends it, then copies the
  sequence state once; a writer thread encodes, hashes and writes it. Pending writes are
  flushed at exit; a forked child starts its own writer.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain_llamacpp_local.cache.checkpoints import Checkpoint
from langchain_llamacpp_local.cache.host_ram import CachedPrompt
from langchain_llamacpp_local.cache.slots import common_prefix_len

logger = logging.getLogger(__name__)

#: Environment variable naming the directory when ``prompt_cache_dir`` is not set.
ENV_DIR = "LLAMACPP_PROMPT_CACHE_DIR"
#: Default byte budget of the directory.
DEFAULT_MAX_BYTES = 4 * 1024**3

_MAGIC = b"LLCPPKV1"
_SUFFIX = ".llkv"
_TMP_SUFFIX = ".tmp"
_DIGEST = 32
_LEN = struct.Struct("<I")
#: Temporary files older than this are a crashed writer's: removed during eviction.
_STALE_TMP_S = 3600.0
#: Longest header accepted (JSON: key, sizes, checkpoint table).
_MAX_HEADER = 1 << 20
#: Seconds the exit hook waits for pending writes.
_EXIT_FLUSH_S = 30.0


def file_identity(path: str) -> dict[str, Any]:
    """What identifies a model file's contents: size, mtime and a hash of its start
    (the header and the first tensors: a re-quantized or edited file differs there)."""
    st = os.stat(path)
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head": h.hexdigest()}


def cache_key(parts: dict[str, Any]) -> str:
    """The hex key of a (model, settings, build) combination; ``parts`` must be JSON."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


@dataclass(frozen=True)
class DiskEntry:
    """One cache file as the index knows it (its entries, not its state)."""

    path: Path
    entries: tuple[int, ...]
    exact: int
    size: int


class _Corrupt(ValueError):
    """A file that is not one this process may restore."""


def _encode(key: str, build: str, item: CachedPrompt) -> bytes:
    header = json.dumps(
        {
            "key": key,
            "build": build,
            "n_entries": len(item.entries),
            "exact": item.exact,
            "data": len(item.data),
            "checkpoints": [[c.n_tokens, c.pos_min, c.pos_max, c.size] for c in item.checkpoints],
        }
    ).encode()
    entries = struct.pack(f"<{len(item.entries)}i", *item.entries)
    body = b"".join(
        [_MAGIC, _LEN.pack(len(header)), header, entries, item.data]
        + [c.data for c in item.checkpoints]
    )
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def _read_header(f: Any, key: str, build: str) -> tuple[dict[str, Any], tuple[int, ...], int]:
    """The header and entries of an open cache file; checks magic, key and build."""
    if f.read(len(_MAGIC)) != _MAGIC:
        raise _Corrupt("not a cache file")
    raw = f.read(_LEN.size)
    if len(raw) != _LEN.size:
        raise _Corrupt("truncated header")
    (n_header,) = _LEN.unpack(raw)
    if n_header > _MAX_HEADER:
        raise _Corrupt("header too large")
    blob = f.read(n_header)
    if len(blob) != n_header:
        raise _Corrupt("truncated header")
    try:
        header = json.loads(blob)
        n = int(header["n_entries"])
        if header["key"] != key:
            raise _Corrupt("written for another model or other settings")
        if header["build"] != build:
            raise _Corrupt("written by another llama.cpp build")
        if n < 0 or int(header["data"]) < 0:
            raise _Corrupt("bad sizes")
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, _Corrupt):
            raise
        raise _Corrupt(f"bad header: {exc}") from None
    raw = f.read(4 * n)
    if len(raw) != 4 * n:
        raise _Corrupt("truncated entries")
    offset = len(_MAGIC) + _LEN.size + n_header + 4 * n
    return header, struct.unpack(f"<{n}i", raw), offset


def _decode(blob: bytes, key: str, build: str) -> CachedPrompt:
    """The record in a whole cache file, verified before any of it is used."""
    if len(blob) < len(_MAGIC) + _LEN.size + _DIGEST:
        raise _Corrupt("truncated file")
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise _Corrupt("checksum mismatch (truncated or corrupt)")
    header, entries, offset = _read_header(io.BytesIO(body), key, build)
    sizes = [int(header["data"])] + [int(c[3]) for c in header["checkpoints"]]
    if offset + sum(sizes) != len(body):
        raise _Corrupt("sizes do not add up")
    data = body[offset : offset + sizes[0]]
    pos = offset + sizes[0]
    checkpoints = []
    for n_tokens, pos_min, pos_max, size in header["checkpoints"]:
        checkpoints.append(
            Checkpoint(int(n_tokens), int(pos_min), int(pos_max), body[pos : pos + int(size)])
        )
        pos += int(size)
    return CachedPrompt(entries, data, checkpoints, int(header["exact"]))


class PendingSave:
    """A record's place in the writer's queue, taken before the reply is sent and filled
    after (:meth:`fill`), so that files keep their order and the exit flush waits for it."""

    def __init__(self) -> None:
        self.item: CachedPrompt | None = None
        self._ready = threading.Event()

    def fill(self, item: CachedPrompt | None) -> None:
        """Hand over the record (None: nothing to write); call exactly once."""
        self.item = item
        self._ready.set()

    def wait(self) -> CachedPrompt | None:
        self._ready.wait()
        return self.item


class _Writer:
    """One background thread encoding and writing files in order."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="llamacpp-disk-cache", daemon=True)
        self._thread.start()

    def put(self, cache: DiskPromptCache, pending: PendingSave) -> None:
        self._queue.put(("write", cache, pending))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every file queued before this call is written (True) or ``timeout``."""
        done = threading.Event()
        self._queue.put(("mark", done))
        return done.wait(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item[0] == "mark":
                item[1].set()
                continue
            _, cache, pending = item
            record = pending.wait()
            if record is None:
                continue
            try:
                cache._write_record(record)
            except Exception:  # a full disk or a removed directory must not kill the thread
                logger.warning("prompt cache: could not write a record", exc_info=True)


_writer_lock = threading.Lock()
_writer: _Writer | None = None
#: The cache objects the writer thread has written for, to renew their locks in a forked
#: child (the thread may have held one at the fork).
_caches: weakref.WeakSet[DiskPromptCache] = weakref.WeakSet()


def _get_writer() -> _Writer:
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = _Writer()
            _flush_at_child_exit()
        return _writer


def flush(timeout: float | None = None) -> bool:
    """Wait for the files queued so far to be written (tests, short-lived programs)."""
    writer = _writer
    return writer.flush(timeout) if writer is not None else True


def _flush_at_exit() -> None:
    flush(_EXIT_FLUSH_S)


def _flush_at_child_exit() -> None:
    """A ``multiprocessing`` child ends with ``os._exit`` (no atexit hooks) but runs its
    exit finalizers first: flush there too."""
    import multiprocessing.util  # only where a writer starts

    multiprocessing.util.Finalize(None, _flush_at_exit, exitpriority=0)


def _after_fork_in_child() -> None:
    """A forked child inherits the parent's writer but not its thread: what it queued
    would never be written and its exit flush would wait in vain. It starts afresh (the
    parent writes what the parent queued)."""
    global _writer, _writer_lock
    _writer_lock = threading.Lock()  # the parent's writer thread may have held a lock
    _writer = None
    for cache in list(_caches):
        cache._lock = threading.Lock()


atexit.register(_flush_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)


class DiskPromptCache:
    """The cache files of one (model, settings, build) key in a directory."""

    def __init__(self, directory: str | os.PathLike[str], key: str, build: str, max_bytes: int):
        self.dir = Path(directory).expanduser()
        self.key = key
        self.build = build
        self.max_bytes = max_bytes
        self._index: dict[Path, DiskEntry] = {}
        self._scanned_at = -1.0
        self._lock = threading.Lock()
        self._last_saved: dict[int, tuple[int, int]] = {}  # seq_id -> (n entries, hash)
        self.dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ lookup

    def best(self, prompt: Sequence[Hashable]) -> tuple[DiskEntry | None, int]:
        """The file sharing the longest prefix with ``prompt``, and that length."""
        best: DiskEntry | None = None
        best_n = 0
        for entry in self._index_entries():
            n = common_prefix_len(entry.entries, prompt)
            if n > best_n or (n == best_n and best is not None and entry.size < best.size):
                best, best_n = entry, n
        return best, best_n

    def _index_entries(self) -> list[DiskEntry]:
        """The files this process may restore (scanning the directory first)."""
        self._scan()
        with self._lock:
            return list(self._index.values())

    def discard(self, entry: DiskEntry) -> None:
        """Delete a file whose state proved unusable once restored (the restore logged
        why)."""
        logger.debug("prompt cache: deleting %s", entry.path.name)
        self._forget(entry.path)
        with contextlib.suppress(OSError):
            entry.path.unlink()

    def load(self, entry: DiskEntry) -> CachedPrompt | None:
        """The verified record of ``entry``, or None (one log line) if it cannot be used."""
        try:
            blob = entry.path.read_bytes()
            item = _decode(blob, self.key, self.build)
        except FileNotFoundError:
            self._forget(entry.path)  # evicted by another process meanwhile
            return None
        except (_Corrupt, OSError, struct.error) as exc:
            logger.warning("prompt cache: skipping %s: %s", entry.path.name, exc)
            self._forget(entry.path)
            with contextlib.suppress(OSError):
                entry.path.unlink()  # it can never restore: make room for good ones
            return None
        with contextlib.suppress(OSError):
            os.utime(entry.path)  # last use, for the LRU
        return item

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._index.pop(path, None)

    def _scan(self) -> None:
        """Read the headers of files written since the last scan (other processes')."""
        try:
            mtime = self.dir.stat().st_mtime
        except OSError:
            return
        if mtime == self._scanned_at:
            return
        self._scanned_at = mtime
        seen: set[Path] = set()
        for path in self.dir.glob(f"*{_SUFFIX}"):
            seen.add(path)
            if path in self._index:
                continue
            try:
                with open(path, "rb") as f:
                    header, entries, _ = _read_header(f, self.key, self.build)
                size = path.stat().st_size
            except _Corrupt as exc:
                if "another" not in str(exc):  # other keys' files are not ours to judge
                    logger.warning("prompt cache: skipping %s: %s", path.name, exc)
                continue
            except (OSError, struct.error):
                continue
            with self._lock:
                self._index[path] = DiskEntry(path, entries, int(header["exact"]), size)
        with self._lock:
            for path in list(self._index):
                if path not in seen:
                    del self._index[path]

    # ------------------------------------------------------------------ saving

    def wants(self, seq_id: int, entries: Sequence[Hashable]) -> bool:
        """Whether the state of ``entries`` is new (not the same as last saved)."""
        if not entries or not all(type(e) is int for e in entries):
            return False  # image chunks are not persisted
        mark = (len(entries), hash(tuple(entries)))
        if self._last_saved.get(seq_id) == mark:
            return False
        self._last_saved[seq_id] = mark
        return True

    def save(self, item: CachedPrompt) -> None:
        """Queue ``item`` for writing (the file appears when it is complete)."""
        pending = self.reserve()
        if pending is not None:
            pending.fill(item)

    def reserve(self) -> PendingSave | None:
        """A place in the writer's queue for a record handed over later (None: off)."""
        if self.max_bytes <= 0:
            return None
        pending = PendingSave()
        _caches.add(self)  # the writer thread takes its lock from now on
        _get_writer().put(self, pending)
        return pending

    def _write_record(self, item: CachedPrompt) -> None:
        """Encode and write ``item`` (the writer thread: hashing a whole KV state is slow)."""
        blob = _encode(self.key, self.build, item)
        if len(blob) > self.max_bytes:
            return
        entries = tuple(int(e) for e in item.entries)  # type: ignore[call-overload]
        self._write(self._name(entries), blob, entries, item.exact)

    def _name(self, entries: Sequence[int]) -> str:
        h = hashlib.blake2b(digest_size=20)
        h.update(self.key.encode())
        h.update(struct.pack(f"<{len(entries)}i", *entries))
        return h.hexdigest() + _SUFFIX

    def _write(self, name: str, blob: bytes, entries: tuple[int, ...], exact: int) -> None:
        """Write atomically (temporary file, fsync, rename), then enforce the budget."""
        final = self.dir / name
        tmp = self.dir / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        with self._lock:
            self._index[final] = DiskEntry(final, entries, exact, len(blob))
        logger.debug(
            "prompt cache: wrote %s (%d entries, %.1f MiB)", name, len(entries), len(blob) / 2**20
        )
        self._drop_prefixes_of(final, entries)
        self.evict()

    def _drop_prefixes_of(self, newest: Path, entries: tuple[int, ...]) -> None:
        with self._lock:
            covered = [
                e.path
                for e in self._index.values()
                if e.path != newest
                and len(e.entries) < len(entries)
                and entries[: len(e.entries)] == e.entries
            ]
            for path in covered:
                del self._index[path]
        for path in covered:
            with contextlib.suppress(OSError):
                path.unlink()

    def evict(self) -> None:
        """Delete the least recently used files until the directory fits the budget."""
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for path in self.dir.iterdir():
            try:
                st = path.stat()
            except OSError:
                continue
            if path.name.endswith(_TMP_SUFFIX):
                if now - st.st_mtime > _STALE_TMP_S:
                    with contextlib.suppress(OSError):
                        path.unlink()
                continue
            if path.suffix == _SUFFIX:
                files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            with contextlib.suppress(OSError):
                path.unlink()
                logger.debug("prompt cache: evicted %s", path.name)
            total -= size
            self._forget(path)
