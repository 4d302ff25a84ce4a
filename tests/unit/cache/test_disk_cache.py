"""The disk prompt cache's files: format, verification, budget, concurrent writers.

No model: records are written and read back as the worker would hand them over; the
restore path on real llama.cpp is in integration/cache/test_disk_cache.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from langchain_llamacpp_local.cache import disk as disk_cache
from langchain_llamacpp_local.cache.checkpoints import Checkpoint
from langchain_llamacpp_local.cache.disk import DiskPromptCache
from langchain_llamacpp_local.cache.host_ram import CachedPrompt

KEY, BUILD = "k" * 32, "build 1"
ROOT = Path(__file__).resolve().parents[3]


def _item(entries: range | list[int], fill: int = 7, ck: bool = True) -> CachedPrompt:
    cks = [Checkpoint(4, 0, 3, bytes([fill]) * 100)] if ck else []
    return CachedPrompt(tuple(entries), bytes([fill]) * 1000, cks, exact=len(entries) - 1)


def _cache(tmp_path: Path, **kw: object) -> DiskPromptCache:
    return DiskPromptCache(
        tmp_path, kw.get("key", KEY), kw.get("build", BUILD), kw.get("max_bytes", 1 << 20)
    )


def _save(cache: DiskPromptCache, item: CachedPrompt) -> None:
    cache.save(item)
    assert disk_cache.flush(10)


def test_a_saved_record_restores_exactly(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    item = _item(range(50))
    _save(cache, item)
    reader = _cache(tmp_path)  # another process: it only has the directory
    entry, n = reader.best(list(range(40)) + [999])
    assert entry is not None and n == 40
    assert reader.load(entry) == item


def test_a_record_keeps_its_prompt_length(tmp_path: Path) -> None:
    """How many entries were the prompt (the rest the reply) survives the file, as it
    does a host-RAM copy: the cache report tells leaving the reply from a miss."""
    cache = _cache(tmp_path)
    item = _item(range(50))
    item.n_prompt = 42
    _save(cache, item)
    reader = _cache(tmp_path)
    entry, _ = reader.best(list(range(50)))
    assert entry is not None
    loaded = reader.load(entry)
    assert loaded is not None and loaded.n_prompt == 42 and loaded == item


def test_the_longest_prefix_wins(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    _save(cache, _item([1, 2, 3] + list(range(100, 140))))
    _save(cache, _item([1, 2, 3, 4] + list(range(200, 240))))
    entry, n = _cache(tmp_path).best([1, 2, 3, 4, 5])
    assert n == 4 and entry is not None and entry.entries[3] == 4


@pytest.mark.parametrize(("key", "build"), [("x" * 32, BUILD), (KEY, "build 2")])
def test_other_models_settings_or_builds_are_never_listed(
    tmp_path: Path, key: str, build: str
) -> None:
    _save(_cache(tmp_path), _item(range(50)))
    other = _cache(tmp_path, key=key, build=build)
    assert other.best(list(range(50))) == (None, 0)


@pytest.mark.parametrize("damage", ["flip", "truncate", "append"])
def test_a_damaged_file_is_skipped_with_one_log_line(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    _save(_cache(tmp_path), _item(range(50)))
    (path,) = tmp_path.glob("*.llkv")
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[-200] ^= 0xFF  # inside the state: only the checksum can tell
    elif damage == "truncate":
        del blob[-300:]
    else:
        blob += b"junk"
    path.write_bytes(bytes(blob))
    reader = _cache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="langchain_llamacpp_local.cache.disk"):
        entry, n = reader.best(list(range(50)))
        if damage == "flip":
            assert entry is not None and n == 50  # the header still reads
            assert reader.load(entry) is None
        else:
            assert entry is None  # the header's sizes do not fit the file
    assert len([r for r in caplog.records if "skipping" in r.message]) == 1
    assert not path.exists()  # it can never restore: its room goes to good files
    assert reader.best(list(range(50))) == (None, 0)


def test_garbage_in_the_directory_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "a.llkv").write_bytes(b"not a cache file at all")
    (tmp_path / "b.llkv").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("hello")
    cache = _cache(tmp_path)
    assert cache.best([1, 2, 3]) == (None, 0)
    _save(cache, _item(range(50)))
    assert cache.best(list(range(50)))[1] == 50


def test_the_budget_evicts_the_least_recently_used(tmp_path: Path) -> None:
    probe = _cache(tmp_path)
    one = len(disk_cache._encode(KEY, BUILD, _item(range(100, 150)), secret=probe.secret))
    cache = _cache(tmp_path, max_bytes=int(one * 2.5))
    _save(cache, _item(range(100, 150)))
    _save(cache, _item(range(200, 250)))
    old = time.time() - 100
    for i, path in enumerate(sorted(tmp_path.glob("*.llkv"))):
        os.utime(path, (old + i, old + i))
    entry, _ = cache.best(list(range(100, 150)))
    assert entry is not None and cache.load(entry) is not None  # used: now the newest
    _save(cache, _item(range(300, 350)))
    kept = {e.entries[0] for e in _cache(tmp_path)._index_entries()}
    assert kept == {100, 300}
    assert sum(p.stat().st_size for p in tmp_path.glob("*.llkv")) <= cache.max_bytes


def test_a_conversation_keeps_only_its_longest_file(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    _save(cache, _item(range(50)))
    _save(cache, _item(range(80)))
    assert len(list(tmp_path.glob("*.llkv"))) == 1
    assert _cache(tmp_path).best(list(range(80)))[1] == 80


def test_temporary_files_are_never_read_and_stale_ones_go(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    blob = disk_cache._encode(KEY, BUILD, _item(range(50)), secret=cache.secret)
    partial = tmp_path / f".{'a' * 40}.llkv.123.deadbeef.tmp"
    partial.write_bytes(blob[: len(blob) // 2])  # a writer that died mid-file
    assert cache.best(list(range(50))) == (None, 0)
    os.utime(partial, (time.time() - 7200,) * 2)
    cache.evict()
    assert not partial.exists()


def _writer(directory: str, start: int) -> None:
    cache = DiskPromptCache(directory, KEY, BUILD, 1 << 30)
    for i in range(start, start + 10):
        cache.save(_item([i] + list(range(1000, 1040)), fill=i % 256))
    assert disk_cache.flush(30)


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s)) for s in (0, 100)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    reader = _cache(tmp_path, max_bytes=1 << 30)
    for i in [*range(10), *range(100, 110)]:
        entry, n = reader.best([i] + list(range(1000, 1040)))
        assert entry is not None and n == 41
        item = reader.load(entry)
        assert item is not None and item.data == bytes([i % 256]) * 1000


def test_image_entries_are_not_persisted(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    assert not cache.wants(0, [1, 2, ("image", "abc"), 3])
    assert cache.wants(0, [1, 2, 3])
    assert not cache.wants(0, [1, 2, 3])  # unchanged since the last save


# ---------------------------------------------------------------- a hostile directory


def _parts(path: Path) -> tuple[bytes, Any, bytes]:
    """A cache file's magic, header and what follows (entries, state, digest)."""
    blob = path.read_bytes()
    (n,) = struct.unpack_from("<I", blob, 8)
    return blob[:8], json.loads(blob[12 : 12 + n]), blob[12 + n :]


