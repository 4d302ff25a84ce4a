"""LoRA adapters per request on real llama.cpp, with tiny adapters the suite writes.

Adapters at scale 0 leave the base model bit for bit; at scale 1 the output is
llama-cpp-python's own (``Llama(lora_path=...)``); concurrent requests with
different adapters each get their solo answer; a changed adapter set never reuses
a cached prefix; bad adapter files are refused with errors naming them.
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from langchain_core.messages import AIMessage, HumanMessage

from langchain_llamacpp_local import ChatLlamaCpp
from langchain_llamacpp_local.errors import ModelLoadError, NonFiniteOutputError
from langchain_llamacpp_local.llama import lora_registry
from tests.compare import GREEDY, assert_identical, assert_same_greedy, ids
from tests.gguf_models import byte_token, write_tiny_llama, write_tiny_lora
from tests.helpers import worker_of

RAW = "{{ messages[-1].content }}"
ALL = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
PROMPT = "hello lora"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("lora")
    corrupt = d / "corrupt.gguf"
    good = write_tiny_lora(d / "a.gguf", seed=1)
    corrupt.write_bytes(good.read_bytes()[:300])  # a truncated header
    junk = d / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return {
        "model": str(write_tiny_llama(d / "model.gguf")),
        "a": str(good),
        "b": str(write_tiny_lora(d / "b.gguf", seed=2)),
        "mamba": str(write_tiny_lora(d / "mamba.gguf", arch="mamba")),
        "narrow": str(write_tiny_lora(d / "narrow.gguf", n_embd=32)),
        "corrupt": str(corrupt),
        "junk": str(junk),
        "f64": str(_f64_lora(d / "f64.gguf")),
        # in bounds (weights within f16's range), yet at scale 100 its values and keys
        # overflow the f16 KV cache: what only the after-decode check can catch
        "hot": str(write_tiny_lora(d / "hot.gguf", seed=1, strength=1e4)),
        "dir": str(d),
    }


def _f64_lora(path: Path) -> Path:
    """A well-formed adapter whose tensors are F64: llama.cpp loads it, then its matmul
    kernels crash the process on the first decode."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 4.0)
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.full((4, 64), 0.01))
    w.add_tensor("blk.0.attn_q.weight.lora_b", np.full((64, 4), 0.01))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llm(files: dict[str, str], **kw: Any) -> ChatLlamaCpp:
    base: dict[str, Any] = {
        "max_tokens": 12,
        "n_ctx": 256,
        "chat_template": RAW,
        "lora_adapters": {"a": files["a"], "b": files["b"]},
        # answers are compared bit for bit across cache paths and concurrency
        "deterministic": True,
        **GREEDY,
    }
    return ChatLlamaCpp(model_path=files["model"], **{**base, **kw})


def test_scale_zero_and_defaults_equal_the_base_model(files: dict[str, str]) -> None:
    base = ChatLlamaCpp(
        model_path=files["model"],
        max_tokens=12,
        n_ctx=256,
        chat_template=RAW,
        deterministic=True,
        **GREEDY,
    ).invoke(PROMPT, cache_prompt=False)
    llm = _llm(files)
    default = llm.invoke(PROMPT, cache_prompt=False)  # bare paths: loaded, off
    zero = llm.invoke(PROMPT, cache_prompt=False, lora={"a": 0.0})
    assert_identical(default, base)
    assert_identical(zero, base)
    assert default.response_metadata["lora"] == {}
    assert zero.response_metadata["lora"] == {}
    on = llm.invoke(PROMPT, cache_prompt=False, lora={"a": 1.0})
    assert ids(on) != ids(base)  # the adapter does change the answer
    assert on.response_metadata["lora"] == {"a": 1.0}


def test_scale_one_equals_llama_cpp_python(files: dict[str, str]) -> None:
    got = _llm(files).invoke(PROMPT, cache_prompt=False, lora={"a": 1.0})
    ref = llama_cpp.Llama(files["model"], lora_path=files["a"], n_ctx=256, verbose=False)
    try:
        toks = ref.tokenize(PROMPT.encode(), add_bos=True, special=True)
        assert got.usage_metadata["input_tokens"] == len(toks)
        want: list[int] = []
        for t in ref.generate(toks, temp=0.0, top_k=1):
            if t == ref.token_eos() or len(want) == 12:
                break
            want.append(t)
    finally:
        ref.close()
    assert ids(got) == want


