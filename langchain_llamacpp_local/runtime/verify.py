"""Speculative verify: one request's draft decoded after its pending token in one call,
kept as far as its own sampler agrees (llama.cpp's ``common_sampler_sample_and_accept_n``).

The proposers and the draft-length controller are :mod:`~.speculative`'s; the plan that
says which drafts a step verifies is :func:`~.scheduler.plan_step`'s. Here is the verify
itself, which the loop (:mod:`~.loop`) runs: it owns failures and the end of a reply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from langchain_llamacpp_local.cache.slot_memory import SlotMemory, Verify
from langchain_llamacpp_local.llama.engine import Engine
from langchain_llamacpp_local.runtime.active import WORKER_LOG, Active, lora_of

logger = logging.getLogger(WORKER_LOG)


def draft(eng: Engine, act: Active) -> list[int]:
    """Draft tokens to verify after ``act``'s pending token this step ([]: none)."""
    sp = act.spec
    if sp is None or sp.proposer is None or (act.think is not None and act.think.forcing):
        return []  # forced tokens are not sampled: nothing to verify
    # every verified row is a generated token and a KV position: stay within both
    room = min(act.max_new - act.n_gen - 1, eng.n_ctx - act.slot.n_past - 1)
    n = min(sp.limit, room)
    if n < 1:
        return []
    n = min(n, sp.controller.want())
    if n < 1:
        return []
    try:
        proposed = sp.proposer.propose(act.slot.seq_id, sp.history, n)
    except Exception:  # a failing proposer costs speed, never the request
        logger.warning(
            "the %s proposer failed; speculation off for the request", sp.kind, exc_info=True
        )
        sp.proposer = None
        return []
    return [int(t) for t in proposed[:n]]


def decode_rows(eng: Engine, act: Active, step: Verify) -> None:
    """Decode a verify step's rows ([pending, *draft]) in one call, logits for each."""
    n = len(step.rows)
    eng.set_lora(lora_of(act))  # LoRA hook
    eng.decode_batch(
        step.rows, range(step.n_past, step.n_past + n), [act.slot.seq_id] * n, [True] * n
    )


def accept(
    eng: Engine,
    memory: SlotMemory,
    act: Active,
    step: Verify,
    take: Callable[[Active, int, int], bool],
) -> None:
    """Sample the verify rows in order until the sampler disagrees with the draft
    (``take`` hands each token to the reply: False once it ended), then keep in the
    memory only the rows whose input token stays in the sequence."""
    assert act.spec is not None and act.sampler is not None
    batch = step.rows
    n_draft = len(batch) - 1
    used = 0  # rows whose input token stays in the sequence
    accepted = 0
    sp = act.spec
    sp.drafted += n_draft
    try:
        for i in range(len(batch)):
            used = i + 1
            tok = act.sampler.sample(eng.ctx, i)
            match = i < n_draft and tok == batch[i + 1]
            if match:  # counted first: the request may finish on this token
                accepted += 1
                sp.accepted += 1
            if not take(act, i, tok):
                break  # finished (end of generation, stop string, length)
            if not match or (act.think is not None and act.think.forcing):
                act.pending = tok
                break
    finally:
        sp.controller.update(n_draft, accepted)
        memory.keep(step, used, partial(decode_kept, eng, act))


def decode_kept(eng: Engine, act: Active, rows: Sequence[Any], start: int) -> None:
    """Decode a verify step's kept rows again (``SlotMemory.keep`` restored the state
    from before it: memory that cannot be trimmed)."""
    eng.set_lora(lora_of(act))  # LoRA hook
    n = len(rows)
    eng.decode_batch(rows, range(start, start + n), [act.slot.seq_id] * n, [False] * n)
