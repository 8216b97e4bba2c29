"""One GPU: the block-sparse kernel where the call's mask pays, the dense kernel where it does not.

On a group of one nothing moves, so a call's mask raises one question: does skipping its
dropped blocks save time? The block-sparse kernel runs the kept block pairs at its own rate,
which on a GPU is a little below the best dense kernel's (FA4 block-sparse 0.96-1.01x cuDNN
dense per kept block on an H200, flex 0.66-0.70x: ``kernels/__init__.py``), so a mask that
keeps nearly everything is faster dense. Which side a mask falls on depends on the kernels,
the GPU and the shapes, so it is measured, not assumed:

* rates, once per (shapes, dtype, device, sparse kernel), on that geometry's ``MEASURE_AT``-th
  call (the first calls compile kernels): the sparse kernel on the call's own block lists and
  every dense candidate (``kernels/dense.py``) on its q, k, v, each timed ``REPEATS`` times after
  a warm-up (CUDA events, medians); the sparse kernel's time per kept block pair, and the
  fastest dense kernel with its time;
* every later call: the dense kernel when its kept pairs at the sparse rate would take at
  least as long as the dense kernel over all of them (``choose``), else the sparse kernel.

So the layers of one model can differ: each call decides on its own mask. The mask itself is
computed either way (the decision reads it, in the call's one host read), so its cost counts
on both sides and does not enter the comparison. The decision is logged
once per geometry and decision on the ``sparsp`` logger; ``last_choice()`` returns the latest.

A call on one rank without a mask (``ring``, a dense config) takes the fastest dense kernel
once the rates are measured: no block lists, no merge. It applies where a call's group has
one rank and its mask is computed or absent (a test's mask runs as given), on the device types
of ``DEVICES`` (CUDA: a CPU run has no kernel worth switching to, and the CPU suite holds the
sparse path to its reference); elsewhere only the kept share is recorded.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

from ..caches import per_geometry
from ..kernels import LocalKV
from ..kernels.dense import DenseFn, dense_kernels
from ..timing import times_ms

log = logging.getLogger("sparsp")

DEVICES = ("cuda",)
"""Device types where a call on one rank may take the dense kernel."""
MEASURE_AT = 3
"""The call of a geometry whose inputs the rates are measured on (the ones before it warm up
the kernels: FA4 compiles on its first call of a shape)."""
REPEATS = 5
"""Timed runs per kernel when measuring (after one warm-up run each); the median counts."""


@dataclass
class Rates:
    """What one geometry's kernels cost, measured on one call."""

    sparse_ms_per_pair: float  # the block-sparse kernel per kept block pair
    dense_name: str  # the fastest dense kernel (``kernels/dense.py``)
    dense_ms: float  # its time over every block pair
    dense_fn: DenseFn


@dataclass(frozen=True)
class Choice:
    """One call's decision."""

    dense: bool
    kernel: str  # the kernel that ran: the dense one's name, or the sparse kernel's
    kept: float  # share of the block pairs the mask keeps
    sparse_ms: float | None  # the sparse kernel's estimate for this call (None before the rates)
    dense_ms: float | None


_RATES = per_geometry("one GPU: measured sparse and dense kernel rates")  # key -> Rates | None
_SEEN = per_geometry("one GPU: calls per geometry before the rates")  # key -> count
_LOGGED = per_geometry("one GPU: decisions logged")  # (key, dense) -> True
_last: Choice | None = None


def last_choice() -> Choice | None:
    """The latest decision made in this process (None before the first one-GPU call)."""
    return _last


def applies(call, computed: bool) -> bool:
    """Whether ``call`` picks its kernel here: one rank, and a mask computed from the call's
    summaries or none at all (a dense strategy or config; a test's mask is run as given)."""
    return call.world == 1 and (computed or call.full_mask is None)


def choose(call, layer: int | None = None) -> DenseFn | None:
    """The dense kernel to run this call with, or None for the block-sparse kernel; after the
    call's host read (``call.kept`` holds its kept block pairs). A call without a mask (a dense
    strategy or config) takes the fastest dense kernel once it is measured. Off ``DEVICES``
    only the kept share is recorded (``last_choice``)."""
    global _last
    sh = call.shapes
    total = sh.batch * sh.heads * sh.num_blocks[0] ** 2
    kept = total if call.full_mask is None else int(call.kept.get(0, total))
    key = (sh, call.q.dtype, str(call.q.device), call.kernel_name)
    rates = _RATES.get(key)
    if rates is None and call.q.device.type in DEVICES:
        seen = _SEEN[key] = _SEEN.get(key, 0) + 1
        if seen >= MEASURE_AT and kept > 0:
            rates = _RATES[key] = measure(call, kept)
    if rates is None:
        _last = Choice(False, call.kernel_name, kept / total, None, None)
        return None
    sparse_ms = kept * rates.sparse_ms_per_pair
    dense = call.full_mask is None or sparse_ms >= rates.dense_ms
    _last = Choice(dense, rates.dense_name if dense else call.kernel_name, kept / total, sparse_ms, rates.dense_ms)
    if call.full_mask is not None and (key, dense) not in _LOGGED:
        _LOGGED[(key, dense)] = True
        where = "" if layer is None else f"layer {layer}, "
        kernel = f"dense kernel {rates.dense_name}" if dense else f"sparse kernel {call.kernel_name}"
        log.info("sparsp: one GPU, %s%d tokens, %dx%d heads: the mask keeps %.1f%% of the block pairs: %s "
                 "(estimated ms: sparse %.3g, dense %.3g)", where, sh.seq_lens[0], sh.heads, sh.head_dim,
                 100 * kept / total, kernel, sparse_ms, rates.dense_ms)
    return rates.dense_fn if dense else None


def measure(call, kept: int) -> Rates:
    """Time the sparse kernel on ``call``'s own block lists (all of them for a call without a
    mask) and every dense candidate on its inputs (module docstring); ``RuntimeError`` when no
    dense kernel runs here."""
    q, k, v = call.q, call.k, call.v
    kv = LocalKV(k, v, call.shapes.block_size)
    num, idx = call.local_lists()
    q_hm = call.q_hm

    def sparse():  # the kernel and the output's one write in the caller's layout, as a call does
        o, _ = call.kernel(q_hm, kv, num, idx, scale=call.scale)
        return o.permute(0, 2, 1, 3).to(q.dtype).contiguous()

    sparse_ms = statistics.median(times_ms(sparse, warmup=1, iters=REPEATS, device=q.device))
    best: tuple[str, float, DenseFn] | None = None
    tried = []
    for name, fn in dense_kernels(q.device):
        try:
            ms = statistics.median(times_ms(lambda fn=fn: fn(q, k, v, call.scale), warmup=1, iters=REPEATS,
                                                device=q.device))
        except Exception as e:  # a kernel that cannot run this shape: the next one
            tried.append(f"{name}: {type(e).__name__}")
            continue
        tried.append(f"{name} {ms:.3g} ms")
        if best is None or ms < best[1]:
            best = (name, ms, fn)
    if best is None:
        raise RuntimeError("no dense attention kernel runs here: " + "; ".join(tried))
    log.debug("sparsp: one GPU rates: sparse %s %.3g ms for %d pairs; dense %s", call.kernel_name, sparse_ms,
              kept, ", ".join(tried))
    return Rates(sparse_ms / kept, best[0], best[1], best[2])
