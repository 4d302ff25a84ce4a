"""From a call's options and the model's fields to a :class:`~.jobs.ChatJob`.

A call may override most of the model's fields (``invoke(..., temperature=0)``); the
names it accepts come from the settings the job fills (:class:`SamplingParams` and
:class:`ChatJob`), so a new setting is a call option without being listed again.
The options are checked first (:func:`check_call`: every argument check of a call's
options lives here), then merged with the model's fields into the job, on the caller's
thread.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from langchain_core.messages import BaseMessage

from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.errors import InvalidRequestError, unknown_names_error
from langchain_llamacpp_local.llama.json_grammar import (
    MAX_SCHEMA_NESTING,
    check_grammar,
    nesting_depth,
)
from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.llama.settings import check_int
from langchain_llamacpp_local.runtime.lora import parse_adapters, request_key
from langchain_llamacpp_local.runtime.scheduler import PRIORITIES
from langchain_llamacpp_local.templates.messages import convert_messages

#: SamplingParams fields the prompt decides (tool calls' lazy grammars), never a field
#: or call option of their own (``grammar`` is both: the user's, or the prompt's).
_FROM_THE_PROMPT = frozenset({"grammar_lazy_triggers"})

#: The sampling settings a model field (and a call) sets, in SamplingParams' order.
SAMPLING_OPTIONS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if f.name not in _FROM_THE_PROMPT
)

#: ChatJob fields that are no call option: the conversation itself, what the job
#: derives from other options, and the request's own state.
_JOB_STATE = frozenset(
    {"messages", "sampling", "max_tokens_default", "stop", "deadline", "cancel", "reuse_owner"}
)

#: Call options that fill no job field: ``timeout`` becomes the deadline, ``model``
#: and ``keep_alive`` choose and hold the model, ``strict`` and
#: ``ls_structured_output_format`` are LangChain's (``bind_tools``, tracing).
_CALL_ONLY = frozenset({"timeout", "model", "keep_alive", "strict", "ls_structured_output_format"})

#: Every keyword argument ``invoke``/``stream`` (and ``render_prompt``) accept.
CALL_OPTIONS: frozenset[str] = frozenset(
    {*SAMPLING_OPTIONS, *_CALL_ONLY}
    | {f.name for f in dataclasses.fields(ChatJob) if f.name not in _JOB_STATE}
)


class ChatDefaults(Protocol):
    """The model fields a request falls back to (``ChatLlamaCpp``'s)."""

    stop: list[str] | None
    max_tokens: int | None
    grammar: str | None
    timeout: float | None
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None
    reasoning: bool | None
    reasoning_effort: str | None
    reasoning_budget: int | None
    reasoning_budget_message: str | None
    stream_tool_args: bool
    logprobs: bool
    top_logprobs: int
    speculative: str | None
    speculative_max_draft: int
    draft_model_path: str | None
    lora_adapters: dict[str, Any] | None
    lora: dict[str, float] | None
    allow_local_image_files: bool
    allow_remote_image_urls: bool
    priority: str
    stall_budget_ms: float | None
    cache_reuse: int

    @property
    def reuse_scope(self) -> str: ...

    @property
    def model_fields_set(self) -> set[str]: ...


@dataclass(frozen=True)
class CheckedCall:
    """A call's options once checked, with the values that needed a check resolved."""

    options: dict[str, Any]
    stop: list[str]
    timeout: float | None
    max_tokens: int | None
    speculative: str | None
    speculative_max_draft: int
    lora: tuple[tuple[str, float], ...] | None


def sampling_params(defaults: Any, overrides: Mapping[str, Any] | None = None) -> SamplingParams:
    """The model's sampling fields with a call's overrides (checked on construction)."""
    values = {k: getattr(defaults, k) for k in SAMPLING_OPTIONS}
    if overrides:
        values.update({k: v for k, v in overrides.items() if k in SAMPLING_OPTIONS})
    return SamplingParams(**values)


def speculative_of(defaults: ChatDefaults, options: Mapping[str, Any]) -> tuple[str | None, Any]:
    """The speculative kind and draft length a call runs with: a ``draft_model_path``
    turns drafting on unless the call says otherwise."""
    kind = options.get("speculative", defaults.speculative)
    if kind is None and "speculative" not in options and defaults.draft_model_path:
        kind = "draft"
    return kind, options.get("speculative_max_draft", defaults.speculative_max_draft)


# --------------------------------------------------------------------------- checks


def check_timeout(value: Any) -> float | None:
    """``timeout``: None (no limit) or a finite number of seconds > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"timeout must be a finite number of seconds > 0 (None: no limit), got {value!r}"
        )
    return float(value)


def check_priority(value: Any) -> None:
    """``priority``: "interactive" or "background"."""
    if value not in PRIORITIES:
        raise ValueError(f"priority must be one of {list(PRIORITIES)}, got {value!r}")


def check_stall_budget(value: Any) -> None:
    """``stall_budget_ms``: None (off) or a finite number of milliseconds > 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"stall_budget_ms must be a number of milliseconds or None, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"stall_budget_ms must be a finite number of milliseconds > 0 (None: off), "
            f"got {value!r}"
        )


