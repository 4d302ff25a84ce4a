"""Prompt-reading progress as LangChain custom callback events.

LLM run managers have no ``on_custom_event`` of their own (the mixin's is a no-op), so
the event goes to the run's handlers as :func:`langchain_core.callbacks.dispatch_custom_event`
sends it, with the chat model's run as its ``run_id``.

LangChain hands ``_stream`` no run manager on its streaming paths (``stream()``,
``astream()``, and ``invoke`` when it streams: ``streaming=True``, a streaming handler
such as ``astream_events``'s). There the run is passed through :data:`CURRENT_RUN`, a
context variable set only while LangChain starts the run and first steps ``_stream``
(whose body reads it before its first chunk), so it never leaks to other code.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    BaseCallbackManager,
    CallbackManagerForLLMRun,
)
from langchain_core.callbacks.manager import ahandle_event, handle_event
from langchain_core.runnables import RunnableConfig, ensure_config

T = TypeVar("T")

#: the run whose progress ``_stream`` reports when LangChain passed it no run manager
CURRENT_RUN: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "llamacpp_progress_run", default=None
)

#: name of the custom event: data ``{"total", "cached", "processed"}`` (prompt tokens)
PROGRESS_EVENT = "llamacpp_prompt_progress"


def emit_progress(
    run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun, data: dict[str, int]
) -> Awaitable[None] | None:
    """Send one progress event to the run's handlers (an async run's: awaitable)."""
    send = ahandle_event if isinstance(run_manager, AsyncCallbackManagerForLLMRun) else handle_event
    return send(  # type: ignore[no-any-return]
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
    return None  # a call's callback steps await an async run's answer only if it has one


def progress_only(run_manager: Any) -> Any:
    """A copy of ``run_manager`` that reports progress but no tokens: ``invoke`` without
    ``streaming`` hands it to ``_stream``. LangChain's own ``stream()`` passes no run
    manager to ``_stream`` (nor does ``invoke`` when it streams): those paths pass the
    run through :data:`CURRENT_RUN` instead."""
    if run_manager is None:
        return None
    quiet = copy.copy(run_manager)
    quiet.on_llm_new_token = _no_token
    return quiet


def _handlers(callbacks: Any) -> tuple[list[Any], list[Any], Any]:
    """(handlers, inheritable handlers, parent run id) of a config's or model's
    ``callbacks`` (a list of handlers, a callback manager, or None)."""
    if callbacks is None:
        return [], [], None
    if isinstance(callbacks, BaseCallbackManager):
        return (
            list(callbacks.handlers),
            list(callbacks.inheritable_handlers),
            (callbacks.parent_run_id),
        )
    return list(callbacks), list(callbacks), None


def stream_run(
    config: RunnableConfig | None, callbacks: Any, tags: Any, metadata: Any, *, is_async: bool
) -> tuple[RunnableConfig, Any]:
    """For ``stream()``/``astream()``: the config to pass on, with a ``run_id`` fixed in
    advance (LangChain takes the run's id from it), and a run manager on that id for
    progress events only, over the handlers the config and the model name (None without
    any: then the worker sends no progress)."""
    config = ensure_config(config)
    run_id = config.get("run_id") or uuid.uuid4()
    config["run_id"] = run_id
    handlers, inheritable, parent = _handlers(config.get("callbacks"))
    local, local_inheritable, _ = _handlers(callbacks)
    handlers += [h for h in local if h not in handlers]
    inheritable += [h for h in local_inheritable if h not in inheritable]
    if not handlers:
        return config, None
    cls = AsyncCallbackManagerForLLMRun if is_async else CallbackManagerForLLMRun
    run = cls(
        run_id=run_id,
        handlers=handlers,
        inheritable_handlers=inheritable,
        parent_run_id=parent,
        tags=[*(config.get("tags") or []), *(tags or [])],
        metadata={**(config.get("metadata") or {}), **(metadata or {})},
    )
    return config, run


@contextlib.contextmanager
def run_set(run: Any) -> Iterator[None]:
    """:data:`CURRENT_RUN` set to ``run`` inside the ``with`` only."""
    token = CURRENT_RUN.set(run)
    try:
        yield
    finally:
        CURRENT_RUN.reset(token)


def first_step_with(run: Any, make: Callable[[], Iterator[T]]) -> Iterator[T]:
    """``make()``'s items, with :data:`CURRENT_RUN` set to ``run`` only while its first
    item is produced (when ``_stream`` starts and reads it)."""
    with run_set(run):
        inner = make()
        try:
            first = next(inner)
        except StopIteration:
            return
    try:
        yield first
        yield from inner
    finally:
        close = getattr(inner, "close", None)
        if close is not None:
            close()


async def afirst_step_with(run: Any, make: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
    """:func:`first_step_with` for async iterators."""
    with run_set(run):
        inner = make()
        try:
            first = await inner.__anext__()
        except StopAsyncIteration:
            return
    try:
        yield first
        async for item in inner:
            yield item
    finally:
        aclose = getattr(inner, "aclose", None)
        if aclose is not None:
            await aclose()
