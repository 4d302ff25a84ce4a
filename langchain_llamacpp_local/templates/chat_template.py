"""The chat template: a GGUF's Jinja template compiled in the sandbox, its conventions
probed, and rendering with the message adaptation the template needs.

GGUF files carry Hugging Face style Jinja chat templates. They are untrusted
code from a downloaded file, so they run in a resource-limited Jinja sandbox
(:mod:`.sandbox`) and every failure, sandbox violations and limits
included, surfaces as :class:`ChatTemplateError` naming where the template came
from. Each template's conventions for tool calls (arguments as dict or JSON text,
``content=None``, id form) are found by rendering probe conversations, the way
llama.cpp's capability probe does, so real templates render what llama.cpp and
transformers render. Models without a usable template fall back to lenient
built-in templates (:mod:`.builtin_templates`) that accept anything LangChain sends.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import string
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, meta

from langchain_llamacpp_local.errors import ChatTemplateError
from langchain_llamacpp_local.templates.hermes_prompt import (
    append_text,
    flatten_tool_messages,
    prepend_text,
)
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

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- compiled templates

_ENV = make_env()

# Compiled templates and probe results, per template source: a template is compiled and
# probed once per process, not per model load or per request.
_CACHE_SIZE = 64
_cache_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A parent's caller may have held the lock at a fork."""
    global _cache_lock
    _cache_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
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

    @property
    def variables(self) -> frozenset[str]:
        """The variables the template reads that it does not set first."""
        return self._variables

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
    def supports_parallel_tool_calls(self) -> bool:
        """Probe (llama.cpp's caps probe): an assistant message with two calls shows both,
        so a conversation with parallel calls reads back as the model wrote it."""
        if not self.supports_tool_calls:
            return False
        return bool(self._probe("supports_parallel_tool_calls", self._probe_parallel))

    def _probe_parallel(self) -> bool:
        conv = self.conventions
        second = f"{_PROBE_NAME}_two"
        calls = [
            {
                "id": f"{_PROBE_ID}{i}",
                "type": "function",
                "function": {"name": name, "arguments": {"probe_arg": _PROBE_VALUE}},
            }
            for i, name in enumerate((_PROBE_NAME, second))
        ]
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "probe question"},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ]
        fn = {**_PROBE_TOOLS[0]["function"], "name": second}
        tools = [*_PROBE_TOOLS, {"type": "function", "function": fn}]
        try:
            text = self._render(_apply_conventions(messages, conv), tools, False, {})
        except ChatTemplateError as exc:
            if exc.limit:
                raise
            return False
        # the second call is shown after the question (tool lists come before it)
        return second in text.split("probe question", 1)[-1]

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
        request's, inside :func:`~.sandbox.request_budget`).
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
            for make in (merge_adjacent, lambda m: merge_adjacent(flatten_tool_messages(m))):
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


def merge_adjacent(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
                append_text(prev.get("content"), "\n\n" + m["content"])
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
            new["content"] = prepend_text(m.get("content"), "\n\n".join(pending))
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
