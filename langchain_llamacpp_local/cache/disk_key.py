"""What a disk cache file is keyed and signed with, and the private files that hold it.

A file's key (:func:`cache_key`) names the model file's identity, the settings that
change the KV cache and the llama.cpp build; a per-user secret, kept outside the cache
directory, signs every file. Both the directory and the secret's file must be the user's
own and not writable by others (else anyone who can write them could plant files).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import secrets
import stat
import uuid
from pathlib import Path
from typing import Any

#: Environment variable naming the secret's file (default: under the user's state directory).
ENV_KEY_FILE = "LLAMACPP_PROMPT_CACHE_KEY_FILE"

#: The suffix of every temporary file this package writes (see :func:`temp_path`).
TMP_SUFFIX = ".tmp"
_SECRET_BYTES = 32
#: Regular files only, never blocking (a FIFO named like a cache file must not hang the
#: worker), never through a symlink.
OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
#: A new private file, never an existing one, never through a symlink.
CREATE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


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


def temp_path(path: Path) -> Path:
    """A temporary name beside ``path``, unique to this process and call: written whole,
    then renamed or linked into place, so nobody reads half a file."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


def _uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def make_private_dirs(path: Path) -> None:
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


def check_private_dir(path: Path, what: str) -> None:
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
    return read_secret(str(path))


@functools.lru_cache(maxsize=8)
def read_secret(name: str) -> bytes:
    """The secret in the file ``name``, read once per process (``cache_clear`` forgets)."""
    path = Path(name)
    make_private_dirs(path.parent)
    check_private_dir(path.parent, "the prompt cache key's directory")
    try:
        fd = os.open(path, OPEN_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        _create_secret(path)
        fd = os.open(path, OPEN_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
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
    tmp = temp_path(path)
    fd = os.open(tmp, CREATE_FLAGS, 0o600)
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


def secret_id(secret: bytes) -> str:
    """Names the secret in a file's header (without revealing it): files signed with
    another secret (another user's key file) are someone else's, not corrupt."""
    return hashlib.blake2b(b"prompt cache key id", key=secret, digest_size=8).hexdigest()