def _plant(path: Path, magic: bytes, header: Any, rest: bytes) -> None:
    """Write a file in the cache's format: everything one who can read a file can do."""
    blob = json.dumps(header).encode()
    path.write_bytes(magic + struct.pack("<I", len(blob)) + blob + rest)


def _forge(template: Path, item: CachedPrompt) -> bytes:
    """A file claiming ``item``, with the header copied from a real file of the cache and
    the digest recomputed as anyone can (BLAKE2b without a key)."""
    magic, header, _ = _parts(template)
    header.update(n_entries=len(item.entries), exact=item.exact, data=len(item.data))
    header["checkpoints"] = []
    head = json.dumps(header).encode()
    body = (
        magic
        + struct.pack("<I", len(head))
        + head
        + struct.pack(f"<{len(item.entries)}i", *item.entries)
        + item.data
    )
    return body + hashlib.blake2b(body, digest_size=32).digest()


def test_a_forged_file_never_restores(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Whoever can write the directory can read a header and compute an unkeyed digest:
    the file would restore another conversation's state under this prompt's tokens."""
    cache = _cache(tmp_path)
    _save(cache, _item(range(50)))
    (real,) = tmp_path.glob("*.llkv")
    forged = tmp_path / ("f" * 40 + ".llkv")
    lie = CachedPrompt(tuple(range(1000, 1060)), b"\x66" * 1000, [], exact=59)
    forged.write_bytes(_forge(real, lie))
    reader = _cache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="langchain_llamacpp_local.cache.disk"):
        entry, n = reader.best(list(range(1000, 1060)))
        assert entry is None or reader.load(entry) is None
    assert not forged.exists()  # removed: it can never restore
    assert real.exists()


def test_files_signed_with_another_key_are_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(_cache(tmp_path / "c"), _item(range(50)))
    monkeypatch.setenv(disk_cache.ENV_KEY_FILE, str(tmp_path / "k2" / "key"))
    other = _cache(tmp_path / "c")
    assert other.best(list(range(50))) == (None, 0)
    assert len(list((tmp_path / "c").glob("*.llkv"))) == 1  # another user's: not deleted


def test_old_unsigned_files_are_removed(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    _save(cache, _item(range(50)))
    (real,) = tmp_path.glob("*.llkv")
    old = tmp_path / ("0" * 40 + ".llkv")
    old.write_bytes(b"LLCPPKV1" + real.read_bytes()[8:])
    reader = _cache(tmp_path)
    assert reader.best(list(range(50)))[1] == 50
    assert not old.exists()


def test_the_secret_is_private_and_outside_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(disk_cache.ENV_KEY_FILE)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cache = _cache(tmp_path / "cache")
    key = tmp_path / "state" / "langchain-llamacpp-local" / "prompt-cache.key"
    assert key.read_bytes() == cache.secret and len(cache.secret) == 32
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert _cache(tmp_path / "cache2").secret == cache.secret  # one per user
    assert not list((tmp_path / "cache").iterdir())


def test_a_key_file_of_no_such_user_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(disk_cache.ENV_KEY_FILE, "~nosuchuser-llamacpp/key")
    with pytest.raises(FileNotFoundError, match="LLAMACPP_PROMPT_CACHE_KEY_FILE"):
        _cache(tmp_path)


def _first_use(key: str, out: Any) -> None:
    out.put(disk_cache.load_secret(Path(key)))


def test_processes_starting_together_share_one_secret(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")  # nothing to import again: they start at once
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_first_use, args=(str(tmp_path / "k" / "key"), out)) for _ in range(4)
    ]
    for p in procs:
        p.start()
    secrets = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert secrets == {(tmp_path / "k" / "key").read_bytes()}
    assert [p.name for p in (tmp_path / "k").iterdir()] == ["key"]  # no temporary left


def test_a_readable_secret_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "k" / "key"
    monkeypatch.setenv(disk_cache.ENV_KEY_FILE, str(key))
    _cache(tmp_path / "c")
    key.chmod(0o644)
    disk_cache.read_secret.cache_clear()
    with pytest.raises(disk_cache.UnsafeCacheError, match=r"chmod 600"):
        _cache(tmp_path / "c")


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(disk_cache.UnsafeCacheError) as err:
        _cache(shared)
    assert str(shared) in str(err.value) and "chmod go-w" in str(err.value)
    assert not list(shared.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory away")
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(disk_cache.UnsafeCacheError, match=r"owned by uid 65534"):
        _cache(theirs)


def test_directory_and_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        cache = _cache(tmp_path / "a" / "b")
        _save(cache, _item(range(50)))
    finally:
        os.umask(old)
    for d in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    (path,) = (tmp_path / "a" / "b").glob("*.llkv")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_only_the_packages_own_files_are_ever_removed(tmp_path: Path) -> None:
    """``prompt_cache_dir`` may be a folder the user keeps files in."""
    old = time.time() - 7200
    mine = {
        "notes.tmp": b"x",
        "backup.llkv.tmp": b"x",
        ".draft.tmp": b"x",
        "model.llkv": b"not a cache file" * 1000,
        ("a" * 40) + ".llkv.bak": b"x",
    }
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
        os.utime(tmp_path / name, (old, old))
    _save(_cache(tmp_path / "probe"), _item(range(50)))
    one = next((tmp_path / "probe").glob("*.llkv")).stat().st_size
    cache = _cache(tmp_path, max_bytes=int(one * 1.5))
    _save(cache, _item(range(50)))
    _save(cache, _item(range(100, 150)))  # over the budget: the oldest cache file goes
    cache.evict()
    for name, data in mine.items():
        assert (tmp_path / name).read_bytes() == data
    assert len(list(tmp_path.glob("[0-9a-f]" * 40 + ".llkv"))) == 1


_FIFO_SCRIPT = """
import os, sys
from pathlib import Path
from langchain_llamacpp_local.cache import disk as disk_cache
d = Path(sys.argv[1])
cache = disk_cache.DiskPromptCache(d, "k" * 32, "build 1", 1 << 20)
os.mkfifo(d / "fifo")
os.mkfifo(d / ("b" * 40 + ".llkv"))
os.symlink(d / "fifo", d / ("c" * 40 + ".llkv"))
entry, n = cache.best(list(range(50)))
assert entry is not None and n == 50, (entry, n)
print("scanned", flush=True)
os.rename(entry.path, d / "moved")
os.symlink(d / "fifo", entry.path)  # swapped between the scan and the read
assert cache.load(entry) is None
os.unlink(entry.path)
os.mkfifo(entry.path)
assert cache.load(entry) is None
print("loaded", flush=True)
cache.evict()
print("evicted", flush=True)
"""


def test_a_fifo_named_like_a_cache_file_never_blocks(tmp_path: Path) -> None:
    """Opening a FIFO for reading waits for a writer: the worker would hang forever."""
    _save(_cache(tmp_path), _item(range(50)))
    done = subprocess.run(
        [sys.executable, "-c", _FIFO_SCRIPT, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["scanned", "loaded", "evicted"]
    assert stat.S_ISFIFO(os.lstat(tmp_path / ("b" * 40 + ".llkv")).st_mode)  # not ours: kept


def _bad_headers() -> list[tuple[str, Callable[[dict[str, Any]], Any]]]:
    """Header changes (returning the new header) a file of the right key may carry."""
    return [
        ("no exact", lambda h: {k: v for k, v in h.items() if k != "exact"}),
        ("odd exact", lambda h: {**h, "exact": "12"}),
        ("exact past the end", lambda h: {**h, "exact": 10**6}),
        ("float exact", lambda h: {**h, "exact": 1e400}),
        ("2^40 entries", lambda h: {**h, "n_entries": 2**40}),
        ("2^62 entries", lambda h: {**h, "n_entries": 2**62}),
        ("negative entries", lambda h: {**h, "n_entries": -1}),
        ("odd checkpoints", lambda h: {**h, "checkpoints": [[1, 2]]}),
        ("huge checkpoint", lambda h: {**h, "checkpoints": [[4, 0, 3, 2**62]]}),
        ("huge data", lambda h: {**h, "data": 2**62}),
        ("prompt past the end", lambda h: {**h, "n_prompt": 10**6}),
        ("odd prompt length", lambda h: {**h, "n_prompt": "12"}),
        ("not an object", lambda h: list(h.items())),
    ]


@pytest.mark.parametrize(("what", "change"), _bad_headers(), ids=[w for w, _ in _bad_headers()])
def test_a_malformed_file_of_this_key_is_skipped_once_and_deleted(
    tmp_path: Path, what: str, change: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cache = _cache(tmp_path)
    _save(cache, _item(range(50)))
    (real,) = tmp_path.glob("*.llkv")
    magic, header, rest = _parts(real)
    bad = tmp_path / ("e" * 40 + ".llkv")
    _plant(bad, magic, change(header), rest)
    reader = _cache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="langchain_llamacpp_local.cache.disk"):
        entry, n = reader.best(list(range(50)))  # no KeyError, MemoryError, OverflowError
        assert n == 50 and entry is not None and entry.path == real
        assert reader.load(entry) is not None
        _save(reader, _item(range(200, 250)))  # a write: the directory is scanned again
        assert reader.best(list(range(200, 250)))[1] == 50
    assert len([r for r in caplog.records if "skipping" in r.message]) == 1
    assert not bad.exists()


def test_a_huge_sparse_file_is_never_read_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(_cache(tmp_path / "other"), _item(range(60)))
    (longer,) = (tmp_path / "other").glob("*.llkv")
    magic, header, rest = _parts(longer)
    cache = _cache(tmp_path / "c")
    _save(cache, _item(range(50)))
    huge = tmp_path / "c" / ("d" * 40 + ".llkv")
    _plant(huge, magic, {**header, "data": header["data"] + 2**40}, rest)
    with open(huge, "r+b") as f:
        f.truncate(2**40 + huge.stat().st_size)  # 1 TiB in holes: no disk used
    reader = _cache(tmp_path / "c")
    with caplog.at_level(logging.WARNING, logger="langchain_llamacpp_local.cache.disk"):
        for _ in range(2):  # it matches more of the prompt than the good file
            entry, _n = reader.best(list(range(60)))
            item = reader.load(entry) if entry is not None else None  # no MemoryError
            assert item is not None and item.entries == tuple(range(50))
    assert len([r for r in caplog.records if "skipping" in r.message]) == 1
    assert not huge.exists()


def test_other_keys_files_are_read_once(tmp_path: Path) -> None:
    """A shared directory with thousands of other models' files: a scan (one runs after
    every write) opens only files it has not seen."""
    other = _cache(tmp_path, key="o" * 32)
    _save(other, _item(range(50)))
    (template,) = tmp_path.glob("*.llkv")
    blob = template.read_bytes()
    for i in range(300):
        (tmp_path / f"{i:040x}.llkv").write_bytes(blob)
    opened: list[str] = []
    listening = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:  # audit hooks cannot be removed
        if listening[0] and event == "open" and str(args[0]).startswith(str(tmp_path)):
            opened.append(str(args[0]))

    sys.addaudithook(hook)
    try:
        cache = _cache(tmp_path)
        opened.clear()
        assert cache.best(list(range(50))) == (None, 0)
        assert len(opened) >= 300
        _save(cache, _item(range(100, 150)))
        opened.clear()
        assert cache.best(list(range(100, 150)))[1] == 50
        assert len(opened) <= 1, len(opened)  # not the 301 others
        _save(_cache(tmp_path), _item(range(200, 250)))  # another process's write
        opened.clear()
        assert cache.best(list(range(200, 250)))[1] == 50
        assert len(opened) == 1, len(opened)  # its file, not the 301 others
    finally:
        listening[0] = False
