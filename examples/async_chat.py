"""Async streaming: two conversations at once on one model, without blocking the event loop.

Run: python examples/async_chat.py [model.gguf]
"""

from __future__ import annotations

import asyncio
import sys

from _demo import default_model, max_tokens

from langchain_llamacpp_local import ChatLlamaCpp


async def ask(llm: ChatLlamaCpp, tag: str, question: str) -> str:
    text = ""
    async for chunk in llm.astream(question):
        text += str(chunk.content)
        print(f"[{tag}] {chunk.content!r}", flush=True)
    return text


async def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    llm = ChatLlamaCpp(model_path=path, temperature=0, max_tokens=max_tokens(32))
    # Both streams run in the same decode batches (continuous batching).
    a, b = await asyncio.gather(
        ask(llm, "a", "Name three rivers in Europe."),
        ask(llm, "b", "Name three mountains in Asia."),
    )
    print("\nA:", a, "\nB:", b)
    # A timeout cancels the generation on the worker, not just the await.
    try:
        await asyncio.wait_for(llm.ainvoke("Write a long essay.", max_tokens=500), timeout=0.5)
    except asyncio.TimeoutError:
        print(
            "\ncancelled after 0.5 s; the model is free again:",
            (await llm.ainvoke("Say OK.", max_tokens=4)).content,
        )


if __name__ == "__main__":
    asyncio.run(main())
