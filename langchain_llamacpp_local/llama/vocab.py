"""A model's vocabulary through llama.cpp: tokens, pieces, special tokens, metadata.

One implementation for every holder of a ``llama_vocab`` (the chat context, the
embedding context and the weights-free vocabulary model used to count tokens).
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from typing import Any

import llama_cpp.llama_cpp as C

_ATTR_UNKNOWN = 1 << 0
_ATTR_CONTROL = 1 << 3
_ATTR_USER_DEFINED = 1 << 4
_ATTR_LSTRIP = 1 << 7
_ATTR_RSTRIP = 1 << 8
_VOCAB_SPM, _VOCAB_BPE = 1, 2
#: texts at least this long have their control-text scan remembered, up to this many
_MEMO_MIN_CHARS, _MEMO_TEXTS = 32, 4096


@dataclass(frozen=True)
class SpecialToken:
    text: str
    id: int
    lstrip: bool
    rstrip: bool


@dataclass(frozen=True)
class VocabInfo:
    """What prompt tokenization needs from a vocabulary, computed once per model."""

    specials: tuple[SpecialToken, ...]
    """llama.cpp's special-token cache (control, user-defined, unknown), longest first."""
    control_texts: frozenset[str]
    """Texts that ``parse_special=True`` turns into control tokens and plain text does not."""
    bound_exact: bool
    """Whether the byte bound holds (SPM and BPE vocabularies; others normalize text)."""

    def __post_init__(self) -> None:
        heads = "".join(sorted({re.escape(t[0]) for t in self.control_texts}))
        lengths = sorted({len(t) for t in self.control_texts}, reverse=True)
        object.__setattr__(self, "_head_re", re.compile(f"[{heads}]") if heads else None)
        object.__setattr__(self, "_lengths", lengths)
        #: long texts already scanned (an agent loop sends its history again every turn)
        object.__setattr__(self, "_found", {})

    def find_control(self, text: str) -> list[str]:
        """Control-token texts occurring in ``text``: at each possible first character, one
        set lookup per distinct control-text length (no scan over thousands of texts)."""
        head_re: re.Pattern[str] | None = self._head_re  # type: ignore[attr-defined]
        if head_re is None or not text:
            return []
        memo: dict[str, tuple[str, ...]] = self._found  # type: ignore[attr-defined]
        long = len(text) >= _MEMO_MIN_CHARS
        if long:
            hit = memo.get(text)
            if hit is not None:
                return list(hit)
        lengths: list[int] = self._lengths  # type: ignore[attr-defined]
        controls = self.control_texts
        found: set[str] = set()
        for m in head_re.finditer(text):
            i = m.start()
            for n in lengths:
                cand = text[i : i + n]
                if cand in controls:
                    found.add(cand)
                    break
        out = sorted(found, key=len, reverse=True)
        if long:
            if len(memo) >= _MEMO_TEXTS:
                memo.clear()
            memo[text] = tuple(out)
        return out


@functools.cache
def _attr_getter() -> Any:
    """``llama_vocab_get_attr`` called without releasing the GIL: the call is a lookup,
    and a scan that released it 262k times would trade it with every other thread."""
    fn = ctypes.PyDLL(C._lib._name).llama_vocab_get_attr
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    fn.restype = ctypes.c_int32
    return fn


def scan_vocab(vocab: Any, n_vocab: int) -> VocabInfo:
    """llama.cpp's special-token table of ``vocab``: one attribute call per token, texts
    only for the specials."""
    specials: list[SpecialToken] = []
    control: set[str] = set()
    get_attr = _attr_getter()
    handle = ctypes.cast(vocab, ctypes.c_void_p)
    wanted = _ATTR_CONTROL | _ATTR_USER_DEFINED | _ATTR_UNKNOWN
    for tok in range(n_vocab):
        attr = get_attr(handle, tok)
        if attr & wanted:
            text = (C.llama_vocab_get_text(vocab, tok) or b"").decode("utf-8", errors="replace")
            if not text:
                continue
            specials.append(
                SpecialToken(text, tok, bool(attr & _ATTR_LSTRIP), bool(attr & _ATTR_RSTRIP))
            )
            if attr & (_ATTR_CONTROL | _ATTR_UNKNOWN):
                control.add(text)
    specials.sort(key=lambda s: len(s.text.encode("utf-8")), reverse=True)
    return VocabInfo(
        specials=tuple(specials),
        control_texts=frozenset(control),
        bound_exact=int(C.llama_vocab_type(vocab)) in (_VOCAB_SPM, _VOCAB_BPE),
    )


def longest_piece(vocab: Any, n_vocab: int) -> int:
    """Bytes of the longest vocabulary entry."""
    get_text = C.llama_vocab_get_text
    return max(len(get_text(vocab, tok) or b"") for tok in range(n_vocab))


def tokenize(vocab: Any, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
    """``text`` as token ids (retried once with the size llama.cpp asks for)."""
    data = text.encode("utf-8")
    cap = len(data) + 8
    arr = (C.llama_token * cap)()
    n = C.llama_tokenize(vocab, data, len(data), arr, cap, add_special, parse_special)
    if n < 0:
        cap = -n
        arr = (C.llama_token * cap)()
        n = C.llama_tokenize(vocab, data, len(data), arr, cap, add_special, parse_special)
        if n < 0:
            raise ValueError("tokenization failed")
    return list(arr[:n])


def token_piece(vocab: Any, token: int, *, special: bool = True) -> bytes:
    """The bytes ``token`` stands for."""
    buf = ctypes.create_string_buffer(64)
    n = C.llama_token_to_piece(vocab, token, buf, 64, 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = C.llama_token_to_piece(vocab, token, buf, -n, 0, special)
    return buf.raw[:n]


def token_text(vocab: Any, token: int) -> str:
    """The vocabulary's text of a special token (e.g. ``<bos>``), for templates."""
    if token < 0:
        return ""
    return token_piece(vocab, token, special=True).decode("utf-8", errors="replace")


def read_metadata(model: Any) -> dict[str, str]:
    """Every GGUF metadata value of a loaded ``llama_model``, as text."""
    out: dict[str, str] = {}
    buf_size = 1 << 16
    buf = ctypes.create_string_buffer(buf_size)
    for i in range(C.llama_model_meta_count(model)):
        n = C.llama_model_meta_key_by_index(model, i, buf, buf_size)
        if n < 0:
            continue
        key = buf.value.decode("utf-8", errors="replace")
        n = C.llama_model_meta_val_str_by_index(model, i, buf, buf_size)
        if n >= buf_size:  # long chat templates: retry with a buffer that fits
            big = ctypes.create_string_buffer(n + 1)
            C.llama_model_meta_val_str_by_index(model, i, big, n + 1)
            out[key] = big.value.decode("utf-8", errors="replace")
        elif n >= 0:
            out[key] = buf.value.decode("utf-8", errors="replace")
    return out


class VocabMethods:
    """Token methods over ``self.vocab`` (a ``llama_vocab``), shared by every holder of
    one: the chat context and the weights-free vocabulary model."""

    vocab: Any

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        return tokenize(self.vocab, text, add_special=add_special, parse_special=parse_special)

    def token_piece(self, token: int, *, special: bool = True) -> bytes:
        return token_piece(self.vocab, token, special=special)

    def token_text(self, token: int) -> str:
        """The vocabulary's text of a special token (e.g. ``<bos>``), for templates."""
        return token_text(self.vocab, token)

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    def is_control(self, token: int) -> bool:
        return bool(C.llama_vocab_is_control(self.vocab, token))
