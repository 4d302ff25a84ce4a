"""The draft-model proposer on real llama.cpp with tiny generated GGUFs.

Reference continuations come from the target engine itself, decoding greedily one
token at a time (what the draft must reproduce when it is the target's own file).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from langchain_llamacpp_local.errors import IncompatibleDraftModelError, ModelLoadError
from langchain_llamacpp_local.llama import model_handle
from langchain_llamacpp_local.llama.draft import DraftModel, draft_config
from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.probes import MemoryKind
from langchain_llamacpp_local.runtime.speculative import Proposer
from tests.gguf_models import (
    BOS_ID,
    EOS_ID,
    byte_token,
    write_scripted_llama,
    write_tiny_llama_vocab,
)

N_CTX = 256


def _engine(path: str, n_seq: int = 2) -> Engine:
    return Engine(LoadConfig(model_path=path, n_ctx=N_CTX, n_slots=n_seq, flash_attn=False))


@pytest.fixture
def target(tiny_llama: str) -> Iterator[Engine]:
    eng = _engine(tiny_llama)
    yield eng
    eng.close()


def _draft(path: str, target: Engine, *, p_min: float = 0.0) -> DraftModel:
    return DraftModel(draft_config(target.config, path, n_ctx=target.n_ctx), target, p_min=p_min)


def greedy(eng: Engine, history: Sequence[int], n: int, seq: int = 0) -> list[int]:
    """The target's own greedy continuation of ``history`` (``n`` tokens or up to EOG)."""
    eng.seq_rm(seq, -1, -1)
    eng.decode(list(history), 0, seq)
    out: list[int] = []
    while True:
        tok = int(np.argmax(eng.logits(-1)))
        out.append(tok)
        if len(out) == n or eng.is_eog(tok):
            return out
        eng.decode_batch([tok], [len(history) + len(out) - 1], [seq], [True])


def _text(eng: Engine, s: str) -> list[int]:
    return eng.tokenize(s, add_special=True)


def test_own_draft_proposes_the_targets_greedy_continuation(
    tiny_llama: str, target: Engine
) -> None:
    draft = _draft(tiny_llama, target)
    try:
        assert isinstance(draft, Proposer)
        history = _text(target, "def f(x): return x + 1")
        drafts = draft.propose(0, history, 8)
        assert len(drafts) == 8
        assert drafts == greedy(target, history, 8)
    finally:
        draft.close()
        draft.close()  # idempotent
    assert draft.propose(0, history, 4) == []  # closed: no draft, no error


def test_reuses_the_longest_common_prefix(tiny_llama: str, target: Engine) -> None:
    draft = _draft(tiny_llama, target)
    eng = draft.engine
    assert eng is not None
    try:
        history = _text(target, "The quick brown fox")
        first = draft.propose(0, history, 4)
        assert draft.n_decoded == len(history) + 3  # the last draft is never decoded
        assert eng.seq_pos_max(0) == len(history) + 2

        # the target accepted 2 drafts and sampled another token: only it is decoded
        other = next(t for t in range(3, 200) if t != first[2])
        h2 = [*history, *first[:2], other]
        before = draft.n_decoded
        second = draft.propose(0, h2, 4)
        assert draft.n_decoded - before == 1 + 3
        assert second == greedy(target, h2, 4)

        # all accepted plus the bonus token: the last draft and the bonus are new
        h3 = [*h2, *second, 42]
        before = draft.n_decoded
        third = draft.propose(0, h3, 4)
        assert draft.n_decoded - before == 2 + 3
        assert third == greedy(target, h3, 4)

        # the same history again: its last token is re-decoded for its logits
        before = draft.n_decoded
        assert draft.propose(0, h3, 4) == third
        assert draft.n_decoded - before == 1 + 3
    finally:
        draft.close()


