"""``sparsp simulate``: arguments, the printed table, exit status 2 on bad input."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..inputs import add_density_profile_arguments, add_renamed, add_schedule_arguments, add_thresholds_argument

DESCRIPTION = (
    "Predict, on the CPU, the per-rank and per-round timing of every sequence-parallel strategy "
    "on a fabric profile, from the exact demand of `sparsp analyze` (synthetic masks) and a cost "
    "model: kernel time per kept block, per-call fixed costs and the host's counted ops, link "
    "bandwidth and latency (alone and while a kernel runs), and contention where links share a "
    "path. Prints a table; writes DIR/simulate.json and PNGs of "
    "latency and speedup versus G. Profiles: h200x2-nvlink, h200x2-host (measured), "
    "pcie4-8gpu-p2p/-nop2p, pcie5-8gpu-p2p/-nop2p (public specifications), or a profile .json. "
    "With --density-profile, the WHOLE MODEL's step instead: every layer on its own masks, calibrated "
    "to a real model's per-head densities as in `sparsp analyze --density-profile`, summed over the "
    "layers per strategy, for `auto` (its per-layer picks) and for ulysses with heads given to ranks "
    "by density; on every built-in profile unless --fabric names some. "
    "Every row also prices a reuse call (its plan kept: no mask phase) and a dense step's call, and a whole "
    "run of --steps steps under --dense-steps and --replan-every (a table when a schedule is given). "
    "With --mesh cfg=C,ulysses=U or --mesh auto, the model's denoising step on a device mesh instead: per G "
    "and fabric (several, or all: the multi-host profiles hold 64 GPUs) the mesh and its step beside the flat "
    "group and beside ulysses x ring-sparse at that mesh. "
    "With --count-ops, no simulation: the host's eager ops one call issues, counted on the code on "
    "CPU gloo ranks, and the cost model's op constants fitted to them. "
    "Method and sources: docs/simulate.md."
)
DEFAULT_FABRIC = "pcie4-8gpu-nop2p"
"""The profile of the one-call sweep when ``--fabric`` is not given."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..geometry import PRESETS
    from ..names import PROFILE_NAMES

    p.add_argument("--model", default="hunyuan-video", choices=PRESETS, help="model preset")
    p.add_argument("--ranks", type=int, nargs="+", default=None,
                   help="sequence-parallel degrees G (default: those of 2 4 8 the profile holds, with several "
                        "profiles the largest; with --count-ops: 2 3 4 6)")
    p.add_argument("--fabric", nargs="+", default=None, metavar="PROFILE",
                   help=f"profile name ({', '.join(PROFILE_NAMES)}) or a profile .json file (default: "
                        f"{DEFAULT_FABRIC}); with --density-profile several, or `all` (every built-in "
                        f"profile: the default there), a profile of fewer GPUs than G skipped at that G")
    p.add_argument("--cdf", type=float, nargs="+", default=[0.9], help="CDF thresholds")
    p.add_argument("--strategy", nargs="+", default=None, metavar="NAME",
                   help="strategies (default: every registered one; an unknown name is refused with "
                        "the registered ones)")
    p.add_argument("--placement", default="auto", choices=["auto", "contiguous", "periodic"],
                   help="auto: the placement each strategy is registered with")
    p.add_argument("--transport", default=None,
                   help="a transport of the profile (default: its copy-engine one; nccl for NCCL)")
    p.add_argument("--text", action="store_true", help="include the model's text tokens")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8"], help="K/V element type")
    p.add_argument("--prefetch", type=int, default=None,
                   help="rounds fetched ahead by a direct-routed strategy (SparspConfig.prefetch; default 1; "
                        "refused when no direct-routed strategy is simulated)")
    p.add_argument("--no-local-first", action="store_true",
                   help="simulate every strategy in order, the local kernel after the host read "
                        "(SparspConfig(local_first=False)); default (None, automatic): the "
                        "strategies registered local_first launch it before the read "
                        "where the code's rule would (not over nccl; the first round moves in less "
                        "time than the local kernel computes)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic masks (with --density-profile: of a calibration fitted now)")
    p.add_argument("--fit-profile", type=Path, nargs="*", default=None, metavar="RESULT.json",
                   help="bench transport (and bench kernel) results to fit the machine profile of --fabric "
                        "to: transports alone and under load, kernel rates per head dim and per shape; a "
                        "file measured on another GPU (or the CPU) is refused (no file: the newest "
                        "transport-*.json and kernel-*.json of the profile's GPU in bench/results); the "
                        "files used are printed")
    add_renamed(p, "--calibrate", "--fit-profile")
    p.add_argument("--validate", type=Path, nargs="*", default=None, metavar="ATTENTION.json",
                   help="bench attention results whose multi-GPU strategy rows to predict, never "
                        "fitted on (no file: the newest attention-*.json per model and machine in "
                        "bench/results)")
    add_density_profile_arguments(
        p, use="predict the whole model's step, each layer on masks calibrated to it (not with "
               "--validate or --text)", fitted="DIR/calibration.json")
    p.add_argument("--layers", type=int, default=None,
                   help="with --density-profile: the model's first N layers (default: all of them)")
    add_thresholds_argument(p)
    add_schedule_arguments(p, costs="time")
    p.add_argument("--branches", type=int, default=None,
                   help="guidance branches per denoising step (a step is the model's layers x these calls; "
                        "default: the preset pipeline's: wan 2, ltx-video 2, ltx-2 3, hunyuan-video 1)")
    p.add_argument("--mesh", default=None, metavar="cfg=C,ulysses=U|auto",
                   help="the model's step on a device mesh of each --ranks G (sp takes the rest; cfg 2 splits a "
                        "step's branches over two halves): that mesh, or with auto the best of every valid one, "
                        "beside the flat group and ulysses x ring-sparse at the same mesh; --fabric takes several "
                        "profiles or all (the default), those of fewer GPUs than G skipped; --ranks defaults to 8")
    p.add_argument("--out", type=Path, default=Path("results/simulate"), help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--count-ops", action="store_true",
                   help="instead of simulating: count the eager PyTorch ops one sp_attention call issues, "
                        "per strategy and order, on CPU gloo groups of each --ranks G, and print the op "
                        "constants of sparsp.cost.ops fitted to them (for recounting them after a change "
                        "to the code; minutes); takes no other option")


