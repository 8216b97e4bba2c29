"""The denoising schedule: which calls run dense, which solve a plan, which reuse one.

A diffusion model calls every attention layer once per denoising step and branch (CFG's cond
and uncond, LTX-2's STG and modality passes), and its masks move little from one step to the
next (docs/configuration.md, "Schedules", gives the public evidence and where it stops). A
call that says its step (``sp_attention(step=)``; the Diffusers integration counts steps
itself) follows ``SparspConfig``'s schedule (``SparspConfig.step_kind``):

* a **dense** step (step < ``dense_steps``) runs exact dense attention through the strategy's
  dense path (``dense_path``): no summaries, no mask, no demand;
* a **plan** step is an ordinary call; where plans are reused (``replan_every`` > 1) what it
  decided before moving bytes is kept (``KeptPlan``);
* a **reuse** step takes the kept plan of its key and runs it on its own q, k, v: no summaries,
  no metadata collective, no mask, no host read; the K/V values move along the plan (its
  bytes are the plan's demand). Without a kept plan it plans.

A plan is kept per (owner, layer, branch, local shape, group, strategy, config, dtype, device);
the owner is the parallelized model (None for direct calls). The store keeps
``SparspConfig.kept_plans`` plans, the least recently used dropped first: every rank makes the
same calls in the same order, so every rank keeps and drops the same plans and no rank plans
(a collective) while its peers reuse. A plan holds this rank's mask rows eight blocks a byte
(the whole mask for a head-sharded strategy, whose run reads every rank's rows), the layouts
without their token rows (remade when packed), the counts, ``auto``'s choice, ``ulysses``'
head work and one GPU's kernel choice; its block lists are remade from the rows when the
kernel needs them. ``close_transports()`` and ``unparallelize`` free them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..caches import on_forget, per_geometry
from ..masks import pack_bits, unpack_bits
from ..packing import Layout
from ..plan import Shapes
from .auto import AUTO
from .call import Call
from .registry import StrategySpec, strategy_spec

_PLANS: OrderedDict = per_geometry("schedule: kept plans")  # key -> KeptPlan, least recently used first
_BRANCHES = per_geometry("schedule: calls per (owner, layer) and step")  # (owner, layer) -> (step, calls)


def dense_path(strategy: str) -> str:
    """The strategy a dense step runs for ``strategy``: a head-sharded one keeps its all-to-all
    (with the dense kernel), every sequence-sharded one (and ``auto``) the dense ``ring``."""
    if strategy != AUTO and strategy_spec(strategy).heads_divisible:
        return strategy
    return "ring"


def branch_of(owner, layer: int | None, step: int, branch):
    """The branch of a call: ``branch`` where given, else the count of earlier calls of the
    same (owner, layer) at this step (the i-th call of one (layer, step) is branch i)."""
    if branch is not None:
        return branch
    key = (owner, layer)
    last, calls = _BRANCHES.get(key, (None, 0))
    calls = calls + 1 if last == step else 0
    _BRANCHES[key] = (step, calls)
    return calls


def new_run(owner=None) -> None:
    """Forget the branch counts of ``owner``'s calls: the next call of a layer is branch 0."""
    for key in [k for k in _BRANCHES if k[0] == owner]:
        del _BRANCHES[key]


def plan_key(owner, layer, branch, q: torch.Tensor, group, strategy: str, config) -> tuple:
    return (owner, layer, branch, tuple(q.shape), id(group), strategy, config, q.dtype, str(q.device))


