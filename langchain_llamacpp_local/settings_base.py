"""What ``ChatLlamaCpp``, ``LlamaCppEmbeddings`` and ``LlamaCppRerank`` share: the model
they run (:class:`~.model_selection.ModelSelection`), the load settings that decide how
its weights load, and the lifecycle (``load``, ``close``, ``with``).

The defaults come from :class:`~.llama.loading.LoadConfig`, the one place they are
written: a field and the config it fills cannot disagree; :func:`settings_from` fills a
settings dataclass from the fields of the same names, so no class lists them again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from pydantic import ConfigDict, StrictBool, model_validator
from typing_extensions import Self

from langchain_llamacpp_local.copies import ConfigOnlyCopies
from langchain_llamacpp_local.llama.loading import LoadConfig
from langchain_llamacpp_local.model_selection import ModelSelection
from langchain_llamacpp_local.validation import check_argument_names

C = TypeVar("C")


def settings_from(model: Any, config: type[C], **overrides: Any) -> C:
    """The settings dataclass ``config`` filled from ``model``'s fields of the same
    names; ``overrides`` for the ones whose value differs from the field's (a renamed
    field, a resolved path, a default that depends on other fields). A config field that
    is neither keeps its own default."""
    fields = type(model).model_fields
    values = {
        f.name: getattr(model, f.name)
        for f in dataclasses.fields(config)  # type: ignore[arg-type]
        if f.init and f.name in fields and f.name not in overrides
    }
    return config(**values, **overrides)


class ModelSettings(ConfigOnlyCopies, ModelSelection):
    """Base of the three model classes: model selection, shared load settings, lifecycle.

    Subclasses implement :meth:`load` (load now instead of at the first call) and
    :meth:`close` (cancel this instance's calls and free what it used).
    """

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    n_threads: int | None = LoadConfig.n_threads
    """CPU threads (for a chat model: for generation; default: one per usable physical
    core, from the affinity mask and cgroup quota, shared with the process's other models
    through a CPU budget; docs/configuration.md#threads)."""
    n_gpu_layers: int = LoadConfig.n_gpu_layers
    """Layers to offload to the GPU (-1: all). Needs a GPU build of llama-cpp-python.
    Part of the load settings shared by every model class on the same file (a chat
    model with ``rpc_servers`` defaults to all layers)."""
    use_mmap: bool = LoadConfig.use_mmap
    """Memory-map the model file."""
    use_mlock: bool = LoadConfig.use_mlock
    """Lock the model in RAM."""
    cpu_amx: StrictBool | None = LoadConfig.cpu_amx
    """Let llama.cpp put weights in ggml's AMX buffer type on Intel CPUs with AMX.
    None (default) or False: no weight goes there, because its matrix kernel crashes the
    process on some CPUs (ggml-org/llama.cpp#20824); every other repacking is kept.
    Part of the load settings shared by every model class; see docs/configuration.md."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_arguments(cls, data: Any) -> Any:
        """A misspelt argument (``n_gpu_layer=10``) gets the closest field's name instead
        of being silently ignored."""
        check_argument_names(cls, data, cls.__name__)
        return data

    def load(self) -> Self:
        """Load the model now (otherwise the first call does); returns ``self``."""
        raise NotImplementedError

    def close(self) -> None:
        """Cancel this instance's running calls and free what it used."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.load()

    def __exit__(self, *exc: object) -> None:
        self.close()