def check_max_tokens(value: Any) -> int | None:
    """``max_tokens``: None (until the model stops or the context is full) or an int > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"max_tokens must be a positive integer or None, got {value!r}")
    if value <= 0:
        raise ValueError(f"max_tokens must be positive or None, got {value}")
    return value


def normalize_stop(value: Any, name: str = "stop") -> list[str]:
    """Stop strings as a list: a single string is one stop string (not its characters)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a string or a list of strings, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{name} must hold strings only, got {item!r}")
    return [v for v in value if v]


def check_tool_nesting(index: int, tool: Mapping[str, Any]) -> None:
    """Refuse a tool nested deeper than a schema may be (:data:`MAX_SCHEMA_NESTING`).

    Every way a tool reaches the model (its description written into the prompt,
    the template given a copy, the grammar of its call) walks the schema recursively;
    a schema nested past that limit would fail in one of them with a bare
    ``RecursionError``, so it is refused up front, naming its depth.
    """
    fn = tool.get("function")
    wrapped = isinstance(fn, Mapping)  # {"type": "function", "function": {..., "parameters"}}
    depth = nesting_depth(tool) - (2 if wrapped else 1)  # the schema's own depth
    if depth > MAX_SCHEMA_NESTING:
        name = fn.get("name") if wrapped else tool.get("name")
        raise ValueError(
            f"the schema of tools[{index}] ({name!r}) nests {depth} objects/arrays deep, "
            f"more than the {MAX_SCHEMA_NESTING} allowed (each schema level is about two: "
            "'properties' and the property's schema)"
        )


def check_budget_message(value: Any) -> None:
    """``reasoning_budget_message``: None or text that has a UTF-8 form (it is
    tokenized as plain text, written into the reply's thinking block)."""
    if value is None:
        return
    if not isinstance(value, str):
        raise TypeError(
            f"reasoning_budget_message must be a string, got {type(value).__name__} {value!r}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"reasoning_budget_message is not valid Unicode: character {exc.start} is "
            f"{value[exc.start]!r} ({exc.reason})"
        ) from None


def check_call_options(kwargs: Mapping[str, Any]) -> None:
    """Type checks of per-call options whose wrong types would fail obscurely later."""
    tools = kwargs.get("tools")
    if tools is not None:
        if not isinstance(tools, (list, tuple)):
            raise TypeError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise TypeError(
                    f"tools[{i}] must be a dict (bind_tools converts tools), got "
                    f"{type(tool).__name__}"
                )
            check_tool_nesting(i, tool)
    rf = kwargs.get("response_format")
    if rf is not None and not isinstance(rf, dict):
        raise TypeError(
            "response_format must be a dict such as {'type': 'json_object'}, got "
            f"{type(rf).__name__}"
        )
    ctk = kwargs.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(ctk).__name__}")
    top = kwargs.get("top_logprobs")
    if top is not None:
        check_int("top_logprobs", top, lo=0, hi=100)
    check_logprobs_flag(kwargs.get("logprobs"))
    for name in ("logprobs", "cache_prompt", "parallel_tool_calls", "stream_tool_args"):
        value = kwargs.get(name)
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    tmpl = kwargs.get("chat_template")
    if tmpl is not None and not isinstance(tmpl, str):
        raise TypeError(f"chat_template must be a string, got {type(tmpl).__name__}")
    if "priority" in kwargs:
        check_priority(kwargs["priority"])
    if "stall_budget_ms" in kwargs:
        check_stall_budget(kwargs["stall_budget_ms"])
    if "cache_reuse" in kwargs:
        check_cache_reuse(kwargs["cache_reuse"])


