"""Heads given to ranks by their density, for a head-sharded strategy (``ulysses``).

After its all-to-all, a head-sharded rank computes whole heads over every token, so its work
is the sum of its heads' kept blocks. Heads of one layer differ in density by an order of
magnitude in real models, and contiguous head groups (rank r: heads [r·H/G, (r+1)·H/G)) leave
the rank with the densest group the slowest. ``balanced_heads`` gives heads to ranks by the
greedy longest-processing-time rule with exactly H/G heads per rank: heads in descending order
of kept blocks, each to the rank with the least so far among those with room. The mask is the
same on every rank (``plan.gather_metadata``), so every rank derives the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_heads", "contiguous_heads", "head_balance", "max_over_mean", "rank_loads"]


def contiguous_heads(heads: int) -> tuple[int, ...]:
    """The order a head-sharded strategy uses by default: rank r takes heads r·H/G onwards."""
    return tuple(range(heads))


def rank_loads(kept: Sequence[int], ranks: int, order: Sequence[int] | None = None) -> list[int]:
    """Kept blocks per rank when rank r computes heads ``order[r·H/G : (r+1)·H/G]`` (None:
    the contiguous order); ``kept[h]``: head h's kept blocks."""
    H = len(kept)
    if H % ranks:
        raise ValueError(f"{H} heads do not divide over {ranks} ranks")
    order = contiguous_heads(H) if order is None else tuple(order)
    if sorted(order) != list(range(H)):
        raise ValueError(f"head order {order} is not a permutation of {H} heads")
    per = H // ranks
    return [sum(kept[h] for h in order[r * per:(r + 1) * per]) for r in range(ranks)]


def balanced_heads(kept: Sequence[int], ranks: int) -> tuple[int, ...]:
    """A head order (rank r computes ``order[r·H/G : (r+1)·H/G]``, ascending within a rank)
    whose busiest rank has as few kept blocks as the greedy rule gives (module docstring),
    and never more than the contiguous order's: where the greedy result is no better, the
    contiguous order itself (so balancing never costs, and an even mask keeps its order).
    Ties go to the lower head and the lower rank: the result is a pure function of ``kept``."""
    H = len(kept)
    if ranks < 1 or H % ranks:
        raise ValueError(f"{H} heads do not divide over {ranks} ranks")
    per = H // ranks
    load, given = [0] * ranks, [[] for _ in range(ranks)]
    for h in sorted(range(H), key=lambda h: (-kept[h], h)):
        r = min((r for r in range(ranks) if len(given[r]) < per), key=lambda r: (load[r], r))
        given[r].append(h)
        load[r] += kept[h]
    order = tuple(h for r in range(ranks) for h in sorted(given[r]))
    if max(load) >= max(rank_loads(kept, ranks)):
        return contiguous_heads(H)
    return order


def head_balance(kept: Sequence[int], ranks: int) -> dict:
    """A head-sharded strategy's per-rank kept blocks for one mask, contiguous and balanced
    (``kept[h]``: head h's kept blocks): each with its busiest rank over the mean, the rank
    whose heads are densest, and the balanced head order."""
    order = balanced_heads(kept, ranks)
    plain, even = rank_loads(kept, ranks), rank_loads(kept, ranks, order)
    return {"kept_per_rank": plain, "kept_max_over_mean": max_over_mean(plain),
            "densest_rank": plain.index(max(plain)),
            "balanced_kept_per_rank": even, "balanced_kept_max_over_mean": max_over_mean(even),
            "head_order": list(order)}


def max_over_mean(per_rank: Sequence[float]) -> float:
    """The busiest rank over the mean, to 4 places (1.0: balanced, or nothing to do)."""
    mean = sum(per_rank) / len(per_rank)
    return round(max(per_rank) / mean, 4) if mean > 0 else 1.0