def test_constructor_scale_is_the_default_and_a_request_replaces_it(
    files: dict[str, str],
) -> None:
    plain = _llm(files)
    scaled = _llm(files, lora_adapters={"a": {"path": files["a"], "scale": 0.5}, "b": files["b"]})
    dflt = scaled.invoke(PROMPT, cache_prompt=False)
    assert dflt.response_metadata["lora"] == {"a": 0.5}
    assert_identical(dflt, plain.invoke(PROMPT, cache_prompt=False, lora={"a": 0.5}))
    only_b = scaled.invoke(PROMPT, cache_prompt=False, lora={"b": 1.0})
    assert only_b.response_metadata["lora"] == {"b": 1.0}
    assert_identical(only_b, plain.invoke(PROMPT, cache_prompt=False, lora={"b": 1.0}))
    bound = plain.bind(lora={"a": 0.5}).invoke(PROMPT, cache_prompt=False)
    assert_identical(bound, dflt)
    configurable = plain.configurable_fields(lora=_field("lora"))
    cfg = configurable.invoke(
        PROMPT, config={"configurable": {"lora": {"a": 0.5}}}, cache_prompt=False
    )
    assert_identical(cfg, dflt)


def _field(name: str) -> Any:
    from langchain_core.runnables import ConfigurableField

    return ConfigurableField(id=name)


def test_adapters_are_loaded_once_per_model(files: dict[str, str]) -> None:
    one = _llm(files).load()
    two = _llm(files, n_ctx=512).load()  # another context (worker) on the same model
    assert worker_of(one) is not worker_of(two)
    loaded = lora_registry.loaded_adapter_paths()
    assert sorted(loaded) == sorted([files["a"], files["b"]])


