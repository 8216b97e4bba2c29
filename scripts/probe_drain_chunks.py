"""What one more chunk costs the consumer of a drain payload, on one GPU.

At G = 2 a ``sparsp`` call's one remote payload is its drain: the transfer no later compute
hides. Cut into u head-group chunks (``SparspConfig.drain_chunks``, paper §7), the consumer
computes each chunk once it landed, so only the last chunk's compute follows the transfer —
at the price of u kernels instead of one, their block lists made after the host read, and u
head-slice merges instead of one ``merge_final``. ``strategies/chunks.py`` weighs that price
(``Fabric.chunk_s``) against the compute it moves off the critical path. This probe measures
the price with the call's own kernels, at each preset's 2-GPU shard (B = 1; the payload: a
random ``--selected`` share of the peer's (head, block) pairs, each local query block reading
a selected block with probability ``--density``):

- whole: the payload's kernel (its lists made before, as the plan stage does) and
  ``merge_final`` with the local partial into the output;
- u chunks: per head group, its lists (``kernel_indices`` on the group's rows), its kernel
  over the group's own packed buffer and ``merge_into`` that head slice of the output.

Per variant: ``host_us`` (the host's issue time of one variant on an idle GPU, median of
``--iters``), ``alone_ms`` (that variant's span on the device, CUDA events: host issue and
device work) and ``device_ms`` (``--iters`` variants back to back, per variant: the device's
time, or the host's where it issues slower than the device runs). ``chunk_ms`` = (u chunks − whole) / (u − 1) of each. ``equal``: the chunked
output matches the whole one within bf16 rounding (max abs difference printed).

    python scripts/probe_drain_chunks.py [--models ltx-2 ltx-video] [--units 2 4] [--iters 20]

Prints a table and writes JSON to ``--out``. A measurement to decide what to change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from probe_fa4_launch import BS, shard_inputs  # scripts/: the same shard inputs
from sparsp.geometry import MODELS
from sparsp.kernels import KVBuffer, get_kernel, kernel_indices, merge_final, merge_into, resolve_kernel
from sparsp.packing import layout, pack
from sparsp.strategies.base import head_slice
from sparsp.strategies.chunks import head_groups

class Payload:
    """One packed payload of the heads ``heads`` of a selection, and its kernel's inputs."""

    def __init__(self, k, v, selected, mask, heads, width):
        H = k.shape[2]
        h0, h1 = heads
        sel = torch.zeros_like(selected)
        sel[h0:h1] = selected[h0:h1]
        S = k.shape[1]
        self.lay = layout(sel, S, BS, heads=H)
        D = k.shape[-1]
        self.flat = torch.empty(2 * max(self.lay.num_rows, 1) * D, dtype=k.dtype, device=k.device)
        pack(k, v, self.lay, H, self.flat)
        self.heads, self.mask, self.width, self.D = heads, mask, width, D
        self.ids = head_slice(self.lay.block_ids, 1, heads)

    def buffer(self) -> KVBuffer:
        lay = self.lay
        return KVBuffer.from_payload(self.flat, rows=lay.num_rows, block_start=lay.block_start,
                                     block_len=lay.block_len, num_aligned=lay.num_aligned,
                                     block_size=BS, head_dim=self.D)

    def lists(self):
        h0, h1 = self.heads
        return kernel_indices(self.mask[:, h0:h1], self.ids, self.width)


def _case(model: str, selected_share: float, density: float):
    q, k, v, n, g = shard_inputs(model)
    H, S, D = q.shape[1:]
    selected = torch.rand(H, n, device="cuda", generator=g) < selected_share
    mask = (torch.rand(1, H, n, n, device="cuda", generator=g) < density) & selected[None, :, None, :]
    local_o = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    local_l = torch.randn(1, H, S, device="cuda", generator=g)
    return q, k, v, selected, mask, local_o, local_l, n


def _timed(fn, iters: int) -> dict:
    for _ in range(3):
        result = fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, alone = [], []
    for _ in range(iters):  # one variant on an idle GPU: its host issue time and its span
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        end.record()
        torch.cuda.synchronize()
        alone.append(start.elapsed_time(end))
    start.record()
    for _ in range(iters):  # back to back: the device's time per variant
        fn()
    end.record()
    torch.cuda.synchronize()
    return {"host_us": statistics.median(host) * 1e6, "device_ms": start.elapsed_time(end) / iters,
            "alone_ms": statistics.median(alone), "result": result}


