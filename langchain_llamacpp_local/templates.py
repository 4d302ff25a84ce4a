"""Chat templates and LangChain message conversion, as pure functions.

GGUF files carry Hugging Face style Jinja chat templates. They are untrusted
code from a downloaded file, so they are compiled in Jinja's immutable sandbox
(the same environment ``transformers`` uses) and every failure, sandbox
violations included, surfaces as :class:`ChatTemplateError` naming where the
template came from. Models without a usable template fall back to lenient
built-in templates that accept anything LangChain sends (several system
messages, consecutive turns of one role, tool calls and tool results).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

from jinja2 import TemplateError, meta, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
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

__all__ = [
    "BUILTIN_TEMPLATES",
    "TOOL_SYSTEM_PROMPT",
    "ChatTemplate",
    "ChatTemplateError",
    "convert_messages",
    "flatten_tool_messages",
    "inject_tool_prompt",
    "select_template",
    "tool_prompt",
]

logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render (includes sandbox violations);
    the message names the template origin."""


# --------------------------------------------------------------------------- messages

_TEXT_BLOCKS = frozenset({"text"})
_IMAGE_BLOCKS = frozenset({"image", "image_url"})
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
    """LangChain content → a string, or text/image parts when images are present."""
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
        elif btype in _SKIPPED_BLOCKS:
            continue
        else:
            raise ValueError(
                f"message {index}: unsupported content block type {btype!r} "
                "(supported: text, image, image_url)"
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


# --------------------------------------------------------------------------- tool prompt

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


def tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """:data:`TOOL_SYSTEM_PROMPT` filled with ``tools`` (OpenAI tool dicts)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOL_SYSTEM_PROMPT.replace("{tools}", lines)


def _prepend_text(content: Any, text: str, sep: str = "\n\n") -> Any:
    """``text`` + ``sep`` + content, for string or parts content."""
    if isinstance(content, list):
        return [{"type": "text", "text": text + sep}, *content]
    if content is None or content == "":
        return text
    return f"{text}{sep}{content}"


def inject_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Describe ``tools`` in the system prompt, for templates without tool support.

    Prepended to a leading system message, or added as one; inputs are not mutated.
    """
    prompt = tool_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = _prepend_text(out[0].get("content"), prompt)
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


def _append_text(content: Any, text: str) -> Any:
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
            new["content"] = _append_text(content, ("\n" if content else "") + calls)
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


# --------------------------------------------------------------------------- sandbox


class _TemplateRaised(Exception):
    """``raise_exception`` was called by the template (wrapped with the origin later)."""


class _GenerationTagExtension(Extension):
    """Accept ``{% generation %}…{% endgeneration %}`` (HF assistant-mask markers),
    rendering the body unchanged: only training code cares about the masks."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Like transformers' filter: Jinja's own HTML-escapes ``<``/``&``, corrupting tool JSON."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationTagExtension],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_env()

# A template concatenating ``arguments`` as a string (``... + tool['function']['arguments'] + ...``).
_ARGS_CONCAT = re.compile(
    r"""arguments(?:['"]\])?\s*[+~]|[+~]\s*[\w.]*(?:\[['"]\w+['"]\])*(?:\.|\[['"])arguments\b(?!['"]?\]?\s*\|)"""
)
_PROBE = "\x00system-probe-7f3a\x00"


class ChatTemplate:
    """A compiled, sandboxed chat template.

    ``origin`` (``"gguf:tokenizer.chat_template"``, ``"builtin:gemma"``,
    ``"override"``, ...) is put in every error so a bad template is easy to trace.
    """

    def __init__(
        self, source: str, *, origin: str = "custom", bos_token: str = "", eos_token: str = ""
    ) -> None:
        self.source = source
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._ast = _ENV.parse(source)
            self._template = _ENV.from_string(self._ast)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template {origin!r} failed to compile: {exc}") from exc
        self._variables = meta.find_undeclared_variables(self._ast)

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r})"

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads ``tools`` (else the caller injects a tool prompt)."""
        return "tools" in self._variables

    @cached_property
    def tool_call_args_as_dict(self) -> bool:
        """False when the template concatenates ``arguments`` as a string (e.g. DeepSeek V3)."""
        return _ARGS_CONCAT.search(self.source) is None

    @cached_property
    def supports_system_role(self) -> bool:
        """Probe: a template that raises on, or drops, a system message has no system role.

        If the template fails even without a system message the probe is inconclusive
        and the messages are passed through untouched.
        """
        user = {"role": "user", "content": "Hi"}
        try:
            text = self._render([{"role": "system", "content": _PROBE}, user], None, True, {})
        except ChatTemplateError:
            try:
                self._render([user], None, True, {})
            except ChatTemplateError:
                return True
            return False
        return _PROBE in text

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (HF dicts) to prompt text; extra kwargs become template variables.

        Templates without a system role get system text merged into the next user
        message; every failure is a :class:`ChatTemplateError`.
        """
        if any(m.get("role") == "system" for m in messages) and not self.supports_system_role:
            messages = _merge_system(messages)
        if not self.tool_call_args_as_dict:
            messages = _stringify_args(messages)
        return self._render(messages, tools, add_generation_prompt, kwargs)

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
    ) -> str:
        now = datetime.now()
        variables: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y"),
        }
        if tools is not None:
            variables["tools"] = tools
        variables.update(kwargs)
        try:
            return self._template.render(**variables)
        except _TemplateRaised as exc:
            raise ChatTemplateError(f"chat template {self.origin!r}: {exc}") from None
        except RecursionError as exc:
            raise ChatTemplateError(f"chat template {self.origin!r} recursed too deeply") from exc
        except Exception as exc:  # template code is untrusted: any failure is the template's
            raise ChatTemplateError(
                f"chat template {self.origin!r} failed to render: {type(exc).__name__}: {exc}"
            ) from exc


