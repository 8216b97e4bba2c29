"""Per-geometry state: one owner, so that forgetting it is one call.

Every module that keeps something per geometry (shapes, send rows, captured graphs, ``auto``'s
predictions, compiled kernels) makes its cache with :func:`per_geometry` or registers its own
forget step with :func:`on_forget`; :func:`forget_all` (called by
``sparsp.close_transports``) empties them all. Two rules for what a cache holds: a small
least-recently-used cache (:func:`lru_get`), and the same with a CUDA graph captured on a
key's second call (:func:`captured_on_second_sight`)."""

from __future__ import annotations

import logging
from collections import OrderedDict

log = logging.getLogger("sparsp")

_FORGET: list = []  # (name, forget, size or None) per registered cache


def per_geometry(name: str) -> OrderedDict:
    """A new, empty cache that :func:`forget_all` empties. ``name`` says what it holds (for
    readers, debugging and :func:`sizes`)."""
    cache: OrderedDict = OrderedDict()
    _FORGET.append((name, cache.clear, cache.__len__))
    return cache


def on_forget(name: str, forget, size=None) -> None:
    """Register ``forget()`` (no arguments) to run on :func:`forget_all`: for state that is more
    than one mapping (a group's shapes, a compiled kernel's table). ``size()``, when given,
    counts what it holds (:func:`sizes`)."""
    _FORGET.append((name, forget, size))


def forget_all() -> None:
    """Empty every per-geometry cache of the process; safe to call twice."""
    for _, forget, _ in _FORGET:
        forget()


def registered() -> list[str]:
    """The names of every registered cache, in registration order."""
    return [name for name, _, _ in _FORGET]


def sizes() -> dict[str, int | None]:
    """Entries each registered cache holds now (None where it registered no count)."""
    return {name: size() if size is not None else None for name, _, size in _FORGET}


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

