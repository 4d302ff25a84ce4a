"""Turn what a user calls a model into GGUF files: a path, a name in a models directory,
or a Hugging Face repo spec (``owner/repo[:QUANT]``, ``owner/repo/file.gguf``).

Rules, in order (the first that matches wins; a miss lists everything tried):

1. An existing path: a ``.gguf`` file, or a folder holding one model.
2. A name in ``models_dir``: ``<name>.gguf``, a multi-part ``<name>-00001-of-000NN.gguf``,
   or a folder ``<name>/`` holding the model (for ``name:tag``, also ``<name>-<tag>.gguf``
   and ``<name>/`` files tagged ``tag``, e.g. a quant). Case-insensitive.
3. A Hugging Face spec, fetched with ``huggingface_hub`` (its cache, token, offline
   mode and progress bars). The file is chosen the way llama.cpp's ``-hf`` chooses it
   (``common/download.cpp``): the requested quant, else Q4_K_M, else Q8_0, else the
   first model file; every part of a split GGUF is fetched; with the network off or
   unreachable, the files already in the cache are used.

A vision projector (mmproj) is picked automatically inside a model's own folder (and,
in a flat ``models_dir``, one whose name contains the model's); ``mmproj="auto"``
also looks beside a plain path and in the Hugging Face repo; ``mmproj="none"``
never loads one; any other value is the projector's path.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from langchain_llamacpp_local.errors import (
    ModelLoadError,
    ModelNotFoundError,
    RequestTimeoutError,
)

logger = logging.getLogger(__name__)

MMPROJ_AUTO = "auto"
MMPROJ_NONE = "none"
MODELS_DIR_ENV = "LLAMACPP_MODELS_DIR"
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


# --------------------------------------------------------------------------- file names

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


def _first_part(path: str) -> bool:
    info = split_info(path)
    return info is not None and (info.count <= 1 or info.index == 1)


def pick_model_file(files: list[str], tag: str = "") -> str | None:
    """The model file for ``tag`` among repo-relative ``files`` (llama.cpp's rule)."""
    for t in [tag] if tag else list(DEFAULT_TAGS):
        pattern = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
        for f in files:
            if is_model_file(f) and pattern.search(f) and _first_part(f):
                return f
    if not tag:
        for f in files:
            if is_model_file(f) and _first_part(f):
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


# --------------------------------------------------------------------------- specs


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


def models_dir_from(value: str | None) -> str | None:
    """The models directory: the given value, else ``LLAMACPP_MODELS_DIR``, else None."""
    raw = value if value else os.environ.get(MODELS_DIR_ENV)
    return str(Path(raw).expanduser()) if raw else None


# --------------------------------------------------------------------------- local lookup


#: Entries a model folder's two levels may hold before the lookup gives up: a folder
#: named by mistake (a home directory, a data set) is not listed to its end.
MAX_LISTED = 20_000
#: Folder listings remembered (each checked against its folders' modification times).
LISTINGS_KEPT = 64

#: the deadline (``time.monotonic()``) of the request resolving a model now, if any
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "model_resolution_deadline", default=None
)
_listings: OrderedDict[str, tuple[int, dict[str, int], list[str]]] = OrderedDict()
_listings_lock = threading.Lock()


def _check_deadline(spec: str = "") -> None:
    deadline = _deadline.get()
    if deadline is not None and time.monotonic() >= deadline:
        raise RequestTimeoutError(
            "looking up the model" + (f" {spec!r}" if spec else "") + " took longer than "
            "the request's timeout"
        )


@contextlib.contextmanager
def _within(deadline: float | None) -> Iterator[None]:
    token = _deadline.set(deadline)
    try:
        yield
    finally:
        _deadline.reset(token)


