"""The plan stage of a call: made eagerly or replayed as a CUDA graph (one per geometry), then
read in the call's one host read (``strategies/request.py``).

Between the metadata all-gather and the call's one host read, every rank turns the gathered
summaries into the whole block mask, the strategy's payload selections, the layouts awaiting
their counts and the vector of counts the host reads (``plan.Metadata.stage``), and the
kernels' block lists of the local shard and of every payload computed whole (``Call.lists``).
None of it reads the host, and its shapes are fixed by the geometry (group, shapes, summary capacity,
strategy, config, dtype, device, transport). It is a few hundred small ops, which the host
takes longer to queue than the device takes to run (docs/performance.md), so the call would
wait for the host. Captured once, the stage costs one graph launch (reading the gathered rows where the
metadata step keeps them; one copy of them first where it does not).

The first call of a geometry runs eagerly (it fills the per-geometry constants the stage
reads: block lengths, index ranges, thresholds); the second captures after an eager warm-up
on a side stream (lazy library handles) and replays; later calls replay. The graph's outputs
(mask, demand, selections, pending layouts, counts) live in its private pool and are
overwritten by the next replay, which the compute stream orders after every kernel of the
call that read them. A stage that cannot be captured (an op that syncs the host, e.g.) is
logged once and runs eagerly from then on. A capture costs what ``torch.cuda.graph`` does on
entry — a device synchronize and emptying the device and pinned-host allocator caches — once
per geometry, on its second call (a warm-up step of a denoising loop).

``strategy="auto"`` runs ``sparsp``'s stage with the figures its choice needs
(``cost.figures.call_figures``) in the same host read, captured alike. Not captured: a
``sim_threshold`` config (key smoothing adds collectives before the mask), test masks
(``_global_mask``), dense configs (no mask to compute) and a mesh call's sp step (its mask is
an input made by the call's head step, whose own stage is captured: ``strategies/meshed.py``). The CDF thresholds are an input of
the graph, copied in before each replay, not part of its key: the layers of one geometry with
thresholds of their own (``SparspConfig.thresholds``) replay one graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from .. import _triton
from ..caches import captured_on_second_sight, per_geometry
from ..cost.figures import call_figures
from ..masks import threshold_tensor
from ..plan import Metadata, Staged
from .call import Call


@dataclass
class _Stage:
    """One geometry's captured stage: its static input and the graph's outputs."""

    graph: torch.cuda.CUDAGraph
    rows: torch.Tensor  # the static input: the kept gathered rows, or a copy of them
    cdf: torch.Tensor  # the static input: the CDF thresholds, float32 [H]
    mask: torch.Tensor  # the whole mask
    demand: torch.Tensor | None  # every rank's demand (None: the plan read none)
    lists: dict  # the kernels' block lists (``Call.lists``)
    staged: Staged  # the pending layouts and the counts vector the host reads


_STAGES = per_geometry("captured: plan stages")  # key -> _Stage (``captured_on_second_sight``)
MAX_STAGES = 32
"""Geometries (and configs) whose stage is remembered; past this the least recently used is
dropped with its graph and memory pool (a caller sweeping thresholds per call makes a new
key each time)."""


def eligible(q: torch.Tensor, spec, config, computed: bool) -> bool:
    """Whether this call's stage may be captured (see the module docstring)."""
    return (config.cuda_graphs and q.device.type == "cuda" and computed and spec is not None
            and spec.sparse and config.sim_threshold is None)


def stage(q, k, v, meta: Metadata, group, spec, config, transport, global_mask=None, *,
          auto: bool = False, cdf: torch.Tensor | None = None) -> tuple[Call, Staged, str | None]:
    """The plan stage of a call on ``meta`` (the whole mask made here from its summaries):
    the ``Call`` of ``spec``, its staged
    counts (``Metadata.stage``) and a deferred error (raised once the shapes are confirmed).
    Device ops only, the same on the eager path and in a captured graph. ``auto``: ``spec`` is
    ``auto.PLANNED``'s and the figures ``auto.choose_from`` reads ride with the counts.
    ``cdf``: the CDF thresholds as a device input (a captured stage's, ``replayed``)."""
    shapes = meta.shapes
    N = shapes.total_blocks
    full_mask, error = None, None
    if spec.sparse:
        whole = (shapes.batch, shapes.heads, N, N)
        if global_mask is not None and tuple(global_mask.shape) != whole:
            error = f"_global_mask has shape {tuple(global_mask.shape)}; the inputs need {whole} ({N} blocks)"
            full_mask = torch.ones(whole, dtype=torch.bool, device=q.device)
        elif global_mask is not None:
            full_mask = global_mask.to(q.device, torch.bool)
        elif config.dense:
            full_mask = torch.ones(whole, dtype=torch.bool, device=q.device)
        else:  # the whole mask from the gathered summaries
            full_mask = meta.block_mask(config, cdf)
    call = Call(q, k, v, shapes, config, group, transport, full_mask=full_mask)
    selections = spec.plan(call) if spec.plan is not None else {}
    # auto's figures ride with the counts; a head-sharded strategy balances its ranks by the
    # kept pairs per head among them (``cost.figures.head_pairs``)
    sharded = spec.heads_divisible and full_mask is not None and shapes.world_size > 1
    tail = call_figures(full_mask, shapes) if auto or sharded else None
    staged = meta.stage(selections, call.kept_counts(), tail=tail)
    # the kernels' block lists: mask + ids known before the sync
    call.local_lists()
    for key, (origin, heads) in call.consumes.items():
        call.lists(origin, staged.pending[key].ids, heads)
    return call, staged, error


