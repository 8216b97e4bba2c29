"""Two GPUs exchanging through pinned host memory, with the staging buffers placed on chosen
NUMA nodes: does where the host memory lives set the host fabric's rate?

The ``host`` transport stages every payload in host memory: the producer copies device to
host into a slot, the consumer host to device out of it, both GPUs at once. On the 2×H200
box the traces put the device-to-host pieces at ≈ 52 GB/s and the host-to-device ones at ≈ 32
while both run. A slot's pages live on the NUMA node of whichever process touched them first;
if the two GPUs hang off different sockets, the reads of one side cross the sockets' link.
This probe, in one process driving both GPUs (no transport code), places buffer A (GPU a
writes, GPU b reads) and buffer B (b writes, a reads) on each pair of nodes, runs the exchange
in ``--piece-mib`` pieces (each host-to-device piece after its device-to-host piece, as the
transport pipelines them), and prints GB/s per copy direction (``a→A``: GPU a's writes;
``A→b``: GPU b's reads, timed from before the first piece landed, so a pipe's whole time):

    python scripts/probe_host_numa.py [--devices 0 1] [--mib 128] [--piece-mib 16] [--iters 10]

It first prints each GPU's NUMA node (sysfs) and the host's nodes. With one node there is
nothing to place and it says so. ``--devices 0 0`` exercises the code on a one-GPU machine.
A measurement to decide what to change, not a benchmark.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics

import torch

SYS_MBIND = 237  # x86-64
MPOL_BIND = 2


def gpu_node(device: int) -> int:
    """The NUMA node sysfs gives the GPU's PCI device (-1: unknown)."""
    props = torch.cuda.get_device_properties(device)
    try:
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            return int(f.read().strip())
    except (AttributeError, OSError, ValueError):
        return -1


def host_nodes() -> list[int]:
    try:
        return sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n.startswith("node")
                      and n[4:].isdigit())
    except OSError:
        return [0]


class PinnedOnNode:
    """``nbytes`` of anonymous memory bound to NUMA ``node`` (mbind before the first touch),
    touched, then page-locked for the GPUs (``cudaHostRegister``, portable)."""

    def __init__(self, nbytes: int, node: int) -> None:
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_ulong(1 << node)
        if libc.syscall(SYS_MBIND, ctypes.c_void_p(self.addr), ctypes.c_ulong(nbytes), MPOL_BIND,
                        ctypes.byref(mask), ctypes.c_ulong(64), 0) != 0:
            raise OSError(ctypes.get_errno(), f"mbind to node {node} failed")
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.tensor.fill_(1)  # the first touch: the pages land on ``node``
        err = torch.cuda.cudart().cudaHostRegister(self.addr, nbytes, 1)  # cudaHostRegisterPortable
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {err}")

    def close(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(self.addr)
        del self.tensor
        try:
            self.map.close()
        except BufferError:  # a view still alive: the mapping goes with the process
            pass


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
    na, nb = gpu_node(a), gpu_node(b)
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
        print(f"A on node {node_a}, B on node {node_b}: GB/s " + ", ".join(f"{k} {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
