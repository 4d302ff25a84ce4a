"""What one worker step decodes: the decision, as data.

As vLLM v1's ``Scheduler.schedule()`` returns a ``SchedulerOutput`` that the model
runner executes, :func:`plan_step` returns a :class:`StepPlan` that the worker applies:
which generating requests share each ``llama_decode``, which verify which draft (a
call of their own), and which piece of which prompt is read (its images, then a range
of its tokens cut as :mod:`~langchain_llamacpp_local.cache.chunking` says). It never
touches llama.cpp, so the order, grouping and cuts are tested without a model.

While an interactive request generates, the prompt piece is sized so the whole step
fits a stall budget (Sarathi-Serve's stall-free batching): :func:`largest_piece` over
a :class:`CallCost` the worker fits from the calls it timed. Requests are ordered by
:func:`by_priority`: interactive ones first, background ones after them until they
have waited long enough (:func:`effective_priority`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from langchain_llamacpp_local.cache.chunking import balanced_groups, fast_piece_end, piece_end
from langchain_llamacpp_local.cache.slot_memory import WINDOW_SLACK
from langchain_llamacpp_local.runtime.lora import plan_adapter_groups

T = TypeVar("T")

#: Fewest prompt tokens a budgeted piece reads, whatever the budget: a prompt always
#: progresses. Only where the pool is so large that more would overrun the budget
#: (over 8,000 cells every row attends to, a row costs 6-7 ms on two CPU cores).
MIN_PIECE = 8
#: The most a long prompt's first piece beside the streams reads (less when the budget
#: allows less): the cost fit has not yet timed a piece at that point of the pool.
FIRST_PIECE = 16
#: A prompt with more than this many tokens left reads its first piece beside the
#: streams at :data:`FIRST_PIECE` (a shorter one is read as the budget allows from the
#: start).
FIRST_PIECE_ABOVE = 4 * FIRST_PIECE
#: Time spent before a step's calls that is a real copy (a conversation parked or
#: restored), as a share of the budget: with a smallest piece over the budget anyway,
#: the prompt waits a step after one instead of adding that piece to it.
COPY_SHARE = 0.25
#: A background request counts as interactive once it has waited this long (seconds,
#: or worker steps) since it was queued: interactive work cannot starve it.
BACKGROUND_AGE_S = 5.0
BACKGROUND_AGE_STEPS = 250
PRIORITIES = ("interactive", "background")
#: The default stall budget (``ChatLlamaCpp.stall_budget_ms``): on two CPU cores a
#: stream's token takes 13-40 ms (more beside idle conversations) and a piece of a
#: 4,000-token prompt a few ms per token, so 100 ms lets pieces of a few dozen tokens
#: through; steps planned to a budget took up to 1.37 times it on a shared machine
#: (another thread taking a core mid-call), so a stream's longest gap stays within
#: 150 ms, what a reader sees as a hiccup. On a GPU whole pieces fit in it and nothing
#: changes.
DEFAULT_STALL_BUDGET_MS = 100.0


@dataclass(frozen=True)
class CallCost:
    """What one ``llama_decode`` call costs, in seconds: ``per_call`` (the weights read
    once per call, the launch), ``per_row`` per row, and ``per_attended`` per position a
    row attends to (attention grows with the prompt before it)."""

    per_call: float
    per_row: float
    per_attended: float
    pool: int | None = None
    """Cells in use in a unified KV pool whose every row attends over all of them, or
    None: each row attends its own sequence's positions. Without flash attention
    llama.cpp's attention spans every used cell of a unified pool, other
    conversations' masked ones included, so an idle conversation kept beside a stream
    slows each of its tokens (:func:`call_attention`)."""

    def of(self, rows: int, attended: int) -> float:
        """A call of ``rows`` rows whose own positions attended sum to ``attended``."""
        if rows <= 0:
            return 0.0
        att = call_attention(rows, attended, self.pool)
        return self.per_call + self.per_row * rows + self.per_attended * att

    def scaled(self, factor: float) -> CallCost:
        """Every call ``factor`` times as costly."""
        return replace(
            self,
            per_call=self.per_call * factor,
            per_row=self.per_row * factor,
            per_attended=self.per_attended * factor,
        )


def call_attention(rows: int, own: int, pool: int | None) -> int:
    """Positions a call of ``rows`` rows attends in all: ``own`` (each row's own
    sequence up to it) or, over a pool of ``pool`` used cells that every row attends
    to, each row all of them and the call's new ones."""
    if pool is None:
        return own
    return rows * (pool + rows)


