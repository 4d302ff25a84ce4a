"""An agent with two tools on a local model (langchain.agents.create_agent).

Run: python examples/agent_with_tools.py [model.gguf]

With a capable instruct model (Qwen 2.5/3, Llama 3.x, Mistral...) the model decides
when to call a tool (``tool_choice="auto"``, parsed from the format its chat template
uses). Tiny models cannot make that decision reliably; giving the agent a
``ToolStrategy`` response format makes every turn a grammar-constrained tool call
(``tool_choice="any"``) and the loop ends when the model calls the answer tool. A tiny
model would also call the same tool again and again, so a middleware offers only the
answer tool once a tool has answered: the run is one tool call, then the answer.
``RetryInvalidToolCalls`` re-asks the model if a call comes back malformed (e.g. cut
off by ``max_tokens``). This works on the 135M default model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from _demo import default_model, max_tokens
from langchain.agents import create_agent
from langchain.agents.middleware import ModelRequest, ModelResponse, wrap_model_call
from langchain.agents.structured_output import ToolStrategy
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.agents import RetryInvalidToolCalls


@tool
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"It is 18 degrees and cloudy in {city}."


@tool
def get_population(city: str) -> str:
    """Get the population of a city."""
    return f"{city} has about 2.1 million inhabitants."


class Answer(BaseModel):
    """The final answer to the user's question."""

    answer: str


@wrap_model_call
def answer_after_a_tool(
    request: ModelRequest, handler: Callable[..., ModelResponse]
) -> ModelResponse:
    """Once a tool has answered, offer only the answer tool (``ToolStrategy`` adds it)."""
    if request.messages and isinstance(request.messages[-1], ToolMessage):
        request = request.override(tools=[])
    return handler(request)


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    llm = ChatLlamaCpp(model_path=path, temperature=0, max_tokens=max_tokens(128), n_ctx=4096)
    agent = create_agent(
        llm,
        tools=[get_weather, get_population],
        response_format=ToolStrategy(Answer),
        middleware=[RetryInvalidToolCalls(max_retries=2), answer_after_a_tool],
    )
    result = agent.invoke(
        {"messages": [("user", "What is the weather in Paris? Use the get_weather tool.")]},
        {"recursion_limit": 12},
    )
    for msg in result["messages"]:
        calls = getattr(msg, "tool_calls", None)
        print(f"{msg.type:>5}: {calls or msg.content}")
    print("structured response:", result.get("structured_response"))


if __name__ == "__main__":
    main()
