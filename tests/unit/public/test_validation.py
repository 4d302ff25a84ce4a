"""Settings, per-call options, GGUF headers and grammar bounds are checked
before they reach llama.cpp, with errors that name the problem."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.chat.request_options import (
    check_call_options,
    check_timeout,
    normalize_stop,
)
from langchain_llamacpp_local.errors import (
    GrammarTooLargeError,
    InvalidSamplingParams,
    closest_name,
)
from langchain_llamacpp_local.llama.gguf import check_hparams, read_gguf_metadata
from langchain_llamacpp_local.llama.json_grammar import (
    MAX_GRAMMAR_REPETITION,
    MAX_SCHEMA_NESTING,
    check_grammar,
    json_schema_to_grammar,
)
from langchain_llamacpp_local.llama.sampling import SamplingParams, penalty_window
from langchain_llamacpp_local.llama.settings import check_load_settings
from tests.gguf_models import write_tiny_llama

# --------------------------------------------------------------------------- typos


def test_unknown_constructor_arguments_raise_naming_the_closest_field(tmp_path: Path) -> None:
    with pytest.raises(TypeError) as info:
        ChatLlamaCpp(model_path="m.gguf", n_gpu_layer=10, lookahead="ngram")
    msg = str(info.value)
    assert "'n_gpu_layer' (did you mean 'n_gpu_layers'?)" in msg
    assert "'lookahead'" in msg
    with pytest.raises(TypeError, match="did you mean 'temperature'"):
        ChatLlamaCpp(model_path="m.gguf", temprature=0.1)
    # aliases and every declared field stay accepted
    assert ChatLlamaCpp(model="m.gguf", model_name="x", verbose=False).model_name == "x"


def test_unknown_call_kwargs_raise_naming_the_closest_option(tmp_path: Path) -> None:
    llm = ChatLlamaCpp(model_path=str(tmp_path / "missing.gguf"))
    with pytest.raises(TypeError, match="'max_token' \\(did you mean 'max_tokens'\\?\\)"):
        llm.invoke("hi", max_token=5)
    with pytest.raises(TypeError, match="did you mean 'tool_choice'"):
        llm.invoke("hi", tool_chioce="auto")


def test_closest_name() -> None:
    assert closest_name("n_gpu_layer", ["n_gpu_layers", "n_ctx"]) == "n_gpu_layers"
    assert closest_name("zzz", ["n_gpu_layers", "n_ctx"]) is None


# --------------------------------------------------------------------------- call options


def test_a_single_stop_string_is_one_stop() -> None:
    assert normalize_stop("xyz") == ["xyz"]
    assert normalize_stop(["a", "", "bc"]) == ["a", "bc"]
    assert normalize_stop(None) == []
    with pytest.raises(TypeError, match="stop"):
        normalize_stop(5)
    with pytest.raises(TypeError, match="stop"):
        normalize_stop(["a", 1])
    assert ChatLlamaCpp(model_path="m.gguf", stop="xyz").stop == ["xyz"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, 0, "5", True, [1]])
def test_bad_timeouts_name_the_parameter(value: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="timeout"):
        check_timeout(value)
    if isinstance(value, str):
        return  # the constructor reads "5" as 5.0 (pydantic's lax numbers)
    with pytest.raises((TypeError, ValueError), match="timeout"):
        ChatLlamaCpp(model_path="m.gguf", timeout=value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"timeout": math.nan}, "timeout"),
        ({"timeout": math.inf}, "timeout"),
        ({"timeout": "3"}, "timeout"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [get_weather := "x"]}, "tools"),
        ({"response_format": "json"}, "response_format"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"chat_template_kwargs": ["a"]}, "chat_template_kwargs"),
        ({"temperature": "hot"}, "temperature"),
        ({"penalty_last_n": 2**40}, "penalty_last_n"),
        ({"priority": "urgent"}, "priority"),
        ({"stall_budget_ms": 0}, "stall_budget_ms"),
        ({"stall_budget_ms": math.inf}, "stall_budget_ms"),
        ({"stall_budget_ms": "150"}, "stall_budget_ms"),
        ({"cache_reuse": -1}, "cache_reuse"),
        ({"cache_reuse": True}, "cache_reuse"),
        ({"cache_reuse": "256"}, "cache_reuse"),
        ({"cache_reuse": 2.0}, "cache_reuse"),
        ({"cache_reuse": None}, "cache_reuse"),
    ],
)
def test_wrong_call_options_name_the_parameter(
    tmp_path: Path, kwargs: dict[str, Any], name: str
) -> None:
    llm = ChatLlamaCpp(model_path=str(tmp_path / "missing.gguf"))
    with pytest.raises((TypeError, ValueError), match=name):
        llm.invoke("hi", **kwargs)  # refused before any model is loaded


def test_a_grammar_beside_tools_or_a_response_format_is_refused_before_loading(
    tmp_path: Path,
) -> None:
    grammar = 'root ::= "a"'
    tool = {"type": "function", "function": {"name": "f"}}
    llm = ChatLlamaCpp(model_path=str(tmp_path / "missing.gguf"))
    for options in ({"tools": [tool]}, {"response_format": {"type": "json_object"}}):
        with pytest.raises(ValueError, match="grammar cannot be combined with"):
            llm.invoke("hi", grammar=grammar, **options)
    fixed = ChatLlamaCpp(model_path=str(tmp_path / "missing.gguf"), grammar=grammar)
    with pytest.raises(ValueError, match="grammar cannot be combined with tools"):
        fixed.invoke("hi", tools=[tool])
    with pytest.raises(ValueError, match="grammar nests 500 groups deep"):
        ChatLlamaCpp(model_path=str(tmp_path / "m.gguf"), grammar="root ::= " + "(" * 500)
    with pytest.raises(TypeError, match="grammar must be a GBNF string"):
        llm.invoke("hi", grammar=["root ::= x"])


def test_check_call_options_accepts_good_values() -> None:
    check_call_options(
        {
            "tools": [{"type": "function"}],
            "response_format": {"type": "json_object"},
            "top_logprobs": 3,
            "logprobs": True,
            "chat_template_kwargs": {},
            "priority": "background",
            "stall_budget_ms": None,
        }
    )
    check_call_options({"priority": "interactive", "stall_budget_ms": 50})


@pytest.mark.parametrize(("field", "value"), [("priority", "later"), ("stall_budget_ms", -1.0)])
def test_wrong_scheduling_fields_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        ChatLlamaCpp(model_path="m.gguf", **{field: value})


def _nested_tool(levels: int) -> dict[str, Any]:
    """A tool whose parameters schema nests ``levels`` objects/arrays deep."""
    node: dict[str, Any] = {"type": "string"}  # one level: the innermost schema
    for _ in range(levels - 1):
        node = {"type": "array", "items": node}
    return {"type": "function", "function": {"name": "t", "parameters": node}}


def test_tool_schemas_nested_up_to_the_grammar_limit_pass_deeper_ones_name_their_depth() -> None:
    check_call_options({"tools": [_nested_tool(MAX_SCHEMA_NESTING)]})
    json_schema_to_grammar(_nested_tool(MAX_SCHEMA_NESTING)["function"]["parameters"])
    deeper = _nested_tool(MAX_SCHEMA_NESTING + 1)
    with pytest.raises(ValueError, match=rf"tools\[1\] \('t'\) nests {MAX_SCHEMA_NESTING + 1} "):
        check_call_options({"tools": [_nested_tool(2), deeper]})
    with pytest.raises(GrammarTooLargeError):  # the same limit as the tool-call grammar's
        json_schema_to_grammar(deeper["function"]["parameters"])
    # measured without recursion: far past Python's recursion limit too
    with pytest.raises(ValueError, match="nests 5000 objects/arrays deep"):
        check_call_options({"tools": [_nested_tool(5000)]})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": True}, "temperature"),
        ({"n_ctx": True}, "n_ctx"),
    ],
)
def test_booleans_and_fractions_are_not_numbers(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises((TypeError, ValueError), match=name):
        ChatLlamaCpp(model_path="m.gguf", **kwargs)


# --------------------------------------------------------------------------- load settings


@pytest.mark.parametrize(
    ("settings", "name"),
    [
        ({"n_batch": 2, "n_slots": 4}, "n_batch"),
        ({"n_ctx": 1, "n_slots": 4}, "n_ctx"),
        ({"n_ctx": 3, "n_slots": 4}, "n_ctx"),
        ({"n_ctx": 0}, "n_ctx"),
        ({"n_ctx": 2**32 + 1}, "n_ctx"),
        ({"n_ubatch": 2, "n_slots": 4}, "n_ubatch"),
        ({"n_threads": 0}, "n_threads"),
        ({"n_threads": 100_000}, "n_threads"),
        ({"n_threads_batch": -1}, "n_threads_batch"),
        ({"n_slots": 0}, "n_slots"),
        ({"n_slots": 257}, "n_slots"),
        ({"n_gpu_layers": -5}, "n_gpu_layers"),
        ({"rope_freq_base": math.nan}, "rope_freq_base"),
        ({"rope_freq_scale": -1.0}, "rope_freq_scale"),
        ({"image_min_tokens": 0}, "image_min_tokens"),
        ({"image_min_tokens": 9, "image_max_tokens": 4}, "image_min_tokens"),
        ({"type_k": "q9_9"}, "type_k"),
        ({"prompt_cache_bytes": -1}, "prompt_cache_bytes"),
        ({"checkpoint_min_step": 0}, "checkpoint_min_step"),
    ],
)
def test_load_settings_llama_cpp_would_abort_on(settings: dict[str, Any], name: str) -> None:
    with pytest.raises((TypeError, ValueError), match=name):
        check_load_settings(settings)


def test_load_settings_minimums_are_accepted() -> None:
    check_load_settings({"n_ctx": 4, "n_batch": 4, "n_ubatch": 4, "n_slots": 4})
    check_load_settings({"n_ctx": 1, "n_batch": 1, "n_slots": 1, "n_threads": 1})
    check_load_settings({"n_gpu_layers": -1, "type_k": "Q8_0"})


# --------------------------------------------------------------------------- penalty window


def test_penalty_window_maps_to_llama_cpp_semantics() -> None:
    assert penalty_window(-1, 4096) == 4096  # whole context (llama.cpp alone: off)
    assert penalty_window(0, 4096) == 0
    assert penalty_window(64, 4096) == 64
    assert penalty_window(10**9, 4096) == 4096  # clamped: no 4 GB ring buffer
    with pytest.raises(InvalidSamplingParams, match="penalty_last_n"):
        penalty_window(-1, None)
    for bad in (-2, 2**31, 10**12):
        with pytest.raises(InvalidSamplingParams, match="penalty_last_n"):
            SamplingParams(penalty_last_n=bad)


# --------------------------------------------------------------------------- GGUF header


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"llama.block_count": 100000}, "block_count=100000"),
        ({"llama.block_count": 0}, "block_count=0"),
        ({"llama.block_count": 2, "llama.nextn_predict_layers": 3}, "nextn_predict_layers"),
        ({"llama.block_count": 2, "llama.expert_count": 2000}, "expert_count=2000"),
        ({"llama.expert_count": 8, "llama.expert_used_count": [2, 9]}, "expert_used_count=9"),
        ({"llama.expert_count": 8}, "expert_used_count must be > 0"),
        (
            {"llama.expert_count": 8, "llama.expert_used_count": 2, "llama.expert_group_count": 3},
            "expert_group_count=3",
        ),
        ({"llama.expert_group_count": 2}, "without experts"),
        ({"llama.rope.scaling.type": "warp"}, "rope.scaling.type"),
        ({"llama.block_count": -1}, "negative"),
        ({"llama.block_count": "many"}, "must be a number"),
    ],
)
def test_check_hparams_refuses_what_llama_cpp_asserts_on(
    meta: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_hparams({"general.architecture": "llama", **meta})


def test_check_hparams_accepts_real_headers(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "ok.gguf")
    meta = read_gguf_metadata(path, arrays=True)
    assert meta["llama.block_count"] == 2
    check_hparams(meta)
    check_hparams(
        {
            "general.architecture": "llama",
            "llama.block_count": 512,
            "llama.expert_count": 8,
            "llama.expert_used_count": 2,
            "llama.rope.scaling.type": "yarn",
        }
    )


# --------------------------------------------------------------------------- grammar bounds


def test_too_large_bounds_are_errors_naming_the_field() -> None:
    class Essay(BaseModel):
        body: str = Field(max_length=MAX_GRAMMAR_REPETITION + 1)

    with pytest.raises(GrammarTooLargeError, match="'body'"):
        json_schema_to_grammar(Essay.model_json_schema())
    with pytest.raises(GrammarTooLargeError, match="'xs'"):
        json_schema_to_grammar(
            {
                "type": "object",
                "properties": {
                    "xs": {"type": "array", "items": {"type": "integer"}, "minItems": 10**7}
                },
            }
        )


def test_check_grammar_limits() -> None:
    check_grammar('root ::= "a" ("b" | "c")* # comment ((((\n')
    with pytest.raises(GrammarTooLargeError, match="nests"):
        check_grammar("root ::= " + "(" * 500 + '"a"' + ")" * 500)
    with pytest.raises(GrammarTooLargeError, match="rules"):
        check_grammar('root ::= ("a"{0,1000}) ' * 300)
    # parentheses inside literals and classes do not count
    check_grammar('root ::= "((((((" [(((] ' * 100)


def test_community_parameters_get_what_replaces_them_not_a_lookalike_field() -> None:
    """langchain-community's names are not typos of ours: ``grammar_path`` is not
    ``mmproj_path`` and ``model_kwargs`` is not ``model_path``."""
    with pytest.raises(TypeError) as info:
        ChatLlamaCpp(model_path="m.gguf", grammar_path="g.gbnf", model_kwargs={}, lora_path="a")
    msg = str(info.value)
    assert "mmproj_path" not in msg and "'model_path'" not in msg, msg
    assert "'grammar_path' (pass the grammar's text as grammar=..., or build one from a" in msg
    assert "'model_kwargs' (llama.cpp settings are fields of their own" in msg
    assert "'lora_path' (use lora_adapters=" in msg
    with pytest.raises(TypeError, match="'last_n_tokens_size' \\(use penalty_last_n=\\)"):
        ChatLlamaCpp(model_path="m.gguf", last_n_tokens_size=64)
    # unrelated names get no suggestion; typos still get theirs
    assert closest_name("model_kwargs", ["model_path", "models_dir"]) is None
    assert closest_name("kv_unify", ["kv_unified"]) == "kv_unified"


@pytest.mark.parametrize("value", [-1, True, False, "256", 2.0, None, 2**40])
def test_a_wrong_cache_reuse_is_refused_at_construction(tmp_path: Path, value: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="cache_reuse"):
        ChatLlamaCpp(model_path=str(tmp_path / "missing.gguf"), cache_reuse=value)


def test_cache_reuse_is_off_by_default_and_a_call_may_set_it(tmp_path: Path) -> None:
    from langchain_core.messages import HumanMessage

    from langchain_llamacpp_local.chat.request_options import build_job, check_call

    llm = ChatLlamaCpp(model_path=str(tmp_path / "missing.gguf"))
    msgs = [HumanMessage("hi")]
    assert llm.cache_reuse == 0
    assert build_job(llm, msgs, check_call({}, None, llm)).cache_reuse == 0
    job = build_job(llm, msgs, check_call({"cache_reuse": 256}, None, llm))
    assert job.cache_reuse == 256 and job.reuse_owner == llm.reuse_scope
    other = ChatLlamaCpp(model_path=str(tmp_path / "missing.gguf"), cache_reuse=64)
    assert build_job(other, msgs, check_call({}, None, other)).cache_reuse == 64
    assert other.reuse_scope != llm.reuse_scope  # one instance's entries stay its own
