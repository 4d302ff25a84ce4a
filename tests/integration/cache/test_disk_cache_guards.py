"""The disk cache against forged states, and off the reply's path, on real llama.cpp.

A forged state is built from a real one: the conversation's record is taken from the
slot, a cell's position in llama.cpp's state blob is moved to 2**31 - 1 (a position
``seq_rm`` cannot remove) and the record is saved over the genuine file.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.cache import disk as disk_cache
from langchain_llamacpp_local.cache.checkpoints import Checkpoint
from langchain_llamacpp_local.cache.host_ram import CachedPrompt
from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.runtime.channel import Channel
from langchain_llamacpp_local.runtime.requests import Finished
from tests.compare import GREEDY as _GREEDY
from tests.compare import assert_identical
from tests.gguf_models import write_scripted_llama
from tests.helpers import cached_tokens, worker_of

GREEDY: dict[str, Any] = {**_GREEDY, "max_tokens": 8, "deterministic": True}
INT32_MAX = 2**31 - 1
CACHE_LOGGERS = "langchain_llamacpp_local.cache"
PREAMBLE = SystemMessage(
    "You are an agent with tools. "
    + " ".join(f"Rule {i}: answer briefly and cite the tool you used." for i in range(10))
)
FIRST = [PREAMBLE, HumanMessage("first question")]
SECOND = [PREAMBLE, HumanMessage("a different question")]


def _cold(path: str, msgs: list[BaseMessage]) -> BaseMessage:
    llm = ChatLlamaCpp(model_path=path, **GREEDY)
    try:
        return llm.invoke(msgs)
    finally:
        llm.close()
        registry.unload()


def _attention_cell_at_end(item: CachedPrompt, seq_id: int) -> CachedPrompt:
    """The last cell of an attention KV state moved to 2**31 - 1 (a cell's metadata is
    its position, its count of sequence ids (1) and the id)."""
    n = len(item.entries)
    data = bytearray(item.data)
    at = data.find(struct.pack("<iIi", n - 1, 1, seq_id))
    assert 0 < at < 64 + 12 * n, "the cell metadata was not found where expected"
    data[at : at + 4] = struct.pack("<i", INT32_MAX)
    return CachedPrompt(item.entries, bytes(data), item.checkpoints, item.exact)


def _recurrent_checkpoints_at_end(item: CachedPrompt, seq_id: int) -> CachedPrompt:
    """Every checkpoint's recurrent cell moved to 2**31 - 1 (after a short header, the
    state is its cell count (1), the cell's position and a zero sequence-id count)."""
    forged = []
    for ck in item.checkpoints:
        data = bytearray(ck.data)
        at = data.find(struct.pack("<IiI", 1, ck.n_tokens - 1, 0)) + 4
        assert 4 <= at < 64, "the cell metadata was not found where expected"
        data[at : at + 4] = struct.pack("<i", INT32_MAX)
        forged.append(Checkpoint(ck.n_tokens, ck.pos_min, ck.pos_max, bytes(data)))
    assert forged, "the record has no checkpoint to forge"
    return CachedPrompt(item.entries, item.data, forged, item.exact)


def _forge(
    llm: ChatLlamaCpp, cache: Path, edit: Callable[[CachedPrompt, int], CachedPrompt]
) -> Path:
    """Overwrite the file of the conversation ``llm`` just answered with ``edit`` of its
    record; returns the file."""
    assert disk_cache.flush(30)  # the genuine file first: the forged one replaces it

    def forge(st: Any) -> None:
        slot = max(st.slots, key=lambda s: s.n_past)
        data = bytes(st.engine.state_get(slot.seq_id, 0))
        item = CachedPrompt(tuple(slot.entries), data, list(slot.checkpoints.items), slot.exact)
        st.memory.disk.save(edit(item, slot.seq_id))

    worker_of(llm).call(forge)  # type: ignore[union-attr]
    assert disk_cache.flush(30)
    (path,) = cache.glob("*.llkv")
    return path


