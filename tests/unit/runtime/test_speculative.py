"""Speculative decoding helpers without a model: n-gram lookup, draft length, settings."""

from __future__ import annotations

import pytest

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.chat.request_options import check_speculative
from langchain_llamacpp_local.runtime.speculative import (
    DraftController,
    NgramProposer,
    Proposer,
    ngram_draft,
)

# --------------------------------------------------------------------------- n-gram lookup


def test_ngram_proposes_the_continuation_of_an_earlier_match() -> None:
    assert ngram_draft([1, 2, 3, 4, 9, 2, 3], 5) == [4, 9, 2, 3]
    assert ngram_draft([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]


def test_ngram_prefers_the_longest_match_then_the_most_recent() -> None:
    # "7 2 3" matches at the end of both earlier occurrences of "2 3", only the first has "7"
    h = [7, 2, 3, 10, 11, 5, 2, 3, 20, 21, 7, 2, 3]
    assert ngram_draft(h, 2) == [10, 11]
    # equal length: the most recent earlier occurrence wins
    h2 = [2, 3, 10, 2, 3, 20, 2, 3]
    assert ngram_draft(h2, 1) == [20]


def test_ngram_needs_at_least_ngram_min_matching_tokens() -> None:
    assert ngram_draft([5, 1, 9, 1], 3) == []  # only the last token (1-gram) matches
    assert ngram_draft([5, 1, 9, 1], 3, ngram_min=1) == [9, 1]
    assert ngram_draft([1, 2, 3], 4) == []
    assert ngram_draft([], 4) == []
    assert ngram_draft([1, 2, 1, 2], 0) == []


def test_ngram_draft_stops_at_the_end_of_history() -> None:
    assert ngram_draft([1, 2, 1, 2, 1, 2], 8) == [1, 2]


def test_ngram_proposer_is_a_proposer() -> None:
    p = NgramProposer()
    assert isinstance(p, Proposer)
    assert p.propose(0, [4, 5, 6, 4, 5], 3) == [6, 4, 5]
    p.forget(0)
    p.close()
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(ngram_max=2, ngram_min=3)


# --------------------------------------------------------------------------- draft length


def test_controller_grows_on_full_acceptance_and_shrinks_on_rejection() -> None:
    c = DraftController(n_max=8, length=2)
    assert c.want() == 2
    c.update(2, 2)
    assert c.want() == 4
    c.update(4, 4)
    assert c.want() == 8
    c.update(8, 8)
    assert c.want() == 8  # capped
    c.update(8, 3)
    assert c.want() == 4  # accepted + 1
    assert (c.drafted, c.accepted) == (22, 17)


def test_controller_pauses_while_acceptance_stays_low_then_retries() -> None:
    c = DraftController(n_max=8, pause_steps=3)
    steps = 0
    while c.want() > 0:
        c.update(4, 0)
        steps += 1
    assert steps < 6  # a few rejected drafts switch it off (the loop saw the 1st pause step)
    assert [c.want() for _ in range(2)] == [0, 0]  # pause_steps in all
    assert c.want() == c.n_min  # then it tries again with the shortest draft
    c.update(1, 0)
    assert c.want() == 0 and c.paused == 5  # paused again, twice as long


def test_controller_rejects_bad_limits() -> None:
    with pytest.raises(ValueError, match="n_min"):
        DraftController(n_max=0)


# --------------------------------------------------------------------------- settings


def test_check_speculative() -> None:
    check_speculative(None, 8, draft_model=None)
    check_speculative("ngram", 1, draft_model=None)
    check_speculative("draft", 16, draft_model="small.gguf")
    with pytest.raises(ValueError, match="'eagle'"):
        check_speculative("eagle", 8, draft_model=None)
    with pytest.raises(ValueError, match="draft_model_path"):
        check_speculative("draft", 8, draft_model=None)
    with pytest.raises(ValueError, match="speculative_max_draft"):
        check_speculative("ngram", 0, draft_model=None)
    with pytest.raises(TypeError, match="speculative_max_draft"):
        check_speculative("ngram", 2.5, draft_model=None)


def test_chat_model_validates_speculative_settings() -> None:
    with pytest.raises(ValueError, match="speculative"):
        ChatLlamaCpp(model_path="m.gguf", speculative="eagle")
    with pytest.raises(ValueError, match="draft_model_path"):
        ChatLlamaCpp(model_path="m.gguf", speculative="draft")
    with pytest.raises(ValueError, match="speculative_max_draft"):
        ChatLlamaCpp(model_path="m.gguf", speculative="ngram", speculative_max_draft=0)
    llm = ChatLlamaCpp(model_path="m.gguf", draft_model_path="d.gguf")
    assert llm._load_config().draft_model_path.endswith("d.gguf")
    # a per-call override is checked the same way, before anything is loaded
    with pytest.raises(ValueError, match="'eagle'"):
        ChatLlamaCpp(model_path="m.gguf").invoke("hi", speculative="eagle")
    with pytest.raises(ValueError, match="speculative_max_draft"):
        ChatLlamaCpp(model_path="m.gguf").invoke("hi", speculative_max_draft=-1)
