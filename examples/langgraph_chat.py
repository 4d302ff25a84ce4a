"""A LangGraph graph with two parallel branches sharing one local model.

Run: python examples/langgraph_chat.py [model.gguf]

Both branches call the same ChatLlamaCpp; their requests run together in one
decode batch, each in its own cache slot.
"""

from __future__ import annotations

import operator
import sys
from typing import Annotated

from _demo import default_model, max_tokens
from langgraph.graph import END, START, StateGraph
from typing_extensions import TypedDict

from langchain_llamacpp_local import ChatLlamaCpp


class State(TypedDict):
    topic: str
    notes: Annotated[list[str], operator.add]


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    llm = ChatLlamaCpp(model_path=path, temperature=0, max_tokens=max_tokens(40))

    def pros(state: State) -> dict:
        return {"notes": ["PRO: " + str(llm.invoke(f"One advantage of {state['topic']}:").content)]}

    def cons(state: State) -> dict:
        return {"notes": ["CON: " + str(llm.invoke(f"One drawback of {state['topic']}:").content)]}

    graph = StateGraph(State)
    graph.add_node("pros", pros)
    graph.add_node("cons", cons)
    graph.add_edge(START, "pros")
    graph.add_edge(START, "cons")
    graph.add_edge("pros", END)
    graph.add_edge("cons", END)
    result = graph.compile().invoke({"topic": "electric bicycles", "notes": []})
    print("\n".join(result["notes"]))


if __name__ == "__main__":
    main()
