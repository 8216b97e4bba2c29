#!/usr/bin/env python3
"""GPU soak: many consecutive ``sp_attention`` calls over NCCL with new
inputs (and so new masks) every call; device memory must not grow.

    PYTHONPATH=src python3 scripts/gpu_soak.py                      # 2 GPUs, 2,000 calls
    PYTHONPATH=src python3 scripts/gpu_soak.py --transport host --calls 500
    torchrun --nproc-per-node 2 scripts/gpu_soak.py --transport ipc
    PYTHONPATH=src python3 scripts/gpu_soak.py --cpu --tokens 256 --heads 2 --head-dim 16 \\
        --block-size 16 --calls 200                                 # smoke test without GPUs

Without torchrun it starts ``--world`` processes itself (one GPU each). Strategy ``sparsp``;
``--transport all`` (the default) takes auto, ipc and host in turn, call by call, so all three
stay live together; the CDF threshold cycles too. Each rank prints
``torch.cuda.memory_allocated`` and ``max_memory_allocated`` at the start, after the warm-up
(every transport built, the kernel compiled) and after the last call; the run fails (exit 1)
when allocated memory after the last call exceeds the post-warm-up value by more than
``--max-growth-mib`` on any rank, or when a sampled call differs from the ``nccl`` transport
on the same inputs. Exit 2: ``--max-seconds`` ran out first. The last line is a summary.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

TRANSPORTS = ("auto", "ipc", "host", "nccl")
CDFS = (0.8, 0.9, 0.95)
MIB = 1 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--calls", type=int, default=2000,
                   help="attention calls per rank (default 2000)")
    p.add_argument("--transport", default="all", choices=("all",) + TRANSPORTS,
                   help="all: auto, ipc, host in turn, one per call (default)")
    p.add_argument("--world", type=int, default=2, help="processes to start without torchrun")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per rank (default 8192)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kernel", default="auto", choices=("auto", "torch", "flex"))
    p.add_argument("--warmup", type=int, default=3,
                   help="calls of every config (transport x CDF threshold, the nccl check's too) "
                        "before the baseline measurement (default 3: the eager first call of a "
                        "geometry, the CUDA-graph capture of its plan stage on the second, a replay; "
                        "a stage captured later would count as growth)")
    p.add_argument("--check-every", type=int, default=100,
                   help="compare every N-th call with the nccl transport on the same inputs "
                        "(0: never; default 100)")
    p.add_argument("--max-growth-mib", type=float, default=32.0,
                   help="allowed growth of allocated memory after the warm-up (default 32 MiB)")
    p.add_argument("--max-seconds", type=float, default=240.0,
                   help="stop (exit 2) when the soak runs longer than this (default 240)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true",
                   help="gloo on CPU, torch kernel, RSS instead of device memory: a smoke "
                        "test of this script")
    args = p.parse_args(argv)
    if args.calls < 1 or args.world < 2:
        p.error("--calls must be >= 1 and --world >= 2")
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _memory(device: torch.device) -> tuple[int, int]:
    """(allocated, max allocated) bytes on ``device``; RSS twice on CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    rss = _rss_bytes()
    return rss, rss


def _inputs(args, device, dtype, rank: int, call: int):
    """New q, k, v every call: a shared direction per head plus noise, so masks are sparse."""
    g = torch.Generator(device=device).manual_seed(args.seed * 1_000_003 + call * 64 + rank)
    shape = (1, args.tokens, args.heads, args.head_dim)
    c = 2 * torch.randn(1, 1, args.heads, args.head_dim, generator=g, device=device)
    ramp = torch.linspace(-2, 2, args.tokens, device=device).view(1, -1, 1, 1)
    q = c + torch.randn(shape, generator=g, device=device)
    k = c + torch.randn(shape, generator=g, device=device) + ramp
    v = torch.randn(shape, generator=g, device=device)
    return tuple(x.to(dtype).contiguous() for x in (q, k, v))


