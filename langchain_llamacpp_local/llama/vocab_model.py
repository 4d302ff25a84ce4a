"""A ``vocab_only`` llama.cpp model: what prompt preparation reads of an engine, without
the weights (counting tokens and previewing prompts before or without a load)."""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import llama_cpp.llama_cpp as C

from langchain_llamacpp_local.errors import ModelLoadError
from langchain_llamacpp_local.llama import vocab
from langchain_llamacpp_local.llama.backend import init_backend
from langchain_llamacpp_local.llama.loading import check_gguf_file
from langchain_llamacpp_local.llama.probes import MemoryKind


class VocabModel(vocab.VocabMethods):
    """The vocabulary and metadata of a GGUF, with the :class:`Engine` methods that read
    only those."""

    def __init__(self, path: str) -> None:
        init_backend()
        check_gguf_file(path)
        params = C.llama_model_default_params()
        params.vocab_only = True
        model = C.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise ModelLoadError(f"llama.cpp could not read the vocabulary of {path}")
        self.model = model
        self._finalizer = weakref.finalize(self, C.llama_model_free, model)
        self.vocab = C.llama_model_get_vocab(model)
        self.n_vocab = int(C.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(C.llama_model_n_ctx_train(model))
        self.metadata = vocab.read_metadata(model)
        self.add_bos = bool(C.llama_vocab_get_add_bos(self.vocab))
        self.bos_id = int(C.llama_vocab_bos(self.vocab))
        self.eos_id = int(C.llama_vocab_eos(self.vocab))
        # no window to overflow when only counting; no checkpoints to place
        self.n_ctx = sys.maxsize
        self.memory_kind = MemoryKind.PARTIAL
        self.lock = threading.Lock()

    def tokenize_multimodal(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("a prompt with images is prepared by the loaded model")
