"""What batching can give on this machine: raw llama.cpp, no package code.

Used by bench_shared_prefix.py to measure, in the same run, the limit its speed-up goal
meets. Five sequences each read a question and generate a reply, one sequence at a time
(``serial``) or all five in one ``llama_decode`` per step (``batched``): once after a
shared preamble copied to every sequence with ``llama_memory_seq_cp`` (the sub-agents'
shape: each new token attends over the preamble's cells), once with no preamble (five
unrelated short prompts). Timing only: the tokens fed are fixed, not sampled, so both
modes do exactly the same work.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any


def _quiet_logger() -> Any:
    import llama_cpp as lc

    return lc.llama_log_callback(lambda level, text, data: None)


_QUIET = _quiet_logger()


class RawModel:
    """A model and a unified KV pool, driven through the C API of llama-cpp-python."""

    def __init__(self, path: str, n_ctx: int, n_seq: int, n_threads: int, n_batch: int = 512):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_log_set(_QUIET, ctypes.c_void_p(0))
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        cp = lc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(max(n_batch, n_seq), 0, n_seq)
        self.vocab = lc.llama_model_get_vocab(self.model)

    def tokens(self, text: str) -> list[int]:
        lc = self.lc
        raw = text.encode()
        buf = (lc.llama_token * (len(raw) + 16))()
        n = lc.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, True)
        return list(buf[:n])

    def decode(self, items: list[tuple[int, int, int]]) -> None:
        """``items``: (token, position, sequence); logits for each sequence's last item."""
        b = self.batch
        last: dict[int, int] = {}
        for i, (tok, pos, seq) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 0
            last[seq] = i
        for i in last.values():
            b.logits[i] = 1
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def read(self, toks: list[int], seq: int, start: int) -> None:
        for i in range(0, len(toks), self.n_batch):
            part = toks[i : i + self.n_batch]
            self.decode([(t, start + i + j, seq) for j, t in enumerate(part)])

    def clear(self, seq: int, from_pos: int = 0) -> None:
        self.lc.llama_memory_seq_rm(self.mem, seq, from_pos, -1)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)


def _replies(
    m: RawModel, questions: list[list[int]], start: int, reply: int, batched: bool
) -> float:
    """Each sequence reads its question at ``start`` and then ``reply`` tokens; seconds."""
    filler = questions[0][-1]
    t0 = time.perf_counter()
    if batched:
        items = [(t, start + j, s) for s, q in enumerate(questions) for j, t in enumerate(q)]
        m.decode(items)
        pos = [start + len(q) for q in questions]
        for k in range(reply):
            m.decode([(filler, pos[s] + k, s) for s in range(len(questions))])
    else:
        for s, q in enumerate(questions):
            m.decode([(t, start + j, s) for j, t in enumerate(q)])
            for k in range(reply):
                m.decode([(filler, start + len(q) + k, s)])
    return time.perf_counter() - t0


def batching_limit(
    path: str,
    *,
    preamble_text: str,
    questions: list[str],
    reply: int,
    n_ctx: int,
    n_threads: int,
    rounds: int = 3,
) -> dict[str, Any]:
    """Speed-ups of five-at-once over one-at-a-time, with and without a shared preamble."""
    n = len(questions)
    m = RawModel(path, n_ctx, n, n_threads)
    try:
        pre = m.tokens(preamble_text)
        qs = [m.tokens(q) for q in questions]
        out: dict[str, Any] = {"preamble_tokens": len(pre), "question_tokens": [len(q) for q in qs]}
        t0 = time.perf_counter()
        m.read(pre, 0, 0)
        out["preamble_read_s"] = time.perf_counter() - t0
        runs: dict[str, list[float]] = {
            k: [] for k in ("long_serial", "long_batched", "short_serial", "short_batched")
        }
        for _ in range(rounds):
            for batched in (False, True):
                for s in range(1, n):
                    m.clear(s)
                    m.lc.llama_memory_seq_cp(m.mem, 0, s, 0, len(pre))
                m.clear(0, len(pre))
                key = "long_batched" if batched else "long_serial"
                runs[key].append(_replies(m, qs, len(pre), reply, batched))
        for s in range(n):
            m.clear(s)
        for _ in range(rounds):
            for batched in (False, True):
                for s in range(n):
                    m.clear(s)
                key = "short_batched" if batched else "short_serial"
                runs[key].append(_replies(m, qs, 0, reply, batched))
        best = {k: min(v) for k, v in runs.items()}
        out["runs_s"] = runs
        out["best_s"] = best
        out["long_speedup"] = best["long_serial"] / best["long_batched"]
        out["short_speedup"] = best["short_serial"] / best["short_batched"]
        p = out["preamble_read_s"]
        # the benchmark's metric: the preamble is read once either way
        out["with_preamble_speedup"] = (p + best["long_serial"]) / (p + best["long_batched"])
        return out
    finally:
        m.close()
