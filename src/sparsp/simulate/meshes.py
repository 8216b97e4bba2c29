"""``sparsp simulate --mesh``: a model's denoising step on a device mesh, per G and fabric.

Per (cdf, fabric, G, strategy): the mesh asked for (``cfg=C,ulysses=U``, sp the rest of G) or,
with ``--mesh auto``, the best one (``cost.mesh_step.best_mesh``: every valid mesh priced, the
fastest run kept), its step beside the flat group (one sp group of G ranks, the same
strategy) and beside the peers' composition with sparsity added at the same mesh (Ulysses ×
``ring-sparse``: the registered sparse strategy that ships full shards). A step is the
model's layers × its guidance branches (``options.BRANCHES``; ``--branches``) attention calls,
``ceil(branches / cfg)`` per layer on each CFG half, plus the halves' one exchange; its time
is the run's total over its steps under the schedule (``--steps``, ``--dense-steps``,
``--replan-every``). Masks: layer 0's synthetic masks (``--thresholds``: at layer 0's), the
same for every layer. The profiles of fewer GPUs than G are skipped at that G.
"""

from __future__ import annotations

import time

from ..analysis import DTYPE_BYTES, read_table
from ..cost.mesh import Mesh
from ..cost.mesh_step import best_mesh, mesh_step
from ..cost.profiles import get_profile
from ..geometry import preset
from ..strategies.registry import strategies_where, strategy_spec
from .options import BRANCHES, MaskCache, geometry, modelled

__all__ = ["peers", "print_meshes", "simulate_meshes"]


def peers() -> str:
    """The peers' sparse strategy: the registered sparse one that ships full shards (``ring-sparse``)."""
    return next(s for s in strategies_where(byte_rule="full-shards") if strategy_spec(s).sparse)


def simulate_meshes(cfg, progress=None) -> dict:
    """The ``simulate.json`` document of ``--mesh`` (module docstring)."""
    t0 = time.perf_counter()
    geom = geometry(cfg.model, cfg.text)
    table = read_table(cfg.thresholds, preset(cfg.model)) if cfg.thresholds is not None else None
    profiles = [get_profile(name) for name in cfg.fabric_names()]
    ranks = cfg.ranks or (8,)
    strategies = cfg.strategies or tuple(strategies_where(primary=True))
    for s in strategies:
        if not modelled(s):
            raise ValueError(f"--mesh: {s} has no schedule in the cost model; choose another --strategy")
    branches = BRANCHES[cfg.model] if cfg.branches is None else cfg.branches
    if cfg.mesh != "auto":
        for G in ranks:
            Mesh.parse(cfg.mesh, G).check(geom.heads, geom.num_blocks)  # before any work
    cache = MaskCache(cfg.seed, table)
    base, peer = strategy_spec(strategies_where(baseline=True)[0]), strategy_spec(peers())
    kw = dict(baseline=base, branches=branches, schedule=cfg.schedule, transport=cfg.transport,
              dtype_bytes=DTYPE_BYTES[cfg.dtype], local_first=cfg.local_first, prefetch=cfg.prefetch,
              placement=None if cfg.placement == "auto" else cfg.placement)
    rows, skipped = [], []
    task = progress.add_task("meshes", total=len(cfg.cdf) * len(profiles) * len(ranks) * len(strategies)) \
        if progress else None
    for cdf in cfg.cdf:
        masks = cache.get(geom, cdf)
        for prof in profiles:
            for G in ranks:
                if G > prof.gpus:
                    skipped.append({"ranks": G, "fabric": prof.name,
                                    "reason": f"profile {prof.name} has {prof.gpus} GPUs"})
                    continue
                for s in strategies:
                    rows.append({"cdf": cdf, **_row(masks, geom, prof, G, strategy_spec(s), peer, cfg.mesh, kw)})
                    if progress is not None:
                        progress.advance(task)
    return {"kind": "simulate", "mode": "mesh", "model": geom.name, "tokens": geom.num_tokens, "heads": geom.heads,
            "head_dim": geom.head_dim, "layers": geom.layers, "branches": branches, "dtype": cfg.dtype,
            "masks": f"synthetic (seed {cfg.seed})" + (f", layer 0 of {table.path}" if table else ""),
            "mesh": cfg.mesh, "fabrics": [p.name for p in profiles], "ranks": list(ranks), "cdf": list(cfg.cdf),
            "schedule": cfg.schedule.to_dict(), "results": rows, "skipped": skipped,
            "seconds": round(time.perf_counter() - t0, 2)}


