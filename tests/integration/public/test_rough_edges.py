"""Small things a new user meets: each once rough, each with the behaviour LangChain's
other providers (or OpenAI's API) have."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
from langchain_core.exceptions import ModelInvalidRequestError
from langchain_core.messages import HumanMessage
from PIL import Image

from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings
from langchain_llamacpp_local.chat.images import load_image
from tests.gguf_models import write_tiny_llama_vocab
from tests.llama_cpp_cases import TEMPLATES
from tests.printing_model import write_printing_llama

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_tool_choice_any_without_tools_is_a_model_invalid_request_error(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama)
    with pytest.raises(ModelInvalidRequestError, match="needs tools"):
        llm.bind_tools([], tool_choice="any")
    with pytest.raises(ModelInvalidRequestError, match="needs tools"):
        llm.invoke("hi", tool_choice="any")


def test_logprobs_as_a_count_points_to_top_logprobs(tiny_llama: str) -> None:
    with pytest.raises(TypeError, match="logprobs=True, top_logprobs=5"):
        ChatLlamaCpp(model_path=tiny_llama, logprobs=5)
    llm = ChatLlamaCpp(model_path=tiny_llama, max_tokens=2)
    with pytest.raises(ModelInvalidRequestError, match="logprobs=True, top_logprobs=3"):
        llm.invoke("hi", logprobs=3)


def test_raw_bytes_as_an_images_base64() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    raw = buf.getvalue()
    want = load_image({"type": "image", "base64": base64.b64encode(raw).decode()})
    for given in (raw, base64.b64encode(raw)):  # the file's bytes, or base64 as bytes
        got = load_image({"type": "image", "base64": given, "mime_type": "image/png"})
        assert (got.width, got.height, got.rgb) == (want.width, want.height, want.rgb)


def test_tool_calls_finish_with_tool_calls(tmp_path: Path) -> None:
    qwen = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    path, _ = write_printing_llama(
        tmp_path / "call.gguf", call, chat_template=qwen, cuts=("<tool_call>",)
    )
    llm = ChatLlamaCpp(model_path=str(path), temperature=0, max_tokens=100)
    msg = llm.bind_tools([TOOL]).invoke("weather?")
    assert msg.tool_calls and msg.response_metadata["finish_reason"] == "tool_calls"
    merged = None
    for chunk in llm.bind_tools([TOOL]).stream("weather?"):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and merged.response_metadata["finish_reason"] == "tool_calls"
    plain = llm.invoke("weather?")  # no tools bound: the same text is content
    assert plain.response_metadata["finish_reason"] == "stop"
    assert plain.usage_metadata["output_token_details"] == {"reasoning": 0}


def test_profile_carries_the_reasoning_keys(tmp_path: Path) -> None:
    qwen3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    path, _ = write_printing_llama(tmp_path / "think.gguf", "ok", chat_template=qwen3)
    profile = ChatLlamaCpp(model_path=str(path), n_ctx=1024).profile
    assert profile is not None
    assert profile["reasoning_output"] is True
    assert profile["reasoning_effort_levels"] == ["none", "minimal", "low", "medium", "high"]
    assert profile["max_output_tokens"] == profile["max_input_tokens"] == 1024
    gpt_oss = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
    oss = ChatLlamaCpp(model_path=str(path), chat_template=gpt_oss).profile
    assert oss is not None and oss["reasoning_effort_default"] == "medium"
    qwen = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    plain = ChatLlamaCpp(model_path=str(path), chat_template=qwen).profile
    assert plain is not None and plain["reasoning_output"] is False
    assert "reasoning_effort_levels" not in plain


def test_one_empty_text_does_not_fail_a_batch_on_a_model_without_bos(tmp_path: Path) -> None:
    path = write_tiny_llama_vocab(tmp_path / "nobos.gguf", add_bos=False)
    emb = LlamaCppEmbeddings(model_path=str(path), flash_attn=False)
    vectors = emb.embed_documents(["a cat", "", "a dog"])
    assert len(vectors) == 3 and all(np.isfinite(v).all() for v in vectors)
    # the empty text is the end-of-text token alone, as a query too
    np.testing.assert_allclose(vectors[1], emb.embed_query(""), atol=1e-5)


def test_tools_added_to_a_conversation_are_not_template_kwargs(tmp_path: Path) -> None:
    qwen = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    path, _ = write_printing_llama(tmp_path / "m.gguf", "Fine.", chat_template=qwen)
    llm = ChatLlamaCpp(model_path=str(path), temperature=0, max_tokens=8)
    history = [HumanMessage("Hello there, how is the weather today?")]
    llm.invoke(history)
    msg = llm.bind_tools([TOOL]).invoke(history)
    cache = msg.response_metadata["cache"]
    assert cache["missed"]
    assert cache["miss"]["cause"] == "tool list or order changed", cache


def test_max_retries_retries_a_retryable_error(tiny_llama: str) -> None:
    from langchain_llamacpp_local import WorkerDeadError
    from tests.helpers import make_worker_fail, worker_of

    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, temperature=0, max_tokens=4)
    make_worker_fail(llm)
    with pytest.raises(WorkerDeadError):  # 0 by default: the error reaches the caller
        llm.invoke("hi")
    retrying = ChatLlamaCpp(
        model_path=tiny_llama, n_ctx=256, temperature=0, max_tokens=4, max_retries=1
    )
    dead = make_worker_fail(retrying)
    assert retrying.invoke("hi").response_metadata["finish_reason"] in ("stop", "length")
    assert not dead.alive and worker_of(retrying) is not dead
    with pytest.raises(ModelInvalidRequestError):  # not retryable: raised at once
        retrying.invoke("hi", temperature=-1.0)
    assert ChatLlamaCpp(model_path=tiny_llama, api_key="unused").api_key is not None
