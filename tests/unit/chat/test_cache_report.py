"""The cache report's cause function, without a model: each recognised cause is named
with the message and the offset inside it, and a new turn is no miss."""

from __future__ import annotations

import pytest

from langchain_llamacpp_local.chat.cache_report import (
    CAUSE_RULES,
    MEDIA,
    MessageSpan,
    PromptLayout,
    Span,
    explain_miss,
    likely_cause,
    locate,
    media_kinds,
    message_layout,
    miss_report,
    spans_from_renders,
)

SYSTEM = "<|sys|>You are helpful. Today is 2026-11-26.<|end|>"
TOOLS = "<tools>[get_weather, search]</tools>"
USER1 = "<|user|>Hello there<|end|>"
ASSIST = "<|assistant|>Hi! <img>@@@@</img> How can I help?<|end|>"
USER2 = "<|user|>Weather in Paris?<|end|><|assistant|>"


#: a user message with an image and then an audio clip, as the template messages hold them
MIXED = [
    {"role": "system", "content": "Listen."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Look"},
            {"type": "image", "image": "<png>"},
            {"type": "audio", "audio": "<wav>"},
            {"type": "text", "text": "and hear"},
        ],
    },
    {"role": "user", "content": "Well?"},
]
MIXED_TEXT = f"<s>Listen.</s><u>Look\n{MEDIA}\n{MEDIA}\nand hear</u><u>Well?</u>"


def _layout(kwargs_changed: bool = False) -> PromptLayout:
    parts = [SYSTEM + TOOLS, USER1, ASSIST, USER2]
    prefixes = ["".join(parts[:i]) for i in range(len(parts) + 1)]
    spans = spans_from_renders(prefixes)
    text = prefixes[-1]
    img_start = text.index("<img>")
    messages = (
        MessageSpan(0, "system", spans[0]),
        MessageSpan(1, "user", spans[1]),
        MessageSpan(2, "assistant", spans[2], images=(Span(img_start, img_start + 15),)),
        MessageSpan(3, "user", spans[3]),
    )
    tools = Span(len(SYSTEM), len(SYSTEM) + len(TOOLS))
    return PromptLayout(text, messages, tools=tools, kwargs_changed=kwargs_changed)


def test_changed_system_prompt_names_message_0_and_offset() -> None:
    layout = _layout()
    offset = layout.text.index("2026")
    report = miss_report(layout, offset, source="slot", cached_tokens=7, prompt_tokens=40)
    miss = report["miss"]
    assert isinstance(miss, dict)
    assert miss["message_index"] == 0 and miss["role"] == "system"
    assert miss["offset"] == SYSTEM.index("2026")
    assert miss["cause"] == "system prompt changed"
    assert "cached" not in miss and miss["prompt"].startswith("2026")
    assert report["source"] == "slot"


def test_reordered_tools() -> None:
    layout = _layout()
    offset = layout.text.index("get_weather")
    point = locate(layout, offset)
    assert point.message_index == 0 and point.offset == len(SYSTEM) + len("<tools>[")
    assert likely_cause(point, layout) == "tool list or order changed"


def test_edited_earlier_message() -> None:
    layout = _layout()
    offset = layout.text.index("there")
    point = locate(layout, offset)
    assert (point.message_index, point.offset) == (1, USER1.index("there"))
    assert likely_cause(point, layout) == "history edited"


def test_changed_image() -> None:
    layout = _layout()
    offset = layout.text.index("@@")
    point = locate(layout, offset)
    assert (point.message_index, point.offset) == (2, ASSIST.index("@@"))
    assert likely_cause(point, layout) == "an image changed"


def test_changed_template_kwargs() -> None:
    layout = _layout(kwargs_changed=True)
    offset = layout.text.index("Paris")
    assert likely_cause(locate(layout, offset), layout) == "template kwargs changed"


def test_text_outside_messages_is_the_template() -> None:
    layout = PromptLayout("<bos>" + USER1, (MessageSpan(0, "user", Span(5, 5 + len(USER1))),))
    point = locate(layout, 2)
    assert point.message_index is None and point.offset == 2
    assert likely_cause(point, layout) == "template kwargs changed"