def _list_two_levels(folder: Path) -> tuple[dict[str, int], list[str]]:
    """``folder``'s subfolders (name -> modification time) and the ``.gguf`` files in it
    and in them, relative, sorted as paths: two levels, never deeper."""
    listed = 0

    def entries(path: str) -> list[os.DirEntry[str]]:
        nonlocal listed
        _check_deadline()
        out = []
        with os.scandir(path) as it:
            for entry in it:
                listed += 1
                if listed > MAX_LISTED:
                    raise OSError(
                        f"more than {MAX_LISTED} entries in its first two levels: name the "
                        "model file"
                    )
                out.append(entry)
        return out

    subfolders: dict[str, int] = {}
    files: list[str] = []
    for entry in entries(str(folder)):
        if entry.is_dir():
            subfolders[entry.name] = entry.stat().st_mtime_ns
            files += [
                f"{entry.name}/{inner.name}"
                for inner in entries(entry.path)
                if inner.name.endswith(".gguf") and inner.is_file()
            ]
        elif entry.name.endswith(".gguf") and entry.is_file():
            files.append(entry.name)
    return subfolders, sorted(files, key=lambda rel: rel.split("/"))


def _model_files_in(folder: Path) -> list[str]:
    """Relative paths of the ``.gguf`` files under ``folder`` (sorted, two levels deep).

    Listed once, then remembered: a later call stats the folder and its subfolders and
    lists again only when one of their modification times changed (a file added,
    removed or renamed in either level)."""
    key = str(folder)
    mtime = folder.stat().st_mtime_ns
    with _listings_lock:
        known = _listings.get(key)
    if known is not None and known[0] == mtime:
        try:
            fresh = all((folder / name).stat().st_mtime_ns == t for name, t in known[1].items())
        except OSError:
            fresh = False
        if fresh:
            with _listings_lock:
                if key in _listings:
                    _listings.move_to_end(key)
            return list(known[2])
    subfolders, files = _list_two_levels(folder)
    with _listings_lock:
        _listings[key] = (mtime, subfolders, files)
        _listings.move_to_end(key)
        while len(_listings) > LISTINGS_KEPT:
            _listings.popitem(last=False)
    return list(files)


def _from_folder(
    folder: Path, tag: str, mmproj: str | None, tried: list[str]
) -> ResolvedModel | None:
    files = _model_files_in(folder)
    chosen = pick_model_file(files, tag)
    if chosen is None:
        models = [f for f in files if is_model_file(f)]
        tried.append(
            f"folder {folder}: no model file"
            + (f" tagged {tag!r}" if tag else "")
            + (f" (it holds {', '.join(models)})" if models else "")
        )
        return None
    proj = None
    if mmproj != MMPROJ_NONE:
        found = pick_mmproj(files, chosen)
        proj = str(folder / found) if found else None
    return ResolvedModel(str(folder / chosen), proj, "models_dir", "")


def _untagged(filename: str) -> str:
    """``gemma-3-Q4_K_M-00001-of-00002.gguf`` -> ``gemma-3`` (lower case)."""
    info = split_info(filename)
    if info is None:
        return filename.lower()
    base = info.prefix
    if info.tag:
        base = base[: -len(info.tag) - 1]
    return base.lower()


def _beside(path: Path, only_named: bool) -> str | None:
    """An mmproj file next to ``path``; with ``only_named``, one naming the model."""
    base = _untagged(path.name)
    files = [
        p.name
        for p in sorted(path.parent.glob("*.gguf"))
        if "mmproj" in p.name and (not only_named or base in p.name.lower())
    ]
    found = pick_mmproj(files, path.name)
    return str(path.parent / found) if found else None