def place(step: int | None, strategy: str, config, *, owner, layer, branch, q: torch.Tensor, group,
          masked: bool) -> tuple:
    """Where a call stands in ``config``'s schedule: ``(strategy, config, key, plan)`` — the
    strategy and config it runs with (a dense step's: ``dense_path`` and every block kept), the
    key its plan is kept under (None: not kept) and the kept plan it reuses (None: it plans).
    ``group``: what the plans of its calls are kept per (a call's group, or a mesh call's
    groups); ``masked``: a test's mask, which no schedule applies to."""
    if step is None or not config.scheduled or masked:
        return strategy, config, None, None
    kind = config.step_kind(step)
    if kind == "dense":  # exact dense attention, the strategy's dense path
        return dense_path(strategy), dataclasses.replace(config, cdf_threshold=1.0, sim_threshold=None), None, None
    if config.replan_every == 1:
        return strategy, config, None, None
    key = plan_key(owner, layer, branch_of(owner, layer, step, branch), q, group, strategy, config)
    return strategy, config, key, lookup(key) if kind == "reuse" else None


def run_kept(plan: "KeptPlan", q, k, v, group, config, transport, timer) -> torch.Tensor:
    """A call on a kept plan: no summaries, no metadata collective, no mask, no host read; the
    transport's fence, then the plan's transfers, kernels and merges on this call's q, k, v."""
    plan.check(q)
    call = plan.call(q, k, v, config, group, transport)
    call.timer = timer
    if config.check_finite:
        with call.phase("check"):
            finite_checks.queue(q, k, v, call.rank)
    transport.fence()
    call.run(plan.spec)
    return call.output.result()


def lookup(key) -> "KeptPlan | None":
    """The plan kept for ``key`` (now the most recently used), or None."""
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
    return plan


def keep(key, plan: "KeptPlan", limit: int) -> None:
    """Keep ``plan`` for ``key``; past ``limit`` plans the least recently used go."""
    _PLANS[key] = plan
    _PLANS.move_to_end(key)
    while len(_PLANS) > limit:
        _PLANS.popitem(last=False)


def forget(owner) -> int:
    """Drop every plan and branch count of ``owner`` (``unparallelize``); returns plans dropped."""
    keys = [k for k in _PLANS if k[0] == owner]
    for k in keys:
        del _PLANS[k]
    new_run(owner)
    return len(keys)


def kept() -> tuple[int, int]:
    """(plans kept, bytes they hold) in this process."""
    return len(_PLANS), sum(p.nbytes for p in _PLANS.values())


def _slim(lay: Layout) -> Layout:
    """A layout to keep: its own copies of the small tensors (a captured stage's live in the
    graph's pool, which the next replay overwrites), without the token rows (``rows``: a
    capacity-sized index the pack remakes from the block ids, ``Layout.token_rows``)."""
    return dataclasses.replace(lay, block_ids=lay.block_ids.clone(), block_start=lay.block_start.clone(),
                               block_len=lay.block_len.clone(), selected=lay.selected.clone(), rows=None)


@dataclass
class KeptPlan:
    """What a plan call decided before moving bytes, kept for the reuse calls of its key."""

    spec: StrategySpec
    shapes: Shapes
    local: tuple  # (q's shape, dtype, device) it was made for
    masked: bool
    rows: torch.Tensor | None  # this rank's mask rows, ``pack_bits`` of bool [B, H, n_local, N]
    whole: torch.Tensor | None  # the whole mask, packed, for a run that reads every rank's rows
    layouts: dict
    kept: dict
    kept_by: dict
    consumes: dict
    head_work: list | None
    dense_kernel: object

    @classmethod
    def of(cls, call: Call, spec: StrategySpec) -> "KeptPlan":
        """The plan of ``call``, resolved and about to run as ``spec``."""
        rows = whole = None
        if call.masked and call.dense_kernel is None:
            if spec.heads_divisible:
                whole = pack_bits(call.full_mask)
            else:
                rows = pack_bits(call.mask)
        return cls(spec, call.shapes, (tuple(call.q.shape), call.q.dtype, str(call.q.device)), call.masked,
                   rows, whole, {key: _slim(lay) for key, lay in call.layouts.items()}, dict(call.kept),
                   dict(call.kept_by), dict(call.consumes), call.head_work, call.dense_kernel)

    @property
    def nbytes(self) -> int:
        """Device and host bytes the plan holds."""
        tensors = [t for t in (self.rows, self.whole) if t is not None]
        for lay in self.layouts.values():
            tensors += [lay.block_ids, lay.block_start, lay.block_len, lay.selected]
        return sum(t.numel() * t.element_size() for t in tensors)

    def check(self, q: torch.Tensor) -> None:
        """``ValueError`` when ``q`` is not what the plan was made for (its key holds the shape,
        so only a caller that mixes keys by hand meets it)."""
        here = (tuple(q.shape), q.dtype, str(q.device))
        if here != self.local:
            raise ValueError(f"a kept plan for q {self.local} cannot serve q {here}: plan this call afresh")

    def call(self, q, k, v, config, group, transport) -> Call:
        """A ``Call`` of this plan on new inputs: resolved, ready to run."""
        sh = self.shapes
        N = sh.total_blocks
        full = unpack_bits(self.whole, N) if self.whole is not None else None
        rows = unpack_bits(self.rows, N) if self.rows is not None else None
        call = Call(q, k, v, sh, config, group, transport, full_mask=full, rows=rows, masked=self.masked)
        call.layouts, call.kept, call.kept_by = dict(self.layouts), self.kept, self.kept_by
        call.consumes, call.head_work, call.dense_kernel = dict(self.consumes), self.head_work, self.dense_kernel
        return call


