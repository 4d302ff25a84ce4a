"""LoRA adapters per request: configuration, file checks, prefix keys and grouping.

Pure Python (no llama.cpp calls), so it is testable without a model; the engine
loads and applies the adapters (:meth:`Engine.set_lora`).

Semantics follow llama.cpp's server: every adapter named in ``lora_adapters`` is
loaded once per base model and has a default scale (a bare path: 0, loaded but
off; ``{"path": ..., "scale": s}``: on at ``s``). A request's ``lora`` mapping
replaces the defaults: adapters it does not name are off. Adapters at scale 0 are
dropped from the set, so such a request is exactly the base model.

The set of ``(name, scale)`` pairs a request runs with (its *key*) is part of a
cached prefix's identity: :func:`key_tokens` makes the first prompt entry carry
it, so every prefix comparison (slots, host-RAM cache, prefix copies,
checkpoints) sees two different adapter sets as different from position 0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from langchain_llamacpp_local.errors import ModelLoadError, ModelNotFoundError
from langchain_llamacpp_local.llama.adapters import not_a_file

#: What a request runs with: ``(name, scale)`` pairs in declaration order, none at 0.
LoraKey = tuple[tuple[str, float], ...]

T = TypeVar("T")


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter of a model: its name, its file and its default scale."""

    name: str
    path: str
    scale: float = 0.0


#: The largest ``|scale|`` a request or a default may give an adapter. llama.cpp takes any
#: float and multiplies the adapter's output by ``scale * alpha / rank`` before adding it
#: to the base projection: at 1e6 the keys and values overflow the f16 KV cache to inf,
#: and in a unified KV pool every other sequence's attention multiplies those (masked)
#: cells by 0, so 0 * inf = NaN reaches callers with no adapter at all. Adapters are
#: trained at 1; useful scales lie within a few units of it (negative ones subtract a
#: fine-tune). 100 is a generous ceiling (ComfyUI's LoRA loader stops there too) that
#: keeps the multiplier, with alpha / rank bounded the same way at load
#: (``adapters.MAX_ALPHA_RATIO``), within 1e4: finite in float32 whatever the adapter, and
#: far from the f16 range for a trained one. What a finite scale can still do to a
#: pathological adapter is caught after each decode (docs/lora.md, "Bounds").
MAX_SCALE = 100.0


def _show(value: Any) -> str:
    """``repr`` of a scale, short for huge integers (10**5000 has no ``repr`` at all)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def _scale(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} must be a number, got {value!r}")
    try:
        scale = float(value)
    except OverflowError:  # an int beyond float's range (10**400)
        scale = math.inf
    if not math.isfinite(scale) or abs(scale) > MAX_SCALE:
        raise ValueError(
            f"{where} must be a finite LoRA scale within [-{MAX_SCALE:g}, {MAX_SCALE:g}], "
            f"got {_show(value)} (larger scales overflow the model's activations; "
            "see docs/lora.md)"
        )
    return scale


def parse_adapters(value: Mapping[str, Any] | None) -> tuple[AdapterSpec, ...]:
    """Check ``lora_adapters`` (name -> path, or name -> {"path", "scale"}) without I/O."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError(
            "lora_adapters must be a mapping of names to paths or {'path', 'scale'}, "
            f"got {type(value).__name__}"
        )
    out = []
    for name, item in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_adapters: an adapter name must be a non-empty string: {name!r}")
        if isinstance(item, (str, os.PathLike)):
            out.append(AdapterSpec(name, os.fspath(item), 0.0))
            continue
        if not isinstance(item, Mapping):
            raise ValueError(
                f"lora_adapters[{name!r}] must be a path or {{'path': ..., 'scale': ...}}, "
                f"got {item!r}"
            )
        unknown = set(item) - {"path", "scale"}
        if unknown:
            raise ValueError(
                f"lora_adapters[{name!r}]: unknown keys {sorted(unknown)} (use 'path', 'scale')"
            )
        path = item.get("path")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ValueError(f"lora_adapters[{name!r}] needs a 'path' (a file or a name)")
        scale = _scale(item.get("scale", 1.0), f"lora_adapters[{name!r}]['scale']")
        out.append(AdapterSpec(name, os.fspath(path), scale))
    return tuple(out)


def request_key(
    specs: Sequence[AdapterSpec], requested: Mapping[str, Any] | Sequence[str] | str | None
) -> LoraKey:
    """The adapter set a request runs with (see module docstring).

    ``requested`` is a mapping name -> scale, a name or a list of names (scale 1),
    or None for the defaults. An unknown name raises ``ValueError`` naming the known ones.
    """
    if requested is None:
        return tuple((s.name, s.scale) for s in specs if s.scale != 0.0)
    if isinstance(requested, str):
        requested = {requested: 1.0}
    elif not isinstance(requested, Mapping):
        if not isinstance(requested, Iterable):
            raise ValueError(f"lora must be a mapping of adapter names to scales: {requested!r}")
        requested = dict.fromkeys(requested, 1.0)
    known = [s.name for s in specs]
    unknown = [n for n in requested if n not in known]
    if unknown:
        raise ValueError(
            f"unknown LoRA adapter {', '.join(map(repr, unknown))}: "
            + (
                f"this model has {', '.join(map(repr, known))} (lora_adapters=...)"
                if known
                else "this model has none (pass lora_adapters=... to load some)"
            )
        )
    scales = {n: _scale(v, f"lora[{n!r}]") for n, v in requested.items()}
    return tuple((n, scales[n]) for n in known if scales.get(n, 0.0) != 0.0)


