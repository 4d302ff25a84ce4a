"""What a LangChain user expects of a model object, on the tiny real models: copies and
pickles after use, a stable traced name, the same model options on every class, per-chunk
logprobs, control-token look-alikes beside images, and clear errors for ignored options."""

from __future__ import annotations

import base64
import copy
import io
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessageChunk, HumanMessage
from PIL import Image

from langchain_llamacpp_local import (
    ChatLlamaCpp,
    ContextOverflowError,
    LlamaCppEmbeddings,
    LlamaCppRerank,
)
from langchain_llamacpp_local.errors import ModelLoadError
from langchain_llamacpp_local.llama import model_handle
from langchain_llamacpp_local.runtime import registry
from tests.compare import GREEDY, ids
from tests.gguf_models import BOS_ID, EOS_ID, write_tiny_bert, write_tiny_mmproj
from tests.helpers import reply_of, wait_for


@pytest.fixture(scope="module")
def bert(models_dir: Path) -> str:
    return str(write_tiny_bert(models_dir / "tiny-bert.gguf"))


@pytest.fixture(scope="module")
def reranker(models_dir: Path) -> str:
    return str(write_tiny_bert(models_dir / "tiny-reranker.gguf", rerank=True))


@pytest.fixture(scope="module")
def mmproj(models_dir: Path) -> str:
    return str(write_tiny_mmproj(models_dir / "tiny-mmproj.gguf", text_n_embd=64))


