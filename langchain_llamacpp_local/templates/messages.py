"""LangChain messages as the Hugging Face message dicts chat templates read, as pure
functions (content blocks, tool calls, tool results)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
    convert_to_messages,
)

_TEXT_BLOCKS = frozenset({"text"})
_IMAGE_BLOCKS = frozenset({"image", "image_url"})
_AUDIO_BLOCKS = frozenset({"audio", "input_audio"})
# Represented elsewhere (tool calls by ``tool_calls``) or not replayed (reasoning).
_SKIPPED_BLOCKS = frozenset(
    {
        "tool_use",
        "tool_call",
        "tool_call_chunk",
        "invalid_tool_call",
        "reasoning",
        "thinking",
        "redacted_thinking",
    }
)
_CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def _convert_content(content: Any, index: int) -> str | list[dict[str, Any]]:
    """LangChain content → a string, or text/image/audio parts when media are present."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message {index}: unsupported content of type {type(content).__name__}")
    parts: list[dict[str, Any]] = []
    has_image = False
    for block in content:
        if isinstance(block, str):
            parts.append({"type": "text", "text": block})
            continue
        btype = block.get("type") if isinstance(block, dict) else None
        if btype in _TEXT_BLOCKS:
            parts.append({"type": "text", "text": str(block.get("text") or "")})
        elif btype in _IMAGE_BLOCKS:
            parts.append({"type": "image", "image": block})
            has_image = True
        elif btype in _AUDIO_BLOCKS:
            parts.append({"type": "audio", "audio": block})
            has_image = True
        elif btype in _SKIPPED_BLOCKS:
            continue
        else:
            raise ValueError(
                f"message {index}: unsupported content block type {btype!r} "
                "(supported: text, image, image_url, audio, input_audio)"
            )
    if has_image:
        return parts
    return "\n".join(p["text"] for p in parts)


def _parse_args(raw: Any) -> Any:
    """Arguments of an invalid tool call: a dict when they parse, else the raw text."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return raw
        return parsed if isinstance(parsed, dict) else raw
    return raw if raw is not None else {}


def _ai_tool_calls(msg: AIMessage) -> list[dict[str, Any]]:
    calls = [
        {
            "id": tc.get("id") or "",
            "type": "function",
            "function": {"name": tc["name"], "arguments": dict(tc.get("args") or {})},
        }
        for tc in msg.tool_calls
    ]
    # Replayed so the ToolMessage answering them still has a call to refer to.
    calls += [
        {
            "id": itc.get("id") or "",
            "type": "function",
            "function": {"name": itc["name"], "arguments": _parse_args(itc.get("args"))},
        }
        for itc in msg.invalid_tool_calls
        if itc.get("name")
    ]
    return calls


def _error_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Mark a failed tool result so the model can tell it apart from a real answer."""
    if isinstance(content, str):
        return content if content.startswith("Error") else f"Error: {content}"
    return [{"type": "text", "text": "Error: "}, *content]


def convert_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Convert LangChain messages into the Hugging Face dicts chat templates expect.

    Raises ``ValueError`` for unknown roles and content blocks rather than dropping
    them silently: a prompt missing part of the conversation is worse than an error.
    """
    out: list[dict[str, Any]] = []
    for index, msg in enumerate(messages):
        if not isinstance(msg, BaseMessage):
            msg = convert_to_messages([msg])[0]
        content = _convert_content(msg.content, index)
        entry: dict[str, Any]
        if isinstance(msg, SystemMessage):
            entry = {"role": "system", "content": content}
        elif isinstance(msg, HumanMessage):
            entry = {"role": "user", "content": content}
        elif isinstance(msg, AIMessage):
            entry = {"role": "assistant", "content": content}
            calls = _ai_tool_calls(msg)
            if calls:
                entry["tool_calls"] = calls
            reasoning = msg.additional_kwargs.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                entry["reasoning_content"] = reasoning
        elif isinstance(msg, ToolMessage):
            if msg.status == "error":
                content = _error_content(content)
            entry = {"role": "tool", "content": content, "tool_call_id": msg.tool_call_id}
        elif isinstance(msg, FunctionMessage):
            entry = {"role": "tool", "content": content}
        elif isinstance(msg, ChatMessage):
            role = _CHAT_ROLES.get(msg.role)
            if role is None:
                raise ValueError(
                    f"message {index}: unsupported ChatMessage role {msg.role!r} "
                    f"(supported: {', '.join(_CHAT_ROLES)})"
                )
            entry = {"role": role, "content": content}
        else:
            raise ValueError(f"message {index}: unsupported message type {msg.type!r}")
        if msg.name:
            entry["name"] = msg.name
        out.append(entry)
    return out
