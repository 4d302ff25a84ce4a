"""Log-probabilities from a logits row (pure): normalised, top entries ordered."""

from __future__ import annotations

import math

import numpy as np

from langchain_llamacpp_local.runtime.logprobs import log_normalizer, logprob_entry, top_indices


def test_normalizer_matches_float64_reference_and_survives_large_logits() -> None:
    rng = np.random.default_rng(0)
    row = (rng.standard_normal(262_144) * 8).astype(np.float32)
    ref = np.logaddexp.reduce(row.astype(np.float64))
    assert abs(log_normalizer(row) - ref) < 1e-6 * max(1.0, abs(ref))
    big = np.array([1000.0, 1000.0], dtype=np.float32)
    assert math.isclose(log_normalizer(big), 1000.0 + math.log(2.0), rel_tol=1e-12)


def test_top_indices_are_largest_first_with_ties_by_index() -> None:
    row = np.array([0.5, 3.0, -1.0, 3.0, 2.0], dtype=np.float32)
    assert top_indices(row, 3).tolist() == [1, 3, 4]
    assert top_indices(row, 10).tolist() == [1, 3, 4, 0, 2]
    assert top_indices(row, 0).tolist() == []


def test_entry_probabilities_sum_to_one_and_name_the_pieces() -> None:
    row = np.log(np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float32))
    entry = logprob_entry(row, 1, 2, lambda t: f"<{t}>")
    assert entry["id"] == 1 and entry["token"] == "<1>"
    assert math.isclose(entry["logprob"], math.log(0.25), rel_tol=1e-6)
    assert [e["id"] for e in entry["top_logprobs"]] == [0, 1]
    assert math.isclose(entry["top_logprobs"][0]["logprob"], math.log(0.5), rel_tol=1e-6)
    assert "top_logprobs" not in logprob_entry(row, 0, 0, str)