def test_sequences_are_independent(tiny_llama: str, target: Engine) -> None:
    draft = _draft(tiny_llama, target)
    try:
        ha = _text(target, "alpha beta gamma")
        hb = _text(target, "one two three four five")
        da = draft.propose(0, ha, 5)
        db = draft.propose(1, hb, 5)
        ha2 = [*ha, *da[:1], 7]
        da2 = draft.propose(0, ha2, 5)
        hb2 = [*hb, *db, 9]
        db2 = draft.propose(1, hb2, 5)
        assert da == greedy(target, ha, 5)
        assert db == greedy(target, hb, 5, seq=1)
        assert da2 == greedy(target, ha2, 5)
        assert db2 == greedy(target, hb2, 5, seq=1)
        with pytest.raises(ValueError, match="seq_id 2 out of range"):
            draft.propose(2, ha, 5)
    finally:
        draft.close()


def test_forget_clears_the_sequence(tiny_llama: str, target: Engine) -> None:
    draft = _draft(tiny_llama, target)
    eng = draft.engine
    assert eng is not None
    try:
        history = _text(target, "hello there")
        drafts = draft.propose(0, history, 3)
        draft.propose(1, history, 3)
        draft.forget(0)
        assert eng.seq_pos_max(0) == -1
        assert eng.seq_pos_max(1) == len(history) + 1  # the other sequence is untouched
        before = draft.n_decoded
        assert draft.propose(0, history, 3) == drafts
        assert draft.n_decoded - before == len(history) + 2
    finally:
        draft.close()


def test_window_and_vocabulary_limits_give_no_draft(
    tiny_llama: str, target: Engine, models_dir: Path
) -> None:
    draft = _draft(tiny_llama, target)
    try:
        n_ctx = draft.n_ctx
        assert n_ctx >= target.n_ctx
        assert draft.propose(0, [BOS_ID] + [byte_token(65)] * n_ctx, 4) == []
        # near the end of the window the draft is shortened to fit: positions
        # n_ctx-2 and n_ctx-1 hold two drafts, the third is never decoded
        near = [BOS_ID] + [byte_token(66)] * (n_ctx - 3)
        assert len(draft.propose(0, near, 8)) == 3
        assert draft.propose(0, near, 0) == []
        assert draft.propose(0, [], 4) == []
        # an image position of a multimodal prompt: the draft cannot read it
        image: list = [BOS_ID, ("media", "digest", 0), byte_token(65)]
        assert draft.propose(0, image, 4) == []
        assert draft.engine is not None and draft.engine.seq_pos_max(0) == -1
    finally:
        draft.close()

    # a target whose vocabulary has 100 more tokens (compatible): a history with one
    # of them gives no draft instead of a failed decode
    big = write_tiny_llama_vocab(models_dir / "tiny-vocab-plus100.gguf", extra_tokens=100)
    big_target = _engine(str(big))
    draft = _draft(tiny_llama, big_target)
    try:
        history = [BOS_ID, byte_token(65), 300]
        assert draft.propose(0, history, 4) == []
        assert draft.propose(0, history[:2], 4) == greedy(target, history[:2], 4)
    finally:
        draft.close()
        big_target.close()


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"extra_tokens": 200}, "vocabulary sizes differ by 200 tokens"),
        ({"renamed": {10: "<zz>"}}, "token 10 differs"),
        ({"add_bos": False}, "add_bos differs"),
    ],
)
def test_incompatible_vocabulary_is_refused(
    target: Engine, models_dir: Path, kwargs: dict, reason: str
) -> None:
    name = "tiny-other-" + "-".join(f"{k}" for k in kwargs) + ".gguf"
    path = str(write_tiny_llama_vocab(models_dir / name, **kwargs))
    loaded = model_handle.model_refcounts()
    with pytest.raises(IncompatibleDraftModelError, match=reason) as info:
        _draft(path, target)
    assert isinstance(info.value, ModelLoadError)
    assert path in str(info.value) and target.config.model_path in str(info.value)
    assert model_handle.model_refcounts() == loaded  # the draft's model was freed


