"""What a step costs on a device mesh, and the best mesh for a model and world size.

A mesh call (``cost.mesh``) is priced in phases that follow one another on every rank:

* the mask phase: one metadata all-gather over the (ulysses × sp) ranks of all H heads'
  summaries — their densities give the heads to Ulysses ranks — and the whole mask of every
  head on each rank; it also serves the sp strategy (``mesh_mask_phase``);
* the all-to-all in and, after the sp call, the all-to-all back: each Ulysses group's U − 1
  rounds on the fabric that holds the group (the call's transport inside a host, the network
  transport between hosts), all groups at once, each message's latency and pack then its
  bytes;
* the sp strategy: the U calls (one per Ulysses rank, each on its H/U heads and its own
  demand) of both CFG halves at once on their GPUs, sharing the machine
  (``timeline.timelines``); the slowest sets the phase.

A dense step's call runs the strategy's dense path (``schedule.dense_path``) in the same
mesh; a reuse call skips the mask phase. A kind of step the run does not have is not priced
(None). A step makes ``ceil(branches / cfg)`` calls per layer
on each half (``cfg`` = 2: each half one half of the branches) and, with two halves, one
exchange of the predictions between rank (0, r, u) and rank (1, r, u). ``best_mesh`` prices
every valid mesh and keeps the fastest step (or run, under a schedule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..caches import per_geometry
from ..geometry import VideoGeometry, preset
from ..placement import make_placement
from .figures import Blocks, measure
from .machine import Profile
from .mesh import Mesh, all_to_all_bytes, head_pairs, piece_tokens, ulysses_heads, valid_meshes
from .model import Work, gather_row_bytes, phase_bytes, schedule_of
from .schedule import STEPS, Schedule, call_works, run_cost
from .timeline import mask_phase_ms, timelines

__all__ = ["OUT_VALUES", "MeshStep", "best_mesh", "mesh_step", "prediction_bytes"]

OUT_VALUES = {"wan2.1-14b": 64, "wan2.1-1.3b": 64, "hunyuan-video": 64, "ltx-video": 128, "ltx-video-161f": 128,
              "ltx-2": 128}
"""Values of a step's prediction per video token: the transformer's ``out_channels`` × its
patch (Diffusers 0.42.1 configs: Wan and HunyuanVideo 16 × 1·2·2, LTX-Video and LTX-2 128 × 1)."""


def prediction_bytes(geom: VideoGeometry, dtype_bytes: int = 2) -> int:
    """Bytes of one branch's prediction, what the CFG halves exchange per step (``OUT_VALUES``;
    a geometry of no preset: its hidden size per token, an upper bound)."""
    per_token = OUT_VALUES.get(geom.name, geom.heads * geom.head_dim)
    return geom.video_tokens * per_token * dtype_bytes


@dataclass(frozen=True)
class MeshStep:
    """A mesh's prices (ms): each kind of call (``plan``, ``reuse``, ``dense``) and its parts,
    the exchange between CFG halves, each kind of step, and the run under ``schedule``."""

    mesh: Mesh
    strategy: str
    call_ms: dict
    all_to_all_ms: float
    mask_phase_ms: float
    exchange_ms: float
    calls_per_step: int
    step_ms: dict
    run: dict

    def to_dict(self) -> dict:
        return {"mesh": self.mesh.to_dict(), "label": self.mesh.label, "strategy": self.strategy,
                "call_ms": self.call_ms, "all_to_all_ms": round(self.all_to_all_ms, 4),
                "mask_phase_ms": round(self.mask_phase_ms, 4), "exchange_ms": round(self.exchange_ms, 4),
                "calls_per_step": self.calls_per_step, "step_ms": self.step_ms, "run": self.run}


def _gpus(mesh: Mesh, c: int, r: int | None = None, u: int | None = None) -> list[int]:
    """GPUs of CFG half c's ranks: sp slice r's Ulysses group (``u`` None), or Ulysses rank u's
    sp group (``r`` None)."""
    U, R, first = mesh.ulysses, mesh.sp, c * mesh.ulysses * mesh.sp
    return [first + r * U + x for x in range(U)] if u is None else [first + x * U + u for x in range(R)]


def mesh_mask_phase(plan: Work, mesh: Mesh, u: int, pieces, heads: int, blocks: int, piece_blocks: int, *,
                    head_dim: int, dtype_bytes: int) -> Work:
    """Ulysses rank u's sp group's plan work with the mesh's mask phase (module docstring): sp
    rank r reads its piece (r, u) with every head, selects the whole mask of every head of
    ``blocks`` blocks, and receives U·R − 1 rows of all heads' summaries of a piece of (at most)
    ``piece_blocks`` blocks. A mesh of ulysses 1 is the flat call's own."""
    U, R = mesh.ulysses, mesh.sp
    if U == 1:
        return plan
    row = gather_row_bytes(batch=1, heads=heads, blocks=piece_blocks, head_dim=head_dim, sparse=True)
    return replace(plan, mask_bytes=tuple(phase_bytes(pieces[r][u], batch=1, heads=heads, blocks=blocks,
                                                      head_dim=head_dim, dtype_bytes=dtype_bytes) for r in range(R)),
                   gather_bytes=((U * R - 1) * row,) * R)


