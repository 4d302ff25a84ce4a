"""The generated tiny GGUF models load in llama.cpp and behave as documented."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import llama_cpp.llama_cpp as C  # noqa: E402

from tests.gguf_models import (  # noqa: E402
    BOS_ID,
    MMPROJ_N_IMAGE_TOKENS,
    N_VOCAB,
    SPACE_ID,
    byte_token,
    write_tiny_hybrid,
    write_tiny_llama,
    write_tiny_mamba,
    write_tiny_mmproj,
)

TEXT = "Héllo wörld, ünïcode ✓ 🙂\nsecond line"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@C.llama_log_callback
def _silent(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """No-op llama.cpp log sink (module-level so the ctypes callback stays alive)."""


@pytest.fixture(autouse=True, scope="module")
def _quiet() -> Iterator[None]:
    """Silence llama.cpp (and libmtmd) for this module, then restore the previous sink."""
    prev_cb = C.llama_log_callback()
    prev_ud = ctypes.c_void_p()
    C.llama_log_get(ctypes.byref(prev_cb), ctypes.byref(prev_ud))
    C.llama_log_set(_silent, ctypes.c_void_p(0))
    C.llama_backend_init()
    try:
        import llama_cpp.mtmd_cpp as M

        M.mtmd_log_set(_silent, ctypes.c_void_p(0))
    except (ImportError, OSError, AttributeError):
        pass
    yield
    C.llama_log_set(prev_cb, prev_ud)


WRITERS: dict[str, Callable[..., Path]] = {
    "llama": write_tiny_llama,
    "mamba": write_tiny_mamba,
    "hybrid": write_tiny_hybrid,
}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-gguf")


@pytest.fixture(scope="module")
def paths(gguf_dir: Path) -> dict[str, Path]:
    return {k: fn(gguf_dir / f"{k}.gguf", chat_template=TEMPLATE) for k, fn in WRITERS.items()}


class Loaded:
    """A loaded model + context, freed by :meth:`close`."""

    def __init__(self, path: Path, n_ctx: int = 256) -> None:
        self.model = C.llama_model_load_from_file(
            str(path).encode(), C.llama_model_default_params()
        )
        assert self.model, f"failed to load {path}"
        cp = C.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = 64
        cp.n_threads = cp.n_threads_batch = 2
        self.ctx = C.llama_init_from_model(self.model, cp)
        assert self.ctx, f"failed to create a context for {path}"
        self.vocab = C.llama_model_get_vocab(self.model)
        self.batch = C.llama_batch_init(64, 0, 1)
        self.pos = 0

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        data = text.encode()
        buf = (C.llama_token * (len(data) + 8))()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_special, False)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, ids: list[int]) -> bytes:
        arr = (C.llama_token * len(ids))(*ids)
        buf = ctypes.create_string_buffer(8 * len(ids) + 16)
        n = C.llama_detokenize(self.vocab, arr, len(ids), buf, len(buf), True, False)
        assert n >= 0
        return buf.raw[:n]

    def decode(self, ids: list[int]) -> np.ndarray:
        """Decode ``ids`` at the next positions of sequence 0; return the last logits."""
        b = self.batch
        b.n_tokens = len(ids)
        for i, tok in enumerate(ids):
            b.token[i] = tok
            b.pos[i] = self.pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i == len(ids) - 1
        assert C.llama_decode(self.ctx, b) == 0
        self.pos += len(ids)
        logits = C.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(C.llama_vocab_n_tokens(self.vocab),)).copy()

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        out: list[int] = []
        logits = self.decode(prompt)
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = self.decode([out[-1]])
        return out

    def close(self) -> None:
        C.llama_batch_free(self.batch)
        C.llama_free(self.ctx)
        C.llama_model_free(self.model)


@pytest.fixture(scope="module", params=list(WRITERS))
def loaded(request: pytest.FixtureRequest, paths: dict[str, Path]) -> Iterator[tuple[str, Loaded]]:
    m = Loaded(paths[request.param])
    yield request.param, m
    m.close()


def test_loads_with_metadata(loaded: tuple[str, Loaded]) -> None:
    kind, m = loaded
    assert C.llama_vocab_n_tokens(m.vocab) == N_VOCAB
    assert C.llama_model_n_embd(m.model) == 64
    assert C.llama_model_n_layer(m.model) == 2
    assert C.llama_vocab_bos(m.vocab) == BOS_ID
    assert C.llama_vocab_get_add_bos(m.vocab)
    assert C.llama_vocab_type(m.vocab) == C.LLAMA_VOCAB_TYPE_SPM
    assert C.llama_model_n_ctx_train(m.model) == 2048
    assert C.llama_model_chat_template(m.model, None) == TEMPLATE.encode()
    assert C.llama_model_is_recurrent(m.model) == (kind == "mamba")
    assert C.llama_model_is_hybrid(m.model) == (kind == "hybrid")


def test_tokenize_roundtrip(loaded: tuple[str, Loaded]) -> None:
    _, m = loaded
    ids = m.tokenize(TEXT)
    raw = TEXT.encode()
    expected = [SPACE_ID if b == 0x20 else byte_token(b) for b in raw]
    assert ids == [BOS_ID, *expected]
    assert m.detokenize(ids) == raw
    assert m.detokenize(ids).decode() == TEXT
    assert m.tokenize(TEXT, add_special=False) == expected


def test_greedy_not_degenerate(loaded: tuple[str, Loaded]) -> None:
    _, m = loaded
    C.llama_memory_clear(C.llama_get_memory(m.ctx), True)
    m.pos = 0
    out = m.greedy(m.tokenize("Hello"), 12)
    assert len(set(out)) > 3, out


def test_partial_seq_rm(loaded: tuple[str, Loaded]) -> None:
    """Attention caches can drop a suffix; recurrent state (mamba, lfm2 conv) cannot."""
    kind, m = loaded
    mem = C.llama_get_memory(m.ctx)
    C.llama_memory_clear(mem, True)
    m.pos = 0
    m.decode(m.tokenize("ab", add_special=False))
    assert C.llama_memory_seq_pos_max(mem, 0) == 1
    assert C.llama_memory_seq_rm(mem, 0, 1, -1) == (kind == "llama")
    assert C.llama_memory_seq_rm(mem, 0, -1, -1)  # removing the whole sequence always works


def test_deterministic(gguf_dir: Path, paths: dict[str, Path]) -> None:
    for kind, fn in WRITERS.items():
        again = fn(gguf_dir / f"{kind}-again.gguf", chat_template=TEMPLATE)
        assert again.read_bytes() == paths[kind].read_bytes(), kind
        other = fn(gguf_dir / f"{kind}-seed1.gguf", seed=1, chat_template=TEMPLATE)
        assert other.read_bytes() != paths[kind].read_bytes(), kind


def test_same_weights_same_greedy(paths: dict[str, Path]) -> None:
    """Two loads of the same file decode identically (exact greedy comparisons are safe)."""
    runs = []
    for _ in range(2):
        m = Loaded(paths["llama"])
        try:
            runs.append(m.greedy(m.tokenize("xyz"), 8))
        finally:
            m.close()
    assert runs[0] == runs[1]


def test_n_ctx_train(gguf_dir: Path) -> None:
    m = Loaded(write_tiny_llama(gguf_dir / "llama-512.gguf", n_ctx_train=512))
    try:
        assert C.llama_model_n_ctx_train(m.model) == 512
        assert C.llama_model_chat_template(m.model, None) is None
    finally:
        m.close()


def test_mmproj_image_tokens(gguf_dir: Path, paths: dict[str, Path]) -> None:
    M = pytest.importorskip("llama_cpp.mtmd_cpp")
    proj = write_tiny_mmproj(gguf_dir / "mmproj.gguf")
    assert write_tiny_mmproj(gguf_dir / "mmproj-again.gguf").read_bytes() == proj.read_bytes()
    m = Loaded(paths["llama"])
    params = M.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = 2
    params.print_timings = False
    mctx = M.mtmd_init_from_file(str(proj).encode(), m.model, params)
    assert mctx, "mtmd_init_from_file failed"
    pixels = np.random.default_rng(0).integers(0, 256, 32 * 32 * 3, dtype=np.uint8)
    bitmap = M.mtmd_bitmap_init(32, 32, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    chunks = M.mtmd_input_chunks_init()
    try:
        assert M.mtmd_support_vision(mctx)
        text = b"look: " + M.mtmd_default_marker() + b" ok"
        inp = M.mtmd_input_text()
        inp.text, inp.text_len, inp.add_special, inp.parse_special = text, len(text), True, True
        bitmaps = (M.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(inp), bitmaps, 1) == 0
        kinds = []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            chunk = M.mtmd_input_chunks_get(chunks, i)
            kinds.append(M.mtmd_input_chunk_get_type(chunk))
            if kinds[-1] == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                assert M.mtmd_input_chunk_get_n_tokens(chunk) == MMPROJ_N_IMAGE_TOKENS == 16
                assert M.mtmd_encode_chunk(mctx, chunk) == 0
                embd = M.mtmd_get_output_embd(mctx)
                arr = np.ctypeslib.as_array(embd, shape=(16 * 64,))
                assert np.isfinite(arr).all() and arr.std() > 0
        text_kind = M.MTMD_INPUT_CHUNK_TYPE_TEXT
        assert kinds == [text_kind, M.MTMD_INPUT_CHUNK_TYPE_IMAGE, text_kind]
    finally:
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_bitmap_free(bitmap)
        M.mtmd_free(mctx)
        m.close()
