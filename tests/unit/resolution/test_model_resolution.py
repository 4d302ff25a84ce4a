"""Model names to files: paths, ``models_dir`` layouts and Hugging Face specs (offline).

No model is loaded here: resolution only looks at names, so the files are empty
placeholders. The Hugging Face tests build a real hub cache layout
(``models--owner--repo/{blobs,refs,snapshots}``) and resolve through
``huggingface_hub`` itself with the network switched off.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from langchain_llamacpp_local import ChatLlamaCpp, ModelLoadError
from langchain_llamacpp_local.resolution.model_resolution import (
    ModelNotFoundError,
    is_model_file,
    list_models,
    parse_hf_spec,
    pick_mmproj,
    pick_model_file,
    resolve_model,
    split_info,
    split_parts,
)


def _touch(path: Path, data: bytes = b"GGUF") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------- pure rules


def test_split_info_and_model_files() -> None:
    info = split_info("sub/Qwen3-4B-Q4_K_M-00002-of-00003.gguf")
    assert info is not None
    assert (info.prefix, info.tag, info.index, info.count) == (
        "sub/Qwen3-4B-Q4_K_M",
        "Q4_K_M",
        2,
        3,
    )
    assert split_info("model.bin") is None
    assert split_info("gemma.q8_0.gguf").tag == "Q8_0"  # type: ignore[union-attr]
    assert is_model_file("a/Model-F16.gguf")
    assert not is_model_file("mmproj-Model-F16.gguf")
    assert not is_model_file("Model.imatrix.gguf")
    assert not is_model_file("README.md")


def test_pick_model_file_follows_llama_cpp() -> None:
    files = ["README.md", "m-Q2_K.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "mmproj-m-f16.gguf"]
    assert pick_model_file(files) == "m-Q4_K_M.gguf"  # the default quant
    assert pick_model_file(files, "q2_k") == "m-Q2_K.gguf"  # case-insensitive
    assert pick_model_file(["m-Q2_K.gguf", "m-Q8_0.gguf"]) == "m-Q8_0.gguf"  # second default
    assert pick_model_file(["m-Q2_K.gguf", "m-IQ3.gguf"]) == "m-Q2_K.gguf"  # first model file
    assert pick_model_file(files, "Q5_K_M") is None  # a named quant never falls back
    split = ["m-Q4_K_M-00002-of-00002.gguf", "m-Q4_K_M-00001-of-00002.gguf"]
    assert pick_model_file(split) == "m-Q4_K_M-00001-of-00002.gguf"
    assert split_parts(split + ["m-Q8_0.gguf"], "m-Q4_K_M-00001-of-00002.gguf") == sorted(split)
    assert split_parts(files, "m-Q8_0.gguf") == ["m-Q8_0.gguf"]


def test_pick_mmproj_prefers_the_models_folder_and_its_precision() -> None:
    files = ["mmproj-F16.gguf", "mmproj-Q8_0.gguf", "big/mmproj-F32.gguf", "big/m-Q8_0.gguf"]
    assert pick_mmproj(files, "m-Q8_0.gguf") == "mmproj-Q8_0.gguf"  # closest bits
    assert pick_mmproj(files, "m-F16.gguf") == "mmproj-F16.gguf"
    assert pick_mmproj(files, "big/m-Q8_0.gguf") == "big/mmproj-F32.gguf"  # deepest folder
    assert pick_mmproj(["other/mmproj.gguf"], "m.gguf") is None  # not beside the model


@pytest.mark.parametrize(
    ("spec", "repo", "tag", "file"),
    [
        ("unsloth/Qwen3-4B-GGUF", "unsloth/Qwen3-4B-GGUF", "", ""),
        ("unsloth/Qwen3-4B-GGUF:Q4_K_M", "unsloth/Qwen3-4B-GGUF", "Q4_K_M", ""),
        ("hf.co/owner/repo:q8_0", "owner/repo", "q8_0", ""),
        ("owner/repo/sub/file-Q4_0.gguf", "owner/repo", "", "sub/file-Q4_0.gguf"),
    ],
)
def test_parse_hf_spec(spec: str, repo: str, tag: str, file: str) -> None:
    hs = parse_hf_spec(spec)
    assert hs is not None and (hs.repo_id, hs.tag, hs.filename) == (repo, tag, file)


@pytest.mark.parametrize("spec", ["qwen3:4b", "model.gguf", "/abs/path.gguf", "a/b/c", "a/b:"])
def test_not_hf_specs(spec: str) -> None:
    assert parse_hf_spec(spec) is None


# --------------------------------------------------------------------------- local files


def test_existing_path_wins_and_mmproj_modes(tmp_path: Path) -> None:
    model = _touch(tmp_path / "m-Q4_K_M.gguf")
    proj = _touch(tmp_path / "mmproj-m-f16.gguf")
    r = resolve_model(str(model))
    assert (r.model_path, r.mmproj_path, r.source) == (str(model), None, "path")
    assert resolve_model(str(model), mmproj="auto").mmproj_path == str(proj)
    assert resolve_model(str(model), mmproj="none").mmproj_path is None
    assert resolve_model(str(model), mmproj="/x/p.gguf").mmproj_path == "/x/p.gguf"
    # a folder path holding one model
    assert resolve_model(str(tmp_path)).model_path == str(model)


def test_models_dir_layouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "models"
    flat = _touch(d / "llama3.gguf")
    q4 = _touch(d / "Phi-4-Q4_K_M.gguf")
    q8 = _touch(d / "Phi-4-Q8_0.gguf")
    named_proj = _touch(d / "mmproj-Phi-4-F16.gguf")
    folder_model = _touch(d / "gemma3" / "gemma-3-4b-it-Q4_K_M.gguf")
    folder_q8 = _touch(d / "gemma3" / "gemma-3-4b-it-Q8_0.gguf")
    folder_proj = _touch(d / "gemma3" / "mmproj-F16.gguf")
    tag_file = _touch(d / "qwen3" / "4b.gguf")
    split1 = _touch(d / "big-00001-of-00002.gguf")
    _touch(d / "big-00002-of-00002.gguf")

    def res(name: str, **kw: object) -> tuple[str, str | None]:
        r = resolve_model(name, models_dir=str(d), **kw)  # type: ignore[arg-type]
        assert r.source == "models_dir"
        return r.model_path, r.mmproj_path

    assert res("llama3") == (str(flat), None)
    assert res("LLAMA3") == (str(flat), None)  # case-insensitive
    assert res("llama3.gguf") == (str(flat), None)
    assert res("Phi-4") == (str(q4), str(named_proj))  # default quant; its named projector
    assert res("phi-4:Q8_0") == (str(q8), str(named_proj))
    assert res("Phi-4", mmproj="none") == (str(q4), None)
    assert res("gemma3") == (str(folder_model), str(folder_proj))  # the folder's projector
    assert res("gemma3:q8_0") == (str(folder_q8), str(folder_proj))
    assert res("qwen3:4b") == (str(tag_file), None)  # Ollama-style name/tag
    assert res("big") == (str(split1), None)  # a split GGUF by its name
    # the environment variable stands in for the field
    monkeypatch.setenv("LLAMACPP_MODELS_DIR", str(d))
    assert resolve_model("llama3").model_path == str(flat)


def test_a_miss_lists_everything_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMACPP_MODELS_DIR", raising=False)
    _touch(tmp_path / "Phi-4-Q8_0.gguf")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("phi-4:Q2_K", models_dir=str(tmp_path))
    msg = str(err.value)
    assert "phi-4:Q2_K" in msg and "path" in msg and str(tmp_path) in msg
    assert "phi-4-Q2_K.gguf" in msg and "found Phi-4-Q8_0.gguf" in msg
    assert "not a repo spec" in msg
    assert isinstance(err.value, ModelLoadError)
    with pytest.raises(ModelNotFoundError, match="models_dir: not set"):
        resolve_model("nothing-here")
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model("  ")


# --------------------------------------------------------------------------- Hugging Face


def _hub_cache(root: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """Write ``files`` as huggingface_hub caches them: blobs, a snapshot of symlinks, refs/main."""
    repo_dir = root / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo_dir / "snapshots" / commit
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data + name.encode()).hexdigest()
        _touch(blob, data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * (name.count("/") + 2) + "blobs") / blob.name)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    constants = pytest.importorskip("huggingface_hub.constants")
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("LLAMACPP_MODELS_DIR", raising=False)
    snap = _hub_cache(
        cache,
        "acme/Tiny-GGUF",
        {
            "README.md": b"# tiny",
            "Tiny-Q8_0.gguf": b"GGUF q8",
            "Tiny-Q4_K_M.gguf": b"GGUF q4",
            "mmproj-Tiny-F16.gguf": b"GGUF proj",
            "split/Tiny-F16-00001-of-00002.gguf": b"GGUF part1",
            "split/Tiny-F16-00002-of-00002.gguf": b"GGUF part2",
        },
    )
    return cache, snap


def test_hf_repo_resolves_offline_from_the_cache(hub: tuple[Path, Path]) -> None:
    cache, snap = hub
    r = resolve_model("acme/Tiny-GGUF")
    assert r.source == "huggingface"
    assert Path(r.model_path) == snap / "Tiny-Q4_K_M.gguf"  # Q4_K_M by default
    assert Path(r.model_path).read_bytes() == b"GGUF q4"
    assert r.mmproj_path is None  # only with mmproj="auto"
    r = resolve_model("acme/Tiny-GGUF:q8_0", mmproj="auto")
    assert Path(r.model_path) == snap / "Tiny-Q8_0.gguf"
    assert Path(r.mmproj_path or "") == snap / "mmproj-Tiny-F16.gguf"
    r = resolve_model("hf.co/acme/Tiny-GGUF/Tiny-Q8_0.gguf", hf_cache_dir=str(cache))
    assert Path(r.model_path) == snap / "Tiny-Q8_0.gguf"
    # a split GGUF: the first part, with every part beside it
    r = resolve_model("acme/Tiny-GGUF:F16")
    assert Path(r.model_path) == snap / "split" / "Tiny-F16-00001-of-00002.gguf"
    assert (snap / "split" / "Tiny-F16-00002-of-00002.gguf").read_bytes() == b"GGUF part2"


def test_hf_misses_are_clear(hub: tuple[Path, Path]) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("acme/Tiny-GGUF:Q2_K")
    assert "no GGUF model file tagged 'Q2_K'" in str(err.value)
    assert "Tiny-Q8_0.gguf" in str(err.value)  # what the repo does hold
    with pytest.raises(ModelNotFoundError, match="no snapshot of acme/Missing"):
        resolve_model("acme/Missing")
    with pytest.raises(ModelNotFoundError, match="no file nope.gguf"):
        resolve_model("acme/Tiny-GGUF/nope.gguf")


def test_list_models_covers_models_dir_and_hf_cache(hub: tuple[Path, Path], tmp_path: Path) -> None:
    d = tmp_path / "models"
    _touch(d / "llama3.gguf")
    _touch(d / "gemma3" / "g-Q4_K_M.gguf")
    _touch(d / "gemma3" / "mmproj-F16.gguf")
    _touch(d / "two" / "x-Q4_0.gguf")
    _touch(d / "two" / "x-Q8_0.gguf")
    entries = {e.name: e for e in list_models(str(d))}
    assert {"llama3", "gemma3", "two:Q4_0", "two:Q8_0"} <= set(entries)
    assert entries["gemma3"].mmproj_path == str(d / "gemma3" / "mmproj-F16.gguf")
    assert {"acme/Tiny-GGUF:Q4_K_M", "acme/Tiny-GGUF:Q8_0", "acme/Tiny-GGUF:F16"} <= set(entries)
    assert "mmproj" not in " ".join(entries)
    # every listed name resolves to the listed file
    for e in entries.values():
        assert resolve_model(e.name, models_dir=str(d)).model_path == e.path
    # the same through the chat model (class and instance)
    assert {e.name for e in ChatLlamaCpp.list_models(models_dir=str(d))} == set(entries)
    llm = ChatLlamaCpp(model="llama3", models_dir=str(d))
    assert {e.name for e in llm.list_models()} == set(entries)


def test_constructor_checks_model_selection(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model= .* or model_path="):
        ChatLlamaCpp()
    with pytest.raises(ValueError, match="not both"):
        ChatLlamaCpp(model="a", model_path="b.gguf")
    with pytest.raises(ValueError, match="max_loaded_models"):
        ChatLlamaCpp(model="a", max_loaded_models=0)
    assert ChatLlamaCpp(model="a", keep_alive="5m").keep_alive == 300
    assert ChatLlamaCpp(model="a", keep_alive="-1").keep_alive == -1
    assert ChatLlamaCpp(model="a", keep_alive=0).keep_alive == 0
    with pytest.raises(ValueError, match="keep_alive"):
        ChatLlamaCpp(model="a", keep_alive="soon")
    # construction resolves nothing over the network and loads nothing
    llm = ChatLlamaCpp(model="acme/not-cached:Q4_K_M")
    assert llm.profile is not None


def test_without_hf_hub_offline_a_cached_model_needs_no_network_and_a_miss_is_fast(
    hub: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF_HUB_OFFLINE unset on a machine that cannot reach the hub: a cached repo resolves
    at once, an uncached one fails in seconds naming the unreachable hub, then at once."""
    import socket
    import time

    from langchain_llamacpp_local.resolution import hub as hf_hub

    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with socket.socket() as s:  # a local port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    for var in hf_hub._PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    hf_hub._hf_memo.clear()
    probes: list[object] = []  # connections opened to the hub (counted, not timed)
    connect = socket.create_connection

    def counting(address: tuple[str, int], *args: object, **kwargs: object) -> socket.socket:
        if tuple(address) == ("127.0.0.1", port):
            probes.append(address)
        return connect(address, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hf_hub.socket, "create_connection", counting)
    _cache, snap = hub
    start = time.monotonic()
    assert Path(resolve_model("acme/Tiny-GGUF").model_path) == snap / "Tiny-Q4_K_M.gguf"
    assert time.monotonic() - start < 1.0
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(ModelNotFoundError, match=rf"127\.0\.0\.1:{port}: unreachable"):
            resolve_model("sub/m")
        assert time.monotonic() - start < hf_hub.HUB_PROBE_TIMEOUT_S + 1.0
    assert len(probes) == 1  # the second failure was remembered
    with pytest.raises(ModelNotFoundError, match="unreachable"):
        resolve_model("other/repo")
    assert len(probes) == 1  # remembered for every repo: not probed again