#: Largest ``cache_reuse``: a chunk longer than any context window never matches.
MAX_CACHE_REUSE = 2**31 - 1


def check_cache_reuse(value: Any) -> None:
    """``cache_reuse``: an integer number of tokens >= 0 (0: off); not a bool (True
    would silently mean chunks of 1 token)."""
    check_int("cache_reuse", value, lo=0, hi=MAX_CACHE_REUSE)


def check_grammar_alone(grammar: Any, options: Mapping[str, Any]) -> None:
    """A user's ``grammar`` is the whole constraint: tools and ``response_format``
    build a grammar of their own, and one reply cannot follow two."""
    if grammar is None:
        return
    if not isinstance(grammar, str):
        raise TypeError(f"grammar must be a GBNF string or None, got {type(grammar).__name__}")
    check_grammar(grammar)  # size and nesting; llama.cpp parses it when the call runs
    clash = [name for name in ("tools", "response_format") if options.get(name)]
    if clash:
        raise ValueError(
            f"grammar cannot be combined with {' or '.join(clash)}: they constrain the "
            "reply with a grammar of their own (drop grammar=, or the tools / "
            "structured output)"
        )


def check_logprobs_flag(value: Any) -> None:
    """``logprobs`` is a switch; a count (``logprobs=5``, the legacy completions API's
    form) means ``top_logprobs``, so the error says so."""
    if isinstance(value, int) and not isinstance(value, bool):
        raise TypeError(
            f"logprobs must be True or False, got {value!r}; for the {value} most likely "
            f"alternatives of each token pass logprobs=True, top_logprobs={value}"
        )


def check_call_defaults(defaults: ChatDefaults) -> None:
    """The model's fields that are a call's defaults, checked as call options when the
    model is built (a bad default fails at construction, not at the first call):
    limits, logprobs, priority, the stall budget, ``cache_reuse``, speculation, ``lora``,
    sampling and ``grammar``."""
    check_max_tokens(defaults.max_tokens)
    check_timeout(defaults.timeout)
    check_call_options(
        {
            "top_logprobs": defaults.top_logprobs,
            "logprobs": defaults.logprobs,
            "priority": defaults.priority,
            "stall_budget_ms": defaults.stall_budget_ms,
            "cache_reuse": defaults.cache_reuse,
        }
    )
    check_speculative(
        defaults.speculative, defaults.speculative_max_draft, draft_model=defaults.draft_model_path
    )
    request_key(parse_adapters(defaults.lora_adapters), defaults.lora)  # names and scales
    sampling_params(defaults)  # SamplingParams checks its values
    check_grammar_alone(defaults.grammar, {})


