"""Host µs of a ``sparsp`` (or ``auto``) call between its one host read and its first pack.

On a fabric where the local kernel is not queued early (the host fabric at LTX size), the GPU
has nothing to do from the moment the read's copy lands until the host packs the first payload:
that host work is on the call's critical path. This probe stamps, with the host clock and no
profiler, per call: the read's start (``Metadata.start_read`` returns), its end (``finish``
returns), the transport's ``fence`` (start and duration), and the first ``send_buffer`` (the
pack follows it), and prints the medians over ``--calls`` calls of each configuration, per rank:

    read→landed   start_read's return to finish's return (the host waits for the device)
    landed→pack   finish's return to the first send_buffer (what the device waits for)
    fence         the fence's own duration, and where it ran (before or after the landing)
    call          the whole call, host clock, the device synchronised before and after

Two processes on one GPU over gloo (indicative: the ranks share the device), or the real thing
under torchrun:

    python scripts/probe_read_to_pack.py --pair --model ltx-2 [--drain-chunks 1 4]
    torchrun --standalone --nproc-per-node 2 scripts/probe_read_to_pack.py --model ltx-2 --transport host

``--out FILE`` writes the medians as JSON; ``--profile DIR`` traces one more call of each
configuration per rank (``bench attention``'s profiler settings). A measurement to decide what
to change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


class Stamps:
    """Host-clock stamps of one call; ``install`` wraps the functions that mark them."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.fence_s = 0.0

    def mark(self, name: str) -> None:
        self.now.setdefault(name, time.perf_counter())

    def install(self, transport_cls) -> None:
        from sparsp import plan

        start_read, finish = plan.Metadata.start_read, plan.Metadata.finish
        fence, send_buffer = transport_cls.fence, transport_cls.send_buffer
        stamps = self

        def start_read_(self_, *a, **kw):
            out = start_read(self_, *a, **kw)
            stamps.mark("read")
            return out

        def finish_(self_, *a, **kw):
            out = finish(self_, *a, **kw)
            stamps.mark("landed")
            return out

        def fence_(self_, *a, **kw):
            t0 = time.perf_counter()
            stamps.mark("fence")
            out = fence(self_, *a, **kw)
            stamps.fence_s += time.perf_counter() - t0
            return out

        def send_buffer_(self_, *a, **kw):
            stamps.mark("pack")
            return send_buffer(self_, *a, **kw)

        plan.Metadata.start_read, plan.Metadata.finish = start_read_, finish_
        transport_cls.fence, transport_cls.send_buffer = fence_, send_buffer_


def _measure(rank: int, world: int, args: argparse.Namespace, device: torch.device) -> dict:
    from sparsp import SparspConfig, sp_attention
    from sparsp.bench.attention import make_inputs
    from sparsp.geometry import preset
    from sparsp.placement import make_placement
    from sparsp.strategies import close_transports
    from sparsp.transport.host import HostTransport
    from sparsp.transport.ipc import IpcTransport
    from sparsp.transport.nccl import P2PTransport

    geom = preset(args.model)
    placement = make_placement("periodic", geom, world)
    q, k, v = make_inputs(geom, placement, rank, device, torch.bfloat16, seed=0)
    stamps = Stamps()
    stamps.install({c.name: c for c in (HostTransport, IpcTransport, P2PTransport)}[args.transport])
    rows = {}
    try:
        for drain in args.drain_chunks:
            cfg = SparspConfig(cdf_threshold=args.cdf, block_size=geom.block_size, transport=args.transport,
                               kernel=args.kernel, drain_chunks=drain, local_first=args.local_first)
            spans: dict[str, list[float]] = {k: [] for k in ("read_to_landed", "landed_to_pack", "fence",
                                                             "fence_before_landing", "call")}
            for i in range(args.warmup + args.calls):
                torch.cuda.synchronize(device)
                stamps.now.clear()
                stamps.fence_s = 0.0
                t0 = time.perf_counter()
                sp_attention(q, k, v, strategy=args.strategy, config=cfg)
                torch.cuda.synchronize(device)
                t1 = time.perf_counter()
                if i < args.warmup:
                    continue
                s = stamps.now
                spans["read_to_landed"].append(s["landed"] - s["read"])
                spans["landed_to_pack"].append(s["pack"] - s["landed"])
                spans["fence"].append(stamps.fence_s)
                spans["fence_before_landing"].append(float(s["fence"] < s["landed"]))
                spans["call"].append(t1 - t0)
            scale = {k: 1 if k == "fence_before_landing" else 1e6 for k in spans}  # a share, or µs
            rows[f"{args.strategy} drain_chunks={drain}"] = {k: round(statistics.median(v) * scale[k], 1)
                                                             for k, v in spans.items()}
            if args.profile:  # one more call traced (after a discarded warm-up one): bench's way
                from pathlib import Path

                from sparsp.bench.measure import count_syncs_and_collectives

                count_syncs_and_collectives(lambda: sp_attention(q, k, v, strategy=args.strategy, config=cfg),
                                            Path(args.profile) / f"{args.model}-{args.strategy}-d{drain}-r{rank}")
    finally:
        close_transports()
    return rows


def _pair_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    torch.cuda.set_device(0)
    return _measure(rank, world, args, torch.device("cuda", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ltx-2", help="geometry preset")
    ap.add_argument("--strategy", default="sparsp", choices=("sparsp", "auto"),
                    help="sparsp, or auto (its choice runs between the landing and the pack)")
    ap.add_argument("--pair", action="store_true", help="two gloo processes sharing GPU 0")
    ap.add_argument("--transport", default="host", choices=("host", "ipc", "nccl"),
                    help="the sparsp call's transport (only host with --pair)")
    ap.add_argument("--kernel", default="auto", help="auto (FA4 if installed, else flex), flex, fa4")
    ap.add_argument("--cdf", type=float, default=0.9)
    ap.add_argument("--drain-chunks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--local-first", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the medians as JSON here")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also trace one call per configuration and rank into DIR (read them with "
                         "scripts/trace_timeline.py)")
    args = ap.parse_args()
    args.local_first = {"auto": None, "on": True, "off": False}[args.local_first]
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if args.pair and args.transport != "host":
        ap.error("--pair shares one GPU: only the host transport runs there")
    if args.calls < 5 or args.warmup < 1:
        ap.error("--calls must be >= 5 and --warmup >= 1")
    if args.pair:
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        from dist_utils import run_distributed

        results = run_distributed(_pair_rank, 2, args, timeout=600)
    else:
        import torch.distributed as dist

        from sparsp.bench.common import init_distributed

        rank, world, device = init_distributed()
        mine = _measure(rank, world, args, device)
        results = [None] * world
        dist.all_gather_object(results, mine)
        if rank != 0:
            return
    for r, rows in enumerate(results):
        for name, row in rows.items():
            print(f"rank {r} {args.model} {name}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "transport": args.transport, "pair": args.pair,
                       "cdf": args.cdf, "ranks": results}, f, indent=1)


if __name__ == "__main__":
    main()
