"""One ``sp_attention`` call up to its strategy's run: its checks and the steps around its one
host read.

``validate`` makes every check that needs no communication. ``Request`` then holds the call's
steps before the strategy runs (a mesh call makes two requests, its head step's and its sp
step's: ``strategies/meshed.py``):

1. ``gather``: the metadata all-gather (``plan.gather_metadata``);
2. ``stage``: the plan stage (``strategies/captured.py``), replayed where a graph of its
   geometry exists;
3. ``resolve``: the host read that resolves the call — the local shard's kernel queued before it
   where that pays, the transport's fence beside it; a geometry that changed is gathered again
   or re-cut and staged again there;
4. ``choose``: what runs, from what the read brought — ``auto``'s strategy, the heads a
   head-sharded strategy gives each rank, the kernel of a call on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..config import SparspConfig
from ..cost.figures import head_pairs
from ..groups import marker as record_function  # a no-op unless a profiler records
from ..plan import TAIL, Metadata, Staged, gather_metadata, remask
from ..timing import PhaseTimer
from . import captured, one_gpu
from .auto import AUTO, PLANNED, choose_from
from .call import Call
from .registry import StrategySpec, strategy_names, strategy_spec

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _staged_only(call: Call) -> None:
    raise AssertionError("a mesh call's head step stages; the strategy runs in its sp step")


HEAD_STEP = StrategySpec(name="mesh-heads", run=_staged_only, plan=None, sparse=True, heads_divisible=True,
                         placement="contiguous", byte_rule="all-to-all")
"""What a mesh call's head step stages (``Request(heads_only=True)``): the whole mask and, as a
head-sharded strategy's stage does, the kept work per head; no payloads."""
HEADERS_STEP = replace(HEAD_STEP, name="mesh-headers", sparse=False, heads_divisible=False)
"""The head step of a call without a mask (a dense strategy or config): the headers alone."""


def validate(q, k, v, group, strategy: str, config: SparspConfig) -> None:
    """Every check that needs no communication; raises ``ValueError`` naming the argument."""
    allowed = (*strategy_names(), AUTO)  # "auto": strategies/auto.py picks one per call
    if not isinstance(strategy, str) or strategy not in allowed:
        raise ValueError(f"strategy={strategy!r} is not one of {', '.join(allowed)}")
    if not isinstance(config, SparspConfig):
        raise ValueError(f"config must be a sparsp.SparspConfig, got {type(config).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, S_local, H, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} has dtype {t.dtype}; expected one of {', '.join(map(str, _FLOATS))}")
        if not t.is_contiguous():
            raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                             f"call .contiguous() on it first")
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape "
                         f"(self-attention over the same local tokens)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: call dist.init_process_group first "
                         "(torchrun), or pass group=")
    backend = dist.get_backend(group)
    if backend == "nccl" and q.device.type != "cuda":
        raise ValueError(f"the process group uses NCCL but q is on {q.device}; move q, k, v to the GPU")
    if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
        raise ValueError(f"q is on {q.device} but the current CUDA device is cuda:{torch.cuda.current_device()}")
    G = dist.get_world_size(group)
    if strategy != AUTO and strategy_spec(strategy).heads_divisible and q.shape[2] % G:
        raise ValueError(f"{strategy} needs heads divisible by the group size: H={q.shape[2]}, G={G}")
    if isinstance(config.cdf_threshold, tuple) and len(config.cdf_threshold) != q.shape[2]:
        raise ValueError(f"config.cdf_threshold has {len(config.cdf_threshold)} values for {q.shape[2]} heads")
    if isinstance(config.sim_threshold, tuple) and len(config.sim_threshold) != q.shape[2]:
        raise ValueError(f"config.sim_threshold has {len(config.sim_threshold)} values for {q.shape[2]} heads")


def validate_place(layer, step, branch) -> None:
    """The checks of where a call is in a model and a run (``sp_attention``'s ``layer``,
    ``step``, ``branch``); raises ``ValueError`` naming the argument."""
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise ValueError(f"layer must be an int >= 0 or None, got {layer!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be an int >= 0 or None, got {step!r}")
    if branch is not None and not isinstance(branch, (int, str)):
        raise ValueError(f"branch must be None, an int or a str, got {type(branch).__name__}")


