"""From rendered prompt text to tokens: role-boundary safety and an early size bound.

Two jobs, both about what the tokenizer must never be asked to do:

* **No forged turns**. Tokenizing the whole prompt with special-token
  parsing would turn ``<end_of_turn>`` or ``<|im_end|>`` typed by a user (or returned
  by a tool) into real control tokens. When message content contains the text of a
  control token, the prompt is tokenized the way llama.cpp would with only the
  template's own markup special: llama.cpp's special-token partition is replayed on
  the render where content control texts were replaced by private-use placeholders,
  and each raw fragment (content restored) is tokenized with ``parse_special=False``.
  Prompts without such content take the usual single ``llama_tokenize`` call, so
  they (and the prompt cache) are unchanged.
* **No tokenizing what cannot fit**. Every token covers at most
  :func:`max_piece_bytes` bytes of the text (the longest vocabulary entry), so
  ``non-whitespace bytes / max_piece_bytes`` bounds the token count from below; a
  prompt whose bound already exceeds the context fails before it is tokenized, with
  no false errors.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_llamacpp_local.errors import ContextOverflowError
from langchain_llamacpp_local.llama.vocab import SpecialToken, VocabInfo, longest_piece, scan_vocab
from langchain_llamacpp_local.runtime.worker import join_all

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from langchain_llamacpp_local.llama.engine import Engine

__all__ = [
    "VocabInfo",
    "check_fits",
    "content_has_control_text",
    "protect_content",
    "protected_parts",
    "scan_in_background",
    "tokenize_protected",
    "vocab_info",
]

_cache: weakref.WeakKeyDictionary[Any, VocabInfo] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A parent's caller may have held the lock at a fork."""
    global _cache_lock
    _cache_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


_scans: weakref.WeakKeyDictionary[Any, threading.Thread] = weakref.WeakKeyDictionary()


def vocab_info(eng: Engine) -> VocabInfo:
    """The engine's :class:`VocabInfo` (scanned on first use, then cached; a scan started
    by :func:`scan_in_background` is waited for)."""
    with _cache_lock:
        info = _cache.get(eng)
        scan = _scans.get(eng)
    if info is None and scan is not None:
        scan.join()
        with _cache_lock:
            info = _cache.get(eng)
    if info is None:
        info = scan_vocab(eng.vocab, eng.n_vocab)
        with _cache_lock:
            _cache[eng] = info
    return info


def _join_scans_at_exit(timeout: float = 10.0) -> None:
    """Wait for the vocabulary scans still running (within ``timeout`` in all): one that
    holds the last reference to its model frees it on its thread, and llama.cpp logs
    through a Python callback there, which a daemon thread must not do once the
    interpreter finalizes (``pthread_exit`` unwinding through C++ aborts the process)."""
    with _cache_lock:
        threads = list(_scans.values())
    join_all(threads, timeout)


atexit.register(_join_scans_at_exit)


def scan_in_background(eng: Engine) -> None:
    """Start the vocabulary scan on a thread of its own (one ctypes call per token: a
    tenth of a second for a 262k vocabulary), so that loading does not wait for it; the
    first request that needs it does, if it is not done by then."""
    with _cache_lock:
        if eng in _cache or eng in _scans:
            return
    ref = eng.hold_model()  # the vocabulary outlives an engine closed meanwhile
    vocab, n_vocab = eng.vocab, eng.n_vocab

    def run() -> None:
        try:
            info = scan_vocab(vocab, n_vocab)
            with _cache_lock:
                _cache[eng] = info
        except Exception:  # vocab_info scans again on the request
            logger.debug("background vocabulary scan failed", exc_info=True)
        finally:
            ref.release()

    thread = threading.Thread(target=run, name="llamacpp-vocab-scan", daemon=True)
    with _cache_lock:
        _scans[eng] = thread
    thread.start()


_piece_cache: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def max_piece_bytes(eng: Engine) -> int:
    """Bytes of the longest vocabulary entry, an upper bound on any token's piece (SPM's
    ``\u2581`` is longer than the space it stands for, byte-level BPE chars are >= 1 byte).

    Scanned on the first oversized prompt only, then cached.
    """
    with _cache_lock:
        cached = _piece_cache.get(eng)
    if cached is None:
        cached = max(longest_piece(eng.vocab, eng.n_vocab), 8)  # an unknown char: one token
        with _cache_lock:
            _piece_cache[eng] = cached
    return cached


# --------------------------------------------------------------------------- size bound

_WS = re.compile(rb"\s+")


