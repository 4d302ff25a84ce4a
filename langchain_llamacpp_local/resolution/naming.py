"""What model files are called: GGUF split names, quant tags, sidecars, Hugging Face
specs, and the records a lookup returns. Pure functions of names: no file system.

The choices follow llama.cpp's ``-hf`` (``common/download.cpp``): the requested quant,
else Q4_K_M, else Q8_0, else the first model file; a projector in the model's folder or
one above it, the quantization closest to the model's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

MMPROJ_AUTO = "auto"
MMPROJ_NONE = "none"
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")  # llama.cpp's choice when no quant is named

Source = Literal["path", "models_dir", "huggingface"]


@dataclass(frozen=True)
class ResolvedModel:
    """The files behind a model name."""

    model_path: str
    mmproj_path: str | None
    source: Source
    spec: str


@dataclass(frozen=True)
class ModelEntry:
    """One model :func:`list_models` found; pass ``name`` as ``model=``."""

    name: str
    path: str
    size_bytes: int
    source: Source
    mmproj_path: str | None = None


_RE_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_RE_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
_SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


@dataclass(frozen=True)
class SplitInfo:
    """``dir/name-Q4_K_M-00001-of-00003.gguf`` -> prefix ``dir/name-Q4_K_M``, tag, 1, 3."""

    prefix: str
    tag: str
    index: int
    count: int


def split_info(path: str) -> SplitInfo | None:
    """Parse a GGUF file name (llama.cpp's ``get_gguf_split_info``); None if not ``.gguf``."""
    if not path.lower().endswith(".gguf"):
        return None
    prefix = path[: -len(".gguf")]
    index = count = 1
    m = _RE_SPLIT.match(prefix)
    if m:
        prefix, index, count = m.group(1), int(m.group(2)), int(m.group(3))
    t = _RE_TAG.search(prefix)
    return SplitInfo(prefix, t.group(1).upper() if t else "", index, count)


def is_model_file(path: str) -> bool:
    """A ``.gguf`` that is a model, not a projector, imatrix or draft sidecar."""
    name = path.rsplit("/", 1)[-1]
    return name.lower().endswith(".gguf") and not any(s in name for s in _SIDECARS)


def _quant_bits(path: str) -> int:
    info = split_info(path)
    if info is None:
        return 0
    m = re.search(r"[0-9]+", info.tag)
    return int(m.group(0)) if m else 0


def first_part(path: str) -> bool:
    """Whether ``path`` is a whole GGUF or the first part of a split one."""
    info = split_info(path)
    return info is not None and (info.count <= 1 or info.index == 1)


def pick_model_file(files: list[str], tag: str = "") -> str | None:
    """The model file for ``tag`` among repo-relative ``files`` (llama.cpp's rule)."""
    for t in [tag] if tag else list(DEFAULT_TAGS):
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        for f in files:
            if is_model_file(f) and pattern.search(f) and first_part(f):
                return f
    if not tag:
        for f in files:
            if is_model_file(f) and first_part(f):
                return f
    return None


def split_parts(files: list[str], primary: str) -> list[str]:
    """Every part of ``primary``'s split GGUF, in order (just ``[primary]`` if not split)."""
    info = split_info(primary)
    if info is None or info.count <= 1:
        return [primary]
    parts = []
    for f in files:
        fi = split_info(f)
        if fi is not None and fi.count == info.count and fi.prefix == info.prefix:
            parts.append((fi.index, f))
    return [f for _, f in sorted(parts)]


def pick_mmproj(files: list[str], model: str) -> str | None:
    """The projector for ``model`` among ``files`` (llama.cpp's ``find_best_sibling``):
    deepest shared folder first, then the quantization closest to the model's."""
    model_dir = model.split("/")[:-1]
    model_bits = _quant_bits(model)
    best: tuple[int, int] | None = None
    best_file = None
    for f in files:
        if not f.lower().endswith(".gguf") or "mmproj" not in f:
            continue
        sib_dir = f.split("/")[:-1]
        depth = 0
        while depth < min(len(model_dir), len(sib_dir)) and model_dir[depth] == sib_dir[depth]:
            depth += 1
        if depth != len(sib_dir):  # must sit in the model's folder or one above it
            continue
        score = (depth, -abs(_quant_bits(f) - model_bits))
        if best is None or score > best:
            best, best_file = score, f
    return best_file


@dataclass(frozen=True)
class HfSpec:
    """``owner/repo[:tag]`` or ``owner/repo/path/file.gguf``."""

    repo_id: str
    tag: str = ""
    filename: str = ""


_RE_HF = re.compile(
    r"^(?:hf://|hf\.co/|huggingface\.co/|https://huggingface\.co/)?"
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
    r"(?::(?P<tag>[\w.-]+)|/(?P<file>[^:]+\.gguf))?$"
)


def parse_hf_spec(spec: str) -> HfSpec | None:
    """The Hugging Face reading of ``spec``, or None if it cannot be one."""
    m = _RE_HF.match(spec.strip())
    if m is None:
        return None
    return HfSpec(m.group("repo"), m.group("tag") or "", m.group("file") or "")


def untagged(filename: str) -> str:
    """``gemma-3-Q4_K_M-00001-of-00002.gguf`` -> ``gemma-3`` (lower case)."""
    info = split_info(filename)
    if info is None:
        return filename.lower()
    base = info.prefix
    if info.tag:
        base = base[: -len(info.tag) - 1]
    return base.lower()
