"""The built-in machine profiles, each figure with its source (``get_profile``).

The two ``h200x2-*`` profiles are this project's own measurements (``bench/results/``,
docs/performance.md); the four ``pcie*-8gpu-*`` boxes and the multi-host profiles (eight hosts
of eight GPUs: ``dgx-h100-8hosts``, ``dgx-h200-8hosts``, ``pcie5-8hosts-*``) come from public
specifications, cited in each profile's ``sources`` and in docs/simulate.md. What a profile
holds: ``cost.machine.Profile``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from .machine import BENCH_FABRICS, KERNEL_LAYOUTS, KernelFigure, KernelPoint, Profile, TransportFigure

# 2×H200, measured here (2026-11-30). Kernel: `flex`, 409 TFLOP/s kept at d128, 392 at
# d64; cuDNN dense 619 / 485 is the one-GPU reference. With the `sparsp[fa4]` extra, kernel=auto
# runs FA4 instead (606.8 / 415.0 kept: the median of the FA4 local and packed rows of
# `bench kernel` on one H200, 2026-11-30; `--fit-profile` reads the newest kernel file). The built-in
# sparse figures stay flex's: the PCIe profiles scale from them (FA4's block-sparse path is sm90 only,
# so an L40S or an RTX PRO 6000 runs flex), and `cost/chunks.py` decides chunks at run
# time with them for a call that runs flex; a call that runs FA4 uses ``fa4_tflops`` there.
_H200_KERNELS = (KernelFigure(head_dim=64, sparse_tflops=392.0, dense_tflops=485.0, fa4_tflops=415.0),
                 KernelFigure(head_dim=128, sparse_tflops=409.0, dense_tflops=619.0, fa4_tflops=606.8))
# Fixed costs: "≈ 12 communication ops ... ≈ 6 ms of host time in collective bookkeeping" per
# call at LTX size → 0.5 ms per small collective (one per call now; `--fit-profile` takes NCCL's
# fitted latency); call_ms and launch_ms are estimates.
_FIXED = dict(launch_ms=0.1, call_ms=1.0, sync_ms=0.5)

_H200_NVLINK = Profile(
    name="h200x2-nvlink", description="2×H200, NV18 NVLink, peer copies on copy engines",
    gpus=2, peer_access=True,
    # ipc exchange, both GPUs at once: 366.7 GB/s per direction at 256 MiB; latency 0.11 ms
    # (intercept of time versus size, transport-all-2xH200-2026-11-30.json).
    link_gbps=367.0, hbm_gbps=4000.0,
    transports=(TransportFigure(name="ipc", efficiency=1.0, latency_ms=0.11),
                # NCCL send/recv over NVLink: 170 GB/s at 256 MiB, ≈ 0.6 ms flat below 8 MiB.
                TransportFigure(name="nccl", efficiency=170.0 / 367.0, latency_ms=0.6)),
    kernels=_H200_KERNELS, **_FIXED,
    sources=("2xH200 copy-engine and NCCL probes (2026-11-30)", "bench/results/transport-all-2xH200-2026-11-30.json"),
)

_H200_HOST = Profile(
    name="h200x2-host", description="2×H200 without peer access: pinned host memory over PCIe Gen5",
    gpus=2, peer_access=False,
    # D2H or H2D alone 53–55 GB/s per GPU; D2H and H2D at once on one GPU 44–47 each way; both
    # GPUs duplex at once 33.5 each way: a shared cap of 2 × 2 × 33.5 = 134 GB/s of DMA traffic.
    link_gbps=54.0, duplex_gbps=90.0, host_gbps=134.0, hbm_gbps=4000.0,
    transports=(TransportFigure(name="host", efficiency=1.0, latency_ms=0.27),
                # NCCL with NCCL_P2P_DISABLE=1: 21.5 GB/s against the host transport's 34.3.
                TransportFigure(name="nccl", efficiency=21.5 / 34.3, latency_ms=0.6)),
    kernels=_H200_KERNELS, **_FIXED,
    sources=("2xH200 copy-engine and NCCL probes (2026-11-30)", "bench/results/transport-all-2xH200-2026-11-30.json"),
)


def _kernels_from_peak(peak_bf16_tflops: float) -> tuple[KernelFigure, ...]:
    """Kernel rates of a part from its public dense bf16 peak, at the efficiencies measured on
    the H200 (989 TFLOP/s peak): flex 409 / 392 and cuDNN 619 / 485 at d128 / d64."""
    h200 = 989.0
    return tuple(KernelFigure(head_dim=k.head_dim, sparse_tflops=round(peak_bf16_tflops * k.sparse_tflops / h200, 1),
                              dense_tflops=round(peak_bf16_tflops * k.dense_tflops / h200, 1))
                 for k in _H200_KERNELS)


def _pcie_box(gen: int, p2p: bool) -> Profile:
    # PCIe x16 line rate per direction (PCI-SIG: 16 / 32 GT/s, 128b/130b): 31.5 / 63.0 GB/s; DMA
    # achieves ≈ 80 % of it (TLP headers, flow control), 25.2 / 50.4 GB/s — the H200 box's own
    # Gen5 link reached 54 one way (86 %). Duplex cap: the H200 ratio 90 / 54 = 1.67.
    line = {4: 31.5, 5: 63.0}[gen]
    link = round(0.8 * line, 1)
    if gen == 4:  # dual AMD EPYC 7003: 8 × DDR4-3200 per socket = 204.8 GB/s, ~70 % sustained
        gpu, peak, hbm, host, xsock = "L40S", 362.0, 864.0, 143.0, 86.0
    else:  # dual AMD EPYC 9004: 12 × DDR5-4800 per socket = 460.8 GB/s, ~70 % sustained
        gpu, peak, hbm, host, xsock = "RTX PRO 6000 Blackwell", 500.0, 1792.0, 322.0, 154.0
    kind = "PCIe P2P between GPUs" if p2p else "no peer access: payloads staged in host memory"
    transport = (TransportFigure(name="ipc", efficiency=1.0, latency_ms=0.11) if p2p
                 else TransportFigure(name="host", efficiency=1.0, latency_ms=0.27))
    return Profile(
        name=f"pcie{gen}-8gpu-{'p2p' if p2p else 'nop2p'}",
        description=f"8×{gpu} on PCIe {gen}.0 x16, dual socket (4 GPUs each), {kind}",
        gpus=8, peer_access=p2p, link_gbps=link, duplex_gbps=round(link * 90.0 / 54.0, 1),
        host_gbps=None if p2p else host, sockets=2, inter_socket_gbps=xsock,
        hbm_gbps=0.8 * hbm,
        transports=(transport, TransportFigure(name="nccl", efficiency=round(21.5 / 34.3, 3), latency_ms=0.6)),
        kernels=_kernels_from_peak(peak), **_FIXED,
        sources=(f"PCI-SIG PCIe {gen}.0 x16: {line} GB/s per direction",
                 f"{gpu} datasheet: {peak:g} TFLOP/s dense bf16",
                 "AMD EPYC 7003/9004 memory channels and xGMI links (docs/simulate.md)"),
    )


# Between hosts, NCCL over the network: its copy share is in ``network_gbps`` (efficiency 1);
# its latency the one NCCL showed on the 2×H200 box (≈ 0.6 ms flat below 8 MiB), an assumption
# across hosts until a `bench transport` run there.
_NETWORK = TransportFigure(name="nccl", efficiency=1.0, latency_ms=0.6)
# A network port's achieved share of its line rate: the 80 % the PCIe profiles take for DMA, an
# assumption until a `bench transport` run across hosts.
_NETWORK_SHARE = 0.8


def _dgx(gpu: str, hbm_tbps: float) -> Profile:
    # DGX H100 / H200 (HGX 8-GPU baseboard): every GPU on four NVSwitch chips by NVLink 4, 18
    # links, 900 GB/s both directions = 450 per direction (NVIDIA HGX H100 product page); the
    # NV18 pair of the 2×H200 box copied 367 per direction (ipc, measured), taken here as the
    # achieved rate through the non-blocking switch. Network: eight single-port ConnectX-7, one
    # per GPU, up to 400 Gb/s InfiniBand = 50 GB/s per direction (NVIDIA DGX BasePOD reference
    # architecture, "NVIDIA DGX H200 and H100 systems"). Same GH100 compute as the H200: the
    # H200's measured kernel rates; device memory scaled from the H200's 4.8 TB/s to the part's.
    line = 400 / 8
    return Profile(
        name=f"dgx-{gpu.lower()}-8hosts",
        description=f"8 hosts x 8x{gpu} SXM (DGX): NVLink 4 through NVSwitch inside a host, "
                    f"one 400 Gb/s InfiniBand NIC per GPU between hosts",
        gpus=64, gpus_per_host=8, peer_access=True, link_gbps=367.0, hbm_gbps=round(4000.0 * hbm_tbps / 4.8, 1),
        transports=_H200_NVLINK.transports, kernels=_H200_KERNELS, **_FIXED,
        network_gbps=_NETWORK_SHARE * line, gpus_per_nic=1, network=_NETWORK,
        sources=("NVIDIA HGX H100: NVLink 4, 900 GB/s per GPU both directions (450 per direction)",
                 "2xH200 NV18 ipc exchange: 367 GB/s per direction "
                 "(bench/results/transport-all-2xH200-2026-11-30.json)",
                 "NVIDIA DGX BasePOD RA: DGX H100/H200, eight single-port ConnectX-7, up to 400 Gb/s InfiniBand",
                 f"{gpu} SXM datasheet: {hbm_tbps} TB/s HBM, 989 TFLOP/s dense bf16 (the H200's measured kernels)"),
    )


def _pcie_hosts(p2p: bool) -> Profile:
    # Eight pcie5-8gpu boxes (RTX PRO 6000 Blackwell): NVIDIA's RTX PRO AI Factory reference
    # configuration 2-8-5-200 gives each 8-GPU node 8 ports of 200 Gb/s on the east-west GPU
    # network, one per GPU: 25 GB/s per direction. Without peer access the box has no GPUDirect
    # RDMA either: a payload between hosts is staged in host memory at both ends (``route``).
    box = _pcie_box(5, p2p)
    line = 200 / 8
    return replace(
        box, name=f"pcie5-8hosts-{'p2p' if p2p else 'nop2p'}", gpus=64, gpus_per_host=8,
        description=f"8 hosts x ({box.description}); one 200 Gb/s network port per GPU between hosts",
        network_gbps=_NETWORK_SHARE * line, gpus_per_nic=1, network=_NETWORK,
        sources=box.sources + ("NVIDIA Enterprise RA, RTX PRO AI Factory 2-8-5-200: 8 ports of 200 Gb/s "
                               "east-west per 8-GPU node",),
    )


PROFILES: dict[str, Profile] = {p.name: p for p in (
    _H200_NVLINK, _H200_HOST,
    _pcie_box(4, True), _pcie_box(4, False), _pcie_box(5, True), _pcie_box(5, False),
    _dgx("H100", 3.35), _dgx("H200", 4.8), _pcie_hosts(True), _pcie_hosts(False),
)}


def get_profile(name_or_path: str | Path) -> Profile:
    """A built-in profile by name, or one read from a JSON file (``simulate --fit-profile`` writes
    ``profile-<name>.json``)."""
    if isinstance(name_or_path, str) and name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--fabric {path}: not a readable profile file: {e}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"--fabric {path}: not a sparsp profile (a JSON object)")
        return Profile.from_dict(doc.get("profile", doc))
    raise ValueError(f"unknown fabric profile {str(name_or_path)!r}; choose one of {', '.join(PROFILES)} "
                     f"or give a profile .json file")


__all__ = ["BENCH_FABRICS", "KERNEL_LAYOUTS", "KernelFigure", "KernelPoint", "PROFILES", "Profile", "TransportFigure",
           "get_profile"]
