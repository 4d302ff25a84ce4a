"""Langchain-tests' standard integration suite against Gemma 3 270M (a tiny base model).

Capabilities are declared honestly. The tests that need the model to *choose* well (what
a 270M base model cannot do) are skipped on it and run on SmolLM2-135M-Instruct instead;
the code paths they exercise are also covered deterministically in test_tools.py.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests.chat_models import ChatModelTests

from langchain_llamacpp_local import ChatLlamaCpp
from tests.conftest import gemma_path, smollm2_path


@functools.cache
def _tiny_override_model() -> str:
    from tests.gguf_models import write_tiny_llama

    return str(write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny-override.gguf"))


#: The standard tests that need the model to follow the request (call the tool with the
#: number asked for, fill a schema's keys with text that ends): a 270M base model cannot,
#: so they are skipped on it and run on the instruct model (TestChatLlamaCppInstruct).
ON_INSTRUCT = frozenset(
    {
        "test_tool_calling",
        "test_tool_calling_async",
        "test_structured_output",
        "test_structured_output_async",
        "test_structured_output_pydantic_2_v1",
        "test_unicode_tool_call_integration",
    }
)
#: Standard tests no test model passes, skipped with the reason (the code paths they take
#: are covered deterministically in test_tools.py).
BEYOND_THE_TEST_MODELS = {
    "test_agent_loop": (
        "needs the model to choose to call a tool (tool_choice='auto'); neither Gemma 3 "
        "270M base nor SmolLM2-135M-Instruct does (test_tools.py runs agents with forced calls)"
    ),
    "test_json_mode": (
        "json_mode constrains the output to some JSON object, not to the keys the prompt "
        "asks for; Gemma 3 270M and SmolLM2-135M-Instruct write other keys"
    ),
}
_INSTRUCT = "needs an instruct model: runs on SmolLM2-135M-Instruct (TestChatLlamaCppInstruct)"


class _LocalChatModel:
    """What both classes declare of ``ChatLlamaCpp`` (before the standard base, whose
    properties these replace)."""

    @property
    def chat_model_class(self) -> type[ChatLlamaCpp]:
        return ChatLlamaCpp

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True


class TestChatLlamaCppStandard(_LocalChatModel, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model_path": gemma_path(), "temperature": 0, "max_tokens": 96, "n_ctx": 4096}

    @property
    def supports_image_inputs(self) -> bool:
        return False  # no mmproj for the test model

    @property
    def model_override_value(self) -> str:
        """Per-call ``model=``: another GGUF (the tiny llama), reported under that name."""
        return _tiny_override_model()

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatLlamaCpp(**self.chat_model_params)
        history = [SystemMessage("You are helpful. " * 20), HumanMessage("Hi")]
        llm.invoke(history)
        msgs = [*history, AIMessage("Hello!"), HumanMessage("How are you?")]
        if stream:
            total = None
            for chunk in llm.stream(msgs):
                total = chunk if total is None else total + chunk
            assert total is not None
            msg = AIMessage(
                content=total.content,
                usage_metadata=total.usage_metadata,
                response_metadata=total.response_metadata,
            )
        else:
            msg = llm.invoke(msgs)  # type: ignore[assignment]
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 20  # type: ignore[index]
        return msg

    @pytest.fixture(autouse=True)
    def _only_on_instruct(self, request: pytest.FixtureRequest) -> None:
        """Skips, before the model is built, the tests that run on the instruct model and
        those beyond the test models."""
        name = request.node.originalname
        if name in ON_INSTRUCT:
            pytest.skip(_INSTRUCT)
        if name in BEYOND_THE_TEST_MODELS:
            pytest.skip(BEYOND_THE_TEST_MODELS[name])


class TestChatLlamaCppInstruct(_LocalChatModel, ChatModelTests):
    """The standard tests that need a model to follow the request, on SmolLM2-135M-Instruct
    (ChatML; the tool prompt is the one this package writes for a template without tools).
    The functions are the standard suite's own, with their parameters."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Greedy decoding of a 135M model can loop inside a JSON string until max_tokens;
        # mild penalties end the strings.
        return {
            "model_path": smollm2_path(),
            "temperature": 0,
            "max_tokens": 256,
            "frequency_penalty": 0.5,
            "presence_penalty": 0.5,
        }

    test_tool_calling = ChatModelIntegrationTests.test_tool_calling
    test_tool_calling_async = ChatModelIntegrationTests.test_tool_calling_async
    test_structured_output = ChatModelIntegrationTests.test_structured_output
    test_structured_output_async = ChatModelIntegrationTests.test_structured_output_async
    test_structured_output_pydantic_2_v1 = (
        ChatModelIntegrationTests.test_structured_output_pydantic_2_v1
    )
    test_unicode_tool_call_integration = (
        ChatModelIntegrationTests.test_unicode_tool_call_integration
    )
