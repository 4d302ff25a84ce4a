"""The control-text scan's memo and the batch filling (no model)."""

from __future__ import annotations

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.llama import vocab
from langchain_llamacpp_local.llama.context import fill_batch
from langchain_llamacpp_local.llama.vocab import VocabInfo


def _info() -> VocabInfo:
    return VocabInfo(
        specials=(), control_texts=frozenset({"<|im_start|>", "<|im_end|>"}), bound_exact=True
    )


def test_a_long_text_scanned_again_gives_the_same_answer() -> None:
    info = _info()
    text = "x" * 300 + "<|im_end|> and <|im_start|>" + "y" * 10
    first = info.find_control(text)
    assert first == ["<|im_start|>", "<|im_end|>"]
    first.append("changed by the caller")  # the memo hands out copies
    assert info.find_control(text) == ["<|im_start|>", "<|im_end|>"]
    assert info.find_control("y" * 400) == []
    assert info.find_control("<|im_end|>") == ["<|im_end|>"]  # short: scanned each time
    assert "<|im_end|>" not in info._found  # type: ignore[attr-defined]


def test_the_scan_memo_is_bounded() -> None:
    info = _info()
    for i in range(vocab._MEMO_TEXTS + 10):
        assert info.find_control(f"{i:08d}" + "z" * vocab._MEMO_MIN_CHARS) == []
    assert len(info._found) <= vocab._MEMO_TEXTS  # type: ignore[attr-defined]


def test_fill_batch_writes_every_column() -> None:
    batch = C.llama_batch_init(16, 0, 4)
    try:
        fill_batch(batch, [5, 6, 7], [10, 11, 12], [0, 2, 3], [False, False, True])
        assert batch.n_tokens == 3
        assert [batch.token[i] for i in range(3)] == [5, 6, 7]
        assert [batch.pos[i] for i in range(3)] == [10, 11, 12]
        assert [batch.n_seq_id[i] for i in range(3)] == [1, 1, 1]
        assert [batch.seq_id[i][0] for i in range(3)] == [0, 2, 3]
        assert [batch.logits[i] for i in range(3)] == [0, 0, 1]
        fill_batch(batch, [9], [4], [1], [True])
        assert batch.n_tokens == 1
        assert (batch.token[0], batch.pos[0], batch.seq_id[0][0], batch.logits[0]) == (9, 4, 1, 1)
        fill_batch(batch, [], [], [], [])
        assert batch.n_tokens == 0
    finally:
        C.llama_batch_free(batch)
