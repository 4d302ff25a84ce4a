"""Turn the audio forms LangChain users send into mono float samples, safely.

Accepted in messages: LangChain's ``{"type": "audio", "base64": ..., "mime_type":
"audio/wav"}``, its older ``source_type="base64"`` form, ``{"type": "audio", "url":
"data:audio/wav;base64,..."}`` and OpenAI's ``{"type": "input_audio", "input_audio":
{"data": ..., "format": "wav"}}`` (llama.cpp's server takes the same part).

Only WAV is decoded: 8/16/24/32-bit integer PCM and 32/64-bit float, any channel count
(averaged to mono). The standard library's :mod:`wave` reads integer PCM; it refuses
float and ``WAVE_FORMAT_EXTENSIBLE`` files (Python 3.11), which a minimal, bounded RIFF
reader here takes instead. No other decoder is a dependency, so MP3, FLAC, Ogg and the
rest are refused with an error naming what is accepted. Audio is refused past
:data:`MAX_AUDIO_SECONDS`, checked on the header before any sample is decoded.
Resampling to the projector's rate happens where that rate is known (the loaded
model's projector, :func:`~langchain_llamacpp_local.llama.mtmd.resample_linear`).
"""

from __future__ import annotations

import hashlib
import io
import struct
import wave
from dataclasses import dataclass
from typing import Any

import numpy as np

from langchain_llamacpp_local.chat.images import decode_base64
from langchain_llamacpp_local.errors import AudioInputError

#: Longest audio accepted (ten minutes): its samples are encoded in 30-second windows
#: (each a few hundred prompt positions on real projectors) before any reply.
MAX_AUDIO_SECONDS = 600.0

ACCEPTED = "WAV (8/16/24/32-bit integer PCM or 32/64-bit float, any channel count)"

_WAV_MIME = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})
_MAX_RATE = 384_000
_MAX_CHANNELS = 64
_FLOAT_TAG = 3
_PCM_TAG = 1
_EXTENSIBLE_TAG = 0xFFFE
#: RIFF chunks walked before the data chunk at most (a hostile file cannot loop us)
_MAX_CHUNKS = 64

#: Leading bytes of formats we do not decode, to name them in the error.
_SIGNATURES = (
    (b"ID3", "MP3"),
    (b"\xff\xfb", "MP3"),
    (b"\xff\xf3", "MP3"),
    (b"\xff\xf2", "MP3"),
    (b"fLaC", "FLAC"),
    (b"OggS", "Ogg"),
    (b"FORM", "AIFF"),
    (b"\x1aE\xdf\xa3", "WebM/Matroska"),
    (b"caff", "CAF"),
)


@dataclass(frozen=True)
class DecodedAudio:
    """Mono float32 samples at their own rate, plus a cache identity."""

    samples: bytes  # little-endian float32, mono, in [-1, 1] for integer PCM
    sample_rate: int
    digest: str  # identifies the samples, so an unchanged clip extends a cached prefix

    @property
    def n_samples(self) -> int:
        return len(self.samples) // 4

    @property
    def seconds(self) -> float:
        return self.n_samples / self.sample_rate

    @property
    def mtmd_input(self) -> tuple[str, int, bytes, str]:
        """The form ``Engine.tokenize_multimodal`` takes for an audio clip."""
        return ("audio", self.sample_rate, self.samples, self.digest)


def is_audio_block(block: Any) -> bool:
    """Whether a message content block carries audio (so it needs load_audio)."""
    return isinstance(block, dict) and block.get("type") in ("audio", "input_audio")


