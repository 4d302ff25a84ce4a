"""What :class:`~.slot_memory.SlotMemory` needs of a context's memory, as a protocol.

:class:`~langchain_llamacpp_local.llama.engine.Engine` satisfies it with llama.cpp's
``llama_memory_*`` and ``llama_state_seq_*`` calls; the unit tests satisfy it with a
pure-Python store of token positions per sequence, so the slot bookkeeping (reuse,
parking, checkpoints, verify rollback) is tested without a model, as vLLM tests its
KV-cache manager.
"""

from __future__ import annotations

from typing import Protocol

from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.llama.probes import MemoryKind


class SequenceStore(Protocol):
    """A context's sequences: positions per sequence, removable, copyable, savable."""

    config: LoadConfig
    """The load settings (``deterministic``; the disk cache's key)."""
    memory_kind: MemoryKind
    """Whether a suffix can be trimmed (attention), not at all (recurrent) or only
    while the sliding window still holds what comes before it."""
    n_slots: int
    n_ctx: int
    """Positions one sequence may hold."""
    n_ctx_total: int
    """Positions of the whole memory (a unified cache shares them)."""
    n_batch: int
    n_ubatch: int
    n_swa: int
    kv_unified: bool
    is_recurrent: bool
    is_hybrid: bool
    can_shift: bool
    """Whether positions can be moved (``seq_add``): chunk reuse after a history edit."""
    mrope: bool
    """Whether positions are several numbers per entry (never shifted)."""

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (-1: open end); False when this
        memory cannot (a part of a recurrent state)."""
        ...

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Give ``dst`` the positions [p0, p1) of ``src``."""
        ...

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move ``seq_id``'s positions [p0, p1) by ``delta``."""
        ...

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position ``seq_id`` holds (-1: empty)."""
        ...

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position ``seq_id`` holds (-1: empty)."""
        ...

    def state_size(self, seq_id: int, flags: int = 0) -> int:
        """Bytes :meth:`state_get` would return."""
        ...

    def state_get(self, seq_id: int, flags: int = 0) -> bytes:
        """``seq_id``'s state (``PARTIAL_ONLY``: only what cannot be trimmed)."""
        ...

    def state_set(self, data: bytes, seq_id: int, flags: int = 0) -> bool:
        """Load a state into ``seq_id``; False when refused."""
        ...

    def wipe_memory(self, drop: set[int], *, zero: bool = True) -> frozenset[int]:
        """Clear the whole memory (``zero``: its data too) keeping every sequence but
        ``drop``, put back from the first cell on; the sequences that could not be."""
        ...


__all__ = ["SequenceStore"]
