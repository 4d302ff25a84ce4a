"""From a call's options and the model's fields to a :class:`~.jobs.ChatJob`.

A call may override most of the model's fields (``invoke(..., temperature=0)``); the
names it accepts come from the settings the job fills (:class:`SamplingParams` and
:class:`ChatJob`), so a new setting is a call option without being listed again.
The options are checked first (``validation.check_call``); this module only merges
them with the model's fields and builds the job, on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from langchain_core.messages import BaseMessage

from langchain_llamacpp_local.chat.jobs import ChatJob
from langchain_llamacpp_local.llama.sampling import SamplingParams
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
_JOB_STATE = frozenset({"messages", "sampling", "max_tokens_default", "stop", "deadline", "cancel"})

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
