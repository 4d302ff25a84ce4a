"""llama.cpp's samplers past temperature/top-k/top-p/min-p and the penalties, through the
real request path: each changes what it should on scripted models whose next-token
logits are known (tests/gguf_models.py), works as a field and per call, and a seeded
request under each is reproduced exactly in deterministic mode, alone or beside others.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import BaseMessage

from langchain_llamacpp_local import ChatLlamaCpp
from tests.compare import assert_identical, ids
from tests.gguf_models import byte_token, write_scripted_llama

#: the prompt is the message's text alone: the model sees exactly what the test wrote
PLAIN = "{{ messages[0].content }}"


def _scripted(tmp_path: Path, name: str, transitions: dict[str, dict[str, float]]) -> str:
    return str(write_scripted_llama(tmp_path / f"{name}.gguf", transitions=transitions))


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Greedy prints "bcabcabc..." for ever; each step's runner-up "x" ends the reply."""
    return _scripted(
        tmp_path_factory.mktemp("loop"),
        "loop",
        {"a": {"b": 5, "x": 4}, "b": {"c": 5, "x": 4}, "c": {"a": 5, "x": 4}},
    )


@pytest.fixture(scope="module")
def two_top(tmp_path_factory: pytest.TempPathFactory) -> str:
    """After any letter: "b" (p 0.62) and "c" (p 0.37), the rest below 0.001."""
    return _scripted(tmp_path_factory.mktemp("top"), "top", {s: {"b": 10, "c": 9.5} for s in "abc"})


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> str:
    """After any letter: b, c, d, e with logits 12, 11, 10, 9 (p about .64 .24 .09 .03)."""
    return _scripted(
        tmp_path_factory.mktemp("four"),
        "four",
        {s: {"b": 12, "c": 11, "d": 10, "e": 9} for s in "abcde"},
    )


def _greedy(path: str, **kw: Any) -> ChatLlamaCpp:
    return ChatLlamaCpp(
        model_path=path, temperature=0, max_tokens=30, n_ctx=256, chat_template=PLAIN, **kw
    )


# --------------------------------------------------------------------------- DRY


def test_dry_stops_a_repeated_sequence(loop: str) -> None:
    llm = _greedy(loop)
    assert llm.invoke("a").content == "bca" * 10
    # the repeat "bca|bc" reaches 3 tokens past the allowed 2: "a" loses 0.8 * 1.75,
    # more than its lead of 1 over "x", which ends the reply
    dry = llm.invoke("a", dry_multiplier=0.8)
    assert dry.content == "bcabcax"
    assert dry.response_metadata["finish_reason"] == "stop"
    assert _greedy(loop, dry_multiplier=0.8).invoke("a").content == "bcabcax"  # as a field
    assert llm.invoke("a", dry_multiplier=0.8, dry_penalty_last_n=-1).content == "bcabcax"
    # off by its window; a longer allowed repeat or a weaker base lets it run longer
    assert llm.invoke("a", dry_multiplier=0.8, dry_penalty_last_n=0).content == "bca" * 10
    longer = llm.invoke("a", dry_multiplier=0.8, dry_allowed_length=5).content
    assert longer == "bcabcabcax"
    # a sequence breaker ends every repeat at "c": none grows past the allowed length
    broken = llm.invoke("a", dry_multiplier=0.8, dry_sequence_breakers=["c"])
    assert broken.content == "bca" * 10


# --------------------------------------------------------------------------- XTC


def test_xtc_drops_the_top_choices(two_top: str) -> None:
    llm = _greedy(two_top)
    assert llm.invoke("a").content == "b" * 30
    # both pass the threshold: XTC removes all but the least likely of them
    assert llm.invoke("a", xtc_probability=1.0).content == "c" * 30
    # only "b" passes a threshold of 0.5: nothing is removed
    assert llm.invoke("a", xtc_probability=1.0, xtc_threshold=0.5).content == "b" * 30
    # random, from the request's seed: a seed reproduces its choices, another differs
    half = llm.invoke("a", xtc_probability=0.5, seed=1).content
    assert set(str(half)) == {"b", "c"}
    assert llm.invoke("a", xtc_probability=0.5, seed=1).content == half
    assert llm.invoke("a", xtc_probability=0.5, seed=2).content != half


# --------------------------------------------------------------------------- logit bias


@pytest.mark.parametrize(
    "ban",
    [
        {"b": float("-inf")},
        {"b": "-inf"},
        {"b": False},
        {byte_token(ord("b")): float("-inf")},
        {str(byte_token(ord("b"))): float("-inf")},  # a JSON / OpenAI-style id key
    ],
)
def test_a_banned_token_is_never_emitted(two_top: str, ban: dict[Any, Any]) -> None:
    greedy = _greedy(two_top)
    assert greedy.invoke("a", logit_bias=ban).content == "c" * 30
    sampled = ChatLlamaCpp(
        model_path=two_top, temperature=1.0, max_tokens=60, n_ctx=256, chat_template=PLAIN
    )
    free = Counter(str(sampled.invoke("a", seed=7).content))
    assert free["b"] > 20 and free["c"] > 10  # without the ban "b" is the likeliest token
    for seed in range(5):
        assert sampled.invoke("a", seed=seed, logit_bias=ban).content == "c" * 60


