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

This module keeps the index of a directory's files and its eviction; the files' key and
secret are :mod:`.disk_key`'s, their format :mod:`.disk_format`'s, the writer thread
:mod:`.disk_writer`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from langchain_llamacpp_local.cache.disk_format import (
    FILE_NAME,
    SUFFIX,
    TMP_NAME,
    Unusable,
    file_name,
    read_header,
    read_record,
    remove_file,
)
from langchain_llamacpp_local.cache.disk_format import encode as _encode
from langchain_llamacpp_local.cache.disk_key import (
    CREATE_FLAGS,
    ENV_KEY_FILE,
    UnsafeCacheError,
    cache_key,
    check_private_dir,
    file_identity,
    key_file_path,
    load_secret,
    make_private_dirs,
    read_secret,
    secret_id,
    temp_path,
)
from langchain_llamacpp_local.cache.disk_writer import PendingSave, flush, queue_write
from langchain_llamacpp_local.cache.host_ram import CachedPrompt
from langchain_llamacpp_local.cache.slots import common_prefix_len

__all__ = [
    "DEFAULT_MAX_BYTES",
    "ENV_DIR",
    "ENV_KEY_FILE",
    "DiskEntry",
    "DiskPromptCache",
    "PendingSave",
    "UnsafeCacheError",
    "cache_key",
    "file_identity",
    "flush",
    "key_file_path",
    "load_secret",
    "read_secret",
]

logger = logging.getLogger(__name__)

#: Environment variable naming the directory when ``prompt_cache_dir`` is not set.
ENV_DIR = "LLAMACPP_PROMPT_CACHE_DIR"
#: Default byte budget of the directory.
DEFAULT_MAX_BYTES = 4 * 1024**3
#: Temporary files older than this are a crashed writer's: removed during eviction.
_STALE_TMP_S = 3600.0


@dataclass(frozen=True)
class DiskEntry:
    """One cache file as the index knows it (its entries, not its state)."""

    path: Path
    entries: tuple[int, ...]
    exact: int
    size: int


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
        make_private_dirs(self.dir)
        check_private_dir(self.dir, "the prompt cache directory")
        self.secret = load_secret(key_file_path())
        self._secret_id = secret_id(self.secret)

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
            item = read_record(entry.path, self.key, self.build, self.secret, self.max_bytes)
        except FileNotFoundError:
            self._forget(entry.path)  # evicted by another process meanwhile
            return None
        except OSError as exc:
            item = Unusable(str(exc))
        if isinstance(item, Unusable):
            if item.foreign:
                self._forget(entry.path)  # replaced by another key's file meanwhile
                return None
            logger.warning("prompt cache: skipping %s: %s", entry.path.name, item.why)
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
            remove_file(path)
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
                        and d.name.endswith(SUFFIX)
                        and FILE_NAME.fullmatch(d.name)
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
            got = read_header(path, self.key, self.build, self._secret_id, self.max_bytes)
        except FileNotFoundError:
            return None  # gone
        except OSError as exc:  # a symlink (O_NOFOLLOW), no permission...
            logger.warning("prompt cache: skipping %s: %s", path.name, exc)
            return None
        if isinstance(got, Unusable):
            if got.foreign:
                return None  # not ours to judge
            if got.not_regular:
                logger.warning("prompt cache: skipping %s: %s", path.name, got.why)
                return None
            logger.warning("prompt cache: skipping and deleting %s: %s", path.name, got.why)
            remove_file(path)
            return None
        header, entries, size = got
        return DiskEntry(path, entries, header["exact"], size)

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
        queue_write(self, pending)
        return pending

    def after_fork(self) -> None:
        """A forked child's lock: the parent's writer thread may have held this one."""
        self._lock = threading.Lock()

    def write_record(self, item: CachedPrompt) -> None:
        """Encode and write ``item`` (the writer thread: hashing a whole KV state is slow)."""
        blob = _encode(self.key, self.build, item, secret=self.secret)
        if len(blob) > self.max_bytes:
            return
        entries = tuple(int(e) for e in item.entries)  # type: ignore[call-overload]
        self._write(file_name(self.key, self.secret, entries), blob, entries, item.exact)

    def _write(self, name: str, blob: bytes, entries: tuple[int, ...], exact: int) -> None:
        """Write atomically (temporary file, fsync, rename), then enforce the budget."""
        final = self.dir / name
        tmp = temp_path(final)
        with self._own_change():
            try:
                with os.fdopen(os.open(tmp, CREATE_FLAGS, 0o600), "wb") as f:  # private
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
            is_tmp = TMP_NAME.fullmatch(path.name) is not None
            if not is_tmp and FILE_NAME.fullmatch(path.name) is None:
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