class FiniteChecks:
    """``check_finite`` on reuse calls, which read nothing on the host: each queues the float32
    sums of q, k and v (one pass over each; a NaN or Inf reaches its tensor's sum, as in the
    plan call's summaries) into pinned memory, and a later point that reads the host anyway
    (the next call's start, a plan call's host read, ``close_transports``) raises
    ``ValueError`` on the rank whose sums are not finite. On the CPU it raises at once, with
    exact counts, and a sum that overflowed finite values (near the float32 limit, ~3e38)
    passes. Its peers, waiting for that rank's payloads in a later call, end with their
    transport's timeout message."""

    def __init__(self) -> None:
        self._pending: list = []  # (rank, host sums, event)

    def queue(self, q, k, v, rank: int) -> None:
        sums = torch.stack([t.sum(dtype=torch.float32) for t in (q, k, v)])
        if sums.device.type != "cuda":
            if not bool(torch.isfinite(sums).all()):
                counts = [int((~torch.isfinite(t)).sum()) for t in (q, k, v)]
                _raise_nonfinite(rank, [f"{n} NaN/Inf value{'s' if n > 1 else ''}" if n else None for n in counts])
            return
        host = torch.empty(3, dtype=sums.dtype, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((rank, host, event))

    def clear(self) -> None:
        self._pending = []

    def settle(self, wait: bool = False) -> None:
        """Raise for the first queued check whose sums are not finite and is complete (all of
        them, waiting, with ``wait``); the others stay queued."""
        still = []
        for rank, host, event in self._pending:
            if wait or event.query():
                event.synchronize()
                bad = [None if math.isfinite(s) else "NaN/Inf values" for s in host.tolist()]
                if any(bad):
                    self._pending = []
                    _raise_nonfinite(rank, bad)
            else:
                still.append((rank, host, event))
        self._pending = still


def _raise_nonfinite(rank: int, found: list) -> None:
    """``found``: per q, k, v, what it holds (None: nothing non-finite)."""
    raise ValueError(f"non-finite inputs on rank {rank} in a call that reuses a kept plan ("
                     + "; ".join(f"{name} has {what}" for name, what in zip("qkv", found) if what)
                     + "); sp_attention needs finite q, k, v (SparspConfig(check_finite=False) skips this check)")


finite_checks = FiniteChecks()
on_forget("schedule: queued non-finite checks", finite_checks.clear)

__all__ = ["FiniteChecks", "KeptPlan", "branch_of", "dense_path", "finite_checks", "forget", "keep", "kept",
           "lookup", "new_run", "place", "plan_key", "run_kept"]