def test_a_positive_bias_promotes_a_token(two_top: str) -> None:
    assert _greedy(two_top, logit_bias={"c": 1.0}).invoke("a").content == "c" * 30
    assert _greedy(two_top).invoke("a", logit_bias={"c": 0.4}).content == "b" * 30


# --------------------------------------------------------------------------- distribution


def _counts(path: str, **kw: Any) -> Counter[str]:
    llm = ChatLlamaCpp(
        model_path=path,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=5,
        max_tokens=200,
        n_ctx=512,
        chat_template=PLAIN,
    )
    text = str(llm.invoke("a", **kw).content)
    assert len(text) == 200
    assert llm.invoke("a", **kw).content == text  # seeded: reproduced exactly
    return Counter(text)


def test_samplers_that_reshape_the_distribution(four: str) -> None:
    base = _counts(four)
    assert set(base) == set("bcde") and base["b"] < 150
    # typical sampling keeps the tokens whose surprise is nearest the entropy: "c" alone
    assert _counts(four, typical_p=0.2) == Counter({"c": 200})
    assert set(_counts(four, typical_p=0.5)) == {"b", "c"}
    # top-n-sigma keeps logits within n standard deviations of the best (all 262 count)
    assert _counts(four, top_n_sigma=0.5) == Counter({"b": 200})
    assert set(_counts(four, top_n_sigma=1.0)) == {"b", "c"}
    # dynamic temperature: a low entropy lowers the temperature below 1
    assert _counts(four, dynatemp_range=1.0)["b"] > base["b"] + 40
    # Mirostat aims at a low surprise: mostly the likeliest token
    for version in (1, 2):
        low = _counts(four, mirostat=version, mirostat_tau=0.5)
        assert set(low) <= {"b", "c"} and low["b"] > base["b"] + 30, version
        assert set(_counts(four, mirostat=version, mirostat_tau=5.0)) == set("bcde")


# --------------------------------------------------------------------------- grammar


def test_a_user_grammar_constrains_every_reply(two_top: str) -> None:
    grammar = 'root ::= "c" "b"? "c"'
    assert _greedy(two_top, grammar=grammar).invoke("a").content == "cbc"
    llm = _greedy(two_top)
    assert llm.invoke("a", grammar='root ::= "c"{2,4} "."').content == "cccc."
    assert llm.invoke("a").content == "b" * 30  # the next call is free again


# --------------------------------------------------------------------------- deterministic

#: every sampler added beside the original ones, each seeded and at temperature 1
SEEDED: list[dict[str, Any]] = [
    {"dry_multiplier": 0.8, "dry_allowed_length": 0},
    {"xtc_probability": 0.7, "xtc_threshold": 0.01},
    {"typical_p": 0.6},
    {"top_n_sigma": 0.3},
    {"dynatemp_range": 0.7},
    {"mirostat": 1, "mirostat_tau": 2.0},
    {"mirostat": 2, "mirostat_tau": 2.0},
    {"logit_bias": {"e": 2.0, 100: -3.0}},  # and a ban of the plain reply's first token
    {"grammar": 'root ::= [a-z ]+ "."'},
]

PROMPTS = ["hi", "A question about the weather in the mountains? " * 3]


def _together(llm: ChatLlamaCpp, prompts: list[str], **kw: Any) -> list[BaseMessage]:
    """The prompts' replies, asked from threads at once (the worker batches them)."""
    out: list[Any] = [None] * len(prompts)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = llm.invoke(prompts[i], **kw)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return out


def test_deterministic_mode_reproduces_each_sampler(tiny_llama: str) -> None:
    """Seeded, each sampler gives the same tokens and log-probabilities alone and beside
    another request; and it changes the answer (the comparison is not vacuous)."""
    llm = ChatLlamaCpp(
        model_path=tiny_llama,
        n_slots=2,
        max_tokens=8,
        deterministic=True,
        temperature=1.0,
        seed=11,
        logprobs=True,
        top_logprobs=2,
    )
    first = [llm.invoke(p, cache_prompt=False) for p in PROMPTS]
    plain = [m.content for m in first]
    for sampler in SEEDED:
        if "logit_bias" in sampler:
            sampler = {"logit_bias": {**sampler["logit_bias"], ids(first[0])[0]: float("-inf")}}
        solo = [llm.invoke(p, cache_prompt=False, **sampler) for p in PROMPTS]
        assert [m.content for m in solo] != plain, sampler
        for got, ref in zip(_together(llm, PROMPTS, **sampler), solo, strict=True):
            assert_identical(got, ref)
