"""Block-sparse kernels against dense kernels on one GPU, per kept block (``sparsp bench kernel``).

    python -m sparsp.cli bench kernel                                  # every preset shape
    python -m sparsp.cli bench kernel --shape wan2.1-14b --density 0.25 0.6
    python -m sparsp.cli bench kernel --device cpu --shape 96x160x2x16 --block-size 32

Shapes are one rank's attention at G ranks (default 2): a preset's video tokens / G queries
against all its video tokens as keys (hunyuan-video 63,360 x 126,720 x 24 heads d128,
wan2.1-14b 37,800 x 75,600 x 40 d128, ltx-video 9,216 x 18,432 x 32 d64, ltx-2 the same
x 32 d128), or a custom ``SQxSKxHxD``. Rows, bf16 by default:

- dense: cuDNN SDPA (the reference of the bound), FA4 dense, flex dense (``sdpa`` on CPU);
- sparse, per kernel (``fa4``, ``flex``; ``torch`` on CPU) and K/V layout (``local``: one K/V
  head per query head, ``LocalKV``; ``packed``: one buffer of all heads, ``KVBuffer`` built as
  payloads are) on (a) the benchmark's own masks: ``sparsp.workloads.synthetic_masks`` of the
  shape's geometry at each ``--cdf``, the query-block rows of rank 0, and (b) random per-head
  block masks at each ``--density``.

Timing: CUDA events around the kernel call alone (index lists built before), warm-up, median
of ``--iters`` (>= 10). TFLOP/s are counted on kept blocks with real token counts: 4 · q rows ·
k rows · D per kept (query block, key block) pair per head, no causal discount; dense rows
count every pair. ``vs_cudnn`` and ``vs_best_dense`` divide by cuDNN's and by the fastest
dense kernel's TFLOP/s at the same shape. Result: ``bench/results/kernel-all-<machine>-<date>.json``
(kind ``kernel``; a later run the same day adds its rows) and a PNG next to it; a CPU run's go
to ``results/bench`` unless ``--out`` is given, never to the tracked ``bench/results``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..timing import times_ms
from .args import KERNEL_SHAPES, check_out, default_out, refuse

PRESET_SHAPES = KERNEL_SHAPES


@dataclass(frozen=True, slots=True)
class Shape:
    """One rank's attention: ``q_rows`` queries against ``k_rows`` keys, ``heads`` x ``head_dim``."""

    name: str
    q_rows: int
    k_rows: int
    heads: int
    head_dim: int
    geom: object  # the VideoGeometry the benchmark's own masks come from


