"""Models on the Hugging Face hub, through ``huggingface_hub`` (its cache, token, offline
mode and progress bars): the local cache first (no network for a cached model), then the
hub if it is allowed and reachable; every part of a split GGUF is fetched. Resolutions
are remembered per process, and an unreachable hub for :data:`HUB_PROBE_TTL_S`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from langchain_llamacpp_local.errors import ModelLoadError
from langchain_llamacpp_local.resolution.local import file_size
from langchain_llamacpp_local.resolution.naming import (
    MMPROJ_AUTO,
    HfSpec,
    ModelEntry,
    ResolvedModel,
    first_part,
    is_model_file,
    pick_mmproj,
    pick_model_file,
    split_info,
    split_parts,
)


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


def resolve_hf_cached(
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


def list_hf_cache(cache_dir: str | None) -> list[ModelEntry]:
    """The model files in the Hugging Face cache (``cache_dir`` or the one in force)."""
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
            if info is None or not (is_model_file(f) and first_part(f)):
                continue
            name = f"{repo.repo_id}:{info.tag}" if info.tag else f"{repo.repo_id}/{f}"
            proj = pick_mmproj(files, f)
            out.append(
                ModelEntry(
                    name,
                    str(rev.snapshot_path / f),
                    file_size(rev.snapshot_path / f),
                    "huggingface",
                    str(rev.snapshot_path / proj) if proj else None,
                )
            )
    return out
