"""Langchain-tests' standard integration suite against Gemma 3 270M (a tiny base model).

Capabilities are declared honestly. Tests that need the model to *choose* well
(what a 270M base model cannot do) are marked xfail with the reason; the code
paths they exercise are covered deterministically in test_tools.py.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_llamacpp_local import ChatLlamaCpp
from tests.conftest import gemma_path


@functools.cache
def _tiny_override_model() -> str:
    from tests.gguf_models import write_tiny_llama

    return str(write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny-override.gguf"))


MODEL_QUALITY = "Gemma 3 270M base cannot reliably decide this by itself (model quality)"


class TestChatLlamaCppStandard(ChatModelIntegrationTests):
    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # A local model has no API key and no network calls to retry; unknown
        # constructor arguments raise, so these are not passed.
        params = dict(super().standard_chat_model_params)
        params.pop("api_key", None)
        params.pop("max_retries", None)
        return params

    @property
    def chat_model_class(self) -> type[ChatLlamaCpp]:
        return ChatLlamaCpp

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model_path": gemma_path(), "temperature": 0, "max_tokens": 96, "n_ctx": 4096}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

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

    @pytest.mark.xfail(reason=MODEL_QUALITY)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    # The grammar guarantees a schema-valid call (test_tools.py checks that); picking
    # the value 3 from the question is up to the model.
    @pytest.mark.xfail(reason="270M base model writes a valid but wrong integer argument")
    def test_tool_calling(self, model: BaseChatModel) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason="270M base model writes a valid but wrong integer argument")
    async def test_tool_calling_async(self, model: BaseChatModel) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason="270M base model can loop inside a JSON string until max_tokens")
    def test_structured_output(self, model: BaseChatModel, schema_type: str) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason="270M base model can loop inside a JSON string until max_tokens")
    async def test_structured_output_async(self, model: BaseChatModel, schema_type: str) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason="270M base model can loop inside a JSON string until max_tokens")
    def test_structured_output_pydantic_2_v1(self, model: BaseChatModel) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(
        reason="270M base model does not finish a long CJK argument within max_tokens"
    )
    def test_unicode_tool_call_integration(
        self, model: BaseChatModel, *, tool_choice: str | None = None, force_tool_call: bool = True
    ) -> None:
        super().test_unicode_tool_call_integration(
            model, tool_choice=tool_choice, force_tool_call=force_tool_call
        )

    @pytest.mark.xfail(
        reason="json_mode only constrains to some JSON object; the 270M model ignores the keys asked for"
    )
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)