def _in_models_dir(
    name: str, models_dir: str, mmproj: str | None, tried: list[str]
) -> ResolvedModel | None:
    root = Path(models_dir)
    if not root.is_dir():
        tried.append(f"models_dir {models_dir}: not a directory")
        return None
    base, _, tag = name.rpartition(":") if ":" in name else (name, "", "")
    stems: dict[str, Path] = {}
    folders: dict[str, Path] = {}
    for p in root.iterdir():
        if p.is_dir():
            folders[p.name.lower()] = p
        elif p.is_file() and is_model_file(p.name) and _first_part(p.name):
            info = split_info(p.name)
            assert info is not None
            stems.setdefault(info.prefix.lower(), p)
    want_stems = [name] if not tag else [name, f"{base}-{tag}", f"{base}_{tag}", f"{base}.{tag}"]
    if name.lower().endswith(".gguf"):
        want_stems = [name[: -len(".gguf")]]
    for stem in want_stems:
        hit = stems.get(stem.lower())
        if hit is not None:
            proj = None if mmproj == MMPROJ_NONE else _beside(hit, only_named=True)
            return ResolvedModel(str(hit), proj, "models_dir", name)
    # ``name`` (or ``name:tag``) against ``name-<QUANT>.gguf`` files: choose the quant as -hf does
    tagged = sorted(p.name for p in stems.values() if _untagged(p.name) == base.lower())
    pick = pick_model_file(tagged, tag)
    if pick is not None:
        hit = root / pick
        proj = None if mmproj == MMPROJ_NONE else _beside(hit, only_named=True)
        return ResolvedModel(str(hit), proj, "models_dir", name)
    tried.append(
        f"models_dir {models_dir}: files "
        + ", ".join(f"{s}.gguf" for s in want_stems)
        + f", {base}-<QUANT>.gguf"
        + (f" (found {', '.join(tagged)})" if tagged else "")
    )
    for folder_name, folder_tag in ((name, ""), (base, tag)) if tag else ((name, ""),):
        folder = folders.get(folder_name.lower())
        if folder is None and "/" in folder_name and (root / folder_name).is_dir():
            folder = root / folder_name
        if folder is None:
            tried.append(f"models_dir {models_dir}: folder {folder_name}/")
            continue
        if folder_tag:
            exact = [
                f
                for f in _model_files_in(folder)
                if split_info(f) and Path(f).stem.lower() == folder_tag.lower()
            ]
            if exact:
                proj = None
                if mmproj != MMPROJ_NONE:
                    found = pick_mmproj(_model_files_in(folder), exact[0])
                    proj = str(folder / found) if found else None
                return ResolvedModel(str(folder / exact[0]), proj, "models_dir", name)
        found_model = _from_folder(folder, folder_tag, mmproj, tried)
        if found_model is not None:
            return ResolvedModel(
                found_model.model_path, found_model.mmproj_path, "models_dir", name
            )
    return None


def _fs_lookup(
    look: Callable[[], ResolvedModel | None], where: str, spec: str, tried: list[str]
) -> ResolvedModel | None:
    """A file-system lookup whose ``OSError`` (a name too long for the file system, a
    folder without permission) becomes a line of the not-found report."""
    try:
        return look()
    except TimeoutError:
        raise
    except OSError as exc:
        tried.append(f"{where}: cannot look it up ({exc.strerror or exc})")
        return None


def _from_path(spec: str, mmproj: str | None, tried: list[str]) -> ResolvedModel | None:
    p = Path(spec).expanduser()
    if p.is_file() or (p.exists() and not p.is_dir()):
        proj = _beside(p, only_named=False) if mmproj == MMPROJ_AUTO else None
        return ResolvedModel(str(p), proj, "path", spec)
    if p.is_dir():
        if p.absolute() == Path(p.absolute().anchor):
            tried.append(f"path {p}: a file system root is not a model folder")
            return None
        found = _from_folder(p, "", MMPROJ_NONE if mmproj != MMPROJ_AUTO else MMPROJ_AUTO, tried)
        if found is not None:
            return ResolvedModel(found.model_path, found.mmproj_path, "path", spec)
        return None
    tried.append(f"path {p}: no such file")
    return None


# --------------------------------------------------------------------------- Hugging Face


def _hf() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401 - a submodule, read at call time
    except ImportError:  # pragma: no cover - depends on the environment
        raise ModelLoadError(
            "Hugging Face model specs need huggingface_hub: "
            "pip install 'langchain-llamacpp-local[hf]'"
        ) from None
    return huggingface_hub


