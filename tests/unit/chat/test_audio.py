"""Audio decoding: every accepted block shape and WAV format, mono downmix, refusals,
and the linear resampler (no model)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from langchain_core.exceptions import ModelInvalidRequestError
from langchain_core.messages.content import create_audio_block

from langchain_llamacpp_local.chat.audio import (
    MAX_AUDIO_SECONDS,
    DecodedAudio,
    decode_wav,
    is_audio_block,
    load_audio,
)
from langchain_llamacpp_local.errors import AudioInputError
from langchain_llamacpp_local.llama.mtmd import resample_linear
from langchain_llamacpp_local.templates.messages import convert_messages
from tests.wav_files import audio_block, b64, float_wav, input_audio_part, pcm_wav, tone


def _samples(a: DecodedAudio) -> np.ndarray:
    return np.frombuffer(a.samples, dtype="<f4")


@pytest.mark.parametrize(("width", "tol"), [(1, 1 / 100), (2, 1e-4), (3, 1e-6), (4, 1e-6)])
def test_integer_pcm_widths_decode_to_the_same_wave(width: int, tol: float) -> None:
    x = tone(0.1)
    a = decode_wav(pcm_wav(x, width=width))
    assert (a.sample_rate, a.n_samples) == (16_000, 1600)
    assert np.abs(_samples(a) - x[:, 0]).max() < tol


@pytest.mark.parametrize("extensible", [False, True])
@pytest.mark.parametrize("bits", [32, 64])
def test_float_wav_is_read_by_the_riff_fallback(extensible: bool, bits: int) -> None:
    x = tone(0.05, rate=8000)
    a = decode_wav(float_wav(x, 8000, extensible=extensible, bits=bits))
    assert a.sample_rate == 8000
    np.testing.assert_allclose(_samples(a), x[:, 0], atol=1e-6)


def test_stereo_is_averaged_to_mono_and_identity_follows_the_samples() -> None:
    x = tone(0.05, channels=2)
    a = decode_wav(pcm_wav(x))
    np.testing.assert_allclose(_samples(a), x.mean(axis=1), atol=1e-4)
    assert decode_wav(pcm_wav(x)).digest == a.digest
    assert decode_wav(pcm_wav(x, rate=22_050)).digest != a.digest  # same samples, other rate
    assert decode_wav(pcm_wav(tone(0.05, freq=300, channels=2))).digest != a.digest


def test_every_block_shape_gives_the_same_samples() -> None:
    wav = pcm_wav(tone(0.05))
    forms: list[Any] = [
        audio_block(wav),
        audio_block(wav, mime_type="audio/x-wav"),
        input_audio_part(wav),
        {"type": "input_audio", "input_audio": {"data": b64(wav)}},
        {"type": "audio", "source_type": "base64", "data": b64(wav), "mime_type": "audio/wav"},
        {"type": "audio", "url": "data:audio/wav;base64," + b64(wav)},
        dict(create_audio_block(base64=b64(wav), mime_type="audio/wav")),
        wav,
    ]
    expected = load_audio(forms[0])
    for form in forms:
        assert load_audio(form) == expected, form
    assert all(is_audio_block(f) for f in forms[:-1])


def test_conversion_keeps_audio_parts_for_the_prompt() -> None:
    from langchain_core.messages import HumanMessage

    wav = pcm_wav(tone(0.05))
    msg = HumanMessage(content=[{"type": "text", "text": "hi"}, input_audio_part(wav)])
    [converted] = convert_messages([msg])
    assert [p["type"] for p in converted["content"]] == ["text", "audio"]


@pytest.mark.parametrize(
    ("form", "needle"),
    [
        (input_audio_part(b"ID3\x03\x00rest of an mp3", fmt="mp3"), "'mp3' is not supported"),
        (audio_block(b"ID3\x03\x00rest of an mp3", "audio/mpeg"), "'audio/mpeg'"),
        (audio_block(b"ID3\x03\x00rest of an mp3"), "MP3 audio is not supported"),
        (audio_block(b"fLaC\x00\x00\x00\x22"), "FLAC audio is not supported"),
        (audio_block(b"OggS\x00\x02"), "Ogg audio is not supported"),
        (audio_block(b"\x89PNG\r\n\x1a\n not audio at all"), "not a WAV file"),
        ({"type": "audio", "url": "https://example.com/a.wav"}, "not fetched"),
        ({"type": "audio", "url": "data:audio/wav,plain"}, "base64"),
        ({"type": "audio", "file_id": "file-123"}, "file id"),
        ({"type": "audio", "mime_type": "audio/wav"}, "neither base64"),
        ({"type": "input_audio", "input_audio": "abc"}, "input_audio part needs"),
        ({"type": "audio", "base64": "!!!not base64!!!"}, "audio data is not valid base64"),
    ],
)
def test_refused_forms_name_the_problem(form: Any, needle: str) -> None:
    with pytest.raises(AudioInputError, match=None) as info:
        load_audio(form)
    assert needle in str(info.value)
    assert isinstance(info.value, ModelInvalidRequestError)
    if "not supported" in needle or "not a WAV" in needle:
        assert "WAV (8/16/24/32-bit integer PCM or 32/64-bit float" in str(info.value)


def test_hostile_wav_files_are_refused() -> None:
    wav = pcm_wav(tone(0.1))
    cases = {
        "truncated": wav[: len(wav) // 2],
        "header only": wav[:44],
        "cut header": wav[:30],
        "empty": pcm_wav(np.zeros((0, 1))),
        "float truncated": float_wav(tone(0.1))[:200],
        "float empty": float_wav(np.zeros((0, 1), dtype=np.float32)),
        "nan": float_wav(np.array([[0.1], [np.nan], [0.2]])),
        "no data chunk": float_wav(tone(0.1))[: 44 - 8],
        "riff only": b"RIFF\x04\x00\x00\x00WAVE",
    }
    for name, data in cases.items():
        with pytest.raises(AudioInputError):
            decode_wav(data)
        assert name  # each case named for the failure report


def test_a_hostile_header_cannot_make_the_reader_walk_far_or_allocate() -> None:
    # a float WAV whose data chunk claims 4 GiB: refused from the header, nothing read
    data = float_wav(tone(0.01))
    at = data.index(b"data") + 4
    huge = data[:at] + struct.pack("<I", 0xFFFFFFF0) + data[at + 4 :]
    with pytest.raises(AudioInputError, match="exceeds the limit"):
        decode_wav(huge)
    # endless unknown chunks before the data: the walk stops after a bounded number
    junk = b"junk" + struct.pack("<I", 0)
    at = data.index(b"data")
    many = data[:at] + junk * 10_000 + data[at:]
    with pytest.raises(AudioInputError, match="no data chunk"):
        decode_wav(many)
    assert decode_wav(data[:at] + junk * 10 + data[at:]).n_samples == 160


def test_too_long_audio_is_refused_before_decoding() -> None:
    long = pcm_wav(tone(2.0, rate=8000), rate=8000)
    assert decode_wav(long).seconds == pytest.approx(2.0)
    with pytest.raises(AudioInputError, match="exceeds the limit of 1 s"):
        decode_wav(long, max_seconds=1.0)
    # a PCM header announcing an hour, with a second of data: refused on the header
    wav = pcm_wav(tone(1.0, rate=8000), rate=8000)
    at = wav.index(b"data") + 4
    hour = wav[:at] + struct.pack("<I", 8000 * 2 * 3600) + wav[at + 4 :]
    with pytest.raises(AudioInputError, match="exceeds the limit"):
        decode_wav(hour)
    assert MAX_AUDIO_SECONDS >= 60


def test_linear_resampling_keeps_duration_and_shape() -> None:
    rate_in, rate_out = 8000, 16_000
    x = tone(0.5, rate=rate_in, freq=200)[:, 0].astype(np.float32)
    y = resample_linear(x, rate_in, rate_out)
    assert y.dtype == np.float32 and y.size == 2 * x.size
    expected = tone(0.5, rate=rate_out, freq=200)[:, 0]
    # a 200 Hz tone is smooth at 8 kHz (the last sample holds: nothing after it)
    assert np.abs(y[:-1] - expected[:-1]).max() < 0.01
    down = resample_linear(y, rate_out, rate_in)
    np.testing.assert_allclose(down, x, atol=1e-6)  # every other sample, exactly
    assert resample_linear(x, rate_in, rate_in) is x
    assert resample_linear(x, 44_100, 16_000).size == round(x.size * 16_000 / 44_100)
