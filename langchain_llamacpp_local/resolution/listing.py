"""What models are there: :func:`list_models` over a models directory and the Hugging
Face cache, each with the name that :func:`~.model_resolution.resolve_model` takes."""

from __future__ import annotations

from pathlib import Path

from langchain_llamacpp_local.resolution.hub import list_hf_cache
from langchain_llamacpp_local.resolution.local import (
    beside,
    file_size,
    model_files_in,
    models_dir_from,
)
from langchain_llamacpp_local.resolution.naming import (
    ModelEntry,
    first_part,
    is_model_file,
    pick_mmproj,
    split_info,
)


def list_models(models_dir: str | None = None, hf_cache_dir: str | None = None) -> list[ModelEntry]:
    """The models in ``models_dir`` (or ``LLAMACPP_MODELS_DIR``) and the Hugging Face cache."""
    out: list[ModelEntry] = []
    mdir = models_dir_from(models_dir)
    if mdir and Path(mdir).is_dir():
        root = Path(mdir)
        for p in sorted(root.iterdir()):
            if p.is_file() and is_model_file(p.name) and first_part(p.name):
                info = split_info(p.name)
                assert info is not None
                out.append(
                    ModelEntry(info.prefix, str(p), file_size(p), "models_dir", beside(p, True))
                )
            elif p.is_dir():
                files = model_files_in(p)
                models = [f for f in files if is_model_file(f) and first_part(f)]
                for f in models:
                    name = p.name if len(models) == 1 else f"{p.name}:{_tag_or_stem(f)}"
                    proj = pick_mmproj(files, f)
                    out.append(
                        ModelEntry(
                            name,
                            str(p / f),
                            file_size(p / f),
                            "models_dir",
                            str(p / proj) if proj else None,
                        )
                    )
    out.extend(list_hf_cache(hf_cache_dir))
    return out


def _tag_or_stem(f: str) -> str:
    info = split_info(f)
    return info.tag if info and info.tag else Path(f).stem
