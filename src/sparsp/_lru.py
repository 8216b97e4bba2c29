"""One small least-recently-used cache rule, shared by the per-geometry caches (the plan's kept
send rows and gathered rows, ``strategy="auto"``'s predictions)."""

from __future__ import annotations

from collections import OrderedDict


def lru_get(cache: OrderedDict, key, make, limit: int):
    """``cache[key]``, made by ``make()`` on a miss; at most ``limit`` entries, the least
    recently used dropped first."""
    got = cache.get(key)
    if got is None:
        got = cache[key] = make()
        while len(cache) > limit:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return got
