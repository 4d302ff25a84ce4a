"""What a fresh context can do, found by trying it: the kind of its memory and, in
deterministic mode, how many rows one decode may carry without changing any logit."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Protocol

import llama_cpp
import llama_cpp.llama_cpp as C
import numpy as np

from langchain_llamacpp_local.errors import DecodeError, RequestCancelledError
from langchain_llamacpp_local.llama.loading import LoadConfig

logger = logging.getLogger(__name__)

#: Longest verify step :func:`probe_verify_rows` tries (cost: a few decodes per k).
VERIFY_PROBE_MAX = 8
#: Prefix lengths after which it tries them (kernels round alike or not depending on data).
VERIFY_PROBE_PREFIXES = (37, 4, 20)


class MemoryKind(str, Enum):
    """What the context's memory lets us do with a cached prefix."""

    PARTIAL = "partial"  # attention KV: any suffix can be trimmed
    FULL_ONLY = "full_only"  # recurrent/hybrid: only whole sequences can be removed
    SWA = "swa"  # sliding-window KV: trim works, but old positions get pruned


#: Exactness probe results per (model file identity, llama.cpp build, context settings):
#: reloading the same model in deterministic mode does not probe again.
_probe_cache: dict[tuple[object, ...], tuple[int, int]] = {}


class Probed(Protocol):
    """What the probes use of a fresh context (an :class:`~.engine.Engine`)."""

    config: LoadConfig
    mem: object
    is_recurrent: bool
    is_hybrid: bool
    n_swa: int
    bos_id: int
    n_vocab: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_slots: int

    def decode(
        self,
        tokens: Sequence[int],
        pos0: int,
        seq_id: int,
        *,
        logits_last: bool = True,
        cancel: Callable[[], bool] | None = None,
    ) -> None: ...

    def decode_batch(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seq_ids: Sequence[int],
        outputs: Sequence[bool],
        *,
        cancel: Callable[[], bool] | None = None,
    ) -> None: ...

    def logits(self, idx: int = -1) -> np.ndarray: ...


def probe_memory(engine: Probed) -> MemoryKind:
    """Classify the memory the way llama.cpp's server does (common_context_can_seq_rm)."""
    kind = MemoryKind.PARTIAL
    if engine.is_recurrent or engine.is_hybrid:
        kind = MemoryKind.FULL_ONLY
    else:
        # Decode two tokens and try a partial trim: the reliable test for any new
        # memory type. SWA caches pass it but prune old positions later.
        tok = engine.bos_id if engine.bos_id >= 0 else 0
        engine.decode([tok, tok], 0, 0, logits_last=False)
        if not C.llama_memory_seq_rm(engine.mem, 0, 1, -1):
            kind = MemoryKind.FULL_ONLY
        elif engine.n_swa > 0 and not engine.config.swa_full:
            kind = MemoryKind.SWA
    C.llama_memory_clear(engine.mem, True)
    return kind


def probe_exactness(engine: Probed, threads: int) -> tuple[int, int]:
    """(exact_rows, exact_verify_rows), probed once per model file, build and settings."""
    st = os.stat(engine.config.model_path)
    key = (
        os.path.realpath(engine.config.model_path),
        st.st_size,
        st.st_mtime_ns,
        llama_cpp.__version__,
        C.llama_print_system_info(),
        threads,
        dataclasses.replace(engine.config, model_path="", draft_model_path=None),
    )
    found = _probe_cache.get(key)
    if found is None:
        found = _probe_cache[key] = (probe_rows(engine), probe_verify_rows(engine))
    return found