def _png() -> str:
    img = Image.new("RGB", (32, 32), (200, 30, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


# --------------------------------------------------------------------------- copies


def _round_trips(obj: Any) -> list[Any]:
    return [copy.deepcopy(obj), pickle.loads(pickle.dumps(obj)), copy.copy(obj)]


def test_chat_copies_and_pickles_after_use_share_the_loaded_model(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, max_tokens=6, n_slots=1, **GREEDY)
    first = llm.invoke("hello there")
    bound = llm.bind(stop=["zzz"])
    bound.invoke("hello there")
    loads = registry.load_count()
    for clone in _round_trips(llm):
        assert isinstance(clone, ChatLlamaCpp) and clone is not llm
        assert ids(clone.invoke("hello there")) == ids(first)
    for clone in _round_trips(bound):
        assert ids(clone.invoke("hello there")) == ids(first)
    assert registry.load_count() == loads  # every copy used the loaded model
    assert len(registry.loaded_models()) == 1
    llm.close()  # the original's close() is its own: the copies still work
    assert ids(copy.deepcopy(llm).invoke("hello there")) == ids(first)


def test_embeddings_and_rerank_copy_and_pickle_after_use(bert: str, reranker: str) -> None:
    emb = LlamaCppEmbeddings(model_path=bert)
    rr = LlamaCppRerank(model_path=reranker, top_n=None)
    vec = emb.embed_query("a cat")
    docs = [Document(page_content=t) for t in ("a cat", "stock prices", "a kitten")]
    scores = rr.rerank("cats", [d.page_content for d in docs])
    contexts = len(registry.loaded_models())
    weights = model_handle.model_refcounts()
    for clone in _round_trips(emb):
        assert clone.embed_query("a cat") == vec
    for clone in _round_trips(rr):
        assert clone.rerank("cats", [d.page_content for d in docs]) == scores
        assert len(clone.compress_documents(docs, "cats")) == 3
    # the copies used the same contexts and weights: nothing was loaded again
    assert len(registry.loaded_models()) == contexts == 2
    assert model_handle.model_refcounts() == weights


# --------------------------------------------------------------------------- traced name


def test_traced_model_name_is_the_same_before_and_after_loading(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, max_tokens=2, n_slots=1, **GREEDY)
    before = llm._get_ls_params()["ls_model_name"]
    llm.invoke("hi")
    assert llm._get_ls_params()["ls_model_name"] == before == Path(tiny_llama).stem
    named = ChatLlamaCpp(model="tiny-llama", models_dir=str(Path(tiny_llama).parent))
    named.invoke("hi", max_tokens=2)
    assert named._get_ls_params()["ls_model_name"] == "tiny-llama"


# --------------------------------------------------------------------------- model options


def test_embeddings_and_rerank_take_model_models_dir_and_keep_alive(
    bert: str, reranker: str
) -> None:
    folder = str(Path(bert).parent)
    by_path = LlamaCppEmbeddings(model_path=bert).embed_query("a cat")
    by_name = LlamaCppEmbeddings(model="tiny-bert", models_dir=folder, keep_alive="0s")
    assert by_name.embed_query("a cat") == by_path
    assert LlamaCppEmbeddings(model=bert).embed_query("a cat") == by_path
    registry.unload()
    assert by_name.embed_query("a cat") == by_path
    # keep_alive=0: the context is freed right after the call
    assert wait_for(lambda: registry.loaded_models() == [])
    rr = LlamaCppRerank(model="tiny-reranker", models_dir=folder, keep_alive=-1)
    scores = rr.rerank("cats", ["a cat", "stocks"])
    assert [m.keep_alive for m in registry.loaded_models()] == [-1.0]
    assert scores == LlamaCppRerank(model_path=reranker).rerank("cats", ["a cat", "stocks"])
    with pytest.raises(ValueError, match="model= or model_path="):
        LlamaCppRerank(model="x", model_path=reranker)


@pytest.mark.parametrize("cls", [ChatLlamaCpp, LlamaCppEmbeddings, LlamaCppRerank])
def test_validate_model_on_init(cls: type, tmp_path: Path, tiny_llama: str) -> None:
    missing = str(tmp_path / "missing.gguf")
    cls(model_path=missing)  # off by default, as ChatOllama's: construction reads nothing
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        cls(model_path=missing, validate_model_on_init=True)
    with pytest.raises(ModelLoadError, match="nope"):
        cls(model="nope", models_dir=str(tmp_path), validate_model_on_init=True)
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        cls(model_path=str(not_gguf), validate_model_on_init=True)
    assert cls(model_path=tiny_llama, validate_model_on_init=True)
    assert registry.loaded_models() == []  # validating loads nothing


# --------------------------------------------------------------------------- logprobs


def test_each_streamed_chunk_carries_its_own_logprobs(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(
        model_path=tiny_llama, max_tokens=10, n_slots=1, **GREEDY
    )  # GREEDY asks for logprobs and two alternatives
    chunks = list(llm.stream("hello there", cache_prompt=False))
    with_text = [c for c in chunks if c.content]
    assert len(with_text) >= 2
    for c in with_text:  # ChatOpenAI's shape, each chunk its own tokens
        assert c.response_metadata["logprobs"]["content"]
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert isinstance(merged, AIMessageChunk)
    full = llm.invoke("hello there", cache_prompt=False)
    assert merged.response_metadata["logprobs"] == full.response_metadata["logprobs"]
    assert len(full.response_metadata["logprobs"]["content"]) == 10  # max_tokens


# --------------------------------------------------------------------------- images


def test_control_token_text_beside_an_image_is_plain_text(tiny_llama: str, mmproj: str) -> None:
    """``</s>`` in a message with an image reads as the characters, as it does without
    the image; it is never the end-of-sequence token."""
    vlm = ChatLlamaCpp(model_path=tiny_llama, mmproj_path=mmproj, n_slots=1, max_tokens=4)
    image = {"type": "image", "base64": _png(), "mime_type": "image/png"}

    def ask(text: str, with_image: bool = True) -> list[HumanMessage]:
        parts: list[Any] = [{"type": "text", "text": text}]
        return [HumanMessage(content=[*parts, image] if with_image else parts)]

    out = vlm.invoke(ask("Is <s>this</s> struck through?"), **GREEDY)
    assert out.usage_metadata and out.usage_metadata["output_tokens"] > 0
    tricky = vlm.render_prompt(ask("Is <s>this</s> struck through?")).tokens
    plain = vlm.render_prompt(ask("Is this struck through?")).tokens
    # the look-alikes added only their characters' tokens, no control token
    specials = (BOS_ID, EOS_ID)
    assert [t for t in tricky if t in specials] == [t for t in plain if t in specials]
    text_only = vlm.render_prompt(ask("Is <s>this</s> struck through?", with_image=False))
    no_media = [t for t in tricky if not isinstance(t, tuple)]
    look_alike = vlm.get_token_ids("<s>this</s>")
    for seq in (no_media, list(text_only.tokens)):
        assert any(seq[i : i + len(look_alike)] == look_alike for i in range(len(seq)))


# --------------------------------------------------------------------------- clear errors


def test_tool_choice_without_tools_is_an_error(tiny_llama: str) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, max_tokens=2, n_slots=1, **GREEDY)
    for choice in (
        "any",
        "required",
        "get_weather",
        {"type": "function", "function": {"name": "f"}},
    ):
        with pytest.raises(ValueError, match="no(ne are| tools are) bound|needs tools"):
            llm.invoke("hi", tool_choice=choice)
        with pytest.raises(ValueError, match="needs tools"):
            llm.bind_tools([], tool_choice=choice)
    assert registry.loaded_models() == []  # refused before loading anything
    # "auto" and "none" ask for nothing without tools: the reply is the plain one
    plain = reply_of(llm.invoke("hi", cache_prompt=False))
    assert reply_of(llm.invoke("hi", tool_choice="auto", cache_prompt=False)) == plain
    assert reply_of(llm.invoke("hi", tool_choice="none", cache_prompt=False)) == plain


def test_render_prompt_takes_the_tool_choice_invoke_takes(tiny_llama: str) -> None:
    """``render_prompt`` accepts what ``invoke`` accepts: "auto" and "none" without tools
    ask for nothing (the prompt is the plain one); a forced choice without tools is refused
    by both."""
    llm = ChatLlamaCpp(model_path=tiny_llama, max_tokens=2, n_slots=1, **GREEDY)
    msgs = [HumanMessage("hi")]
    plain = llm.render_prompt(msgs)
    for choice in ("auto", "none"):
        assert llm.render_prompt(msgs, tool_choice=choice).tokens == plain.tokens
    assert llm.get_num_tokens_from_messages(msgs) == plain.n_tokens
    for choice in ("any", "required", "get_weather"):
        with pytest.raises(ValueError, match="no(ne are| tools are) bound|needs tools"):
            llm.render_prompt(msgs, tool_choice=choice)


def test_default_max_tokens_is_fitted_to_a_small_context(
    tiny_llama: str, caplog: pytest.LogCaptureFixture
) -> None:
    llm = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, n_slots=1, **GREEDY)
    assert llm.max_tokens == 256 and "max_tokens" not in llm.model_fields_set
    with caplog.at_level(logging.WARNING, logger="langchain_llamacpp_local"):
        out = llm.invoke("hello there", stop=[])
    assert out.usage_metadata is not None
    assert out.usage_metadata["total_tokens"] <= 256
    assert any("default max_tokens=256" in r.getMessage() for r in caplog.records)
    with pytest.raises(ContextOverflowError, match="max_tokens=256"):
        llm.invoke("hello there", max_tokens=256)
    explicit = ChatLlamaCpp(model_path=tiny_llama, n_ctx=256, n_slots=1, max_tokens=256)
    with pytest.raises(ContextOverflowError, match="max_tokens=256"):
        explicit.invoke("hello there")
