"""LangChain chat model running local GGUF models in-process through llama.cpp."""

from langchain_llamacpp_local.chat.preview import RenderedPrompt
from langchain_llamacpp_local.chat_models import ChatLlamaCpp
from langchain_llamacpp_local.decisions import LlamaCppDecisionModel
from langchain_llamacpp_local.embeddings import LlamaCppEmbeddings
from langchain_llamacpp_local.errors import (
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
    RpcError,
    SamplingError,
    StructuredOutputTruncatedError,
    WorkerDeadError,
)
from langchain_llamacpp_local.rerank import LlamaCppRerank

__all__ = [
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
    "RpcError",
    "SamplingError",
    "StructuredOutputTruncatedError",
    "WorkerDeadError",
]
__version__ = "0.1.0"
