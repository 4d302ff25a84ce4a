"""What a caller asks for: one chat request at the message level.

The front end (:mod:`~langchain_llamacpp_local.chat.frontend`) turns it into the
token-level :class:`~langchain_llamacpp_local.runtime.requests.EngineRequest` the worker
runs; the cancel event and deadline are shared by both.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.runtime.requests import CancelFlag, EngineRequest, is_cancelled


@dataclass
class ChatJob:
    """One chat request, as the caller's side prepares it."""

    messages: list[dict[str, Any]]
    sampling: SamplingParams
    max_tokens: int | None = None
    #: ``max_tokens`` is the field's default, not asked for: a prompt that leaves less
    #: room gets what is left (with a warning) instead of an overflow error
    max_tokens_default: bool = False
    stop: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning: bool | None = None
    #: "none", "minimal", "low", "medium" or "high": a template variable, and the
    #: on/off switch (``enable_thinking``) of templates that have only that
    reasoning_effort: str | None = None
    #: most tokens generated inside the thinking block before its end marker is forced
    reasoning_budget: int | None = None
    reasoning_budget_message: str | None = None  # written before the forced end marker
    #: tool-call arguments streamed in fragments while the model writes them
    stream_tool_args: bool = False
    logprobs: bool = EngineRequest.logprobs
    top_logprobs: int = EngineRequest.top_logprobs
    cache_prompt: bool = EngineRequest.cache_prompt
    #: llama.cpp's ``n_cache_reuse``: cached chunks of at least this many tokens that
    #: match the prompt after an edit are moved, not read (0: off)
    cache_reuse: int = EngineRequest.cache_reuse
    #: whose cached entries chunk reuse may move: the model instance's scope (a moved
    #: entry carries what it attended to, so never another instance's history)
    reuse_owner: str | None = None
    #: "ngram" (prompt lookup) or "draft" (the worker's draft model); None: off
    speculative: str | None = None
    speculative_max_draft: int = EngineRequest.speculative_max_draft
    #: LoRA adapters applied, ((name, scale), ...) (lora.request_key); None: the model
    #: has none configured
    lora: tuple[tuple[str, float], ...] | None = None
    #: "interactive" or "background" (runtime.scheduler: its prompt waits behind
    #: interactive ones, until it has waited long enough)
    priority: str = EngineRequest.priority
    #: while this request generates, the longest a step may take (ms; None: off)
    stall_budget_ms: float | None = EngineRequest.stall_budget_ms
    deadline: float | None = None
    cancel: threading.Event = field(default_factory=CancelFlag)

    def cancelled(self) -> bool:
        return is_cancelled(self.cancel, self.deadline)
