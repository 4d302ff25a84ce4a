"""Grammars that really constrain generation, sampled on a tiny random-weight llama
model through the sampler chain (llama.cpp's own grammar engine)."""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Iterator
from typing import Any

import llama_cpp.llama_cpp as C
import pytest

from langchain_llamacpp_local.formats.grammars import tool_call_grammar
from langchain_llamacpp_local.llama.json_grammar import JSON_OBJECT_GRAMMAR, json_schema_to_grammar
from langchain_llamacpp_local.llama.sampling import Sampler, SamplingParams
from tests.sampling_support import PARAMS as _PARAMS
from tests.sampling_support import TOOLS, Person, TinyModel
from tests.sampling_support import validate as _validate

# ----------------------------------------------------------------------------- llama.cpp


@C.llama_log_callback
def _quiet(_level: int, _text: bytes, _user: ctypes.c_void_p) -> None:
    pass


@pytest.fixture(scope="module", autouse=True)
def _silence_llama() -> Iterator[None]:
    """No llama.cpp log in this module; the previous callback is restored after."""
    prev_cb, prev_ud = C.llama_log_callback(), ctypes.c_void_p()
    C.llama_log_get(ctypes.byref(prev_cb), ctypes.byref(prev_ud))
    C.llama_log_set(_quiet, ctypes.c_void_p(0))
    C.llama_backend_init()
    yield
    C.llama_log_set(prev_cb if prev_cb else None, prev_ud)


def test_grammar_compiles_in_llama_cpp(tiny: TinyModel) -> None:
    for grammar in (json_schema_to_grammar(Person.model_json_schema()), JSON_OBJECT_GRAMMAR):
        smpl = C.llama_sampler_init_grammar(tiny.vocab, grammar.encode(), b"root")
        assert smpl
        C.llama_sampler_free(smpl)


def test_schema_grammar_constrains_generation(tiny: TinyModel) -> None:
    schema = Person.model_json_schema()
    grammar = json_schema_to_grammar(schema)
    for prompt in ("hi", "Tell me about a person"):
        text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 300, prompt)
        assert ended, text
        doc = json.loads(text)
        _validate(doc, schema)
        Person.model_validate(_strip_long(doc))
    # sampled (not greedy) output obeys the grammar too
    text, ended = tiny.generate(SamplingParams(temperature=1.0, seed=3, grammar=grammar), 300)
    assert ended, text
    _validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "pattern",
    [
        r"^\d{5}$",
        r"[a-z]{1,4}",
        "a|bc",
        r"\w{2}@\w{1,3}\.com",
        r"^[\d.]{3}$",
        r"^x\$-\\{2}$",
        '^"q"$',
    ],
)
def test_pattern_grammar_generates_matching_json(tiny: TinyModel, pattern: str) -> None:
    grammar = json_schema_to_grammar({"type": "string", "pattern": pattern})
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 60)
    assert ended, text
    assert re.search(pattern, json.loads(text)), text


def test_annotation_only_schema_means_any_value(tiny: TinyModel) -> None:
    schema = {"type": "object", "properties": {"a": {"title": "A"}}, "required": ["a"]}
    grammar = json_schema_to_grammar(schema)
    assert "a ::= " in grammar and "boolean" in grammar
    with Sampler(tiny.vocab, SamplingParams(temperature=0, grammar=grammar)):
        pass


def _strip_long(doc: dict[str, Any]) -> dict[str, Any]:
    """Shorten strings that are long only because of U+FFFD (see _relaxed)."""

    def fix(v: Any) -> Any:
        if isinstance(v, str):
            return v[:8] if "\ufffd" in v else v
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fix(x) for x in v]
        return v

    return fix(doc)


def _parse_calls(text: str, fmt: str, parallel: bool) -> list[tuple[str, Any]]:
    """Minimal parsers of the wire formats; return [(name, arguments)]."""
    if fmt == "hermes":
        one = r"<tool_call>\n(.*?)\n</tool_call>"
        assert re.fullmatch(f"{one}(\n{one})*", text, re.S), text
        bodies = re.findall(one, text, re.S)
        calls = [json.loads(b) for b in bodies]
    elif fmt == "llama3_json":
        calls = [json.loads(part) for part in text.split("; ")]
    elif fmt == "mistral":
        assert text.startswith("[TOOL_CALLS]")
        calls = json.loads(text[len("[TOOL_CALLS]") :])
    else:
        doc = json.loads(text)
        calls = doc["tool_calls"] if parallel else [doc["tool_call"]]
    key = "parameters" if fmt == "llama3_json" else "arguments"
    out = []
    for call in calls:
        assert list(call) == ["name", key]  # key order name -> arguments
        out.append((call["name"], call[key]))
    return out


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral", "generic"])
@pytest.mark.parametrize("parallel", [False, True])
def test_tool_call_grammar_constrains_generation(tiny: TinyModel, fmt: str, parallel: bool) -> None:
    grammar, used = tool_call_grammar(TOOLS, fmt, parallel=parallel)
    assert used == fmt
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 400)
    if not ended:
        # a random model may keep adding parallel calls; judge the complete ones
        assert parallel and fmt == "llama3_json", text
        text = text[: text.rindex("; ")]
    calls = _parse_calls(text, fmt, parallel)
    assert calls and (parallel or len(calls) == 1)
    for name, args in calls:
        assert name in _PARAMS
        _validate(args, _PARAMS[name])