def _row(masks, geom, prof, G: int, spec, peer, asked: str, kw: dict) -> dict:
    """One (fabric, G, strategy) row: the mesh (asked for, or the best), the flat group and the
    peers' composition at that mesh, each with its step and run."""
    if asked == "auto":
        best, every = best_mesh(geom, G, prof, strategy=spec, masks=masks, **kw)
        flat = next(m for m in every if m.mesh.flat)
    else:
        every = []
        best = mesh_step(masks, geom, Mesh.parse(asked, G), prof, spec, **kw)
        flat = best if best.mesh.flat else mesh_step(masks, geom, Mesh(sp=G), prof, spec, **kw)
    peers_step = mesh_step(masks, geom, best.mesh, prof, peer, **kw) if peer.name != spec.name else best
    per_step = lambda m: m.run["per_step_ms"]  # noqa: E731
    return {"fabric": prof.name, "ranks": G, "strategy": spec.name, "mesh": best.mesh.to_dict(),
            "label": best.mesh.label, "step_ms": per_step(best), "flat_step_ms": per_step(flat),
            "peers_step_ms": per_step(peers_step), "peers": peer.name,
            "vs_flat": round(per_step(flat) / per_step(best), 4),
            "vs_peers": round(per_step(peers_step) / per_step(best), 4),
            "best": best.to_dict(), "flat": flat.to_dict(), "peers_mesh": peers_step.to_dict(),
            "candidates": [m.to_dict() for m in every]}


def print_meshes(doc: dict, console) -> None:
    """The rows as a table: per G and fabric the mesh, its step, the flat group's and the peers'."""
    from rich.table import Table

    sched = doc["schedule"]
    table = Table(title=f"{doc['model']}: {doc['tokens']:,} tokens, {doc['heads']}x{doc['head_dim']} heads, "
                        f"{doc['layers']} layers x {doc['branches']} branch(es) per step, {doc['masks']} masks; "
                        f"--mesh {doc['mesh']}; ms per step over a run of {sched['steps']} steps ({sched['summary']})")
    for col in ("cdf", "G", "fabric", "strategy", "cfg x ulysses x sp", "step ms", "flat", "vs flat", "peers",
                "vs peers"):
        table.add_column(col, justify="right" if col not in ("fabric", "strategy") else "left")
    for r in doc["results"]:
        m = r["mesh"]
        table.add_row(f"{r['cdf']:.2f}", str(r["ranks"]), r["fabric"], r["strategy"],
                      f"{m['cfg']} x {m['ulysses']} x {m['sp']}",
                      f"{r['step_ms']:,.1f}", f"{r['flat_step_ms']:,.1f}", f"{r['vs_flat']:.2f}x",
                      f"{r['peers_step_ms']:,.1f}", f"{r['vs_peers']:.2f}x")
    console.print(table)
    console.print("step ms: the mesh's denoising step (its layers' attention calls, ceil(branches / cfg) per layer "
                  "on each CFG half, and the halves' exchange of their predictions); flat: the same strategy on one "
                  f"group of G ranks; peers: ulysses x {peers()} at the same mesh (the peers' composition with "
                  "sparsity added)", markup=False, highlight=False)
    for r in doc["results"]:
        if r["candidates"]:
            every = ", ".join(f"{c['mesh']['cfg']}x{c['mesh']['ulysses']}x{c['mesh']['sp']} "
                              f"{c['run']['per_step_ms']:,.1f}" for c in r["candidates"])
            console.print(f"{r['strategy']}, G={r['ranks']}, {r['fabric']}, every mesh (cfg x ulysses x sp, step ms): "
                          f"{every}", markup=False, highlight=False)
    for s in doc["skipped"]:
        console.print(f"skipped {s['fabric']} at G={s['ranks']}: {s['reason']}", markup=False, highlight=False)
