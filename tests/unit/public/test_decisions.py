"""The decision model's pure parts: label probabilities, prompts, state rendering, answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from langchain_core.decisions import Box, Choice, Noul, NoulCriteria, Score
from langchain_core.messages import AIMessage, HumanMessage

from langchain_llamacpp_local.decisions import answer, ask, question_message, render_state
from langchain_llamacpp_local.errors import ImageInputError, InvalidRequestError
from langchain_llamacpp_local.llama.sampling import SamplingParams
from langchain_llamacpp_local.runtime.requests import EngineRequest, ScoreRequest
from langchain_llamacpp_local.runtime.scoring import (
    label_distribution,
    log_softmax,
    logsumexp,
    prefix_free,
    score_request,
)


def test_log_softmax_matches_the_definition_and_survives_huge_logits() -> None:
    row = np.array([1000.0, 999.0, -1000.0], dtype=np.float32)
    out = log_softmax(row)
    assert np.all(np.isfinite(out))
    assert math.isclose(float(np.exp(out).sum()), 1.0, rel_tol=1e-12)
    assert math.isclose(out[0] - out[1], 1.0, rel_tol=1e-9)


def test_log_softmax_refuses_non_finite_logits() -> None:
    with pytest.raises(Exception, match="non-finite"):
        log_softmax(np.array([0.0, np.nan]))


def test_logsumexp_of_nothing_is_minus_infinity() -> None:
    assert logsumexp([]) == -math.inf
    assert logsumexp([-math.inf, -math.inf]) == -math.inf
    assert math.isclose(logsumexp([0.0, 0.0]), math.log(2.0))


@settings(derandomize=True, max_examples=200)
@given(
    st.lists(
        st.one_of(st.floats(min_value=-1e6, max_value=0.0), st.just(-math.inf)),
        min_size=1,
        max_size=12,
    )
)
def test_label_distribution_is_finite_and_sums_to_one(logprobs: list[float]) -> None:
    probs = label_distribution(logprobs)
    assert len(probs) == len(logprobs)
    assert all(math.isfinite(p) and 0.0 <= p <= 1.0 for p in probs)
    assert math.isclose(sum(probs), 1.0, rel_tol=1e-9)


def test_label_distribution_renormalises_over_the_allowed_answers() -> None:
    # P(yes)=0.3, P(no)=0.1 of the vocabulary: 0.75 / 0.25 among the two answers
    probs = label_distribution([math.log(0.3), math.log(0.1)])
    assert probs == pytest.approx([0.75, 0.25])


def test_prefix_free() -> None:
    assert prefix_free([[1], [2], [3]])
    assert prefix_free([[1, 2], [1, 3]])
    assert not prefix_free([[1], [1, 0]])  # "1" and "10" split into digits
    assert not prefix_free([[5, 6], [5, 6]])


def _prepared(n: int) -> EngineRequest:
    return EngineRequest(tokens=list(range(n)), sampling=SamplingParams(), max_new=1)


def test_a_scoring_request_takes_the_prompt_and_room_for_its_longest_label() -> None:
    """One label's rows follow the prompt at a time: the longest is what the unified
    cache must leave room for; the state's end is the only checkpoint boundary."""
    prepared = _prepared(50)
    req = score_request(prepared, [[7], [8, 9, 10]], shared=30)
    assert isinstance(req, ScoreRequest)
    assert req.tokens == prepared.tokens and req.channel is prepared.channel
    assert req.cancel is prepared.cancel and req.deadline == prepared.deadline
    assert req.labels == ((7,), (8, 9, 10)) and not req.to_end
    assert req.max_new == 2  # the first token of a label is scored from the prompt's row
    assert req.boundaries == (30,)
    assert req.lora is None and req.sampler is None and req.speculative is None
    # "1" starts "10": every label is scored to the turn's end, all its tokens decoded
    digits = score_request(_prepared(50), [[1], [1, 0]], shared=0)
    assert digits.to_end and digits.max_new == 2 and digits.boundaries == ()
    assert score_request(_prepared(50), [[1]], shared=50).boundaries == ()


def test_a_scoring_request_keeps_the_callers_scheduling_options() -> None:
    prepared = EngineRequest(
        tokens=[1, 2, 3],
        sampling=SamplingParams(),
        max_new=1,
        priority="background",
        stall_budget_ms=40.0,
    )
    req = score_request(prepared, [[7]], shared=0)
    assert req.priority == "background" and req.stall_budget_ms == 40.0


def test_a_scoring_request_refuses_labels_without_tokens() -> None:
    with pytest.raises(InvalidRequestError, match="at least one answer label"):
        score_request(_prepared(5), [], shared=0)
    with pytest.raises(InvalidRequestError, match="no tokens"):
        score_request(_prepared(5), [[1], []], shared=0)


def test_noul_asks_yes_or_no_with_its_criteria() -> None:
    asked = ask("q", Noul(instructions="Is it risky?", criteria=NoulCriteria(true="T", false="F")))
    assert asked.labels == ("yes", "no")
    assert 'Answer "yes" if: T' in asked.text and 'Answer "no" if: F' in asked.text


def test_choice_labels_are_its_keys_and_score_labels_its_levels() -> None:
    c = ask("c", Choice(instructions="Team?", criteria={"billing": "pay", "tech": None}))
    assert c.labels == ("billing", "tech")
    s = ask("s", Score(instructions="How bad?", criteria=["low", "mid", "high"]))
    assert s.labels == ("0", "1", "2")