@dataclass
class Request:
    """One ``sp_attention`` call up to its strategy's run, in four steps: ``gather``, ``stage``,
    ``resolve``, ``choose``. Made from the call's arguments (``validate`` passed) and its
    transport; what follows from them is settled here once: the strategy whose payloads the
    stage plans (``auto``: ``sparsp``'s, with the figures auto chooses from), whether the mask is
    computed from the summaries, whether the stage may be captured, whether the local shard may
    go before the host read."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    group: object
    strategy: str
    config: SparspConfig
    transport: object  # Transport
    global_mask: torch.Tensor | None = None  # tests: replaces the CDF mask
    timer: PhaseTimer | None = None  # benchmarks: CUDA events per phase
    layer: int | None = None  # the model layer it attends for: auto logs its choice per layer
    # a mesh call's head step (``strategies/meshed.py``): the stage makes the whole mask and the
    # kept work per head (``HEAD_STEP``), no payloads; the strategy runs in the sp step after it
    heads_only: bool = False
    # a mesh call's sp step: the metadata its head step gathered (``Metadata.given``), so
    # ``gather`` issues no collective
    given: Metadata | None = None

    def __post_init__(self) -> None:
        self.auto = self.strategy == AUTO and not self.heads_only
        spec = strategy_spec(PLANNED if self.strategy == AUTO else self.strategy)
        self.computed = spec.sparse and self.global_mask is None and not self.config.dense
        if self.heads_only:  # a mask where the strategy reads one (a test's too), else the headers alone
            spec = HEAD_STEP if self.computed or (spec.sparse and self.global_mask is not None) else HEADERS_STEP
        self.planned: StrategySpec = spec
        # a given mask is an input the graph would not see change: the stage runs eagerly
        self.graphed = self.given is None and captured.eligible(self.q, self.planned, self.config, self.computed)
        # one rank picks its kernel from the mask it reads (``one_gpu``): no kernel before the read
        self.alone = self.q.device.type in one_gpu.DEVICES and dist.get_world_size(self.group) == 1
        self.early = (self.config.local_first is not False and self.planned.local_first  # Call.attend_local_early
                      and not self.alone)
        self.error: str | None = None  # the stage's, raised once the read confirmed the shapes
        self._mask_phase = None  # the timer's "mask" phase while it is open

    def gather(self) -> Metadata:
        """The metadata all-gather (``plan.gather_metadata``), or the metadata given (no
        collective); the timer's mask phase opens."""
        if self.timer is not None:
            self._mask_phase = self.timer.phase("mask")
            self._mask_phase.__enter__()
        if self.given is not None:
            return self.given
        with record_function("sparsp.metadata"):
            return gather_metadata(self.q, self.k, self.v, self.group, self.config, self.strategy,
                                   sparse=self.computed)

    def stage(self, meta: Metadata) -> tuple[Call, Staged]:
        """The plan stage on ``meta``: from the gathered rows to the counts the host reads,
        replayed from the geometry's CUDA graph where there is one, else made eagerly."""
        with record_function("sparsp.plan"):
            replay = (captured.replayed(self.q, self.k, self.v, meta, self.group, self.planned, self.config,
                                        self.transport, auto=self.auto) if self.graphed else None)
            if replay is not None:
                self.error = None
                return replay
            call, staged, self.error = captured.stage(self.q, self.k, self.v, meta, self.group, self.planned,
                                                      self.config, self.transport, self.global_mask, auto=self.auto)
            return call, staged

    def resolve(self, meta: Metadata, call: Call, staged: Staged) -> tuple[Call, tuple[dict, dict]]:
        """The call's one host read of ``staged`` (``Metadata.finish``: header checks, layouts,
        counts): the call it resolved and ``(layouts, values)``. Before the host waits: the
        local shard's kernel where it needs nothing the read brings (``_early``), and the
        transport's once-per-call fence, host work done while the device runs the stage and the
        read's copy. A geometry that changed (``finish`` returns None) is cut again or gathered
        again (``plan.remask``) and staged eagerly, once. The stage's deferred error is raised
        once the read confirmed the shapes."""
        fenced = False
        while True:  # once, unless the geometry changed: see plan.gather_metadata
            with record_function("sparsp.resolve"):
                read = meta.start_read(staged)  # the one host sync: its copy is queued now
                if self._early(meta, call):
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
        return call, resolved

    def _early(self, meta: Metadata, call: Call) -> bool:
        """Whether the local shard's kernel goes before this host read: a ``local_first``
        strategy (``early``), a stage without error whose mask is the real one (one whose
        summaries did not fit is redone after the read), and ``SparspConfig.local_first`` True
        or, automatic, where it pays (``Call.local_first_pays``)."""
        return (self.early and self.error is None and (meta.fits or not self.computed)
                and bool(self.config.local_first or call.local_first_pays()))

    def choose(self, call: Call, resolved: tuple[dict, dict]) -> tuple[Call, StrategySpec]:
        """What runs, from what the read brought: the strategy (``auto``'s choice from the
        figures read with the counts; another strategy than the planned one gets a call of its
        own, ``Call.without_plan``), which then takes the read's layouts and counts; the kept
        work per head a head-sharded strategy balances its ranks by; on one GPU, the kernel
        (``one_gpu``)."""
        layouts, values = resolved
        spec = self.planned
        if self.auto:
            spec = strategy_spec(choose_from(values[TAIL], call.shapes, self.q, self.group, self.config,
                                             self.transport, layer=self.layer))
            if spec.name != self.planned.name:
                call = call.without_plan(spec)
        call.timer = self.timer
        call.set_resolved(layouts, values)
        if spec.heads_divisible and call.full_mask is not None and call.world > 1:
            call.head_work = head_pairs(values[TAIL], call.shapes)  # read with the counts (``captured.stage``)
        if one_gpu.applies(call, self.computed):
            call.dense_kernel = one_gpu.choose(call, self.layer)
        return call, spec

    def _close_mask_phase(self) -> None:
        if self._mask_phase is not None:
            self._mask_phase.__exit__(None, None, None)
            self._mask_phase = None


__all__ = ["HEADERS_STEP", "HEAD_STEP", "Request", "validate", "validate_place"]
