"""Chat templates and LangChain message conversion, as pure functions.

GGUF files carry Hugging Face style Jinja chat templates. They are untrusted
code from a downloaded file, so they run in a resource-limited Jinja sandbox
(:mod:`.template_sandbox`) and every failure, sandbox violations and limits
included, surfaces as :class:`ChatTemplateError` naming where the template came
from. Each template's conventions for tool calls (arguments as dict or JSON text,
``content=None``, id form) are found by rendering probe conversations, the way
llama.cpp's capability probe does, so real templates render what llama.cpp and
transformers render. Models without a usable template fall back to lenient
built-in templates that accept anything LangChain sends (several system
messages, consecutive turns of one role, tool calls and tool results).
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import logging
import string
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, meta
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

from langchain_llamacpp_local.errors import ChatTemplateError
from langchain_llamacpp_local.templates.sandbox import (
    DEFAULT_LIMITS,
    RenderLimits,
    TemplateLimitError,
    TemplateRaised,
    budget_remaining,
    compile_template,
    guarded_render,
    make_env,
    request_budget,
)

__all__ = [
    "BUILTIN_TEMPLATES",
    "RenderLimits",
    "TemplateConventions",
    "adapt_messages",
    "render_chat",
    "short_tool_call_id",
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


def tool_prompt(tools: Sequence[Mapping[str, Any]], instruction: bool = True) -> str:
    """:data:`TOOL_SYSTEM_PROMPT` filled with ``tools`` (OpenAI tool dicts); without
    ``instruction``, only the tools (the model calls them in its own syntax)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = TOOL_SYSTEM_PROMPT.replace("{tools}", lines)
    return text if instruction else text[: text.index("</tools>") + len("</tools>")]


def _prepend_text(content: Any, text: str, sep: str = "\n\n") -> Any:
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


# --------------------------------------------------------------------------- compiled templates

_ENV = make_env()

# Compiled templates and probe results, per template source: a template is compiled and
# probed once per process, not per model load or per request.
_CACHE_SIZE = 64
_cache_lock = threading.Lock()
_compiled: OrderedDict[str, tuple[Any, Any, frozenset[str]]] = OrderedDict()
_probes: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()


def _cached(cache: OrderedDict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    with _cache_lock:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    value = make()
    with _cache_lock:
        cache[key] = value
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    return value


def _compile(source: str, limits: RenderLimits) -> tuple[Any, Any, frozenset[str]]:
    template, ast = compile_template(_ENV, source, limits)
    return template, ast, frozenset(meta.find_undeclared_variables(ast))


_PROBE = "\x00system-probe-7f3a\x00"

# The probe conversation that finds a template's conventions (llama.cpp's caps probe).
_PROBE_NAME = "probe_tool_fn"
_PROBE_VALUE = "probe-value-7f3a"
_PROBE_RESULT = "probe-result-output"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _PROBE_NAME,
            "description": "Probe tool",
            "parameters": {
                "type": "object",
                "properties": {"probe_arg": {"type": "string", "description": "An argument"}},
                "required": ["probe_arg"],
            },
        },
    }
]
_PROBE_ID = "call_0f3a9c2e7b1d4a6f8e0c5b2d"

#: Tools llama.cpp passes as ``builtin_tools`` (Llama 3.1's built-in tool names).
_BUILTIN_TOOL_NAMES = ("wolfram_alpha", "web_search", "brave_search", "python", "code_interpreter")


@dataclass(frozen=True)
class TemplateConventions:
    """How a template wants assistant tool calls, found by rendering a probe conversation.

    ``args_as_string``: arguments as JSON text (templates that concatenate them)
    rather than a dict; ``null_content``: ``content=None`` for an assistant message that
    only calls tools (DeepSeek-R1-Distill tests ``content is none``); ``short_ids``:
    9-character alphanumeric tool-call ids (Mistral templates check the length).
    """

    args_as_string: bool = False
    null_content: bool = False
    short_ids: bool = False


_ID_ALPHABET = string.ascii_letters + string.digits


def short_tool_call_id(call_id: str) -> str:
    """A 9-character alphanumeric id (Mistral's form), the same for the same input.

    Stable so the same conversation renders to the same prompt every turn (the
    prompt cache depends on it); ids already in that form are kept.
    """
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode("utf-8")).digest()[:8], "big")
    chars = []
    for _ in range(9):
        n, r = divmod(n, 62)
        chars.append(_ID_ALPHABET[r])
    return "".join(chars)


