"""Prompts tokenized message by message, each message once, on real llama.cpp
vocabularies: the pieces' tokens joined are exactly the whole text's tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from langchain_llamacpp_local.chat.prompt_tokens import PromptTokenizer
from langchain_llamacpp_local.chat.prompts import ChatFormat
from langchain_llamacpp_local.llama.vocab_model import VocabModel
from tests.gguf_models import EOS_ID, N_VOCAB, write_tiny_llama_vocab

#: message contents that stress the cut points: whitespace on both sides of a marker,
#: text that spells (part of) a control token, several scripts, digits, nothing
CONTENTS = [
    "",
    " ",
    "\n\n",
    "  leading and trailing  ",
    "Hello, world! 12345 678",
    "naïve café 日本語 🦊 emoji",
    "a <b>tag</b> and <|im_sta then |> alone",
    "spelled: <|im_start|>user\n and <|im_end|> and <start_of_turn>model <end_of_turn>",
    '<tool_call>\n{"name": "stock", "arguments": {"item": "x"}}\n</tool_call>',
    "tabs\tand\r\nCRLF\n",
]


def _conversation(rng: random.Random, n: int) -> list[dict[str, str]]:
    roles = ["user", "assistant"]
    msgs = [{"role": "system", "content": rng.choice(CONTENTS)}]
    msgs += [{"role": roles[i % 2], "content": rng.choice(CONTENTS)} for i in range(n)]
    return msgs


def _whole(vm: VocabModel, text: str) -> list[int]:
    return vm.tokenize(text, add_special=True, parse_special=True)


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def vocab_and_format(request: pytest.FixtureRequest) -> Iterator[tuple[VocabModel, ChatFormat]]:
    vm = VocabModel(request.getfixturevalue(request.param))
    yield vm, ChatFormat.from_engine(vm)  # type: ignore[arg-type]


def test_rendered_conversations_tokenize_as_a_whole(
    vocab_and_format: tuple[VocabModel, ChatFormat],
) -> None:
    vm, fmt = vocab_and_format
    tok = fmt.tokenizer
    rng = random.Random(7)
    for n in range(1, 40):
        msgs = _conversation(rng, n % 9 + 1)
        text = fmt.template.render(msgs, add_generation_prompt=n % 2 == 0)
        expected = _whole(vm, text)
        assert tok.tokenize(vm, text) == expected  # type: ignore[arg-type]
        assert tok.tokenize(vm, text) == expected  # type: ignore[arg-type]  # from the memo
    # the message markers (BPE: ChatML's; SentencePiece: Gemma's turns) are its cuts
    assert tok.cuts and len(tok.pieces(text)) > 2


def test_any_text_around_the_markers_tokenizes_as_a_whole(
    vocab_and_format: tuple[VocabModel, ChatFormat],
) -> None:
    """Not only what templates write: random strings of markers, their fragments,
    whitespace and words."""
    vm, fmt = vocab_and_format
    tok = fmt.tokenizer
    assert tok.tokenize(vm, "x") == _whole(vm, "x")  # type: ignore[arg-type]  # cuts now known
    cuts = list(tok.cuts or ())
    parts = [*cuts, *(c[: len(c) // 2] for c in cuts), *(c[1:] for c in cuts)]
    parts += [" ", "  ", "\n", "\n\n", "word", " word", "42", "é", "<", ">", "|", "<bos>"]
    rng = random.Random(11)
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 12)))
        assert tok.tokenize(vm, text) == _whole(vm, text), repr(text)  # type: ignore[arg-type]


class _Counting:
    """The vocabulary model, recording what it is asked to tokenize."""

    def __init__(self, vm: VocabModel) -> None:
        self.vm = vm
        self.texts: list[str] = []

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        self.texts.append(text)
        return self.vm.tokenize(text, add_special=add_special, parse_special=parse_special)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.vm, name)


def test_the_next_turn_tokenizes_only_the_messages_it_adds(smollm2: str) -> None:
    vm = VocabModel(smollm2)
    fmt = ChatFormat.from_engine(vm)  # type: ignore[arg-type]
    spy = _Counting(vm)
    history = [
        {"role": "system", "content": "You are a stock assistant. " * 20},
        {"role": "user", "content": "How many items of kind 1?"},
    ]
    first = fmt.template.render(history, add_generation_prompt=True)
    assert fmt.tokenizer.tokenize(spy, first) == _whole(vm, first)  # type: ignore[arg-type]
    history += [
        {"role": "assistant", "content": "Let me look. <tool_call>{}</tool_call>"},
        {"role": "user", "content": "<tool_response>7</tool_response> And item 2?"},
    ]
    second = fmt.template.render(history, add_generation_prompt=True)
    assert second.startswith(first)
    spy.texts.clear()
    assert fmt.tokenizer.tokenize(spy, second) == _whole(vm, second)  # type: ignore[arg-type]
    read = "".join(spy.texts)
    # what the turn added, and nothing of the history before it
    assert "Let me look." in read and "And item 2?" in read
    assert "stock assistant" not in read and "kind 1" not in read


def _tiny_vocab(path: Path, **kwargs: Any) -> VocabModel:
    # two user-defined tokens, <extra_0> and <extra_1>, stand for a template's markers
    return VocabModel(str(write_tiny_llama_vocab(path, extra_tokens=2, **kwargs)))


def test_a_tokenizer_that_adds_eos_tokenizes_whole(models_dir: Path) -> None:
    """EOS added to every piece would be wrong: such a vocabulary gets no cuts."""
    vm = _tiny_vocab(models_dir / "tiny-vocab-eos.gguf", add_eos=True)
    tok = PromptTokenizer([N_VOCAB, N_VOCAB + 1])
    text = "<extra_0>user\nhi<extra_1>\n<extra_0>assistant\n"
    tokens = tok.tokenize(vm, text)  # type: ignore[arg-type]
    assert tok.cuts == ()
    assert tokens == _whole(vm, text) and tokens.count(EOS_ID) == 1


def test_the_memo_holds_at_most_its_token_budget(models_dir: Path) -> None:
    vm = _tiny_vocab(models_dir / "tiny-vocab-markers.gguf")
    tok = PromptTokenizer([N_VOCAB, N_VOCAB + 1], memo_tokens=64)
    for i in range(50):
        text = f"<extra_0>user\nmessage {i}<extra_1>\n<extra_0>assistant\n"
        assert tok.tokenize(vm, text) == _whole(vm, text)  # type: ignore[arg-type]
    assert tok.cuts == ("<extra_0>", "<extra_1>")
    assert 0 < tok.held <= 64
