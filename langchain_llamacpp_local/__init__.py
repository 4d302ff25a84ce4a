"""LangChain chat model running local GGUF models in-process through llama.cpp.

The public names are imported on first use (PEP 562): importing one module of the
package (``langchain_llamacpp_local.errors``, ``.cache.disk``, a child process that needs
one layer) does not import LangChain's chat stack and every layer with it. What
``from langchain_llamacpp_local import ChatLlamaCpp`` returns is unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from langchain_llamacpp_local.chat.preview import RenderedPrompt
    from langchain_llamacpp_local.chat_models import ChatLlamaCpp
    from langchain_llamacpp_local.decisions import LlamaCppDecisionModel
    from langchain_llamacpp_local.embeddings import LlamaCppEmbeddings
    from langchain_llamacpp_local.errors import (
        AudioInputError,
        ChatTemplateError,
        ContextOverflowError,
        DecodeError,
        GGUFHeaderError,
        GrammarTooLargeError,
        ImageInputError,
        IncompatibleDraftModelError,
        InvalidArgumentError,
        InvalidRequestError,
        InvalidSamplingParams,
        InvalidToolCallError,
        KVDesyncError,
        LlamaCppError,
        ModelLoadError,
        ModelNotFoundError,
        NonFiniteOutputError,
        RequestCancelledError,
        RequestTimeoutError,
        ResponseFormatBesideToolsError,
        RpcError,
        SamplingError,
        StructuredOutputTruncatedError,
        WorkerDeadError,
    )
    from langchain_llamacpp_local.rerank import LlamaCppRerank

#: where each public name lives
_HOMES = {
    "RenderedPrompt": "chat.preview",
    "ChatLlamaCpp": "chat_models",
    "LlamaCppDecisionModel": "decisions",
    "LlamaCppEmbeddings": "embeddings",
    "LlamaCppRerank": "rerank",
}

__all__ = [
    "AudioInputError",
    "ChatLlamaCpp",
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
    "LlamaCppEmbeddings",
    "LlamaCppDecisionModel",
    "LlamaCppError",
    "LlamaCppRerank",
    "ModelLoadError",
    "ModelNotFoundError",
    "NonFiniteOutputError",
    "RenderedPrompt",
    "RequestCancelledError",
    "RequestTimeoutError",
    "ResponseFormatBesideToolsError",
    "RpcError",
    "SamplingError",
    "StructuredOutputTruncatedError",
    "WorkerDeadError",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name or a submodule, imported when first asked for (then a plain
    attribute of the package)."""
    if name in __all__:
        home = _HOMES.get(name, "errors")
        value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
