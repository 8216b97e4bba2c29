"""``sp_attention``: one entry point, every registered strategy (DESIGN.md "Baselines").

Data path per call: validate → agree shapes (cached per geometry) → one metadata all-gather
(header + pooled summaries → the whole block mask) → plan (the strategy's payload selections)
→ one host sync (header checks, layouts; the transport's fence runs on the host while the
device works towards it) → transport → kernel → LSE merge.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..config import SparspConfig
from ..groups import marker as record_function  # a no-op unless a profiler records
from ..plan import TAIL, forget_shapes, gather_metadata, remask
from ..transport import make_transport
from . import captured, ring, ring_relay, sparsp, ulysses  # noqa: F401  (each registers its strategies)
from .auto import AUTO, PLANNED, choose_from, forget as forget_auto
from .base import Call, forget_geometries, validate
from .registry import StrategyName, StrategySpec, register_strategy, strategy_names, strategy_spec

log = logging.getLogger("sparsp")

_transports: dict = {}


def get_transport(name: str, group, device: torch.device, timeout_s: float):
    """The transport for (group, name, device), made once and reused across calls."""
    key = (id(group), name, str(device))
    t = _transports.get(key)
    if t is None:
        t = make_transport(name, group, device=device, timeout_s=timeout_s)
        _transports[key] = t
    return t


def close_transports() -> None:
    """Release every cached transport (shared memory, IPC handles) and the per-geometry
    caches; safe to call twice."""
    forget_shapes()
    forget_geometries()
    forget_auto()
    captured.forget()
    while _transports:
        _, t = _transports.popitem()
        t.close()


def comm_bytes(masks, placement, strategy: str, *, head_dim: int, dtype_bytes: int = 2) -> dict:
    """Bytes each rank receives per call under ``strategy`` (its registered byte rule)."""
    return strategy_spec(strategy).comm_bytes(masks, placement, head_dim=head_dim, dtype_bytes=dtype_bytes)


def sp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    strategy: str = "sparsp",
    config: SparspConfig = SparspConfig(),
    _global_mask: torch.Tensor | None = None,
    _timer=None,
) -> torch.Tensor:
    """Sequence-parallel block-sparse attention over ``group``.

    ``q, k, v``: this rank's contiguous slice (B, S_local, H, D) of the (already placed)
    sequence; the slices concatenated in rank order form the global sequence, and each slice
    is cut into ``config.block_size`` blocks from its start. Returns this rank's output slice,
    same shape and dtype as ``q``: attention over the global sequence restricted to the block
    mask ``sparsp.masks.split_mask`` computes on the concatenated q and k (equal to
    ``block_mask`` when every slice but the last is a whole number of blocks).
    ``strategy="ring"`` is the dense baseline and ignores the thresholds; ``strategy="auto"``
    picks one per call from the call's own mask and a machine profile (``strategies/auto.py``).
    ``_global_mask``
    (bool [B, H, N, N], N = global blocks) replaces the CDF mask — for tests; ``_timer``
    (a ``base.PhaseTimer``) times the phases — for benchmarks.
    """
    validate(q, k, v, group, strategy, config)
    spec = strategy_spec(strategy) if strategy != AUTO else None  # auto: chosen per call below
    computed = (spec is None or spec.sparse) and _global_mask is None and not config.dense
    transport = get_transport(config.transport, group, q.device, config.timeout_s)
    timer = _timer
    mask_phase = timer.phase("mask") if timer is not None else contextlib.nullcontext()
    # auto stages sparsp's payloads with the figures it chooses from (strategies/auto.py)
    planned, auto = (strategy_spec(PLANNED), True) if strategy == AUTO else (spec, False)
    graphed = captured.eligible(q, planned, config, computed)
    early = config.local_first is not False and planned.local_first  # Call.attend_local_early
    with torch.no_grad():
        mask_phase.__enter__()
        mask_open = True
        fenced = False
        with record_function("sparsp.metadata"):
            # the mask is the plan stage's (captured.stage), with or without a graph
            meta = gather_metadata(q, k, v, group, config, strategy, sparse=computed)
        while True:  # once, unless the geometry changed: see plan.gather_metadata
            with record_function("sparsp.plan"):
                # from the gathered rows to the counts: a CUDA graph per geometry (captured.py)
                replay = (captured.replayed(q, k, v, meta, group, planned, config, transport, auto=auto)
                          if graphed else None)
                if replay is not None:
                    (call, staged), error = replay, None
                else:
                    call, staged, error = captured.stage(q, k, v, meta, group, planned, config,
                                                         transport, _global_mask, auto=auto)
            with record_function("sparsp.resolve"):
                read = meta.start_read(staged)  # the one host sync: its copy is queued now
                if early and error is None and (meta.fits or not computed) and \
                        (config.local_first or call.local_first_pays()):
                    # the local shard needs nothing the read brings: the device computes it
                    # while the host waits, checks the headers and issues the first round
                    if mask_open:
                        mask_phase.__exit__(None, None, None)
                        mask_open = False
                    call.timer = timer
                    call.attend_local_early()
                if not fenced:
                    # the transport's once-per-call fence (host work: its checks of the last
                    # call's transfers, a barrier, the flag reset) while the device runs the
                    # plan stage and the read's copy, instead of after the read, where the
                    # device would wait for it before the first pack
                    transport.fence()
                    fenced = True
                resolved = meta.finish(staged, read)
            if resolved is not None:
                break
            graphed = False  # the geometry changed: the true shapes' stage runs eagerly
            meta = remask(meta, group) or \
                gather_metadata(q, k, v, group, config, strategy, sparse=computed)
        if mask_open:
            mask_phase.__exit__(None, None, None)
        if error is not None:
            raise ValueError(error)
        if auto:  # the choice, from the figures of the same host read
            spec = strategy_spec(choose_from(resolved[1][TAIL], call.shapes, q, group, config, transport))
            if spec.name != planned.name:
                call = call.without_plan(spec)
        call.timer = timer
        call.set_resolved(*resolved)
        # slot windows sized for the worst case, a full shard per peer (collective only when
        # growing, and then a fence of its own: the windows are made anew)
        transport.reserve(call.shapes.capacity_rows * 2 * call.shapes.head_dim * q.element_size())
        with record_function("sparsp.run"):
            try:
                spec.run(call)
                call.finish()  # the last merge, written as the output
            finally:  # the compute stream after the side stream's packs and transfers, also
                call.join()  # when the run raised: nothing of the call stays unordered
        # the transfers the GPU waits for on its own: the host checks their flags now, with the
        # timeout, so a dead peer raises in this call (transport/slots.py, settle)
        transport.settle()
    return call.result()


__all__ = ["Call", "StrategyName", "StrategySpec", "close_transports", "comm_bytes", "get_transport",
           "register_strategy", "sp_attention", "strategy_names", "strategy_spec"]