def attended(start: int, n: int) -> int:
    """Positions the rows ``start .. start + n - 1`` of one sequence attend to, together
    (each row the positions before it and itself)."""
    return n * start + n * (n + 1) // 2


@dataclass(frozen=True)
class StepBudget:
    """How long one step may take while an interactive request generates."""

    seconds: float
    cost: CallCost
    min_piece: int = MIN_PIECE
    spent: float = 0.0
    """Seconds the streams already waited this step before its calls: copying a
    conversation into or out of llama.cpp's memory to fill a slot, or a finished one's
    state for the disk cache. The step's calls get the rest; when that rest leaves no
    room for the smallest piece that would fit otherwise, the prompt waits one step."""
    margin: float = 1.0
    """How many times its predicted cost a call may take (``CostFit.margin``): pieces
    are planned by the cost times this, so a step stays within the budget though
    calls of one size vary."""


def largest_piece(
    seconds: float,
    cost: CallCost,
    *,
    start: int,
    n_max: int,
    rows: int = 0,
    attending: int = 0,
    n_min: int = MIN_PIECE,
) -> int:
    """The most prompt tokens from position ``start`` (at most ``n_max``) that a call
    already carrying ``rows`` rows attending ``attending`` positions can add and still
    cost at most ``seconds``; at least ``min(n_min, n_max)``."""
    floor = max(0, min(n_min, n_max))

    def fits(n: int) -> bool:
        return cost.of(rows + n, attending + attended(start, n)) <= seconds

    if n_max <= floor or not fits(floor + 1):
        return floor
    lo, hi = floor + 1, n_max  # fits(lo) holds; the cost grows with n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def effective_priority(priority: str, waited_s: float, waited_steps: int) -> int:
    """0 for interactive work, 1 for background work that has not yet waited
    :data:`BACKGROUND_AGE_S` seconds or :data:`BACKGROUND_AGE_STEPS` steps."""
    if priority != "background":
        return 0
    return 0 if waited_s >= BACKGROUND_AGE_S or waited_steps >= BACKGROUND_AGE_STEPS else 1


def by_priority(items: Sequence[T], rank: Callable[[T], int]) -> list[T]:
    """``items`` (in arrival order) with the lower ``rank`` first, arrival order kept
    within a rank."""
    return sorted(items, key=rank)


@dataclass(frozen=True)
class PieceRules:
    """How this context cuts prompts (fixed for the worker's life)."""

    deterministic: bool
    """Bit-exact mode: pieces on the fixed grid (:func:`~.chunking.piece_end`)."""
    n_batch: int
    n_ubatch: int
    align: int
    """The grid spacing (:func:`~.chunking.grid_align`)."""
    window_checkpoints: bool
    """Checkpoints at piece starts and the prompt's end instead of cuts near them
    (``SlotMemory.window_checkpoints``)."""


@dataclass(frozen=True)
class PromptRead:
    """Where a request reading its prompt stands (plain data the plan decides from)."""

    n_past: int
    """Entries its slot holds (where the next piece starts)."""
    n_prompt: int
    media: Mapping[int, int] = field(default_factory=dict)
    """Each image's first position -> the positions it takes."""
    targets: tuple[int, ...] = ()
    """Checkpoint cut points still ahead (ascending)."""
    marks: tuple[int, ...] = ()
    """The prompt's mark cut points (:func:`~.chunking.marker_cuts`)."""
    lora_start: int = 0
    """Where an activated LoRA starts: no piece spans it."""
    last_checkpoint: int | None = None
    """Entries of the slot's newest checkpoint (None: it has none)."""
    beside: int = 0
    """Pieces it read beside generating requests (under a budget) so far."""

    @property
    def long_first(self) -> bool:
        """Its next piece is a long prompt's first beside the streams: read at
        :data:`FIRST_PIECE` at most (the fit has not yet timed a piece at this point of
        llama.cpp's memory; the cells a fill just copied or parked change every row's
        cost)."""
        return self.beside == 0 and self.n_prompt - self.n_past > FIRST_PIECE_ABOVE