@pytest.mark.parametrize("name", ["book", "now", "ping"])
def test_tool_call_grammar_forced_name(tiny: TinyModel, name: str) -> None:
    grammar, _ = tool_call_grammar(TOOLS, "hermes", parallel=False, name=name)
    text, ended = tiny.generate(SamplingParams(temperature=0, grammar=grammar), 200, "call")
    assert ended, text
    [(got, args)] = _parse_calls(text, "hermes", False)
    assert got == name
    _validate(args, _PARAMS[name])
    if name != "book":
        assert args == {}


def test_greedy_is_deterministic(tiny: TinyModel) -> None:
    a = tiny.generate(SamplingParams(temperature=0), 40)
    b = tiny.generate(SamplingParams(temperature=0, seed=123), 40)
    assert a == b and len(a[0]) > 0


def test_greedy_takes_the_token_llama_cpps_greedy_sampler_takes(tiny: TinyModel) -> None:
    """Greedy alone reads the logits with numpy instead of llama.cpp's candidate array;
    on a real context's logits, rewritten in place with ties and a NaN, both pick the
    same token (the first maximum; a NaN is left to llama.cpp)."""
    import numpy as np

    cp = C.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 128, 1, 1
    ctx = C.llama_init_from_model(tiny.model, cp)
    assert ctx
    ref = C.llama_sampler_init_greedy()
    try:
        toks = (C.llama_token * 2)(1, 5)
        assert C.llama_decode(ctx, C.llama_batch_get_one(toks, 2)) == 0
        n_vocab = C.llama_vocab_n_tokens(tiny.vocab)
        logits = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        real = logits.copy()
        rng = np.random.default_rng(7)
        cases = [real]
        for _ in range(20):
            tied = real.copy()
            top = rng.choice(n_vocab, size=3, replace=False)
            tied[top] = real.max() + 1.0
            cases.append(tied)
        with_nan = real.copy()
        with_nan[rng.integers(n_vocab)] = np.nan
        cases.append(with_nan)
        with Sampler(tiny.vocab, SamplingParams(temperature=0)) as ours:
            assert ours._argmax_only  # the numpy path is the one compared
            for case in cases:
                logits[:] = case
                got = ours.sample(ctx, -1)
                logits[:] = case
                assert got == C.llama_sampler_sample(ref, ctx, -1)
    finally:
        C.llama_sampler_free(ref)
        C.llama_free(ctx)


def test_seeded_sampling_is_reproducible(tiny: TinyModel) -> None:
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a = tiny.generate(p, 40)
    assert tiny.generate(p, 40) == a
    others = {tiny.generate(p.replace(seed=s), 40) for s in (1, 2, 3)}
    assert others != {a}  # the seed matters


def test_penalties_change_greedy_output(tiny: TinyModel) -> None:
    base = tiny.generate(SamplingParams(temperature=0), 60)
    pen = SamplingParams(
        temperature=0, repeat_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5
    )
    assert pen.penalties_active
    a = tiny.generate(pen, 60)
    assert a == tiny.generate(pen, 60)
    assert a != base


def test_lazy_grammar_applies_after_trigger(tiny: TinyModel) -> None:
    free, _ = tiny.generate(SamplingParams(temperature=0), 30)
    # pick an ASCII run of the unconstrained output as trigger
    m = re.search(r"[A-Za-z0-9]{2,}", free)
    assert m, free
    trigger = m.group(0)[:3]
    head = free[: free.index(trigger)]
    params = SamplingParams(
        temperature=0,
        grammar=f'root ::= "{trigger}" "ZZZ"',
        grammar_lazy_triggers=(trigger,),
    )
    text, ended = tiny.generate(params, 60)
    assert ended and text == head + trigger + "ZZZ"
    # a trigger that never appears leaves the output unconstrained
    never = SamplingParams(
        temperature=0, grammar='root ::= "Q"', grammar_lazy_triggers=("(never)",)
    )
    assert tiny.generate(never, 30) == (free, False)


def test_invalid_grammar_raises(tiny: TinyModel) -> None:
    for bad in ("root ::= (", 'start ::= "x"', "this is not gbnf"):
        with pytest.raises(ValueError, match="invalid grammar"):
            Sampler(tiny.vocab, SamplingParams(grammar=bad))


def test_sampler_close_is_idempotent(tiny: TinyModel) -> None:
    s = Sampler(tiny.vocab, SamplingParams(repeat_penalty=1.2, grammar=JSON_OBJECT_GRAMMAR))
    s.close()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.sample(None, 0)
