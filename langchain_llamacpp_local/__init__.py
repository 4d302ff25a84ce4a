"""LangChain chat model running local GGUF models in-process through llama.cpp."""

from .chat_models import ChatLlamaCpp
from .embeddings import LlamaCppEmbeddings
from .errors import (
    ContextOverflowError,
    DecodeError,
    IncompatibleDraftModelError,
    LlamaCppError,
    ModelLoadError,
    RequestCancelledError,
    WorkerDeadError,
)
from .model_resolution import ModelNotFoundError
from .prompt_preview import RenderedPrompt
from .rerank import LlamaCppRerank

__all__ = [
    "ChatLlamaCpp",
    "ContextOverflowError",
    "DecodeError",
    "IncompatibleDraftModelError",
    "LlamaCppEmbeddings",
    "LlamaCppError",
    "LlamaCppRerank",
    "ModelLoadError",
    "ModelNotFoundError",
    "RenderedPrompt",
    "RequestCancelledError",
    "WorkerDeadError",
]
__version__ = "0.1.0"