def check_call(
    kwargs: dict[str, Any], stop: list[str] | None, defaults: ChatDefaults
) -> CheckedCall:
    """Every check of one chat call's options, before anything runs: unknown names,
    types, a grammar beside tools, ``tool_choice``, stop strings, limits, speculation
    and LoRA names and scales
    (the caller's errors, raised in that order). The model's fields fill what the call
    leaves out; they were checked at construction."""
    unknown = set(kwargs) - CALL_OPTIONS
    if unknown:
        raise unknown_names_error(unknown, CALL_OPTIONS, "keyword arguments for ChatLlamaCpp")
    options = {k: v for k, v in kwargs.items() if k != "ls_structured_output_format"}
    check_call_options(options)
    check_grammar_alone(options.get("grammar", defaults.grammar), options)
    if options.get("tool_choice") is not None:
        check_tool_choice(options["tool_choice"], options.get("tools"))
    stops = normalize_stop(stop if stop is not None else defaults.stop)
    timeout = check_timeout(options.get("timeout", defaults.timeout))
    max_tokens = check_max_tokens(options.get("max_tokens", defaults.max_tokens))
    check_budget_message(options.get("reasoning_budget_message", defaults.reasoning_budget_message))
    speculative, max_draft = speculative_of(defaults, options)
    check_speculative(speculative, max_draft, draft_model=defaults.draft_model_path)
    specs = parse_adapters(defaults.lora_adapters)
    requested = options.get("lora", defaults.lora)
    return CheckedCall(
        options=options,
        stop=stops,
        timeout=timeout,
        max_tokens=max_tokens,
        speculative=speculative,
        speculative_max_draft=max_draft,
        lora=request_key(specs, requested) if specs or requested else None,
    )


#: the efforts OpenAI's API names; templates with only an on/off switch think for the rest
EFFORTS = ("none", "minimal", "low", "medium", "high")
EFFORTS_OFF = frozenset({"none", "minimal"})


def check_effort(effort: object) -> str:
    """``effort`` if it is one of :data:`EFFORTS`; a template given an unknown effort
    would silently render its default, so it is the caller's error."""
    if effort not in EFFORTS:
        raise InvalidRequestError(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}, not {effort!r}"
        )
    return str(effort)


def check_reasoning_budget(budget: object) -> int:
    """``reasoning_budget``: a count of thinking tokens, 0 turning thinking off."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InvalidRequestError(f"reasoning_budget must be an int >= 0, not {budget!r}")
    return budget


def normalize_tool_choice(tool_choice: Any, tools: Sequence[dict[str, Any]]) -> str | None:
    """Map LangChain/OpenAI ``tool_choice`` forms to ``None`` (auto), ``"none"``,
    ``"required"`` or ``"name:<tool>"``; a bad value raises ``ValueError``."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None or tool_choice == "auto":
        return None
    if tool_choice == "none" or tool_choice is False:
        return "none"
    if tool_choice in ("any", "required") or tool_choice is True:
        return "required"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if tool_choice.get("type") in ("any", "required"):
            return "required"
        if tool_choice.get("type") == "auto":
            return None
        if not name:
            raise ValueError(f"tool_choice {tool_choice!r} names no function")
        tool_choice = name
    if isinstance(tool_choice, str):
        if tool_choice not in names:
            raise ValueError(f"tool_choice={tool_choice!r} is not one of the bound tools {names}")
        return f"name:{tool_choice}"
    raise ValueError(f"unsupported tool_choice {tool_choice!r}")