def parse_shape(text: str, ranks: int, block_size: int) -> Shape:
    """A preset name (video tokens only, one rank's queries) or ``SQxSKxHxD``."""
    from ..geometry import VideoGeometry, preset

    if text in PRESET_SHAPES or "x" not in text:
        geom = replace(preset(text, block_size=block_size), text_tokens=0)
        return Shape(text, geom.num_tokens // ranks, geom.num_tokens, geom.heads, geom.head_dim, geom)
    try:
        sq, sk, h, d = (int(x) for x in text.split("x"))
    except ValueError:
        raise ValueError(f"--shape {text!r}: expected a preset or SQxSKxHxD") from None
    if not (0 < sq <= sk and h > 0 and d >= 12):
        raise ValueError(f"--shape {text!r}: need 0 < SQ <= SK, H > 0, D >= 12")
    # A 1 x 1 x SK "video" with the default RoPE split: its synthetic masks exercise the same
    # code path as a preset's (custom shapes are for plumbing and quick looks).
    geom = VideoGeometry(frames=1, height=1, width=sk, block_size=block_size, heads=h,
                         head_dim=d, name="custom")
    return Shape(text, sq, sk, h, d, geom)


def kept_flops(mask: torch.Tensor, q_rows: int, k_rows: int, bs: int, head_dim: int) -> float:
    """4 · q rows · k rows · D summed over the kept (query block, key block) pairs of
    ``mask`` (bool [H, nQ, nK]), with the real lengths of tail blocks."""
    def lengths(rows: int, n: int) -> torch.Tensor:
        out = torch.full((n,), float(bs), dtype=torch.float64)
        out[-1] = rows - (n - 1) * bs
        return out

    lq, lk = lengths(q_rows, mask.shape[-2]), lengths(k_rows, mask.shape[-1])
    pairs = torch.einsum("hqk,q,k->", mask.double().cpu(), lq, lk).item()
    return 4.0 * head_dim * pairs


def own_masks(shape: Shape, cdfs, seed: int) -> dict[str, torch.Tensor]:
    """``{"cdf x": bool [H, nQ, nK]}``: synthetic masks of the shape's geometry, rank 0's rows."""
    from ..workloads.synthetic import synthetic_masks

    if not cdfs:
        return {}
    bs = shape.geom.block_size
    n_q = math.ceil(shape.q_rows / bs)
    masks = synthetic_masks(shape.geom, list(cdfs), seed=seed)
    return {f"cdf {c:g}": m[0, :, :n_q, :] for c, m in masks.items()}


def random_masks(shape: Shape, densities, bs: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    n_q, n_k = math.ceil(shape.q_rows / bs), math.ceil(shape.k_rows / bs)
    return {f"random {p:g}": torch.rand(shape.heads, n_q, n_k, generator=gen) < p for p in densities}


def _dense_calls(q, k, v, device) -> dict[str, object]:
    """Dense kernels on (1, S, H, D) tensors: name -> zero-argument call."""
    import torch.nn.functional as F

    from ..kernels import fa4, flex

    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, S, D) views, as Diffusers
    if device.type != "cuda":
        return {"sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh)}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh)

    calls = {"cudnn": cudnn}
    if fa4.fa4_available(device) and fa4.unsupported_reason(q, 128) is None:
        calls["fa4"] = lambda: fa4.dense(q, k, v)
    if flex.flex_available(device):
        calls["flex"] = lambda: flex.dense(qh, kh, vh)
    return calls


def _sparse_kernels(names, device) -> list[str]:
    from ..kernels import KernelName, get_kernel

    if names is None:
        names = ["torch"] if device.type != "cuda" else ["fa4", "flex"]
    usable = []
    for name in names:
        try:
            get_kernel(KernelName(name), device)
        except (ValueError, RuntimeError) as e:
            print(f"skipping kernel {name}: {e}")
            continue
        usable.append(name)
    return usable


def _packed(k, v, bs: int):
    """Every block of the (1, S, H, D) keys packed into one payload buffer, as strategies do."""
    from ..kernels import KVBuffer
    from ..packing import layout, pack

    _, S, H, D = k.shape
    selected = torch.ones(H, math.ceil(S / bs), dtype=torch.bool, device=k.device)
    lay = layout(selected, S, bs)
    flat = torch.empty(lay.num_rows * 2 * D, dtype=k.dtype, device=k.device)
    pack(k, v, lay, H, flat)
    kv = KVBuffer.from_payload(flat, rows=lay.num_rows, block_start=lay.block_start,
                               block_len=lay.block_len, num_aligned=lay.num_aligned,
                               block_size=bs, head_dim=D)
    return kv, lay.block_ids


def bench_shape(shape: Shape, args, device, dtype, kernel_names: list[str], progress=None,
                task=None) -> tuple[list, list]:
    """All rows of one shape; returns (rows, errors)."""
    from ..kernels import KernelName, LocalKV, get_kernel, kernel_indices

    bs, H, D = args.block_size, shape.heads, shape.head_dim
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v = (torch.randn(1, n, H, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
               for n in (shape.q_rows, shape.k_rows, shape.k_rows))
    q_hm = q.transpose(1, 2).contiguous()  # head-major, what the strategies pass
    rows, errors = [], []
    base = {"shape": shape.name, "heads": H, "head_dim": D, "q_rows": shape.q_rows,
            "k_rows": shape.k_rows, "block_size": bs, "dtype": str(dtype).replace("torch.", "")}

    def step():
        if progress is not None:
            progress.advance(task)

    def measure(row: dict, fn, flops: float) -> None:
        try:
            ms = statistics.median(times_ms(fn, warmup=args.warmup, iters=args.iters, device=device))
        except Exception as e:  # one kernel failing must not lose the other rows
            errors.append({**row, "error": f"{type(e).__name__}: {e}"})
            print(f"{shape.name} {row['kernel']} {row.get('mask')}: {type(e).__name__}: {e}")
        else:
            rows.append({**row, "ms": _sig(ms), "tflops_kept": _sig(flops / ms / 1e9)})
        step()

    dense_flops = 4.0 * shape.q_rows * shape.k_rows * D * H
    for name, fn in _dense_calls(q, k, v, device).items():
        measure({**base, "kernel": name, "layout": "dense", "mask": "dense", "density": 1.0}, fn,
                dense_flops)

    masks = {**own_masks(shape, args.cdf, args.seed), **random_masks(shape, args.density, bs, args.seed)}
    layouts = {}
    if "local" in args.layout:
        local = LocalKV(k, v, bs)
        layouts["local"] = (local, local.block_ids())
    if "packed" in args.layout:
        layouts["packed"] = _packed(k, v, bs)
    kernels = {n: get_kernel(KernelName(n), device) for n in kernel_names}
    n_k = math.ceil(shape.k_rows / bs)
    for label, mask in masks.items():
        flops = kept_flops(mask, shape.q_rows, shape.k_rows, bs, D)
        dens = round(mask.float().mean().item(), 4)
        m = mask.unsqueeze(0).to(device)
        for lay_name, (kv, block_ids) in layouts.items():
            num, idx = kernel_indices(m, block_ids, n_k)
            for name, kernel in kernels.items():
                row = {**base, "kernel": name, "layout": lay_name, "mask": label, "density": dens}
                measure(row, lambda: kernel(q_hm, kv, num, idx), flops)
    _relative(rows)
    return rows, errors


def _relative(rows: list[dict]) -> None:
    """``vs_cudnn`` and ``vs_best_dense`` of every row (same shape and head dim)."""
    dense = [r for r in rows if r["mask"] == "dense"]
    cudnn = next((r["tflops_kept"] for r in dense if r["kernel"] == "cudnn"), None)
    best = max((r["tflops_kept"] for r in dense), default=None)
    for r in rows:
        r["vs_cudnn"] = _sig(r["tflops_kept"] / cudnn) if cudnn else None
        r["vs_best_dense"] = _sig(r["tflops_kept"] / best) if best else None


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (tiny CPU shapes stay non-zero)."""
    return float(f"{x:.{digits}g}")


def check(args) -> tuple[torch.device, list[Shape]]:
    """Refuse (one line, exit status 2) what cannot run, before any kernel: the device and
    shapes to run, ``--out`` settled (``results/bench`` on a CPU) and checked."""
    if args.iters < 10:
        refuse("kernel", "--iters must be >= 10 (medians of at least ten timed iterations)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.out is None:
        args.out = default_out(device.type == "cuda")
    check_out("kernel", "--out", args.out)
    try:
        shapes = [parse_shape(s, args.ranks, args.block_size) for s in args.shape]
    except ValueError as e:
        refuse("kernel", str(e))
    if device.type == "cpu" and any(s.name in PRESET_SHAPES for s in shapes):
        refuse("kernel", "on CPU give a small custom --shape SQxSKxHxD")
    return device, shapes


def main(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .common import wide_console, write_result

    device, shapes = check(args)
    console = wide_console()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rows, errors = [], []
    kernel_names = _sparse_kernels(args.kernel, device)
    n_dense = 1 if device.type != "cuda" else 3
    n_sparse = (len(args.cdf) + len(args.density)) * len(args.layout) * len(kernel_names)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("kernels", total=len(shapes) * (n_sparse + n_dense))
        for shape in shapes:
            progress.update(task, description=f"{shape.name}")
            r, e = bench_shape(shape, args, device, dtype, kernel_names, progress, task)
            rows += r
            errors += e
    extra = {"versions": _versions(), "ranks": args.ranks}
    if errors:
        extra["errors"] = errors
    path = write_result("kernel", "all", rows, args.out, extra=extra)
    table = Table(title=f"sparsp bench kernel ({device}, {args.dtype}): TFLOP/s per kept block")
    for col in ("shape", "D", "kernel", "layout", "mask", "density", "ms", "TFLOP/s", "vs cuDNN", "vs best"):
        table.add_column(col, justify="left" if col in ("shape", "kernel", "layout", "mask") else "right")
    for r in rows:
        table.add_row(r["shape"], str(r["head_dim"]), r["kernel"], r["layout"], r["mask"],
                      f"{r['density']:.3f}", f"{r['ms']:.3g}", f"{r['tflops_kept']:.4g}",
                      "" if r["vs_cudnn"] is None else f"{r['vs_cudnn']:.2f}",
                      "" if r["vs_best_dense"] is None else f"{r['vs_best_dense']:.2f}")
    console.print(table)
    png = plot(path)
    console.print(f"wrote {path} and {png}" + (f"; {len(errors)} errors (see the file)" if errors else ""))
    return 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for pkg in ("flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
    return out


def plot(path: Path) -> Path:
    """TFLOP/s per kept block against density, one panel per shape: a line per sparse
    (kernel, layout), a horizontal line per dense kernel."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .common import save_figure

    doc = json.loads(Path(path).read_text())
    rows = doc["rows"]
    shapes = list(dict.fromkeys((r["shape"], r["head_dim"]) for r in rows))
    fig, axes = plt.subplots(1, max(1, len(shapes)), figsize=(5.2 * max(1, len(shapes)), 4.2),
                             squeeze=False)
    for ax, (shape, d) in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape and r["head_dim"] == d]
        for r in (r for r in mine if r["mask"] == "dense"):
            ax.axhline(r["tflops_kept"], ls="--", lw=1, color=_color(r["kernel"]),
                       label=f"{r['kernel']} dense")
        series = dict.fromkeys((r["kernel"], r["layout"]) for r in mine if r["mask"] != "dense")
        for kernel, lay in series:
            pts = sorted((r["density"], r["tflops_kept"], r["mask"]) for r in mine
                         if r["kernel"] == kernel and r["layout"] == lay and r["mask"] != "dense")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if lay == "local" else "s:",
                    color=_color(kernel), label=f"{kernel} {lay}")
        ax.set(title=f"{shape} (d{d})", xlabel="block density", ylabel="TFLOP/s per kept block")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(f"sparsp bench kernel, {doc['machine']}, {doc['date']}")
    return save_figure(fig, path, dpi=110)


def _color(kernel: str) -> str:
    return {"cudnn": "black", "fa4": "tab:red", "flex": "tab:blue", "torch": "tab:green",
            "sdpa": "gray"}.get(kernel, "tab:purple")
