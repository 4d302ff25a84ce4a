"""The decode grid (pure functions): warm pieces line up with fresh ones."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from langchain_llamacpp_local.cache.chunking import (
    balanced_groups,
    exact_prefix,
    grid_align,
    marker_cuts,
    piece_end,
    restart_point,
)
from langchain_llamacpp_local.cache.host_ram import CachedPrompt, PromptCache


def _pieces(
    start: int,
    n: int,
    n_batch: int,
    align: int,
    stops: tuple[int, ...] = (),
    marks: tuple[int, ...] = (),
) -> list[int]:
    cuts = [start]
    while cuts[-1] < n:
        cuts.append(piece_end(cuts[-1], n, n_batch, align, stops, marks))
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
    assert _pieces(0, 300, 512, 64, (100, 192)) == [0, 100, 128, 192, 300]
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


@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=4), max_size=3),
)
def test_marker_cuts_are_the_ends_of_every_occurrence(
    toks: list[int], markers: list[list[int]]
) -> None:
    naive = sorted(
        {
            j + len(m)
            for m in markers
            if m
            for j in range(len(toks) - len(m) + 1)
            if toks[j : j + len(m)] == m
        }
    )
    assert marker_cuts(toks, markers) == naive
    assert marker_cuts(tuple(toks), [tuple(m) for m in markers]) == naive


def test_marker_cuts_follow_each_occurrence() -> None:
    toks = [1, 7, 8, 9, 5, 7, 8, 9, 7, 8]
    assert marker_cuts(toks, [(7, 8, 9)]) == [4, 8]
    assert marker_cuts(toks, [(7, 8, 9), (5,), (8, 9)]) == [4, 5, 8]
    assert marker_cuts(toks, []) == []
    assert marker_cuts([7, 8], [(7, 8, 9)]) == []
    # a prefix has the same marks as the longer prompt it begins
    assert marker_cuts(toks[:8], [(7, 8, 9)]) == [4, 8]


def _decode_plan(start: int, n: int, marks: tuple[int, ...]) -> list[tuple[int, int]]:
    cuts = _pieces(start, n, 512, 64, marks=tuple(m for m in marks if m <= n))
    return list(zip(cuts, cuts[1:], strict=False))


def test_a_prompt_that_ends_on_a_mark_is_reused_whole_and_cut_the_same_way() -> None:
    # turn 1 ends with the generation prompt (a mark at its end); turn 2 contains it
    for n1 in (5, 63, 64, 65, 100, 129, 130, 577, 1025):
        marks = (n1,)
        exact = exact_prefix(n1, 64, marks)
        assert exact == n1
        n2 = n1 + 90
        r = restart_point(exact, n2, 64, (), marks)
        assert r == n1
        fresh = _decode_plan(0, n2, marks)
        first_turn = _decode_plan(0, n1, marks)
        # every piece of turn 1 is a piece of the fresh turn 2, and turn 2 resumes at n1
        assert set(first_turn) <= set(fresh)
        assert _decode_plan(r, n2, marks) == [p for p in fresh if p[0] >= r]


def test_no_lone_row_before_a_mark_and_restarts_skip_the_dropped_point() -> None:
    # a mark one token after a grid point: that grid point is not a cut
    assert _pieces(0, 300, 512, 64, marks=(129,)) == [0, 129, 192, 300]
    assert _pieces(0, 900, 512, 64, marks=(129,)) == [0, 129, 192, 704, 900]
    assert restart_point(128, 300, 64, (), (129,)) == 64
    assert restart_point(200, 300, 64, (), (129,)) == 192
    assert restart_point(150, 300, 64, (), (129,)) == 129


def _row_kinds(plan: list[tuple[int, int]]) -> dict[int, tuple[bool, bool]]:
    """How CPU kernels treat each row: (in a lone-row piece, in the piece's last n % 4)."""
    out = {}
    for a, b in plan:
        for p in range(a, b):
            out[p] = (b - a == 1, p >= b - (b - a) % 4)
    return out


def test_warm_restarts_with_marks_compute_every_row_as_fresh_prompts_do() -> None:
    marks = (37, 130, 200, 449)
    for n in (450, 451, 600, 1100):
        fresh = _row_kinds(_decode_plan(0, n, marks))
        for limit in range(0, n, 7):
            r = restart_point(limit, n, 64, (), marks)
            assert r <= max(limit, 0) and (r % 64 == 0 or r in marks)
            warm = _row_kinds(_decode_plan(r, n, marks))
            assert all(warm[p] == fresh[p] for p in range(r, n)), (n, limit, r)
