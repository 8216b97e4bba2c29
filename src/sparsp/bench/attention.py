"""One attention layer per strategy on several GPUs (run under torchrun).

    torchrun --nproc-per-node 2 -m sparsp.cli bench attention --model hunyuan-video --fabric nvlink
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m sparsp.cli bench attention --fabric host

Inputs are the synthetic video Q/K of ``sparsp.workloads`` (V random) at the model's full
geometry, placed periodically for ``sparsp`` and contiguously for the baselines (each as it
would run). Every strategy uses the same kernel; timings are CUDA events around the whole
call (mask, plan, transfers, kernels, merge), warm-up first, median of ≥ 10 iterations, the
slowest rank each iteration. Results: ``bench/results/attention-<model>-<machine>-<date>.json``
(+ PNG); a second run with the other ``--fabric`` extends the same file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from .common import init_distributed, median, time_ms, write_result

FABRICS = ("nvlink", "host")


def add_arguments(p) -> None:
    from ..demand import STRATEGIES
    from ..geometry import PRESETS

    p.add_argument("--model", default="hunyuan-video", choices=PRESETS)
    p.add_argument("--text", action="store_true", help="include the model's text tokens (default: video only)")
    p.add_argument("--cdf", type=float, nargs="+", default=[0.9])
    p.add_argument("--strategy", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--placement", default="auto", choices=["auto", "contiguous", "periodic"],
                   help="auto: periodic for sparsp and ring-relay, contiguous for the rest")
    p.add_argument("--fabric", default="nvlink", choices=FABRICS,
                   help="nvlink: peer copies allowed; host: NCCL_P2P_DISABLE=1, host-staged transports")
    p.add_argument("--transport", default="nccl", choices=["auto", "nccl", "ipc", "host"])
    p.add_argument("--kernel", default="auto", choices=["auto", "torch", "flex"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results"))


def make_inputs(geom, placement, rank: int, device, dtype, seed: int):
    """This rank's placed slice of synthetic q, k (model RoPE structure) and random v."""
    from ..workloads import token_qk

    tokens = placement.perm[placement.token_slice(rank)]
    q, k = token_qk(geom, seed=seed, tokens=tokens, device=device, dtype=torch.float32)
    g = torch.Generator(device=device).manual_seed(seed + 17 + rank)
    v = torch.randn(q.shape, generator=g, device=device, dtype=torch.float32)
    return tuple(x.to(dtype).contiguous() for x in (q, k, v))


def main(args) -> int:
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from .. import SparspConfig, sp_attention
    from ..geometry import preset
    from ..placement import make_placement
    from ..strategies import get_transport

    if args.iters < 10:
        raise SystemExit("--iters must be >= 10 (medians of at least ten timed iterations)")
    if args.fabric == "host" and os.environ.get("NCCL_P2P_DISABLE") != "1":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # before NCCL creates its communicators
    rank, world, device = init_distributed()
    console = Console() if rank == 0 else None
    geom = preset(args.model)
    if not args.text:
        geom = replace(geom, text_tokens=0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    transport = args.transport
    rows = []
    inputs = {}
    for cdf in args.cdf:
        for strategy in args.strategy:
            if strategy == "ulysses" and geom.heads % world:
                continue
            kind = args.placement if args.placement != "auto" else (
                "periodic" if strategy in ("sparsp", "ring-relay") else "contiguous")
            if kind not in inputs:
                pl = make_placement(kind, geom, world)
                inputs.clear()  # one placement's inputs on the GPU at a time
                inputs[kind] = (pl, make_inputs(geom, pl, rank, device, dtype, args.seed))
            pl, (q, k, v) = inputs[kind]
            cfg = SparspConfig(cdf_threshold=cdf, block_size=geom.block_size, transport=transport,
                               kernel=args.kernel, timeout_s=300.0)
            t = get_transport(transport, None, device, cfg.timeout_s)
            call = lambda: sp_attention(q, k, v, strategy=strategy, config=cfg)  # noqa: E731
            call()
            t.fence()
            t.reset_counters()
            call()
            t.fence()
            moved = torch.tensor([t.total_received], dtype=torch.long, device=device)
            dist.all_reduce(moved)
            times = time_ms(call, warmup=args.warmup, iters=args.iters, device=device)
            density = _density(q, k, geom, cfg, strategy)
            row = {"model": geom.name, "tokens": geom.num_tokens, "ranks": world, "fabric": args.fabric,
                   "cdf": cdf, "strategy": strategy, "transport": t.name, "placement": kind,
                   "kernel": args.kernel, "median_ms": round(median(times), 3),
                   "min_ms": round(min(times), 3), "iters": len(times),
                   "bytes_moved": int(moved.item()), "density": density}
            rows.append(row)
            if console:
                console.print(f"{strategy:12s} {kind:10s} cdf {cdf}: {row['median_ms']:.2f} ms, "
                              f"{row['bytes_moved'] / 2**30:.2f} GiB moved, density {density:.3f}")
    if rank == 0:
        path = write_result("attention", geom.name, rows, args.out)
        table = Table(title=f"attention, {geom.name}, {world} GPUs, fabric {args.fabric}")
        for c in ("strategy", "placement", "cdf", "median ms", "GiB moved", "density"):
            table.add_column(c)
        for r in rows:
            table.add_row(r["strategy"], r["placement"], str(r["cdf"]), f"{r['median_ms']:.2f}",
                          f"{r['bytes_moved'] / 2**30:.3f}", f"{r['density']:.3f}")
        console.print(table)
        console.print(f"wrote {path}")
        plot(path)
    dist.barrier()
    from ..strategies import close_transports

    close_transports()
    dist.destroy_process_group()
    return 0


def _density(q, k, geom, cfg, strategy) -> float:
    """Mean kept-block share of the mask this call used (1.0 for the dense ring)."""
    if strategy == "ring":
        return 1.0
    from ..plan import exchange_shapes, local_mask

    shapes = exchange_shapes(q, None, cfg, strategy)
    m = local_mask(q, k, shapes, None, cfg)
    d = torch.tensor([m.float().sum().item(), m.numel()], dtype=torch.float64, device=q.device)
    dist.all_reduce(d)
    return round((d[0] / d[1]).item(), 4)


def plot(path: Path) -> Path:
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(path).read_text())
    rows = doc["rows"]
    fabrics = list(dict.fromkeys(r["fabric"] for r in rows))
    # one group per (strategy, transport): the transports differ by fabric (nccl on both,
    # ipc on nvlink, host on host), so a group may have one bar
    groups = list(dict.fromkeys((r["strategy"], r["transport"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(groups)), 4.5))
    width = 0.8 / max(1, len(fabrics))
    for i, fab in enumerate(fabrics):
        ys = []
        for s, t in groups:
            rs = [r for r in rows if r["fabric"] == fab and r["strategy"] == s and r["transport"] == t]
            ys.append(rs[-1]["median_ms"] if rs else float("nan"))
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=fab)
    ax.set_xticks([j + width * (len(fabrics) - 1) / 2 for j in range(len(groups))],
                  [f"{s}\n{t}" for s, t in groups], fontsize=8)
    ax.set(ylabel="median ms per attention call", title=f"{rows[0]['model']} attention, {doc['machine']}")
    ax.legend(title="fabric")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
