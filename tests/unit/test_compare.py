"""The greedy comparator of the integration tests (tests/compare.py), on made-up replies:
a clear difference fails, a near-tie passes only as a tie broken the other way."""

from __future__ import annotations

from langchain_core.messages import AIMessage

from tests.compare import TIE, greedy_mismatch


def _reply(steps: list[tuple[int, float, int, float]], finish: str = "length") -> AIMessage:
    """A reply whose token ``i`` is ``steps[i] = (id, logprob, runner-up id, its logprob)``."""
    content = [
        {
            "id": tok,
            "logprob": lp,
            "top_logprobs": [{"id": tok, "logprob": lp}, {"id": alt, "logprob": alt_lp}],
        }
        for tok, lp, alt, alt_lp in steps
    ]
    return AIMessage(
        content="", response_metadata={"logprobs": {"content": content}, "finish_reason": finish}
    )


CLEAR = (1, -0.1, 2, -3.0)
TIED = (5, -0.70, 6, -0.70 - TIE / 2)
BROKEN = (6, -0.70 - TIE / 2, 5, -0.70)  # the same tie, broken the other way


def test_the_same_generation_passes_and_a_logprob_drift_fails() -> None:
    ref = _reply([CLEAR, TIED, CLEAR])
    assert greedy_mismatch(_reply([CLEAR, TIED, CLEAR]), ref) is None
    drift = _reply([CLEAR, (5, -0.75, 6, -0.71), CLEAR])
    assert "logprob" in (greedy_mismatch(drift, ref) or "")
    assert greedy_mismatch(drift, ref, tol=0.1) is None


def test_a_different_token_at_a_clear_choice_fails() -> None:
    ref = _reply([CLEAR, CLEAR])
    assert "clear choice" in (greedy_mismatch(_reply([CLEAR, (2, -3.0, 1, -0.1)]), ref) or "")


def test_a_near_tie_passes_only_as_the_same_tie_broken_the_other_way() -> None:
    ref = _reply([CLEAR, TIED, CLEAR, CLEAR])
    # broken the other way: the texts differ from there, nothing after it is compared
    assert greedy_mismatch(_reply([CLEAR, BROKEN, (9, -0.2, 8, -0.3), CLEAR]), ref) is None
    # a third token at the tie is no tie broken differently
    third = _reply([CLEAR, (7, -0.70, 5, -0.71), CLEAR, CLEAR])
    assert "runner-up" in (greedy_mismatch(third, ref) or "")
    # the runner-up, but this side did not see the reference's choice tied with it
    unseen = _reply([CLEAR, (6, -0.70 - TIE / 2, 9, -0.9), CLEAR, CLEAR])
    assert "top two" in (greedy_mismatch(unseen, ref) or "")
    # the runner-up at a log-probability far from the reference's
    far = _reply([CLEAR, (6, -0.2, 5, -0.70), CLEAR, CLEAR])
    assert "tied token logprob" in (greedy_mismatch(far, ref) or "")


def test_lengths_and_finish_reasons_are_compared() -> None:
    ref = _reply([CLEAR, CLEAR, CLEAR])
    assert "2 tokens vs 3" in (greedy_mismatch(_reply([CLEAR, CLEAR]), ref) or "")
    assert "4 tokens vs 3" in (greedy_mismatch(_reply([CLEAR] * 4), ref) or "")
    stopped = _reply([CLEAR, CLEAR, CLEAR], finish="stop")
    assert "finish reason" in (greedy_mismatch(stopped, ref) or "")
    # after a tie, two generations both cut at max_tokens have its length
    tied = _reply([CLEAR, TIED, CLEAR])
    assert greedy_mismatch(_reply([CLEAR, BROKEN, CLEAR]), tied) is None
    short = _reply([CLEAR, BROKEN])
    assert "both cut at max_tokens" in (greedy_mismatch(short, tied) or "")
    # a generation that ended at its end-of-generation token after the tie may be shorter
    assert greedy_mismatch(_reply([CLEAR, BROKEN], finish="stop"), tied) is None
