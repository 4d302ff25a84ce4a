"""Copying and pickling a model instance copies its configuration, never its runtime state.

LangChain and LangGraph copy models (``copy.deepcopy`` in ``with_config`` and graph
checkpoints) and pickle them (multiprocessing, checkpointers). An instance's private
attributes hold what runs it: a worker with its thread and queues, a context, locks.
Those cannot be copied, and must not be: a copy is another handle on the same loaded
model, which it finds again through the registry on its first call (the weights are
shared, no context is copied). So a copy or an unpickled instance gets its private
attributes fresh from their defaults, whether or not the original has been used.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined


def _fresh_private(obj: BaseModel) -> None:
    """Give ``obj`` its private attributes' defaults (calling their factories)."""
    private = {}
    for name, attr in obj.__private_attributes__.items():
        value = attr.get_default(call_default_factory=True)
        if value is not PydanticUndefined:
            private[name] = value
    object.__setattr__(obj, "__pydantic_private__", private or None)


class ConfigOnlyCopies(BaseModel):
    """Mixin: ``copy.copy``, ``copy.deepcopy`` and ``pickle`` carry the fields only."""

    def __copy__(self) -> Any:
        new = super().__copy__()
        _fresh_private(new)
        return new

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Any:
        cls = type(self)
        new = cls.__new__(cls)
        if memo is not None:
            memo[id(self)] = new
        object.__setattr__(new, "__dict__", copy.deepcopy(self.__dict__, memo))
        object.__setattr__(new, "__pydantic_extra__", copy.deepcopy(self.__pydantic_extra__, memo))
        object.__setattr__(new, "__pydantic_fields_set__", set(self.__pydantic_fields_set__))
        _fresh_private(new)
        return new

    def __getstate__(self) -> dict[Any, Any]:
        state = dict(super().__getstate__())
        state["__pydantic_private__"] = None
        return state

    def __setstate__(self, state: dict[Any, Any]) -> None:
        super().__setstate__(state)
        _fresh_private(self)