def _all_to_all_ms(mesh: Mesh, pieces, heads: int, profile: Profile, transport, *, head_dim: int,
                   dtype_bytes: int) -> float:
    """Both Ulysses all-to-alls of a call, every group of both CFG halves at once (no fixed cost:
    the call's is the sp call's)."""
    U, R = mesh.ulysses, mesh.sp
    if U == 1:
        return 0.0
    _, into, back = all_to_all_bytes(pieces, heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    zero = tuple((0.0,) for _ in range(U))
    calls = [(Work("ulysses-all-to-all", "all-to-all", U, zero, tuple((0,) for _ in range(U)),
                   tuple(tuple(into[r * U + u]) for u in range(U)), tuple(tuple(back[r * U + u]) for u in range(U))),
              _gpus(mesh, c, r=r)) for c in range(mesh.cfg) for r in range(R)]
    return max(t.latency_ms for t in timelines(calls, profile, transport=transport, head_dim=head_dim,
                                               skip=frozenset({"fixed"})))


def _exchange_ms(mesh: Mesh, nbytes: int, profile: Profile, transport, head_dim: int) -> float:
    """The CFG halves' exchange of their predictions: every rank with its counterpart, at once."""
    if mesh.cfg == 1:
        return 0.0
    half = mesh.ulysses * mesh.sp
    pair = Work("cfg-exchange", "relay-ring", 2, ((0.0, 0.0),) * 2, ((0, 0),) * 2, ((nbytes,),) * 2)
    return max(t.latency_ms for t in timelines([(pair, (g, g + half)) for g in range(half)], profile,
                                               transport=transport, head_dim=head_dim, skip=frozenset({"fixed"})))


def mesh_step(masks: torch.Tensor, geom: VideoGeometry, mesh: Mesh, profile: Profile, spec, *, baseline=None,
              branches: int = 1, layers: int | None = None, schedule: Schedule = Schedule(),
              placement: str | None = None, transport=None, dtype_bytes: int = 2, local_first=None,
              prefetch: int = 1) -> MeshStep:
    """The prices of ``mesh`` for ``spec``'s sp calls on masks bool [heads, nB, nB] of
    ``geom`` (module docstring): ``layers`` calls per branch (default: the geometry's), the
    run of ``schedule``; ``baseline``: the dense path's facts for a dense step of a
    sequence-sharded strategy (``schedule.dense_path``)."""
    H, hd, U, R = geom.heads, geom.head_dim, mesh.ulysses, mesh.sp
    mesh.check(H, geom.num_blocks)
    if mesh.world > profile.gpus:
        raise ValueError(f"mesh {mesh.label}: {mesh.world} ranks exceed the {profile.gpus} GPUs of {profile.name}")
    schedule_of(spec)
    pl = make_placement(placement or spec.placement, geom, R)
    pieces = piece_tokens(pl, U)
    groups = ulysses_heads(head_pairs(masks, geom.block_lengths()), U)
    kw = dict(head_dim=hd, dtype_bytes=dtype_bytes, profile=profile, transport=transport, local_first=local_first)
    works = []
    piece_blocks = max(-(-n // U) for n in pl.blocks_per_rank)
    for u, heads in enumerate(groups):
        d = measure(masks[list(heads)], Blocks.of(pl), relay=spec.byte_rule == "relay")
        w = call_works(spec, d, baseline=baseline, **kw)
        w["plan"] = mesh_mask_phase(w["plan"], mesh, u, pieces, H, geom.num_blocks, piece_blocks, head_dim=hd,
                                    dtype_bytes=dtype_bytes)
        works.append(w)
    a2a = _all_to_all_ms(mesh, pieces, H, profile, transport, head_dim=hd, dtype_bytes=dtype_bytes)
    call, counts = {}, schedule.counts()
    for kind in ("plan", "reuse", "dense"):
        if kind != "plan" and not counts[kind]:  # a kind of step the run has not: not priced
            call[kind] = None
            continue
        # both CFG halves at once (each on its branch; the same masks here), sharing the machine
        tls = timelines([(w[kind], _gpus(mesh, c, u=u)) for c in range(mesh.cfg) for u, w in enumerate(works)],
                        profile, transport=transport, head_dim=hd, prefetch=prefetch)
        call[kind] = round(max(t.latency_ms for t in tls) + a2a, 4)
    mask = max(max(mask_phase_ms(w["plan"], profile, _gpus(mesh, 0, u=u))) for u, w in enumerate(works))
    exchange = _exchange_ms(mesh, prediction_bytes(geom, dtype_bytes), profile, transport, hd)
    calls = math.ceil(branches / mesh.cfg) * (geom.layers if layers is None else layers)
    step = {k: None if v is None else round(calls * v + exchange, 4) for k, v in call.items()}
    run = run_cost(schedule, plan_ms=step["plan"], reuse_ms=step["reuse"] or 0.0, dense_ms=step["dense"] or 0.0)
    return MeshStep(mesh, spec.name, call, a2a, mask, exchange, calls, step, run)


_MASKS = per_geometry("cost: best_mesh's synthetic masks")  # (geometry, cdf, seed) -> bool [H, nB, nB]


def _synthetic(geom: VideoGeometry, cdf: float, seed: int) -> torch.Tensor:
    """Layer 0's synthetic masks of ``geom`` at ``cdf`` (``workloads.synthetic``), made once."""
    from ..workloads.synthetic import synthetic_masks

    key = (geom, float(cdf), seed)
    if key not in _MASKS:
        _MASKS[key] = synthetic_masks(geom, [float(cdf)], seed=seed)[float(cdf)][0]
    return _MASKS[key]


def best_mesh(geometry: VideoGeometry | str, world_size: int, profile: Profile | str, *, strategy, branches: int = 2,
              baseline=None, schedule: Schedule | None = None, masks: torch.Tensor | None = None, cdf: float = 0.9,
              seed: int = 0, **kw) -> tuple[MeshStep, list[MeshStep]]:
    """The fastest mesh of ``world_size`` ranks for a model (``geometry``, or a preset name) on
    ``profile`` (a ``Profile`` or a built-in name): every ``valid_meshes`` candidate priced by
    ``mesh_step`` with ``strategy``'s facts (``model.StrategyFacts``) on ``masks`` (default:
    layer 0's synthetic masks at ``cdf``), ``branches`` guidance branches per step (``cfg`` 2
    only where there are several), and ``schedule`` (default: every one of 50 steps plans;
    ``baseline``: the dense path's facts where it has dense steps). The best is the least
    ``run["total_ms"]``, ties to the earlier candidate (fewer CFG halves, then fewer Ulysses
    ranks). Returns (the best, every candidate); ``kw``: ``mesh_step``'s."""
    from .profiles import get_profile

    geom = preset(geometry) if isinstance(geometry, str) else geometry
    profile = get_profile(profile) if isinstance(profile, str) else profile
    schedule = schedule or Schedule(steps=STEPS)
    masks = _synthetic(geom, cdf, seed) if masks is None else masks
    heads_divide = schedule_of(strategy) == "all-to-all"
    candidates = [m for m in valid_meshes(world_size, geom.heads, branches=branches, blocks=geom.num_blocks)
                  if not heads_divide or (geom.heads // m.ulysses) % m.sp == 0]
    if not candidates:
        raise ValueError(f"no mesh of {world_size} ranks runs {geom.name} ({geom.heads} heads) with {strategy.name}")
    priced = [mesh_step(masks, geom, m, profile, strategy, baseline=baseline, branches=branches, schedule=schedule,
                        **kw) for m in candidates]
    return min(priced, key=lambda s: s.run["total_ms"]), priced