def _diagnose(name: str, fn) -> None:
    """Print every host synchronisation ``fn`` makes (``torch.cuda.set_sync_debug_mode``) and
    its top host-side ops under the profiler."""
    import warnings

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    print(f"[{name}] host synchronisations: {len(syncs)}")
    for w in syncs[:4]:
        print("   ", str(w.message)[:120], f"({w.filename}:{w.lineno})")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def probe(model: str, units: list[int], iters: int, selected_share: float, density: float,
          diagnose: bool = False) -> dict:
    kernel = get_kernel("auto", torch.device("cuda"))
    q, k, v, selected, mask, local_o, local_l, n = _case(model, selected_share, density)
    H = q.shape[1]
    whole = Payload(k, v, selected, mask, (0, H), n)
    w_num, w_idx = whole.lists()  # made in the plan stage, before the read
    w_buf = whole.buffer()

    def run_whole():
        o, l = kernel(q, w_buf, w_num, w_idx)
        return merge_final(local_o, local_l, o, l, q.dtype)

    if diagnose:
        _diagnose(f"{model} whole", run_whole)
    rows = {"whole": _timed(run_whole, iters)}
    ref = rows["whole"].pop("result")
    for u in units:
        parts = [Payload(k, v, selected, mask, g, n) for g in head_groups(H, u)]
        out = torch.empty(q.shape[0], q.shape[2], H, q.shape[3], dtype=q.dtype, device=q.device)

        def run_chunks():
            for p in parts:
                h0, h1 = p.heads
                num, idx = p.lists()
                o, l = kernel(q[:, h0:h1], p.buffer(), num, idx)
                merge_into(local_o[:, h0:h1], local_l[:, h0:h1], o, l,
                           out.permute(0, 2, 1, 3)[:, h0:h1])
            return out

        if diagnose:
            _diagnose(f"{model} {u} chunks", run_chunks)
        r = _timed(run_chunks, iters)
        diff = (r.pop("result").float() - ref.float()).abs().max().item()
        r.update(max_abs_diff=diff,
                 **{f"chunk_{key}": (r[key] - rows["whole"][key]) / (u - 1)
                    for key in ("host_us", "device_ms", "alone_ms")})
        rows[f"chunks_{u}"] = r
    from sparsp.kernels import fa4

    states = [type(p).__name__ for p in fa4._PREPARED.values()]
    return {"model": model, "shard": list(q.shape), "payload_rows": whole.lay.num_rows,
            "fa4_signatures": {"prepared": states.count("_Prepared"), "on_trial": states.count("_Trial"),
                               "declined": states.count("NoneType")},
            "kernel": resolve_kernel("auto", "cuda"), "selected": selected_share,
            "density": density, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["ltx-video", "ltx-2", "wan2.1-14b",
                                                    "hunyuan-video"], choices=sorted(MODELS))
    ap.add_argument("--units", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--selected", type=float, default=0.84,
                    help="share of the peer's (head, block) pairs in the payload")
    ap.add_argument("--density", type=float, default=0.5,
                    help="probability that a local query block reads a selected block")
    ap.add_argument("--diagnose", action="store_true",
                    help="print the chunked variants' host synchronisations and top host ops")
    ap.add_argument("--out", help="JSON file to write")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    results = [probe(m, a.units, a.iters, a.selected, a.density, a.diagnose) for m in a.models]
    print(f"{'model':14s} {'variant':9s} {'device ms':>9s} {'alone ms':>9s} {'host us':>8s} "
          f"{'chunk dev':>9s} {'chunk alone':>11s} {'chunk host':>10s} {'diff':>8s}")
    for res in results:
        for name, r in res["rows"].items():
            extra = (f"{r['chunk_device_ms']:9.3f} {r['chunk_alone_ms']:11.3f} "
                     f"{r['chunk_host_us']:10.1f} {r['max_abs_diff']:8.1e}") if "chunk_host_us" in r else ""
            print(f"{res['model']:14s} {name:9s} {r['device_ms']:9.3f} {r['alone_ms']:9.3f} "
                  f"{r['host_us']:8.1f} {extra}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "iters": a.iters,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