@dataclass(frozen=True)
class PromptPiece(Generic[T]):
    """One piece of one prompt: its images at ``media``, in order, then tokens
    ``[start, end)`` in one decode call."""

    request: T
    media: tuple[int, ...]
    start: int
    end: int
    window: bool = False
    """Window checkpoints apply: one at the prompt's end once its first token is out."""
    targets_taken: int = 0
    """Checkpoint targets within reach of ``start`` that this piece settles there."""
    checkpoint_at_start: bool = False
    """Save a checkpoint before decoding (the newest one is not close enough)."""
    adapters: bool = True
    """The request's LoRA applies to the tokens (not before an aLoRA's activation)."""


@dataclass(frozen=True)
class StepPlan(Generic[T]):
    """One worker step, in the order it runs."""

    decode_groups: tuple[tuple[T, ...], ...]
    """Generating requests whose next token shares a ``llama_decode``, one call per group."""
    verify: tuple[T, ...]
    """Requests verifying a draft, each in its own call (rows roll back on rejection)."""
    drafts: tuple[tuple[int, ...], ...] = ()
    """The draft each of ``verify`` checks after its pending token (same order)."""
    prompt: PromptPiece[T] | None = None
    """The prompt piece read last (after the generation calls)."""
    with_prompt: tuple[T, ...] = ()
    """Generating requests whose next token rides in the prompt piece's call (not in
    ``decode_groups``): the running streams wait for one call, not for two."""
    more_prompts: tuple[PromptPiece[T], ...] = ()
    """Pieces of younger requests' prompts that fill the rest of the piece's call (no
    images; the same adapters), as llama.cpp's server fills a batch from every slot
    reading its prompt: requests that arrive together are read together."""

    def verifies(self) -> Iterator[tuple[T, tuple[int, ...]]]:
        """``(request, draft)`` pairs, in order."""
        return zip(self.verify, self.drafts, strict=True)


def row_limit(n_generating: int, *, deterministic: bool, kv_unified: bool, exact_rows: int) -> int:
    """The most generation rows one call may carry.

    All of them by default, as llama.cpp's server; in deterministic mode with per-slot
    KV streams, no more than the kernels keep bit-identical (probed at load)."""
    if kv_unified or not deterministic:
        return max(1, n_generating)
    return exact_rows


def plan_piece(request: T, read: PromptRead, rules: PieceRules) -> PromptPiece[T]:
    """The next piece of ``request``'s prompt.

    Images at the resume point are read first (each its own decode calls); an image
    that would end the prompt is the last thing planned (the worker refuses it: the
    text after an image is what shows an overflow under adapters). The text piece then
    ends at the first checkpoint target, image or aLoRA activation after its start, at
    the prompt's end or after ``n_batch`` tokens; in deterministic mode on the grid."""
    n_prompt = read.n_prompt
    images: list[int] = []
    pos = read.n_past
    while pos < n_prompt and pos in read.media:
        images.append(pos)
        if pos + read.media[pos] >= n_prompt:
            return PromptPiece(request, tuple(images), pos, pos)
        pos += read.media[pos]
    start = pos
    window = rules.window_checkpoints and not read.media
    targets = list(read.targets)
    taken = 0
    at_start = False
    if window:
        # checkpoints wanted just after the start are taken at it, before the piece is
        # decoded (no decode call of their own), unless one close enough exists
        near = [t for t in targets if t <= start + WINDOW_SLACK]
        if near:
            taken = len(near)
            del targets[:taken]
            last = read.last_checkpoint
            at_start = last is None or last < near[-1] - WINDOW_SLACK
    stops = [*targets, *read.media, *([read.lora_start] if read.lora_start > start else [])]
    if rules.deterministic:
        end = piece_end(
            start,
            n_prompt,
            min(rules.n_batch, rules.n_ubatch),
            rules.align,
            stops=stops,
            marks=read.marks,
        )
    else:
        end = fast_piece_end(start, n_prompt, rules.n_batch, stops=stops)
    return PromptPiece(
        request,
        tuple(images),
        start,
        end,
        window=window,
        targets_taken=taken,
        checkpoint_at_start=at_start,
        adapters=start >= read.lora_start,
    )