def _error(message) -> int:
    """A bad argument, the way argparse reports one: one line on stderr, exit status 2."""
    print(f"sparsp simulate: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def check_files(args) -> None:
    """Every input file, read and checked before any work: one ``ValueError`` line naming the
    option, the file and what is wrong (empty, not UTF-8, not JSON, another kind of file)."""
    from ..inputs import read_json
    from ..names import PROFILE_NAMES
    from .calibrate import read_result

    for fabric in args.fabric or ():
        if fabric != "all":
            _check_profile_file(fabric, PROFILE_NAMES)
    for path in args.fit_profile or ():
        read_result(path, ("transport", "kernel"), "--fit-profile")
    for path in args.validate or ():
        read_result(path, ("attention",), "--validate")
    if getattr(args, "calibration", None) is not None:
        read_json(args.calibration, "--calibration", what="sparsp calibration (JSON)")
    if getattr(args, "thresholds", None) is not None:
        from ..analysis import read_table
        from ..geometry import preset

        read_table(args.thresholds, preset(args.model))


def fit_inputs(args, fabrics: tuple[str, ...]) -> list[str]:
    """``--fit-profile``'s files (found now when none is named: those of the profile's GPU),
    each checked to come from the GPU the profile describes → one line per file to print."""
    from ..cost.profiles import get_profile
    from .calibrate import describe_inputs, discover_calibration

    if len(args.fit_profile) > 2:
        raise ValueError("--fit-profile takes a bench transport result and optionally a bench kernel result")
    if len(fabrics) > 1 or "all" in fabrics:
        raise ValueError("--fit-profile fits one profile: give one --fabric with it")
    profile = get_profile(fabrics[0] if fabrics else DEFAULT_FABRIC)
    if not args.fit_profile:
        args.fit_profile = discover_calibration(profile=profile)
    return describe_inputs(profile, args.fit_profile)


def _check_profile_file(fabric: str, names) -> None:
    from ..inputs import read_json

    if fabric not in names and (fabric.endswith(".json") or Path(fabric).exists()):
        doc = read_json(fabric, "--fabric", what="sparsp profile (JSON)")
        if not isinstance(doc, dict):
            raise ValueError(f"--fabric {fabric}: not a sparsp profile: the JSON is a {type(doc).__name__}, "
                             f"not an object")
        if "kind" in doc and "rows" in doc:
            raise ValueError(f"--fabric {fabric}: not a sparsp profile: it is a bench {doc['kind']!r} result "
                             f"(give it to --fit-profile)")
        from ..cost.profiles import Profile

        try:
            Profile.from_dict(doc.get("profile", doc))
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"--fabric {fabric}: {' '.join(str(e).split())}") from None


