"""Adapting a request to a template: the tool prompt for a template that does not read
``tools``, tool turns as text for one that does not render them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_llamacpp_local.templates.chat_template import ChatTemplate, merge_adjacent
from langchain_llamacpp_local.templates.hermes_prompt import (
    flatten_tool_messages,
    inject_tool_prompt,
)


def adapt_messages(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and ``tools`` as a template can take them.

    A template that does not read ``tools`` gets the documented Hermes tool prompt in
    the system message; one that does not render ``tool_calls`` gets calls and
    results flattened to Hermes text. Returns the messages and the tools to pass.
    """
    render_tools: list[dict[str, Any]] | None = None
    if tools:
        if template.supports_tools:
            render_tools = list(tools)
        else:
            messages = inject_tool_prompt(messages, list(tools))
    if not template.supports_tool_calls and any(
        m.get("tool_calls") or m.get("role") == "tool" for m in messages
    ):
        messages = flatten_tool_messages(messages)
        if template.requires_alternation:  # tool results next to a user turn (Gemma 2)
            messages = merge_adjacent(messages)
    return messages, render_tools


def render_chat(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render a conversation the way a request is rendered (:func:`adapt_messages` first)."""
    messages, render_tools = adapt_messages(template, messages, tools)
    return template.render(
        messages, tools=render_tools, add_generation_prompt=add_generation_prompt, **kwargs
    )
