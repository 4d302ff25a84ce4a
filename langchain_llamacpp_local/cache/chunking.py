"""Where a prompt is cut into ``llama_decode`` calls.

By default (``deterministic=False``) as llama.cpp does: ``n_batch`` tokens per call
from wherever the cached prefix ends, plus the cuts checkpoints and images need
(:func:`resume_point`, :func:`fast_piece_end`). The rest of this module is the
deterministic mode's fixed grid of absolute positions.

llama.cpp's CPU kernels round a token's activations differently depending on the
shape of the micro-batch it is computed in (a one-row batch takes a vector path,
several rows a tiled GEMM; repacked quantized weights use a 4-row kernel for whole
groups and a vector kernel for the rest). A warm request that decodes only the
suffix after its cached prefix would therefore see slightly different logits from
a fresh request reading the whole prompt, and a greedy answer could change.

To make warm == fresh bit for bit, every prompt is decoded in pieces whose
boundaries lie on one grid that depends only on the prompt itself:

* cut points are the multiples of ``align`` (a multiple of 4), the start and end of
  every image, every *mark* (the position right after each occurrence of the chat
  template's generation prompt, e.g. ``<start_of_turn>model\n``, where an assistant
  reply began, or of its end of a message, e.g. ``<end_of_turn>\n``) and the end of
  the prompt; the multiple of ``align`` just before a
  one-token tail (before a mark or the end) is dropped so no text piece is a lone row
  unless the layout forces it;
* a decode call covers consecutive pieces (at most ``n_batch`` tokens) and never
  mixes in another sequence's prompt;
* a cached prefix is reused only up to a cut point at or below its *exact* length:
  the entries that were decoded as prompt pieces of this grid, not generated tokens
  (decoded one at a time) nor the last, partial group of a prompt unless the prompt
  ends on a mark.

Marks are what keeps an agent loop cheap: a prompt always ends with the generation
prompt, so the previous turn's prompt ends on a mark, the next turn's prompt (which
contains it) cuts there too, and the whole previous prompt is reused instead of only
its whole grid cells. Marks depend only on the tokens before them, so a warm and a
fresh prompt find the same ones.

These are pure functions, testable without a model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

_T = TypeVar("_T")

#: Grid spacing (tokens). Small enough that a warm turn re-reads little, large
#: enough that prompt pieces keep llama.cpp's batched kernels efficient.
DEFAULT_ALIGN = 64


def grid_align(n_batch: int, preferred: int = DEFAULT_ALIGN) -> int:
    """The grid spacing for a context with ``n_batch``: a multiple of 4, at most half of it."""
    a = min(preferred, n_batch // 2)
    if a >= 4:
        return a // 4 * 4
    return max(1, a)


def exact_prefix(n_prompt: int, align: int, marks: Iterable[int] = ()) -> int:
    """How many entries of a freshly decoded prompt a longer prompt could reuse exactly."""
    return max([n_prompt // align * align, *(m for m in marks if m <= n_prompt)])


def marker_cuts(tokens: Sequence[object], markers: Sequence[Sequence[object]]) -> list[int]:
    """Positions right after each occurrence of any of ``markers`` in ``tokens`` (ascending).

    A cut depends only on the tokens before it, so a prompt and any longer prompt
    that begins with it find the same cuts there. Markers start with a control token,
    rare in a prompt: occurrences are found from it (a scan in C).
    """
    seq = tokens if isinstance(tokens, list) else list(tokens)
    n = len(seq)
    cuts: set[int] = set()
    for marker in markers:
        m = len(marker)
        if m == 0 or n < m:
            continue
        first = marker[0]
        whole = list(marker)
        j = -1
        while True:
            try:
                j = seq.index(first, j + 1, n - m + 1)
            except ValueError:
                break
            if seq[j : j + m] == whole:
                cuts.add(j + m)
    return sorted(cuts)


def restart_point(
    limit: int,
    n_prompt: int,
    align: int,
    media: Iterable[tuple[int, int]] = (),
    marks: Sequence[int] = (),
) -> int:
    """The cut point at or below ``limit`` to resume decoding ``n_prompt`` entries from.

    ``media`` lists the (start, n_pos) spans of images: a restart inside one moves
    to its start. ``marks`` are the prompt's mark cut points (:func:`marker_cuts`).
    At least one entry is always left to decode (sampling needs logits).
    """
    limit = min(limit, n_prompt - 1)
    if limit <= 0:
        return 0
    r = limit // align * align
    if r > 0 and (r == n_prompt - 1 or (r + 1) in marks):  # dropped: a one-token tail
        r -= align
    r = max([r, *(m for m in marks if m <= limit)])
    for start, n_pos in media:
        if start < r < start + n_pos:
            r = start
    # an image end is a cut point too: resume there rather than further back
    for start, n_pos in media:
        end = start + n_pos
        if r < end <= limit and end < n_prompt:
            r = end
    return max(r, 0)


def resume_point(limit: int, n_prompt: int, media: Iterable[tuple[int, int]] = ()) -> int:
    """Default mode: resume right after the common prefix ``limit`` (moved back to the
    start of an image it ends inside), leaving at least one entry to decode."""
    r = max(0, min(limit, n_prompt - 1))
    for start, n_pos in media:
        if start < r < start + n_pos:
            r = start
    return r


def fast_piece_end(start: int, n_prompt: int, n_batch: int, stops: Iterable[int] = ()) -> int:
    """Default mode: a decode call ends after ``n_batch`` tokens, at the end of the prompt
    or at the first stop (checkpoint position, image start) after ``start``."""
    return min([n_prompt, start + max(1, n_batch), *(s for s in stops if s > start)])


def piece_end(
    start: int,
    n_prompt: int,
    n_batch: int,
    align: int,
    stops: Iterable[int] = (),
    marks: Sequence[int] = (),
) -> int:
    """End of the decode call that starts at ``start`` (a cut point) of an ``n_prompt`` prompt.

    ``stops`` are cut points the call must end at (image starts, checkpoint
    positions), ``marks`` too (see :func:`marker_cuts`): the call ends at the first
    one after ``start``, at ``n_prompt``, or at the last grid point within ``n_batch``
    tokens.
    """
    stops = [*stops, *marks]
    hard = min([n_prompt, *(s for s in stops if s > start)])
    end = min(hard, start + n_batch)
    if start % align:
        # Resuming at a cut off the grid (a mark, an image end): back onto the grid
        # first. A piece's last rows are computed differently when its length is not
        # a multiple of the kernels' row group, so a piece may end off the grid only
        # where every plan of this prompt ends one (a hard stop).
        return min(end, (start // align + 1) * align)
    if end < hard:
        grid = end // align * align
        if grid > start:
            end = grid
        # keep the piece after this one from being a lone token before the end or a mark
        if (hard == n_prompt or hard in marks) and hard - end == 1 and end - align > start:
            end -= align
    return end


def balanced_groups(items: Sequence[_T], limit: int) -> list[list[_T]]:
    """Split ``items`` into the fewest decode calls of at most ``limit`` rows, sizes within one.

    A step's cost grows with its rows but not linearly (a one-row call is a vector
    kernel, more rows share weight reads), so 4 requests under a limit of 3 run as
    2 + 2 rather than 3 + 1: measured on Gemma 3 270M Q4_K_M on 2 cores, 43 + 43 ms
    against 70 + 26 ms. Order is kept.
    """
    if not items:
        return []
    limit = max(1, limit)
    n_groups = -(-len(items) // limit)
    base, extra = divmod(len(items), n_groups)
    out: list[list[_T]] = []
    i = 0
    for g in range(n_groups):
        size = base + (1 if g < extra else 0)
        out.append(list(items[i : i + size]))
        i += size
    return out