def load_audio(block: Any, *, max_seconds: float = MAX_AUDIO_SECONDS) -> DecodedAudio:
    """Decode ``block`` (any accepted form, or WAV bytes) into mono float samples."""
    if isinstance(block, DecodedAudio):
        return block
    if isinstance(block, (bytes, bytearray, memoryview)):
        return decode_wav(bytes(block), max_seconds=max_seconds)
    if not isinstance(block, dict):
        raise AudioInputError(f"unsupported audio input of type {type(block).__name__}")
    data, declared = _payload(block)
    if declared is not None and declared not in ("wav", *_WAV_MIME):
        raise AudioInputError(f"audio in {declared!r} is not supported; accepted: {ACCEPTED}")
    return decode_wav(data, max_seconds=max_seconds)


def _payload(block: dict[str, Any]) -> tuple[bytes, str | None]:
    """The encoded bytes of a block and the format it declares (lower case), if any."""
    btype = block.get("type")
    if btype == "input_audio":
        inner = block.get("input_audio")
        if not isinstance(inner, dict) or not isinstance(inner.get("data"), str):
            raise AudioInputError("input_audio part needs {'data': <base64>, 'format': 'wav'}")
        fmt = inner.get("format")
        return _b64(inner["data"]), str(fmt).lower() if fmt is not None else None
    mime = block.get("mime_type")
    declared = str(mime).lower().split(";")[0].strip() if mime else None
    if isinstance(block.get("base64"), str):
        return _b64(block["base64"]), declared
    if block.get("source_type") == "base64" and isinstance(block.get("data"), str):
        return _b64(block["data"]), declared
    url = block.get("url")
    if block.get("source_type") == "url" and not isinstance(url, str):
        url = block.get("data")
    if isinstance(url, str):
        head, sep, body = url.strip().partition(",")
        if head[:5].lower() != "data:" or not sep:
            raise AudioInputError(
                "audio URLs are not fetched; send the audio as base64 (or a base64 data: URL)"
            )
        if ";base64" not in head.lower():
            raise AudioInputError("only base64 data: URLs are supported for audio")
        mime_in_url = head[5:].split(";")[0].strip().lower()
        return _b64(body), mime_in_url or declared
    if "file_id" in block or block.get("source_type") == "id":
        raise AudioInputError(
            "audio blocks referencing a provider file id cannot be used locally; "
            "send the audio as base64"
        )
    raise AudioInputError("audio block has neither base64 data nor a data: URL")


def _b64(payload: str) -> bytes:
    """Base64 as images decode it (in GIL-friendly steps), with audio's error type."""
    return decode_base64(payload, what="audio", error=AudioInputError)


