"""The worker's measured cost of a decode call, for the stall budget's piece sizes.

A call's time is modelled as ``per_call + per_row * rows + per_attended * attended``
(:class:`~.scheduler.CallCost`): the weights read once per call, the rows' own work,
and attention, which grows with the positions each row attends to, so a piece late
in a long prompt costs more than an early one of the same size. :class:`CostFit`
fits the three numbers by least squares over the calls the worker timed, older ones
fading, starting from a prior that the first measurements quickly outweigh. Token
steps (a few rows) and prompt pieces are kept apart and weigh alike, so the many
token steps of a stream do not drown the few pieces the fit must predict.

A fit predicts the middle of a call's time, and a budget is a bound: :attr:`CostFit.margin`
is how far recent prompt pieces ran over their prediction (a high quantile of the
ratio), so the planner aims that much below the budget. It covers a shared machine's
jitter and a change the model cannot see until it has refitted (another conversation's
cells entering or leaving llama.cpp's memory change every row's attention).
"""

from __future__ import annotations

from collections import deque

from langchain_llamacpp_local.runtime.scheduler import CallCost, attended

#: Before anything was measured: about what a 135M model reads on two CPU cores.
PRIOR = CallCost(per_call=0.002, per_row=0.004, per_attended=2e-8)
#: Each new call's weight over the ones before it (older ones fade: the machine's load
#: changes); the prior weighs as this many calls.
FADE = 0.97
PRIOR_WEIGHT = 0.5
#: Calls with more rows than this are prompt pieces.
STEP_ROWS = 8
#: A call is learned as at most this many times what the fit predicts for it, once
#: the fit has this many calls and was solved a few calls ago (while a budget reads
#: it every step): on a shared machine one call descheduled for seconds would
#: otherwise multiply every prediction for dozens of steps, and the pieces shrink to
#: the minimum. A machine that really slows down is followed all the same, a few
#: calls later.
OUTLIER = 4.0
OUTLIER_AFTER = 16
OUTLIER_FRESH = 4

#: The margin is taken over this many recent prompt pieces ...
MARGIN_WINDOW = 24
#: ... as this quantile of their time over what the fit predicted for them ...
MARGIN_QUANTILE = 0.9
#: ... within these bounds (a fit that overestimates lets pieces grow a little; one
#: wildly off does not shrink them past half).
MARGIN_MIN = 0.9
MARGIN_MAX = 2.0

_Sums = tuple[list[list[float]], list[float]]


def _zero() -> _Sums:
    return [[0.0] * 3 for _ in range(3)], [0.0] * 3


class CostFit:
    """Online least squares of call time over ``(1, rows, attended)`` (see module)."""

    def __init__(self, prior: CallCost = PRIOR) -> None:
        self.prior = prior
        self._bins = {True: _zero(), False: _zero()}
        self._model = prior
        self._stale = False
        self._seen: set[bool] = set()
        self.n = 0
        #: :attr:`n` when the model was last solved (None: never)
        self._solved_at: int | None = None
        #: recent prompt pieces' measured time over the prediction they were planned by
        self._ratios: deque[float] = deque(maxlen=MARGIN_WINDOW)

    def observe(self, rows: int, attending: int, seconds: float) -> None:
        """Record one decode call: ``rows`` rows attending ``attending`` positions took
        ``seconds``."""
        if rows <= 0 or not seconds > 0:
            return
        kind = rows > STEP_ROWS
        if kind not in self._seen:  # the first call of a kind warms up (graph, pages)
            self._seen.add(kind)
            return
        solved = self._solved_at
        # the model solved a few calls ago: a budget is reading it (with none, nobody does)
        if solved is not None and self.n - solved <= OUTLIER_FRESH:
            predicted = self._model.of(rows, attending)
            if kind and predicted > 0:
                self._ratios.append(seconds / predicted)
            if self.n >= OUTLIER_AFTER:
                seconds = min(seconds, OUTLIER * predicted)
        a, b = self._bins[kind]
        x = (1.0, float(rows), float(attending))
        for i in range(3):
            b[i] = b[i] * FADE + x[i] * seconds
            for j in range(3):
                a[i][j] = a[i][j] * FADE + x[i] * x[j]
        self.n += 1
        self._stale = True

    @property
    def model(self) -> CallCost:
        """The fitted cost (solved when asked: a token step only adds its sums)."""
        if self._stale:
            self._model = self._solve()
            self._stale = False
            self._solved_at = self.n
        return self._model

    @property
    def margin(self) -> float:
        """How many times its prediction a prompt piece may take: the
        :data:`MARGIN_QUANTILE` of the recent pieces' ratio (1.0 before any was seen)."""
        if not self._ratios:
            return 1.0
        ranked = sorted(self._ratios)
        q = ranked[min(len(ranked) - 1, int(MARGIN_QUANTILE * len(ranked)))]
        return min(MARGIN_MAX, max(MARGIN_MIN, q))

    def _solve(self) -> CallCost:
        a = [[0.0] * 3 for _ in range(3)]
        b = [0.0] * 3
        counts = [ak[0][0] for ak, _ in self._bins.values()]
        most = max(counts)
        for count, (ak, bk) in zip(counts, self._bins.values(), strict=True):
            if count <= 0:
                continue
            w = most / count  # each kind of call weighs alike
            for i in range(3):
                b[i] += w * bk[i]
                for j in range(3):
                    a[i][j] += w * ak[i][j]
        # the prior as calls of a token step, a mid-size piece and a late long piece
        for rows, start in ((1, 1024), (64, 512), (512, 4096)):
            x = (1.0, float(rows), float(attended(start, rows)))
            y = self.prior.of(rows, int(x[2]))
            w = PRIOR_WEIGHT / 3
            for i in range(3):
                b[i] += w * x[i] * y
                for j in range(3):
                    a[i][j] += w * x[i] * x[j]
        coef = _solve3(a, b)
        if coef is None:
            return self._model
        per_call, per_row, per_att = coef
        if per_row <= 0:
            return self._model
        return CallCost(max(0.0, per_call), per_row, max(0.0, per_att))


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """``a x = b`` for a 3x3 system (Gaussian elimination with scaled partial pivoting),
    or None when it is singular."""
    scale = [max(abs(v) for v in row) or 1.0 for row in a]
    m = [[a[i][j] / scale[i] for j in range(3)] + [b[i] / scale[i]] for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= f * m[col][c]
    x = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        x[i] = (m[i][3] - sum(m[i][j] * x[j] for j in range(i + 1, 3))) / m[i][i]
    return x[0], x[1], x[2]
