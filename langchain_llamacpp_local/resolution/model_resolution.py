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

This module holds the entry points; file naming is :mod:`.naming`'s, the file system
(paths, ``models_dir``) :mod:`.local`'s, the Hugging Face hub :mod:`.hub`'s, and
:func:`list_models` :mod:`.listing`'s.
"""

from __future__ import annotations

import logging
from pathlib import Path

from langchain_llamacpp_local.errors import ModelNotFoundError
from langchain_llamacpp_local.resolution.hub import resolve_hf_cached
from langchain_llamacpp_local.resolution.listing import list_models
from langchain_llamacpp_local.resolution.local import (
    MODELS_DIR_ENV,
    beside,
    check_deadline,
    from_path,
    fs_lookup,
    in_models_dir,
    models_dir_from,
    within_deadline,
)
from langchain_llamacpp_local.resolution.naming import (
    MMPROJ_AUTO,
    MMPROJ_NONE,
    HfSpec,
    ModelEntry,
    ResolvedModel,
    SplitInfo,
    is_model_file,
    parse_hf_spec,
    pick_mmproj,
    pick_model_file,
    split_info,
    split_parts,
)

logger = logging.getLogger(__name__)


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
    with within_deadline(deadline):
        return _resolve_model(spec, models_dir, mmproj, hf_cache_dir, offline)


def _resolve_model(
    spec: str,
    models_dir: str | None,
    mmproj: str | None,
    hf_cache_dir: str | None,
    offline: bool | None,
) -> ResolvedModel:
    check_deadline(spec)
    tried: list[str] = []
    explicit_proj = mmproj not in (None, MMPROJ_AUTO, MMPROJ_NONE)
    mode = None if explicit_proj else mmproj
    found = fs_lookup(lambda: from_path(spec, mode, tried), "path", spec, tried)
    if found is None:
        mdir = models_dir_from(models_dir)
        if mdir is None:
            tried.append(f"models_dir: not set (pass models_dir= or set {MODELS_DIR_ENV})")
        else:
            found = fs_lookup(
                lambda: in_models_dir(spec, mdir, mode, tried), f"models_dir {mdir}", spec, tried
            )
    if found is None:
        hs = parse_hf_spec(spec)
        if hs is None:
            tried.append(
                "Hugging Face: not a repo spec (owner/repo[:QUANT] or owner/repo/file.gguf)"
            )
        else:
            found = resolve_hf_cached(spec, hs, mode, hf_cache_dir, offline, tried)
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
        proj = beside(p, only_named=False) if p.parent.is_dir() else None
    elif mmproj in (None, MMPROJ_NONE):
        proj = None
    else:
        proj = str(Path(mmproj).expanduser())
    return ResolvedModel(str(p), proj, "path", path)


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
