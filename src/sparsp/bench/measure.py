"""What ``bench attention`` measures besides a call's median: the inputs of the bound (the
link bandwidth of the fabric, a rank's kept-block FLOPs, the fastest dense kernel's rate) and
the profiler's counts of one call (host synchronisations, collectives; op tables and a trace
with ``--torch-profile``)."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import torch

from ..timing import times_ms
from .common import median


def link_gbps(fabric: str, results: Path) -> float | None:
    """The best 256 MiB bandwidth any transport reached on ``fabric`` (bench transport files)."""
    best = None
    for path in sorted(glob.glob(str(Path(results) / "transport-all-*.json"))):
        for r in json.loads(Path(path).read_text()).get("rows", []):
            if (r.get("fabric") == fabric and r.get("bytes") == 256 << 20 and not r.get("under_load")
                    and r.get("inflight", 1) == 1):  # single exchanges (not pipelined)
                best = max(best or 0.0, float(r["gbps"]))
    return best


def kept_flops(mask: torch.Tensor | None, shapes) -> float:
    """FLOPs of this rank's kept block pairs, real token counts (4·q·k·D per pair and head)."""
    lens = []
    for p, n in enumerate(shapes.num_blocks):
        L = torch.full((n,), shapes.block_size, dtype=torch.float64)
        if shapes.has_tail(p):
            L[-1] = shapes.seq_lens[p] - (n - 1) * shapes.block_size
        lens.append(L)
    klen = torch.cat(lens)
    qlen = lens[shapes.rank]
    per_pair = 4.0 * shapes.head_dim * qlen[:, None] * klen[None, :]
    if mask is None:
        return float(per_pair.sum()) * shapes.batch * shapes.heads
    return float((mask.double().cpu() * per_pair).sum())


def _dense_candidates(q, k, v):
    """(name, fn) of every dense kernel worth timing: cuDNN and flash SDPA, and FA4 if installed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))

    def sdpa(backend):
        def fn():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)
        return fn

    out = [("cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("flash", sdpa(SDPBackend.FLASH_ATTENTION))]
    try:
        from ..kernels import fa4  # optional backend (flash-attn-4)

        if fa4.fa4_available(q.device):
            out.append(("fa4", lambda: fa4.dense(q, k, v)))
    except (ImportError, AttributeError, RuntimeError):
        pass
    return out


def dense_tflops(q, k, v, kernel: str) -> tuple[float, str]:
    """TFLOP/s of the fastest dense kernel on (local queries × all keys) shapes of this head dim."""
    flops = 4.0 * q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] * q.shape[3]
    best, name = 0.0, "none"
    for label, fn in _dense_candidates(q, k, v):
        try:
            ms = median(times_ms(fn, warmup=3, iters=10, device=q.device))
        except RuntimeError:
            continue
        if flops / ms / 1e9 > best:
            best, name = flops / ms / 1e9, label
    return best, name


def dense_call(q, k, v, name: str):
    """The dense kernel ``name`` (one of ``dense_tflops``' candidates) on these tensors."""
    return dict(_dense_candidates(q, k, v))[name]


def count_syncs_and_collectives(fn, profile_to: Path | None = None) -> tuple[int, int]:
    """(host syncs, collectives) of one call, from the profiler's host-side events inside the
    call (the closing synchronize of the measurement is outside it); with ``profile_to`` (a
    path stem) also the op tables and a gzipped Chrome trace of that call.

    The profiler records a warm-up call first and keeps only the second: the first Triton
    launch after a profiler starts takes 2.5–2.7 ms of host time on an H200 (30–45 µs
    otherwise), which put a gap of that size at the start of every traced call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        for _ in range(2):  # the warm-up call, then the recorded one
            with record_function("bench.call"):
                fn()
            if cuda:
                torch.cuda.synchronize()
            prof.step()
    if profile_to is not None:
        _write_profile(prof, Path(profile_to))
    events = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    call = next(e for e in events if e.name == "bench.call")
    inside = [e for e in events if call.time_range.start <= e.time_range.start <= call.time_range.end]
    syncs = sum(e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                           "sparsp.host_read") for e in inside)
    # one op per collective issued (the profiler also lists each under its NCCL annotation,
    # on the host and on the device: those are not counted again); the transports'
    # send/recv are payload, not metadata
    colls = sum(e.name.startswith("c10d::") and not any(w in e.name for w in ("send", "recv", "coalesced", "barrier"))
                for e in inside)
    return syncs, colls


def _write_profile(prof, stem: Path) -> None:
    import gzip
    import tempfile

    stem.parent.mkdir(parents=True, exist_ok=True)
    avg = prof.key_averages()
    tables = [f"== by self device time\n{avg.table(sort_by='self_device_time_total', row_limit=40)}",
              f"== by self host time\n{avg.table(sort_by='self_cpu_time_total', row_limit=40)}"]
    stem.parent.joinpath(stem.name + ".txt").write_text("\n\n".join(tables))
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        with open(tmp.name, "rb") as src, gzip.open(stem.parent / (stem.name + ".json.gz"), "wb") as dst:
            dst.write(src.read())
