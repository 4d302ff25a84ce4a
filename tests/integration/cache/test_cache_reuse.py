"""Chunk reuse after a history edit (``cache_reuse``) on real llama.cpp.

After the oldest turn is dropped, the next turn moves the cached turns that follow it
(``llama_memory_seq_rm`` + ``llama_memory_seq_add``) and reads only what is new; the KV
bookkeeping check (``LLAMACPP_LOCAL_CHECK_KV=1``, tests/conftest.py) runs after every
step. Moved entries were computed attending to the dropped turn, so a reply may differ
from a fresh read's: these tests check where it agrees (short greedy continuations) and
report what differs. The decision itself: tests/unit/cache/test_reuse.py.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.messages.content import create_image_block
from PIL import Image

from langchain_llamacpp_local import ChatLlamaCpp
from tests.compare import GREEDY, assert_same_greedy, entries, ids
from tests.gguf_models import write_tiny_mmproj
from tests.helpers import cached_tokens

TOPICS = ("the moon", "volcanoes", "bread baking", "chess openings", "rivers", "honey bees")


def _history(first: int, last: int) -> list[BaseMessage]:
    msgs: list[BaseMessage] = [SystemMessage("You are a helpful assistant. Answer briefly.")]
    for i in range(first, last):
        msgs.append(HumanMessage(f"Tell me one fact about {TOPICS[i]}."))
        msgs.append(AIMessage(f"A fact about {TOPICS[i]}: it is interesting in ways {i}."))
    return msgs


def _trimmed_turn(llm: ChatLlamaCpp, **kw: Any) -> tuple[BaseMessage, list[BaseMessage]]:
    """A 6-turn conversation's next turn, then the turn after it with the oldest turn
    dropped (``trim_messages``' edit); returns that reply and its prompt."""
    full = [*_history(0, 6), HumanMessage("Which topic came last?")]
    reply = llm.invoke(full, **kw)
    trimmed = [
        *_history(1, 6),
        HumanMessage("Which topic came last?"),
        AIMessage(str(reply.content)),
        HumanMessage("And which came first?"),
    ]
    return llm.invoke(trimmed, **kw), trimmed


def _cache(msg: BaseMessage) -> dict[str, Any]:
    return msg.response_metadata["cache"]  # type: ignore[no-any-return]


def test_a_trimmed_history_moves_the_rest_and_reads_the_new_turn(smollm2: str) -> None:
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=2048, max_tokens=8, cache_reuse=16, **GREEDY)
    msg, _ = _trimmed_turn(llm)
    usage = msg.usage_metadata
    assert usage is not None
    cache = _cache(msg)
    assert cache["reuse_off"] is None and cache["missed"]
    moved = cache["moved_tokens"]
    read = usage["input_tokens"] - cached_tokens(msg)
    assert moved > 150  # five turns, the last question and reply
    assert read < 40 and read * 5 < moved  # the new question and the template's tail
    assert msg.response_metadata["timings"]["prompt_n"] == read


def test_off_reads_the_whole_history_again(smollm2: str) -> None:
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=2048, max_tokens=8, **GREEDY)
    msg, _ = _trimmed_turn(llm)
    assert "moved_tokens" not in _cache(msg)  # the report carries it only when asked for
    assert cached_tokens(msg) < 30  # the system prompt's tokens only


def test_a_call_may_turn_it_on(smollm2: str) -> None:
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=2048, max_tokens=8, **GREEDY)
    msg, _ = _trimmed_turn(llm, cache_reuse=16)
    assert _cache(msg)["moved_tokens"] > 150


def _agrees_in_tokens(msg: BaseMessage, fresh: BaseMessage) -> float:
    """The same greedy tokens; returns the largest log-probability difference (the
    moved entries' numbers are not a fresh read's: this is what it costs)."""
    assert ids(msg) == ids(fresh), (msg.content, fresh.content)
    return max(
        abs(a["logprob"] - b["logprob"]) for a, b in zip(entries(msg), entries(fresh), strict=True)
    )


def test_greedy_answers_after_a_trim_agree_with_a_fresh_read(smollm2: str) -> None:
    """Short greedy continuations give the fresh read's tokens, but not its numbers: the
    moved entries attended to the dropped turn (here about 0.03 in the first token's
    log-probability, beyond the 0.02 that cache paths differ by otherwise)."""
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=2048, max_tokens=8, cache_reuse=16, **GREEDY)
    msg, trimmed = _trimmed_turn(llm)
    assert _cache(msg)["moved_tokens"] > 150
    fresh = llm.invoke(trimmed, cache_prompt=False)
    assert _agrees_in_tokens(msg, fresh) < 0.5


def test_greedy_answers_on_the_tiny_model(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=2048, max_tokens=4, cache_reuse=16, **GREEDY)
    msg, trimmed = _trimmed_turn(llm)
    assert _cache(msg)["moved_tokens"] > 150
    fresh = llm.invoke(trimmed, cache_prompt=False)
    assert _agrees_in_tokens(msg, fresh) < 0.5


