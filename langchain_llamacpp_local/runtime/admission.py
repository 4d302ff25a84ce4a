"""Admission decisions: whether a queued request waits for a prefix a running request
is reading, and how it speculates. Pure functions over plain data; the
loop (:mod:`~.loop`) applies them (fills the slot through ``SlotMemory.acquire``).

Whether a request fits the unified KV pool is :mod:`~.cache.pool`'s decision
(``SlotMemory.room``); the order of interactive and background work is
:func:`~.scheduler.by_priority` over :func:`~.scheduler.effective_priority`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from langchain_llamacpp_local.cache.pool import waits_for_prefix
from langchain_llamacpp_local.cache.slots import common_prefix_len
from langchain_llamacpp_local.errors import InvalidRequestError
from langchain_llamacpp_local.runtime.active import WORKER_LOG
from langchain_llamacpp_local.runtime.requests import EngineRequest
from langchain_llamacpp_local.runtime.speculative import DraftController, Proposer, Speculation

logger = logging.getLogger(WORKER_LOG)


def waits_for_reader(
    tokens: Sequence[Any], rank: int, readers: Iterable[tuple[Sequence[Any], int, int]]
) -> bool:
    """Whether a request of ``tokens`` and priority ``rank`` waits for one of the
    running ``readers`` (their prompt, positions read, rank) to finish reading the
    prefix they share (:func:`~.pool.waits_for_prefix`): in the unified pool it is then
    copied (read once, held once) instead of read again beside it. Never for a reader
    of lower priority, whose prompt waits behind its own."""
    for their_tokens, n_past, their_rank in readers:
        # (the adapter set is part of the tokens' identity)
        if their_rank <= rank:
            later = common_prefix_len(their_tokens, tokens)
            if waits_for_prefix(min(later, len(tokens) - 1), n_past):
                return True
    return False


def draft_limit(requested: int, n_batch: int, exact_verify_rows: int | None) -> int:
    """Most draft tokens per verify step: one call's batch, and with
    ``exact_verify_rows`` (deterministic mode) the verify length whose logits the
    load's probe found equal to single steps (< 1: the request does not speculate)."""
    limit = min(requested, n_batch - 1)
    if exact_verify_rows is not None:
        # a verify step longer than the probed limit would change the logits
        limit = min(limit, exact_verify_rows - 1)
        if limit < 1:
            logger.debug(
                "speculation off: this model's kernels give a multi-token verify step "
                "different logits (exact_verify_rows=%d); deterministic=False allows it",
                exact_verify_rows,
            )
    return limit


def speculation(
    job: EngineRequest,
    proposers: Mapping[str, Proposer],
    n_batch: int,
    exact_verify_rows: int | None,
) -> Speculation | None:
    """How ``job`` speculates, or None when it does not ask to; a proposer this model
    lacks refuses the request."""
    kind = job.speculative
    if kind is None:
        return None
    proposer = proposers.get(kind)
    if proposer is None:
        raise InvalidRequestError(
            f"speculative={kind!r} is not available for this model"
            + (" (load it with draft_model_path=...)" if kind == "draft" else "")
        )
    limit = draft_limit(job.speculative_max_draft, n_batch, exact_verify_rows)
    start = max((p + m.n_pos for p, m in job.media.items()), default=0)
    history = [int(t) for t in job.tokens[start:]]
    return Speculation(
        kind=kind,
        proposer=proposer if limit >= 1 else None,
        controller=DraftController(n_max=max(1, limit)),
        limit=max(0, limit),
        history=history,
    )
