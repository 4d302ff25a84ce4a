"""Prefix-reuse and checkpoint bookkeeping (pure functions, no model)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from langchain_llamacpp_local.cache.checkpoints import (
    Checkpoint,
    CheckpointStore,
    checkpoint_targets,
)
from langchain_llamacpp_local.cache.slots import Slot, common_prefix_len

tokens = st.lists(st.integers(0, 5), max_size=700)


@given(tokens, tokens)
def test_common_prefix_matches_naive(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_len(a, b) == n


@given(st.lists(st.integers(0, 3), max_size=1500), tokens, tokens)
def test_common_prefix_of_a_shared_history(shared: list[int], a: list[int], b: list[int]) -> None:
    """Long shared prefixes (an agent's history) at every length, any tails after them."""
    x, y = shared + a, shared + b
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    assert common_prefix_len(x, y) == n
    assert common_prefix_len(tuple(x), y) == n  # a cached prompt's entries against tokens


def test_common_prefix_long_block_path() -> None:
    a = list(range(1000))
    b = list(range(777)) + [-1] + list(range(300))
    assert common_prefix_len(a, b) == 777
    assert common_prefix_len(a, a) == 1000


def _ck(n: int, size: int = 10) -> Checkpoint:
    return Checkpoint(n_tokens=n, pos_min=0, pos_max=n - 1, data=b"x" * size)


def test_checkpoint_store_bounds_and_lookup() -> None:
    store = CheckpointStore(max_count=3, max_bytes=1000)
    for n in (10, 20, 30, 40):
        store.add(_ck(n))
    assert [c.n_tokens for c in store.items] == [20, 30, 40]  # oldest evicted
    assert store.best_for(35).n_tokens == 30
    assert store.best_for(40).n_tokens == 40
    assert store.best_for(5) is None
    store.drop_after(30)
    assert [c.n_tokens for c in store.items] == [20, 30]
    store.add(_ck(30, 20))  # same point replaces
    assert [c.size for c in store.items] == [10, 20]


def test_checkpoint_store_byte_budget_keeps_needed_points() -> None:
    store = CheckpointStore(max_count=10, max_bytes=25)
    store.add(_ck(10))
    store.add(_ck(20), keep=frozenset({10, 20}))
    store.add(_ck(30), keep=frozenset({20, 30}))
    assert [c.n_tokens for c in store.items] == [20, 30]
    assert store.total_bytes == 20


def test_checkpoint_targets_special_points_and_spacing() -> None:
    pts = checkpoint_targets(0, 2000, n_ubatch=512, min_step=512, boundaries=(1900,))
    assert 1996 in pts and 1484 in pts and 1900 in pts
    assert 512 in pts
    assert 1024 not in pts  # periodic points keep min_step away from the special ones
    periodic = [p for p in pts if p not in (1900, 1484, 1996)]
    assert all(b - a >= 512 for a, b in zip(periodic, periodic[1:], strict=False))
    assert all(0 < p < 2000 for p in pts)
    assert pts == sorted(pts)
    # points before the reused prefix are not decoded again, so not saved again
    assert all(p > 1500 for p in checkpoint_targets(1500, 2000, n_ubatch=512, min_step=512))
    # short prompt: only the near-end point fits
    assert checkpoint_targets(0, 10, n_ubatch=512, min_step=512) == [6]


def test_slot_truncate_drops_checkpoints() -> None:
    slot = Slot(seq_id=0, entries=list(range(50)))
    slot.checkpoints.add(_ck(20))
    slot.checkpoints.add(_ck(40))
    slot.truncate(30)
    assert slot.n_past == 30
    assert [c.n_tokens for c in slot.checkpoints.items] == [20]
