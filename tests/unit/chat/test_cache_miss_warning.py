"""The optional cache-miss warning, without a model: a costly miss is logged once per
conversation (its opening user turn, whatever the system prompt), memory is bounded,
and a hit, a cheap miss or an unset threshold logs nothing."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from langchain_llamacpp_local.chat.cache_report import (
    LastKwargs,
    MissWarnings,
    conversation_key,
    kwargs_key,
    reread_tokens,
    warn_on_miss,
)

LOGGER = "langchain_llamacpp_local.chat.cache_report"


def _convo(system: str, question: str = "What is the weather?") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]


MISS: dict[str, Any] = {
    "source": "slot",
    "missed": True,
    "at": 12,
    "miss": {
        "message_index": 0,
        "role": "system",
        "offset": 41,
        "prompt": "6. Be brief.",
        "cause": "system prompt changed",
    },
}
USAGE = {"input_tokens": 900, "input_token_details": {"cache_read": 12}}


def test_key_ignores_the_system_prompt_but_not_the_opening_turn() -> None:
    assert conversation_key(_convo("Today is Monday.")) == conversation_key(
        _convo("Today is Tuesday.")
    )
    assert conversation_key(_convo("x", "Plan a trip.")) != conversation_key(
        _convo("x", "Fix my code.")
    )
    # only system messages: the first one identifies it
    only = [{"role": "system", "content": "a"}]
    assert conversation_key(only) != conversation_key([{"role": "system", "content": "b"}])
    assert conversation_key([]) == conversation_key([])


def test_reread_counts_only_a_miss() -> None:
    assert reread_tokens(MISS, USAGE) == 888
    hit = {**MISS, "missed": False}  # a new turn extending the cache: no miss
    assert reread_tokens(hit, USAGE) == 0
    assert reread_tokens(None, USAGE) == 0


def test_warns_once_per_conversation(caplog: pytest.LogCaptureFixture) -> None:
    warned = MissWarnings()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert warn_on_miss(MISS, USAGE, 500, _convo("Today is Monday."), warned)
    [record] = caplog.records
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "888" in text and "message 0" in text and "offset 41" in text
    assert "system prompt changed" in text and "'6. Be brief.'" in text
    # the same conversation (its system prompt changed again): no second warning
    assert not warn_on_miss(MISS, USAGE, 500, _convo("Today is Wednesday."), warned)
    # another conversation warns once too
    assert warn_on_miss(MISS, USAGE, 500, _convo("x", "Another question"), warned)
    assert len(caplog.records) == 2


def test_no_warning_below_threshold_on_a_hit_or_when_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    convo = _convo("s")
    assert not warn_on_miss(MISS, USAGE, 888, convo, MissWarnings())  # not *more than*
    assert not warn_on_miss({**MISS, "missed": False}, USAGE, 0, convo, MissWarnings())
    assert not warn_on_miss(MISS, USAGE, None, convo, MissWarnings())
    assert not caplog.records


def test_remembered_conversations_are_bounded() -> None:
    warned = MissWarnings(limit=2)
    assert warned.first("a") and warned.first("b")
    assert not warned.first("a")  # "a" is now the most recent
    assert warned.first("c")  # "b", the oldest, is forgotten
    assert warned.first("b")
    assert len(warned) == 2


def test_last_kwargs_names_a_change_per_conversation() -> None:
    last = LastKwargs()
    a, b = conversation_key(_convo("s", "first")), conversation_key(_convo("s", "second"))
    monday, tuesday = kwargs_key({"today": "Monday"}), kwargs_key({"today": "Tuesday"})
    assert not last.changed(a, monday)  # nothing known yet
    assert not last.changed(b, tuesday)  # another conversation: its own record
    assert not last.changed(a, monday)
    assert last.changed(a, tuesday)
    assert not last.changed(a, tuesday)
    assert kwargs_key({"x": 1, "y": 2}) == kwargs_key({"y": 2, "x": 1})


def test_a_decoded_image_counts_in_the_key_by_its_digest_not_its_pixels() -> None:
    """The key never spells out an image's pixels (megabytes, under the GIL)."""
    from langchain_llamacpp_local.chat.cache_report import conversation_key
    from langchain_llamacpp_local.chat.images import DecodedImage

    def conv(rgb: bytes, digest: str) -> list[dict]:
        image = DecodedImage(width=1, height=1, rgb=rgb, digest=digest)
        part = {"type": "image", "image": image}
        return [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]

    same = conversation_key(conv(b"\x00" * 3, "abc"))
    assert conversation_key(conv(b"\xff" * 3, "abc")) == same  # pixels not serialised
    assert conversation_key(conv(b"\x00" * 3, "abd")) != same  # another image