def test_new_turn_is_no_miss() -> None:
    layout = _layout()
    offset = layout.text.index("Weather")
    point = locate(layout, offset)
    assert point.message_index == 3
    assert likely_cause(point, layout) is None


@pytest.mark.parametrize("rule", CAUSE_RULES)
def test_every_rule_is_reachable(rule: object) -> None:
    """Each rule decides at least one of the cases above (no dead row in the table)."""
    layout, kw = _layout(), _layout(kwargs_changed=True)
    cases = [
        (layout, layout.text.index("2026")),
        (layout, layout.text.index("get_weather")),
        (layout, layout.text.index("there")),
        (layout, layout.text.index("@@")),
        (kw, kw.text.index("Paris")),
    ]
    bare = PromptLayout("<bos>" + USER1, (MessageSpan(0, "user", Span(5, 5 + len(USER1))),))
    cases.append((bare, 2))
    mixed = message_layout(MIXED_TEXT, MIXED)
    cases.append((mixed, MIXED_TEXT.rindex(MEDIA)))
    assert any(likely_cause(locate(lay, off), lay) == rule[1] for lay, off in cases)  # type: ignore[index]


def test_a_span_holds_its_start_and_not_its_end() -> None:
    span = Span(3, 5)
    assert [o for o in range(8) if o in span] == [3, 4]
    assert 3.0 not in span and "3" not in span  # offsets are ints
    assert 0 not in Span(0, 0)  # an empty message holds nothing


def test_a_new_turn_from_its_first_character_is_no_miss() -> None:
    """The prompt leaving the cache exactly where the new message starts (where the last
    cached message ends) is in the new message: a new turn, not an edited history."""
    layout = _layout()
    boundary = layout.messages[3].span.start
    assert boundary == layout.messages[2].span.end
    point = locate(layout, boundary)
    assert (point.message_index, point.offset) == (3, 0)
    assert likely_cause(point, layout) is None
    # one character earlier is the end of the earlier message: its history was edited
    before = locate(layout, boundary - 1)
    assert before.message_index == 2 and likely_cause(before, layout) == "history edited"


def test_a_changed_developer_message_is_a_changed_system_prompt() -> None:
    """OpenAI's "developer" role is the system prompt of reasoning models."""
    layout = _layout()
    developer = PromptLayout(
        layout.text,
        (MessageSpan(0, "developer", layout.messages[0].span), *layout.messages[1:]),
    )
    point = locate(developer, developer.text.index("2026"))
    assert point.role == "developer"
    assert likely_cause(point, developer) == "system prompt changed"


def test_each_media_placeholder_is_named_by_its_kind() -> None:
    """Images and audio clips render as mtmd's one marker; the parts' order says which
    marker is which, so a changed clip is not reported as a changed image."""
    assert media_kinds(MIXED) == ["image", "audio"]
    layout = message_layout(MIXED_TEXT, MIXED)
    image, clip = MIXED_TEXT.index(MEDIA), MIXED_TEXT.rindex(MEDIA)
    assert layout.messages[1].images == (Span(image, image + len(MEDIA)),)
    assert layout.messages[1].audio == (Span(clip, clip + len(MEDIA)),)
    assert likely_cause(locate(layout, image), layout) == "an image changed"
    assert likely_cause(locate(layout, clip), layout) == "an audio clip changed"


@pytest.mark.parametrize(("at", "cause"), [(1, "an image changed"), (4, "an audio clip changed")])
def test_a_miss_at_a_media_position_names_its_kind(at: int, cause: str) -> None:
    """At the token level the miss lands on a media item's first position; the items
    before it, counted by their first positions, say which part it is."""
    pieces = {1: b"<s>Listen.</s><u>Look\n", 2: b"\n", 3: b"\nand hear</u><u>Well?</u>"}
    tokens = [1, ("media", "png", 0), ("media", "png", 1), 2, ("media", "wav", 0), 3]
    miss = explain_miss(MIXED_TEXT, tokens, at, lambda t: pieces[t], MIXED)
    assert (miss["cause"], miss["message_index"]) == (cause, 1)