def plan_step(
    generating: Sequence[T],
    *,
    drafting: Callable[[T], bool] | None = None,
    limit: int,
    lora_of: Callable[[T], Hashable],
    turn: int,
    drafts: Callable[[T], Sequence[int]] | None = None,
    reading: Sequence[tuple[T, PromptRead]] = (),
    rules: PieceRules | None = None,
    mix: bool = False,
    budget: StepBudget | None = None,
    position: Callable[[T], int] | None = None,
) -> StepPlan[T]:
    """Plan one step for ``generating`` (in slot order) and ``reading`` (in arrival order).

    A generating request verifies the draft ``drafts`` gives it (or, without
    ``drafts``, whenever ``drafting`` says so); the others decode their next token.
    Requests with different LoRA sets never share a call (the adapters are set per
    context); ``turn`` rotates which set goes first; each set's requests are split
    into the fewest calls of at most ``limit`` rows. The oldest request still reading
    its prompt reads one piece of it (:func:`plan_piece`, ``rules`` needed then); with
    ``mix``, outside deterministic mode, younger ones fill the rest of that call
    (:func:`more_pieces`).

    With ``mix`` (the memory can drop the rows of an aborted call) and outside
    deterministic mode, the first decode group with the piece's adapter set joins the
    piece's call, as llama.cpp's server batches the next tokens with a prompt chunk: the
    piece gives up as many tokens as the group has rows, so the call stays within
    ``n_batch``, and the running streams wait for that one call instead of their own
    call and then the piece's.

    With ``budget`` (an interactive request generates; ``position`` gives a generating
    request's next position) the piece is cut so the step's calls together cost at most
    ``budget.seconds`` (:func:`largest_piece`; at least ``budget.min_piece`` tokens, and
    in deterministic mode a multiple of the grid spacing, the grid kept); younger
    prompts fill what is left of it; a long prompt's first piece beside the streams
    reads at most :data:`FIRST_PIECE`, and costs are the fit's times ``budget.margin``.
    Images are read whole whatever they cost. Time
    the step already spent before its calls (``budget.spent``) counts too: when it
    leaves no room for the smallest piece and either that piece would have fit without
    it or it was a real copy (:data:`COPY_SHARE` of the budget, or as long as that
    piece), the plan reads no prompt this step.
    """
    draft_of = {id(r): tuple(drafts(r)) for r in generating} if drafts is not None else {}

    def verifying(r: T) -> bool:
        if drafts is not None:
            return bool(draft_of[id(r)])
        return drafting is not None and drafting(r)

    plain = [r for r in generating if not verifying(r)]
    groups = tuple(
        tuple(group)
        for part in plan_adapter_groups(plain, lora_of, turn)
        for group in balanced_groups(part, limit)
    )
    verify = tuple(r for r in generating if verifying(r))
    drafted = tuple(draft_of.get(id(r), ()) for r in verify)
    if not reading:
        return StepPlan(groups, verify, drafted)
    if rules is None:
        raise ValueError("plan_step(reading=...) needs the piece rules")
    request, read = reading[0]
    piece = plan_piece(request, read, rules)
    riding: tuple[T, ...] = ()
    all_groups = groups
    mixing = mix and not rules.deterministic and piece.end > piece.start
    # (not before an aLoRA's activation: the piece decodes without the request's set)
    if mixing and piece.adapters:
        lora = lora_of(request)
        for i, group in enumerate(groups):
            if len(group) < rules.n_batch and lora_of(group[0]) == lora:
                riding = group
                groups = groups[:i] + groups[i + 1 :]
                break
    n_batch = rules.n_batch - len(riding)
    left: tuple[float, CallCost, int, int] | None = None
    if budget is not None and piece.end > piece.start:
        if position is None:
            raise ValueError("plan_step(budget=...) needs the generating positions")
        cost = budget.cost.scaled(budget.margin)
        spent = sum(cost.of(len(g), sum(position(r) + 1 for r in g)) for g in groups)
        spent += sum(
            cost.of(1 + len(d), attended(position(r), 1 + len(d)))
            for r, d in zip(verify, drafted, strict=True)
        )
        seconds = budget.seconds - spent
        ride = sum(position(r) + 1 for r in riding)
        if budget.spent > 0:
            first = min(budget.min_piece, piece.end - piece.start)
            call = cost.of(len(riding) + first, ride + attended(piece.start, first))
            if seconds < call + budget.spent and (
                call <= seconds or budget.spent >= min(call, COPY_SHARE * budget.seconds)
            ):
                # the slot's fill (or a save) took the piece's time, or was itself a
                # real copy (a quarter of the budget, or longer than the piece): the
                # streams decode alone this step and the prompt reads from the next one
                return StepPlan(all_groups, verify, drafted)
            seconds -= budget.spent
        if piece.media:  # an image encode cannot be cut: the text after it waits
            cap = budget.min_piece
        else:
            cap = largest_piece(
                seconds,
                cost,
                start=piece.start,
                n_max=n_batch,
                rows=len(riding),
                attending=ride,
                n_min=budget.min_piece,
            )
            if read.long_first:  # the fit learns from it
                cap = min(cap, max(budget.min_piece, FIRST_PIECE))
        if rules.deterministic:
            # whole grid cells, the same cuts a piece alone could have; two at least, so
            # a prompt's one-token tail can still join the cell before it (a lone row
            # takes another kernel path: its logits would differ)
            cap = max(2 * rules.align, cap // rules.align * rules.align)
        n_batch = min(n_batch, cap)
        left = (seconds, cost, len(riding), ride)
    if n_batch != rules.n_batch:
        piece = plan_piece(request, read, replace(rules, n_batch=n_batch))
    if not mixing:
        return StepPlan(groups, verify, drafted, piece)
    room = rules.n_batch - len(riding) - (piece.end - piece.start)
    if left is not None:
        seconds, cost, rows, ride = left
        left = (
            seconds,
            cost,
            rows + piece.end - piece.start,
            ride + attended(piece.start, piece.end - piece.start),
        )
    more = more_pieces(reading[1:], lora_of, _applied(piece, lora_of), room, rules, left)
    return StepPlan(groups, verify, drafted, piece, riding, more)


def _applied(piece: PromptPiece[T], lora_of: Callable[[T], Hashable]) -> Hashable:
    """The adapter set ``piece``'s tokens decode with (None: the base model)."""
    return (lora_of(piece.request) or None) if piece.adapters else None


def more_pieces(
    reading: Sequence[tuple[T, PromptRead]],
    lora_of: Callable[[T], Hashable],
    lora: Hashable,
    room: int,
    rules: PieceRules,
    budget: tuple[float, CallCost, int, int] | None = None,
) -> tuple[PromptPiece[T], ...]:
    """Pieces of ``reading``'s prompts (in arrival order) for the ``room`` tokens left in
    a prompt piece's call decoding with adapter set ``lora``: each the piece
    :func:`plan_piece` cuts within the room left (so checkpoints and activations still
    end pieces), skipping a prompt that would read an image first or decode with other
    adapters. With ``budget`` (the seconds the call may take, its cost model, and the
    rows and attended positions it has so far) each also within the time left."""
    out: list[PromptPiece[T]] = []
    for request, read in reading:
        if room <= 0:
            break
        cap = room
        if budget is not None:
            seconds, cost, rows, ride = budget
            cap = largest_piece(
                seconds, cost, start=read.n_past, n_max=room, rows=rows, attending=ride, n_min=0
            )
            if cap <= 0:
                break
            if read.long_first:
                cap = min(cap, FIRST_PIECE)
        piece = plan_piece(request, read, replace(rules, n_batch=cap))
        if piece.media or piece.end <= piece.start or _applied(piece, lora_of) != lora:
            continue
        out.append(piece)
        n = piece.end - piece.start
        room -= n
        if budget is not None:
            seconds, cost, rows, ride = budget
            budget = (seconds, cost, rows + n, ride + attended(piece.start, n))
    return tuple(out)
