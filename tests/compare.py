"""Comparing greedy generations from different cache paths.

The cached and the fresh path decode the same tokens in different batch shapes
(and KV cell layouts), so llama.cpp's kernels round differently: about 1e-4 in
log-probability. Greedy outputs are therefore identical except where the
reference's two best tokens are practically tied; a real cache bug shows up as a
large difference at a clear choice. Requests must use ``logprobs=True,
top_logprobs=2``.
"""

from __future__ import annotations

from langchain_core.messages import BaseMessage

TIE = 0.02  # log-probability gap below which two tokens count as tied
LOGPROB_TOL = 0.02
GREEDY = {"temperature": 0.0, "logprobs": True, "top_logprobs": 2}


def entries(msg: BaseMessage) -> list[dict]:
    return msg.response_metadata["logprobs"]["content"]


def ids(msg: BaseMessage) -> list[int]:
    return [e["id"] for e in entries(msg)]


def _finish(msg: BaseMessage) -> object:
    return msg.response_metadata.get("finish_reason")


def _tie_break(i: int, x: dict, y: dict, gap: float, tol: float) -> str | None:
    """Why ``got``'s token ``x`` is no tie broken the other way at the reference's ``y``
    (None if it is one): the reference is at a near-tie, ``got`` took its runner-up, and
    both sides saw the two tokens with the same log-probabilities."""
    if gap >= TIE:
        return f"token {i}: {x['id']} != {y['id']} at a clear choice (gap {gap:.4f})"
    runner_up = y["top_logprobs"][1]
    if x["id"] != runner_up["id"]:
        return (
            f"token {i}: {x['id']} is neither the reference's choice {y['id']} nor its "
            f"runner-up {runner_up['id']}"
        )
    if abs(x["logprob"] - runner_up["logprob"]) > tol:
        return f"token {i}: tied token logprob {x['logprob']:.5f} vs {runner_up['logprob']:.5f}"
    seen = {t["id"]: t["logprob"] for t in x.get("top_logprobs") or ()}
    if y["id"] not in seen:
        return f"token {i}: the reference's choice {y['id']} is not in this side's top two"
    if abs(seen[y["id"]] - y["logprob"]) > tol:
        return f"token {i}: tied token logprob {seen[y['id']]:.5f} vs {y['logprob']:.5f}"
    return None


def greedy_mismatch(got: BaseMessage, ref: BaseMessage, *, tol: float = LOGPROB_TOL) -> str | None:
    """Why ``got`` is not the same greedy generation as ``ref`` (None if it is).

    Token by token: the same token with a log-probability within ``tol``. A different
    token passes at one near-tie only (the generations are different texts after it, so
    no later position can be compared), and only as a tie broken the other way, seen so
    by both sides (:func:`_tie_break`). The lengths and finish reasons must agree; after
    a tie, lengths must still agree where both ran to ``max_tokens``."""
    a, b = entries(got), entries(ref)
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        top = y["top_logprobs"]
        gap = top[0]["logprob"] - top[1]["logprob"] if len(top) > 1 else float("inf")
        if x["id"] != y["id"]:
            problem = _tie_break(i, x, y, gap, tol)
            if problem is None and _finish(got) == _finish(ref) == "length" and len(a) != len(b):
                problem = f"{len(a)} tokens vs {len(b)}, both cut at max_tokens"
            return problem
        if abs(x["logprob"] - y["logprob"]) > tol:
            return f"token {i}: logprob {x['logprob']:.5f} vs {y['logprob']:.5f}"
    if len(a) != len(b):
        return f"{len(a)} tokens vs {len(b)}"
    if _finish(got) != _finish(ref):
        return f"finish reason {_finish(got)!r} vs {_finish(ref)!r} after the same tokens"
    return None


def assert_same_greedy(got: BaseMessage, ref: BaseMessage, *, tol: float = LOGPROB_TOL) -> None:
    """Same tokens and close log-probabilities, up to a near-tie in the reference."""
    problem = greedy_mismatch(got, ref, tol=tol)
    assert problem is None, problem


def identical_mismatch(got: BaseMessage, ref: BaseMessage) -> str | None:
    """Why ``got`` is not bit-for-bit the generation ``ref`` is (tokens and logprobs)."""
    a, b = entries(got), entries(ref)
    if len(a) != len(b):
        return f"{len(a)} tokens vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x["id"] != y["id"] or x["logprob"] != y["logprob"]:
            return f"token {i}: {x['id']} ({x['logprob']!r}) vs {y['id']} ({y['logprob']!r})"
        if x.get("top_logprobs") != y.get("top_logprobs"):
            return f"token {i}: top logprobs differ"
    return None


def assert_identical(got: BaseMessage, ref: BaseMessage) -> None:
    """Same tokens and exactly the same log-probabilities (the exactness guarantee)."""
    problem = identical_mismatch(got, ref)
    assert problem is None, problem
