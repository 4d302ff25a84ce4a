"""Images through llama.cpp's mtmd: the projector, tokenizing a prompt with images and
evaluating an image's chunk into a sequence.

``mtmd_cpp`` is imported where it is used: its library is loaded only for a model
with a projector.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable, Sequence

import llama_cpp.llama_cpp as C
import numpy as np

from langchain_llamacpp_local.errors import DecodeError, ModelLoadError
from langchain_llamacpp_local.llama.backend import capture_log, log_reasons, route_mtmd_log
from langchain_llamacpp_local.llama.loading import LoadConfig, check_gguf_file


class MediaChunk:
    """An image's tokens from mtmd (owned copy), spanning ``n_pos`` KV positions."""

    def __init__(self, chunk: object, n_pos: int, n_tokens: int, digest: str) -> None:
        self.chunk = chunk
        self.n_pos = n_pos
        self.n_tokens = n_tokens
        self.digest = digest

    def __del__(self) -> None:
        chunk, self.chunk = self.chunk, None
        if chunk:
            try:
                from llama_cpp import mtmd_cpp as M

                M.mtmd_input_chunk_free(chunk)
            except Exception:  # interpreter shutdown
                pass


def tokenize_parts(
    mtmd: object, chunks: object, parts: Sequence[tuple[str, bool] | None], bitmaps: list[object]
) -> int:
    """``mtmd_tokenize_from_parts``: each text part with its own ``parse_special``, the
    bitmaps in order at the ``None`` parts; BOS added as ``mtmd_tokenize`` adds it."""
    from llama_cpp import mtmd_cpp as M

    if sum(p is None for p in parts) != len(bitmaps):
        return 1
    keep: list[object] = []  # the buffers must outlive the call
    ptrs = []
    images = iter(bitmaps)
    for part in parts:
        if part is None:
            item = M.mtmd_input_part(text=None, bitmap=next(images))
        else:
            raw = part[0].encode("utf-8")
            inp = M.mtmd_input_text(
                text=raw, text_len=len(raw), add_special=False, parse_special=part[1]
            )
            keep += [raw, inp]
            item = M.mtmd_input_part(text=ctypes.pointer(inp), bitmap=None)
        keep.append(item)
        ptrs.append(ctypes.pointer(item))
    arr = (ctypes.POINTER(M.mtmd_input_part) * max(1, len(ptrs)))(*ptrs)
    return int(M.mtmd_tokenize_from_parts(mtmd, chunks, arr, len(ptrs), True))


def load_projector(config: LoadConfig, model: object, threads: int) -> object:
    """The vision projector (llama.cpp mtmd) of ``config.mmproj_path``, created next to ``model``."""
    from llama_cpp import mtmd_cpp as M

    path = config.mmproj_path
    assert path is not None
    check_gguf_file(path)
    route_mtmd_log()
    params = M.mtmd_context_params_default()
    params.use_gpu = config.n_gpu_layers != 0
    params.n_threads = threads
    params.print_timings = False
    params.warmup = False
    if config.image_min_tokens is not None:
        params.image_min_tokens = config.image_min_tokens
    if config.image_max_tokens is not None:
        params.image_max_tokens = config.image_max_tokens
    with capture_log() as reasons:
        mctx = M.mtmd_init_from_file(path.encode(), model, params)
    if not mctx:
        why = log_reasons(reasons)
        raise ModelLoadError(
            f"llama.cpp could not load the projector {path} for this model"
            + (f": {why}" if why else "")
        )
    if not M.mtmd_support_vision(mctx):
        M.mtmd_free(mctx)
        raise ModelLoadError(f"{path} has no vision encoder")
    return mctx


def free_projector(mctx: object) -> None:
    """Free a projector from :func:`load_projector`."""
    from llama_cpp import mtmd_cpp as M

    M.mtmd_free(mctx)


def tokenize_multimodal(
    mtmd: object | None,
    text: str | Sequence[tuple[str, bool] | None],
    images: Sequence[tuple[int, int, bytes | bytearray, str]],
) -> tuple[list[Hashable], dict[int, MediaChunk]]:
    """Tokenize ``text`` whose media markers stand for ``images`` (w, h, rgb, digest).

    ``text`` is the prompt (special-token text parsed), or its parts: ``(text,
    parse_special)`` each tokenized on its own, ``None`` for each image in turn
    (``mtmd_tokenize_from_parts``: message text read as plain text).

    Returns one entry per KV position (image positions are ``("media", digest, k)``,
    so an unchanged image extends the common prefix) and the image chunks by the
    position where each starts.
    """
    from llama_cpp import mtmd_cpp as M

    if mtmd is None:
        raise ValueError("this model has no vision projector: pass mmproj_path=... to send images")
    bitmaps = []
    chunks = M.mtmd_input_chunks_init()
    try:
        for w, h, rgb, digest in images:
            # a pointer to the caller's pixels, not a copy: copying a large image
            # holds the GIL (mtmd copies it itself, in C, with the GIL released)
            pixels = np.frombuffer(rgb, dtype=np.uint8)
            if pixels.size != w * h * 3:
                raise ValueError(f"a {w}x{h} image needs {w * h * 3} RGB bytes")
            bm = M.mtmd_bitmap_init(w, h, pixels.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
            if not bm:
                raise ValueError(f"llama.cpp could not take a {w}x{h} image")
            M.mtmd_bitmap_set_id(bm, digest.encode())
            bitmaps.append(bm)
        if isinstance(text, str):
            raw = text.encode("utf-8")
            inp = M.mtmd_input_text(
                text=raw, text_len=len(raw), add_special=True, parse_special=True
            )
            arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = M.mtmd_tokenize(mtmd, chunks, ctypes.byref(inp), arr, len(bitmaps))
        else:
            rc = tokenize_parts(mtmd, chunks, text, bitmaps)
        if rc == 1:
            raise ValueError("the prompt's image markers do not match the number of images")
        if rc != 0:
            raise ValueError(f"llama.cpp could not preprocess the image (code {rc})")
        entries: list[Hashable] = []
        media: dict[int, MediaChunk] = {}
        for i in range(M.mtmd_input_chunks_size(chunks)):
            ch = M.mtmd_input_chunks_get(chunks, i)
            if M.mtmd_input_chunk_get_type(ch) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                ptr = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
                entries.extend(ptr[: n.value])
                continue
            n_pos = int(M.mtmd_input_chunk_get_n_pos(ch))
            cid = (M.mtmd_input_chunk_get_id(ch) or b"").decode()
            media[len(entries)] = MediaChunk(
                M.mtmd_input_chunk_copy(ch),
                n_pos,
                int(M.mtmd_input_chunk_get_n_tokens(ch)),
                cid,
            )
            entries.extend(("media", cid, k) for k in range(n_pos))
        return entries, media
    finally:
        for bm in bitmaps:
            M.mtmd_bitmap_free(bm)
        M.mtmd_input_chunks_free(chunks)


def eval_media(
    mtmd: object, ctx: object, n_batch: int, media: MediaChunk, pos: int, seq_id: int
) -> None:
    """Encode an image chunk and decode its embeddings at ``pos`` of ``seq_id``."""
    from llama_cpp import mtmd_cpp as M

    new_pos = C.llama_pos(0)
    rc = M.mtmd_helper_eval_chunk_single(
        mtmd,
        ctx,
        media.chunk,
        pos,
        seq_id,
        n_batch,
        False,  # mtmd ignores it for an image: the text after it is checked
        ctypes.byref(new_pos),
    )
    if rc != 0:
        raise DecodeError(f"evaluating an image chunk failed with code {rc}")
