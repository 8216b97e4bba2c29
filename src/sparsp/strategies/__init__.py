"""``sp_attention``: one entry point, every registered strategy (README, "Strategies").

Data path per call (``request``): validate → one metadata all-gather (header + summaries:
``plan``) → the plan stage (the whole block mask, the strategy's payload selections, the counts
the host reads; a CUDA graph per geometry: ``captured``) → one host read (header checks,
layouts; the transport's fence runs on the host while the device works towards it) → what runs
(``auto``'s choice, the heads' ranks, one GPU's kernel) → the strategy's run (transport →
kernel → LSE merge: ``Call.run``, ``merged``). A call on a mesh of ulysses > 1 makes two
requests around an all-to-all inside the Ulysses group (``meshed``); of ulysses 1, this one over
the mesh's ``sp`` group.
"""

from __future__ import annotations

import logging

import torch

from .. import caches
from ..config import SparspConfig
from ..transport import make_transport
from . import meshed, ring, ring_relay, schedule, sparsp, ulysses  # noqa: F401  (each registers its strategies)
from .call import Call
from .request import Request, validate, validate_place
from .registry import StrategyName, StrategySpec, register_strategy, strategy_names, strategy_spec

log = logging.getLogger("sparsp")

_transports: dict = {}


def get_transport(name: str, group, device: torch.device, timeout_s: float, local: str | None = None):
    """The transport for (group, name, device, ``local``: ``SparspConfig.local_transport``),
    made once and reused across calls."""
    key = (id(group), name, str(device), local)
    t = _transports.get(key)
    if t is None:
        t = make_transport(name, group, device=device, timeout_s=timeout_s, local=local)
        _transports[key] = t
    return t


def close_transports() -> None:
    """Release every cached transport (shared memory, IPC handles) and empty the per-geometry
    caches (``sparsp.caches``); safe to call twice."""
    caches.forget_all()
    while _transports:
        _, t = _transports.popitem()
        t.close()


def comm_bytes(masks, placement, strategy: str, *, head_dim: int, dtype_bytes: int = 2, mesh=None) -> dict:
    """Bytes each rank receives per call under ``strategy`` (its registered byte rule).
    ``mesh``: a ``sparsp.cost.mesh.Mesh`` whose ``sp`` ranks ``placement`` places: one call on
    one half of it, the strategy's bytes on each Ulysses rank's heads (``"sp"``) and the
    all-to-alls' (``"ulysses"``) apart (``cost.mesh.mesh_comm_bytes``)."""
    spec = strategy_spec(strategy)
    if mesh is None:
        return spec.comm_bytes(masks, placement, head_dim=head_dim, dtype_bytes=dtype_bytes)
    from ..cost.mesh import mesh_comm_bytes

    return mesh_comm_bytes(masks, placement, spec.byte_rule, mesh, head_dim=head_dim, dtype_bytes=dtype_bytes)