def soak(args, rank: int, world: int, local: int, init_method: str) -> int:
    from sparsp import SparspConfig, close_transports, sp_attention

    device = torch.device("cpu") if args.cpu else torch.device("cuda", local)
    what = "allocated" if device.type == "cuda" else "RSS"
    if args.cpu:
        torch.set_num_threads(1)  # the ranks share the cores
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    else:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                                device_id=device, timeout=datetime.timedelta(seconds=300))
    dtype = torch.float32 if args.cpu else torch.bfloat16
    names = ["auto", "ipc", "host"] if args.transport == "all" else [args.transport]
    if args.cpu:
        names = [n for n in names if n != "ipc"] or ["nccl"]  # ipc moves CUDA tensors only
    kernel = "torch" if args.cpu else args.kernel
    configs = {(n, c): SparspConfig(cdf_threshold=c, block_size=args.block_size, transport=n,
                                    kernel=kernel, timeout_s=120.0)
               for n in names + ["nccl"] for c in CDFS}
    warmup = args.warmup * len(configs)
    say = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    say(f"gpu_soak: {world} ranks, {args.calls} calls, transports {','.join(names)}, "
        f"{args.tokens} tokens x {args.heads} heads x {args.head_dim} per rank, {dtype}, "
        f"block {args.block_size}, kernel {kernel}, device {device.type}")
    start = _memory(device)
    t0 = time.monotonic()
    for j in range(args.warmup):  # every config's stage captured before the baseline
        for (name, cdf), cfg in configs.items():
            q, k, v = _inputs(args, device, dtype, rank, args.calls + j)
            sp_attention(q, k, v, strategy="sparsp", config=cfg)
    del q, k, v
    base, t_warm = _memory(device), time.monotonic()
    checked, worst, done, stopped = 0, 0.0, 0, False
    for i in range(args.calls):
        name = names[i % len(names)]
        cdf = CDFS[(i // len(names)) % len(CDFS)]
        q, k, v = _inputs(args, device, dtype, rank, i)
        out = sp_attention(q, k, v, strategy="sparsp", config=configs[(name, cdf)])
        if args.check_every and i % args.check_every == 0 and name != "nccl":
            want = sp_attention(q, k, v, strategy="sparsp", config=configs[("nccl", cdf)])
            diff = (out.float() - want.float()).abs().max().item()
            if not (torch.isfinite(out).all().item() and diff <= 2e-2):
                print(f"rank {rank}: call {i} ({name}) differs from nccl by {diff}", flush=True)
                worst = float("inf")
            checked, worst = checked + 1, max(worst, diff)
        del q, k, v, out
        done = i + 1
        if done % 50 == 0:  # every rank stops at the same call: the calls are collective
            late = torch.tensor([float(time.monotonic() - t0 > args.max_seconds)], device=device)
            dist.all_reduce(late, op=dist.ReduceOp.MAX)
            if late.item():
                stopped = True
                break
        if done % 250 == 0:
            rate = done / max(time.monotonic() - t_warm, 1e-9)
            alloc = _memory(device)[0]
            say(f"  {done}/{args.calls} calls, {rate:.1f} calls/s after the warm-up, "
                f"rank 0 {what} {alloc / MIB:.1f} MiB")
    elapsed = time.monotonic() - t0
    after = _memory(device)
    dist.barrier()
    close_transports()
    closed = _memory(device)
    growth = (after[0] - base[0]) / MIB
    mine = {"rank": rank, "start": start, "base": base, "after": after, "closed": closed,
            "growth": growth, "checked": checked, "worst": worst}
    print(f"rank {rank}: {done} calls in {elapsed:.1f} s; {what} start {start[0] / MIB:.1f} MiB, "
          f"after warm-up ({warmup} calls) {base[0] / MIB:.1f} MiB, after the last call "
          f"{after[0] / MIB:.1f} MiB (growth {growth:+.1f} MiB), after close_transports "
          f"{closed[0] / MIB:.1f} MiB; max allocated {base[1] / MIB:.1f} -> {after[1] / MIB:.1f} "
          f"MiB; {checked} calls checked against nccl (max diff {worst:.3g})", flush=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    bad_mem = [e["rank"] for e in everyone if e["growth"] > args.max_growth_mib]
    bad_out = [e["rank"] for e in everyone if not e["worst"] <= 2e-2]
    status = 2 if stopped else (1 if bad_mem or bad_out else 0)
    verdict = {0: "OK", 1: "FAIL", 2: "STOPPED (time budget)"}[status]
    rate = done / max(time.monotonic() - t_warm, 1e-9)
    say(f"gpu_soak {verdict}: {done}/{args.calls} calls x {world} ranks ({','.join(names)}) in "
        f"{elapsed:.1f} s ({rate:.1f} calls/s); {what} after warm-up -> after last call: "
        + ", ".join(f"rank {e['rank']} {e['base'][0] / MIB:.1f} -> {e['after'][0] / MIB:.1f} MiB"
                    for e in everyone)
        + f" (bound +{args.max_growth_mib:g} MiB"
        + (f", exceeded on ranks {bad_mem}" if bad_mem else "") + "); peak "
        + f"{max(e['after'][1] for e in everyone) / MIB:.1f} MiB; "
        + f"{sum(e['checked'] for e in everyone)} sampled calls vs nccl"
        + (f", WRONG on ranks {bad_out}" if bad_out else ", equal"))
    return status


def _spawned(rank: int, args, world: int, port: int, codes) -> None:
    try:
        codes[rank] = soak(args, rank, world, rank, f"tcp://127.0.0.1:{port}")
    except BaseException:
        import traceback

        traceback.print_exc()
        codes[rank] = 1


def main(argv=None) -> int:
    args = parse_args(argv)
    # NVLink multicast stays off, as scripts/gpu_check.sh sets it
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")
    if "RANK" in os.environ:  # torchrun
        return soak(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                    int(os.environ.get("LOCAL_RANK", 0)), "env://")
    if not args.cpu and torch.cuda.device_count() < args.world:
        print(f"gpu_soak: needs {args.world} GPUs, found {torch.cuda.device_count()} "
              "(--cpu runs the smoke version)", file=sys.stderr)
        return 1
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    codes = ctx.Array("i", [-1] * args.world)
    port = _free_port()
    procs = [ctx.Process(target=_spawned, name=f"rank{r}",
                         args=(r, args, args.world, port, codes)) for r in range(args.world)]
    for p in procs:
        p.start()
    # a rank that failed leaves its peers blocked in a collective: give them a grace period
    deadline = None
    while any(p.is_alive() for p in procs):
        time.sleep(0.5)
        failed = any(p.exitcode not in (None, 0) or codes[r] not in (-1, 0, 2)
                     for r, p in enumerate(procs))
        if failed and deadline is None:
            deadline = time.monotonic() + 30.0
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.is_alive():
                    print(f"gpu_soak: {p.name} still running 30 s after a rank failed: killed",
                          file=sys.stderr)
                    p.kill()
    for p in procs:
        p.join()
    results = [c if p.exitcode == 0 and c >= 0 else max(c, 1) for c, p in zip(codes, procs)]
    return max(results)


if __name__ == "__main__":
    sys.exit(main())
