"""What the sampling and tool-grammar tests share: schemas and tools to build grammars
from, and a tiny llama.cpp model that samples under them (no worker, no template)."""

from __future__ import annotations

import ctypes
from enum import Enum
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C
import pydantic

from langchain_llamacpp_local.llama.sampling import Sampler, SamplingParams
from langchain_llamacpp_local.llama.text_stream import Utf8Decoder

try:
    import jsonschema
except ImportError:  # pragma: no cover - jsonschema ships with the test extras' deps
    jsonschema = None


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=8)
    number: int | None = None


class Pet(pydantic.BaseModel):
    kind: Color
    nick: str = pydantic.Field(pattern=r"^[a-z]{1,6}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    favourite: Color
    active: bool
    address: Address
    previous: Address | None = None
    pets: list[Pet] = pydantic.Field(default_factory=list, max_length=2)
    tags: list[str] = pydantic.Field(default_factory=list, max_length=3)


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                    "days": {"type": "integer"},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book",
            "description": "Uses $defs like a pydantic tool.",
            "parameters": {
                "type": "object",
                "$defs": {"When": {"type": "string", "enum": ["now", "later"]}},
                "properties": {"when": {"$ref": "#/$defs/When"}, "seats": {"type": "integer"}},
                "required": ["when"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "now",
            "description": "No arguments.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {"type": "function", "function": {"name": "ping", "description": "No parameters key."}},
]
PARAMS = {
    t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in TOOLS
}


class TinyModel:
    def __init__(self, path: Path) -> None:
        self.model = C.llama_model_load_from_file(
            str(path).encode(), C.llama_model_default_params()
        )
        assert self.model
        self.vocab = C.llama_model_get_vocab(self.model)

    def generate(
        self, params: SamplingParams, max_tokens: int = 200, prompt: str = "hi"
    ) -> tuple[str, bool]:
        """Sample up to ``max_tokens``; returns (text, ended at EOG)."""
        cp = C.llama_context_default_params()
        cp.n_ctx = max(512, max_tokens + 64)
        cp.n_batch = 512
        cp.n_threads = cp.n_threads_batch = 2
        ctx = C.llama_init_from_model(self.model, cp)
        assert ctx
        try:
            data = prompt.encode()
            toks = (C.llama_token * 64)()
            n = C.llama_tokenize(self.vocab, data, len(data), toks, 64, True, False)
            batch = C.llama_batch_get_one(toks, n)
            dec, text = Utf8Decoder(), ""
            buf = ctypes.create_string_buffer(64)
            with Sampler(self.vocab, params) as sampler:
                for _ in range(max_tokens):
                    assert C.llama_decode(ctx, batch) == 0
                    tok = sampler.sample(ctx, -1)
                    if C.llama_vocab_is_eog(self.vocab, tok):
                        return text + dec.flush(), True
                    k = C.llama_token_to_piece(self.vocab, tok, buf, 64, 0, True)
                    text += dec.feed(buf.raw[:k])
                    one = (C.llama_token * 1)(tok)
                    batch = C.llama_batch_get_one(one, 1)
            return text + dec.flush(), False
        finally:
            C.llama_free(ctx)

    def close(self) -> None:
        C.llama_model_free(self.model)


def _relaxed(schema: Any) -> Any:
    """The schema without maxLength: llama.cpp's grammar decodes UTF-8 leniently, so a
    random model's invalid byte run is one character to the grammar but several U+FFFD
    once decoded."""
    if isinstance(schema, dict):
        return {k: _relaxed(v) for k, v in schema.items() if k != "maxLength"}
    if isinstance(schema, list):
        return [_relaxed(v) for v in schema]
    return schema


def validate(instance: Any, schema: dict[str, Any]) -> None:
    schema = _relaxed(schema)
    if jsonschema is not None:
        jsonschema.validate(instance, schema)
        return
    assert isinstance(instance, dict)  # pragma: no cover
    assert set(schema.get("required", [])) <= set(instance)  # pragma: no cover
