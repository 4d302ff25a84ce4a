"""Per-token log-probabilities from a row of logits (the OpenAI ``logprobs`` shape).

A pure function on a numpy row, so it is testable without a model. It runs once per
generated token on the worker thread, where every millisecond is a millisecond the
other slots wait: the row stays float32 (a 262k-entry vocabulary costs about 1 ms),
only the normaliser is summed in float64, and the top entries come from a partial
sort rather than a full one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def log_normalizer(logits: np.ndarray) -> float:
    """``log(sum(exp(logits)))``, stable for large logits."""
    m = float(logits.max())
    return m + float(np.log(np.exp(logits - m).sum(dtype=np.float64)))


def top_indices(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest logits, largest first (ties: lower index first)."""
    n = len(logits)
    k = min(k, n)
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    idxs = np.argpartition(logits, n - k)[n - k :] if k < n else np.arange(n)
    order = np.lexsort((idxs, -logits[idxs].astype(np.float64)))
    return idxs[order]


def logprob_entry(
    logits: np.ndarray, tok: int, top: int, piece: Callable[[int], str]
) -> dict[str, Any]:
    """The entry for sampled token ``tok``: its log-probability and the ``top`` best."""
    lse = log_normalizer(logits)
    entry: dict[str, Any] = {
        "token": piece(tok),
        "id": int(tok),
        "logprob": float(logits[tok]) - lse,
    }
    if top > 0:
        entry["top_logprobs"] = [
            {"token": piece(int(i)), "id": int(i), "logprob": float(logits[i]) - lse}
            for i in top_indices(logits, top)
        ]
    return entry
