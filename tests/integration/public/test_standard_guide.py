"""langchain-tests' standard suites written exactly as LangChain's integration-testing
guide writes them: the class, its constructor parameters, nothing else, on the instruct
test model (SmolLM2-135M-Instruct).

The tests that measure what a 135M model can do (choose to call a tool, fill a
schema's keys from the prompt) are marked ``xfail`` with the reason, as the guide
says; test_standard.py runs the suites with the capabilities declared per model.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_llamacpp_local import ChatLlamaCpp
from tests.conftest import smollm2_path

pytestmark = pytest.mark.smollm2

QUALITY = "measures the model, not the integration: SmolLM2-135M-Instruct {}"


class TestChatLlamaCppUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatLlamaCpp]:
        return ChatLlamaCpp

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model_path": smollm2_path(), "temperature": 0}


class TestChatLlamaCppIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatLlamaCpp]:
        return ChatLlamaCpp

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model_path": smollm2_path(), "temperature": 0}