def probe_rows(engine: Probed) -> int:
    """How many sequences may share a generation step without changing any one's logits.

    llama.cpp's CPU matmuls take a vector path for a one-row micro-batch and tiled
    or grouped kernels for several rows (F32/F16/Q8_0 via llamafile's GEMM; 4-row
    groups for repacked K-quants), which round differently. Distinct short
    sequences each take one step alone, then together in groups of 2.. n_slots;
    the answer is the largest size up to which every group matched bit for bit
    (1: never share). Measured: Gemma 3 270M Q4_K_M gives 3, the F32 test models 1.
    """
    k_max = min(engine.n_slots, 8)
    if k_max < 2:
        return 1
    base = [engine.bos_id if engine.bos_id >= 0 else 0]
    n_vocab = max(2, min(engine.n_vocab, 4096))
    prompts = [
        base + [(97 + 31 * s + 7 * i) % n_vocab for i in range(4 + 3 * s)] for s in range(k_max)
    ]
    best = 1

    def prime() -> None:  # recurrent state cannot be stepped back: start over
        C.llama_memory_clear(engine.mem, True)
        for s, p in enumerate(prompts):
            engine.decode(p[:-1], 0, s, logits_last=False)

    try:
        prime()
        solo = []
        for s, p in enumerate(prompts):
            engine.decode_batch([p[-1]], [len(p) - 1], [s], [True])
            solo.append(engine.logits(0))
        for k in range(2, k_max + 1):
            prime()
            pos = [len(p) - 1 for p in prompts[:k]]
            engine.decode_batch([p[-1] for p in prompts[:k]], pos, list(range(k)), [True] * k)
            if not all(np.array_equal(engine.logits(i), solo[i]) for i in range(k)):
                break
            best = k
    except (DecodeError, RequestCancelledError):  # recurrent state cannot be stepped back
        best = 1
    finally:
        C.llama_memory_clear(engine.mem, True)
    logger.debug("up to %d sequences share a generation step exactly", best)
    return best


def probe_verify_rows(engine: Probed) -> int:
    """How many tokens of ONE sequence one decode may carry with exactly the logits
    (and the memory) that one-token steps would give: speculative verification.

    For k = 2.. ``VERIFY_PROBE_MAX``, after prefixes of a few lengths, decoding k
    tokens at once must give, row by row, the logits of k single steps, and the
    step after it must match too (the cached K/V or recurrent state is the same).
    Returns the largest k that held everywhere (1: a multi-token verify step
    changes logits). A probe can only find counterexamples: whether two kernels
    round alike depends on the data, so it tries several positions. Measured on
    x86: Gemma 3 270M Q4_K_M matches for k <= 3 after some prefixes and not even
    for k = 2 after others (33, 40 tokens), so it gets 1; the test models with
    zeroed attention get 8.
    """
    k_max = min(VERIFY_PROBE_MAX, engine.n_batch, engine.n_ubatch)
    heads = [h for h in VERIFY_PROBE_PREFIXES if h + k_max + 1 <= engine.n_ctx]
    if k_max < 2 or not heads:
        return 1
    try:
        # k = 2 everywhere first: most CPU models fail there, after a few decodes
        best = verify_rows_upto(engine, 2, heads)
        if best == 2 and k_max > 2:
            best = verify_rows_upto(engine, k_max, heads)
    except (DecodeError, RequestCancelledError):
        best = 1
    finally:
        C.llama_memory_clear(engine.mem, True)
    logger.debug("a verify step of up to %d tokens of one sequence is exact", best)
    return best


def verify_rows_upto(engine: Probed, best: int, heads: Sequence[int]) -> int:
    bos = [engine.bos_id] if engine.bos_id >= 0 else []
    n_vocab = max(2, min(engine.n_vocab, 4096))

    def prime(toks: list[int], head: int) -> None:  # recurrent state: start over
        C.llama_memory_clear(engine.mem, True)
        engine.decode(toks[:head], 0, 0, logits_last=False)

    for c, head in enumerate(heads):
        toks = bos + [(53 + 29 * c + 11 * i) % n_vocab for i in range(head + best + 1)]
        prime(toks, head)
        solo = []
        for i in range(head, head + best + 1):
            engine.decode_batch([toks[i]], [i], [0], [True])
            solo.append(engine.logits(0))
        for k in range(2, best + 1):
            prime(toks, head)
            engine.decode_batch(toks[head : head + k], range(head, head + k), [0] * k, [True] * k)
            same = all(np.array_equal(engine.logits(i), solo[i]) for i in range(k))
            if same:  # and the state it left: the next single step
                engine.decode_batch([toks[head + k]], [head + k], [0], [True])
                same = np.array_equal(engine.logits(0), solo[k])
            if not same:
                best = k - 1
                break
        if best < 2:
            return 1
    return best
