"""Grammar bounds on llama.cpp's own grammar engine: the repetitions
``json_schema_to_grammar`` writes for large ``{m,n}`` bounds (chunked above llama.cpp's
cap) accept exactly the lengths the schema allows, fed token by token over the tiny
llama's vocabulary. The bounds that are refused before llama.cpp are in
tests/unit/public/test_validation.py."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import llama_cpp.llama_cpp as C
import numpy as np
import pytest

from langchain_llamacpp_local.llama.json_grammar import json_schema_to_grammar
from tests.gguf_models import write_tiny_llama


class _Vocab:
    """The tiny llama's vocab (byte tokens: one token per ASCII character)."""

    def __init__(self, path: Path) -> None:
        from langchain_llamacpp_local.llama.backend import init_backend

        init_backend()
        params = C.llama_model_default_params()
        self.model = C.llama_model_load_from_file(str(path).encode(), params)
        assert self.model
        self.vocab = C.llama_model_get_vocab(self.model)

    def tokens(self, text: str) -> list[int]:
        data = text.encode()
        arr = (C.llama_token * (len(data) + 8))()
        n = C.llama_tokenize(self.vocab, data, len(data), arr, len(arr), False, False)
        assert n >= 0
        return list(arr[:n])

    def accepts(self, grammar: str, text: str) -> bool:
        """Whether ``grammar`` accepts exactly ``text`` (fed token by token)."""
        smpl = C.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        assert smpl, "grammar did not compile"
        try:
            eos = int(C.llama_vocab_eos(self.vocab))
            for tok in [*self.tokens(text), eos]:
                cand = np.zeros(
                    1, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)]
                )
                cand["id"] = tok
                arr = C.llama_token_data_array(
                    data=cand.ctypes.data_as(C.llama_token_data_p),
                    size=1,
                    selected=-1,
                    sorted=False,
                )
                C.llama_sampler_apply(smpl, ctypes.byref(arr))
                if not np.isfinite(cand["logit"][0]):
                    return False
                if tok != eos:
                    C.llama_sampler_accept(smpl, tok)
            return True
        finally:
            C.llama_sampler_free(smpl)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Vocab]:
    v = _Vocab(write_tiny_llama(tmp_path_factory.mktemp("validation") / "tiny.gguf"))
    yield v
    C.llama_model_free(v.model)


@pytest.mark.parametrize(("lo", "hi"), [(3, 4), (0, 2500), (1500, 2100), (2000, 2000)])
def test_string_length_bounds_are_exact(vocab: _Vocab, lo: int, hi: int) -> None:
    """Flat ``{m,n}`` repetitions (chunked above llama.cpp's 2000 cap) keep every bound."""
    grammar = json_schema_to_grammar({"type": "string", "minLength": lo, "maxLength": hi})
    assert grammar.count("(") < 20  # flat, not thousands of nested groups
    for n in {lo, hi, (lo + hi) // 2}:
        assert vocab.accepts(grammar, '"' + "a" * n + '" '), n
    assert not vocab.accepts(grammar, '"' + "a" * (hi + 1) + '" ')
    if lo:
        assert not vocab.accepts(grammar, '"' + "a" * (lo - 1) + '" ')


def test_array_item_bounds_are_exact(vocab: _Vocab) -> None:
    grammar = json_schema_to_grammar(
        {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2003}
    )
    assert vocab.accepts(grammar, "[1,1] ")
    assert vocab.accepts(grammar, "[" + ",".join(["1"] * 2003) + "] ")
    assert not vocab.accepts(grammar, "[" + ",".join(["1"] * 2004) + "] ")
    assert not vocab.accepts(grammar, "[1] ")


def test_regex_repetition_is_flat_and_exact(vocab: _Vocab) -> None:
    grammar = json_schema_to_grammar({"type": "string", "pattern": "^(ab){2,2001}$"})
    assert vocab.accepts(grammar, '"' + "ab" * 2001 + '" ')
    assert not vocab.accepts(grammar, '"' + "ab" * 2002 + '" ')
    assert not vocab.accepts(grammar, '"ab" ')
