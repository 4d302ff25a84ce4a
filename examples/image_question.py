"""Ask questions about an image with a vision model (text GGUF + mmproj GGUF).

Run: python examples/image_question.py MODEL.gguf MMPROJ.gguf IMAGE.png

The follow-up question reuses the cached image: only the new text is decoded
(see the cache_read counts printed per turn).
"""

from __future__ import annotations

import base64
import mimetypes
import sys
from pathlib import Path

from _demo import max_tokens
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage

from langchain_llamacpp_local import ChatLlamaCpp


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    model, mmproj, image = sys.argv[1:]
    llm = ChatLlamaCpp(
        model_path=model, mmproj_path=mmproj, temperature=0, max_tokens=max_tokens(128)
    )
    data = base64.b64encode(Path(image).read_bytes()).decode()
    mime = mimetypes.guess_type(image)[0] or "image/png"
    history: list[BaseMessage] = [
        HumanMessage(
            content=[
                {"type": "text", "text": "Describe this picture in one sentence."},
                {"type": "image", "base64": data, "mime_type": mime},
            ]
        )
    ]
    for follow_up in ("What colours stand out?", None):
        reply = llm.invoke(history)
        usage = reply.usage_metadata or {}
        print(f"assistant: {reply.content}")
        print(
            f"  (prompt {usage.get('input_tokens')} tokens, "
            f"{usage.get('input_token_details', {}).get('cache_read')} from the cache)"
        )
        if follow_up is None:
            break
        history += [AIMessage(reply.content), HumanMessage(follow_up)]
        print(f"user: {follow_up}")


if __name__ == "__main__":
    main()
