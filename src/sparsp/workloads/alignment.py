"""The search for one head's alignment a: where its token density on the fit's sampled rows
meets a target (``sparsp.workloads.calibration``; docs/workloads.md, "Heads calibrated to a
profile").

The density falls as a grows, close to a logistic curve in log a below the noise's ceiling, so
the search runs on the density's logit against log a: secant steps, then the Illinois rule once
two points bracket the target, a bisection where that stalls. A rough search on an eighth of
the rows (an eighth of the work per step) gets near; the search on every row finishes from
there. A column head's density on 128 rows jumps where one row stops following the sinks (a
row then needs thousands of keys): the search strides across a plateau and stops on a jump.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from .scores import KeyCounter, RowScores

ALIGNMENT_RANGE = (0.01, 20.0)
"""The search's bounds on a: at 0.01 only the noise shapes the scores, at 20 a head keeps a
handful of keys."""
RELATIVE_TOLERANCE = 0.10
ABSOLUTE_TOLERANCE = 0.002


def tolerance(target: float) -> float:
    """The allowed |measured − target|: 10 % relative or 0.002 absolute, whichever is larger."""
    return max(RELATIVE_TOLERANCE * target, ABSOLUTE_TOLERANCE)


_MIDPOINT = {"column": 0.06, "diagonal": 0.7, "multi-diagonal": 0.7, "dense": 3.4}
"""The alignment at which a head of each kind keeps about half its ceiling: where the searches
start from (measured on the published profiles' layers)."""
_FIRST_ROWS = 16  # rows of the first, rough search; the rest join to finish it
_NARROWEST = 2e-3  # of log a: a bracket this narrow holds a jump, not the target


def fit_alignment(scores: RowScores, h: int, target: float, kind: str, mass: float, iterations: int,
                  counter: KeyCounter) -> tuple[float, float, bool]:
    """Head ``h``'s alignment, its density on the fit's rows and whether the target is in
    reach. A rough search on the first ``_FIRST_ROWS`` rows (an eighth of the work per step)
    gets near the target; the search on every row goes on from there, within half the
    tolerance, so the verification on another sample still lands within it."""
    tol = tolerance(target)
    keys, first = scores.geom.num_tokens, min(_FIRST_ROWS, scores.rows)
    head: dict[float, float] = {}  # counts over the first rows, by log a
    ceiling = _ceiling(mass, scores.noise)

    def rough(x: float) -> float:
        head[x] = scores.count(h, math.exp(x), mass, counter, slice(0, first))
        return head[x] / first / keys

    def every(x: float) -> float:
        top = head[x] if x in head else scores.count(h, math.exp(x), mass, counter, slice(0, first))
        return (top + scores.count(h, math.exp(x), mass, counter, slice(first, scores.rows))) / scores.rows / keys

    x, slope, steps = math.log(_MIDPOINT[kind]) - _logit(target, ceiling) / 5.0, -5.0, 0
    if first < scores.rows:
        steps = max(1, iterations // 2)
        near, slope = _search(rough, target, tol / 2, x, slope, steps, ceiling)
        x = min(near, key=lambda p: abs(p[1] - target))[0]
        steps = len(near)
    points, _ = _search(every, target, tol / 2, x, slope, max(1, iterations - steps), ceiling)
    x, d = min(points, key=lambda p: abs(p[1] - target))
    lo, hi = (math.log(v) for v in ALIGNMENT_RANGE)
    at_end = (x <= lo and d < target) or (x >= hi and d > target)  # the knob can go no further
    a = ALIGNMENT_RANGE[0] if x <= lo else ALIGNMENT_RANGE[1] if x >= hi else math.exp(x)
    return a, d, not at_end or abs(d - target) <= tol


def _ceiling(mass: float, noise: float) -> float:
    """A little above the densest a head can be: with a -> 0 its scores are σ² N(0, 1) per key,
    and the fewest keys holding ``mass`` are Φ(Φ⁻¹(mass) − σ²) of them (``CALIBRATION_MIX``)."""
    normal = statistics.NormalDist()
    return min(1.0, normal.cdf(normal.inv_cdf(mass) - noise * noise) + 0.02)


def _logit(d: float, ceiling: float) -> float:
    # The density against log a is close to a logistic curve below the ceiling: straight here.
    d = min(max(d, 1e-9), ceiling * (1 - 1e-3))
    return math.log(d) - math.log(ceiling - d)


def _search(measure: Callable[[float], float], target: float, aim: float, x: float, slope: float,
            steps: int, ceiling: float) -> tuple[list[tuple[float, float]], float]:
    """The (log a, density) points ``measure`` gave while looking for |density − target| <=
    ``aim`` in log a over ``ALIGNMENT_RANGE`` (the density falls as a grows), and the last
    slope of the density's logit (``_logit``) over log a: secant steps from ``x``, then the
    Illinois rule inside the bracket once the target lies between two points. An end is
    measured only when the search reaches it."""
    lo, hi = (math.log(v) for v in ALIGNMENT_RANGE)
    goal = _logit(target, ceiling)
    dense = sparse = None  # [x, logit − goal] nearest the target on each side
    last = None  # the side that moved last, for the Illinois rule
    widths = [math.inf, math.inf]  # of the bracket: bisect when two steps did not halve it
    stride = 0.0  # of the last step before a bracket: doubled on a plateau
    points: list[tuple[float, float]] = []
    for _ in range(steps):
        d = measure(x)
        points.append((x, d))
        g = _logit(d, ceiling) - goal
        flat = False
        if len(points) > 1 and points[-2][0] != x:
            s = (_logit(d, ceiling) - _logit(points[-2][1], ceiling)) / (x - points[-2][0])
            flat = s > -0.5  # a plateau between two rows' jumps: keep the slope, stride on
            slope = slope if flat else max(-50.0, s)
        if abs(d - target) <= aim:
            break
        side = "dense" if g > 0 else "sparse"
        if side == "dense":
            dense = [x, g]
        else:
            sparse = [x, g]
        if dense and sparse:
            if side == last:  # the other end has not moved twice: weigh it less
                other = sparse if side == "dense" else dense
                other[1] /= 2
            last = side
            (xa, ga), (xb, gb) = dense, sparse
            if xb - xa < _NARROWEST:
                break
            widths.append(xb - xa)
            if widths[-1] > widths[-3] / 2:  # a jump in the density (one row's keys) stalls the rule
                x = (xa + xb) / 2
            else:
                x = xa + ga * (xb - xa) / (ga - gb)
                x = min(max(x, xa + 0.02 * (xb - xa)), xb - 0.02 * (xb - xa))
        elif (side == "dense" and x >= hi) or (side == "sparse" and x <= lo):
            break  # beyond an end
        else:
            stride = 2 * stride if flat else min(0.7, max(_NARROWEST, abs(g / slope)))
            x = min(hi, max(lo, x + math.copysign(stride, -g / slope)))
    return points, slope