def _hf_cached_files(hf: Any, repo_id: str, cache_dir: str | None) -> list[str]:
    """Files of ``repo_id``'s cached snapshot (its ``main`` ref), repo-relative."""
    try:
        folder = Path(hf.snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except Exception:
        return []
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


_hf_memo: dict[tuple[Any, ...], ResolvedModel] = {}


def _resolve_hf_cached(
    spec: str,
    hs: HfSpec,
    mmproj: str | None,
    cache_dir: str | None,
    offline: bool | None,
    tried: list[str],
) -> ResolvedModel | None:
    """:func:`_resolve_hf`, remembered per process: a per-call ``model=`` must not list
    the repo over the network on every call."""
    if offline is None:
        offline = bool(_hf().constants.HF_HUB_OFFLINE)
    key = (spec, mmproj, cache_dir, offline, _hf().constants.HF_HUB_CACHE)
    hit = _hf_memo.get(key)
    if hit is not None and all(Path(p).exists() for p in (hit.model_path, hit.mmproj_path) if p):
        return hit
    found = _resolve_hf(spec, hs, mmproj, cache_dir, offline, tried)
    if found is not None:
        if len(_hf_memo) > 256:
            _hf_memo.clear()
        _hf_memo[key] = found
    return found


#: Seconds the reachability check of the hub waits for a connection.
HUB_PROBE_TIMEOUT_S = 3.0
#: Seconds an unreachable (or reachable) hub is remembered before it is checked again.
HUB_PROBE_TTL_S = 60.0
_hub_lock = threading.Lock()
_hub_probe: dict[str, tuple[float, str | None]] = {}
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def hub_unreachable(endpoint: str) -> str | None:
    """Why the hub at ``endpoint`` cannot be reached (None if a TCP connection opens).

    Checked once per :data:`HUB_PROBE_TTL_S` with a :data:`HUB_PROBE_TIMEOUT_S`
    connection, so an offline machine fails in seconds instead of sitting through
    ``huggingface_hub``'s retries on every call. With a proxy configured the check is
    left to ``huggingface_hub``.
    """
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return None
    now = time.monotonic()
    with _hub_lock:
        hit = _hub_probe.get(endpoint)
        if hit is not None and now < hit[0]:
            return hit[1]
    url = urlparse(endpoint)
    host = url.hostname or endpoint
    port = url.port or (80 if url.scheme == "http" else 443)
    result: list[str | None] = []

    def probe() -> None:  # on a thread: name resolution has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            result.append(None)
        except OSError as exc:
            result.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=probe, name="llamacpp-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S)
    error = result[0] if result else f"no connection within {HUB_PROBE_TIMEOUT_S:g} s"
    with _hub_lock:
        _hub_probe[endpoint] = (time.monotonic() + HUB_PROBE_TTL_S, error)
    return error


def _resolve_hf(
    spec: str,
    hs: HfSpec,
    mmproj: str | None,
    cache_dir: str | None,
    offline: bool | None,
    tried: list[str],
) -> ResolvedModel | None:
    """The local cache first (no network for a cached model), then the hub if it is
    allowed and reachable."""
    hf = _hf()
    if offline is None:
        offline = bool(hf.constants.HF_HUB_OFFLINE)
    cached_files = _hf_cached_files(hf, hs.repo_id, cache_dir)
    if cached_files:
        found = _pick_and_fetch(hf, spec, hs, mmproj, cache_dir, cached_files, True, tried)
        if found is not None:
            return found
    else:
        where = cache_dir or hf.constants.HF_HUB_CACHE
        tried.append(f"Hugging Face cache {where}: no snapshot of {hs.repo_id}")
    if offline:
        tried.append("Hugging Face hub: not asked (offline: HF_HUB_OFFLINE is set)")
        return None
    endpoint = str(hf.constants.ENDPOINT)
    error = hub_unreachable(endpoint)
    if error is not None:
        tried.append(
            f"Hugging Face hub {endpoint}: unreachable ({error}); set HF_HUB_OFFLINE=1 to use "
            "only the cache"
        )
        return None
    try:
        files = list(hf.list_repo_files(hs.repo_id))
    except Exception as exc:  # gated, missing, network trouble
        tried.append(
            f"Hugging Face {hs.repo_id}: could not list the repo ({type(exc).__name__}: {exc})"
        )
        return None
    return _pick_and_fetch(hf, spec, hs, mmproj, cache_dir, files, False, tried)


def _pick_and_fetch(
    hf: Any,
    spec: str,
    hs: HfSpec,
    mmproj: str | None,
    cache_dir: str | None,
    files: list[str],
    local_only: bool,
    tried: list[str],
) -> ResolvedModel | None:
    where = "cache of " if local_only else ""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if hs.filename:
        primary = hs.filename if hs.filename in files else None
        if primary is None:
            tried.append(
                f"Hugging Face {where}{hs.repo_id}: no file {hs.filename} "
                f"(GGUF files: {', '.join(ggufs) or 'none'})"
            )
            return None
    else:
        primary = pick_model_file(files, hs.tag)
        if primary is None:
            what = f"tagged {hs.tag!r}" if hs.tag else "at all"
            tried.append(
                f"Hugging Face {where}{hs.repo_id}: no GGUF model file {what} "
                f"(GGUF files: {', '.join(ggufs) or 'none'})"
            )
            return None
    parts = split_parts(files, primary)

    def fetch(name: str) -> str:
        return str(
            hf.hf_hub_download(hs.repo_id, name, cache_dir=cache_dir, local_files_only=local_only)
        )

    try:
        paths = [fetch(f) for f in parts]
        proj_name = pick_mmproj(files, primary) if mmproj == MMPROJ_AUTO else None
        proj = fetch(proj_name) if proj_name else None
    except Exception as exc:
        tried.append(
            f"Hugging Face {where}{hs.repo_id}: could not fetch {primary} "
            f"({type(exc).__name__}: {exc})"
        )
        return None
    return ResolvedModel(paths[0], proj, "huggingface", spec)


# --------------------------------------------------------------------------- entry points


def resolve_model(
    spec: str,
    *,
    models_dir: str | None = None,
    mmproj: str | None = None,
    hf_cache_dir: str | None = None,
    offline: bool | None = None,
    deadline: float | None = None,
) -> ResolvedModel:
    """The files for ``spec`` (see the module docstring for the rules).

    ``mmproj``: None (automatic inside the model's folder), ``"auto"``, ``"none"`` or a
    path. ``offline`` None follows ``HF_HUB_OFFLINE``. ``deadline`` (``time.monotonic()``,
    a request's): folder listings stop past it with :class:`RequestTimeoutError`.
    Raises :class:`ModelNotFoundError`.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model must be a non-empty string, not {spec!r}")
    with _within(deadline):
        return _resolve_model(spec, models_dir, mmproj, hf_cache_dir, offline)


def _resolve_model(
    spec: str,
    models_dir: str | None,
    mmproj: str | None,
    hf_cache_dir: str | None,
    offline: bool | None,
) -> ResolvedModel:
    _check_deadline(spec)
    tried: list[str] = []
    explicit_proj = mmproj not in (None, MMPROJ_AUTO, MMPROJ_NONE)
    mode = None if explicit_proj else mmproj
    found = _fs_lookup(lambda: _from_path(spec, mode, tried), "path", spec, tried)
    if found is None:
        mdir = models_dir_from(models_dir)
        if mdir is None:
            tried.append(f"models_dir: not set (pass models_dir= or set {MODELS_DIR_ENV})")
        else:
            found = _fs_lookup(
                lambda: _in_models_dir(spec, mdir, mode, tried), f"models_dir {mdir}", spec, tried
            )
    if found is None:
        hs = parse_hf_spec(spec)
        if hs is None:
            tried.append(
                "Hugging Face: not a repo spec (owner/repo[:QUANT] or owner/repo/file.gguf)"
            )
        else:
            found = _resolve_hf_cached(spec, hs, mode, hf_cache_dir, offline, tried)
    if found is None:
        raise ModelNotFoundError(spec, tried)
    if explicit_proj:
        assert mmproj is not None
        found = ResolvedModel(found.model_path, str(Path(mmproj).expanduser()), found.source, spec)
    logger.debug(
        "model %r -> %s (mmproj %s, from %s)",
        spec,
        found.model_path,
        found.mmproj_path,
        found.source,
    )
    return found


def resolve_path(path: str, mmproj: str | None = None) -> ResolvedModel:
    """``model_path=``: the file as given (a missing one fails at load with its own
    message); ``mmproj`` as in :func:`resolve_model`."""
    p = Path(path).expanduser()
    if mmproj == MMPROJ_AUTO:
        proj = _beside(p, only_named=False) if p.parent.is_dir() else None
    elif mmproj in (None, MMPROJ_NONE):
        proj = None
    else:
        proj = str(Path(mmproj).expanduser())
    return ResolvedModel(str(p), proj, "path", path)


def list_models(models_dir: str | None = None, hf_cache_dir: str | None = None) -> list[ModelEntry]:
    """The models in ``models_dir`` (or ``LLAMACPP_MODELS_DIR``) and the Hugging Face cache."""
    out: list[ModelEntry] = []
    mdir = models_dir_from(models_dir)
    if mdir and Path(mdir).is_dir():
        root = Path(mdir)
        for p in sorted(root.iterdir()):
            if p.is_file() and is_model_file(p.name) and _first_part(p.name):
                info = split_info(p.name)
                assert info is not None
                out.append(
                    ModelEntry(info.prefix, str(p), _size(p), "models_dir", _beside(p, True))
                )
            elif p.is_dir():
                files = _model_files_in(p)
                models = [f for f in files if is_model_file(f) and _first_part(f)]
                for f in models:
                    name = p.name if len(models) == 1 else f"{p.name}:{_tag_or_stem(f)}"
                    proj = pick_mmproj(files, f)
                    out.append(
                        ModelEntry(
                            name,
                            str(p / f),
                            _size(p / f),
                            "models_dir",
                            str(p / proj) if proj else None,
                        )
                    )
    out.extend(_list_hf_cache(hf_cache_dir))
    return out


def _tag_or_stem(f: str) -> str:
    info = split_info(f)
    return info.tag if info and info.tag else Path(f).stem


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _list_hf_cache(cache_dir: str | None) -> list[ModelEntry]:
    try:
        import huggingface_hub as hf
        import huggingface_hub.constants
    except ImportError:  # pragma: no cover
        return []
    try:
        # scan_cache_dir's own default is bound when huggingface_hub is imported: pass
        # the cache in force now (HF_HUB_CACHE may have been set since)
        info = hf.scan_cache_dir(cache_dir or huggingface_hub.constants.HF_HUB_CACHE)
    except Exception:  # no cache yet
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        files = sorted(f.file_path.relative_to(rev.snapshot_path).as_posix() for f in rev.files)
        for f in files:
            info = split_info(f)
            if info is None or not (is_model_file(f) and _first_part(f)):
                continue
            name = f"{repo.repo_id}:{info.tag}" if info.tag else f"{repo.repo_id}/{f}"
            proj = pick_mmproj(files, f)
            out.append(
                ModelEntry(
                    name,
                    str(rev.snapshot_path / f),
                    _size(rev.snapshot_path / f),
                    "huggingface",
                    str(rev.snapshot_path / proj) if proj else None,
                )
            )
    return out


__all__ = [
    "MMPROJ_AUTO",
    "MMPROJ_NONE",
    "MODELS_DIR_ENV",
    "HfSpec",
    "ModelEntry",
    "ModelNotFoundError",
    "ResolvedModel",
    "SplitInfo",
    "is_model_file",
    "list_models",
    "models_dir_from",
    "parse_hf_spec",
    "pick_mmproj",
    "pick_model_file",
    "resolve_model",
    "resolve_path",
    "split_info",
    "split_parts",
]
