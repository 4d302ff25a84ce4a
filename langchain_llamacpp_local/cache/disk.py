"""A prompt cache on disk: conversations' states that outlive the process.

The host-RAM cache (:mod:`.host_ram`) dies with the process, so every new process
(a command-line agent run, a notebook restart, a worker scaled from zero) would read its
system prompt and tools again from the first token. This tier keeps the same records
(:class:`~.host_ram.CachedPrompt`: the entries, the sequence state, its checkpoints)
in files under ``prompt_cache_dir``:

* **Content-addressed.** A file's name hashes the :func:`cache_key` (the model file's
  identity, every setting that changes what the KV cache holds, the llama.cpp build) and
  the token prefix. Only files with this process's key are listed, so a foreign model's
  or another build's state never reaches ``llama_state_seq_set_data``.
* **Safe by construction.** Files are written to a temporary name and renamed (a crash
  mid-write never leaves a file that restores; processes sharing the directory each
  write whole files); a header holds the key and the sizes, a BLAKE2b digest *keyed with
  a per-user secret* kept outside the directory covers everything, so a file nobody
  holding the secret wrote never restores. A mismatched, truncated or corrupt file is
  skipped with one log line; only regular files are opened, never blocking.
* **Private.** The directory must be the user's own and not writable by others (else
  anyone who can write it could plant files); it is created 0700, files 0600.
* **LRU under a byte budget.** Restoring a file touches it; the oldest go first, and a
  file whose prefix a newer file of the same conversation extends is dropped.
* **Off the reply's path.** When a reply is done the worker sends it, then copies the
  sequence state once; a writer thread encodes, hashes and writes it. Pending writes are
  flushed at exit; a forked child starts its own writer.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import hmac
import io
import json
import logging
import os
import queue
import re
import secrets
import stat
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Hashable, Iterator, Sequence
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

#: Environment variable naming the secret's file (default: under the user's state directory).
ENV_KEY_FILE = "LLAMACPP_PROMPT_CACHE_KEY_FILE"

_MAGIC = b"LLCPPKV2"  # version 1 had an unkeyed digest: such files are removed
_OLD_MAGICS = (b"LLCPPKV1",)
_SUFFIX = ".llkv"
_TMP_SUFFIX = ".tmp"
#: The only names this package writes: cache files and their temporary files. Nothing
#: else in the directory is read or removed (it may be a folder the user keeps files in).
_FILE_NAME = re.compile(r"[0-9a-f]{40}\.llkv")
_TMP_NAME = re.compile(r"\.[0-9a-f]{40}\.llkv\.[0-9]+\.[0-9a-f]{8}\.tmp")
_DIGEST = 32
_SECRET_BYTES = 32
_LEN = struct.Struct("<I")
#: Regular files only, never blocking (a FIFO named like a cache file must not hang the
#: worker), never through a symlink.
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
_CREATE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
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


class UnsafeCacheError(PermissionError):
    """The cache directory or the secret's file could be changed by someone else."""


def _uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def _make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parent 0700 whatever the umask (``os.makedirs``
    gives intermediate folders the umask's mode: 0777 under ``umask 0``)."""
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)


def _check_private_dir(path: Path, what: str) -> None:
    """Refuse a directory someone else could write into: its owner or a group/other with
    write access could plant or swap files. (pip disables its cache on a directory the
    user does not own; ssh refuses key files and folders others can write.)"""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{what} {str(path)!r} is not a directory")
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        raise UnsafeCacheError(
            f"{what} {str(path)!r} is owned by uid {st.st_uid}, not by this user (uid {uid}):"
            " its owner could plant files that change answers; use a directory of your own"
        )
    if uid is not None and st.st_mode & 0o022:
        who = " and ".join(
            name for bit, name in ((0o020, "its group"), (0o002, "all users")) if st.st_mode & bit
        )
        raise UnsafeCacheError(
            f"{what} {str(path)!r} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o}):"
            f" they could plant or replace files that change answers; run"
            f" `chmod go-w {str(path)!r}` (or `chmod 700`) or use another directory"
        )


def key_file_path() -> Path:
    """Where the per-user secret lives: ``$LLAMACPP_PROMPT_CACHE_KEY_FILE``, else
    ``$XDG_STATE_HOME`` (or ``~/.local/state``)``/langchain-llamacpp-local/prompt-cache.key``.
    Outside the cache directory, so that whoever can read or fill the cache (a copied or
    synced folder, a backup) cannot sign files."""
    explicit = os.environ.get(ENV_KEY_FILE)
    state = os.environ.get("XDG_STATE_HOME", "")
    raw = explicit or (state if os.path.isabs(state) else "~/.local/state")
    try:
        base = Path(raw).expanduser().absolute()
    except RuntimeError as exc:  # "~user" of no such user, or no home directory
        where = f"{ENV_KEY_FILE}={explicit!r}" if explicit else "the prompt cache key"
        raise FileNotFoundError(f"{where}: {exc}") from None
    return base if explicit else base / "langchain-llamacpp-local" / "prompt-cache.key"


