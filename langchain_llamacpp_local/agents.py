"""Agent middleware for ``langchain.agents.create_agent`` (needs ``langchain>=1.0``).

A model's malformed tool call (arguments cut off by ``max_tokens``, JSON that does not
parse) is an ``invalid_tool_calls`` entry of its ``AIMessage``; ``create_agent`` routes
only ``tool_calls`` to the tools, so without this middleware such a turn ends the run
with no tool called and no error. :class:`RetryInvalidToolCalls` asks the model again,
telling it what was wrong.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage

from langchain_llamacpp_local.errors import InvalidToolCallError
from langchain_llamacpp_local.validation import check_retry_options

__all__ = ["InvalidToolCallError", "RetryInvalidToolCalls"]


class RetryInvalidToolCalls(AgentMiddleware):
    """Re-ask the model when its reply holds invalid tool calls.

    Each retry appends the failed reply and a user message naming every invalid call
    and its error, so the prompt (and a deterministic model's answer) changes. The
    agent's state keeps only the reply that was finally accepted. After
    ``max_retries`` failed retries, ``on_failure="error"`` raises
    :class:`InvalidToolCallError`; ``"end"`` returns the last reply as it is (the run
    then ends as it would without this middleware).
    """

    def __init__(self, max_retries: int = 2, on_failure: Literal["error", "end"] = "error") -> None:
        super().__init__()
        check_retry_options(max_retries, on_failure)
        self.max_retries = max_retries
        self.on_failure = on_failure

    def wrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]
    ) -> ModelResponse:
        messages = list(request.messages)
        response = handler(request)
        for _ in range(self.max_retries):
            bad = _invalid_reply(response)
            if bad is None:
                return response
            messages += _feedback(bad)
            response = handler(request.override(messages=messages))
        return self._give_up(response)

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> ModelResponse:
        messages = list(request.messages)
        response = await handler(request)
        for _ in range(self.max_retries):
            bad = _invalid_reply(response)
            if bad is None:
                return response
            messages += _feedback(bad)
            response = await handler(request.override(messages=messages))
        return self._give_up(response)

    def _give_up(self, response: ModelResponse) -> ModelResponse:
        bad = _invalid_reply(response)
        if bad is None or self.on_failure == "end":
            return response
        raise InvalidToolCallError(
            f"the model wrote invalid tool calls after {self.max_retries} retries: "
            + "; ".join(_describe(c) for c in bad.invalid_tool_calls),
            bad,
        )


def _invalid_reply(response: Any) -> AIMessage | None:
    """The reply's ``AIMessage`` if it holds invalid tool calls (else None)."""
    result = getattr(response, "result", None) or []
    for msg in reversed(result):
        if isinstance(msg, AIMessage):
            return msg if msg.invalid_tool_calls else None
    return None


def _describe(call: dict[str, Any]) -> str:
    name = call.get("name") or "(no name)"
    return f"{name}: {call.get('error') or 'invalid'} (arguments written: {call.get('args')!r})"


def _feedback(bad: AIMessage) -> list[BaseMessage]:
    """The failed reply (as plain text) and the error report the model reads next."""
    lines = "\n".join(f"- {_describe(c)}" for c in bad.invalid_tool_calls)
    return [
        AIMessage(content=bad.content),
        HumanMessage(
            "Your tool call could not be used:\n"
            f"{lines}\n"
            "Call the tool again with complete JSON arguments that match its schema."
        ),
    ]
