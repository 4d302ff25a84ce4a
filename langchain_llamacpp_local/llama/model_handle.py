"""One loaded ``llama_model`` per (file, model load settings), shared by reference count.

A chat model and an embeddings model on the same GGUF each need their own
llama.cpp context (different batch, pooling and memory), but not their own
copy of the weights: :func:`acquire` hands out references to one loaded model
and frees it when the last reference is released. Contexts must be freed
before the reference that created them is released.

The module is generic (the loader and the free function are passed in), so the
reference counting is testable without llama.cpp.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Hashable
from typing import Any

logger = logging.getLogger(__name__)


def model_address(model: object) -> int:
    """A loaded model's address: the key of the tables kept per model (weight buffers,
    LoRA adapters), which must not hold the model itself."""
    return int(ctypes.cast(model, ctypes.c_void_p).value or 0)


def model_file(path: str | os.PathLike[str]) -> str:
    """The one spelling of a model file's path in every key (chat, embeddings, rerank,
    draft, projector): absolute, ``~`` expanded, symlinks kept. Keeping links matters: a
    split GGUF's parts are found by name beside the first, and Hugging Face's cache links
    each name to a hashed blob, so resolving would lose the siblings."""
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


class _SharedModel:
    """A model slot: loaded once, freed when ``refs`` drops to zero."""

    def __init__(self, key: Hashable, free: Callable[[Any], None]) -> None:
        self.key = key
        self.free = free
        self.refs = 0
        self.model: Any = None
        self.load_lock = threading.Lock()  # one loader per key; others wait for it


_entries: dict[Hashable, _SharedModel] = {}
_lock = threading.Lock()
#: the parent's models in a forked child: kept (never freed there) but not shared
_forked_away: list[_SharedModel] = []


def _after_fork_in_child() -> None:
    """A forked child inherits the parent's models, with locks their loaders (threads
    that do not exist in the child) may hold: it loads its own. The parent's stay
    referenced, so nothing in the child frees memory the parent's contexts still use."""
    global _lock
    _lock = threading.Lock()
    _forked_away.extend(_entries.values())
    _entries.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ModelRef:
    """A counted reference to a loaded model; :meth:`release` it exactly once."""

    def __init__(self, entry: _SharedModel) -> None:
        self._entry: _SharedModel | None = entry
        self.model: Any = entry.model
        self.key = entry.key

    @property
    def released(self) -> bool:
        return self._entry is None

    def release(self) -> None:
        """Drop this reference; the last one frees the model. Idempotent."""
        entry, self._entry = self._entry, None
        if entry is None:
            return
        self.model = None
        with _lock:
            entry.refs -= 1
            if entry.refs > 0:
                return
            if _entries.get(entry.key) is entry:
                del _entries[entry.key]
            model, entry.model = entry.model, None
        if model is not None:
            logger.debug("freeing model %r", entry.key)
            entry.free(model)


def acquire(key: Hashable, load: Callable[[], Any], free: Callable[[Any], None]) -> ModelRef:
    """A reference to the model for ``key``, calling ``load()`` if none is loaded.

    ``load`` returns the model or raises; a failed load leaves nothing behind
    (a later call tries again). Concurrent callers with the same key wait for
    one load instead of loading twice.
    """
    with _lock:
        entry = _entries.get(key)
        if entry is None:
            entry = _entries[key] = _SharedModel(key, free)
        entry.refs += 1
    try:
        with entry.load_lock:
            if entry.model is None:
                entry.model = load()
                logger.debug("loaded model %r", key)
    except BaseException:
        with _lock:
            entry.refs -= 1
            if entry.refs == 0 and entry.model is None and _entries.get(key) is entry:
                del _entries[key]
        raise
    return ModelRef(entry)


def model_refcounts() -> dict[Hashable, int]:
    """The keys of the loaded models and their reference counts (diagnostics, tests)."""
    with _lock:
        return {k: e.refs for k, e in _entries.items() if e.model is not None}
