"""The plan stage of a call: made eagerly or replayed as a CUDA graph (one per geometry), then
read in the call's one host read.

``Request`` holds one ``sp_attention`` call's steps before the strategy runs: ``gather`` (the
metadata all-gather, ``plan.gather_metadata``), ``stage`` (this module's stage, replayed where
a graph of its geometry exists) and ``read`` (the host read, with the local shard's kernel
queued before it where that pays, the transport's fence beside it, and ``auto``'s choice from
its figures; a geometry that changed is regathered or re-cut and staged again there).

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

``strategy="auto"`` runs ``sparsp``'s stage with the figures its choice needs (``auto.figures``)
in the same host read, captured alike. Not captured: a ``sim_threshold`` config (key
smoothing adds collectives before the mask), test masks (``_global_mask``) and dense configs
(no mask to compute).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .. import _triton
from ..caches import captured_on_second_sight, per_geometry
from ..groups import marker as record_function  # a no-op unless a profiler records
from ..plan import TAIL, Metadata, Staged, gather_metadata, remask
from ..timing import PhaseTimer
from .auto import AUTO, PLANNED, choose_from, figures, head_pairs
from . import one_gpu
from .base import Call
from .registry import StrategySpec, strategy_spec


@dataclass
class _Stage:
    """One geometry's captured stage: its static input and the graph's outputs."""

    graph: torch.cuda.CUDAGraph
    rows: torch.Tensor  # the static input: the kept gathered rows, or a copy of them
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
          auto: bool = False) -> tuple[Call, Staged, str | None]:
    """The plan stage of a call on ``meta`` (the whole mask made here from its summaries):
    the ``Call`` of ``spec``, its staged
    counts (``Metadata.stage``) and a deferred error (raised once the shapes are confirmed).
    Device ops only, the same on the eager path and in a captured graph. ``auto``: ``spec`` is
    ``auto.PLANNED``'s and the figures ``auto.choose_from`` reads ride with the counts."""
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
            full_mask = meta.block_mask(config)
    call = Call(q, k, v, shapes, config, group, transport, full_mask=full_mask)
    selections = spec.plan(call) if spec.plan is not None else {}
    # auto's figures ride with the counts; a head-sharded strategy balances its ranks by the
    # kept pairs per head among them (``auto.head_pairs``)
    sharded = spec.heads_divisible and full_mask is not None and shapes.world_size > 1
    tail = figures(full_mask, shapes) if auto or sharded else None
    staged = meta.stage(selections, call.kept_counts(), tail=tail)
    # the kernels' block lists: mask + ids known before the sync
    call.local_lists()
    for key, (origin, heads) in call.consumes.items():
        call.lists(origin, staged.pending[key].ids, heads)
    return call, staged, error


def _stage(q, k, v, meta: Metadata, rows: torch.Tensor, group, spec, config, transport, auto: bool):
    """``stage`` on the gathered ``rows`` (the captured function)."""
    call, staged, _ = stage(q, k, v, meta.with_rows(rows), group, spec, config, transport, auto=auto)
    return call, staged


def _capture(q, k, v, meta: Metadata, group, spec, config, transport, auto: bool) -> _Stage:
    # the static input: the gathered rows themselves where the metadata step keeps them in one
    # buffer per geometry (``summaries.gathered_rows``), so a replay copies nothing; else a copy
    rows = meta.rows if meta.rows_kept else meta.rows.clone()
    args = (q, k, v, meta, rows, group, spec, config, transport, auto)
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
    return _Stage(graph, rows, call.full_mask, call._demand, call._lists, staged)


def replayed(q, k, v, meta: Metadata, group, spec, config, transport, *,
             auto: bool = False) -> tuple[Call, Staged] | None:
    """This call's ``Call`` (mask and demand set) and staged counts from the geometry's graph,
    or None: run the stage eagerly (the geometry's first call, or capture failed)."""
    key = (id(group), meta.shapes, meta.capacity, spec.name, auto, config, q.dtype, str(q.device),
           transport.name, _triton.settings())
    st = captured_on_second_sight(_STAGES, key, lambda: _capture(q, k, v, meta, group, spec, config, transport, auto),
                                  MAX_STAGES, what="the plan stage", otherwise="runs it eagerly")
    if st is None:
        return None
    if st.rows.data_ptr() != meta.rows.data_ptr():
        st.rows.copy_(meta.rows)
    st.graph.replay()
    call = Call(q, k, v, meta.shapes, config, group, transport, full_mask=st.mask)
    call._demand, call._lists = st.demand, dict(st.lists)
    return call, st.staged


def captured() -> int:
    """How many geometries replay a captured stage (tests and benchmarks)."""
    return sum(isinstance(s, _Stage) for s in _STAGES.values())


