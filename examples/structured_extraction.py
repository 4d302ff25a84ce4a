"""Structured extraction: the output is grammar-constrained to the schema.

Run: python examples/structured_extraction.py [model.gguf]
"""

from __future__ import annotations

import sys

from _demo import default_model, max_tokens
from pydantic import BaseModel, Field

from langchain_llamacpp_local import ChatLlamaCpp


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="Full name")
    age: int = Field(description="Age in years")
    city: str = Field(description="Where they live")


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else default_model()
    llm = ChatLlamaCpp(model_path=path, temperature=0, max_tokens=max_tokens(96))
    text = "Maria Lopez, 34, moved to Valencia last spring to open a bakery."
    for method in ("json_schema", "function_calling"):
        extractor = llm.with_structured_output(Person, method=method)
        person = extractor.invoke(
            f"Extract the name, age and city of the person in this text: {text}"
        )
        print(f"{method:>16}: {person!r}")


if __name__ == "__main__":
    main()
