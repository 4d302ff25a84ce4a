"""A changed image in an earlier message is named as the cause of a cache miss."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.messages.content import create_image_block
from PIL import Image

from langchain_llamacpp_local import ChatLlamaCpp
from tests.compare import GREEDY
from tests.gguf_models import write_tiny_mmproj


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="PNG")
    return buf.getvalue()


def _convo(color: tuple[int, int, int], turns: int) -> list[BaseMessage]:
    image = create_image_block(base64=base64.b64encode(_png(color)).decode(), mime_type="image/png")
    msgs: list[BaseMessage] = [
        HumanMessage(content_blocks=[{"type": "text", "text": "Look at this: "}, image])
    ]
    for i in range(turns):
        msgs += [AIMessage(f"answer {i}"), HumanMessage(f"question {i}")]
    return msgs


def test_changed_image_is_named(tiny_llama: str, models_dir: Path) -> None:
    mmproj = str(write_tiny_mmproj(models_dir / "tiny-mmproj-report.gguf", text_n_embd=64))
    settings: dict[str, Any] = {**GREEDY, "max_tokens": 4}
    llm = ChatLlamaCpp(model_path=tiny_llama, mmproj_path=mmproj, n_slots=1, **settings)
    llm.invoke(_convo((255, 0, 0), 1))
    report = llm.invoke(_convo((0, 0, 255), 2)).response_metadata["cache"]
    assert report["missed"] is True
    miss = report["miss"]
    assert miss["cause"] == "an image changed"
    assert miss["message_index"] == 0 and miss["role"] == "user"
    assert miss["offset"] == len("Look at this: ") + 1  # after the text part and its "\n"