@pytest.mark.parametrize(
    ("question", "match"),
    [
        (Box(instructions="the cat"), "Box questions are not supported"),
        (Noul(instructions="   "), "instructions are empty"),
        (Choice.model_construct(instructions="x", criteria={}), "criteria are empty"),
        (Choice(instructions="x", criteria={" ": None}), "label is empty"),
        (
            Noul(instructions=[{"type": "image", "url": "http://x/y.png"}]),
            "media blocks in questions",
        ),
    ],
)
def test_bad_questions_name_the_problem(question: object, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        ask("q", question)  # type: ignore[arg-type]


def test_state_renders_text_json_messages_and_images() -> None:
    assert render_state("plain text") == ("plain text", [])
    image = {"type": "image", "base64": "AAAA", "mime_type": "image/png"}
    text, media = render_state(
        {
            "messages": [HumanMessage("hi"), AIMessage("", tool_calls=[_call()])],
            "shot": image,
            "n": 3,
        }
    )
    assert media == [image]
    assert '"role": "human"' in text and '"name": "rm"' in text and "[image 1]" in text


def test_state_refuses_audio() -> None:
    with pytest.raises(ImageInputError, match="'audio'"):
        render_state({"clip": {"type": "audio", "base64": "AAAA", "mime_type": "audio/wav"}})


def test_every_question_starts_with_the_same_state_text() -> None:
    a = question_message("STATE", [], "question one").content
    b = question_message("STATE", [], "question two").content
    assert isinstance(a, str) and isinstance(b, str)
    cut = a.index("question one")
    assert a[:cut] == b[:cut] and "STATE" in a[:cut]


def test_answers() -> None:
    noul = answer(ask("q", Noul(instructions="x")), [0.8, 0.2])
    assert noul.noul == 0.8  # type: ignore[union-attr]
    choice = answer(ask("c", Choice(instructions="x", criteria={"a": None, "b": None})), [0.3, 0.7])
    assert choice.choice == "b" and choice.confidence == 0.7  # type: ignore[union-attr]
    score = ask("s", Score(instructions="x", criteria=["l", "m", "h"]))
    sure = answer(score, [0.0, 0.0, 1.0])
    assert sure.score == 2.0 and sure.confidence == 1.0  # type: ignore[union-attr]
    unsure = answer(score, [1 / 3, 1 / 3, 1 / 3])
    assert unsure.score == pytest.approx(1.0)  # type: ignore[union-attr]
    assert unsure.confidence == pytest.approx(0.0, abs=1e-12)  # type: ignore[union-attr]
    assert unsure.legend == {0: "l", 1: "m", 2: "h"}  # type: ignore[union-attr]


def _call() -> dict[str, object]:
    return {"name": "rm", "args": {"path": "/"}, "id": "c1", "type": "tool_call"}


def test_dict_questions_are_validated_into_questions() -> None:
    from langchain_llamacpp_local.decisions import as_question

    q = as_question("q", {"type": "choice", "instructions": "Which?", "criteria": {"a": None}})
    assert isinstance(q, Choice) and list(q.criteria) == ["a"]
    assert isinstance(as_question("n", {"type": "noul", "instructions": "Ok?"}), Noul)
    with pytest.raises(InvalidRequestError, match="question 'q' is not a valid question"):
        as_question("q", {"type": "noul"})  # no instructions
    with pytest.raises(InvalidRequestError, match="question 'q' is not a valid question"):
        as_question("q", {"instructions": "no type"})
    with pytest.raises(InvalidRequestError, match="must be a Noul, Choice or Score"):
        as_question("q", "Risky?")


def test_rotations_list_the_options_in_another_order_with_the_same_labels() -> None:
    from langchain_llamacpp_local.decisions import variants

    q = Choice(instructions="Which?", criteria={"a": "A.", "b": "B.", "c": "C."})
    texts = [v.text for v in variants("q", q, "cyclic")]
    assert len(texts) == 3 and len(set(texts)) == 3
    assert all(v.labels == ("a", "b", "c") for v in variants("q", q, "cyclic"))
    assert texts[1].index("- b") < texts[1].index("- c") < texts[1].index("- a")
    assert texts[1].endswith('"b", "c", "a".')
    yes_no = [v.text for v in variants("n", Noul(instructions="Ok?"), "cyclic")]
    assert yes_no[0].endswith('"yes" or "no".') and yes_no[1].endswith('"no" or "yes".')
    levels = variants("s", Score(instructions="How?", criteria=["x", "y"]), "cyclic")[1].text
    assert levels.index("1: y") < levels.index("0: x")
    assert len(variants("q", q, None)) == 1


def test_debiased_answers_average_the_rotations() -> None:
    from langchain_llamacpp_local.decisions import debiased, variants

    q = Choice(instructions="Which?", criteria={"a": None, "b": None})
    asked = variants("q", q, "cyclic")
    # a model that always picks the option listed first: the average is even
    out = debiased(asked, [[0.9, 0.1], [0.1, 0.9]])
    assert out["q"].probabilities == pytest.approx({"a": 0.5, "b": 0.5})
    n = variants("n", Noul(instructions="Ok?"), None)
    assert debiased(n, [[0.7, 0.3]])["n"].noul == pytest.approx(0.7)