def min_tokens(eng: Engine, text: str) -> int:
    """A lower bound on the tokens of ``text`` (0 when the vocabulary gives none)."""
    if not vocab_info(eng).bound_exact:
        return 0
    data = text.encode("utf-8", errors="surrogatepass")
    # whitespace next to an lstrip/rstrip special token is dropped, so it is not counted
    n = len(data) - sum(len(m) for m in _WS.findall(data))
    return -(-n // max_piece_bytes(eng))


def check_fits(eng: Engine, text: str, max_tokens: int | None) -> None:
    """Raise :class:`ContextOverflowError` when ``text`` cannot fit before tokenizing it."""
    n_ctx = eng.n_ctx
    if len(text) <= n_ctx:  # short: the bound cannot decide it and tokenizing is cheap
        return
    low = min_tokens(eng, text)
    if low >= n_ctx or (max_tokens is not None and max_tokens > n_ctx - low):
        raise ContextOverflowError(
            f"prompt of at least {low} tokens ({len(text)} characters)"
            + (f" plus max_tokens={max_tokens}" if max_tokens is not None else "")
            + f" does not fit the context window of {n_ctx} tokens"
            " (raise n_ctx, lower max_tokens or shorten the conversation)"
        )


# --------------------------------------------------------------------------- injection

_PUA = 0xF0000  # supplementary private use area: never a special token, survives trim/lower


def content_has_control_text(info: VocabInfo, messages: Any) -> list[str]:
    """Control-token texts found in any string inside ``messages`` (or any other data
    given to the template: tools, template kwargs), dictionary keys included."""
    found: set[str] = set()
    for text in _strings(messages):
        found.update(info.find_control(text))
    return sorted(found, key=len, reverse=True)


def _strings(value: Any) -> Any:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield k
            if k not in ("role", "type"):
                yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def protect_content(messages: Any, texts: Sequence[str]) -> tuple[Any, dict[str, str]]:
    """Replace each of ``texts`` in every message string by a placeholder character.

    Returns the new messages and placeholder → original text.
    """
    mapping = {chr(_PUA + i): t for i, t in enumerate(texts)}
    pattern = re.compile("|".join(re.escape(t) for t in texts))
    reverse = {t: ph for ph, t in mapping.items()}

    def sub(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: reverse[m.group(0)], value)
        if isinstance(value, dict):
            return {
                (sub(k) if isinstance(k, str) else k): (v if k in ("role", "type") else sub(v))
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [sub(v) for v in value]
        if isinstance(value, tuple):
            return tuple(sub(v) for v in value)
        return value

    return sub(messages), mapping


def restore(text: str, mapping: dict[str, str]) -> str:
    """The placeholders (raw, or JSON-escaped by ``tojson(ensure_ascii=True)``) → originals."""
    for ph, orig in mapping.items():
        text = text.replace(ph, orig)
        escaped = json.dumps(ph)[1:-1]
        if escaped in text:
            text = text.replace(escaped, json.dumps(orig)[1:-1])
    return text


def partition_specials(text: str, specials: Sequence[SpecialToken]) -> list[str | SpecialToken]:
    """llama.cpp's ``tokenizer_st_partition``: split raw text at special tokens, longest
    token first, honouring lstrip/rstrip."""
    frags: list[str | SpecialToken] = [text]
    for sp in specials:
        if not any(isinstance(f, str) and sp.text in f for f in frags):
            continue
        out: list[str | SpecialToken] = []
        for f in frags:
            if not isinstance(f, str):
                out.append(f)
                continue
            rest = f
            while True:
                i = rest.find(sp.text)
                if i < 0:
                    if rest:
                        out.append(rest)
                    break
                left = rest[:i]
                if sp.lstrip:
                    left = left.rstrip()
                if left:
                    out.append(left)
                out.append(sp)
                rest = rest[i + len(sp.text) :]
                if sp.rstrip:
                    rest = rest.lstrip()
        frags = out
    return frags


def tokenize_protected(
    eng: Engine, info: VocabInfo, text_with_placeholders: str, mapping: dict[str, str]
) -> list[int]:
    """Tokenize with only the template's markup special: special tokens are found in the
    placeholder render (content cannot contain one there), raw fragments are tokenized
    as plain text with the content restored."""
    tokens: list[int] = [eng.bos_id] if eng.add_bos and eng.bos_id >= 0 else []
    for frag in partition_specials(text_with_placeholders, info.specials):
        if isinstance(frag, SpecialToken):
            tokens.append(frag.id)
        else:
            tokens.extend(
                eng.tokenize(restore(frag, mapping), add_special=False, parse_special=False)
            )
    return tokens


def protected_parts(
    info: VocabInfo, text_with_placeholders: str, mapping: dict[str, str], media_marker: str
) -> list[tuple[str, bool] | None]:
    """:func:`tokenize_protected`'s split for a prompt with images, for mtmd.

    Returns text parts ``(text, parse_special)`` (the template's special tokens with
    ``True``, message text restored with ``False``) and ``None`` where each media
    marker stood: mtmd tokenizes each part as given and puts an image at each ``None``.
    """
    parts: list[tuple[str, bool] | None] = []
    for frag in partition_specials(text_with_placeholders, info.specials):
        if isinstance(frag, SpecialToken):
            parts.append((frag.text, True))
            continue
        pieces = frag.split(media_marker)
        for k, piece in enumerate(pieces):
            if k:
                parts.append(None)
            if piece:
                parts.append((restore(piece, mapping), False))
    return parts
