"""Langchain-tests' standard unit suite: construction is cheap and loads nothing."""

from __future__ import annotations

from typing import Any

from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_llamacpp_local import ChatLlamaCpp
from tests.conftest import gemma_path


class TestChatLlamaCppUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatLlamaCpp]:
        return ChatLlamaCpp

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model_path": gemma_path()}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True
