"""Audio through a tiny random Ultravox-style audio projector on the tiny llama."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.chat.audio import load_audio
from langchain_llamacpp_local.errors import AudioInputError, ImageInputError
from langchain_llamacpp_local.llama.mtmd import resample_linear
from tests.compare import GREEDY, assert_same_greedy, ids
from tests.gguf_models import MMPROJ_N_AUDIO_TOKENS, write_tiny_audio_mmproj, write_tiny_mmproj
from tests.wav_files import audio_block, float_wav, input_audio_part, pcm_wav, tone

LA = pcm_wav(tone(1.0, freq=440))
LOW = pcm_wav(tone(1.0, freq=150))
QUESTION = "What do you hear?"


def _ask(part: dict[str, Any], text: str = QUESTION) -> list[BaseMessage]:
    return [HumanMessage(content=[{"type": "text", "text": text}, part])]


def _media(tokens: list[Any]) -> list[Any]:
    return [t for t in tokens if isinstance(t, tuple) and t[0] == "media"]


@pytest.fixture(scope="module")
def audio_mmproj(models_dir: Path) -> str:
    return str(write_tiny_audio_mmproj(models_dir / "tiny-audio-mmproj.gguf", text_n_embd=64))


@pytest.fixture()
def alm(tiny_llama: str, audio_mmproj: str) -> ChatLlamaCpp:
    return ChatLlamaCpp(
        model_path=tiny_llama, mmproj_path=audio_mmproj, n_slots=1, max_tokens=10, **GREEDY
    )


def test_an_audio_question_runs_end_to_end(alm: ChatLlamaCpp) -> None:
    msgs = _ask(audio_block(LA))
    rendered = alm.render_prompt(msgs)
    digest = load_audio(audio_block(LA)).digest
    assert _media(rendered.tokens) == [("media", digest, k) for k in range(MMPROJ_N_AUDIO_TOKENS)]
    assert "<__media__>" in rendered.text
    assert alm.get_num_tokens_from_messages(msgs) == rendered.n_tokens

    reply = alm.invoke(msgs, cache_prompt=False)
    assert reply.usage_metadata["input_tokens"] == rendered.n_tokens  # type: ignore[index]
    assert reply.usage_metadata["output_tokens"] > 0  # type: ignore[index]
    assert ids(alm.invoke(msgs, cache_prompt=False)) == ids(reply)
    text_only = alm.render_prompt([HumanMessage(QUESTION)])
    assert rendered.n_tokens >= text_only.n_tokens + MMPROJ_N_AUDIO_TOKENS
    # other audio changes what the model reads: the first token's log-probability moves
    low = alm.invoke(_ask(audio_block(LOW)), cache_prompt=False)
    first = reply.response_metadata["logprobs"]["content"][0]["logprob"]
    assert low.response_metadata["logprobs"]["content"][0]["logprob"] != pytest.approx(
        first, abs=1e-6
    )
    streamed = "".join(str(c.content) for c in alm.stream(msgs, cache_prompt=False))
    assert streamed == reply.content


def test_both_part_shapes_and_formats_give_the_same_answer(alm: ChatLlamaCpp) -> None:
    expected = ids(alm.invoke(_ask(audio_block(LA)), cache_prompt=False))
    x = np.frombuffer(load_audio(audio_block(LA)).samples, dtype="<f4")
    forms = [
        input_audio_part(LA),
        {"type": "audio", "url": "data:audio/wav;base64," + audio_block(LA)["base64"]},
        audio_block(float_wav(x)),  # the same samples as float: the same digest and answer
    ]
    for form in forms:
        assert ids(alm.invoke(_ask(form), cache_prompt=False)) == expected, form


def test_audio_at_another_rate_is_resampled_to_the_projectors(alm: ChatLlamaCpp) -> None:
    x8k = tone(1.0, rate=8000, freq=300)[:, 0].astype(np.float32)
    at_8k = float_wav(x8k, 8000)
    # what the projector reads from the 8 kHz clip is its linear resampling to 16 kHz
    at_16k = float_wav(resample_linear(x8k, 8000, 16_000), 16_000)
    a, b = (
        alm.invoke(_ask(audio_block(at_8k)), cache_prompt=False),
        alm.invoke(_ask(audio_block(at_16k)), cache_prompt=False),
    )
    assert_same_greedy(a, b)
    assert a.response_metadata["logprobs"]["content"][0]["logprob"] == pytest.approx(
        b.response_metadata["logprobs"]["content"][0]["logprob"], abs=1e-4
    )
    assert a.usage_metadata["input_tokens"] == b.usage_metadata["input_tokens"]  # type: ignore[index]
    # a clip over one 30-second window takes a second window of positions
    long = alm.render_prompt(_ask(audio_block(pcm_wav(tone(31.0, rate=8000), rate=8000))))
    assert len(_media(long.tokens)) == 2 * MMPROJ_N_AUDIO_TOKENS


def test_a_follow_up_reuses_the_audio_in_the_cache(alm: ChatLlamaCpp) -> None:
    turn1 = _ask(audio_block(LA))
    first = alm.invoke(turn1)
    n1 = first.usage_metadata["input_tokens"]  # type: ignore[index]
    turn2 = [*turn1, AIMessage(first.content), HumanMessage("And how loud is it?")]
    second = alm.invoke(turn2)
    # reuse resumes on the 64-position decode grid (docs/cache.md, "Exactness")
    assert second.usage_metadata["input_token_details"]["cache_read"] >= n1 // 64 * 64  # type: ignore[index]
    assert n1 // 64 * 64 > 0
    assert_same_greedy(second, alm.invoke(turn2, cache_prompt=False))
    # the same turn with other audio at the same place diverges inside the audio
    alm.invoke(turn2)
    other = alm.invoke(
        [*_ask(audio_block(LOW)), AIMessage(first.content), HumanMessage("And how loud is it?")]
    )
    assert (
        other.usage_metadata["input_token_details"]["cache_read"] < n1 - MMPROJ_N_AUDIO_TOKENS // 2
    )  # type: ignore[index]


def test_media_the_projector_cannot_read_are_clear_errors(
    alm: ChatLlamaCpp, tiny_llama: str, models_dir: Path
) -> None:
    from tests.integration.chat.test_images import RED, _v1

    with pytest.raises(ImageInputError, match="reads audio only"):
        alm.invoke(_ask(_v1(RED)))
    vision = str(write_tiny_mmproj(models_dir / "tiny-mmproj-for-audio.gguf", text_n_embd=64))
    with pytest.raises(AudioInputError, match="no audio encoder"):
        ChatLlamaCpp(model_path=tiny_llama, mmproj_path=vision).invoke(_ask(audio_block(LA)))
    with pytest.raises(AudioInputError, match="no audio projector"):
        ChatLlamaCpp(model_path=tiny_llama, mmproj_path="none").invoke(_ask(audio_block(LA)))
    assert alm.invoke(_ask(audio_block(LA)), cache_prompt=False).content is not None


def test_the_profile_says_what_the_projector_reads(
    tiny_llama: str, audio_mmproj: str, models_dir: Path
) -> None:
    """``audio_inputs`` and ``image_inputs`` come from the projector's own header: an
    audio projector reads no images, a vision projector no audio, no projector neither."""
    vision = str(write_tiny_mmproj(models_dir / "tiny-mmproj-profile.gguf", text_n_embd=64))
    for mmproj, images, audio in ((audio_mmproj, False, True), (vision, True, False)):
        profile = ChatLlamaCpp(model_path=tiny_llama, mmproj_path=mmproj).profile
        assert (profile["image_inputs"], profile["audio_inputs"]) == (images, audio), mmproj
    plain = ChatLlamaCpp(model_path=tiny_llama).profile
    assert (plain["image_inputs"], plain["audio_inputs"]) == (False, False)


def test_a_changed_clip_is_named_as_the_cause_of_a_miss(alm: ChatLlamaCpp) -> None:
    """The cache report names a changed audio clip as such, not as a changed image."""

    def convo(wav: bytes, turns: int) -> list[BaseMessage]:
        msgs: list[BaseMessage] = [
            HumanMessage(content=[{"type": "text", "text": "Hear this: "}, audio_block(wav)])
        ]
        for i in range(turns):
            msgs += [AIMessage(f"answer {i}"), HumanMessage(f"question {i}")]
        return msgs

    alm.invoke(convo(LA, 1))
    report = alm.invoke(convo(LOW, 2)).response_metadata["cache"]
    assert report["missed"] is True
    miss = report["miss"]
    assert miss["cause"] == "an audio clip changed"
    assert miss["message_index"] == 0 and miss["role"] == "user"
