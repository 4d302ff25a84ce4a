"""Typed errors, so callers can tell bad input from a broken engine.

Every error a request can raise reaches the caller as one of these (or a plain
``ValueError`` subclass for bad input); the worker itself keeps serving.
"""

from __future__ import annotations


class LlamaCppError(RuntimeError):
    """Base class for errors raised by the llama.cpp engine."""


class ModelLoadError(LlamaCppError):
    """The model file is missing, not a GGUF file, truncated or unsupported."""


class ContextOverflowError(ValueError):
    """Prompt plus ``max_tokens`` does not fit the context window.

    Raised before anything is decoded: nothing is ever silently truncated.
    """


class DecodeError(LlamaCppError):
    """``llama_decode`` failed (out of KV space or a backend failure)."""


class NonFiniteOutputError(DecodeError):
    """A decode under LoRA adapters produced NaN or inf logits: the adapter set drove the
    model's activations out of range. Only the requests whose outputs were non-finite
    fail; the KV memory is wiped and everything else in it put back first, so no
    overflowed cell is ever attended to by another request (docs/lora.md, "Bounds").

    ``seq_ids`` are the sequences that failed; ``lost`` the other sequences whose
    state could not be put back (their cached prefix is gone; a running one fails).
    """

    def __init__(
        self,
        message: str,
        seq_ids: frozenset[int] = frozenset(),
        lost: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(message)
        self.seq_ids = seq_ids
        self.lost = lost


class WorkerDeadError(LlamaCppError):
    """The worker thread that owns the model has stopped; reload the model."""


class RequestCancelledError(LlamaCppError):
    """The request was cancelled (stream closed, task cancelled or ``close()``)."""


class IncompatibleDraftModelError(ModelLoadError):
    """The draft model's vocabulary cannot share token ids with the target's.

    Checked at load like llama.cpp's ``common_speculative_are_compatible``; the
    message names the mismatch and both files.
    """
