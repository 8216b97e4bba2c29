"""The per-geometry caches' two rules: one small least-recently-used cache (the plan's kept send
rows and gathered rows, ``strategy="auto"``'s predictions), and the same with a CUDA graph
captured on a key's second call (the summing kernel's, the plan stage's)."""

from __future__ import annotations

import logging
from collections import OrderedDict

log = logging.getLogger("sparsp")


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


_FAILED = object()


def captured_on_second_sight(cache: OrderedDict, key, capture, limit: int, *, what: str, otherwise: str,
                             ready=None):
    """The CUDA graph (or whatever ``capture()`` makes) kept for ``key`` from the key's second
    call on, or None where the caller runs its work itself: the first call of a key (its eager
    run fills the per-geometry constants a capture reads), a call ``ready()`` declines (when
    given), and every call after a capture that raised (logged once: "CUDA graph capture of
    ``what`` failed …; this geometry ``otherwise``"). At most ``limit`` keys, the least recently
    used dropped first (with what was made for them)."""
    if key not in cache:
        cache[key] = None
        while len(cache) > limit:
            cache.popitem(last=False)
        return None
    cache.move_to_end(key)
    got = cache[key]
    if got is _FAILED or (ready is not None and not ready()):
        return None
    if got is None:
        try:
            got = capture()
        except Exception as e:  # a capture error leaves the caller's own path intact
            log.warning("sparsp: CUDA graph capture of %s failed (%s: %s); this geometry %s",
                        what, type(e).__name__, e, otherwise)
            cache[key] = _FAILED
            return None
        cache[key] = got
    return got

