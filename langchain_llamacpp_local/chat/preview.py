"""What the model will read: the rendered prompt and its tokens, without generating.

:meth:`ChatLlamaCpp.render_prompt` and the token counters (``get_token_ids``,
``get_num_tokens_from_messages``) run the same :func:`prompts.prepare` a request runs.
A prompt without images needs only the tokenizer, the chat template and the GGUF's
metadata, so it is prepared on a vocabulary-only llama.cpp model (``vocab_only``: no
weights read, milliseconds for a small vocabulary) cached per file; counting then
neither loads the weights nor waits behind the worker's generations.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from langchain_llamacpp_local.llama.vocab_model import VocabModel


@dataclass(frozen=True)
class RenderedPrompt:
    """The prompt of one request, exactly as the model reads it.

    ``text`` is the chat template's output (tools, generation prompt and all);
    ``tokens`` the token ids decoded (an image is one ``("media", digest, k)`` entry
    per position it fills); ``grammar`` the GBNF that constrains the reply (forced tool
    calls, structured output) and ``tool_format`` the syntax its tool calls are parsed in
    (None when no tools are bound)."""

    text: str
    tokens: tuple[Any, ...]
    stop: tuple[str, ...]
    grammar: str | None
    tool_format: str | None

    @property
    def n_tokens(self) -> int:
        """How many positions of the context window the prompt fills."""
        return len(self.tokens)


def from_prepared(prepared: Any) -> RenderedPrompt:
    sampling = prepared.sampling
    return RenderedPrompt(
        text=prepared.text,
        tokens=tuple(prepared.tokens),
        stop=tuple(prepared.stop),
        grammar=getattr(sampling, "grammar", None),
        tool_format=prepared.parse_format if prepared.tools else None,
    )


@functools.lru_cache(maxsize=8)
def _vocab_and_format(path: str, mtime_ns: int) -> tuple[VocabModel, Any]:
    from langchain_llamacpp_local.chat.prompts import ChatFormat

    vm = VocabModel(path)
    return vm, ChatFormat.from_engine(vm)  # type: ignore[arg-type]


def vocab_and_format(path: str) -> tuple[VocabModel, Any]:
    """The cached vocabulary-only model and chat format of the GGUF at ``path``."""
    path = os.path.abspath(path)
    return _vocab_and_format(path, os.stat(path).st_mtime_ns)


def prepare_without_weights(path: str, job: Any) -> RenderedPrompt:
    from langchain_llamacpp_local.chat.prompts import prepare

    vm, fmt = vocab_and_format(path)
    with vm.lock:
        return from_prepared(prepare(fmt, job, vm))  # type: ignore[arg-type]


def tokenize_text(path: str, text: str) -> list[int]:
    vm, _ = vocab_and_format(path)
    with vm.lock:
        return vm.tokenize(text, add_special=False, parse_special=False)
