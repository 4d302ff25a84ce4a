"""What callers may read of a worker: its model's facts (:class:`ModelInfo`, read once
after load) and a read-only snapshot (:meth:`~.worker.ModelWorker.stats`) for tests,
benchmarks and monitoring, as frozen data taken between two steps."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelInfo:
    """What callers may want to know about the loaded model (read once after load)."""

    model_name: str
    n_ctx: int
    n_ctx_train: int
    n_vocab: int
    n_slots: int
    memory_kind: str
    metadata: dict[str, str]
    #: the chat template's origin and tool-call format: the front end's (resolved once
    #: per loaded model on the caller's side); empty in the worker's own copy
    template_origin: str = ""
    tool_format: str = ""
    #: MiB of weights per buffer type, as llama.cpp reported the load (CPU_REPACK, AMX...)
    weight_buffers: dict[str, float] = field(default_factory=dict)
    #: the CPU threads chosen at load (``n_threads``, ``n_threads_batch``, the usable
    #: CPUs they were chosen from and why); under load fewer may run at a time
    threads: dict[str, object] = field(default_factory=dict)


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


__all__ = ["ModelInfo", "SlotStats", "WorkerStats"]