@pytest.mark.parametrize(
    ("model", "edit"),
    [("tiny_llama", _attention_cell_at_end), ("tiny_mamba", _recurrent_checkpoints_at_end)],
)
def test_a_state_with_a_cell_out_of_reach_is_refused_and_the_model_serves(
    model: str,
    edit: Callable[[CachedPrompt, int], CachedPrompt],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A restored state (or checkpoint) whose positions are not what its entries claim
    is dropped with one log line and the prompt read instead; the file is deleted, and
    every later request is served (before: DecodeError until the model was unloaded)."""
    path = request.getfixturevalue(model)
    cache = tmp_path / "cache"
    writer = ChatLlamaCpp(model_path=path, prompt_cache_dir=str(cache), n_slots=1, **GREEDY)
    writer.invoke(FIRST)
    forged = _forge(writer, cache, edit)
    writer.close()
    registry.unload()
    cold = _cold(path, SECOND)
    llm = ChatLlamaCpp(model_path=path, prompt_cache_dir=str(cache), n_slots=1, **GREEDY)
    with caplog.at_level(logging.WARNING, logger="langchain_llamacpp_local"):
        out = llm.invoke(SECOND)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith(CACHE_LOGGERS)]
    assert len(lines) == 1 and "does not hold" in lines[0], lines
    assert not forged.exists()
    assert_identical(out, cold)
    for _ in range(2):  # and the model keeps serving
        assert_identical(llm.invoke(SECOND), cold)
    worker_of(llm).call(lambda st: st.memory.check())  # type: ignore[union-attr]


@pytest.mark.parametrize("kv_unified", [False, True])
def test_reset_removes_a_cell_seq_rm_cannot_reach(tiny_llama: str, kv_unified: bool) -> None:
    """llama.cpp's seq_rm(seq, -1, -1) removes [0, 2**31 - 1): a cell at 2**31 - 1
    stays. Reset still empties the sequence, and the other slot's conversation
    survives it (per-sequence streams or one unified cache)."""
    llm = ChatLlamaCpp(model_path=tiny_llama, n_slots=2, kv_unified=kv_unified, **GREEDY)
    first = llm.invoke(FIRST)

    def plant_and_reset(st: Any) -> tuple[int, int, int]:
        held = max(st.slots, key=lambda s: s.n_past)
        other = next(s for s in st.slots if s is not held)
        item = CachedPrompt(tuple(held.entries), bytes(st.engine.state_get(held.seq_id, 0)))
        forged = _attention_cell_at_end(item, held.seq_id)
        assert st.engine.state_set(forged.data, other.seq_id, 0)
        assert st.engine.seq_pos_max(other.seq_id) == INT32_MAX
        st.memory.reset(other)
        st.memory.check()
        return (
            st.engine.seq_pos_max(other.seq_id),
            st.engine.seq_pos_max(held.seq_id),
            held.n_past,
        )

    emptied, kept, n_past = worker_of(llm).call(plant_and_reset)  # type: ignore[union-attr]
    assert emptied == -1
    assert kept == n_past - 1
    again = llm.invoke(FIRST)  # from the kept conversation, and the same
    assert cached_tokens(again) > 0
    assert_identical(again, first)
    llm.invoke(SECOND)  # the emptied slot serves too


def test_the_reply_is_sent_before_its_state_is_saved(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply's last item goes out first; then the worker copies the state once and
    the disk cache's own thread encodes, hashes and writes it."""
    cache = tmp_path / "cache"
    events: list[tuple[str, Any]] = []
    put, state_get, encode = Channel.put, Engine.state_get, disk_cache._encode

    def spy_put(self: Channel, item: Any) -> None:
        if isinstance(item, Finished):
            events.append(("done", sorted(cache.glob("*.llkv"))))
        put(self, item)

    def spy_state_get(self: Engine, seq_id: int, flags: int = 0) -> bytearray:
        if flags == 0:  # a whole sequence (what the disk cache saves)
            events.append(("copy", threading.current_thread().name))
        return state_get(self, seq_id, flags)

    def spy_encode(*args: Any, **kwargs: Any) -> bytes:
        events.append(("encode", threading.current_thread().name))
        return encode(*args, **kwargs)

    monkeypatch.setattr(Channel, "put", spy_put)
    monkeypatch.setattr(Engine, "state_get", spy_state_get)
    monkeypatch.setattr(disk_cache, "_encode", spy_encode)
    llm = ChatLlamaCpp(model_path=tiny_llama, prompt_cache_dir=str(cache), n_slots=1, **GREEDY)
    llm.invoke(FIRST)
    assert disk_cache.flush(30)
    assert [kind for kind, _ in events] == ["done", "copy", "encode"], events
    assert events[0][1] == []  # no file yet when the reply completed
    assert events[1][1].startswith("llamacpp-worker")
    assert events[2][1] == "llamacpp-disk-cache"
    assert list(cache.glob("*.llkv"))


def test_a_reply_ending_inside_a_verify_step_saves_the_state_it_keeps(
    tmp_path: Path,
) -> None:
    """A stop string inside an accepted draft ends the reply before the step drops its
    rejected rows: the saved state is taken after the step, so it holds exactly the
    entries the file lists (a state with more cells would be refused on restore)."""
    cycle = "abcd efg."
    model = write_scripted_llama(
        tmp_path / "cycle.gguf",
        transitions={c: {cycle[(i + 1) % len(cycle)]: 10.0} for i, c in enumerate(cycle)},
    )
    cache = tmp_path / "cache"
    llm = ChatLlamaCpp(
        model_path=str(model),
        chat_template="{{ messages[-1].content }}",
        n_ctx=512,
        n_slots=1,
        prompt_cache_dir=str(cache),
        max_tokens=40,
        speculative_max_draft=6,
        **_GREEDY,
    )
    got = llm.invoke(cycle * 5 + "a", stop=["g.ab"], speculative="ngram")
    assert got.content == "bcd ef" and got.response_metadata["speculative"]["accepted"] > 0
    assert disk_cache.flush(30)

    def saved(st: Any) -> tuple[int, int, int]:
        slot = st.slots[0]
        entry, _ = st.memory.disk.best(slot.entries)
        item = st.memory.disk.load(entry)
        assert st.engine.state_set(item.data, slot.seq_id, 0)  # the same state again
        return len(item.entries), slot.n_past, st.engine.seq_pos_max(slot.seq_id)

    n_file, n_slot, pos_max = worker_of(llm).call(saved)  # type: ignore[union-attr]
    assert n_file == n_slot
    assert pos_max == n_file - 1