def resolve_adapter_path(path: str, models_dir: str | None) -> str:
    """An adapter file: a path, else a file (``name`` or ``name.gguf``) in ``models_dir``.

    Something that exists but is not a regular file is refused by what it is."""
    p = Path(path).expanduser()
    tried = [p]
    if models_dir and not p.is_absolute():
        tried += [Path(models_dir) / path, Path(models_dir) / f"{path}.gguf"]
    for cand in tried:
        if cand.exists():
            why = not_a_file(cand)
            if why is not None:
                raise ModelLoadError(f"LoRA adapter {path}: {cand} is {why}")
            return os.path.abspath(cand)
    raise ModelNotFoundError(
        path,
        [str(c) for c in tried],
        message=f"LoRA adapter file not found: {path} (tried {', '.join(map(str, tried))})",
    )


class KeyedToken(int):
    """A token id that also carries an adapter set: equal only to the same token under
    the same set, so a cached prefix never matches across adapter sets. It is an
    ``int`` for everything else (llama.cpp's batch, samplers, proposers)."""

    lora: LoraKey

    def __new__(cls, token: int, lora: LoraKey) -> KeyedToken:
        obj = super().__new__(cls, token)
        obj.lora = lora
        return obj

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyedToken):
            return int(self) == int(other) and self.lora == other.lora
        return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((int(self), self.lora))

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeyedToken, (int(self), self.lora))

    def __repr__(self) -> str:
        return f"KeyedToken({int(self)}, {self.lora!r})"


def key_tokens(tokens: list[Hashable], lora: LoraKey, start: int = 0) -> list[Hashable]:
    """``tokens`` with entry ``start`` keyed by ``lora`` (unchanged for the base model).

    ``start`` > 0 is an activated LoRA's invocation start: the entries before it are
    computed without the adapter, so they stay shareable with the base model.
    """
    if not lora or start >= len(tokens):
        return tokens
    first = tokens[start]
    keyed: Hashable = (
        KeyedToken(first, lora)
        if isinstance(first, int)
        else ("lora", lora, first)  # an image first: still a distinct entry
    )
    return [*tokens[:start], keyed, *tokens[start + 1 :]]


def alora_start(tokens: Sequence[Hashable], invocation: Sequence[int]) -> int | None:
    """Where the last occurrence of an activated LoRA's invocation sequence starts in
    ``tokens`` (None: absent, the adapter stays off), as llama.cpp's server finds it."""
    n = len(invocation)
    if n == 0:
        return 0
    inv = list(invocation)
    for i in range(len(tokens) - n, -1, -1):
        if [tokens[j] for j in range(i, i + n)] == inv:
            return i
    return None


def activate(
    lora: LoraKey, alora: Mapping[str, Sequence[int]], tokens: Sequence[Hashable]
) -> tuple[LoraKey, int]:
    """The adapter set a prompt runs with and where it takes effect.

    Plain LoRA: the whole prompt (``start`` 0). An activated LoRA (one with invocation
    tokens) runs alone and only from the last occurrence of its invocation sequence
    on; without one in the prompt it is off (llama.cpp's server does the same).
    """
    named = [n for n, _ in lora if n in alora]
    if not named:
        return lora, 0
    if len(lora) != 1:
        raise ValueError(
            f"the activated LoRA {named[0]!r} cannot run with other adapters in one request"
        )
    start = alora_start(tokens, alora[named[0]])
    if start is None:
        return (), 0
    return lora, start


def plan_adapter_groups(
    items: Sequence[T], key: Callable[[T], Hashable], turn: int
) -> list[list[T]]:
    """Split one step's requests into groups that may share a ``llama_decode``.

    Adapters are set per context, so a decode call carries one adapter set
    (llama.cpp's server: the batch takes the first request's set). Every group is
    decoded in the same step, each in its own call; ``turn`` (the step counter)
    rotates which group goes first, so no set is always kept behind another.
    Order within a group is kept.
    """
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    ordered = list(groups.values())
    if len(ordered) > 1:
        k = turn % len(ordered)
        ordered = ordered[k:] + ordered[:k]
    return ordered


__all__ = [
    "AdapterSpec",
    "KeyedToken",
    "activate",
    "alora_start",
    "LoraKey",
    "MAX_SCALE",
    "key_tokens",
    "parse_adapters",
    "plan_adapter_groups",
    "request_key",
    "resolve_adapter_path",
]
