"""Which special tokens a prompt may be cut before (pure decision, no model)."""

from __future__ import annotations

import pytest

from langchain_llamacpp_local.chat.prompt_tokens import safe_cuts
from langchain_llamacpp_local.llama.vocab import SpecialToken

START = SpecialToken("<|im_start|>", 10, lstrip=False, rstrip=False)
END = SpecialToken("<|im_end|>", 11, lstrip=False, rstrip=False)


def _specials(*extra: SpecialToken) -> list[SpecialToken]:
    table = [START, END, SpecialToken("<unk>", 0, False, False), *extra]
    return sorted(table, key=lambda s: len(s.text.encode()), reverse=True)


def test_message_markers_of_an_ordinary_vocabulary_are_cut_points() -> None:
    assert safe_cuts(_specials(), [10, 11]) == ("<|im_start|>", "<|im_end|>")
    assert safe_cuts(_specials(), [10, 10, 11]) == ("<|im_start|>", "<|im_end|>")


def test_a_candidate_that_is_not_a_special_token_is_left_out() -> None:
    assert safe_cuts(_specials(), [10, 999]) == ("<|im_start|>",)


@pytest.mark.parametrize(
    "other",
    [
        # contains the candidate: matched first, it would take the candidate's text
        SpecialToken("<|im_start|>system", 20, False, False),
        # the same text under another id
        SpecialToken("<|im_start|>", 21, False, False),
        # at least as long, ends inside the candidate's start
        SpecialToken("xxxxxxxxx<|im", 22, False, False),
        # at least as long, starts inside the candidate's end
        SpecialToken("t|>yyyyyyyyyyyy", 23, False, False),
    ],
    ids=["contains", "duplicate", "overlaps-its-start", "overlaps-its-end"],
)
def test_a_token_scanned_first_that_could_take_its_text_rules_it_out(other: SpecialToken) -> None:
    assert safe_cuts(_specials(other), [10]) == ()


def test_shorter_overlapping_tokens_are_scanned_after_it_and_do_not_matter() -> None:
    """llama.cpp matches the longest special tokens first: a shorter one that overlaps
    or is contained in the candidate finds its text already taken."""
    shorter = [
        SpecialToken("x<|im", 30, False, False),
        SpecialToken("|>y", 31, False, False),
        SpecialToken("im_start", 32, False, False),
    ]
    assert safe_cuts(_specials(*shorter), [10]) == ("<|im_start|>",)


@pytest.mark.parametrize(
    "cand",
    [
        SpecialToken("<|im_start|>", 10, lstrip=True, rstrip=False),  # strips text before
        SpecialToken("\n<|im_start|>", 10, False, False),  # a neighbour's strip eats it
        SpecialToken("<|im_start|> ", 10, False, False),
        SpecialToken("<a<a", 10, False, False),  # overlaps itself
    ],
    ids=["lstrip", "leading-space", "trailing-space", "self-overlap"],
)
def test_tokens_whose_match_depends_on_their_surroundings_are_not_cut_points(
    cand: SpecialToken,
) -> None:
    assert safe_cuts([cand, END], [10]) == ()


def test_an_rstrip_token_is_a_cut_point() -> None:
    """rstrip strips the text after the token: inside the piece it starts."""
    cand = SpecialToken("<|im_start|>", 10, lstrip=False, rstrip=True)
    assert safe_cuts([cand, END], [10]) == ("<|im_start|>",)
