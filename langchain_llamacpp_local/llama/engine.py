"""The chat context: the operations the worker needs of llama.cpp's C API.

It owns a context and a reusable batch on a shared model (:mod:`.loading`), and
exposes tokenize, decode a chunk at given positions, read logits, trim/copy memory,
save/restore sequence state, LoRA sets (:mod:`.lora_registry`) and images
(:mod:`.mtmd`). Keeping these ctypes calls here means the cache logic above it is
plain Python.

An :class:`Engine` is not thread-safe: only its worker thread may use it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Hashable, Sequence

import llama_cpp.llama_cpp as C
import numpy as np

from langchain_llamacpp_local.errors import (
    DecodeError,
    ModelLoadError,
    NonFiniteOutputError,
    RequestCancelledError,
    WorkerDeadError,
)
from langchain_llamacpp_local.llama import model_handle, mtmd, vocab
from langchain_llamacpp_local.llama.abort import DecodeAbort
from langchain_llamacpp_local.llama.backend import aborting, init_backend
from langchain_llamacpp_local.llama.context import (
    fill_batch,
    flash_attn_type,
    free_context,
    new_context,
)
from langchain_llamacpp_local.llama.loading import (
    LoadConfig,
    check_load_config,
    flash_attn_setting,
    kv_type,
    load_model,
    weight_buffers,
)
from langchain_llamacpp_local.llama.lora_registry import alora_invocation_tokens, load_adapter
from langchain_llamacpp_local.llama.mtmd import MediaChunk
from langchain_llamacpp_local.llama.omp import ran_team
from langchain_llamacpp_local.llama.probes import probe_exactness, probe_memory
from langchain_llamacpp_local.llama.settings import DEFAULT_MAX_CTX
from langchain_llamacpp_local.llama.threads import (
    cpu_budget,
    default_cpu_view,
    log_thread_plan,
    plan_threads,
)

logger = logging.getLogger(__name__)

#: ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: a sequence's state without its trimmable KV
#: (what a checkpoint of recurrent or sliding-window memory saves).
PARTIAL_ONLY = 1

#: Rope types whose positions are several numbers per entry (M-RoPE, interleaved
#: M-RoPE, vision): llama.cpp's K-shift does not support them.
_MULTI_POS_ROPE = frozenset(
    {C.LLAMA_ROPE_TYPE_MROPE, C.LLAMA_ROPE_TYPE_IMROPE, C.LLAMA_ROPE_TYPE_VISION}
)


class Engine(vocab.VocabMethods):
    """A loaded model with one persistent context (see module docstring)."""

    def __init__(self, config: LoadConfig, progress: Callable[[float], None] | None = None) -> None:
        init_backend()
        self.config = config
        check_load_config(config)
        type_k = kv_type(config.type_k, "type_k")
        type_v = kv_type(config.type_v, "type_v")

        self._model_ref = load_model(config, progress)
        self.model = model = self._model_ref.model
        self.weight_buffers = weight_buffers(model)
        self.ctx = None
        self.mtmd: object | None = None
        #: held while a caller's thread tokenizes images with the projector, and while
        #: the worker frees it: mtmd's tokenizer only reads the projector's settings
        #: (llama.cpp's server tokenizes on its HTTP threads as well), but must not
        #: outlive it
        self._mtmd_lock = threading.Lock()
        self._batch: C.llama_batch | None = None
        # the adapter set applied to the context (set_lora); () while probing
        self._lora_current: tuple[tuple[str, float], ...] = ()
        try:
            self.vocab = C.llama_model_get_vocab(model)
            self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
            self.n_ctx_train = C.llama_model_n_ctx_train(model)
            self.metadata = self._read_metadata()
            self.is_recurrent = bool(C.llama_model_is_recurrent(model))
            self.is_hybrid = bool(C.llama_model_is_hybrid(model))
            self.n_swa = int(C.llama_model_n_swa(model))

            # n_ctx is one conversation's window. Per-sequence KV streams (the default)
            # give each slot a window of its own, so the context holds n_ctx x n_slots.
            n_ctx = config.n_ctx or min(self.n_ctx_train or DEFAULT_MAX_CTX, DEFAULT_MAX_CTX)
            n_seq = config.n_slots
            cparams = C.llama_context_default_params()
            cparams.n_ctx = n_ctx if config.kv_unified else n_ctx * n_seq
            cparams.n_batch = min(config.n_batch, n_ctx)
            cparams.n_ubatch = min(config.n_ubatch or config.n_batch, cparams.n_batch)
            cparams.n_seq_max = n_seq
            cparams.kv_unified = config.kv_unified
            self.thread_plan = plan = plan_threads(
                default_cpu_view(), config.n_threads, config.n_threads_batch
            )
            log_thread_plan(plan)
            threads = plan.n_threads_batch
            cparams.n_threads = plan.n_threads
            cparams.n_threads_batch = plan.n_threads_batch
            #: decodes of this context (and of a draft model's, which runs on the same
            #: thread) draw threads from the process-wide budget under one id
            self.team = id(self)
            self._threads_set = (plan.n_threads, plan.n_threads_batch)
            # the process-wide budget, looked up once (not per decode); None for an
            # explicit setting, which always wins, and for deterministic mode, which
            # keeps one team size (its exactness probes are keyed by it)
            self._budget = (
                cpu_budget()
                if config.n_threads is None
                and config.n_threads_batch is None
                and not config.deterministic
                else None
            )
            cparams.swa_full = config.swa_full
            cparams.no_perf = True
            cparams.flash_attn_type = flash_attn_type(flash_attn_setting(config))
            if type_k is not None:
                cparams.type_k = type_k
            if type_v is not None:
                cparams.type_v = type_v
            if config.rope_freq_base:
                cparams.rope_freq_base = config.rope_freq_base
            if config.rope_freq_scale:
                cparams.rope_freq_scale = config.rope_freq_scale
            self._abort = DecodeAbort()
            self._abort.install(cparams)
            ctx = new_context(
                model, cparams, f"a context of {n_ctx} tokens for {config.model_path}"
            )
            self.ctx = ctx
            self.kv_unified = config.kv_unified
            #: every row of a call attends over every used cell of the pool (a unified
            #: cache without flash attention: llama.cpp's n_kv spans them all, other
            #: sequences' cells masked); the stall budget's cost model counts them
            self.attends_all_cells = config.kv_unified and flash_attn_setting(config) is False
            self.n_ctx_total = int(C.llama_n_ctx(ctx))
            # llama.cpp pads each stream to a multiple of 256: the window of one slot
            self.n_ctx = (
                self.n_ctx_total if self.kv_unified else min(n_ctx, self.n_ctx_total // n_seq)
            )
            self.n_batch = int(C.llama_n_batch(ctx))
            self.n_ubatch = int(C.llama_n_ubatch(ctx))
            self.n_slots = int(C.llama_n_seq_max(ctx))
            self.mem = C.llama_get_memory(ctx)
            self._batch = C.llama_batch_init(self.n_batch, 0, self.n_slots)
            self.add_bos = bool(C.llama_vocab_get_add_bos(self.vocab))
            self.bos_id = int(C.llama_vocab_bos(self.vocab))
            self.eos_id = int(C.llama_vocab_eos(self.vocab))
            self.memory_kind = probe_memory(self)
            #: whether cached entries can be moved to other positions (llama.cpp's
            #: ``llama_memory_can_shift``), and whether positions are several numbers
            #: per entry (M-RoPE), which llama.cpp never shifts
            self.can_shift = bool(C.llama_memory_can_shift(self.mem))
            self.mrope = int(C.llama_model_rope_type(model)) in _MULTI_POS_ROPE
            # 0: not probed (only deterministic mode needs them)
            self.exact_rows = 0
            self.exact_verify_rows = 0
            if config.deterministic:
                self.exact_rows, self.exact_verify_rows = probe_exactness(self, threads)
            self.mtmd = mtmd.load_projector(config, model, threads) if config.mmproj_path else None
            self._load_lora()
        except BaseException:
            self.close()
            raise
        logger.debug(
            "loaded %s: n_ctx=%d n_batch=%d n_ubatch=%d memory=%s n_swa=%d",
            config.model_path,
            self.n_ctx,
            self.n_batch,
            self.n_ubatch,
            self.memory_kind.value,
            self.n_swa,
        )

    def _load_lora(self) -> None:
        """Load (or share) this model's LoRA adapters; none is applied yet."""
        self.lora: dict[str, object] = {}
        self.lora_defaults: dict[str, float] = {}
        self.alora: dict[str, list[int]] = {}
        for name, path, scale in self.config.lora_adapters:
            try:
                adapter = load_adapter(self.model, self.config.model_path, path)
            except ModelLoadError as exc:
                raise ModelLoadError(f"LoRA adapter {name!r}: {exc}") from None
            self.lora[name] = adapter
            self.lora_defaults[name] = scale
            invocation = alora_invocation_tokens(adapter)
            if invocation:
                self.alora[name] = invocation

    def check_lora(self, lora: Sequence[tuple[str, float]]) -> None:
        """Raise ``ValueError`` if ``lora`` names an adapter this context did not load."""
        unknown = [n for n, _ in lora if n not in self.lora]
        if unknown:
            raise ValueError(
                f"unknown LoRA adapter {unknown[0]!r}: this model has "
                f"{sorted(self.lora) or 'none'} (lora_adapters=...)"
            )

    def set_lora(self, lora: Sequence[tuple[str, float]]) -> None:
        """Apply the adapter set ``lora`` ((name, scale) pairs) to the context for the
        decodes that follow; a no-op when it is already applied."""
        key = tuple(lora)
        if key == self._lora_current:
            return
        self.check_lora(key)
        n = len(key)
        adapters = (C.llama_adapter_lora_p_ctypes * max(1, n))(*(self.lora[k] for k, _ in key))
        scales = (ctypes.c_float * max(1, n))(*(s for _, s in key))
        rc = C.llama_set_adapters_lora(self.ctx, adapters if n else None, n, scales if n else None)
        if rc != 0:
            raise DecodeError(f"llama.cpp could not apply the LoRA adapters {key} (code {rc})")
        self._lora_current = key

    def tokenize_multimodal(
        self,
        text: str | Sequence[tuple[str, bool] | None],
        images: Sequence[mtmd.MediaInput],
    ) -> tuple[list[Hashable], dict[int, MediaChunk]]:
        """:func:`.mtmd.tokenize_multimodal` with this model's projector, on the
        caller's thread (image and audio preprocessing run there, not on the decode loop)."""
        with self._mtmd_lock:
            if self.ctx is None:
                raise WorkerDeadError("the model was closed")
            return mtmd.tokenize_multimodal(self.mtmd, text, images)

    def eval_media(self, media: MediaChunk, pos: int, seq_id: int) -> None:
        """Encode an image chunk and decode its embeddings at ``pos`` of ``seq_id``."""
        mtmd.eval_media(self.mtmd, self.ctx, self.n_batch, media, pos, seq_id)

    # ------------------------------------------------------------------ metadata

    def _read_metadata(self) -> dict[str, str]:
        return vocab.read_metadata(self.model)

    # ------------------------------------------------------------------ decode

    def decode(
        self,
        tokens: Sequence[int],
        pos0: int,
        seq_id: int,
        *,
        logits_last: bool = True,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        """Decode ``tokens`` of one sequence at positions ``pos0..`` in ``n_batch`` chunks.

        ``cancel`` is checked before each chunk and, through llama.cpp's abort
        callback, inside a long decode. Raises :class:`RequestCancelledError` or
        :class:`DecodeError`; the chunks decoded before that stay in the cache.
        """
        n = len(tokens)
        done = 0
        while done < n:
            if cancel is not None and cancel():
                raise RequestCancelledError("cancelled during prompt processing")
            chunk = min(self.n_batch, n - done)
            last = done + chunk == n
            self.decode_batch(
                tokens[done : done + chunk],
                range(pos0 + done, pos0 + done + chunk),
                [seq_id] * chunk,
                [logits_last and last and i == chunk - 1 for i in range(chunk)],
                cancel=cancel,
            )
            done += chunk

    def decode_batch(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seq_ids: Sequence[int],
        outputs: Sequence[bool],
        *,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        """One ``llama_decode`` of up to ``n_batch`` tokens from several sequences.

        This is the continuous-batching step: prompt chunks of some requests and
        the next token of others go through the model together. ``outputs[i]``
        asks for logits at batch index ``i`` (read them with :meth:`logits`).
        """
        batch = self._batch
        assert batch is not None
        n = len(tokens)
        if n == 0:
            return
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        fill_batch(batch, tokens, positions, seq_ids, outputs)
        try:
            if cancel is None:  # a generation step: nothing to watch
                rc = self._run_decode(batch, n)
            else:
                with self._abort.watch(self.ctx, cancel):
                    rc = self._run_decode(batch, n)
        finally:
            aborting.active = False
            ran_team(self._threads_set[0 if n == 1 else 1])
        if rc == 2:
            raise RequestCancelledError("cancelled during decoding")
        if rc != 0:
            raise DecodeError(
                f"llama_decode failed with code {rc} "
                f"({'no KV slot for the batch' if rc == 1 else 'backend error'})"
            )
        if self._lora_current and any(outputs):
            self._check_finite([(i, seq_ids[i]) for i, out in enumerate(outputs) if out])

    def _run_decode(self, batch: C.llama_batch, n: int) -> int:
        """``llama_decode`` of ``n`` tokens on the threads the CPU budget gives."""
        if self._budget is None:
            return int(C.llama_decode(self.ctx, batch))
        plan = self.thread_plan
        want = plan.n_threads if n == 1 else plan.n_threads_batch
        with self._budget.threads(self.team, want) as got:
            self._use_threads(min(plan.n_threads, got), min(plan.n_threads_batch, got))
            return int(C.llama_decode(self.ctx, batch))

    def _check_finite(self, rows: Sequence[tuple[int, int]]) -> None:
        """After a decode under LoRA adapters: raise :class:`NonFiniteOutputError` if an
        output row (``(index, seq_id)`` pairs) holds NaN or inf, once the memory is wiped
        (:meth:`wipe_memory`).

        A scale within bounds can still overflow a pathological adapter's activations;
        the f16 KV cache then holds inf, and every sequence of a unified pool (every later
        one of a stream) multiplies those cells by a 0 attention weight: NaN. A sequence's
        last row attends to all its cells, so its logits show it. Checked here, before any
        other decode, and only under adapters: nothing else a request sends reaches the
        activations.
        """
        bad: set[int] = set()
        for i, seq in rows:
            if int(seq) not in bad:
                row = np.ctypeslib.as_array(C.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))
                if not np.isfinite(row).all():
                    bad.add(int(seq))
        if not bad:
            return
        adapters = dict(self._lora_current)
        lost = self.wipe_memory(bad)
        logger.warning(
            "LoRA adapters %s gave non-finite logits: KV memory wiped, %d other sequences lost",
            adapters,
            len(lost),
        )
        raise NonFiniteOutputError(
            f"the LoRA adapters {adapters} drove the model's activations out of range "
            "(NaN or inf logits): the request was stopped and its KV cells wiped, so no "
            "other request sees them. Lower the scale, or check the adapter file",
            frozenset(bad),
            lost,
        )

    def wipe_memory(self, drop: set[int], *, zero: bool = True) -> frozenset[int]:
        """Clear the memory keeping every sequence but ``drop``, put back from cell 0 on
        (llama.cpp's search for free cells restarts there): returns the sequences that
        could not be put back (their cells are gone).

        Removing a sequence's cells only marks them free; their data stays in the
        buffers and a masked cell is still multiplied (0 * inf = NaN): ``zero`` clears
        the buffers too. So the other sequences are copied out, the memory cleared, and
        they are put back."""
        for seq in drop:
            self.seq_rm(seq, -1, -1)
        saved = [
            (seq, self.state_get(seq, 0))
            for seq in range(self.n_slots)
            if seq not in drop and self.seq_pos_max(seq) >= 0
        ]
        self.clear(zero=zero)
        lost: set[int] = set()
        for seq, data in saved:
            if not self.state_set(data, seq, 0):
                self.seq_rm(seq, -1, -1)
                lost.add(seq)
        return frozenset(lost)

    def _use_threads(self, n_threads: int, n_threads_batch: int) -> None:
        """Set the context's thread counts for the next decode (llama.cpp reads them
        per graph, so changing them between decodes is free)."""
        if (n_threads, n_threads_batch) != self._threads_set:
            C.llama_set_n_threads(self.ctx, n_threads, n_threads_batch)
            self._threads_set = (n_threads, n_threads_batch)

    def logits(self, idx: int = -1) -> np.ndarray:
        """A copy of the logits of output ``idx`` of the last decode (-1: the last one)."""
        ptr = C.llama_get_logits_ith(self.ctx, idx)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    # ------------------------------------------------------------------ memory

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        return bool(C.llama_memory_seq_rm(self.mem, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        C.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move ``seq_id``'s positions [p0, p1) by ``delta`` (keys re-rotated on the next
        decode); the caller checked :attr:`can_shift`."""
        C.llama_memory_seq_add(self.mem, seq_id, p0, p1, delta)

    def seq_pos_min(self, seq_id: int) -> int:
        return int(C.llama_memory_seq_pos_min(self.mem, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(C.llama_memory_seq_pos_max(self.mem, seq_id))

    def clear(self, *, zero: bool = True) -> None:
        """Empty the memory; ``zero`` also clears its buffers' data."""
        C.llama_memory_clear(self.mem, zero)

    def state_size(self, seq_id: int, flags: int = 0) -> int:
        """Bytes of ``seq_id``'s state: llama.cpp counts them without copying any data."""
        return int(C.llama_state_seq_get_size_ext(self.ctx, seq_id, flags))

    def state_get(self, seq_id: int, flags: int = 0) -> bytearray:
        """``seq_id``'s state, copied once (it may be the whole KV cache of a conversation:
        no second copy into ``bytes``)."""
        size = self.state_size(seq_id, flags)
        raw = bytearray(size)  # slicing a ctypes array would build a list of ints
        buf = (ctypes.c_uint8 * size).from_buffer(raw)
        n = C.llama_state_seq_get_data_ext(self.ctx, buf, size, seq_id, flags)
        del buf
        del raw[n:]
        return raw

    def state_set(self, data: bytes, seq_id: int, flags: int = 0) -> bool:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return C.llama_state_seq_set_data_ext(self.ctx, buf, len(data), seq_id, flags) > 0

    def hold_model(self) -> model_handle.ModelRef:
        """Another counted reference to this engine's model (release it exactly once):
        the model and its vocabulary stay valid for its holder even after :meth:`close`."""

        def not_loaded() -> object:
            raise RuntimeError("the engine's model is no longer loaded")

        return model_handle.acquire(self._model_ref.key, not_loaded, lambda _model: None)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        if getattr(self, "mtmd", None):
            with self._mtmd_lock:
                mtmd.free_projector(self.mtmd)
                self.mtmd = None
        free_context(self.ctx, self._batch)
        self.ctx = self._batch = None
        abort = getattr(self, "_abort", None)
        if abort is not None:
            abort.close()
        self.model = None
        ref = getattr(self, "_model_ref", None)
        if ref is not None:
            ref.release()