def check_combinations(args) -> None:
    """An option that cannot apply to the strategies simulated is refused, never ignored."""
    from ..strategies.registry import strategies_where, strategy_names

    chosen = list(args.strategy or strategy_names())
    direct = [s for s in chosen if s in strategies_where(byte_rule="direct")]
    if args.prefetch is not None and not direct:
        raise ValueError(f"--prefetch applies to direct-routed strategies "
                         f"({', '.join(strategies_where(byte_rule='direct'))}), and --strategy "
                         f"{' '.join(chosen)} has none")
    ordered = [s for s in chosen if s in strategies_where(local_first=True)]
    if args.no_local_first and not ordered:
        raise ValueError(f"--no-local-first applies to strategies that can compute the local shard first "
                         f"({', '.join(strategies_where(local_first=True))}), and --strategy "
                         f"{' '.join(chosen)} has none")


def _config(args):
    """The ``SimulateConfig`` of the arguments, every input checked (``ValueError``), and the
    lines naming the files a profile is fitted to."""
    from .options import SimulateConfig

    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out} is a file; give a directory")
    check_files(args)
    several = args.density_profile is not None or args.mesh is not None
    fabrics = tuple(args.fabric or (("all",) if several else ()))
    if not several and (len(fabrics) > 1 or "all" in fabrics):
        raise ValueError(f"--fabric {' '.join(fabrics)}: several profiles need --density-profile or --mesh "
                         f"(the one-call sweep takes one profile)")
    if args.mesh is not None:
        given = [name for name, on in (("--density-profile", args.density_profile is not None),
                                       ("--validate", args.validate is not None),
                                       ("--fit-profile", args.fit_profile is not None)) if on]
        if given:
            raise ValueError(f"{' and '.join(given)} cannot apply with --mesh: it prices a step on synthetic masks "
                             f"with the built-in profiles; drop {'it' if len(given) == 1 else 'them'}")
    fitting = fit_inputs(args, fabrics) if args.fit_profile is not None else []
    check_combinations(args)
    cfg = SimulateConfig(
        model=args.model, ranks=tuple(args.ranks or ()), cdf=tuple(args.cdf),
        fabric=fabrics[0] if len(fabrics) == 1 and fabrics[0] != "all" else DEFAULT_FABRIC,
        fabrics=fabrics if several else (),
        density_profile=args.density_profile, step=args.step, calibration=args.calibration,
        layers=args.layers, out=args.out,
        strategies=tuple(args.strategy or ()), placement=args.placement, transport=args.transport,
        text=args.text, dtype=args.dtype, prefetch=1 if args.prefetch is None else args.prefetch,
        seed=args.seed, fit_profile=tuple(args.fit_profile or ()),
        validate=None if args.validate is None else tuple(args.validate),
        steps=args.steps, dense_steps=args.dense_steps, replan_every=args.replan_every, branches=args.branches,
        thresholds=args.thresholds, mesh=args.mesh,
        **({"local_first": False} if args.no_local_first else {}),  # else the config's default
    )
    return cfg, fitting