def _merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fold each system message into the next user message (``system\\n\\nuser``);
    one with no user message after it becomes a user message."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for m in messages:
        role = m.get("role")
        if role == "system":
            pending.append(_text_of(m.get("content")))
        elif role == "user" and pending:
            new = dict(m)
            new["content"] = _prepend_text(m.get("content"), "\n\n".join(pending))
            out.append(new)
            pending = []
        else:
            out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) if isinstance(p, dict) else str(p)
            for p in content
            if not isinstance(p, dict) or p.get("type") == "text"
        )
    return "" if content is None else str(content)


def _stringify_args(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments as JSON text, for templates that concatenate them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            new_calls = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and not isinstance(fn.get("arguments"), str):
                    args = json.dumps(fn.get("arguments") or {}, ensure_ascii=False)
                    c = {**c, "function": {**fn, "arguments": args}}
                new_calls.append(c)
            m = {**m, "tool_calls": new_calls}
        out.append(m)
    return out


# --------------------------------------------------------------------------- built-ins

_HEAD, _TAIL = TOOL_SYSTEM_PROMPT.split("\n{tools}\n")

# Shared macros: content (string or text/image parts), Hermes tool calls and tool prompt.
_MACROS = r"""{%- macro render_content(content, image_token) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is string -%}{{ part }}
{%- elif part is mapping and part.type == 'text' -%}{{ part.text }}
{%- elif part is mapping and part.type in ['image', 'image_url'] -%}{{ image_token }}
{%- endif -%}
{%- endfor -%}
{%- elif content is defined and content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- macro render_tool_calls(message) -%}
{%- for tc in message.tool_calls -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{%- if not loop.first -%}{{ '\n' }}{%- endif -%}
{{- '<tool_call>\n{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' -}}
{%- if fn.arguments is string -%}{{ fn.arguments }}
{%- elif fn.arguments is defined and fn.arguments is not none -%}{{ fn.arguments | tojson }}
{%- else -%}{{ '{}' }}
{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endmacro -%}
{%- macro render_assistant(message, image_token) -%}
{%- set text = render_content(message.content, image_token) -%}
{{- text -}}
{%- if message.tool_calls -%}
{%- if text -%}{{ '\n' }}{%- endif -%}
{{- render_tool_calls(message) -}}
{%- endif -%}
{%- endmacro -%}
{%- macro tool_prompt(tools) -%}
{{- @HEAD@ -}}
{%- for tool in tools -%}{{ '\n' }}{{ tool | tojson }}{%- endfor -%}
{{- @TAIL@ -}}
{%- endmacro -%}
{%- macro tool_response(message, image_token) -%}
{{- '<tool_response>\n' ~ render_content(message.content, image_token) ~ '\n</tool_response>' -}}
{%- endmacro -%}
""".replace("@HEAD@", json.dumps(_HEAD)).replace("@TAIL@", json.dumps("\n" + _TAIL))

# Gemma 3: no system role (leading system text and the tool prompt open the first
# user turn, later system messages become user turns), tool results as user turns.
_GEMMA = r"""{{- bos_token -}}
{%- set ns = namespace(prefix='', leading=true) -%}
{%- for message in messages -%}
{%- if message.role == 'system' and ns.leading -%}
{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ (render_content(message.content, '<start_of_image>') | trim) -%}
{%- else -%}
{%- if ns.leading -%}
{%- set ns.leading = false -%}
{%- if tools -%}{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ tool_prompt(tools) -%}{%- endif -%}
{%- if ns.prefix and message.role != 'user' -%}
{{- '<start_of_turn>user\n' ~ ns.prefix ~ '<end_of_turn>\n' -}}
{%- set ns.prefix = '' -%}
{%- endif -%}
{%- endif -%}
{%- if message.role == 'user' -%}
{{- '<start_of_turn>user\n' ~ (ns.prefix ~ '\n\n' if ns.prefix else '') ~ (render_content(message.content, '<start_of_image>') | trim) ~ '<end_of_turn>\n' -}}
{%- set ns.prefix = '' -%}
{%- elif message.role == 'assistant' -%}
{{- '<start_of_turn>model\n' ~ (render_assistant(message, '<start_of_image>') | trim) ~ '<end_of_turn>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<start_of_turn>user\n' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<start_of_image>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<end_of_turn>\n' -}}{%- endif -%}
{%- else -%}
{{- '<start_of_turn>user\n' ~ (render_content(message.content, '<start_of_image>') | trim) ~ '<end_of_turn>\n' -}}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if ns.leading and tools -%}{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ tool_prompt(tools) -%}{%- endif -%}
{%- if ns.prefix -%}{{- '<start_of_turn>user\n' ~ ns.prefix ~ '<end_of_turn>\n' -}}{%- endif -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

# ChatML / Qwen 2.5: tool prompt after the first system message (or as its own).
_CHATML = r"""{%- if tools and (not messages or messages[0].role != 'system') -%}
{{- '<|im_start|>system\n' ~ tool_prompt(tools) ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{{- '<|im_start|>system\n' ~ render_content(message.content, '<__media__>') -}}
{%- if loop.first and tools -%}{{- '\n\n' ~ tool_prompt(tools) -}}{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' ~ render_assistant(message, '<__media__>') ~ '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user\n' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<__media__>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- else -%}
{{- '<|im_start|>' ~ message.role ~ '\n' ~ render_content(message.content, '<__media__>') ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

_LLAMA3 = r"""{{- bos_token -}}
{%- if tools and (not messages or messages[0].role != 'system') -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' ~ tool_prompt(tools) ~ '<|eot_id|>' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' ~ (render_content(message.content, '<__media__>') | trim) -}}
{%- if loop.first and tools -%}{{- '\n\n' ~ tool_prompt(tools) -}}{%- endif -%}
{{- '<|eot_id|>' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' ~ (render_assistant(message, '<__media__>') | trim) ~ '<|eot_id|>' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<__media__>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|eot_id|>' -}}{%- endif -%}
{%- else -%}
{{- '<|start_header_id|>' ~ message.role ~ '<|end_header_id|>\n\n' ~ (render_content(message.content, '<__media__>') | trim) ~ '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

# Mistral [INST] format: like Gemma, no system role.
_MISTRAL = r"""{{- bos_token -}}
{%- set ns = namespace(prefix='', leading=true) -%}
{%- for message in messages -%}
{%- if message.role == 'system' and ns.leading -%}
{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ render_content(message.content, '<__media__>') -%}
{%- else -%}
{%- if ns.leading -%}
{%- set ns.leading = false -%}
{%- if tools -%}{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ tool_prompt(tools) -%}{%- endif -%}
{%- if ns.prefix and message.role != 'user' -%}
{{- '[INST] ' ~ ns.prefix ~ ' [/INST]' -}}
{%- set ns.prefix = '' -%}
{%- endif -%}
{%- endif -%}
{%- if message.role == 'assistant' -%}
{{- ' ' ~ render_assistant(message, '<__media__>') ~ eos_token -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '[INST] ' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<__media__>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- ' [/INST]' -}}{%- endif -%}
{%- else -%}
{{- '[INST] ' ~ (ns.prefix ~ '\n\n' if ns.prefix else '') ~ render_content(message.content, '<__media__>') ~ ' [/INST]' -}}
{%- set ns.prefix = '' -%}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if ns.leading and tools -%}{%- set ns.prefix = ns.prefix ~ ('\n\n' if ns.prefix else '') ~ tool_prompt(tools) -%}{%- endif -%}
{%- if ns.prefix -%}{{- '[INST] ' ~ ns.prefix ~ ' [/INST]' -}}{%- endif -%}
"""

_PHI3 = r"""{%- if tools and (not messages or messages[0].role != 'system') -%}
{{- '<|system|>\n' ~ tool_prompt(tools) ~ '<|end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
{{- '<|system|>\n' ~ render_content(message.content, '<__media__>') -}}
{%- if loop.first and tools -%}{{- '\n\n' ~ tool_prompt(tools) -}}{%- endif -%}
{{- '<|end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|assistant|>\n' ~ render_assistant(message, '<__media__>') ~ '<|end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|user|>\n' -}}{%- else -%}{{- '\n' -}}{%- endif -%}
{{- tool_response(message, '<__media__>') -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|end|>\n' -}}{%- endif -%}
{%- else -%}
{{- '<|user|>\n' ~ render_content(message.content, '<__media__>') ~ '<|end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}
"""

BUILTIN_TEMPLATES: dict[str, str] = {
    "gemma": _MACROS + _GEMMA,
    "chatml": _MACROS + _CHATML,
    "llama3": _MACROS + _LLAMA3,
    "mistral": _MACROS + _MISTRAL,
    "phi3": _MACROS + _PHI3,
}
"""Lenient fallback templates (Hermes-style tools), by name; usable as overrides."""


# --------------------------------------------------------------------------- selection


def _builtin_for(metadata: Mapping[str, str]) -> str:
    """The built-in template matching a GGUF's architecture and name."""
    arch = str(metadata.get("general.architecture") or "").lower()
    name = str(metadata.get("general.name") or "").lower()
    if arch.startswith("gemma"):
        return "gemma"
    if arch.startswith("mistral") or "mistral" in name or "mixtral" in name:
        return "mistral"
    if arch == "llama" and any(k in name for k in ("llama-3", "llama3", "llama 3")):
        return "llama3"
    if arch == "phi3":
        return "phi3"
    return "chatml"


def select_template(
    metadata: Mapping[str, str], *, override: str | None = None, with_tools: bool = False
) -> ChatTemplate:
    """Pick and compile the chat template for a model.

    Order: ``override`` (a built-in name, a GGUF named variant such as ``"tool_use"``,
    or Jinja source); the GGUF ``tokenizer.chat_template.tool_use`` when
    ``with_tools``; the GGUF ``tokenizer.chat_template``; a built-in chosen from
    ``general.architecture``/``general.name``. A GGUF template that fails to compile
    is logged and replaced by the built-in, so the model stays usable; a bad
    override raises. ``_bos_token``/``_eos_token`` in ``metadata`` are the special
    token texts (looked up in the vocab by the caller).
    """
    tokens = {
        "bos_token": str(metadata.get("_bos_token") or ""),
        "eos_token": str(metadata.get("_eos_token") or ""),
    }
    if override is not None:
        key = override.strip()
        gguf_key = f"tokenizer.chat_template.{key}"
        if metadata.get(gguf_key):
            return ChatTemplate(str(metadata[gguf_key]), origin=f"gguf:{gguf_key}", **tokens)
        if key.lower() in BUILTIN_TEMPLATES:
            name = key.lower()
            return ChatTemplate(BUILTIN_TEMPLATES[name], origin=f"builtin:{name}", **tokens)
        return ChatTemplate(override, origin="override", **tokens)
    keys = ["tokenizer.chat_template"]
    if with_tools:
        keys.insert(0, "tokenizer.chat_template.tool_use")
    for key in keys:
        source = metadata.get(key)
        if source:
            try:
                return ChatTemplate(str(source), origin=f"gguf:{key}", **tokens)
            except ChatTemplateError as exc:
                logger.warning("%s; falling back to a built-in template", exc)
    name = _builtin_for(metadata)
    return ChatTemplate(BUILTIN_TEMPLATES[name], origin=f"builtin:{name}", **tokens)
