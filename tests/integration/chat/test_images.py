"""Images through a tiny random vision projector (llava-style mlp) on the tiny llama."""

from __future__ import annotations

import base64
import io
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.messages.content import create_image_block
from PIL import Image

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.chat.images import load_image
from langchain_llamacpp_local.chat.prompts import MEDIA_MARKER
from tests.compare import GREEDY, assert_same_greedy, ids
from tests.gguf_models import write_tiny_mmproj
from tests.helpers import worker_of


def _png(color: tuple[int, int, int], size: int = 32) -> bytes:
    img = Image.new("RGB", (size, size), color)
    for x in range(size):  # a little structure so the encoder sees more than a flat colour
        img.putpixel((x, x), (255 - color[0], 255 - color[1], 255 - color[2]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


RED = _png((200, 30, 30))
BLUE = _png((20, 40, 220))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _ask(image: dict[str, Any], text: str = "What is in this picture?") -> list[BaseMessage]:
    return [HumanMessage(content=[{"type": "text", "text": text}, image])]


def _v1(data: bytes) -> dict[str, Any]:
    return {"type": "image", "base64": _b64(data), "mime_type": "image/png"}


@pytest.fixture(scope="module")
def mmproj(models_dir: Path) -> str:
    return str(write_tiny_mmproj(models_dir / "tiny-mmproj.gguf", text_n_embd=64))


@pytest.fixture()
def vlm(tiny_llama: str, mmproj: str) -> ChatLlamaCpp:
    return ChatLlamaCpp(
        model_path=tiny_llama, mmproj_path=mmproj, n_slots=1, max_tokens=12, **GREEDY
    )


def test_profile_reports_image_input_only_with_a_projector(tiny_llama: str, mmproj: str) -> None:
    assert ChatLlamaCpp(model_path=tiny_llama, mmproj_path=mmproj).profile["image_inputs"] is True
    assert ChatLlamaCpp(model_path=tiny_llama).profile["image_inputs"] is False


def test_image_changes_the_answer_and_is_deterministic(vlm: ChatLlamaCpp) -> None:
    red = vlm.invoke(_ask(_v1(RED)), cache_prompt=False)
    red2 = vlm.invoke(_ask(_v1(RED)), cache_prompt=False)
    blue = vlm.invoke(_ask(_v1(BLUE)), cache_prompt=False)
    assert ids(red) == ids(red2)
    assert red.response_metadata["logprobs"]["content"][0]["logprob"] != pytest.approx(
        blue.response_metadata["logprobs"]["content"][0]["logprob"], abs=1e-6
    )
    text_only = vlm.invoke([HumanMessage("What is in this picture?")], cache_prompt=False)
    # the image's tokens count as input tokens
    assert red.usage_metadata["input_tokens"] >= text_only.usage_metadata["input_tokens"] + 16  # type: ignore[index]
    streamed = "".join(str(c.content) for c in vlm.stream(_ask(_v1(RED)), cache_prompt=False))
    assert streamed == red.content


def test_follow_up_reuses_the_image_in_the_cache(vlm: ChatLlamaCpp) -> None:
    turn1 = [*_ask(_v1(RED))]
    first = vlm.invoke(turn1)
    n1 = first.usage_metadata["input_tokens"]  # type: ignore[index]
    turn2 = [*turn1, AIMessage(first.content), HumanMessage("And what colour is it?")]
    second = vlm.invoke(turn2)
    # reuse resumes on the 64-position decode grid (docs/cache.md, "Exactness")
    assert second.usage_metadata["input_token_details"]["cache_read"] >= n1 // 64 * 64  # type: ignore[index]
    assert_same_greedy(second, vlm.invoke(turn2, cache_prompt=False))
    # a different image at the same place diverges there
    vlm.invoke(turn2)
    other = vlm.invoke(
        [*_ask(_v1(BLUE)), AIMessage(first.content), HumanMessage("And what colour is it?")]
    )
    assert other.usage_metadata["input_token_details"]["cache_read"] < n1 - 16  # type: ignore[index]


def test_every_accepted_form_gives_the_same_result(vlm: ChatLlamaCpp, tmp_path: Path) -> None:
    path = tmp_path / "red.png"
    path.write_bytes(RED)
    data_url = "data:image/png;base64," + _b64(RED)
    forms = [
        _v1(RED),
        {"type": "image", "url": data_url},
        {"type": "image_url", "image_url": {"url": data_url}},
        {"type": "image_url", "image_url": data_url},
        {"type": "image", "source_type": "base64", "data": _b64(RED), "mime_type": "image/png"},
        create_image_block(base64=_b64(RED), mime_type="image/png"),
        {"type": "image", "source": {"type": "base64", "data": _b64(RED)}},
    ]
    expected = ids(vlm.invoke(_ask(forms[0]), cache_prompt=False))
    for form in forms[1:]:
        assert ids(vlm.invoke(_ask(form), cache_prompt=False)) == expected, form
    local = vlm.model_copy(update={"allow_local_image_files": True})
    assert (
        ids(local.invoke(_ask({"type": "image", "url": str(path)}), cache_prompt=False)) == expected
    )


def test_refused_forms_have_clear_errors(
    vlm: ChatLlamaCpp, tiny_llama: str, tmp_path: Path
) -> None:
    path = tmp_path / "red.png"
    path.write_bytes(RED)
    with pytest.raises(ValueError, match="(?i)local"):
        vlm.invoke(_ask({"type": "image", "url": str(path)}))
    with pytest.raises(ValueError, match="(?i)remote"):
        vlm.invoke(_ask({"type": "image", "url": "https://example.com/cat.png"}))
    with pytest.raises(ValueError):
        vlm.invoke(_ask({"type": "image", "base64": "not an image", "mime_type": "image/png"}))
    text_only = ChatLlamaCpp(model_path=tiny_llama, n_slots=1, max_tokens=4)
    with pytest.raises(ValueError, match="mmproj_path"):
        text_only.invoke(_ask(_v1(RED)))
    served = vlm.invoke(_ask(_v1(RED)))  # still serving, as a fresh decode does
    assert ids(served) and ids(served) == ids(vlm.invoke(_ask(_v1(RED)), cache_prompt=False))


def test_the_pixels_reach_mtmd_without_a_copy(vlm: ChatLlamaCpp) -> None:
    """The caller's side hands mtmd a pointer to the decoded pixels: a Python copy of a
    large image (108 MB for 6000x6000) holds the GIL all along, stalling every other
    thread, an event loop included. Checked on the traced memory's peak, not on a clock.
    Pixels that do not match the image's size are refused (mtmd would read past their
    end)."""
    big = load_image(_png((10, 200, 10), size=1024))  # 3 MiB of pixels
    vlm.load()
    worker = worker_of(vlm)
    assert worker is not None
    text = f"look: {MEDIA_MARKER} ok"

    tracemalloc.start()
    try:
        worker.engine.tokenize_multimodal(text, [(1024, 1024, big.rgb, big.digest)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(big.rgb) // 4, f"{peak} bytes traced for {len(big.rgb)} bytes of pixels"
    with pytest.raises(ValueError, match="RGB bytes"):
        worker.engine.tokenize_multimodal(text, [(1024, 1024, big.rgb[:-3], "x")])
    served = vlm.invoke(_ask(_v1(RED)))  # still serving, as a fresh decode does
    assert ids(served) and ids(served) == ids(vlm.invoke(_ask(_v1(RED)), cache_prompt=False))
