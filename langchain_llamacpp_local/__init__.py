"""LangChain chat model running local GGUF models in-process through llama.cpp."""

from .chat_models import ChatLlamaCpp
from .errors import (
    ContextOverflowError,
    DecodeError,
    LlamaCppError,
    ModelLoadError,
    RequestCancelledError,
    WorkerDeadError,
)
from .model_resolution import ModelNotFoundError

__all__ = [
    "ChatLlamaCpp",
    "ContextOverflowError",
    "DecodeError",
    "LlamaCppError",
    "ModelLoadError",
    "ModelNotFoundError",
    "RequestCancelledError",
    "WorkerDeadError",
]
__version__ = "0.1.0"
