"""Two GPUs exchanging through pinned host memory, with the staging buffers placed on chosen
NUMA nodes: does where the host memory lives set the host fabric's rate?

The ``host`` transport stages every payload in host memory: the producer copies device to
host into a slot, the consumer host to device out of it, both GPUs at once. On the 2×H200
box the traces put the device-to-host pieces at ≈ 52 GB/s and the host-to-device ones at ≈ 32
while both run. A slot's pages are allocated on the NUMA node its segment's creator ran on;
if the two GPUs hang off different sockets, the reads of one side cross the sockets' link.
This probe, in one process driving both GPUs, places buffer A (GPU a writes, GPU b reads) and
buffer B (b writes, a reads) on each pair of nodes the way ``SPARSP_HOST_NUMA`` places a slot
window (``shm.ShmSegment.create(placement=...)``), runs the exchange in ``--piece-mib`` pieces (each host-to-device piece after its device-to-host piece, as the
transport pipelines them), and prints GB/s per copy direction (``a→A``: GPU a's writes;
``A→b``: GPU b's reads, timed from before the first piece landed, so a pipe's whole time):

    python scripts/probe_host_numa.py [--devices 0 1] [--mib 128] [--piece-mib 16] [--iters 10]

It first prints each GPU's NUMA node (sysfs) and the host's nodes. With one node there is
nothing to place and it says so. ``--devices 0 0`` exercises the code on a one-GPU machine.
A measurement to decide what to change, not a benchmark.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics

import torch

from sparsp.transport.cuda_ops import gpu_numa_node
from sparsp.transport.shm import HEADER_BYTES, ShmSegment, numa_pages


def host_nodes() -> list[int]:
    try:
        return sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n.startswith("node")
                      and n[4:].isdigit())
    except OSError:
        return [0]


class PinnedOnNode:
    """``nbytes`` of host memory allocated on NUMA ``node`` the way the ``host`` transport's
    ``SPARSP_HOST_NUMA`` places a slot window (``ShmSegment.create(placement=...)``), then
    page-locked for the GPUs (``cudaHostRegister``, portable); ``tensor`` is the buffer."""

    def __init__(self, nbytes: int, node: int) -> None:
        self.seg = ShmSegment.create(f"numaprobe{secrets.token_hex(4)}", node, HEADER_BYTES + nbytes,
                                     placement=((HEADER_BYTES, nbytes, node),))
        self.seg.unlink()  # this process holds the only mapping: nothing left behind
        err = torch.cuda.cudart().cudaHostRegister(self.seg.ptr, self.seg.size, 1)  # portable
        if int(err) != 0:
            self.seg.close()
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        self.tensor = self.seg.tensor[HEADER_BYTES:]
        self.pages = numa_pages(self.seg.ptr)  # where the pages landed, as the kernel says

    def close(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.seg.ptr)
        del self.tensor
        self.seg.close()


def exchange(a: int, b: int, buf_a: torch.Tensor, buf_b: torch.Tensor, piece: int, iters: int) -> dict:
    """GPU a → A → GPU b and GPU b → B → GPU a at once, piece by piece; median GB/s."""
    n = buf_a.numel()
    src = {d: torch.randn(n // 4, device=f"cuda:{d}").view(torch.uint8) for d in {a, b}}
    dst = {d: torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}") for d in {a, b}}
    streams = {(d, k): torch.cuda.Stream(device=d) for d in {a, b} for k in ("d2h", "h2d")}
    rates: dict[str, list[float]] = {"a→A": [], "A→b": [], "b→B": [], "B→a": []}
    for it in range(iters + 2):
        for d in {a, b}:
            torch.cuda.synchronize(d)
        marks = {}
        for prod, cons, host, w, r in ((a, b, buf_a, "a→A", "A→b"), (b, a, buf_b, "b→B", "B→a")):
            s_out, s_in = streams[(prod, "d2h")], streams[(cons, "h2d")]
            ev = {k: torch.cuda.Event(enable_timing=True) for k in ("w0", "w1")}
            ev_in = {k: torch.cuda.Event(enable_timing=True) for k in ("r0", "r1")}
            with torch.cuda.device(prod):
                ev["w0"].record(s_out)
            with torch.cuda.device(cons):
                ev_in["r0"].record(s_in)
            for off in range(0, n, piece):
                with torch.cuda.device(prod), torch.cuda.stream(s_out):
                    host[off:off + piece].copy_(src[prod][off:off + piece], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(s_out)
                with torch.cuda.device(cons), torch.cuda.stream(s_in):
                    s_in.wait_event(done)
                    dst[cons][off:off + piece].copy_(host[off:off + piece], non_blocking=True)
            with torch.cuda.device(prod):
                ev["w1"].record(s_out)
            with torch.cuda.device(cons):
                ev_in["r1"].record(s_in)
            marks[w], marks[r] = (ev["w0"], ev["w1"]), (ev_in["r0"], ev_in["r1"])
        for d in {a, b}:
            torch.cuda.synchronize(d)
        if it < 2:
            continue
        for name, (e0, e1) in marks.items():  # a read's span starts before its first piece landed
            rates[name].append(n / e0.elapsed_time(e1) / 1e6)
    return {k: round(statistics.median(v), 1) for k, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, nargs=2, default=[0, 1], metavar=("A", "B"))
    ap.add_argument("--mib", type=int, default=128, help="bytes each way, MiB")
    ap.add_argument("--piece-mib", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA GPUs")
    a, b = args.devices
    if max(a, b) >= torch.cuda.device_count():
        ap.error(f"--devices {a} {b}: this machine has {torch.cuda.device_count()} GPU(s)")
    nodes = host_nodes()
    na, nb = gpu_numa_node(torch.device("cuda", a)), gpu_numa_node(torch.device("cuda", b))
    print(f"host NUMA nodes {nodes}; GPU {a} on node {na}, GPU {b} on node {nb}; "
          f"this process may run on CPUs {sorted(os.sched_getaffinity(0))[:4]}…")
    nbytes, piece = args.mib << 20, args.piece_mib << 20
    places = [(x, y) for x in nodes for y in nodes] if len(nodes) > 1 else [(nodes[0], nodes[0])]
    if len(nodes) == 1:
        print("one NUMA node: nothing to place; the exchange as it is:")
    for node_a, node_b in places:
        A, B = PinnedOnNode(nbytes, node_a), PinnedOnNode(nbytes, node_b)
        try:
            r = exchange(a, b, A.tensor, B.tensor, piece, args.iters)
        finally:
            A.close()
            B.close()
        print(f"A on node {node_a} (pages {A.pages}), B on node {node_b} (pages {B.pages}): GB/s "
              + ", ".join(f"{k} {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
