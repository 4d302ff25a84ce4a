"""The Hermes / Qwen 2.5 tool-call prompt syntax: the one place it is written.

Tools described in the system prompt (:data:`TOOL_SYSTEM_PROMPT`), and tool calls and
results as ``<tool_call>`` / ``<tool_response>`` text, for templates that cannot
render them natively; the built-in templates (:mod:`.builtin_templates`) write the same text.
It sits with the templates rather than the formats because the template's own
alternation fallback (:class:`~.chat_template.ChatTemplate`) and the built-ins use it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_SYSTEM_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
"""Hermes/Qwen 2.5 tool instructions; ``{tools}`` is replaced by one JSON tool per line.

Used (through :func:`inject_tool_prompt`) when the model's template cannot render
``tools`` itself, and by the built-in templates, so both produce the same text.
"""


def tool_prompt(tools: Sequence[Mapping[str, Any]], instruction: bool = True) -> str:
    """:data:`TOOL_SYSTEM_PROMPT` filled with ``tools`` (OpenAI tool dicts); without
    ``instruction``, only the tools (the model calls them in its own syntax)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = TOOL_SYSTEM_PROMPT.replace("{tools}", lines)
    return text if instruction else text[: text.index("</tools>") + len("</tools>")]


def prepend_text(content: Any, text: str, sep: str = "\n\n") -> Any:
    """``text`` + ``sep`` + content, for string or parts content."""
    if isinstance(content, list):
        return [{"type": "text", "text": text + sep}, *content]
    if content is None or content == "":
        return text
    return f"{text}{sep}{content}"


def inject_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], instruction: bool = True
) -> list[dict[str, Any]]:
    """Describe ``tools`` in the system prompt, for templates without tool support.

    Prepended to a leading system message, or added as one; inputs are not mutated.
    """
    prompt = tool_prompt(tools, instruction)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = prepend_text(out[0].get("content"), prompt)
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _tool_call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    body = json.dumps(
        {"name": fn.get("name"), "arguments": args if args is not None else {}}, ensure_ascii=False
    )
    return f"<tool_call>\n{body}\n</tool_call>"


def append_text(content: Any, text: str) -> Any:
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return f"{content}{text}" if content else text


def flatten_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rewrite tool calls and results as Hermes text, for templates that cannot render them.

    Assistant ``tool_calls`` become ``<tool_call>`` blocks appended to the content;
    runs of ``tool`` messages become one user message of ``<tool_response>`` blocks
    (one message keeps templates that insist on alternating roles working).
    """
    out: list[dict[str, Any]] = []
    prev_tool = False
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            new = {k: v for k, v in m.items() if k != "tool_calls"}
            calls = "\n".join(_tool_call_text(c) for c in m["tool_calls"])
            content = new.get("content")
            new["content"] = append_text(content, ("\n" if content else "") + calls)
            out.append(new)
            prev_tool = False
        elif role == "tool":
            content = m.get("content")
            if isinstance(content, list):
                block: Any = [
                    {"type": "text", "text": "<tool_response>\n"},
                    *content,
                    {"type": "text", "text": "\n</tool_response>"},
                ]
            else:
                block = (
                    f"<tool_response>\n{content if content is not None else ''}\n</tool_response>"
                )
            if prev_tool:
                last = out[-1]
                if isinstance(block, list) or isinstance(last["content"], list):
                    head = last["content"]
                    head = head if isinstance(head, list) else [{"type": "text", "text": head}]
                    tail = block if isinstance(block, list) else [{"type": "text", "text": block}]
                    last["content"] = [*head, {"type": "text", "text": "\n"}, *tail]
                else:
                    last["content"] = f"{last['content']}\n{block}"
            else:
                out.append({"role": "user", "content": block})
            prev_tool = True
        else:
            out.append(dict(m))
            prev_tool = False
    return out