def test_concurrent_requests_with_different_adapters_match_their_solo_runs(
    files: dict[str, str],
) -> None:
    llm = _llm(files, n_slots=3, max_tokens=16)
    sets = [{"a": 1.0}, {"b": 1.0}, {}]
    prompts = ["one prompt", "another one", "a third one"]
    solo = [llm.invoke(p, cache_prompt=False, lora=s) for p, s in zip(prompts, sets, strict=True)]
    got: list[Any] = [None] * 3
    start = threading.Barrier(3)

    def run(i: int) -> None:
        start.wait()
        got[i] = llm.invoke(prompts[i], cache_prompt=False, lora=sets[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for g, s in zip(got, solo, strict=True):
        assert_identical(g, s)


def test_switching_adapters_between_turns_never_reuses_the_cache(files: dict[str, str]) -> None:
    llm = _llm(files, n_slots=1, chat_template=ALL, n_ctx=1024)
    one = "turn one " * 20  # reuse is in whole grid cells: long enough for some

    def read(msg: Any) -> int:
        return msg.usage_metadata["input_token_details"]["cache_read"]

    first = llm.invoke([HumanMessage(one)], lora={"a": 1.0})
    history = [HumanMessage(one), AIMessage(first.content), HumanMessage("two")]
    same_a = llm.invoke(history, lora={"a": 1.0})
    assert read(same_a) > 0  # the same adapter set reuses the first turn
    switched = llm.invoke(history, lora={"b": 1.0})
    assert read(switched) == 0
    # the "a" conversation was parked in host RAM, not reused by "b": back to "a" it is
    again_a = llm.invoke(history, lora={"a": 1.0})
    assert read(again_a) > 0
    base = llm.invoke(history, lora={})  # the base model shares nothing with either
    assert read(base) == 0
    assert_identical(switched, llm.invoke(history, cache_prompt=False, lora={"b": 1.0}))
    assert_identical(again_a, llm.invoke(history, cache_prompt=False, lora={"a": 1.0}))
    assert_identical(base, llm.invoke(history, cache_prompt=False, lora={}))


@pytest.mark.parametrize(
    ("which", "words"),
    [
        ("mamba", "architecture 'mamba'"),
        ("narrow", "another base model"),
        ("corrupt", "corrupt"),
        ("junk", "corrupt"),
        ("f64", "ggml type 28"),
    ],
)
def test_bad_adapter_files_are_refused_and_the_model_keeps_serving(
    files: dict[str, str], which: str, words: str
) -> None:
    good = _llm(files)
    before = good.invoke(PROMPT, lora={"a": 1.0})
    bad = _llm(files, lora_adapters={"x": files[which]})
    with pytest.raises(ModelLoadError) as err:
        bad.invoke(PROMPT)
    assert files[which] in str(err.value) and words in str(err.value)
    assert_identical(good.invoke(PROMPT, lora={"a": 1.0}), before)


def test_missing_adapter_and_models_dir_names(files: dict[str, str]) -> None:
    with pytest.raises(ModelLoadError, match="LoRA adapter file not found: nope"):
        _llm(files, lora_adapters={"x": "nope"}).invoke(PROMPT)
    by_name = _llm(files, lora_adapters={"a": "a", "b": "b.gguf"}, models_dir=files["dir"])
    assert_identical(
        by_name.invoke(PROMPT, cache_prompt=False, lora={"a": 1.0}),
        _llm(files).invoke(PROMPT, cache_prompt=False, lora={"a": 1.0}),
    )


def test_unknown_adapter_name_fails_before_anything_runs(files: dict[str, str]) -> None:
    llm = _llm(files)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'sql'.*'a', 'b'"):
        llm.invoke(PROMPT, lora={"sql": 1.0})
    with pytest.raises(ValueError, match="has none"):
        ChatLlamaCpp(model_path=files["model"], chat_template=RAW).invoke(PROMPT, lora="a")
    with pytest.raises(ValueError):
        _llm(files, lora={"a": float("nan")})
    assert llm.invoke(PROMPT, lora={"a": 1.0}).content


def test_speculation_with_an_adapter_on_the_target(files: dict[str, str]) -> None:
    llm = _llm(files, deterministic=False, max_tokens=24)
    prompt = "abcabcabcabcabc"
    ref = llm.invoke(prompt, cache_prompt=False, lora={"a": 1.0})
    got = llm.invoke(prompt, cache_prompt=False, lora={"a": 1.0}, speculative="ngram")
    assert_same_greedy(got, ref)
    assert got.response_metadata["speculative"]["drafted"] >= 0
    assert got.response_metadata["lora"] == {"a": 1.0}


def test_activated_lora_takes_effect_from_its_invocation(
    files: dict[str, str], tmp_path: Path
) -> None:
    """An aLoRA equals llama.cpp run by hand: the prompt before the invocation sequence
    decoded without the adapter, the rest and the answer with it."""
    invocation = [byte_token(ord("@")), byte_token(ord("@"))]
    path = str(write_tiny_lora(tmp_path / "alora.gguf", seed=3, invocation_tokens=invocation))
    llm = _llm(files, lora_adapters={"act": path, "a": files["a"]}, max_tokens=10)
    prompt = "the text before it " * 8 + "@@ and after"  # reuse: whole grid cells
    base = llm.invoke(prompt, lora={})
    got = llm.invoke(prompt, lora={"act": 1.0})
    assert got.response_metadata["lora"] == {"act": 1.0}
    # the part before the invocation was reused from the base model's request
    assert got.usage_metadata["input_token_details"]["cache_read"] > 0
    assert_identical(llm.invoke(prompt, cache_prompt=False, lora={"act": 1.0}), got)

    ref = llama_cpp.Llama(files["model"], n_ctx=256, verbose=False)
    adapter = llama_cpp.llama_adapter_lora_init(ref._model.model, path.encode())
    try:
        toks = ref.tokenize(prompt.encode(), add_bos=True, special=True)
        start = next(i for i in range(len(toks)) if toks[i : i + 2] == invocation)
        ref.eval(toks[:start])
        arr = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(adapter)
        assert (
            llama_cpp.llama_set_adapters_lora(ref._ctx.ctx, arr, 1, (ctypes.c_float * 1)(1.0)) == 0
        )
        ref.eval(toks[start:])
        want: list[int] = []
        while len(want) < 10:
            row = llama_cpp.llama_get_logits_ith(ref._ctx.ctx, -1)
            tok = int(np.argmax(np.ctypeslib.as_array(row, shape=(ref.n_vocab(),))))
            if tok == ref.token_eos():
                break
            want.append(tok)
            ref.eval([tok])
    finally:
        llama_cpp.llama_adapter_lora_free(adapter)
        ref.close()
    assert ids(got) == want
    assert ids(got) != ids(base)
    # without the invocation sequence the adapter stays off: the base model's answer
    off = llm.invoke("no invocation here", cache_prompt=False, lora={"act": 1.0})
    assert off.response_metadata["lora"] == {}
    assert_identical(off, llm.invoke("no invocation here", cache_prompt=False, lora={}))
    with pytest.raises(ValueError, match="cannot run with other adapters"):
        llm.invoke(prompt, lora={"act": 1.0, "a": 1.0})


def test_draft_model_with_an_adapter_on_the_target(files: dict[str, str], tmp_path: Path) -> None:
    """The draft model runs without the adapter; the target verifies with it."""
    draft = str(write_tiny_llama(tmp_path / "draft.gguf", seed=0))
    llm = _llm(files, deterministic=False, max_tokens=16, draft_model_path=draft)
    ref = llm.invoke(PROMPT, cache_prompt=False, lora={"a": 1.0}, speculative=None)
    got = llm.invoke(PROMPT, cache_prompt=False, lora={"a": 1.0}, speculative="draft")
    assert_same_greedy(got, ref)
    spec = got.response_metadata["speculative"]
    assert spec["type"] == "draft" and spec["drafted"] > 0
    assert got.response_metadata["lora"] == {"a": 1.0}


@pytest.mark.parametrize(
    "scale",
    [1e6, -1e6, 1e39, 10**400, 10**5000, math.inf, 100.5],
    ids=["1e6", "-1e6", "1e39", "10**400", "10**5000", "inf", "100.5"],
)
def test_scales_out_of_bounds_are_refused_naming_the_adapter(
    files: dict[str, str], scale: float
) -> None:
    """A scale past [-100, 100] would overflow the f16 KV cache (1e39 is inf as a C
    float, 10**400 no float at all): a ValueError naming the adapter and the bound."""
    llm = _llm(files)
    ref = llm.invoke(PROMPT, cache_prompt=False, lora={})
    with pytest.raises(
        ValueError, match=r"lora\['a'\] must be a finite LoRA scale within \[-100, 100\]"
    ):
        llm.invoke(PROMPT, lora={"a": scale})
    with pytest.raises(ValueError, match=r"lora_adapters\['a'\]\['scale'\].*\[-100, 100\]"):
        _llm(files, lora_adapters={"a": {"path": files["a"], "scale": scale}})
    assert llm.invoke(PROMPT, lora={"a": 100.0}).content  # the bound itself is allowed
    assert_identical(llm.invoke(PROMPT, cache_prompt=False, lora={}), ref)


def _lora_with(path: Path, *, alpha: float = 4.0, value: float | None = None) -> Path:
    """A tiny-llama adapter with ``alpha`` and, if given, ``value`` in one lora_b entry."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    b = np.full((64, 4), 0.01, dtype=np.float32)
    if value is not None:
        b[7, 2] = value
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.full((4, 64), 0.01, dtype=np.float32))
    with np.errstate(over="ignore"):  # 1e5 as F16: inf
        w.add_tensor("blk.0.attn_q.weight.lora_b", b.astype(np.float16) if value == 1e5 else b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"alpha": math.nan}, "adapter.lora.alpha is nan"),
        ({"alpha": math.inf}, "adapter.lora.alpha is inf"),
        ({"alpha": 3e38}, "adapter.lora.alpha is 3"),
        ({"alpha": -3e38}, "adapter.lora.alpha is -3"),
        ({"alpha": 401.0}, r"within \[-400, 400\]"),  # rank 4: alpha / rank at most 100
        ({"value": math.nan}, "'blk.0.attn_q.weight.lora_b' holds NaN or inf"),
        ({"value": -math.inf}, "'blk.0.attn_q.weight.lora_b' holds NaN or inf"),
        ({"value": 1e5}, "holds NaN or inf"),  # 1e5 as F16 is inf
        ({"value": 3e38}, "holds 3e\\+38, beyond 65504"),
    ],
)
def test_adapters_with_non_finite_or_huge_numbers_are_refused(
    files: dict[str, str], tmp_path: Path, kw: dict[str, float], words: str
) -> None:
    """llama.cpp takes any alpha and any tensor values; used once, they overflow the KV
    cache. Refused at load, naming the adapter and the file; the model keeps serving."""
    path = str(_lora_with(tmp_path / "bad.gguf", **kw))
    good = _llm(files)
    before = good.invoke(PROMPT, cache_prompt=False, lora={})
    with pytest.raises(ModelLoadError, match=words) as err:
        _llm(files, lora_adapters={"bad": path}).invoke(PROMPT)
    assert "LoRA adapter 'bad'" in str(err.value) and path in str(err.value)
    assert_identical(good.invoke(PROMPT, cache_prompt=False, lora={}), before)
    fine = str(_lora_with(tmp_path / "fine.gguf", alpha=8.0, value=0.5))
    assert _llm(files, lora_adapters={"fine": fine}).invoke(PROMPT, lora={"fine": 1.0}).content


@pytest.mark.parametrize("deterministic", [False, True])
def test_an_adapter_that_overflows_fails_only_its_own_request(
    files: dict[str, str], deterministic: bool
) -> None:
    """An in-bounds scale on a pathological adapter overflows the f16 KV cache; masked
    cells are still multiplied (0 * inf = NaN), by every sequence of the unified pool
    and by later requests of a stream. That request fails with NonFiniteOutputError;
    a request running beside it and the next one are unchanged."""
    llm = _llm(
        files,
        lora_adapters={"hot": files["hot"], "a": files["a"]},
        deterministic=deterministic,
        n_slots=1 if deterministic else 2,
        n_ctx=512,
        max_tokens=200,
    )
    same = assert_identical if deterministic else assert_same_greedy
    ref = llm.invoke(PROMPT, cache_prompt=False, lora={})

    def overflow() -> BaseException | None:
        try:
            llm.invoke("overflow", cache_prompt=False, max_tokens=4, lora={"hot": 100.0})
        except Exception as exc:  # noqa: BLE001 - asserted by the caller, after the others
            return exc
        return None

    failed = overflow()
    same(llm.invoke(PROMPT, cache_prompt=False, lora={}), ref)  # the next request
    assert isinstance(failed, NonFiniteOutputError), failed
    assert "LoRA adapters {'hot': 100.0}" in str(failed)
    assert llm.invoke(PROMPT, cache_prompt=False, lora={"hot": 1.0}).content
    if deterministic:
        return
    # beside a running request in the shared pool: it goes on, and its answer is its own
    chunks: list[Any] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def run() -> None:
        try:
            for chunk in llm.stream(PROMPT, cache_prompt=False, lora={}):
                chunks.append(chunk)
                started.set()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
            started.set()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    failed = overflow()
    seen = len(chunks)
    t.join(60)
    assert not errors, errors
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert_same_greedy(full, ref)
    assert isinstance(failed, NonFiniteOutputError), failed
    assert seen < len(chunks)  # the stream was still running when the other one failed
    same(llm.invoke(PROMPT, cache_prompt=False, lora={}), ref)


def test_adapter_paths_that_are_not_files_say_what_they_are(
    files: dict[str, str], tmp_path: Path
) -> None:
    """A directory, a FIFO or a device as an adapter path is named for what it is (not
    "file not found"), and a FIFO never blocks (in a subprocess with a timeout)."""
    fifo = tmp_path / "adapter.fifo"
    os.mkfifo(fifo)
    code = f"""
from langchain_llamacpp_local import ChatLlamaCpp
for path in ({files["dir"]!r}, {str(fifo)!r}, "/dev/zero"):
    llm = ChatLlamaCpp(model_path={files["model"]!r}, chat_template="x", lora_adapters={{"x": path}})
    try:
        llm.invoke("hi", max_tokens=1)
        print("LOADED", path)
    except Exception as exc:
        print(type(exc).__name__, exc)
"""
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout
    assert lines[0].startswith("ModelLoadError") and "is a directory" in lines[0], lines[0]
    for line in lines[1:]:
        assert line.startswith("ModelLoadError") and "not a regular file" in line, line
    assert "not found" not in proc.stdout


def test_an_image_read_under_an_overflowing_adapter_fails_alone(
    files: dict[str, str], tmp_path: Path
) -> None:
    """Image embeddings go through the adapted projections too: the same check applies."""
    import base64
    import io

    from PIL import Image

    from tests.gguf_models import write_tiny_mmproj

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, format="PNG")
    image = {"type": "image", "base64": base64.b64encode(buf.getvalue()).decode()}
    image["mime_type"] = "image/png"
    llm = _llm(
        files,
        mmproj_path=str(write_tiny_mmproj(tmp_path / "mmproj.gguf")),
        chat_template=ALL,  # text after the image
        lora_adapters={"hot": files["hot"]},
        deterministic=False,
        n_slots=2,
    )
    ref = llm.invoke(PROMPT, cache_prompt=False, lora={})
    ask = [HumanMessage(content=[{"type": "text", "text": "what is it?"}, image])]
    assert llm.invoke(ask, cache_prompt=False, lora={"hot": 1.0}).content
    with pytest.raises(NonFiniteOutputError):
        llm.invoke(ask, cache_prompt=False, lora={"hot": 100.0})
    assert_same_greedy(llm.invoke(PROMPT, cache_prompt=False, lora={}), ref)