def _stage(q, k, v, meta: Metadata, rows: torch.Tensor, group, spec, config, transport, auto: bool, cdf):
    """``stage`` on the gathered ``rows`` and the thresholds ``cdf`` (the captured function)."""
    call, staged, _ = stage(q, k, v, meta.with_rows(rows), group, spec, config, transport, auto=auto, cdf=cdf)
    return call, staged


@lru_cache(maxsize=256)
def _keyed(config):
    """``config`` as a stage's key holds it: the CDF thresholds are the stage's input, not part
    of its key, so the layers of one geometry with thresholds of their own (``thresholds=``)
    share one graph instead of one each (``MAX_STAGES``)."""
    return replace(config, cdf_threshold=0.5)


def _capture(q, k, v, meta: Metadata, group, spec, config, transport, auto: bool) -> _Stage:
    # the static inputs: the gathered rows themselves where the metadata step keeps them in one
    # buffer per geometry (``summaries.gathered_rows``), so a replay copies nothing; else a
    # copy; and the thresholds, copied in before each replay
    rows = meta.rows if meta.rows_kept else meta.rows.clone()
    cdf = threshold_tensor(config.cdf_threshold, meta.shapes.heads, q.device).clone()
    args = (q, k, v, meta, rows, group, spec, config, transport, auto, cdf)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: library handles and workspaces before capture
        _, warm = _stage(*args)
    torch.cuda.current_stream().wait_stream(side)
    # the host read's copy as the graph's last node, into a pinned buffer kept with the stage:
    # no copy op and no allocator bookkeeping on the host per call; finish uses its values up
    # before the next call replays, as with ``groups.HostRead(reuse=True)``
    host = torch.empty(warm.flat.shape, dtype=warm.flat.dtype, pin_memory=True)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a transport's helper thread may use CUDA while this thread captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        call, staged = _stage(*args)
        host.copy_(staged.flat, non_blocking=True)
    staged = replace(staged, copied=(host, torch.cuda.Event()))
    # the capture's Call is dropped: it holds that call's q, k, v
    return _Stage(graph, rows, cdf, call.full_mask, call._demand, call._lists, staged)


def replayed(q, k, v, meta: Metadata, group, spec, config, transport, *,
             auto: bool = False) -> tuple[Call, Staged] | None:
    """This call's ``Call`` (mask and demand set) and staged counts from the geometry's graph,
    or None: run the stage eagerly (the geometry's first call, or capture failed)."""
    key = (id(group), meta.shapes, meta.capacity, spec.name, auto, _keyed(config), q.dtype, str(q.device),
           transport.name, _triton.settings())
    st = captured_on_second_sight(_STAGES, key, lambda: _capture(q, k, v, meta, group, spec, config, transport, auto),
                                  MAX_STAGES, what="the plan stage", otherwise="runs it eagerly")
    if st is None:
        return None
    if st.rows.data_ptr() != meta.rows.data_ptr():
        st.rows.copy_(meta.rows)
    st.cdf.copy_(threshold_tensor(config.cdf_threshold, meta.shapes.heads, q.device))  # device to device
    st.graph.replay()
    call = Call(q, k, v, meta.shapes, config, group, transport, full_mask=st.mask)
    call._demand, call._lists = st.demand, dict(st.lists)
    return call, st.staged


def captured() -> int:
    """How many geometries replay a captured stage (tests and benchmarks)."""
    return sum(isinstance(s, _Stage) for s in _STAGES.values())
