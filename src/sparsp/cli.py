"""The ``sparsp`` command line: ``analyze`` (CPU), ``bench attention|transport`` (GPUs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .geometry import PRESETS
from .strategies import strategy_names


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _add_analyze(sub) -> None:
    p = sub.add_parser(
        "analyze",
        help="bytes each SP strategy moves on a model (CPU, no GPU needed)",
        description=(
            "Compute, for a model preset and G ranks, the exact K/V bytes every sequence-parallel "
            "strategy receives per attention call under contiguous and periodic placement, from "
            "synthetic video attention masks (or a recorded trace). Prints a table and writes "
            "DIR/analysis.json and PNG plots (volume vs G, Figure 4 and 5 analogues)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="hunyuan-video", choices=PRESETS, help="model preset")
    p.add_argument("--ranks", type=int, default=8, help="sequence-parallel degree G")
    p.add_argument("--cdf", type=float, nargs="+", default=[0.85, 0.9, 0.95], help="CDF thresholds")
    p.add_argument("--placement", nargs="+", default=["contiguous", "periodic"],
                   choices=["contiguous", "periodic"], help="placements to compare")
    names = strategy_names()
    p.add_argument("--strategy", nargs="+", default=list(names), choices=names,
                   help="strategies to account")
    p.add_argument("--trace", type=Path, default=None,
                   help="a sparsp trace (.pt) with real masks to analyse instead of synthetic ones")
    p.add_argument("--layers", type=int, default=1, help="layers to generate (or read from the trace) and sum")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8"], help="K/V element type")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    p.add_argument("--out", type=Path, default=Path("results/analyze"), help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=_run_analyze)


def _run_analyze(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .analysis import AnalyzeConfig, analyze, write_outputs

    console = Console()
    try:
        if args.out.exists() and not args.out.is_dir():  # found now, not after the analysis
            raise ValueError(f"--out {args.out} is a file; give a directory")
        cfg = AnalyzeConfig(
            model=args.model, ranks=args.ranks, cdf=tuple(args.cdf), placements=tuple(args.placement),
            strategies=tuple(args.strategy), trace=args.trace, layers=args.layers, dtype=args.dtype,
            seed=args.seed, out=args.out,
        )
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            doc = analyze(cfg, progress)
    except (ValueError, OSError) as e:  # bad arguments or an unreadable --trace: no traceback
        return _usage_error(e)
    table = Table(title=f"{doc['model']}: {doc['tokens']:,} tokens, {doc['heads']}x{doc['head_dim']} heads, "
                        f"G={doc['ranks']}, {doc['dtype']}, {doc['layers']} layer(s), {doc['masks']} masks")
    for col in ("cdf", "density", "placement", "strategy", "max/rank", "total", "vs ring"):
        table.add_column(col, justify="right" if col not in ("placement", "strategy") else "left")
    for r in doc["results"]:
        red = r["reduction_vs_ring"]
        table.add_row(f"{r['cdf']:.2f}", f"{100 * r['density']:.1f}%", r["placement"], r["strategy"],
                      _fmt_bytes(r["bytes_max_rank"]), _fmt_bytes(r["bytes_total"]),
                      "" if red is None else ("0.0%" if red == 0 else f"{-100 * red:+.1f}%"))
    console.print(table)
    for s in doc["mask_stats"]:
        shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["patterns"].items())
        console.print(f"cdf {s['cdf']:.2f}: density {100 * s['density']:.1f}%; patterns: {shares}")
    try:
        paths = _write_json_only(doc, args.out) if args.no_plots else write_outputs(doc, args.out)
    except OSError as e:  # --out names a file, or a directory we may not write
        return _usage_error(f"cannot write to --out {args.out}: {e}")
    console.print("wrote " + ", ".join(str(p) for p in paths))
    console.print(f"done in {doc['seconds']:.1f} s")
    return 0


def _usage_error(error) -> int:
    """Report a bad argument the way argparse does: one line on stderr, exit status 2."""
    print(f"sparsp analyze: error: {error}", file=sys.stderr)
    return 2


def _write_json_only(doc, out: Path):
    import json

    out.mkdir(parents=True, exist_ok=True)
    path = out / "analysis.json"
    path.write_text(json.dumps(doc, indent=1))
    return [path]


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="GPU benchmarks (run under torchrun)",
                       description="GPU benchmarks; results go to bench/results/ as JSON + PNG.")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="{attention,kernel,transport,e2e}")
    from .bench import attention as bench_attention

    a = bsub.add_parser("attention", help="one attention layer per strategy",
                        description=bench_attention.__doc__,
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bench_attention.add_arguments(a)
    a.set_defaults(func=bench_attention.main)
    from .bench import e2e as bench_e2e

    e = bsub.add_parser("e2e", help="denoising steps of a Diffusers transformer per strategy",
                        description=bench_e2e.__doc__, formatter_class=bench_e2e.HelpFormatter)
    bench_e2e.add_arguments(e)
    e.set_defaults(func=bench_e2e.main)
    from .bench import kernel as bench_kernel

    kr = bsub.add_parser("kernel", help="block-sparse kernels vs dense kernels on one GPU",
                         description=bench_kernel.__doc__,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_kernel.add_arguments(kr)
    kr.set_defaults(func=bench_kernel.main)
    try:
        from .bench import transport as bench_transport
    except ImportError:  # pragma: no cover - optional while the transport bench is absent
        return
    t = bsub.add_parser("transport", help="bandwidth per transport, alone and under attention load",
                        description=bench_transport.__doc__,
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bench_transport.add_arguments(t)
    t.set_defaults(func=lambda args: _run_result(bench_transport.run, args))


def _run_result(fn, args) -> int:
    fn(args)
    return 0


def _add_simulate(sub) -> None:
    """``sparsp simulate`` (CPU cost model; arguments and job in ``sparsp.simulate``)."""
    from .simulate import cli as simulate_cli

    p = sub.add_parser("simulate", help="predict each strategy's timing on a fabric profile (CPU)",
                       description=simulate_cli.DESCRIPTION,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    simulate_cli.add_arguments(p)
    p.set_defaults(func=simulate_cli.main)


def _add_trace(sub) -> None:
    """``sparsp trace`` (record a transformer's block masks; job in ``sparsp.integrations.trace``)."""
    from .integrations import trace

    p = sub.add_parser("trace", help="record a Diffusers transformer's block masks for analyze --trace",
                       description=trace.__doc__, formatter_class=trace.HelpFormatter)
    trace.add_arguments(p)
    p.set_defaults(func=trace.main)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparsp",
        description="Sparsity-aware sequence-parallel attention for video diffusion transformers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{analyze,bench,simulate,trace}")
    _add_analyze(sub)
    _add_bench(sub)
    _add_trace(sub)
    _add_simulate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
