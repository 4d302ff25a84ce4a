"""An agent with two tools on a local model (langchain.agents.create_agent).

Run: python examples/agent_with_tools.py [model.gguf]

With a capable instruct model (Qwen 2.5/3, Llama 3.x, Mistral...) the model decides
when to call a tool (``tool_choice="auto"``, parsed from the format its chat template
uses). Tiny base models cannot make that decision reliably; giving the agent a
``ToolStrategy`` response format makes every turn a grammar-constrained tool call
(``tool_choice="any"``) and the loop ends when the model calls the answer tool. This
example uses that strategy so it works on the 270M default model too.
"""

from __future__ import annotations

import sys

from _demo import default_model, max_tokens
from langchain.agents import create_agent
from langchain.agents.structured_output import ToolStrategy
from langchain_core.tools import tool
from pydantic import BaseModel

from langchain_llamacpp_local import ChatLlamaCpp


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


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    llm = ChatLlamaCpp(model_path=path, temperature=0, max_tokens=max_tokens(128), n_ctx=4096)
    agent = create_agent(
        llm, tools=[get_weather, get_population], response_format=ToolStrategy(Answer)
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
