"""LangChain chat model running local GGUF models in-process through llama.cpp."""

from langchain_llamacpp_local.chat.preview import RenderedPrompt
from langchain_llamacpp_local.chat_models import ChatLlamaCpp
from langchain_llamacpp_local.embeddings import LlamaCppEmbeddings
from langchain_llamacpp_local.errors import (
    ContextOverflowError,
    DecodeError,
    IncompatibleDraftModelError,
    LlamaCppError,
    ModelLoadError,
    RequestCancelledError,
    WorkerDeadError,
)
from langchain_llamacpp_local.rerank import LlamaCppRerank
from langchain_llamacpp_local.runtime.model_resolution import ModelNotFoundError

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