@dataclass
class Request:
    """One ``sp_attention`` call up to its strategy's run, in three steps: ``gather``, ``stage``,
    ``read``. Made from the call's arguments (``validate`` passed) and its transport; what
    follows from them is settled here once: the strategy whose payloads the stage plans
    (``auto``: ``sparsp``'s, with the figures auto chooses from), whether the mask is computed
    from the summaries, whether the stage may be captured, whether the local shard may go
    before the host read."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    group: object
    strategy: str
    config: object  # SparspConfig
    transport: object  # Transport
    global_mask: torch.Tensor | None = None  # tests: replaces the CDF mask
    timer: PhaseTimer | None = None  # benchmarks: CUDA events per phase
    layer: int | None = None  # the model layer it attends for: auto logs its choice per layer

    def __post_init__(self) -> None:
        self.auto = self.strategy == AUTO
        self.planned: StrategySpec = strategy_spec(PLANNED if self.auto else self.strategy)
        self.computed = (self.auto or self.planned.sparse) and self.global_mask is None and not self.config.dense
        self.graphed = eligible(self.q, self.planned, self.config, self.computed)
        # one rank picks its kernel from the mask it reads (``one_gpu``): no kernel before the read
        self.alone = self.q.device.type in one_gpu.DEVICES and dist.get_world_size(self.group) == 1
        self.early = (self.config.local_first is not False and self.planned.local_first  # Call.attend_local_early
                      and not self.alone)
        self.error: str | None = None  # the stage's, raised once the read confirmed the shapes
        self._mask_phase = None  # the timer's "mask" phase while it is open

    def gather(self) -> Metadata:
        """The metadata all-gather (``plan.gather_metadata``); the timer's mask phase opens."""
        if self.timer is not None:
            self._mask_phase = self.timer.phase("mask")
            self._mask_phase.__enter__()
        with record_function("sparsp.metadata"):
            return gather_metadata(self.q, self.k, self.v, self.group, self.config, self.strategy,
                                   sparse=self.computed)

    def stage(self, meta: Metadata) -> tuple[Call, Staged]:
        """The plan stage on ``meta``: from the gathered rows to the counts the host reads,
        replayed from the geometry's CUDA graph where there is one, else made eagerly."""
        with record_function("sparsp.plan"):
            replay = (replayed(self.q, self.k, self.v, meta, self.group, self.planned, self.config, self.transport,
                               auto=self.auto) if self.graphed else None)
            if replay is not None:
                self.error = None
                return replay
            call, staged, self.error = stage(self.q, self.k, self.v, meta, self.group, self.planned, self.config,
                                             self.transport, self.global_mask, auto=self.auto)
            return call, staged

    def read(self, meta: Metadata, call: Call, staged: Staged) -> tuple[Call, StrategySpec]:
        """The call's one host read of ``staged`` (``Metadata.finish``: header checks, layouts),
        and the strategy to run: the call resolved, and ``auto``'s choice from the figures read
        with the counts. Before the host waits: the local shard's kernel where it needs nothing
        the read brings (a ``local_first`` strategy, when it pays: ``Call.local_first_pays``),
        and the transport's once-per-call fence, host work done while the device runs the
        stage and the read's copy. A geometry that changed (``finish`` returns None) is cut
        again or gathered again (``plan.remask``) and staged eagerly, once."""
        fenced = False
        while True:  # once, unless the geometry changed: see plan.gather_metadata
            with record_function("sparsp.resolve"):
                read = meta.start_read(staged)  # the one host sync: its copy is queued now
                if self.early and self.error is None and (meta.fits or not self.computed) and \
                        (self.config.local_first or call.local_first_pays()):
                    # the local shard needs nothing the read brings: the device computes it
                    # while the host waits, checks the headers and issues the first round
                    self._close_mask_phase()
                    call.timer = self.timer
                    call.attend_local_early()
                if not fenced:
                    # the transport's fence (host work: its checks of the last call's transfers,
                    # a barrier, the flag reset) while the device runs the plan stage and the
                    # read's copy, instead of after the read, where the device would wait for
                    # it before the first pack
                    self.transport.fence()
                    fenced = True
                resolved = meta.finish(staged, read)
            if resolved is not None:
                break
            self.graphed = False  # the geometry changed: the true shapes' stage runs eagerly
            meta = remask(meta, self.group) or \
                gather_metadata(self.q, self.k, self.v, self.group, self.config, self.strategy, sparse=self.computed)
            call, staged = self.stage(meta)
        self._close_mask_phase()
        if self.error is not None:
            raise ValueError(self.error)
        spec = self.planned
        if self.auto:  # the choice, from the figures of the same host read
            spec = strategy_spec(choose_from(resolved[1][TAIL], call.shapes, self.q, self.group, self.config,
                                             self.transport, layer=self.layer))
            if spec.name != self.planned.name:
                call = call.without_plan(spec)
        call.timer = self.timer
        call.set_resolved(*resolved)
        if spec.heads_divisible and call.full_mask is not None and call.world > 1:
            call.head_work = head_pairs(resolved[1][TAIL], call.shapes)  # read with the counts (``stage``)
        if one_gpu.applies(call, self.computed):
            call.dense_kernel = one_gpu.choose(call, self.layer)
        return call, spec

    def _close_mask_phase(self) -> None:
        if self._mask_phase is not None:
            self._mask_phase.__exit__(None, None, None)
            self._mask_phase = None
