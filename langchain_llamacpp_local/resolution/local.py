"""Models on the file system: a path, or a name in a models directory.

A name is looked up as ``<name>.gguf``, a multi-part ``<name>-00001-of-000NN.gguf``,
``<name>-<QUANT>.gguf`` or a folder ``<name>/`` holding the model, case-insensitively.
A folder's two levels are listed once and remembered while their modification times
hold; a listing stops at the request's deadline and at :data:`MAX_LISTED` entries.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

from langchain_llamacpp_local.errors import RequestTimeoutError
from langchain_llamacpp_local.resolution.naming import (
    MMPROJ_AUTO,
    MMPROJ_NONE,
    ResolvedModel,
    first_part,
    is_model_file,
    pick_mmproj,
    pick_model_file,
    split_info,
    untagged,
)

MODELS_DIR_ENV = "LLAMACPP_MODELS_DIR"


def models_dir_from(value: str | None) -> str | None:
    """The models directory: the given value, else ``LLAMACPP_MODELS_DIR``, else None."""
    raw = value if value else os.environ.get(MODELS_DIR_ENV)
    return str(Path(raw).expanduser()) if raw else None


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


def check_deadline(spec: str = "") -> None:
    """Raise :class:`RequestTimeoutError` past the deadline of the lookup running now."""
    deadline = _deadline.get()
    if deadline is not None and time.monotonic() >= deadline:
        raise RequestTimeoutError(
            "looking up the model" + (f" {spec!r}" if spec else "") + " took longer than "
            "the request's timeout"
        )


@contextlib.contextmanager
def within_deadline(deadline: float | None) -> Iterator[None]:
    """Run a lookup under ``deadline`` (``time.monotonic()``; None: none)."""
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
        check_deadline()
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


def model_files_in(folder: Path) -> list[str]:
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
    files = model_files_in(folder)
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


def beside(path: Path, only_named: bool) -> str | None:
    """An mmproj file next to ``path``; with ``only_named``, one naming the model."""
    base = untagged(path.name)
    files = [
        p.name
        for p in sorted(path.parent.glob("*.gguf"))
        if "mmproj" in p.name and (not only_named or base in p.name.lower())
    ]
    found = pick_mmproj(files, path.name)
    return str(path.parent / found) if found else None


def in_models_dir(
    name: str, models_dir: str, mmproj: str | None, tried: list[str]
) -> ResolvedModel | None:
    """``name`` (or ``name:tag``) in ``models_dir``; each place looked goes to ``tried``."""
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
        elif p.is_file() and is_model_file(p.name) and first_part(p.name):
            info = split_info(p.name)
            assert info is not None
            stems.setdefault(info.prefix.lower(), p)
    want_stems = [name] if not tag else [name, f"{base}-{tag}", f"{base}_{tag}", f"{base}.{tag}"]
    if name.lower().endswith(".gguf"):
        want_stems = [name[: -len(".gguf")]]
    for stem in want_stems:
        hit = stems.get(stem.lower())
        if hit is not None:
            proj = None if mmproj == MMPROJ_NONE else beside(hit, only_named=True)
            return ResolvedModel(str(hit), proj, "models_dir", name)
    # ``name`` (or ``name:tag``) against ``name-<QUANT>.gguf`` files: choose the quant as -hf does
    tagged = sorted(p.name for p in stems.values() if untagged(p.name) == base.lower())
    pick = pick_model_file(tagged, tag)
    if pick is not None:
        hit = root / pick
        proj = None if mmproj == MMPROJ_NONE else beside(hit, only_named=True)
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
                for f in model_files_in(folder)
                if split_info(f) and Path(f).stem.lower() == folder_tag.lower()
            ]
            if exact:
                proj = None
                if mmproj != MMPROJ_NONE:
                    found = pick_mmproj(model_files_in(folder), exact[0])
                    proj = str(folder / found) if found else None
                return ResolvedModel(str(folder / exact[0]), proj, "models_dir", name)
        found_model = _from_folder(folder, folder_tag, mmproj, tried)
        if found_model is not None:
            return ResolvedModel(
                found_model.model_path, found_model.mmproj_path, "models_dir", name
            )
    return None


def fs_lookup(
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


def from_path(spec: str, mmproj: str | None, tried: list[str]) -> ResolvedModel | None:
    """``spec`` as an existing file or model folder (None, noted in ``tried``, if not)."""
    p = Path(spec).expanduser()
    if p.is_file() or (p.exists() and not p.is_dir()):
        proj = beside(p, only_named=False) if mmproj == MMPROJ_AUTO else None
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


def file_size(p: Path) -> int:
    """``p``'s size, 0 if it cannot be read (a listing shows what it can)."""
    try:
        return p.stat().st_size
    except OSError:
        return 0
