"""``with_structured_output``: a grammar-constrained answer parsed into the schema.

``json_schema`` constrains generation with a grammar built from the schema,
``function_calling`` forces a call of a tool shaped like it, ``json_mode`` any JSON
object; output cut off by ``max_tokens`` raises instead of parsing as a partial answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.runnables import (
    Runnable,
    RunnableGenerator,
    RunnableMap,
    RunnablePassthrough,
)
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from langchain_llamacpp_local.errors import StructuredOutputTruncatedError


def structured_output(
    model: Any,
    schema: dict[str, Any] | type,
    *,
    method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
    include_raw: bool = False,
    strict: bool | None = None,
    **kwargs: Any,
) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
    """``model.with_structured_output``: output matching ``schema`` (pydantic v1/v2 class, TypedDict or JSON schema).

    ``json_schema`` (default) constrains generation with a grammar built from the
    schema; ``function_calling`` forces a call of a tool shaped like the schema;
    ``json_mode`` constrains output to some JSON object (describe the keys in the prompt).
    """
    if kwargs:
        raise ValueError(f"Received unsupported arguments {kwargs}")
    is_pydantic = isinstance(schema, type) and (
        is_basemodel_subclass(schema) or is_pydantic_v1(schema)
    )
    if method == "function_calling":
        tool = convert_to_openai_tool(schema, strict=strict)
        name = tool["function"]["name"]
        llm = model.bind_tools(
            [schema],
            tool_choice=name,
            parallel_tool_calls=False,
            ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict},
                "schema": tool,
            },
        )
        parser: Runnable = (
            PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
            if is_pydantic
            else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        )
    elif method in ("json_schema", "json_mode"):
        if method == "json_schema":
            json_schema = json_schema_of(schema)
            response_format: dict[str, Any] = {
                "type": "json_schema",
                "json_schema": {
                    "name": json_schema.get("title", "output"),
                    "schema": json_schema,
                    "strict": strict,
                },
            }
        else:
            response_format = {"type": "json_object"}
        try:
            ls_schema: Any = convert_to_json_schema(schema)
        except (TypeError, ValueError):
            ls_schema = schema
        llm = model.bind(
            response_format=response_format,
            ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict},
                "schema": ls_schema,
            },
        )
        parser = (
            PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
            if is_pydantic
            else JsonOutputParser()
        )
    else:
        raise ValueError(
            f"method must be 'json_schema', 'function_calling' or 'json_mode', not {method!r}"
        )
    # Partial-JSON parsing would read output cut off by max_tokens as a valid answer.
    parser = complete_output(method) | parser
    if not include_raw:
        return llm | parser
    parser_assign = RunnablePassthrough.assign(
        parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
    )
    parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
    parser_with_fallback = parser_assign.with_fallbacks(
        [parser_none], exception_key="parsing_error"
    )
    return RunnableMap(raw=llm) | parser_with_fallback


def complete_output(method: str) -> Runnable[Any, Any]:
    """Passes the model's output through and then checks it was not cut off by the token
    limit: ``finish_reason == "length"`` with output that does not parse whole raises
    :class:`StructuredOutputTruncatedError`. A generator, so the parser after it still
    streams partial output."""

    def transform(chunks: Iterator[Any]) -> Iterator[Any]:
        total = None
        for chunk in chunks:
            total = chunk if total is None else total + chunk
            yield chunk
        check_complete(total, method)

    async def atransform(chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        total = None
        async for chunk in chunks:
            total = chunk if total is None else total + chunk
            yield chunk
        check_complete(total, method)

    return RunnableGenerator(transform, atransform, name="check_complete")


def check_complete(message: Any, method: str) -> None:
    if not isinstance(message, AIMessage):
        return
    if message.response_metadata.get("finish_reason") != "length":
        return
    if method == "function_calling":
        if isinstance(message, AIMessageChunk):  # merged chunks: arguments as streamed
            whole = bool(message.tool_call_chunks) and all(
                is_json(c.get("args") or "{}") for c in message.tool_call_chunks
            )
        else:
            whole = bool(message.tool_calls) and not message.invalid_tool_calls
        what = "the forced tool call"
    else:
        whole = is_json(message.text)
        what = "the structured output"
    if whole:  # complete exactly at the limit
        return
    usage = message.usage_metadata or {}
    raise StructuredOutputTruncatedError(
        f"{what} was cut off by max_tokens after {usage.get('output_tokens', '?')} tokens "
        "(finish_reason='length') before it was complete; raise max_tokens (with "
        "max_tokens=None, the context window n_ctx is the limit)",
        llm_output=message.text,
    )


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def is_pydantic_v1(schema: type) -> bool:
    try:
        from pydantic.v1 import BaseModel as V1BaseModel
    except ImportError:  # pragma: no cover
        return False
    return issubclass(schema, V1BaseModel)


def json_schema_of(schema: dict[str, Any] | type) -> dict[str, Any]:
    if isinstance(schema, type) and is_pydantic_v1(schema):
        return schema.schema()  # type: ignore[attr-defined]
    if isinstance(schema, type) and is_basemodel_subclass(schema):
        return schema.model_json_schema()
    return convert_to_json_schema(schema)