def main(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .job import simulate
    from .plots import write_outputs

    if args.count_ops:
        return count_ops(args)
    console = Console()
    if console.width < 118:  # the table has eleven columns: do not truncate them in a pipe
        console = Console(width=118)
    try:
        cfg, fitting = _config(args)
        for line in fitting:  # whole lines: a path is not to be wrapped
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        run, write = simulate, write_outputs
        if cfg.density_profile is not None:  # the whole model's step
            from .layers import simulate_model, write_model

            run, write = simulate_model, write_model
        elif cfg.mesh is not None:  # the model's step on a device mesh
            from .meshes import simulate_meshes

            run, write = simulate_meshes, write_outputs
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            doc = run(cfg, progress)
    except (ValueError, OSError) as e:
        return _error(e)
    except (KeyError, TypeError, IndexError) as e:  # a result file whose rows lack a field
        files = ", ".join(map(str, [*(args.fit_profile or ()), *(args.validate or ())])) or "the inputs"
        return _error(f"a row of {files} lacks a field or has a value of the wrong type: "
                      f"{type(e).__name__}: {e}")
    if doc.get("mode") == "model":
        from .layers import print_model

        print_model(doc, console)
    elif doc.get("mode") == "mesh":
        from .meshes import print_meshes

        print_meshes(doc, console)
    else:
        print_tables(doc, console)
    try:
        paths = write(doc, args.out, plots=not args.no_plots)
    except OSError as e:
        return _error(f"cannot write to --out {args.out}: {e}")
    console.print("wrote " + ", ".join(str(p) for p in paths))
    console.print(f"done in {doc['seconds']:.1f} s")
    return 0


def count_ops(args) -> int:
    """``--count-ops``: ``opcount.report`` at each ``--ranks`` G; any other option is refused."""
    from .opcount import HEADS, RANKS, report

    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    given = [f"--{k.replace('_', '-')}" for k, v in vars(defaults.parse_args([])).items()
             if k not in ("count_ops", "ranks") and getattr(args, k, v) != v]
    if given:
        return _error(f"{' '.join(given)} cannot apply with --count-ops: it counts the code's ops, it "
                      f"simulates nothing; drop {'it' if len(given) == 1 else 'them'}")
    ranks = tuple(args.ranks or RANKS)
    bad = [G for G in ranks if G < 1 or HEADS % G]
    if bad:
        return _error(f"--ranks {' '.join(map(str, bad))}: --count-ops counts on {HEADS} heads; each G must "
                      f"divide them")
    for line in report(ranks):
        print(line, flush=True)
    return 0


def print_tables(doc: dict, console) -> None:
    from rich.table import Table

    from ..strategies.registry import strategies_where

    transports = ", ".join(dict.fromkeys(r["transport"] for r in doc["results"]))
    order = {None: "local first where it pays", True: "local first where registered",
             False: "in order"}.get(doc.get("local_first"), "in order")
    table = Table(title=f"{doc['model']}: {doc['tokens']:,} tokens, {doc['heads']}x{doc['head_dim']} heads, "
                        f"on {doc['fabric']} ({transports}); simulated ({order}), {doc['masks']} masks")
    for col in ("cdf", "G", "strategy", "ms", "vs ring", "vs 1-GPU sparse", "compute", "fixed", "exposed",
                "MiB/rank", "bottleneck"):
        table.add_column(col, justify="left" if col in ("strategy", "bottleneck") else "right")
    for r in doc["results"]:
        table.add_row(f"{r['cdf']:.2f}", str(r["ranks"]), r["strategy"], f"{r['predicted_ms']:.1f}",
                      "" if r["speedup_vs_ring"] is None else f"{r['speedup_vs_ring']:.2f}x",
                      f"{r['speedup_vs_one_gpu']:.2f}x", f"{r['compute_ms']:.1f}", f"{r['fixed_ms']:.1f}",
                      f"{r['exposed_ms']:.1f}",
                      f"{r['bytes_max_rank'] / 2**20:,.0f}", r["bottleneck"])
    console.print(table)
    from .job import BOTTLENECK_LEGEND

    console.print("ms: predicted time of one attention call; vs ring: the dense ring's ms at the same G over "
                  "this row's; vs 1-GPU sparse: the one-GPU sparse call's ms (below) over this row's, not dense "
                  "attention's; compute, fixed, exposed: the slowest rank's kernel time, fixed costs and transfer "
                  "time not hidden behind compute (ms); " + BOTTLENECK_LEGEND, markup=False, highlight=False)
    for cdf, one in doc["one_gpu"].items():
        console.print(f"one GPU, cdf {cdf}: sparse ({strategies_where(primary=True)[0]} on a group of one) "
                      f"{one['sparse_ms']:.1f} ms, dense kernel {one['dense_ms']:.1f} ms")
    print_run(doc, console)
    for s in doc["skipped"]:
        console.print(f"skipped {s['strategy']} at G={s['ranks']}: {s['reason']}")
    if doc.get("validation") is not None:
        v = Table(title="validation: attention rows (never used for fitting)")
        for col in ("model", "G", "fabric", "strategy", "transport", "predicted ms", "measured ms", "error"):
            v.add_column(col, justify="right" if "ms" in col or col in ("error", "G") else "left")
        for r in doc["validation"]:
            v.add_row(r["model"], str(r.get("ranks", 2)), r["fabric"], r["strategy"], r["transport"],
                      f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}", f"{100 * r['error']:+.1f} %")
        console.print(v)
        summary = doc.get("validation_summary") or {}
        groups = [("2 GPUs", summary)] + [(f"{k[6:]} GPUs", summary[k]) for k in summary
                                          if k.startswith("ranks_")]
        for label, part in groups:
            if part.get("rows"):
                per = "; ".join(f"{f} {part[f]['within']}/{part[f]['rows']}" for f in part
                                if isinstance(part[f], dict) and not f.startswith("ranks_"))
                console.print(f"{label}, within {100 * summary['tolerance']:.0f} %: {part['within']} of "
                              f"{part['rows']} rows ({per}); median error {100 * part['median_error']:+.1f} %")
        for src, commit in (doc.get("validation_sources") or {}).items():
            console.print(f"source {src} (commit {commit or 'uncommitted'})")
        for note in doc.get("validation_notes", [])[:10]:
            console.print(f"[dim]{note}[/dim]")


def print_run(doc: dict, console) -> None:
    """With a schedule (some dense steps or plans reused), each row's run under it beside a run
    whose every step plans, the one-GPU call first (G = 1)."""
    sched = doc["schedule"]
    if not sched["scheduled"]:
        return
    from rich.table import Table

    from ..strategies.registry import strategies_where

    table = Table(title=f"a run of {sched['steps']} steps, {doc['calls_per_step']} attention calls each: "
                        f"{sched['summary']}")
    for col in ("cdf", "G", "strategy", "plan ms", "reuse ms", "dense ms", "run s", "step ms",
                "every step plans: run s", "step ms", "saved"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    primary = strategies_where(primary=True)[0]
    rows = [{"cdf": float(c), "ranks": 1, "strategy": f"{primary} (1 GPU)", "predicted_ms": one["sparse_ms"], **one}
            for c, one in doc["one_gpu"].items()] + doc["results"]
    for r in rows:
        run = r["run"]
        table.add_row(f"{r['cdf']:.2f}", str(r["ranks"]), r["strategy"], f"{r['predicted_ms']:.1f}",
                      f"{r['reuse_ms']:.1f}", f"{r['dense_ms']:.1f}", f"{run['total_ms'] / 1e3:,.1f}",
                      f"{run['per_step_ms']:,.1f}", f"{run['every_step_plans_total_ms'] / 1e3:,.1f}",
                      f"{run['every_step_plans_per_step_ms']:,.1f}", f"{100 * run['saved']:+.1f}%")
    console.print(table)
    console.print("plan ms: a call that solves its plan (the table above); reuse ms: the same call reusing its kept "
                  "plan (no mask phase); dense ms: a dense step's call, through the strategy's dense path (the dense "
                  "ring for a sequence-sharded strategy, its own all-to-all with the dense kernel for ulysses, the "
                  "dense kernel on one GPU); run s, step ms: the run and its mean step under the schedule, then with "
                  "every step planning", markup=False, highlight=False)