class ChatTemplate:
    """A compiled, sandboxed chat template.

    ``origin`` (``"gguf:tokenizer.chat_template"``, ``"builtin:gemma"``,
    ``"override"``, ...) is put in every error so a bad template is easy to trace.
    ``limits`` bounds each render (time, output size, loop and operator caps).
    """

    def __init__(
        self,
        source: str,
        *,
        origin: str = "custom",
        bos_token: str = "",
        eos_token: str = "",
        limits: RenderLimits = DEFAULT_LIMITS,
    ) -> None:
        self.source = source
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.limits = limits
        try:
            self._template, self._ast, self._variables = _cached(
                _compiled, source, lambda: _compile(source, limits)
            )
        except TemplateLimitError as exc:
            raise ChatTemplateError(
                f"chat template {origin!r} failed to compile: {exc}", limit=True
            ) from None
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template {origin!r} failed to compile: {exc}") from exc
        except RecursionError:
            raise ChatTemplateError(
                f"chat template {origin!r} failed to compile: nested too deeply"
            ) from None
        except (MemoryError, ValueError, TypeError) as exc:
            raise ChatTemplateError(
                f"chat template {origin!r} failed to compile: {type(exc).__name__}: {exc}"
            ) from None

        self._probed: dict[str, Any] = _cached(
            _probes, (source, bos_token, eos_token, limits), dict
        )

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r})"

    def _probe(self, name: str, compute: Callable[[], Any]) -> Any:
        """A probe's result, computed once per template source (shared by every instance).

        A probe that hits a limit with (nearly) a whole budget to itself is remembered
        as failing, so a runaway template costs one budget, not one per request.
        """
        if name in self._probed:
            value = self._probed[name]
            if isinstance(value, ChatTemplateError):
                raise ChatTemplateError(str(value), limit=True)
            return value
        remaining = budget_remaining()
        try:
            value = compute()
        except ChatTemplateError as exc:
            fresh = remaining is None or remaining >= 0.9 * self.limits.timeout_s
            if exc.limit and fresh and "cancelled" not in str(exc):
                self._probed[name] = exc
            raise
        self._probed[name] = value
        return value

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads ``tools`` (or FireFunction's ``functions``); else the
        caller injects a tool prompt."""
        return "tools" in self._variables or "functions" in self._variables

    @property
    def supports_tool_calls(self) -> bool:
        """Whether the template renders assistant ``tool_calls`` (else they are flattened)."""
        return "tool_calls" in self.source

    @property
    def tool_call_args_as_dict(self) -> bool:
        """False when the template wants ``arguments`` as JSON text (e.g. DeepSeek V3)."""
        return not self.conventions.args_as_string

    @property
    def conventions(self) -> TemplateConventions:
        """Probe the template: render a tool-call conversation in each convention and keep
        the first that shows the call's name, arguments and result best.

        Probing (not reading the source) is what tells ``{{ arguments | tojson }}`` from
        ``'...' + arguments`` or ``arguments.items()``.
        """
        if not self.supports_tool_calls:
            return TemplateConventions()
        return self._probe("conventions", self._find_conventions)

    def _find_conventions(self) -> TemplateConventions:
        best: tuple[tuple[bool, ...], TemplateConventions] | None = None
        for short_ids in (False, True):
            for null_content in (False, True):
                for args_as_string in (False, True):
                    conv = TemplateConventions(args_as_string, null_content, short_ids)
                    score = self._probe_score(conv)
                    if best is None or score > best[0]:
                        best = (score, conv)
        assert best is not None
        logger.debug("chat template %s conventions: %s", self.origin, best[1])
        return best[1]

    def _probe_score(self, conv: TemplateConventions) -> tuple[bool, ...]:
        args: Any = {"probe_arg": _PROBE_VALUE}
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "probe question"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": _PROBE_ID,
                        "type": "function",
                        "function": {"name": _PROBE_NAME, "arguments": args},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": _PROBE_ID,
                "name": _PROBE_NAME,
                "content": _PROBE_RESULT,
            },
            {"role": "assistant", "content": "probe answer"},
            {"role": "user", "content": "probe follow-up"},
        ]
        try:
            text = self._render(_apply_conventions(messages, conv), _PROBE_TOOLS, True, {})
        except ChatTemplateError as exc:
            if exc.limit:  # a runaway template: no point probing it further
                raise
            return (False,)
        args_clean = (
            "probe_arg" in text
            and _PROBE_VALUE in text
            and '\\"probe_arg' not in text
            and "'probe_arg'" not in text
        )
        return (True, _PROBE_NAME in text, args_clean, _PROBE_RESULT in text)

    @property
    def supports_system_role(self) -> bool:
        """Probe: a template that raises on, or drops, a system message has no system role.

        If the template fails even without a system message the probe is inconclusive
        and the messages are passed through untouched.
        """
        return bool(self._probe("supports_system_role", self._probe_system_role))

    def _probe_system_role(self) -> bool:
        user = {"role": "user", "content": "Hi"}
        try:
            text = self._render([{"role": "system", "content": _PROBE}, user], None, True, {})
        except ChatTemplateError as exc:
            if exc.limit:
                raise
            try:
                self._render([user], None, True, {})
            except ChatTemplateError as exc2:
                if exc2.limit:
                    raise
                return True
            return False
        return _PROBE in text

    @property
    def requires_alternation(self) -> bool:
        """Probe: the template rejects two user turns in a row but accepts one."""
        return bool(self._probe("requires_alternation", self._probe_alternation))

    def _probe_alternation(self) -> bool:
        try:
            self._render([{"role": "user", "content": "a"}], None, True, {})
        except ChatTemplateError as exc:
            if exc.limit:
                raise
            return False
        try:
            self._render(
                [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                None,
                True,
                {},
            )
        except ChatTemplateError as exc:
            if exc.limit:
                raise
            return True
        return False

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (HF dicts) to prompt text; extra kwargs become template variables.

        Tool calls and results are passed natively, adapted to the template's
        :attr:`conventions`; templates without a system role get system text merged
        into the next user message; a template that checks role alternation and
        rejects the conversation gets adjacent turns merged (then tool turns
        flattened to text) before its own error is reported. Every failure is a
        :class:`ChatTemplateError`. Probes and renders share one time budget (the
        request's, inside :func:`~.template_sandbox.request_budget`).
        """
        with request_budget(self.limits):
            return self._render_adapted(messages, tools, add_generation_prompt, kwargs)

    def _render_adapted(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> str:
        if any(m.get("role") == "system" for m in messages) and not self.supports_system_role:
            messages = _merge_system(messages)
        has_tools = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if has_tools:
            messages = _apply_conventions(messages, self.conventions)
        try:
            return self._render(messages, tools, add_generation_prompt, kwargs)
        except ChatTemplateError as first:
            # Only turns our tool handling made adjacent are merged: two user messages
            # sent by the caller get the template's own error.
            if not (first.raised_by_template and self.requires_alternation and has_tools):
                raise
            for make in (_merge_adjacent, lambda m: _merge_adjacent(flatten_tool_messages(m))):
                try:
                    variant = make(messages)
                    if variant != messages:
                        return self._render(variant, tools, add_generation_prompt, kwargs)
                except Exception:  # noqa: BLE001 - the template's own error is the answer
                    continue
            raise

    def _variables_for(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
    ) -> dict[str, Any]:
        """The variables llama.cpp and transformers pass (deep copies: templates may mutate)."""
        now = datetime.now()
        variables: dict[str, Any] = {
            "messages": copy.deepcopy(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y"),
        }
        if tools is not None:
            variables["tools"] = copy.deepcopy(tools)
            if "functions" in self._variables:  # FireFunction v2 (as llama.cpp passes it)
                variables["functions"] = json.dumps(tools, ensure_ascii=False, indent=2)
            if "builtin_tools" in self._variables:  # Llama 3.1 built-in tools
                names = [
                    t.get("function", {}).get("name")
                    for t in tools
                    if t.get("function", {}).get("name") in _BUILTIN_TOOL_NAMES
                ]
                if names:
                    variables["builtin_tools"] = names
        elif "functions" in self._variables:
            variables["functions"] = ""
        variables.update(copy.deepcopy(dict(kwargs)))
        return variables

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
    ) -> str:
        try:
            variables = self._variables_for(messages, tools, add_generation_prompt, kwargs)
        except RecursionError:  # copying them: a tool schema or message nested ~1000 deep
            raise ChatTemplateError(
                "the messages or tools nest too deeply to pass to the chat template "
                "(Python's recursion limit)"
            ) from None
        try:
            return guarded_render(self._template, variables, self.limits)
        except TemplateRaised as exc:
            raise ChatTemplateError(
                f"chat template {self.origin!r}: {exc}", raised_by_template=True
            ) from None
        except TemplateLimitError as exc:
            raise ChatTemplateError(f"chat template {self.origin!r}: {exc}", limit=True) from None
        except RecursionError:
            raise ChatTemplateError(f"chat template {self.origin!r} recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateError(f"chat template {self.origin!r} ran out of memory") from None
        except Exception as exc:  # template code is untrusted: any failure is the template's
            raise ChatTemplateError(
                f"chat template {self.origin!r} failed to render: {type(exc).__name__}: {exc}"
            ) from exc


def _apply_conventions(
    messages: list[dict[str, Any]], conv: TemplateConventions
) -> list[dict[str, Any]]:
    """Tool calls and results in the form the template expects (inputs are not mutated)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list) and calls:
            new_calls = []
            for c in calls:
                if not isinstance(c, dict):
                    new_calls.append(c)
                    continue
                c = dict(c)
                fn = c.get("function")
                if isinstance(fn, dict):
                    fn = dict(fn)
                    fn["arguments"] = _args_for(fn.get("arguments"), conv.args_as_string)
                    c["function"] = fn
                if conv.short_ids:
                    c["id"] = short_tool_call_id(str(c.get("id") or ""))
                new_calls.append(c)
            m = {**m, "tool_calls": new_calls}
            content = m.get("content")
            if conv.null_content and (content is None or content == ""):
                m["content"] = None
            elif content is None:
                m["content"] = ""
        elif m.get("role") == "tool" and conv.short_ids and "tool_call_id" in m:
            m = {**m, "tool_call_id": short_tool_call_id(str(m.get("tool_call_id") or ""))}
        out.append(m)
    return out


def _args_for(args: Any, as_string: bool) -> Any:
    if as_string:
        return args if isinstance(args, str) else json.dumps(args or {}, ensure_ascii=False)
    if isinstance(args, str):  # llama.cpp's func_args_not_string: parse JSON text to a dict
        try:
            parsed = json.loads(args)
        except ValueError:
            return args
        return parsed if isinstance(parsed, dict) else args
    return args if args is not None else {}


def _merge_adjacent(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge consecutive user (or system, or plain assistant) turns into one, ``\\n\\n``-joined,
    for templates that insist on alternating roles."""
    out: list[dict[str, Any]] = []
    for m in messages:
        prev = out[-1] if out else None
        role = m.get("role")
        if (
            prev is not None
            and role == prev.get("role")
            and role in ("user", "system", "assistant")
            and not m.get("tool_calls")
            and not prev.get("tool_calls")
        ):
            merged = dict(prev)
            merged["content"] = (
                _append_text(prev.get("content"), "\n\n" + m["content"])
                if isinstance(m.get("content"), str)
                else _join_parts(prev.get("content"), m.get("content"))
            )
            out[-1] = merged
        else:
            out.append(m)
    return out


def _join_parts(a: Any, b: Any) -> Any:
    head = a if isinstance(a, list) else [{"type": "text", "text": a or ""}]
    tail = b if isinstance(b, list) else [{"type": "text", "text": b or ""}]
    return [*head, {"type": "text", "text": "\n\n"}, *tail]


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
            messages = _merge_adjacent(messages)
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


def is_template_source(text: str) -> bool:
    """The rule telling a template name from template source: source has Jinja markup.

    Without it a typo such as ``"chatmlx"`` would be compiled as a template that
    prints the word ``chatmlx`` for every prompt.
    """
    return any(mark in text for mark in ("{{", "{%", "{#"))


def _named_template(metadata: Mapping[str, str], name: str, tokens: dict[str, str]) -> ChatTemplate:
    gguf_key = f"tokenizer.chat_template.{name}"
    if metadata.get(gguf_key):
        return ChatTemplate(str(metadata[gguf_key]), origin=f"gguf:{gguf_key}", **tokens)
    if name.lower() in BUILTIN_TEMPLATES:
        key = name.lower()
        return ChatTemplate(BUILTIN_TEMPLATES[key], origin=f"builtin:{key}", **tokens)
    variants = sorted(
        k.removeprefix("tokenizer.chat_template.")
        for k in metadata
        if k.startswith("tokenizer.chat_template.")
    )
    close = difflib.get_close_matches(name.lower(), [*BUILTIN_TEMPLATES, *variants], n=1)
    raise ChatTemplateError(
        f"chat_template={name!r} is not a built-in template name "
        f"({', '.join(BUILTIN_TEMPLATES)})"
        + (f" nor one of the model's named templates ({', '.join(variants)})" if variants else "")
        + (f"; did you mean {close[0]!r}?" if close else "")
        + " (Jinja template source must contain '{{' or '{%')"
    )


def select_template(
    metadata: Mapping[str, str], *, override: str | None = None, with_tools: bool = False
) -> ChatTemplate:
    """Pick and compile the chat template for a model.

    Order: ``override`` (a built-in name, a GGUF named variant such as ``"tool_use"``,
    or Jinja source — see :func:`is_template_source`; an unknown name raises); the GGUF ``tokenizer.chat_template.tool_use`` when
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
        if not is_template_source(override):
            return _named_template(metadata, override.strip(), tokens)
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
