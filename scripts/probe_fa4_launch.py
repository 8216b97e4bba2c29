"""Host cost of one FA4 block-sparse launch, through ``flash_attn_func`` and prepared.

``sparsp.kernels.fa4`` launches FA4's compiled kernel directly once a launch signature has
been seen (``SPARSP_FA4_PREPARED``, docs/kernels.md). This probe measures what that saves at
each preset's 2-GPU shard (the local kernel of a ``sparsp`` call: B = 1, the shard's queries
against its own keys, a random block mask of ``--density``), on one GPU:

- ``host_us``: Python time per launch, ``--iters`` launches issued back to back (the GPU
  queue absorbs them; nothing waits);
- ``alone_ms``: one launch on an idle GPU, CUDA events around the call (host issue + kernel),
  median of ``--iters``: how a call's first kernel looks when the GPU waited for the host;
- ``kernel_ms``: the kernel alone (events around a back-to-back run, per launch);
- ``equal``: prepared and ``flash_attn_func`` outputs and LSEs are bit-equal.

    python scripts/probe_fa4_launch.py [--models ltx-video hunyuan-video] [--iters 30]

Prints a table and writes JSON to ``--out`` when given. A measurement to decide what to
change, not a benchmark of the library (that is ``sparsp bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from sparsp.geometry import MODELS, preset
from sparsp.kernels import LocalKV, fa4, kernel_indices

BS = 128


def shard_inputs(model: str):
    """A preset's G = 2 shard on the GPU: head-major q (1, H, S, D), k and v (1, S, H, D) in
    bf16, its block count and the generator that made them (seeded)."""
    spec = MODELS[model]
    H, D = spec.heads, spec.head_dim
    S = preset(model).num_tokens // 2
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, -(-S // BS), g


def _case(model: str, density: float):
    q, k, v, n, g = shard_inputs(model)
    mask = torch.rand(1, q.shape[1], n, n, device="cuda", generator=g) < density
    mask[..., 0] = True
    kv = LocalKV(k, v, BS)
    num, idx = kernel_indices(mask, kv.block_ids(), n)
    return q, kv, num, idx


def _measure(args, iters: int) -> dict:
    call = lambda: fa4.block_sparse_attention(*args)  # noqa: E731
    for _ in range(3):
        out, lse = call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    host = (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    kernel = start.elapsed_time(end) / iters
    alone = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        alone.append(start.elapsed_time(end))
    return {"host_us": host * 1e6, "kernel_ms": kernel, "alone_ms": statistics.median(alone),
            "out": out, "lse": lse}


def probe(model: str, iters: int, density: float) -> dict:
    args = _case(model, density)
    rows = {}
    for mode in ("0", "1"):
        os.environ["SPARSP_FA4_PREPARED"] = mode
        rows[mode] = _measure(args, iters)
    os.environ.pop("SPARSP_FA4_PREPARED")
    off, on = rows["0"], rows["1"]
    equal = torch.equal(off["out"], on["out"]) and torch.equal(off["lse"], on["lse"])
    prepared = [type(p).__name__ == "_Prepared" for p in fa4._PREPARED.values()]
    return {"model": model, "shape": list(args[0].shape), "density": density,
            "prepared_signatures": sum(prepared), "equal": equal,
            **{f"{name}_{key}": rows[mode][key] for mode, name in (("0", "api"), ("1", "prepared"))
               for key in ("host_us", "kernel_ms", "alone_ms")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["ltx-video", "ltx-2", "wan2.1-14b",
                                                    "hunyuan-video"], choices=sorted(MODELS))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--out", help="JSON file to write")
    a = ap.parse_args()
    if not torch.cuda.is_available() or not fa4.fa4_available("cuda"):
        raise SystemExit(f"needs a GPU with FA4: {fa4.import_error() or 'no sm90 GPU'}")
    rows = [probe(m, a.iters, a.density) for m in a.models]
    print(f"{'model':15s} {'host us api/prep':>18s} {'alone ms api/prep':>18s} {'kernel ms':>10s} equal")
    for r in rows:
        print(f"{r['model']:15s} {r['api_host_us']:8.1f} / {r['prepared_host_us']:6.1f} "
              f"{r['api_alone_ms']:8.3f} / {r['prepared_alone_ms']:6.3f} "
              f"{r['prepared_kernel_ms']:10.3f} {r['equal']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "iters": a.iters, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
