"""The disk cache's writer across ``fork()``: a child writes its own files and exits
promptly. Each case runs in a fresh interpreter with a timeout (a hang fails the test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = r"""
import multiprocessing, os, sys
from pathlib import Path
from langchain_llamacpp_local.cache import disk as disk_cache
from langchain_llamacpp_local.cache.host_ram import CachedPrompt

directory, how = Path(sys.argv[1]), sys.argv[2]

def item(tag):
    return CachedPrompt(tuple(range(tag * 100, tag * 100 + 50)), bytes([tag]) * 1000, [], 49)

cache = disk_cache.DiskPromptCache(directory, "k" * 32, "build 1", 1 << 20)
cache.save(item(1))
assert disk_cache.flush(10)  # the parent's writer thread is running

if how == "os.fork":
    pid = os.fork()
    if pid == 0:
        cache.save(item(2))
        assert disk_cache.flush(10), "the child's file was not written"
        cache.save(item(3))  # written by the exit flush
        raise SystemExit(0)  # a normal exit: the interpreter's exit hooks run
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
else:  # multiprocessing's fork start method ends the child with os._exit
    proc = multiprocessing.get_context("fork").Process(target=cache.save, args=(item(2),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, proc.exitcode
cache.save(item(4))  # the parent's writer still works
assert disk_cache.flush(10)
print(len(list(directory.glob("*.llkv"))))
"""


@pytest.mark.parametrize(("how", "files"), [("os.fork", 4), ("multiprocessing", 3)])
def test_a_forked_child_writes_its_files_and_exits_promptly(
    tmp_path: Path, how: str, files: int
) -> None:
    """The child has the parent's writer object but not its thread: it must start its
    own (files written, the exit flush does not wait 30 s for a thread that is gone)."""
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path), how],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.strip().splitlines()[-1]) == files
