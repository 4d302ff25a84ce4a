"""The decode grid (pure functions): warm pieces line up with fresh ones."""

from __future__ import annotations

from langchain_llamacpp_local.chunking import (
    balanced_groups,
    exact_prefix,
    grid_align,
    piece_end,
    restart_point,
)
from langchain_llamacpp_local.prompt_cache import CachedPrompt, PromptCache


def _pieces(start: int, n: int, n_batch: int, align: int, stops: tuple[int, ...] = ()) -> list[int]:
    cuts = [start]
    while cuts[-1] < n:
        cuts.append(piece_end(cuts[-1], n, n_batch, align, stops))
    return cuts


def test_grid_align_is_a_multiple_of_four_within_half_a_batch() -> None:
    assert grid_align(512) == 64
    assert grid_align(64) == 32
    assert grid_align(10) == 4
    assert grid_align(2) == 1


def test_a_warm_restart_cuts_where_a_fresh_prompt_does() -> None:
    for n in (5, 63, 64, 65, 129, 300, 513, 577, 1100):
        fresh = _pieces(0, n, 512, 64)
        for limit in range(0, n, 37):
            r = restart_point(limit, n, 64)
            assert r % 64 == 0 and r <= max(limit, 0)
            warm = _pieces(r, n, 512, 64)
            # every warm cut at or after the first full cell is a cut of the grid
            assert all(c % 64 == 0 or c == n for c in warm)
            assert all(c % 64 == 0 or c == n for c in fresh)
            assert n - warm[-2] >= min(2, n)  # never a lone last token
            assert n - fresh[-2] >= min(2, n)


def test_restart_leaves_at_least_one_token_and_avoids_images() -> None:
    assert restart_point(1000, 129, 64) == 64  # 128 would leave one lone token
    assert restart_point(1000, 130, 64) == 128
    assert restart_point(10, 130, 64) == 0
    # inside an image: back to its start; an image end is a cut point
    assert restart_point(100, 300, 64, [(40, 50)]) == 90
    assert restart_point(80, 300, 64, [(40, 50)]) == 40


def test_pieces_stop_at_images_and_checkpoints() -> None:
    assert _pieces(0, 300, 512, 64, (100, 192)) == [0, 100, 192, 300]
    assert _pieces(0, 1100, 512, 64) == [0, 512, 1024, 1100]
    assert _pieces(0, 1025, 512, 64) == [0, 512, 960, 1025]


def test_exact_prefix_is_whole_cells() -> None:
    assert exact_prefix(130, 64) == 128
    assert exact_prefix(63, 64) == 0


def test_take_of_an_evicted_entry_is_refused_not_raised() -> None:
    cache = PromptCache(max_bytes=10)
    a = CachedPrompt((1, 2, 3), b"x" * 8)
    cache.put(a)
    cache.put(CachedPrompt((4, 5, 6), b"y" * 8))  # evicts a
    assert cache.take(a) is False


def test_balanced_groups_use_the_fewest_calls_with_even_sizes() -> None:
    assert balanced_groups([1, 2, 3, 4], 3) == [[1, 2], [3, 4]]
    assert balanced_groups([1, 2, 3, 4, 5], 3) == [[1, 2, 3], [4, 5]]
    assert balanced_groups([1, 2, 3, 4, 5, 6, 7], 3) == [[1, 2, 3], [4, 5], [6, 7]]
    assert balanced_groups([1, 2, 3], 1) == [[1], [2], [3]]
    assert balanced_groups([1, 2, 3], 8) == [[1, 2, 3]]
    assert balanced_groups([], 3) == []
    assert balanced_groups([1, 2], 0) == [[1], [2]]
