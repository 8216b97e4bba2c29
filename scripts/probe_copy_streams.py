"""Host-memory copies on one GPU: device-to-host and host-to-device at once, the host-to-device
side on one stream or spread over several (one GPU; pinned host memory).

The ``host`` transport moves a payload as a device-to-host copy on the producer and a
host-to-device copy on the consumer, in pieces, one stream each way (``transport/host.py``).
On the 2×H200 box, both ranks exchanging, the traces put the device-to-host pieces at ≈ 52
GB/s and the host-to-device ones at ≈ 32 GB/s while both run (≈ 54 alone). This probe asks
whether that asymmetry is already there on one GPU copying both ways at once, and whether the
host-to-device side goes faster spread over several streams (copy engines):

    python scripts/probe_copy_streams.py [--mib 128] [--piece-mib 16] [--streams 1 2 3] [--iters 10]

Per setting: GB/s of each direction (bytes / span from the first copy's start to the last
one's end, CUDA events), median of ``--iters``. A measurement to decide what to change.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _run(nbytes: int, piece: int, h2d_streams: int, both: bool, iters: int) -> tuple[float, float]:
    """Median GB/s (device-to-host, host-to-device) of ``iters`` exchanges; each direction
    timed on one stream: a start event its copy streams wait on, and an end event after it
    waited on all of them."""
    dev = torch.device("cuda")
    src_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    plan = {"h2d": [torch.cuda.Stream(dev) for _ in range(h2d_streams)]}
    if both:
        plan["d2h"] = [torch.cuda.Stream(dev)]
    timers = {name: torch.cuda.Stream(dev) for name in plan}
    out: dict[str, list[float]] = {name: [] for name in plan}
    for it in range(iters + 2):
        torch.cuda.synchronize()
        gate = torch.cuda.Event()
        torch.cuda._sleep(2_000_000)  # ≈ 1 ms on an H200: the host queues everything behind it
        gate.record()
        marks = {}
        for name, streams in plan.items():
            timer = timers[name]
            timer.wait_event(gate)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(timer)
            for s in streams:
                s.wait_event(start)
            for j, off in enumerate(range(0, nbytes, piece)):
                with torch.cuda.stream(streams[j % len(streams)]):
                    if name == "d2h":
                        dst_host[off:off + piece].copy_(src_dev[off:off + piece], non_blocking=True)
                    else:
                        dst_dev[off:off + piece].copy_(src_host[off:off + piece], non_blocking=True)
            for s in streams:
                timer.wait_stream(s)
            end.record(timer)
            marks[name] = (start, end)
        torch.cuda.synchronize()
        if it >= 2:
            for name, (start, end) in marks.items():
                out[name].append(nbytes / start.elapsed_time(end) / 1e6)
    med = {name: statistics.median(v) for name, v in out.items()}
    return med.get("d2h", 0.0), med["h2d"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=128, help="bytes each way, MiB")
    ap.add_argument("--piece-mib", type=int, default=16, help="one copy's size, MiB")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 3], help="host-to-device streams")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    nbytes, piece = args.mib << 20, args.piece_mib << 20
    for n in args.streams:
        _, alone = _run(nbytes, piece, n, both=False, iters=args.iters)
        d2h, h2d = _run(nbytes, piece, n, both=True, iters=args.iters)
        print(f"host-to-device on {n} stream(s): alone {alone:5.1f} GB/s; with a device-to-host copy "
              f"at once: host-to-device {h2d:5.1f}, device-to-host {d2h:5.1f} GB/s")


if __name__ == "__main__":
    main()
