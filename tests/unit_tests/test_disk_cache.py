"""The disk prompt cache's files: format, verification, budget, concurrent writers.

No model: records are written and read back as the worker would hand them over; the
restore path on real llama.cpp is in integration_tests/test_disk_cache.py.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from langchain_llamacpp_local.cache import disk as disk_cache
from langchain_llamacpp_local.cache.checkpoints import Checkpoint
from langchain_llamacpp_local.cache.disk import DiskPromptCache
from langchain_llamacpp_local.cache.host_ram import CachedPrompt

KEY, BUILD = "k" * 32, "build 1"


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
    entry, n = reader.best(list(range(50)))
    assert entry is not None and n == 50  # the header still reads
    with caplog.at_level(logging.WARNING, logger="langchain_llamacpp_local.cache.disk"):
        assert reader.load(entry) is None
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
    one = len(disk_cache._encode(KEY, BUILD, _item(range(100, 150))))
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
    blob = disk_cache._encode(KEY, BUILD, _item(range(50)))
    partial = tmp_path / ".abc.llkv.123.deadbeef.tmp"
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
