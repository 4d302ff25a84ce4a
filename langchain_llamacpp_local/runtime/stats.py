"""A worker's read-only snapshot (:meth:`~.worker.ModelWorker.stats`): what tests,
benchmarks and monitoring may read of it, as frozen data taken between two steps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlotStats:
    """One slot as the worker saw it between two steps."""

    seq_id: int
    n_past: int  # entries the slot's memory records
    pos_max: int  # the newest position llama.cpp holds for the sequence (-1: none)
    checkpoint_bytes: int  # its state checkpoints' total size


@dataclass(frozen=True)
class WorkerStats:
    """A read-only snapshot of a worker, taken on its thread between two steps
    (:meth:`ModelWorker.stats`): for tests, benchmarks and monitoring."""

    slots: tuple[SlotStats, ...]
    n_active: int  # requests holding a slot (reading their prompt, generating, scoring)
    n_pending: int  # requests queued for a slot
    preparing: int  # requests their callers are preparing (:meth:`ModelWorker.preparing`)
    host_ram_items: int  # conversations the host-RAM prompt cache holds
    kv_unified: bool
    exact_rows: int  # generation rows one call keeps bit-identical (0: not probed)
    exact_verify_rows: int  # verify rows one call keeps bit-identical (0: not probed)


__all__ = ["SlotStats", "WorkerStats"]
