"""Prompt-reading progress as LangChain custom callback events.

LLM run managers have no ``on_custom_event`` of their own (the mixin's is a no-op), so
the event goes to the run's handlers as :func:`langchain_core.callbacks.dispatch_custom_event`
sends it, with the chat model's run as its ``run_id``.
"""

from __future__ import annotations

import copy
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.callbacks.manager import ahandle_event, handle_event

#: name of the custom event: data ``{"total", "cached", "processed"}`` (prompt tokens)
PROGRESS_EVENT = "llamacpp_prompt_progress"


def emit_progress(run_manager: CallbackManagerForLLMRun, data: dict[str, int]) -> None:
    """Send one progress event to the run's handlers."""
    handle_event(
        run_manager.handlers,
        "on_custom_event",
        "ignore_custom_event",
        PROGRESS_EVENT,
        data,
        run_id=run_manager.run_id,
        tags=run_manager.tags,
        metadata=run_manager.metadata,
    )


async def aemit_progress(run_manager: AsyncCallbackManagerForLLMRun, data: dict[str, Any]) -> None:
    """:func:`emit_progress` for async handlers."""
    await ahandle_event(
        run_manager.handlers,
        "on_custom_event",
        "ignore_custom_event",
        PROGRESS_EVENT,
        data,
        run_id=run_manager.run_id,
        tags=run_manager.tags,
        metadata=run_manager.metadata,
    )


def _no_token(*_args: Any, **_kwargs: Any) -> None:
    return None


async def _ano_token(*_args: Any, **_kwargs: Any) -> None:
    return None


def progress_only(run_manager: Any) -> Any:
    """A copy of ``run_manager`` that reports progress but no tokens: ``invoke`` without
    ``streaming`` hands it to ``_stream``. LangChain's own ``stream()`` passes no run
    manager to ``_stream`` (nor does ``invoke`` when it streams: ``streaming=True``,
    ``astream_events``), so progress events reach callbacks on ``invoke``/``ainvoke``."""
    if run_manager is None:
        return None
    quiet = copy.copy(run_manager)
    is_async = isinstance(run_manager, AsyncCallbackManagerForLLMRun)
    quiet.on_llm_new_token = _ano_token if is_async else _no_token
    return quiet