def test_vocab_differences_below_the_checked_ids_are_accepted(
    target: Engine, models_dir: Path
) -> None:
    """Like llama.cpp, token texts are compared from id 5 on (special tokens may differ)."""
    path = str(write_tiny_llama_vocab(models_dir / "tiny-unk.gguf", renamed={0: "<pad>"}))
    draft = _draft(path, target)
    try:  # accepted, and it drafts (the same weights: the target's own continuation)
        history = _text(target, "def f(x): return x + 1")
        assert draft.propose(0, history, 8) == greedy(target, history, 8)
    finally:
        draft.close()


def test_built_from_the_targets_config(tiny_llama: str, target: Engine) -> None:
    """The worker passes the target's LoadConfig with ``draft_model_path`` set."""
    cfg = dataclasses.replace(target.config, draft_model_path=tiny_llama)
    draft = DraftModel(cfg, target, p_min=0.0)
    try:
        assert draft.engine is not None
        assert draft.engine.config.draft_model_path is None
        assert draft.engine.n_slots == target.n_slots and draft.n_ctx == target.n_ctx
        history = _text(target, "from the worker")
        assert draft.propose(1, history, 3) == greedy(target, history, 3, seq=1)
    finally:
        draft.close()


def test_slot_count_must_match(tiny_llama: str, target: Engine) -> None:
    cfg = LoadConfig(model_path=tiny_llama, n_ctx=N_CTX, n_slots=1)
    with pytest.raises(ValueError, match="one sequence per target slot"):
        DraftModel(cfg, target)


@pytest.mark.parametrize("arch", ["tiny_mamba", "tiny_hybrid"])
def test_recurrent_draft_rolls_back_through_its_checkpoint(
    arch: str, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(arch)
    target = _engine(path)
    draft = _draft(path, target)
    try:
        assert draft.engine is not None
        assert draft.engine.memory_kind is MemoryKind.FULL_ONLY
        history = _text(target, "state space models")
        first = draft.propose(0, history, 4)
        assert first == greedy(target, history, 4)
        # two drafts rejected: rolled back to the history, not re-read
        other = next(t for t in range(3, 200) if t != first[2])
        h2 = [*history, *first[:2], other]
        before = draft.n_decoded
        second = draft.propose(0, h2, 4)
        assert draft.n_decoded - before == 3 + 3
        assert second == greedy(target, h2, 4)
        # a different history: nothing reusable, the sequence is re-read
        h3 = _text(target, "other words")
        before = draft.n_decoded
        assert draft.propose(0, h3, 4) == greedy(target, h3, 4)
        assert draft.n_decoded - before == len(h3) + 3
    finally:
        draft.close()
        target.close()


def test_tiny_llama_target_with_a_mamba_draft(target: Engine, tiny_mamba: str) -> None:
    """A draft of another architecture with the same vocabulary is compatible."""
    reference = _engine(tiny_mamba)
    draft = _draft(tiny_mamba, target)
    try:
        history = _text(target, "mixing architectures")
        assert draft.propose(1, history, 5) == greedy(reference, history, 5)
    finally:
        draft.close()
        reference.close()


def test_p_min_stops_at_a_low_confidence_token(models_dir: Path) -> None:
    path = str(
        write_scripted_llama(
            models_dir / "scripted-draft.gguf",
            transitions={
                "a": {"b": 20.0},
                "b": {"c": 20.0},
                "c": {"d": 1.0, "e": 0.9},  # p(d) ~ 0.2 among the top 10
            },
        )
    )
    target = _engine(path)
    try:
        a, b, c, d = (byte_token(ord(ch)) for ch in "abcd")
        confident = _draft(path, target, p_min=0.75)
        try:
            assert confident.propose(0, [BOS_ID, a], 8) == [b, c]
        finally:
            confident.close()
        anything = _draft(path, target, p_min=0.0)
        try:  # "d" goes to EOS: drafting stops after an end-of-generation token
            assert anything.propose(0, [BOS_ID, a], 8) == [b, c, d, EOS_ID]
        finally:
            anything.close()
        with pytest.raises(ValueError, match="p_min"):
            _draft(path, target, p_min=1.5)
    finally:
        target.close()