def load_secret(path: Path) -> bytes:
    """The secret in ``path``, created (0600, atomically) on first use."""
    return _load_secret(str(path))


@functools.lru_cache(maxsize=8)
def _load_secret(name: str) -> bytes:
    path = Path(name)
    _make_private_dirs(path.parent)
    _check_private_dir(path.parent, "the prompt cache key's directory")
    try:
        fd = os.open(path, _OPEN_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        _create_secret(path)
        fd = os.open(path, _OPEN_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    if stat.S_ISDIR(os.fstat(fd).st_mode):  # (reading it would name the descriptor)
        os.close(fd)
        raise UnsafeCacheError(
            f"the prompt cache key {name!r} is a directory: {ENV_KEY_FILE} names the key"
            " file itself"
        )
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        uid = _uid()
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCacheError(f"the prompt cache key {name!r} is not a regular file")
        if uid is not None and (st.st_uid != uid or st.st_mode & 0o077):
            raise UnsafeCacheError(
                f"the prompt cache key {name!r} (uid {st.st_uid}, mode"
                f" {stat.S_IMODE(st.st_mode):o}) must belong to this user (uid {uid}) and be"
                f" readable by no one else: run `chmod 600 {name!r}`, or delete it to make a"
                " new one (files signed with it are then ignored)"
            )
        secret = f.read(_SECRET_BYTES + 1)
    if len(secret) != _SECRET_BYTES:
        raise UnsafeCacheError(
            f"the prompt cache key {name!r} holds {len(secret)} bytes, not {_SECRET_BYTES}:"
            " delete it to make a new one (files signed with it are then ignored)"
        )
    return secret


def _create_secret(path: Path) -> None:
    """Write a new secret under a temporary name and link it into place: a concurrent
    process either wins (its secret is used by both) or loses; nobody reads half a key."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}")
    fd = os.open(tmp, _CREATE_FLAGS, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(_SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
        except OSError:  # a file system without hard links
            if not os.path.lexists(path):
                os.rename(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _secret_id(secret: bytes) -> str:
    """Names the secret in a file's header (without revealing it): files signed with
    another secret (another user's key file) are someone else's, not corrupt."""
    return hashlib.blake2b(b"prompt cache key id", key=secret, digest_size=8).hexdigest()


@dataclass(frozen=True)
class DiskEntry:
    """One cache file as the index knows it (its entries, not its state)."""

    path: Path
    entries: tuple[int, ...]
    exact: int
    size: int


class _Corrupt(ValueError):
    """A file that is not one this process may restore."""


class _Foreign(_Corrupt):
    """A valid file of another key, build or secret: not ours to judge or remove."""


def _encode(key: str, build: str, item: CachedPrompt, *, secret: bytes) -> bytes:
    header = json.dumps(
        {
            "key": key,
            "build": build,
            "secret": _secret_id(secret),
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
    f: Any, key: str, build: str, secret_id: str, size: int
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
    if header.get("secret") != secret_id:
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
        io.BytesIO(body), key, build, _secret_id(secret), len(blob)
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
    fd = os.open(path, _OPEN_FLAGS)
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


class _NotRegular(_Corrupt):
    """A FIFO, device or directory named like a cache file: skipped, never removed."""


def _remove(path: Path) -> None:
    """Delete ``path`` if it is a regular file (only the package's own files go)."""
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            path.unlink()


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
        #: every cache-named file looked at (name -> inode), usable or not: a scan reads
        #: only new or replaced files, not another key's thousands again
        self._seen: dict[str, int] = {}
        self._scanned_at = -1
        self._lock = threading.Lock()
        self._last_saved: dict[int, tuple[int, int]] = {}  # seq_id -> (n entries, hash)
        _make_private_dirs(self.dir)
        _check_private_dir(self.dir, "the prompt cache directory")
        self.secret = load_secret(key_file_path())
        self._secret_id = _secret_id(self.secret)

    # ------------------------------------------------------------------ lookup

    def best(self, prompt: Sequence[Hashable]) -> tuple[DiskEntry | None, int]:
        """The file sharing the longest prefix with ``prompt``, and that length."""
        best: DiskEntry | None = None
        best_n = 0
        # the entries are tuples: compared with a tuple, no copy per entry
        key = tuple(prompt)
        for entry in self._index_entries():
            n = common_prefix_len(entry.entries, key)
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
        self._remove_own(entry.path)

    def load(self, entry: DiskEntry) -> CachedPrompt | None:
        """The verified record of ``entry``, or None (one log line) if it cannot be used."""
        try:
            fd, st = _open_regular(entry.path, self.max_bytes)
            with os.fdopen(fd, "rb") as f:
                blob = f.read(st.st_size + 1)
                with contextlib.suppress(OSError, NotImplementedError):
                    os.utime(f.fileno())  # last use, for the LRU
            item = _decode(blob, self.key, self.build, self.secret)
        except FileNotFoundError:
            self._forget(entry.path)  # evicted by another process meanwhile
            return None
        except _Foreign:
            self._forget(entry.path)  # replaced by another key's file meanwhile
            return None
        except (_Corrupt, OSError) as exc:
            logger.warning("prompt cache: skipping %s: %s", entry.path.name, exc)
            self._remove_own(entry.path)  # it can never restore: make room for good ones
            return None
        if (item.entries, item.exact) != (entry.entries, entry.exact):
            self._forget(entry.path)  # rewritten since the scan: read its header again
            return None
        return item

    def _forget(self, path: Path) -> None:
        with self._lock:
            self._index.pop(path, None)
            self._seen.pop(path.name, None)

    def _dir_mtime(self) -> int | None:
        try:
            return os.stat(self.dir).st_mtime_ns
        except OSError:
            return None

    @contextlib.contextmanager
    def _own_change(self) -> Iterator[None]:
        """Mark a change this cache makes to the directory (its index already has it): if
        the directory was as last scanned before, the next lookup need not list it again
        (with thousands of files a listing costs more than the request). Another process's
        file written in that instant is found at the next change."""
        before = self._dir_mtime()
        try:
            yield
        finally:
            after = self._dir_mtime()
            with self._lock:
                if before is not None and before == self._scanned_at:
                    self._scanned_at = after if after is not None else -1

    def _remove_own(self, path: Path) -> None:
        with self._own_change():
            _remove(path)
        self._forget(path)

    def _scan(self) -> None:
        """Read the headers of files written since the last scan (other processes'). A
        file already seen under the same inode is not opened again, whoever's it is."""
        mtime = self._dir_mtime()
        with self._lock:
            if mtime is None or mtime == self._scanned_at:
                return
            self._scanned_at = mtime
            known = dict(self._seen)  # what a write meanwhile adds is not "gone"
        present: dict[str, int] = {}
        try:
            with os.scandir(self.dir) as it:
                for d in it:
                    if (
                        len(d.name) == 45
                        and d.name.endswith(_SUFFIX)
                        and _FILE_NAME.fullmatch(d.name)
                    ):
                        present[d.name] = d.inode()
        except OSError:  # the directory was removed: nothing to restore
            return
        new = [n for n, ino in present.items() if known.get(n) != ino]
        with self._lock:
            for name, ino in known.items():
                if name not in present and self._seen.get(name) == ino:
                    del self._seen[name]
                    self._index.pop(self.dir / name, None)
        for name in new:
            path = self.dir / name
            entry = self._read_entry(path)
            with self._lock:
                self._seen[name] = present[name]
                if entry is None:
                    self._index.pop(path, None)
                else:
                    self._index[path] = entry

    def _read_entry(self, path: Path) -> DiskEntry | None:
        """``path``'s index entry if it is one of this key's files. A broken file of this
        key (or of no key, or of the unsigned format) is deleted with one log line."""
        try:
            fd, st = _open_regular(path, self.max_bytes)
            with os.fdopen(fd, "rb") as f:
                header, entries, _ = _read_header(
                    f, self.key, self.build, self._secret_id, st.st_size
                )
        except (FileNotFoundError, _Foreign):
            return None  # gone, or not ours to judge
        except _NotRegular as exc:
            logger.warning("prompt cache: skipping %s: %s", path.name, exc)
            return None
        except OSError as exc:  # a symlink (O_NOFOLLOW), no permission...
            logger.warning("prompt cache: skipping %s: %s", path.name, exc)
            return None
        except _Corrupt as exc:
            logger.warning("prompt cache: skipping and deleting %s: %s", path.name, exc)
            _remove(path)
            return None
        return DiskEntry(path, entries, header["exact"], st.st_size)

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
        blob = _encode(self.key, self.build, item, secret=self.secret)
        if len(blob) > self.max_bytes:
            return
        entries = tuple(int(e) for e in item.entries)  # type: ignore[call-overload]
        self._write(self._name(entries), blob, entries, item.exact)

    def _name(self, entries: Sequence[int]) -> str:
        h = hashlib.blake2b(digest_size=20, key=self.secret)
        h.update(self.key.encode())
        h.update(struct.pack(f"<{len(entries)}i", *entries))
        return h.hexdigest() + _SUFFIX

    def _write(self, name: str, blob: bytes, entries: tuple[int, ...], exact: int) -> None:
        """Write atomically (temporary file, fsync, rename), then enforce the budget."""
        final = self.dir / name
        tmp = self.dir / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}"
        with self._own_change():
            try:
                with os.fdopen(os.open(tmp, _CREATE_FLAGS, 0o600), "wb") as f:  # private
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
                with contextlib.suppress(OSError):
                    self._seen[name] = os.lstat(final).st_ino
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
            self._remove_own(path)

    def evict(self) -> None:
        """Delete the least recently used files until the directory fits the budget. Only
        regular files named as this package names them are counted or removed."""
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for path in self.dir.iterdir():
            is_tmp = _TMP_NAME.fullmatch(path.name) is not None
            if not is_tmp and _FILE_NAME.fullmatch(path.name) is None:
                continue
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if is_tmp:
                if now - st.st_mtime > _STALE_TMP_S:
                    self._remove_own(path)
                continue
            files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            self._remove_own(path)
            logger.debug("prompt cache: evicted %s", path.name)
            total -= size
