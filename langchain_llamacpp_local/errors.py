"""Every public error of the package, each also LangChain's standard model error.

LangChain's agent stack acts on ``langchain_core.exceptions``: ``SummarizationMiddleware``
retries an overflowing summary with a shorter history only on ``ContextOverflowError``,
and ``ModelRetryMiddleware`` (like the summary call's own retries) skips a ``ModelError``
whose ``is_retryable`` is false. So each error here is also the matching LangChain type
while keeping its Python base, so ``except ValueError`` or ``except TimeoutError`` code
keeps working. The table of which is which is in docs/concurrency.md ("Errors").
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from langchain_core import exceptions as lc

if TYPE_CHECKING:
    from langchain_core.messages import AIMessage

__all__ = [
    "AudioInputError",
    "ChatTemplateError",
    "ContextOverflowError",
    "DecodeError",
    "GGUFHeaderError",
    "GrammarTooLargeError",
    "ImageInputError",
    "IncompatibleDraftModelError",
    "InvalidArgumentError",
    "InvalidRequestError",
    "InvalidSamplingParams",
    "InvalidToolCallError",
    "KVDesyncError",
    "LlamaCppError",
    "ModelLoadError",
    "ModelNotFoundError",
    "NonFiniteOutputError",
    "RequestCancelledError",
    "RequestTimeoutError",
    "ResponseFormatBesideToolsError",
    "RpcError",
    "SamplingError",
    "StructuredOutputTruncatedError",
    "WorkerDeadError",
    "as_model_error",
]


class LlamaCppError(RuntimeError):
    """Base class for errors raised by the llama.cpp engine."""


# --------------------------------------------------------------------------- the caller's input


class InvalidRequestError(ValueError, lc.ModelInvalidRequestError):
    """A request the model cannot run as given (a bad per-call value, schema, template,
    image or prompt); the message names the problem. Retrying it unchanged fails again."""


class InvalidArgumentError(TypeError, lc.ModelInvalidRequestError):
    """An argument of the wrong kind or an unknown keyword (the message names the closest
    valid one); a ``TypeError`` as before."""


class ResponseFormatBesideToolsError(InvalidRequestError):
    """The chat template's tool-call syntax cannot be told apart from a JSON answer, so
    ``response_format`` cannot be combined with tools (raised at ``bind_tools``)."""


class ContextOverflowError(ValueError, lc.ContextOverflowError):
    """Prompt plus ``max_tokens`` does not fit the context window.

    Raised before anything is decoded: nothing is ever silently truncated. LangChain's
    ``SummarizationMiddleware`` answers it by summarizing a shorter history.
    """


class InvalidSamplingParams(InvalidRequestError):
    """A sampling setting is out of range (the message names the field)."""


class GrammarTooLargeError(InvalidRequestError):
    """A schema or grammar is beyond what llama.cpp's grammar engine can take (the
    message names the bound or field)."""


class ChatTemplateError(InvalidRequestError):
    """A chat template failed to compile or render (includes sandbox violations and
    resource limits); the message names the template origin.

    ``raised_by_template`` is true when the template itself refused the input
    (its ``raise_exception``), so the message is the template's own.
    """

    def __init__(
        self, message: str, *, raised_by_template: bool = False, limit: bool = False
    ) -> None:
        super().__init__(message)
        self.raised_by_template = raised_by_template
        self.limit = limit


class ImageInputError(InvalidRequestError):
    """An image was refused; the message says why and how to allow it if possible."""


class AudioInputError(InvalidRequestError):
    """An audio part was refused (format, size, or a model that cannot hear); the
    message says why and what is accepted."""


class StructuredOutputTruncatedError(lc.OutputParserException):
    """Structured output (or a forced tool call) ended at ``max_tokens`` before it was
    complete; the text so far is in ``llm_output``.

    An ``OutputParserException`` (so a ``ValueError``), like every other failure to read
    structured output: ``with_structured_output(..., include_raw=True)`` reports it as
    ``parsing_error`` with ``parsed=None``. ChatOpenAI raises ``LengthFinishReasonError``
    in the same case.
    """

    def __init__(self, message: str, *, llm_output: str | None = None) -> None:
        super().__init__(message, llm_output=llm_output)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # (the base class's own pickling would append its troubleshooting link again)
        return (type(self), (self.message,), vars(self))


# --------------------------------------------------------------------------- time


class RequestTimeoutError(TimeoutError, lc.ModelTimeoutError):
    """The call's ``timeout`` expired (queueing, loading and generation included); the
    request was cancelled. Retryable: a later call may find the model less busy."""


class RequestCancelledError(LlamaCppError):
    """The request was cancelled (stream closed, task cancelled or ``close()``)."""


# --------------------------------------------------------------------------- the model


class ModelLoadError(LlamaCppError, lc.ModelError):
    """The model file is missing, not a GGUF file, truncated or unsupported."""

    is_retryable = False


class ModelNotFoundError(ModelLoadError, lc.ModelNotFoundError):
    """No model matched a name, or its file does not exist; the message lists every
    place that was tried."""

    def __init__(self, spec: str, tried: list[str], *, message: str | None = None) -> None:
        self.spec = spec
        self.tried = list(tried)
        if message is None:
            lines = "\n".join(f"  - {t}" for t in tried)
            shown = repr(spec) if len(spec) <= 200 else f"{spec[:60]!r}... ({len(spec)} characters)"
            message = f"model {shown} not found; tried:\n{lines}"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled errors cross processes (multiprocessing, a LangGraph checkpoint)
        return (type(self), (self.spec, self.tried), {"args": self.args})


class IncompatibleDraftModelError(ModelLoadError):
    """The draft model's vocabulary cannot share token ids with the target's.

    Checked at load like llama.cpp's ``common_speculative_are_compatible``; the
    message names the mismatch and both files.
    """


class RpcError(ModelLoadError):
    """An RPC server cannot be used (not compiled in, unreachable, wrong protocol)."""


class GGUFHeaderError(ValueError, lc.ModelError):
    """A GGUF header cannot be read (a length runs past the end of the file, a bad
    value); the model file is at fault, not the request."""

    is_retryable = False


class DecodeError(LlamaCppError, lc.ModelAPIError):
    """``llama_decode`` failed (out of KV space or a backend failure)."""


class NonFiniteOutputError(DecodeError):
    """A decode under LoRA adapters produced NaN or inf logits: the adapter set drove the
    model's activations out of range. Only the requests whose outputs were non-finite
    fail; the KV memory is wiped and everything else in it put back first, so no
    overflowed cell is ever attended to by another request (docs/lora.md, "Bounds").

    ``seq_ids`` are the sequences that failed; ``lost`` the other sequences whose
    state could not be put back (their cached prefix is gone; a running one fails).
    """

    #: the request's own adapter set overflowed: the same request fails the same way
    is_retryable = False

    def __init__(
        self,
        message: str,
        seq_ids: frozenset[int] = frozenset(),
        lost: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(message)
        self.seq_ids = seq_ids
        self.lost = lost


class SamplingError(LlamaCppError, lc.ModelAPIError):
    """This request cannot go on sampling (e.g. its grammar allows no token); the
    worker reports it to the request and keeps serving."""

    #: the request's own grammar or settings left no token: the same request fails again
    is_retryable = False


class WorkerDeadError(LlamaCppError, lc.ModelAPIError):
    """The worker thread that owns the model has stopped; the next call loads the model
    again on a new worker, so retrying is worthwhile."""


class KVDesyncError(AssertionError):
    """The worker's record of a slot disagrees with llama.cpp's memory (a bug). Raised
    only under ``LLAMACPP_LOCAL_CHECK_KV=1``; the worker dies and its callers get
    :class:`WorkerDeadError`."""


# --------------------------------------------------------------------------- agents


class InvalidToolCallError(ValueError):
    """The model kept writing invalid tool calls after every retry
    (``RetryInvalidToolCalls``); ``response`` is its last reply."""

    def __init__(self, message: str, response: AIMessage) -> None:
        super().__init__(message)
        self.response = response


# --------------------------------------------------------------------------- the boundary


# --------------------------------------------------------------------------- unknown names

#: Parameters of langchain-community's llama.cpp classes that are no field here, each
#: with what to use instead (docs/migration.md): spelling similarity would point them
#: at an unrelated field (``grammar_path`` is not ``mmproj_path``).
COMMUNITY_HINTS: dict[str, str] = {
    "grammar_path": "pass the grammar's text as grammar=..., or build one from a schema: "
    "use with_structured_output() or bind_tools(tool_choice=...)",
    "model_kwargs": "llama.cpp settings are fields of their own (n_ctx=, n_gpu_layers=, "
    "chat_template=, chat_template_kwargs=...)",
    "chat_format": "use chat_template= (the GGUF's own template is the default)",
    "chat_handler": "use chat_template= and mmproj_path= for vision models",
    "lora_path": "use lora_adapters={'name': path} (docs/lora.md)",
    "lora_base": "use lora_adapters={'name': path} (docs/lora.md)",
    "lora_scale": "use lora_adapters={'name': {'path': ..., 'scale': s}} (docs/lora.md)",
    "f16_kv": "use type_k=/type_v= ('f16' is the default)",
    "last_n_tokens_size": "use penalty_last_n=",
    "logits_all": "use logprobs=True (and top_logprobs=)",
    "n_parts": "no longer a llama.cpp setting",
    "vocab_only": "get_token_ids() reads only the vocabulary when the model is not loaded",
    "suffix": "not supported for chat",
    "echo": "not supported for chat",
    "client": "the instance loads and shares its model itself",
}

#: How alike (difflib's ratio) a name must be to a valid one to be suggested: typos
#: (``n_gpu_layer``, ``temprature``) are well above it, unrelated names sharing a
#: suffix (``model_kwargs``/``model_path``: 0.64) below.
SIMILARITY_CUTOFF = 0.75


def closest_name(name: str, valid: Iterable[str]) -> str | None:
    """The valid name ``name`` most likely misspells, if any is close."""
    matches = difflib.get_close_matches(name, list(valid), n=1, cutoff=SIMILARITY_CUTOFF)
    return matches[0] if matches else None


def unknown_names_error(unknown: Iterable[str], valid: Iterable[str], what: str) -> TypeError:
    """A ``TypeError`` listing ``unknown`` names, each with its closest valid one (or,
    for a langchain-community parameter, what replaces it)."""
    valid = sorted(set(valid))
    parts = []
    for name in sorted(unknown):
        hint = COMMUNITY_HINTS.get(name)
        guess = closest_name(name, valid)
        if hint is not None:
            parts.append(f"{name!r} ({hint})")
        elif guess:
            parts.append(f"{name!r} (did you mean {guess!r}?)")
        else:
            parts.append(repr(name))
    return TypeError(f"unexpected {what}: {', '.join(parts)}")


def as_model_error(exc: Exception) -> Exception:
    """``exc`` as the error a chat call raises: itself when LangChain can already
    classify it (or it is a cancellation); otherwise a plain ``TimeoutError``,
    ``TypeError`` or ``ValueError`` from deeper code becomes the matching class above,
    with the same message (the caller chains the original).

    The message is the original's text (``str(exc)``), not its ``args``: a pydantic
    ``ValidationError`` has none (its text is built from its errors), a codec error's
    are a tuple of fields."""
    if isinstance(exc, (lc.ModelError, lc.OutputParserException, RequestCancelledError)):
        return exc
    for kind, model_error in (
        (TimeoutError, RequestTimeoutError),
        (TypeError, InvalidArgumentError),
        (ValueError, InvalidRequestError),
    ):
        if isinstance(exc, kind):
            text = str(exc)
            return model_error(text) if text else model_error(*exc.args)
    return exc


@contextlib.contextmanager
def model_errors() -> Iterator[None]:
    """Raise what escapes a call as LangChain's model error of its kind
    (:func:`as_model_error`), the original chained."""
    try:
        yield
    except Exception as exc:
        converted = as_model_error(exc)
        if converted is exc:
            raise
        raise converted from exc