def decode_wav(data: bytes, *, max_seconds: float = MAX_AUDIO_SECONDS) -> DecodedAudio:
    """Decode a WAV file into mono float32 samples (see the module docstring)."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioInputError(f"{_sniff(data)} is not supported; accepted: {ACCEPTED}")
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            n_frames = w.getnframes()
            _check_header(channels, width * 8, rate, n_frames, max_seconds)
            raw = w.readframes(n_frames)
        tag = _PCM_TAG
    except wave.Error as exc:
        # 3.12 and before: "unknown format: 3"; 3.13 reads WAVE_FORMAT_EXTENSIBLE itself
        # and refuses its float subformat as "unknown extended format"
        if "unknown format" not in str(exc) and "unknown extended format" not in str(exc):
            raise AudioInputError(f"not a readable WAV file: {exc}") from None
        tag, channels, bits, rate, raw_view = _riff_fallback(data, max_seconds)
        width = bits // 8
        n_frames = len(raw_view) // (channels * width) if channels * width else 0
        raw = bytes(raw_view)
    except EOFError:
        raise AudioInputError("the WAV file is truncated (its header is incomplete)") from None
    frame = channels * width
    if len(raw) < n_frames * frame:
        raise AudioInputError(
            f"the WAV file is truncated: its header announces {n_frames} frames, "
            f"the data holds {len(raw) // frame}"
        )
    samples = _to_float(raw[: n_frames * frame], tag, width, channels)
    if samples.size == 0:
        raise AudioInputError("the WAV file holds no samples")
    if not np.all(np.isfinite(samples)):
        raise AudioInputError("the WAV file holds non-finite (NaN or infinite) samples")
    pcm = samples.astype("<f4").tobytes()
    sha = hashlib.sha256(f"audio:{rate}:".encode())
    sha.update(pcm)
    return DecodedAudio(pcm, rate, sha.hexdigest())


def _sniff(data: bytes) -> str:
    for sig, name in _SIGNATURES:
        if data.startswith(sig):
            return f"{name} audio"
    return "this data (not a WAV file)"


def _check_header(channels: int, bits: int, rate: int, n_frames: int, max_seconds: float) -> None:
    if not 1 <= channels <= _MAX_CHANNELS:
        raise AudioInputError(f"the WAV file has {channels} channels (1 to {_MAX_CHANNELS})")
    if bits not in (8, 16, 24, 32, 64):
        raise AudioInputError(f"{bits}-bit WAV samples are not supported; accepted: {ACCEPTED}")
    if not 1 <= rate <= _MAX_RATE:
        raise AudioInputError(f"the WAV file's sample rate {rate} Hz is out of range")
    if n_frames == 0:
        raise AudioInputError("the WAV file holds no samples")
    if n_frames / rate > max_seconds:
        raise AudioInputError(
            f"audio of {n_frames / rate:.1f} s exceeds the limit of {max_seconds:g} s"
        )


def _riff_fallback(data: bytes, max_seconds: float) -> tuple[int, int, int, int, memoryview]:
    """Format tag, channels, bits, rate and sample bytes of a float or extensible WAV.

    Walks at most :data:`_MAX_CHUNKS` chunks; every length is checked against the data."""
    view = memoryview(data)
    pos = 12
    fmt: tuple[int, int, int, int] | None = None
    for _ in range(_MAX_CHUNKS):
        if pos + 8 > len(data):
            break
        cid = bytes(view[pos : pos + 4])
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body = pos + 8
        if cid == b"fmt ":
            if size < 16 or body + size > len(data):
                raise AudioInputError("the WAV file's format chunk is truncated")
            tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", data, body)
            if tag == _EXTENSIBLE_TAG:
                if size < 40:
                    raise AudioInputError("the WAV file's extensible format chunk is truncated")
                (tag,) = struct.unpack_from("<H", data, body + 24)  # sub-format GUID
            if tag not in (_PCM_TAG, _FLOAT_TAG) or (tag == _FLOAT_TAG and bits not in (32, 64)):
                raise AudioInputError(
                    f"WAV format {tag} ({bits}-bit) is not supported; accepted: {ACCEPTED}"
                )
            fmt = (tag, channels, bits, rate)
        elif cid == b"data":
            if fmt is None:
                raise AudioInputError("the WAV file has no format chunk before its data")
            tag, channels, bits, rate = fmt
            frame = channels * (bits // 8)
            _check_header(channels, bits, rate, size // frame if frame else 0, max_seconds)
            if body + size > len(data):
                raise AudioInputError(
                    f"the WAV file is truncated: its header announces {size // frame} frames, "
                    f"the data holds {(len(data) - body) // frame}"
                )
            return tag, channels, bits, rate, view[body : body + size]
        pos = body + size + (size & 1)  # chunks are padded to an even length
    raise AudioInputError("the WAV file has no data chunk")


def _to_float(raw: bytes, tag: int, width: int, channels: int) -> np.ndarray:
    """Interleaved little-endian samples as float32 mono (channels averaged)."""
    if tag == _FLOAT_TAG:
        x = np.frombuffer(raw, dtype="<f4" if width == 4 else "<f8").astype(np.float32)
    elif width == 1:  # 8-bit WAV is unsigned
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        x = v.astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = (np.frombuffer(raw, dtype="<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    else:
        raise AudioInputError(f"{width * 8}-bit integer WAV is not supported; accepted: {ACCEPTED}")
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1, dtype=np.float32)
    return x
