"""Host µs of one ``fence`` of the slot transports: as the code is, and with a second barrier
after the flag reset (what ``fence`` did until 2026-12-01, tenth session).

Two processes over gloo share this machine (a CPU, or one GPU with ``--device cuda``); each
call exchanges one small payload each way, waits for it, then times ``fence()`` on the host.
The two forms alternate in blocks (``--blocks`` of each, ``--calls`` fences per block) so that
drift hits both; per rank, the median µs of each block:

    python scripts/probe_fence.py [--device cuda] [--calls 300] [--blocks 2]

A measurement to decide what to change, not a benchmark.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dist_utils import run_distributed  # noqa: E402  (tests/: the gloo process harness)
from sparsp.transport.host import HostTransport  # noqa: E402


def _rank(rank: int, world: int, tag: str, calls: int, blocks: int, device: str) -> dict:
    dev = torch.device(device)
    t = HostTransport(None, timeout_s=30, window=3, slot_bytes=1 << 16, tag=tag,
                      device=dev if dev.type == "cuda" else None)
    reset = type(t)._reset_flags

    def reset_then_meet() -> None:
        reset(t)
        t._barrier("fence flag reset")

    peer = 1 - rank
    out: dict[str, list[float]] = {"one barrier": [], "two barriers": []}
    for _ in range(blocks):
        for form in out:
            if form == "two barriers":
                t._reset_flags = reset_then_meet
            else:
                t.__dict__.pop("_reset_flags", None)
            spans = []
            for _ in range(calls):
                buf = t.send_buffer(peer, 1024, torch.float32)
                buf.fill_(rank)
                t.publish(peer, buf)
                got = torch.empty(1024, device=dev)
                t.fetch(peer, got).wait()
                t.release(peer)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                t.fence()
                spans.append(time.perf_counter() - t0)
            out[form].append(round(statistics.median(spans) * 1e6, 1))
    t.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (both processes on GPU 0)")
    ap.add_argument("--calls", type=int, default=300, help="fences per block")
    ap.add_argument("--blocks", type=int, default=2, help="blocks of each form, alternating")
    args = ap.parse_args()
    if args.calls < 10 or args.blocks < 1:
        ap.error("--calls must be >= 10 and --blocks >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU here")
    res = run_distributed(_rank, 2, f"fence{os.getpid()}", args.calls, args.blocks, args.device,
                          timeout=600)
    for r, forms in enumerate(res):
        print(f"rank {r} ({args.device}): median fence µs per block: "
              + "; ".join(f"{form} {vals}" for form, vals in forms.items()))


if __name__ == "__main__":
    main()