@pytest.mark.parametrize(
    ("fixture", "reason"),
    [("tiny_mamba", "recurrent"), ("tiny_hybrid", "hybrid"), ("gemma", "sliding_window")],
)
def test_memory_that_cannot_shift_says_why_it_is_off(
    request: pytest.FixtureRequest, fixture: str, reason: str
) -> None:
    path = request.getfixturevalue(fixture)
    llm = ChatLlamaCpp(model_path=path, n_ctx=2048, max_tokens=4, cache_reuse=16, **GREEDY)
    msg, trimmed = _trimmed_turn(llm)
    cache = _cache(msg)
    assert cache["moved_tokens"] == 0 and cache["reuse_off"] == reason
    assert_same_greedy(msg, llm.invoke(trimmed, cache_prompt=False))


def test_deterministic_mode_never_moves(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(
        model_path=tiny_llama, n_ctx=2048, max_tokens=4, cache_reuse=16, deterministic=True
    )
    msg, _ = _trimmed_turn(llm)
    assert _cache(msg)["moved_tokens"] == 0 and _cache(msg)["reuse_off"] == "deterministic"


def test_another_instance_never_moves_this_ones_entries(smollm2: str) -> None:
    """Two instances of one model share its worker and slots; a moved entry carries what
    it attended to, so one instance's history never reaches the other's answers."""
    kw: dict[str, Any] = {"n_ctx": 2048, "max_tokens": 8, "cache_reuse": 16, **GREEDY}
    kw["n_slots"] = 1  # the second takes the first one's slot
    first = ChatLlamaCpp(model_path=smollm2, **kw)
    second = ChatLlamaCpp(model_path=smollm2, **kw)
    first.invoke([*_history(0, 6), HumanMessage("Which topic came last?")])
    msg = second.invoke([*_history(1, 6), HumanMessage("Which topic came last?")])
    assert _cache(msg)["moved_tokens"] == 0
    assert _cache(msg)["reuse_off"] == "other_conversation"


def test_a_call_without_reuse_reads_the_moved_entries_again(smollm2: str) -> None:
    """Moved entries are kept only by requests of their instance that ask for reuse: the
    same prompt with reuse off is read from the edit on, as a fresh read."""
    llm = ChatLlamaCpp(model_path=smollm2, n_ctx=2048, max_tokens=8, cache_reuse=16, **GREEDY)
    msg, trimmed = _trimmed_turn(llm)
    at = _cache(msg)["miss"]["token"]
    again = llm.invoke(trimmed, cache_reuse=0)
    assert cached_tokens(again) <= at
    assert_same_greedy(again, llm.invoke(trimmed, cache_prompt=False))


def _image_turns(color: tuple[int, int, int]) -> tuple[list[BaseMessage], list[BaseMessage]]:
    """A conversation whose second turn shows an image, and it with the first dropped."""
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    image = create_image_block(base64=data, mime_type="image/png")
    seen = HumanMessage(content_blocks=[{"type": "text", "text": "Look at this: "}, image])
    old = [HumanMessage("an old question to drop"), AIMessage("an old answer to drop")]
    kept = [seen, AIMessage("red"), HumanMessage("and now?")]
    return [*old, *kept], [*kept, AIMessage("x"), HumanMessage("ok")]


def test_an_image_after_the_edit_is_read_and_the_report_says_why(
    tiny_llama: str, models_dir: Path
) -> None:
    """A chunk never holds an image: the text before it is moved, the image and what
    follows are read; ``reuse_off`` names the image when nothing could move."""
    mmproj = str(write_tiny_mmproj(models_dir / "tiny-mmproj-reuse.gguf", text_n_embd=64))
    llm = ChatLlamaCpp(model_path=tiny_llama, mmproj_path=mmproj, n_slots=1, max_tokens=4, **GREEDY)
    before, after = _image_turns((255, 0, 0))
    llm.invoke(before, cache_reuse=8)
    msg = llm.invoke(after, cache_reuse=8)
    cache = _cache(msg)
    usage = msg.usage_metadata
    assert usage is not None
    n_text = len("Look at this: ")  # byte vocabulary: a token a byte
    assert n_text <= cache["moved_tokens"] < n_text + 16 and cache["reuse_off"] is None
    assert usage["input_tokens"] - cached_tokens(msg) > 16  # the image's positions, read
    assert _agrees_in_tokens(msg, llm.invoke(after, cache_prompt=False)) < 0.5
    # chunks of at least 64: the text before the image is too short, the image stops it
    before, after = _image_turns((0, 0, 255))
    llm.invoke(before, cache_reuse=64)
    cache = _cache(llm.invoke(after, cache_reuse=64))
    assert cache["moved_tokens"] == 0 and cache["reuse_off"] == "media"


def test_a_sliding_window_model_with_a_full_cache_moves(gemma: str) -> None:
    """``swa_full=True`` keeps every position of the sliding-window layers: llama.cpp can
    shift it, and reuse applies (Gemma 3)."""
    llm = ChatLlamaCpp(
        model_path=gemma, n_ctx=2048, max_tokens=4, cache_reuse=16, swa_full=True, **GREEDY
    )
    msg, _ = _trimmed_turn(llm)
    assert _cache(msg)["moved_tokens"] > 100 and _cache(msg)["reuse_off"] is None
