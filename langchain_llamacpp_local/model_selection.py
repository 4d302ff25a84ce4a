"""How every model class names its model and how long the model stays loaded.

``ChatLlamaCpp``, ``LlamaCppEmbeddings`` and ``LlamaCppRerank`` take the same
``model=``/``model_path=``, ``models_dir``, ``keep_alive`` and ``validate_model_on_init``
(docs/models.md); this mixin holds those fields, their checks and the resolution of
the model's files, so the three classes resolve a name the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator, model_validator
from typing_extensions import Self

from langchain_llamacpp_local.llama.loading import check_gguf_file
from langchain_llamacpp_local.resolution.model_resolution import (
    MMPROJ_NONE,
    ModelNotFoundError,
    ResolvedModel,
    resolve_model,
    resolve_path,
)
from langchain_llamacpp_local.runtime import registry
from langchain_llamacpp_local.validation import check_model_choice, duration_seconds


class ModelSelection(BaseModel):
    """Mixin: the model's name or path, where names are looked up, how long it stays loaded."""

    model_path: str | None = None
    """Path of the GGUF model file (or give ``model``)."""
    model: str | None = None
    """The model: a GGUF path, a name in ``models_dir`` (``qwen3``, ``qwen3:Q4_K_M``) or a
    Hugging Face spec (``owner/repo[:QUANT]``, ``owner/repo/file.gguf``); give this or
    ``model_path``. See docs/models.md."""
    models_dir: str | None = None
    """Folder of models looked up by name (default: ``LLAMACPP_MODELS_DIR``)."""
    keep_alive: float = registry.DEFAULT_KEEP_ALIVE
    """Seconds a loaded model stays loaded once idle (Ollama's semantics: default 5 min,
    0 frees it after the call, negative keeps it until ``unload()``); ``"10m"``-style
    durations are accepted. Other instances with the same settings reuse it meanwhile."""
    validate_model_on_init: bool = False
    """Check at construction that the model can be found (a GGUF file at the path, or the
    name in ``models_dir`` or the Hugging Face cache, without downloading) instead of at
    the first call, as ``ChatOllama``'s option does."""

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _parse_keep_alive(cls, value: Any) -> Any:
        return duration_seconds(value)

    @model_validator(mode="after")
    def _check_model_selection(self) -> Self:
        check_model_choice(
            self.model, self.model_path, has_model_name="model_name" in type(self).model_fields
        )
        if self.validate_model_on_init:
            self._validate_model()
        return self

    def _validate_model(self) -> None:
        """Find the model's files now, offline (``validate_model_on_init``)."""
        if self.model is None:
            assert self.model_path is not None
            path = str(Path(self.model_path).expanduser())
            if not Path(path).exists():
                raise ModelNotFoundError(self.model_path, [f"path: no file at {path}"])
        else:
            path = resolve_model(
                self.model, models_dir=self.models_dir, mmproj=MMPROJ_NONE, offline=True
            ).model_path
        check_gguf_file(path)

    def _resolve(
        self, spec: str | None = None, mmproj: str | None = None, deadline: float | None = None
    ) -> ResolvedModel:
        """The files for ``spec`` (a per-call ``model=``) or, if None, this instance's
        model; folder lookups stop at ``deadline`` (the request's)."""
        if spec is None and self.model is None:
            assert self.model_path is not None
            return resolve_path(self.model_path, mmproj)
        return resolve_model(
            spec if spec is not None else self.model,  # type: ignore[arg-type]
            models_dir=self.models_dir,
            mmproj=mmproj,
            deadline=deadline,
        )

    def _local_model_file(self) -> str | None:
        """The model's file if it can be found without a download (or None)."""
        if self.model is None:
            return self.model_path
        try:
            return resolve_model(
                self.model, models_dir=self.models_dir, mmproj=MMPROJ_NONE, offline=True
            ).model_path
        except Exception:  # not resolvable offline (yet)
            return None