def sp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    mesh=None,
    dims=None,
    strategy: str = "sparsp",
    config: SparspConfig = SparspConfig(),
    layer: int | None = None,
    step: int | None = None,
    branch=None,
    _global_mask: torch.Tensor | None = None,
    _timer=None,
    _owner=None,
) -> torch.Tensor:
    """Sequence-parallel block-sparse attention over ``group``, or over a device ``mesh``.

    ``q, k, v``: this rank's contiguous slice (B, S_local, H, D) of the (already placed)
    sequence; the slices concatenated in rank order form the global sequence, and each slice
    is cut into ``config.block_size`` blocks from its start. Returns this rank's output slice,
    same shape and dtype as ``q``: attention over the global sequence restricted to the block
    mask ``sparsp.masks.split_mask`` computes on the concatenated q and k (equal to
    ``block_mask`` when every slice but the last is a whole number of blocks).
    ``strategy="ring"`` is the dense baseline and ignores the thresholds; ``strategy="auto"``
    picks one per call from the call's own mask and a machine profile (``strategies/auto.py``).

    ``mesh``: a ``DeviceMesh`` of ``ulysses`` and ``sp`` dimensions (``sparsp.make_mesh``, or
    any mesh with ``dims`` naming its dimensions' roles: ``sparsp.mesh``; a ``cfg`` dimension
    of more than one rank is a pipeline's and is refused), in place of ``group`` (a mesh of one
    ``sp`` dimension). With ulysses U > 1, ``q, k, v`` are piece u of sp slice r on rank
    (sp=r, ulysses=u) (``sparsp.placement.ulysses_pieces``), and the call is the one the sp
    ranks alone would make on their slices: an all-to-all to H/U heads per Ulysses rank, the
    strategy over the sp group, an all-to-all back (``strategies/meshed.py``). Ulysses 1 is
    the call over the mesh's sp group, unchanged.

    ``layer``: the index of the model layer this call attends for (an int >= 0; None: not
    said): its thresholds where ``config.thresholds`` sets them per layer, ``auto``'s log line
    per layer, and the key of its kept plans. ``step`` (an int >= 0; None: plan afresh) and
    ``branch`` (any hashable; None: the i-th call of one (layer, step) is branch i): where the
    call is in a denoising run, for ``config``'s schedule (``dense_steps``, ``replan_every``;
    ``strategies/schedule.py``). ``_global_mask`` (bool [B, H, N, N], N = global blocks)
    replaces the CDF mask — for tests; ``_timer`` (a ``timing.PhaseTimer``) times the phases —
    for benchmarks; ``_owner``: whose plans these are (the parallelized model; None: direct
    calls).
    """
    groups = None
    if mesh is not None or dims is not None:  # every check of the mesh before any communication
        groups = meshed.resolve(mesh, dims, group, q)
        group = groups.sp if groups.layout.ulysses == 1 else groups.sequence
    validate(q, k, v, group, strategy, config)
    validate_place(layer, step, branch)
    if config.table is not None:
        config.table.check(heads=q.shape[2], what="q")
    config = config.at_layer(layer)
    schedule.finite_checks.settle()  # earlier reuse calls' non-finite checks that are complete
    if groups is not None and groups.layout.ulysses > 1:
        transports = tuple(get_transport(config.transport, g, q.device, config.timeout_s, config.local_transport)
                           for g in (groups.ulysses, groups.sp))
        return meshed.attention(q, k, v, groups, strategy, config, transports, layer=layer, step=step, branch=branch,
                                global_mask=_global_mask, timer=_timer, owner=_owner)
    transport = get_transport(config.transport, group, q.device, config.timeout_s, config.local_transport)
    with torch.no_grad():
        strategy, config, key, kept = schedule.place(step, strategy, config, owner=_owner, layer=layer, branch=branch,
                                                     q=q, group=group, masked=_global_mask is not None)
        if kept is not None:  # a reuse step: the kept plan on this call's q, k, v
            return schedule.run_kept(kept, q, k, v, group, config, transport, _timer)
        request = Request(q, k, v, group, strategy, config, transport, _global_mask, _timer, layer=layer)
        meta = request.gather()  # every rank's header and summaries, one all-gather
        call, staged = request.stage(meta)  # the mask, the payloads' selections, the counts to read
        call, resolved = request.resolve(meta, call, staged)  # the one host read: checks, layouts, counts
        call, spec = request.choose(call, resolved)  # auto's choice, the heads' ranks, one GPU's kernel
        if key is not None:  # a plan step whose plan later steps reuse
            schedule.keep(key, schedule.KeptPlan.of(call, spec), config.kept_plans)
        call.run(spec)  # transfers, kernels, merges
    return call.output.result()


def new_run(owner=None) -> None:
    """Start a new denoising run for direct calls of ``owner`` (None: ``sp_attention`` called
    by hand): the branch counts start again. Plans stay; the run's first plan step replaces
    them."""
    schedule.new_run(owner)


__all__ = ["Call", "StrategyName", "StrategySpec", "close_transports", "comm_bytes", "get_transport", "new_run",
           "register_strategy", "sp_attention", "strategy_names", "strategy_spec"]
