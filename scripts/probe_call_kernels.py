"""Time the per-call kernels around the attention on one GPU: summaries, mask, lists, pack, merge.

Every rank of a sparse call builds the *whole* block mask from the gathered summaries, so its
cost is paid once per rank per call, on the critical path before any byte moves; and every
call ends with the LSE merge of its partial results written as the output. This probe times
each step of the selection (``masks.select_blocks``: the torch ops of the sorted path, and the
Triton kernel of ``sparsp.cdf_select`` at several warp counts) and the merge (``merge_pair``
then the output's cast and transpose, against ``merge_final``) the pack's gather
(two ``index_select`` against ``packing.gather_rows``) and the kernel's block lists (the torch
prefix sum and scatter against ``kernels.buffer.compact_rows``) and the metadata's summaries
(q's and k's block sums and v's sum in torch against ``masks.summaries_into`` at several tiles)
at the presets' full geometries (B = 1;
N = the whole sequence's blocks; the merge and the pack at a 2-GPU shard), with CUDA
events, warm-up and the median of ``--iters`` runs:

    python scripts/probe_call_kernels.py [--models hunyuan-video ltx-video] [--iters 20]

Prints one table per model and writes JSON to ``--out`` when given. Not a benchmark of the
library's speed (that is ``sparsp bench attention``); a measurement to decide what to change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from sparsp.bench.kernel import time_ms
from sparsp.geometry import MODELS, preset
from sparsp import cdf_select, masks
from sparsp._triton import triton
from sparsp.kernels.merge import _pair, merge_final, merge_pair
from sparsp.masks import PooledBlocks, _select_sorted, check_parts, select_blocks, summaries_into
from sparsp.kernels.buffer import compact_rows
from sparsp.packing import gather_rows
from sparsp.plan import Shapes
from sparsp.strategies.auto import figures


def block_sums_torch(x: torch.Tensor, bs: int) -> torch.Tensor:
    """``masks.block_sums``' torch form (whole blocks, then the short last one)."""
    B, S, H, D = x.shape
    full = S // bs * bs
    sums = x[:, :full].reshape(B, S // bs, bs, H, D).sum(2, dtype=torch.float32)
    if full < S:
        sums = torch.cat([sums, x[:, full:].sum(1, keepdim=True, dtype=torch.float32)], 1)
    return sums


def _time(fn, iters: int) -> float:
    return statistics.median(time_ms(fn, warmup=3, iters=iters, device=torch.device("cuda")))


def _graphed(fn):
    """``fn`` captured once in a CUDA graph (after a warm-up): the replay, to time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _torch_lists(keep, ids, width):
    pos = keep.cumsum(-1) - 1
    target = torch.where(keep, pos, width)
    packed = torch.zeros(*keep.shape[:-1], width + 1, dtype=torch.int32, device=keep.device)
    packed.scatter_(-1, target, ids.to(torch.int32).expand(keep.shape))
    return keep.sum(-1, dtype=torch.int32), packed[..., :width].contiguous()


def keep_mask(probs, order, keep):
    keep = keep.clone()
    keep[..., 0] = True
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def probe(model: str, iters: int, cdf: float) -> dict:
    spec = MODELS[model]
    H, D = spec.heads, spec.head_dim
    N = preset(model).num_blocks
    g = torch.Generator(device="cuda").manual_seed(0)
    pq = torch.randn(1, H, N, D, device="cuda", generator=g)
    pk = torch.randn(1, H, N, D, device="cuda", generator=g) * 0.5
    cdf_t = torch.full((H,), cdf, device="cuda")
    scores = torch.matmul(pq, pk.transpose(-1, -2)).mul_(D**-0.5)
    probs = torch.softmax(scores, -1)
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = ordered.cumsum(-1) <= cdf_t[None, :, None, None]
    out = {"model": model, "heads": H, "blocks": N, "elements": H * N * N}
    steps = {
        "matmul+scale": lambda: torch.matmul(pq, pk.transpose(-1, -2)).mul_(D**-0.5),
        "softmax": lambda: torch.softmax(scores, -1),
        "sort (stable)": lambda: probs.sort(dim=-1, descending=True, stable=True),
        "sort (unstable)": lambda: probs.sort(dim=-1, descending=True),
        "sort values, int32 keys": lambda: probs.view(torch.int32).sort(dim=-1, descending=True),
        "topk(N)": lambda: probs.topk(N, dim=-1),
        "cumsum+compare": lambda: ordered.cumsum(-1) <= cdf_t[None, :, None, None],
        "scatter": lambda: torch.zeros_like(keep).scatter_(-1, order, keep),
        "sorted selection (softmax..scatter)": lambda: _select_sorted(scores, cdf_t, False, False),
        "select_blocks (whole)": lambda: select_blocks(
            PooledBlocks(pq, None, None), PooledBlocks(pk, None, None), cdf_threshold=cdf),
    }
    block = 1 << (N - 1).bit_length()
    out_mask = torch.empty(scores.shape, dtype=torch.bool, device="cuda")
    for warps in (1, 2, 4, 8, 16):
        steps[f"fused select, {warps} warps"] = (
            lambda w=warps: cdf_select._select_rows[(H * N,)](
                scores, cdf_t, out_mask, N, N, H, BLOCK=block, num_warps=w))
    steps["fused select (default)"] = lambda: cdf_select.select(scores, cdf_t)
    fused = cdf_select.select(scores, cdf_t)
    out["fused differs from sort (rows)"] = int((fused != keep_mask(probs, order, keep)).any(-1).sum())
    S = preset(model).num_tokens // 2  # one rank's queries at G = 2
    o1 = torch.randn(1, H, S, D, device="cuda", generator=g).bfloat16()
    o2 = torch.randn(1, H, S, D, device="cuda", generator=g).bfloat16()
    l1, l2 = torch.randn(1, H, S, device="cuda", generator=g), torch.randn(1, H, S, device="cuda", generator=g)
    steps["merge: merge_pair + output cast"] = (
        lambda: merge_pair(o1, l1, o2, l2)[0].permute(0, 2, 1, 3).to(torch.bfloat16).contiguous())
    steps["merge: eager merge + output cast"] = (
        lambda: _pair(o1, l1, o2, l2)[0].permute(0, 2, 1, 3).to(torch.bfloat16).contiguous())
    steps["merge: merge_final"] = lambda: merge_final(o1, l1, o2, l2, torch.bfloat16)
    # the pack of one G = 2 payload: a half of the shard's (head, block) pairs, head-major rows
    k = torch.randn(1, S, H, D, device="cuda", generator=g).bfloat16()
    v = torch.randn_like(k)
    token_rows = (torch.arange(S, device="cuda")[None, :] * H + torch.arange(H, device="cuda")[:, None]).reshape(-1)
    nb = token_rows.numel() // 128
    take = torch.rand(nb, device="cuda", generator=g) < 0.5
    rows = token_rows[: nb * 128].view(nb, 128)[take].reshape(-1)
    buf = torch.empty(2 * rows.numel() * D, dtype=k.dtype, device="cuda")
    n = rows.numel() * D
    out["pack rows"] = rows.numel()
    steps["pack: two index_select"] = lambda: (
        torch.index_select(k.reshape(-1, D), 0, rows, out=buf[:n].view(-1, D)),
        torch.index_select(v.reshape(-1, D), 0, rows, out=buf[n:].view(-1, D)))
    steps["pack: gather_rows"] = lambda: gather_rows(k, v, rows, buf)
    # the metadata's summaries of one rank's shard: q's and k's block sums and v's check
    q = torch.randn_like(k)
    B_, n_, F_ = 1, -(-S // 128), H * D
    sums = torch.empty(2 * n_ * F_ + check_parts(B_, n_, F_), device="cuda")
    steps["summaries: torch block sums + v sum"] = lambda: (
        block_sums_torch(q, 128), block_sums_torch(k, 128), v.sum(dtype=torch.float32))
    steps["summaries: summaries_into"] = lambda: summaries_into(sums, 128, q, k, v)
    table = masks.SumsTable(q.dtype, q.device)  # the form a CUDA graph replays (plan._graphed_summaries)
    table.set(q, k, v)
    table.upload()
    steps["summaries: summaries_into through the offset table"] = (
        lambda: summaries_into(sums, 128, q, k, v, table=table))
    for tok, warps in ((4, 1), (8, 1), (16, 1), (8, 2), (16, 4)):  # the kernel's tile and warps
        steps[f"summaries: {tok} tokens, {warps} warps"] = (
            lambda tok=tok, warps=warps: masks._sums[(n_, triton.cdiv(F_, masks.SUM_FEATURES))](
                q, k, v, sums, sums, S, n_, F_, n_ * F_, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2],
                BS=128, TOK=tok, FCH=masks.SUM_FEATURES, HAS_B=True, HAS_C=True, OFFSETS=False, ALIGN=8,
                num_warps=warps))
    # the local shard's block lists at G = 2: a [1, H, N/2, N/2] column slice of the whole mask
    half = N // 2
    rows_mask = keep_mask(probs, order, keep)[:, :, :half, :half]
    ids = torch.arange(half, device="cuda").view(1, 1, 1, half).expand(1, H, 1, half)
    steps["lists: torch prefix sum + scatter"] = lambda: _torch_lists(rows_mask, ids, half)
    steps["lists: compact_rows"] = lambda: compact_rows(rows_mask, ids.expand(rows_mask.shape), half)
    # strategy="auto": the demand figures its plan stage adds (G = 2)
    sh = Shapes(0, 2, 1, H, D, 128, ((N - N // 2) * 128, N // 2 * 128))  # whole blocks, N in all
    whole = keep_mask(probs, order, keep)
    fast = figures(whole, sh)
    os.environ["SPARSP_TRITON_FIGURES"] = "0"
    torch_form = figures(whole, sh)
    out["auto figures equal the torch form"] = bool(torch.equal(fast, torch_form))
    # as the plan stage runs them: replayed from a CUDA graph (no host launch cost)
    steps["auto: demand figures, torch form (graph)"] = _graphed(lambda: figures(whole, sh))
    os.environ.pop("SPARSP_TRITON_FIGURES")
    steps["auto: demand figures (graph)"] = _graphed(lambda: figures(whole, sh))
    for name, fn in steps.items():
        try:
            out[name] = round(_time(fn, iters), 4)
        except Exception as exc:  # a step that does not run on this build is reported, not fatal
            out[name] = f"error: {type(exc).__name__}: {exc}"[:120]
    return out


def launch_overhead(iters: int = 200) -> dict:
    """Host µs per launch of each Triton kernel on tiny inputs (the device is idle, so this is
    the Python and driver time a launch costs the host), and of an empty torch op for scale."""
    import time

    dev = torch.device("cuda")
    B, H, S, D, n = 1, 8, 128, 64, 8
    a, b = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    la, lb = (torch.randn(B, H, S, device=dev) for _ in range(2))
    dest = torch.empty(B, S, H, D, device=dev, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    keep = torch.rand(B, H, n, n, device=dev) < 0.5
    ids = torch.arange(n, device=dev).expand(B, H, n, n)
    k = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
    rows = torch.arange(64, device=dev)
    flat = torch.empty(2 * 64 * D, device=dev, dtype=torch.bfloat16)
    from sparsp.kernels.merge import merge_into

    sums = torch.empty(2 * 8 * H * D + check_parts(1, 8, H * D), device=dev)
    cases = {"merge_into": lambda: merge_into(a, la, b, lb, dest),
             "compact_rows": lambda: compact_rows(keep, ids, n),
             "gather_rows": lambda: gather_rows(k, k, rows, flat),
             "summaries_into": lambda: summaries_into(sums, 16, k, k, k),
             "torch add (for scale)": lambda: a.add(b)}
    out = {}
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out[name] = (time.perf_counter() - t0) / iters * 1e6
        torch.cuda.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["hunyuan-video", "wan2.1-14b", "ltx-video", "ltx-2"],
                    choices=sorted(MODELS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cdf", type=float, default=0.9)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--launch-overhead", action="store_true",
                    help="only time the host cost of one launch of each Triton kernel (tiny inputs)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_call_kernels needs a CUDA device")
    if args.launch_overhead:
        result = launch_overhead()
        for name, us in result.items():
            print(f"  {name:24s} {us:7.1f} us per launch (host)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"launch_overhead_us": result}, f, indent=1)
        return
    rows = [probe(m, args.iters, args.cdf) for m in args.models]
    for row in rows:
        print(f"== {row['model']}: {row['heads']} heads x {row['blocks']}^2 blocks")
        for key, value in row.items():
            if key not in ("model", "heads", "blocks", "elements", "pack rows"):
                print(f"  {key:32s} {value} ms" if isinstance(value, float) else f"  {key:32s} {value}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
