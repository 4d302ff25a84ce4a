"""What a new user meets first: the instruct demo model (SmolLM2-135M-Instruct), token
counting, the visible prompt, retried invalid tool calls and clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
from langchain_core.tools import tool

from langchain_llamacpp_local import ChatLlamaCpp, LlamaCppEmbeddings, LlamaCppRerank
from langchain_llamacpp_local.errors import ModelLoadError
from tests.gguf_models import write_scripted_llama, write_tiny_mmproj
from tests.helpers import worker_of

DOCS = Path(__file__).resolve().parents[3] / "docs"


@tool
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"It is 18 degrees and cloudy in {city}."


# --------------------------------------------------------------------------- SmolLM2


@pytest.mark.smollm2
def test_smollm2_chat_template_and_stop_token(smollm2: str) -> None:
    """ChatML from the GGUF; the reply ends at <|im_end|> (not max_tokens) without markup."""
    llm = ChatLlamaCpp(model_path=smollm2, temperature=0, max_tokens=48)
    prompt = llm.render_prompt([SystemMessage("Answer in one word."), HumanMessage("Hi")])
    assert prompt.text == (
        "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    question = [
        SystemMessage("Answer in one word."),
        HumanMessage("What is the capital of France?"),
    ]
    reply = llm.invoke(question)
    assert reply.response_metadata["finish_reason"] == "stop"
    assert "Paris" in reply.content and "<|im_" not in reply.content
    assert reply.usage_metadata["input_tokens"] == llm.get_num_tokens_from_messages(question)


@pytest.mark.smollm2
def test_smollm2_tool_prompt_and_forced_call(smollm2: str) -> None:
    """No tool support in its template: the Hermes prompt is added, Hermes is parsed and
    model_info says so."""
    llm = ChatLlamaCpp(model_path=smollm2, temperature=0, max_tokens=48)
    assert llm.model_info.tool_format == "hermes"
    prompt = llm.render_prompt("Weather in Paris?", tools=[get_weather], tool_choice="any")
    assert prompt.text.startswith("<|im_start|>system\n") and "<tools>" in prompt.text
    assert '"name": "get_weather"' in prompt.text and prompt.tool_format == "hermes"
    assert prompt.grammar and prompt.grammar.startswith('root ::= "<tool_call>')
    msg = llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    assert msg.tool_calls[0]["name"] == "get_weather" and msg.tool_calls[0]["args"]["city"]
    assert msg.usage_metadata["input_tokens"] == prompt.n_tokens


# --------------------------------------------------------------------------- token counting


@pytest.mark.smollm2
def test_token_counting_needs_no_transformers_and_no_weights(smollm2: str) -> None:
    llm = ChatLlamaCpp(model_path=smollm2, temperature=0, max_tokens=4)
    ids = llm.get_token_ids("hello world")
    assert len(ids) == llm.get_num_tokens("hello world") == 2
    assert llm.get_token_ids("<|im_end|>") != [2]  # text stays text
    msgs = [
        SystemMessage("be brief"),
        HumanMessage("a " * 60),
        AIMessage("b " * 60),
        HumanMessage("and now?"),
    ]
    n_all = llm.get_num_tokens_from_messages(msgs)
    n_tools = llm.get_num_tokens_from_messages(msgs, tools=[get_weather])
    assert n_tools > n_all > 120
    assert worker_of(llm) is None  # counted from the vocabulary: the weights were not loaded
    kept = trim_messages(msgs, max_tokens=60, token_counter=llm, include_system=True)
    assert [m.content for m in kept] == ["be brief", "and now?"]
    assert llm.get_num_tokens_from_messages(kept) <= 60
    assert llm.invoke(msgs).usage_metadata["input_tokens"] == n_all


def test_render_prompt_with_images_matches_the_request(tiny_llama: str, tmp_path: Path) -> None:
    """Images need the projector: the loaded model prepares the prompt, media included."""
    import base64
    import io

    from PIL import Image

    mmproj = write_tiny_mmproj(tmp_path / "mmproj.gguf", text_n_embd=64)
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 200, 10)).save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    image = {"type": "image", "base64": data, "mime_type": "image/png"}
    msg = HumanMessage(content=[{"type": "text", "text": "What is it?"}, image])
    llm = ChatLlamaCpp(model_path=tiny_llama, mmproj_path=str(mmproj), temperature=0, max_tokens=2)
    prompt = llm.render_prompt([msg])
    assert "<__media__>" in prompt.text
    assert sum(1 for t in prompt.tokens if isinstance(t, tuple)) == 16
    assert llm.invoke([msg]).usage_metadata["input_tokens"] == prompt.n_tokens


# --------------------------------------------------------------------------- invalid tool calls


@tool("get_weather")
def scripted_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"sunny in {city}"  # not ending in "." (that would start another call)


_HEAD = '"name": "get_weather", "arguments": {"city": "Pa'
_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def _scripted_tool_caller(path: Path) -> str:
    """A model whose call is cut off by max_tokens after a prompt ending in "?", and
    complete after one ending in "." (the retry's error report)."""
    return str(
        write_scripted_llama(
            path,
            extra_tokens=("<tool_call>", "<tool_", "call>", "\n{", _HEAD, _CALL, "\n</tool_call>"),
            transitions={
                "?": {"<tool_call>": 10.0},
                "<tool_call>": {"\n{": 10.0},
                "\n{": {_HEAD: 10.0},
                _HEAD: {"r": 10.0},
                "r": {"r": 10.0},
                ".": {"<tool_": 10.0},
                "<tool_": {"call>": 10.0},
                "call>": {"\n": 10.0},
                "\n": {_CALL: 10.0},
                _CALL: {"\n</tool_call>": 10.0},
            },
            chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
        )
    )


def test_retry_invalid_tool_calls_middleware(tmp_path: Path) -> None:
    from langchain.agents import create_agent

    from langchain_llamacpp_local.agents import InvalidToolCallError, RetryInvalidToolCalls

    llm = ChatLlamaCpp(
        model_path=_scripted_tool_caller(tmp_path / "caller.gguf"),
        temperature=0,
        max_tokens=12,
        n_ctx=2048,
    )
    question = {"messages": [("user", "What is the weather in Paris?")]}
    # without the middleware the run ends on the invalid call, no tool called
    plain = create_agent(llm, tools=[scripted_weather]).invoke(question)["messages"]
    assert plain[-1].invalid_tool_calls and not any(m.type == "tool" for m in plain)

    agent = create_agent(llm, tools=[scripted_weather], middleware=[RetryInvalidToolCalls()])
    messages = agent.invoke(question)["messages"]
    assert [m.type for m in messages] == ["human", "ai", "tool", "ai"]
    assert messages[1].tool_calls[0]["args"] == {"city": "Paris"}
    assert not messages[1].invalid_tool_calls
    assert messages[2].content == "sunny in Paris"

    never = create_agent(llm, tools=[scripted_weather], middleware=[RetryInvalidToolCalls(0)])
    with pytest.raises(InvalidToolCallError, match="invalid JSON"):
        never.invoke(question)
    ended = create_agent(
        llm, tools=[scripted_weather], middleware=[RetryInvalidToolCalls(0, on_failure="end")]
    ).invoke(question)["messages"]
    assert ended[-1].invalid_tool_calls
    with pytest.raises(ValueError, match="max_retries"):
        RetryInvalidToolCalls(-1)


async def test_retry_invalid_tool_calls_middleware_async(tmp_path: Path) -> None:
    from langchain.agents import create_agent

    from langchain_llamacpp_local.agents import RetryInvalidToolCalls

    llm = ChatLlamaCpp(
        model_path=_scripted_tool_caller(tmp_path / "caller.gguf"),
        temperature=0,
        max_tokens=12,
        n_ctx=2048,
    )
    agent = create_agent(llm, tools=[scripted_weather], middleware=[RetryInvalidToolCalls()])
    result = await agent.ainvoke({"messages": [("user", "What is the weather in Paris?")]})
    assert [m.type for m in result["messages"]] == ["human", "ai", "tool", "ai"]


@pytest.mark.smollm2
def test_docs_tools_agent_section_runs_as_written(smollm2: str) -> None:
    text = (DOCS / "tools.md").read_text()
    section = text.split("### Agents", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "docs/tools.md's agent section has no code block"
    source = code.group(1).replace('"SmolLM2-135M-Instruct.Q4_1.gguf"', repr(smollm2))
    assert repr(smollm2) in source
    namespace: dict[str, object] = {}
    exec(compile(source, "docs/tools.md", "exec"), namespace)
    result = namespace["result"]
    assert isinstance(result, dict) and result["messages"][-1].type == "ai"


# --------------------------------------------------------------------------- small things


def test_misspelt_embeddings_and_rerank_arguments_get_a_suggestion(tiny_llama: str) -> None:
    for cls in (LlamaCppEmbeddings, LlamaCppRerank):
        with pytest.raises(TypeError, match=r"'n_gpu_layer' \(did you mean 'n_gpu_layers'\?\)"):
            cls(model_path=tiny_llama, n_gpu_layer=1)


def test_mismatched_mmproj_error_gives_llama_cpp_reason(tiny_llama: str, tmp_path: Path) -> None:
    mmproj = write_tiny_mmproj(tmp_path / "narrow.gguf", text_n_embd=32)
    llm = ChatLlamaCpp(model_path=tiny_llama, mmproj_path=str(mmproj))
    with pytest.raises(ModelLoadError, match=r"mismatch between text model \(n_embd = 64\)"):
        llm.load()
