"""The ``sparsp`` command line: ``analyze``, ``simulate``, ``calibrate`` and ``density`` (CPU),
``trace`` (a Diffusers model), ``bench attention|e2e|kernel|transport`` (GPUs) and ``bench
report|timeline`` (their results).

Each verb's parser gets its arguments only when that verb is chosen (``_LazyParser``), and its
choices come from plain-data modules (``sparsp.geometry``, ``sparsp.names``); strategy names
are checked against the registry when the verb runs. So ``sparsp --help`` and the CPU verbs'
``--help`` answer without importing torch, Diffusers or matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .geometry import PRESETS
from .inputs import HelpFormatter, add_density_profile_arguments, add_schedule_arguments, add_thresholds_argument
from .names import PLACEMENTS
from .preflight import check_out_file


class _LazyParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose arguments ``populate(self)`` adds on first use (parsing or
    help): building the whole command tree then imports no verb's module."""

    def __init__(self, *args, populate=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._populate = populate

    def _fill(self) -> None:
        populate, self._populate = self._populate, None
        if populate is not None:
            populate(self)

    def parse_known_args(self, args=None, namespace=None):
        self._fill()
        return super().parse_known_args(args, namespace)

    if hasattr(argparse.ArgumentParser, "_parse_known_args2"):  # newer Pythons may enter here instead

        def _parse_known_args2(self, *args, **kwargs):
            self._fill()
            return super()._parse_known_args2(*args, **kwargs)

    def format_help(self) -> str:
        self._fill()
        return super().format_help()

    def format_usage(self) -> str:
        self._fill()
        return super().format_usage()


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except ``None`` (the help text says what ``None`` means there)."""

    def _get_help_string(self, action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


ANALYZE_DEFAULTS = {"model": "hunyuan-video", "cdf": (0.85, 0.9, 0.95), "layers": 1, "seed": 0}
"""What ``analyze`` uses for the synthetic masks when an option is not given."""


def _add_analyze(sub) -> None:
    sub.add_parser(
        "analyze",
        help="bytes each SP strategy moves on a model (CPU, no GPU needed)",
        description=(
            "Compute, for a model preset and G ranks, the exact K/V bytes every sequence-parallel "
            "strategy receives per attention call under contiguous and periodic placement, from "
            "synthetic video attention masks or a recorded trace (sparsp trace). Prints a table and "
            "writes DIR/analysis.json and PNG plots: bytes versus G, how widely each remote K block "
            "is read (the sharing curve), and the relay ring's bytes over direct routing. With "
            "--trace, the masks, model and threshold come from the trace: --model, --cdf and --seed "
            "are refused, and --layers may only pick the trace's first N layers. With --density-profile, "
            "the synthetic heads are first calibrated to a real model's per-head densities (docs/workloads.md), "
            "and bytes and per-rank imbalance are reported for every layer (layers.png). With --thresholds, each "
            "layer's masks at its own thresholds. Every row also gives a run's bytes under the schedule of "
            "--steps, --dense-steps and --replan-every; with --mesh cfg=C,ulysses=U, the bytes of one call on one "
            "half of that device mesh, the sp strategy's and the all-to-alls' apart."
        ),
        formatter_class=_DefaultsFormatter,
        populate=_analyze_arguments,
    )


def _analyze_arguments(p) -> None:
    d = ANALYZE_DEFAULTS
    p.add_argument("--model", default=None, choices=PRESETS,
                   help=f"model preset of the synthetic masks (default: {d['model']}; not with --trace)")
    p.add_argument("--ranks", type=int, default=8, help="sequence-parallel degree G")
    p.add_argument("--cdf", type=float, nargs="+", default=None,
                   help=f"CDF thresholds of the synthetic masks (default: {' '.join(map(str, d['cdf']))}; "
                        "not with --trace, whose masks were made at one threshold)")
    p.add_argument("--placement", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS,
                   help="placements to compare")
    p.add_argument("--strategy", nargs="+", default=None, metavar="NAME",
                   help="strategies to account (default: every registered one: README, \"Strategies\"; "
                        "an unknown name is refused with the registered ones)")
    p.add_argument("--trace", type=Path, default=None,
                   help="a sparsp trace (.pt, written by `sparsp trace`) with real masks to analyse "
                        "instead of synthetic ones")
    add_density_profile_arguments(
        p, use="the synthetic heads are calibrated to it, and bytes and per-rank imbalance are reported "
               "for every layer (not with --trace)", fitted="DIR/calibration.json")
    p.add_argument("--layers", type=int, default=None,
                   help=f"synthetic layers to generate and sum (default: {d['layers']}), or with --trace "
                        "the trace's first N layers (default: all of them), or with --density-profile the "
                        "model's first N layers (default: all of them)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8"], help="K/V element type")
    p.add_argument("--seed", type=int, default=None,
                   help=f"seed of the synthetic workload (default: {d['seed']}; not with --trace)")
    add_thresholds_argument(p)
    add_schedule_arguments(p, costs="bytes")
    p.add_argument("--mesh", default=None, metavar="cfg=C,ulysses=U",
                   help="a device mesh of --ranks ranks (sp takes the rest): the bytes of one call on one half, the "
                        "sp strategy's on each Ulysses rank's H/U heads and the Ulysses all-to-alls' apart, and what "
                        "the CFG halves exchange per step")
    p.add_argument("--out", type=Path, default=Path("results/analyze"), help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=_run_analyze)


def _analyze_config(args):
    """The ``AnalyzeConfig`` of the arguments; ``ValueError`` for an option that cannot apply."""
    from .analysis import AnalyzeConfig
    from .preflight import check_out_dir

    check_out_dir(args.out)  # found now, not after the analysis
    d = ANALYZE_DEFAULTS
    profile = getattr(args, "density_profile", None)
    if args.trace is not None and profile is not None:
        raise ValueError("--density-profile cannot apply with --trace: the trace holds real masks already; "
                         "drop one of them")
    if args.trace is not None:
        given = [f"--{k}" for k in ("model", "cdf", "seed") if getattr(args, k) is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} cannot apply with --trace: the trace fixes the model, "
                             f"its masks' threshold and the masks themselves; drop "
                             f"{'it' if len(given) == 1 else 'them'} (or drop --trace for synthetic masks)")
    return AnalyzeConfig(
        model=args.model or d["model"], ranks=args.ranks, cdf=tuple(args.cdf or d["cdf"]),
        placements=tuple(args.placement), strategies=tuple(args.strategy or ()), trace=args.trace,
        layers=args.layers if args.layers is not None else (None if args.trace or profile else d["layers"]),
        dtype=args.dtype, seed=d["seed"] if args.seed is None else args.seed, out=args.out,
        density_profile=profile, step=getattr(args, "step", None), calibration=getattr(args, "calibration", None),
        thresholds=args.thresholds, steps=args.steps, dense_steps=args.dense_steps, replan_every=args.replan_every,
        mesh=args.mesh,
    )


def _run_analyze(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .analysis import analyze, calibration_lines, notes, print_run
    from .analysis_plots import write_outputs

    console = Console()
    need = 120 if args.mesh else 100  # eight columns (ten with a mesh): do not truncate them in a pipe
    if console.width < need:
        console = Console(width=need)
    try:
        cfg = _analyze_config(args)
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            doc = analyze(cfg, progress)
    except (ValueError, OSError) as e:  # bad arguments or an unreadable --trace: no traceback
        return _usage_error(e)
    table = Table(title=f"{doc['model']}: {doc['tokens']:,} tokens, {doc['heads']}x{doc['head_dim']} heads, "
                        f"G={doc['ranks']}, {doc['dtype']}, {doc['layers']} layer(s), {doc['masks']} masks")
    mesh = doc.get("mesh")
    if mesh:
        table.title += f"; one call on one half of mesh {mesh['label']}"
    parts = ("sp total", "all-to-all total") if mesh else ()
    for col in ("cdf", "density", "placement", "strategy", "max/rank", "total", *parts, "vs ring", "compute max/mean"):
        table.add_column(col, justify="right" if col not in ("placement", "strategy") else "left")
    for r in doc["results"]:
        red = r["reduction_vs_ring"]
        apart = (_fmt_bytes(r["sp_bytes_total"]), _fmt_bytes(r["ulysses_bytes_total"])) if mesh else ()
        table.add_row(f"{r['cdf']:.2f}", f"{100 * r['density']:.1f}%", r["placement"], r["strategy"],
                      _fmt_bytes(r["bytes_max_rank"]), _fmt_bytes(r["bytes_total"]), *apart,
                      "" if red is None else ("0.0%" if red == 0 else f"{-100 * red:+.1f}%"),
                      f"{r.get('balanced_compute_max_over_mean', r['compute_max_over_mean']):.2f}x")
    console.print(table)
    if mesh:
        console.print(f"mesh {mesh['label']}: sp total, the strategy's bytes over the {mesh['sp']} sp ranks of each "
                      f"Ulysses rank's {doc['heads'] // mesh['ulysses']} heads; all-to-all total, the Ulysses "
                      f"all-to-alls' (in and back); the CFG halves exchange "
                      f"{_fmt_bytes(mesh['cfg_exchange_bytes_per_step'])} per step", markup=False, highlight=False)
    console.print("compute max/mean: attention work (token pairs computed) of the busiest rank over the "
                  "mean, as each strategy runs; 1.00x is balanced", markup=False, highlight=False)
    print_run(doc, console, _fmt_bytes)
    for s in doc["mask_stats"]:
        shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["patterns"].items())
        console.print(f"cdf {s['cdf']:.2f}: density {100 * s['density']:.1f}%; patterns: {shares}")
    for line in notes(doc):
        console.print(line, markup=False, highlight=False)
    for line in calibration_lines(doc):
        console.print(line, markup=False, highlight=False)
    try:
        paths = write_outputs(doc, args.out, plots=not args.no_plots)
    except OSError as e:  # --out names a file, or a directory we may not write
        return _usage_error(f"cannot write to --out {args.out}: {e}")
    console.print("wrote " + ", ".join(str(p) for p in paths))
    for skipped in doc.get("plots_skipped", []):
        console.print(f"not drawn: {skipped}", markup=False, highlight=False)
    console.print(f"done in {doc['seconds']:.1f} s")
    return 0


def one_line(error) -> str:
    """``error`` as one line (an exception's text may hold newlines)."""
    return " ".join(str(error).split())


def _usage_error(error, verb: str = "analyze") -> int:
    """Report a bad argument the way argparse does: one line on stderr, exit status 2."""
    print(f"sparsp {verb}: error: {one_line(error)}", file=sys.stderr)
    return 2


def _add_calibrate(sub) -> None:
    """``sparsp calibrate`` (fit the synthetic heads to a density profile; ``sparsp.workloads.calibration``)."""
    sub.add_parser(
        "calibrate", help="fit a preset's synthetic heads to a per-head density profile (CPU)",
        description=(
            "Fit the kinds and alignments of a preset's synthetic heads, layer by layer, to a real model's "
            "per-head densities (docs/workloads.md, \"Heads calibrated to a profile\"), check each head on "
            "another sample, and write the fit (JSON) that --calibration of analyze, simulate and bench "
            "reads. Prints a line per layer (a progress bar on a terminal), then a table per layer."),
        formatter_class=_DefaultsFormatter, populate=_calibrate_arguments)


def _calibrate_arguments(p) -> None:
    p.add_argument("profile", type=Path, metavar="PROFILE",
                   help="the density profile: .csv as published (Step,Layer,Head,Sparsity), or sparsp's .json")
    p.add_argument("--model", required=True, choices=PRESETS, help="the preset whose heads are fitted")
    p.add_argument("--step", type=int, default=None, help="the profile's step (1-based; default: the mean over steps)")
    p.add_argument("--layers", type=int, default=None, help="fit only the first N layers (default: all of them)")
    p.add_argument("--rows", type=int, default=128, help="sampled query rows per head, for the fit and for the check")
    p.add_argument("--seed", type=int, default=0, help="the workload seed")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="the calibration JSON to write")
    p.set_defaults(func=_run_calibrate)


def _run_calibrate(args) -> int:
    import time

    t0 = time.perf_counter()
    try:
        check_out_file(args.out, what="a file, e.g. calibration.json")  # before the fit: minutes lost otherwise
        from rich.console import Console

        from .workloads.calibration import calibrate
        from .workloads.density import read_profile

        profile = read_profile(args.profile, expected=args.model)
        console = Console()
        with _layer_progress(console, args.layers or profile.layers) as on_layer:
            cal = calibrate(args.model, profile, step=args.step, layers=args.layers, seed=args.seed,
                            rows=args.rows, on_layer=on_layer)
        cal.write(args.out)
    except (OSError, ValueError) as e:
        return _usage_error(e, "calibrate")
    print("| layer | heads within tolerance | unreachable | worst head (kind): target → verified |")
    print("|---|---|---|---|")
    for r in cal.summary_rows():
        print(f"| {r['layer']} | {100 * r['within']:.0f} % | {len(r['unreachable'])} | {r['worst_head']} "
              f"({r['worst_kind']}): {r['worst_target']:.4f} → {r['worst_density']:.4f} |")
    heads = [h for ly in cal.layers for h in ly.heads]
    print(f"{sum(h.within for h in heads)} of {len(heads)} heads within tolerance, "
          f"{sum(not h.reachable for h in heads)} out of reach; wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


def _layer_progress(console, layers: int):
    """A context giving ``on_layer(fit)``: a progress bar on a terminal, else one line per layer."""
    import contextlib

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .workloads.calibration import layer_lines

    if console.is_terminal:
        @contextlib.contextmanager
        def bar():
            with Progress(TextColumn("fitting layers"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as progress:
                task = progress.add_task("", total=layers)
                yield lambda _: progress.advance(task)
        return bar()
    return contextlib.nullcontext(layer_lines(layers, lambda line: print(line, flush=True)))


def _add_density(sub) -> None:
    """``sparsp density`` (summarise a per-head density profile; ``sparsp.workloads.density``)."""
    sub.add_parser(
        "density", help="summarise a per-head density profile (CPU)",
        description=("Summarise a per-(step, layer, head) density profile, as published (CSV Step,Layer,Head,"
                     "Sparsity) or in sparsp's JSON form: mean, median, layer means, densest head over its "
                     "layer's mean, and how alike consecutive steps are (docs/workloads.md)."),
        formatter_class=_DefaultsFormatter, populate=_density_arguments)


def _density_arguments(p) -> None:
    p.add_argument("file", type=Path, metavar="FILE",
                   help="the profile: .csv as published, or .json as sparsp writes it")
    p.add_argument("--preset", choices=PRESETS, default=None, help="check that layers and heads match this preset")
    p.add_argument("--step", type=int, default=None,
                   help="the step of 'densest head / layer mean' (1-based; default: the middle step)")
    p.add_argument("--write-json", type=Path, default=None, metavar="OUT",
                   help="also write the profile as sparsp's JSON")
    p.set_defaults(func=_run_density)


def _run_density(args) -> int:
    from .workloads.density import read_profile, write_json

    try:
        profile = read_profile(args.file, expected=args.preset)
        summary = profile.summary(step=args.step)
        if args.write_json:
            write_json(profile, args.write_json)
    except (OSError, ValueError) as e:
        return _usage_error(e, "density")
    print(f"{profile.source}: {profile.steps} steps x {profile.layers} layers x {profile.heads} heads, "
          f"token-level density at {profile.mass:g} of the attention mass")
    for line in summary.lines():
        print(f"  {line}")
    return 0


def _add_bench(sub) -> None:
    sub.add_parser("bench", help="GPU benchmarks (run under torchrun) and their reports",
                   description="GPU benchmarks and their reports; results go to bench/results/ as JSON + PNG.",
                   populate=_bench_arguments)


def _bench_arguments(p) -> None:
    from .bench.args import VERBS  # light: each verb's module (torch) loads when the verb runs

    bsub = p.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(VERBS) + "}")
    for verb, (help_line, add) in VERBS.items():
        bsub.add_parser(verb, help=help_line, populate=lambda q, v=verb, a=add: _bench_verb(q, v, a))


def _bench_verb(p, verb: str, add) -> None:
    from .bench.args import HELP_FORMATTER, description, run

    p.description = description(verb)
    p.formatter_class = HELP_FORMATTER
    add(p)
    p.set_defaults(func=lambda args: run(verb, args))


def _add_simulate(sub) -> None:
    """``sparsp simulate`` (CPU cost model; arguments and job in ``sparsp.simulate.cli``)."""
    from .simulate import cli as simulate_cli  # light: the job's modules load in its main

    sub.add_parser("simulate", help="predict each strategy's timing on a fabric profile (CPU)",
                   description=simulate_cli.DESCRIPTION, formatter_class=_DefaultsFormatter,
                   populate=lambda p: (simulate_cli.add_arguments(p), p.set_defaults(func=simulate_cli.main)))


def _add_trace(sub) -> None:
    """``sparsp trace`` (record a transformer's block masks; job in ``sparsp.integrations.trace``)."""
    from .integrations import trace  # light: torch and Diffusers load in its main

    sub.add_parser("trace", help="record a Diffusers transformer's block masks for analyze --trace",
                   description=trace.__doc__, formatter_class=HelpFormatter,
                   populate=lambda p: (trace.add_arguments(p), p.set_defaults(func=trace.main)))


def build_parser() -> argparse.ArgumentParser:
    """The whole command tree; each verb's arguments are added when the verb is parsed."""
    parser = argparse.ArgumentParser(
        prog="sparsp",
        description="Sparsity-aware sequence-parallel attention for video diffusion transformers.",
    )
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{analyze,bench,calibrate,density,simulate,trace}", parser_class=_LazyParser)
    _add_analyze(sub)
    _add_bench(sub)
    _add_calibrate(sub)
    _add_density(sub)
    _add_trace(sub)
    _add_simulate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT; outputs are staged
        print(f"sparsp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