def check_tool_choice(tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> None:
    """Refuse a bad ``tool_choice`` (``ValueError``), and one that asks for a call when
    no tools are bound: it could only be ignored (``"auto"`` and ``"none"`` ask nothing)."""
    if tools:
        normalize_tool_choice(tool_choice, tools)
        return
    try:
        choice = normalize_tool_choice(tool_choice, [])
    except ValueError:
        choice = "unbound"
    if choice not in (None, "none"):
        raise InvalidRequestError(
            f"tool_choice={tool_choice!r} needs tools, but none are bound: pass them with "
            "bind_tools(tools, tool_choice=...)"
        )


def response_schema(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema of an OpenAI-style ``response_format`` (None for plain JSON mode);
    an unknown type or a schema-less ``json_schema`` is the caller's ``ValueError``."""
    rtype = response_format.get("type")
    if rtype == "json_object":
        return None
    if rtype == "json_schema":
        js = response_format.get("json_schema") or {}
        schema = js.get("schema", js if "properties" in js or "type" in js else None)
        if not isinstance(schema, dict):
            raise ValueError("response_format json_schema has no 'schema'")
        return schema
    raise ValueError(
        f"unsupported response_format type {rtype!r}; use 'json_schema' or 'json_object'"
    )


#: Speculative decoding kinds (``ChatLlamaCpp.speculative``).
SPECULATIVE_KINDS = ("ngram", "draft")
#: Most draft tokens one verify step may carry (llama.cpp's server allows 16 by default).
MAX_DRAFT = 64


def check_speculative(kind: Any, max_draft: Any, *, draft_model: str | None) -> None:
    """``speculative``/``speculative_max_draft`` (constructor or per call)."""
    if kind is not None and kind not in SPECULATIVE_KINDS:
        raise ValueError(
            f"speculative={kind!r} is not a speculative decoding kind; use one of "
            f"{list(SPECULATIVE_KINDS)} or None"
        )
    if kind == "draft" and not draft_model:
        raise ValueError('speculative="draft" needs draft_model_path=... (a small GGUF)')
    check_int("speculative_max_draft", max_draft, lo=1, hi=MAX_DRAFT)


# --------------------------------------------------------------------------- the job


def build_job(defaults: ChatDefaults, messages: list[BaseMessage], call: CheckedCall) -> ChatJob:
    """The job of one call; images are decoded here, so the worker never waits on them."""
    options = call.options
    template_kwargs = dict(defaults.chat_template_kwargs or {})
    template_kwargs.update(options.get("chat_template_kwargs") or {})
    return ChatJob(
        messages=decode_images(
            convert_messages(messages),
            allow_local_files=defaults.allow_local_image_files,
            allow_remote_urls=defaults.allow_remote_image_urls,
        ),
        sampling=sampling_params(defaults, options),
        max_tokens=call.max_tokens,
        max_tokens_default="max_tokens" not in options
        and "max_tokens" not in defaults.model_fields_set,
        stop=call.stop,
        tools=options.get("tools"),
        tool_choice=options.get("tool_choice"),
        parallel_tool_calls=options.get("parallel_tool_calls"),
        response_format=options.get("response_format"),
        chat_template=options.get("chat_template", defaults.chat_template),
        chat_template_kwargs=template_kwargs,
        reasoning=options.get("reasoning", defaults.reasoning),
        reasoning_effort=options.get("reasoning_effort", defaults.reasoning_effort),
        reasoning_budget=options.get("reasoning_budget", defaults.reasoning_budget),
        reasoning_budget_message=options.get(
            "reasoning_budget_message", defaults.reasoning_budget_message
        ),
        stream_tool_args=bool(options.get("stream_tool_args", defaults.stream_tool_args)),
        logprobs=bool(options.get("logprobs", defaults.logprobs)),
        top_logprobs=int(options.get("top_logprobs", defaults.top_logprobs) or 0),
        cache_prompt=bool(options.get("cache_prompt", ChatJob.cache_prompt)),
        cache_reuse=options.get("cache_reuse", defaults.cache_reuse),
        reuse_owner=defaults.reuse_scope,
        speculative=call.speculative,
        speculative_max_draft=call.speculative_max_draft,
        lora=call.lora,
        priority=options.get("priority", defaults.priority),
        stall_budget_ms=options.get("stall_budget_ms", defaults.stall_budget_ms),
        deadline=None if call.timeout is None else time.monotonic() + call.timeout,
    )


def decode_images(
    messages: list[dict[str, Any]], *, allow_local_files: bool, allow_remote_urls: bool
) -> list[dict[str, Any]]:
    """Decode image and audio parts in place, in the caller's thread, so the worker never
    waits on pillow, WAV decoding (or a permitted download); refused forms raise
    ``ImageInputError`` or ``AudioInputError``."""
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image":
                from langchain_llamacpp_local.chat.images import load_image

                part["image"] = load_image(
                    part["image"],
                    allow_local_files=allow_local_files,
                    allow_remote_urls=allow_remote_urls,
                )
            elif isinstance(part, dict) and part.get("type") == "audio":
                from langchain_llamacpp_local.chat.audio import load_audio

                part["audio"] = load_audio(part["audio"])
    return messages


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether a converted conversation holds an image or audio (its prompt needs the
    loaded model's projector)."""
    return any(
        isinstance(part, dict) and part.get("type") in ("image", "audio")
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
    )
