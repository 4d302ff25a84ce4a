"""``ChatLlamaCpp(draft_model_path=...)`` end to end: the draft-model proposer in the
worker's verify loop gives the output of plain decoding, and a bad draft fails the load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.errors import IncompatibleDraftModelError
from langchain_llamacpp_local.llama import model_handle
from tests.compare import GREEDY, assert_identical, assert_same_greedy
from tests.gguf_models import write_scripted_llama, write_tiny_llama_vocab

RAW = "{{ messages[-1].content }}"
CYCLE = "abcd efg."


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Prints ``CYCLE`` over and over; after ``.`` it may also end (p ~ 0.73 to go on)."""
    nxt = {c: {CYCLE[(i + 1) % len(CYCLE)]: 10.0} for i, c in enumerate(CYCLE)}
    nxt["."]["</s>"] = 9.0
    path = tmp_path_factory.mktemp("draft-chat") / "cycle.gguf"
    return str(write_scripted_llama(path, transitions=nxt))


def _llm(path: str, **kw: Any) -> ChatLlamaCpp:
    base: dict[str, Any] = {"max_tokens": 40, "n_ctx": 512, "chat_template": RAW, **GREEDY}
    return ChatLlamaCpp(model_path=path, **{**base, **kw})


def test_own_draft_is_accepted_and_identical(cycle_model: str) -> None:
    plain = _llm(cycle_model)
    spec = _llm(cycle_model, draft_model_path=cycle_model)
    try:
        ref = plain.invoke("a", cache_prompt=False)
        got = spec.invoke("a", cache_prompt=False)  # draft_model_path: "draft" by default
        assert got.content == ref.content == ("bcd efg." + CYCLE * 5)[:40]
        assert_identical(got, ref)
        meta = got.response_metadata["speculative"]
        assert meta["type"] == "draft"
        # the draft stops before a token it is not sure of (after ".": p < p_min)
        assert 0 < meta["accepted"] == meta["drafted"]
        # a second request reuses the draft's cached prefix and still matches
        again = spec.invoke("a", cache_prompt=True)
        assert_identical(again, ref)
        # per call: speculation off, or n-gram instead of the draft model
        off = spec.invoke("a", speculative=None, cache_prompt=False)
        assert "speculative" not in off.response_metadata
        assert (
            spec.invoke("a", speculative="ngram").response_metadata["speculative"]["type"]
            == "ngram"
        )
    finally:
        plain.close()
        spec.close()


def test_recurrent_draft_for_an_attention_target(tiny_llama: str, tiny_mamba: str) -> None:
    """A Mamba draft (same vocabulary) rolls back through its checkpoints; the tiny F32
    target verifies several tokens only outside deterministic mode."""
    plain = _llm(tiny_llama, chat_template=None)
    spec = _llm(tiny_llama, chat_template=None, draft_model_path=tiny_mamba)
    try:
        for prompt in ("Tell me a story.", "Tell me a story. Again:"):
            ref = plain.invoke(prompt, cache_prompt=False)
            got = spec.invoke(prompt)
            assert_same_greedy(got, ref)
            assert got.response_metadata["speculative"]["type"] == "draft"
    finally:
        plain.close()
        spec.close()


def test_incompatible_draft_fails_the_load_and_frees_everything(
    tiny_llama: str, models_dir: Path
) -> None:
    other = str(write_tiny_llama_vocab(models_dir / "tiny-chat-other.gguf", extra_tokens=200))
    loaded = model_handle.model_refcounts()
    llm = _llm(tiny_llama, draft_model_path=other)
    with pytest.raises(IncompatibleDraftModelError, match="vocabulary sizes differ") as info:
        llm.load()
    assert other in str(info.value) and tiny_llama in str(info.value)
    llm.close()
    assert model_handle.model_refcounts() == loaded
