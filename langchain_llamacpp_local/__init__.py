"""LangChain chat model running local GGUF models in-process through llama.cpp."""

from langchain_llamacpp_local.chat.preview import RenderedPrompt
from langchain_llamacpp_local.chat_models import ChatLlamaCpp
from langchain_llamacpp_local.embeddings import LlamaCppEmbeddings
from langchain_llamacpp_local.errors import (
    ChatTemplateError,
    ContextOverflowError,
    DecodeError,
    ImageInputError,
    IncompatibleDraftModelError,
    InvalidArgumentError,
    InvalidRequestError,
    LlamaCppError,
    ModelLoadError,
    ModelNotFoundError,
    RequestCancelledError,
    RequestTimeoutError,
    StructuredOutputTruncatedError,
    WorkerDeadError,
)
from langchain_llamacpp_local.rerank import LlamaCppRerank

__all__ = [
    "ChatLlamaCpp",
    "ChatTemplateError",
    "ContextOverflowError",
    "DecodeError",
    "ImageInputError",
    "IncompatibleDraftModelError",
    "InvalidArgumentError",
    "InvalidRequestError",
    "LlamaCppEmbeddings",
    "LlamaCppError",
    "LlamaCppRerank",
    "ModelLoadError",
    "ModelNotFoundError",
    "RenderedPrompt",
    "RequestCancelledError",
    "RequestTimeoutError",
    "StructuredOutputTruncatedError",
    "WorkerDeadError",
]
__version__ = "0.1.0"
