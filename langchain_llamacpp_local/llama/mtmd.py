"""Images and audio through llama.cpp's mtmd: the projector, tokenizing a prompt with
media and evaluating a media chunk into a sequence.

``mtmd_cpp`` is imported where it is used: its library is loaded only for a model
with a projector.
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable, Sequence

import llama_cpp.llama_cpp as C
import numpy as np

from langchain_llamacpp_local.errors import (
    AudioInputError,
    DecodeError,
    ImageInputError,
    ModelLoadError,
)
from langchain_llamacpp_local.llama.backend import capture_log, log_reasons, route_mtmd_log
from langchain_llamacpp_local.llama.loading import LoadConfig, check_gguf_file

#: One media item as :func:`tokenize_multimodal` takes it: an image ``(width, height,
#: rgb, digest)`` or an audio clip ``("audio", sample_rate, float32 mono samples, digest)``.
MediaInput = tuple[int, int, bytes | bytearray, str] | tuple[str, int, bytes | bytearray, str]


def resample_linear(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """``samples`` at ``src_rate`` resampled to ``dst_rate`` by linear interpolation.

    Enough for speech encoders (whisper-style mel features up to 8 kHz): no anti-alias
    filter is applied, so content above the target's Nyquist frequency folds back when
    downsampling. Send audio at the projector's rate (16 kHz for most) to skip this."""
    if src_rate == dst_rate or samples.size == 0:
        return samples
    n_out = max(1, int(round(samples.size * dst_rate / src_rate)))
    at = np.arange(n_out, dtype=np.float64) * (src_rate / dst_rate)
    return np.interp(at, np.arange(samples.size), samples).astype(np.float32)


class MediaChunk:
    """An image's or audio clip's tokens from mtmd (owned copy), spanning ``n_pos`` KV
    positions."""

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
    """The vision and/or audio projector (llama.cpp mtmd) of ``config.mmproj_path``, created next to ``model``."""
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
    if not M.mtmd_support_vision(mctx) and not M.mtmd_support_audio(mctx):
        M.mtmd_free(mctx)
        raise ModelLoadError(f"{path} has neither a vision nor an audio encoder")
    return mctx


def free_projector(mctx: object) -> None:
    """Free a projector from :func:`load_projector`."""
    from llama_cpp import mtmd_cpp as M

    M.mtmd_free(mctx)


def tokenize_multimodal(
    mtmd: object | None,
    text: str | Sequence[tuple[str, bool] | None],
    images: Sequence[MediaInput],
) -> tuple[list[Hashable], dict[int, MediaChunk]]:
    """Tokenize ``text`` whose media markers stand for ``images`` (:data:`MediaInput`:
    images and audio clips, in prompt order).

    ``text`` is the prompt (special-token text parsed), or its parts: ``(text,
    parse_special)`` each tokenized on its own, ``None`` for each media item in turn
    (``mtmd_tokenize_from_parts``: message text read as plain text).

    Audio is resampled to the projector's rate (:func:`resample_linear`).

    Returns one entry per KV position (media positions are ``("media", digest, k)``,
    so an unchanged image or clip extends the common prefix) and the media chunks by
    the position where each starts.
    """
    from llama_cpp import mtmd_cpp as M

    has_audio = any(isinstance(item[0], str) for item in images)
    if mtmd is None:
        if has_audio:
            raise AudioInputError(
                "this model has no audio projector: pass mmproj_path=... with an audio "
                "encoder (Ultravox, Qwen2-Audio, Voxtral...) to send audio"
            )
        raise ValueError("this model has no vision projector: pass mmproj_path=... to send images")
    if has_audio and not M.mtmd_support_audio(mtmd):
        raise AudioInputError("this model's projector has no audio encoder: it cannot read audio")
    has_image = any(not isinstance(item[0], str) for item in images)
    if has_image and not M.mtmd_support_vision(mtmd):
        raise ImageInputError("this model's projector has no vision encoder: it reads audio only")
    bitmaps = []
    chunks = M.mtmd_input_chunks_init()
    try:
        for item in images:
            if isinstance(item[0], str):
                bitmaps.append(_audio_bitmap(mtmd, item[1], item[2], item[3]))
                continue
            w, h, rgb, digest = item
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
            what = "audio" if has_audio else "image"
            raise ValueError(f"llama.cpp could not preprocess the {what} (code {rc})")
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


def _audio_bitmap(mtmd: object, rate: int, pcm: bytes | bytearray, digest: str) -> object:
    """An mtmd audio bitmap of float32 mono ``pcm`` at ``rate``, resampled to the
    projector's rate (mtmd copies the samples)."""
    from llama_cpp import mtmd_cpp as M

    target = int(M.mtmd_get_audio_sample_rate(mtmd))
    if target <= 0:
        raise AudioInputError("this model's projector reports no audio sample rate")
    samples = resample_linear(np.frombuffer(pcm, dtype="<f4"), rate, target)
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if samples.size == 0:
        raise AudioInputError("the audio holds no samples")
    bm = M.mtmd_bitmap_init_from_audio(
        samples.size, samples.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    )
    if not bm:
        raise AudioInputError(f"llama.cpp could not take {samples.size} audio samples")
    M.mtmd_bitmap_set_id(bm, digest.encode())
    return bm


def eval_media(
    mtmd: object, ctx: object, n_batch: int, media: MediaChunk, pos: int, seq_id: int
) -> None:
    """Encode an image or audio chunk and decode its embeddings at ``pos`` of ``seq_id``."""
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
        raise DecodeError(f"evaluating a media chunk failed with code {rc}")
