"""WAV files for audio tests, written with the standard library (``wave``) or, for the
float and extensible formats ``wave`` cannot write, by hand."""

from __future__ import annotations

import base64
import io
import struct
import wave

import numpy as np


def tone(seconds: float, rate: int = 16_000, freq: float = 440.0, channels: int = 1) -> np.ndarray:
    """A sine at ``freq`` (amplitude 0.5), shape (frames, channels); channel k is
    shifted in phase so a downmix is not a copy of one channel."""
    t = np.arange(int(seconds * rate)) / rate
    return np.stack(
        [0.5 * np.sin(2 * np.pi * freq * t + k) for k in range(channels)], axis=1
    ).astype(np.float64)


def pcm_wav(x: np.ndarray, rate: int = 16_000, width: int = 2) -> bytes:
    """Integer PCM WAV of ``x`` (frames, channels) in [-1, 1], ``width`` bytes a sample."""
    x = np.atleast_2d(x.T).T if x.ndim == 1 else x
    frames, channels = x.shape
    if width == 1:
        raw = np.clip(np.round(x * 127 + 128), 0, 255).astype(np.uint8).tobytes()
    elif width == 3:
        v = np.round(x * (2**23 - 1)).astype("<i4").reshape(-1)
        raw = np.frombuffer(v.tobytes(), np.uint8).reshape(-1, 4)[:, :3].tobytes()
    else:
        dtype = {2: "<i2", 4: "<i4"}[width]
        raw = np.round(x * (2 ** (8 * width - 1) - 1)).astype(dtype).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


def float_wav(
    x: np.ndarray, rate: int = 16_000, *, extensible: bool = False, bits: int = 32
) -> bytes:
    """IEEE float WAV (format 3, or ``WAVE_FORMAT_EXTENSIBLE`` with the float GUID)."""
    x = x.reshape(len(x), -1) if x.size else x.reshape(0, 1)
    channels = x.shape[1]
    data = x.astype("<f4" if bits == 32 else "<f8").tobytes()
    block = channels * bits // 8
    if extensible:
        guid = struct.pack("<H", 3) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
        fmt = struct.pack(
            "<HHIIHHHHI", 0xFFFE, channels, rate, rate * block, block, bits, 22, bits, 0
        )
        fmt += guid
    else:
        fmt = struct.pack("<HHIIHH", 3, channels, rate, rate * block, block, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def audio_block(data: bytes, mime_type: str = "audio/wav") -> dict[str, str]:
    """LangChain's standard audio content block."""
    return {"type": "audio", "base64": b64(data), "mime_type": mime_type}


def input_audio_part(data: bytes, fmt: str = "wav") -> dict[str, object]:
    """An OpenAI-style ``input_audio`` part (what llama.cpp's server takes)."""
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}
