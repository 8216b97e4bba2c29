"""The arguments of every ``sparsp bench`` verb, without torch.

``sparsp bench VERB --help`` builds its parser from this module alone: the choices are plain
data (``sparsp.geometry``, ``sparsp.names`` and the constants below), each verb's description
is its module's docstring read from the source (``description``), and the verb's own module
(torch, the kernels, the transports) loads only when the verb runs. Strategy and registered
kernel names are free names here, checked against their registries when the verb runs
(``check_names``): a strategy is named only where it registers.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import sys
from pathlib import Path

from ..geometry import PRESETS
from ..inputs import HelpFormatter, add_density_profile_arguments
from ..names import TRACE_MODELS
from ..units import parse_size

FABRICS = ("nvlink", "host")
"""The GPU fabrics a benchmark runs on: ``nvlink`` (peer copies) or ``host`` (NCCL_P2P_DISABLE=1)."""
CPU_FABRIC = "gloo"
"""The ``fabric`` of a CPU run (``bench e2e --device cpu``): gloo between processes, no GPU path."""

ATTENTION_RESERVED = {"cdf_threshold": "--cdf", "block_size": "--model", "transport": "the rows",
                      "kernel": "--kernel", "timeout_s": "the benchmark (300 s)", "thresholds": "--thresholds",
                      "dense_steps": "the reuse rows", "replan_every": "the reuse rows"}
"""``SparspConfig`` fields ``bench attention`` sets itself (``--config`` may not)."""
LAYER_PICKS = ("densest", "median", "sparsest")
"""``bench attention --layer`` names: a profile's layer by its mean density over heads (at
``--step``, or over every step); ``median`` is the lower median of the layers' means."""
PROFILE_DIR = "density-profile"
"""The folder under ``bench attention --out`` that its ``--density-profile`` results and fits
go to: whatever looks up a preset's results in ``--out`` (``sparsp simulate --validate``, the
report's file globs) never meets rows of another workload."""
ONE_GPU_ROWS = ("1gpu-dense", "1gpu-sparse")
"""The one-GPU rows of ``bench attention`` and ``bench e2e`` (rank 0, the whole sequence): the
fastest dense kernel (what a user without sparsp runs), and the primary strategy on one GPU."""
E2E_RESERVED = {"cdf_threshold": "--cdf", "block_size": "--block-size", "transport": "--transport",
                "kernel": "--kernel", "dense_steps": "--dense-steps", "replan_every": "--replan-every",
                "thresholds": "--thresholds"}
"""``SparspConfig`` fields ``bench e2e`` sets from its own flags (``--config`` may not)."""
E2E_BLOCK_SIZE = 128
"""``bench e2e --block-size`` of a full-size model."""
E2E_TINY_BLOCK_SIZE = 8
"""``bench e2e --block-size`` with ``--tiny``: the tiny latent (3x8x8) patchifies to 48 tokens on
Wan and HunyuanVideo (192 on LTX), one block of 128 that no two ranks can split; 8 gives 6."""
RESULTS = Path("bench/results")
"""``--out`` of a GPU run: the tracked results, which ``sparsp simulate`` reads."""
CPU_RESULTS = Path("results/bench")
"""``--out`` of a CPU run (and of ``bench e2e --tiny``): a CPU's figures are no results to
track, and in ``bench/results`` a fit of a GPU's profile would take them for one."""
OUT_HELP = f"output directory (default: {RESULTS} on GPUs, {CPU_RESULTS} on a CPU)"


def default_out(on_gpu: bool) -> Path:
    """Where a run's results go unless ``--out`` is given (``RESULTS``, ``CPU_RESULTS``)."""
    return RESULTS if on_gpu else CPU_RESULTS
KERNEL_SHAPES = ("hunyuan-video", "wan2.1-14b", "ltx-video", "ltx-2")
"""``bench kernel``'s preset shapes."""
LOAD_ORDERS = ("exchange-first", "attention-first", "both")
"""``bench transport --load-order``."""


def description(verb: str) -> str | None:
    """The docstring of ``sparsp.bench.<verb>``, read from its source without importing it."""
    path = Path(__file__).with_name(f"{verb}.py")
    with contextlib.suppress(OSError, SyntaxError):
        return ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return None


class BenchFailed(RuntimeError):
    """A benchmark's failure that every rank agreed on (``common.agree``): the same one-line
    message, raised on every rank at the same point, so none waits in a collective for a peer
    that has stopped."""


def run(verb: str, args) -> int:
    """Run ``sparsp bench VERB`` (its module loads now); a failure the ranks agreed on ends it
    with one line on stderr and exit status 1, the same on every rank."""
    import importlib

    module = importlib.import_module(f"sparsp.bench.{verb}")
    try:
        return module.main(args)
    except BenchFailed as e:
        print(f"sparsp bench {verb}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


def refuse(verb: str, message: str):
    """Report a bad argument as argparse does (one line on stderr, exit status 2)."""
    print(f"sparsp bench {verb}: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def check_out(verb: str, flag: str, path, *, file: bool = False) -> None:
    """Refuse (``refuse``) an output that cannot be written, before any work starts and without
    making anything: a directory (``file``: a file path) that is an existing file, or whose
    nearest existing parent is a file or not writable."""
    path = Path(path)
    if path.exists() and path.is_dir() == file:
        refuse(verb, f"{flag} {path} is a {'directory' if file else 'file'}; give a "
                     f"{'file name' if file else 'directory'}")
    folder = path.parent if file else path
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        refuse(verb, f"{flag} {path}: {folder} is a file, not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        refuse(verb, f"{flag} {path}: cannot write into {folder}")


class Renamed(argparse.Action):
    """A flag's former spelling, hidden from ``--help``: given, it is refused in one line that
    names the new spelling (``refuse``), with or without a value."""

    def __init__(self, option_strings, dest, *, verb: str, new: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS,
                         **kwargs)
        self.verb, self.new = verb, new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        refuse(self.verb, f"{option_string} is now {self.new}")


def check_names(verb: str, flag: str, given, known) -> None:
    """Refuse (``refuse``) the first name of ``given`` that is not in ``known``, listing ``known``."""
    for name in given:
        if name not in known:
            refuse(verb, f"{flag}: unknown name {name!r}; registered: {', '.join(known)}")


def layer_arg(text: str) -> int | str:
    """One ``bench attention --layer`` value: a 0-based layer index or one of ``LAYER_PICKS``."""
    t = text.strip().lower()
    if t in LAYER_PICKS:
        return t
    try:
        value = int(t)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a 0-based layer index or one of {', '.join(LAYER_PICKS)}, "
                                         f"got {text!r}")
    return value


def schedule_arg(text: str) -> tuple[int, int]:
    """One ``bench e2e --schedule`` value, ``dense=N,replan=K`` (either part may be left out:
    0 dense steps, replan every step): ``(dense_steps, replan_every)``."""
    parts = dict(dense=0, replan=1)
    for item in text.split(","):
        key, eq, value = item.strip().partition("=")
        try:
            number = int(value) if eq and key in parts else -1
        except ValueError:
            number = -1
        if number < (0 if key == "dense" else 1):
            raise argparse.ArgumentTypeError(f"expected dense=N,replan=K (N >= 0 dense steps, a plan every K >= 1 "
                                             f"steps), got {text!r}")
        parts[key] = number
    return parts["dense"], parts["replan"]


MESH_ROLES = ("cfg", "ulysses", "sp")
"""``--mesh``'s dimensions (``sparsp.make_mesh``'s; ``sp`` takes the rest of the ranks)."""


def mesh_arg(text: str) -> dict[str, int]:
    """One ``--mesh`` value, ``cfg=C,ulysses=U`` (any of cfg, ulysses and sp, each an int >= 1;
    sp left out takes the rest of the ranks): the sizes given, by name."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in MESH_ROLES or name in sizes or not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"expected NAME=SIZE pairs of {', '.join(MESH_ROLES)} separated by "
                                             f"commas (e.g. cfg=2,ulysses=4; sp takes the rest of the ranks), "
                                             f"got {text!r}")
        sizes[name] = int(value)
    return sizes


def mesh_sizes(verb: str, sizes: dict[str, int], world: int) -> tuple[int, int, int]:
    """``(cfg, ulysses, sp)`` of ``--mesh`` on ``world`` ranks; refused (one line, exit 2) where
    they do not make the world or cfg is not 1 or 2."""
    cfg, ulysses = sizes.get("cfg", 1), sizes.get("ulysses", 1)
    if cfg not in (1, 2):
        refuse(verb, f"--mesh cfg={cfg}: a step's guidance branches go over 1 or 2 halves")
    if world % (cfg * ulysses):
        refuse(verb, f"--mesh cfg={cfg} x ulysses={ulysses} does not divide the {world} ranks")
    sp = sizes.get("sp", world // (cfg * ulysses))
    if cfg * ulysses * sp != world:
        refuse(verb, f"--mesh cfg={cfg} x ulysses={ulysses} x sp={sp} = {cfg * ulysses * sp} ranks, not the {world} "
                     f"of this run")
    return cfg, ulysses, sp


def mesh_label(sizes: tuple[int, int, int]) -> str:
    """``(cfg, ulysses, sp)`` as the rows name it."""
    return f"cfg {sizes[0]} x ulysses {sizes[1]} x sp {sizes[2]}"


def schedule_label(schedule: tuple[int, int]) -> str:
    """``(dense_steps, replan_every)`` as ``--schedule`` writes it."""
    return f"dense={schedule[0]},replan={schedule[1]}"


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def add_thresholds_argument(p, rows: str) -> None:
    """``--thresholds FILE``: a per-(layer, head) thresholds table for ``rows``, checked against
    the model before any process group starts (``check_thresholds``)."""
    p.add_argument("--thresholds", type=Path, default=None, metavar="FILE",
                   help=f"a JSON table of CDF (and similarity) thresholds per layer and head for {rows} "
                        "(docs/configuration.md, \"Thresholds per layer and head\"); layers it leaves out take --cdf. "
                        "A table of another model is refused")


def check_thresholds(verb: str, path, *, layers: int, heads: int, what: str) -> None:
    """Refuse (``refuse``: one line naming the file) a thresholds table that cannot be read or is
    not for ``layers`` self-attention layers of ``heads`` heads."""
    from ..thresholds import read_thresholds

    try:
        read_thresholds(path).check(layers=layers, heads=heads, what=what)
    except ValueError as e:
        refuse(verb, str(e))


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


# --- --config KEY=VALUE ----------------------------------------------------------------------

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _typed(annotation: str, text: str):
    """``text`` as a value of a ``SparspConfig`` field annotated ``annotation`` (a string: the
    module uses postponed annotations); ``ValueError`` when it is not one."""
    kinds = [k.strip() for k in annotation.split("|")]
    t = text.strip()
    if "None" in kinds and t.lower() in ("none", "auto"):
        return None
    for kind in kinds:
        if kind == "bool" and t.lower() in _TRUE + _FALSE:
            return t.lower() in _TRUE
        if kind == "int":
            with contextlib.suppress(ValueError):
                return int(t)
        if kind == "float":
            with contextlib.suppress(ValueError):
                return float(t)
        if kind.startswith("tuple[float") and "," in t:
            with contextlib.suppress(ValueError):
                return tuple(float(x) for x in t.split(","))
        if kind == "str":
            return t
    raise ValueError(f"expected {annotation}")


def config_arg(text: str) -> tuple[str, object]:
    """One ``--config KEY=VALUE``: a ``SparspConfig`` field and its value, typed from the
    field's annotation and checked by ``SparspConfig`` itself; ``argparse.ArgumentTypeError``
    (one line) for an unknown key or a bad value. Runs only when ``--config`` is given."""
    import dataclasses

    from ..config import SparspConfig

    fields = {f.name: f for f in dataclasses.fields(SparspConfig)}
    key, eq, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not eq:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if key not in fields:
        raise argparse.ArgumentTypeError(f"unknown SparspConfig field {key!r}; fields: "
                                         f"{', '.join(fields)}")
    try:
        typed = _typed(str(fields[key].type), value)
        SparspConfig(**{key: typed})  # the config's own checks, with its message
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{key}={value!r}: {e}") from None
    return key, typed


def add_config_argument(p, *, reserved: dict[str, str]) -> None:
    """The repeatable ``--config KEY=VALUE`` (any ``SparspConfig`` field but those in
    ``reserved``, which maps each to the flag or rule that sets it)."""
    p.add_argument("--config", action="append", default=[], type=config_arg, metavar="KEY=VALUE",
                   help="a SparspConfig field for every sparsp row, typed from the field (e.g. "
                        "drain_chunks=1, local_first=on, cuda_graphs=off, prefetch=2; none/auto "
                        "for None); repeatable; not " + ", ".join(reserved))


# --- the verbs -------------------------------------------------------------------------------


def add_attention(p) -> None:
    p.add_argument("--model", default="hunyuan-video", choices=PRESETS)
    p.add_argument("--text", action="store_true", help="include the model's text tokens (default: video only)")
    p.add_argument("--cdf", type=float, nargs="+", default=[0.9])
    p.add_argument("--strategy", nargs="+", default=None, metavar="NAME",
                   help="strategies to run (default: every registered one, README \"Strategies\", then auto: "
                        "chosen per call by the cost model, strategies/auto.py); an unknown name is "
                        "refused with the registered ones")
    p.add_argument("--fabric", default="nvlink", choices=FABRICS,
                   help="nvlink: peer copies allowed; host: NCCL_P2P_DISABLE=1, host-staged transports")
    p.add_argument("--kernel", default="auto", metavar="NAME",
                   help="auto or a registered kernel (docs/kernels.md); an unknown name is refused with "
                        "the registered ones")
    p.add_argument("--no-copy-engine", action="store_true",
                   help="skip the extra sparsp row on the fabric's copy-engine transport (ipc / host)")
    p.add_argument("--ablation", action="store_true", help="add the ablation rows (see above)")
    add_config_argument(p, reserved=ATTENTION_RESERVED)
    p.add_argument("--no-1gpu", action="store_true", help="skip the one-GPU rows")
    p.add_argument("--mesh", type=mesh_arg, default=None, metavar="ulysses=U[,sp=R]",
                   help="run the strategy rows on a device mesh (sparsp.make_mesh: each rank one piece of an sp "
                        "slice, an all-to-all inside each Ulysses group, the strategy over sp; docs/mesh.md); sp "
                        "takes the rest of the ranks, cfg is a pipeline's (bench e2e --mesh). On one GPU, "
                        "--mesh ulysses=1 runs the mesh path on a mesh of one, timed beside the flat 1gpu-sparse "
                        "call: its overhead")
    p.add_argument("--no-reuse", action="store_true",
                   help="skip the reuse rows: each strategy row is a plan call (its mask phase included); its "
                        "\"STRATEGY (reuse)\" row times a call that reuses that plan (SparspConfig.replan_every: no "
                        "mask phase), with reuse_ratio = reuse / (plan - plan mask phase)")
    add_thresholds_argument(p, "the rows' calls (layer 0, or each --layer of a profile)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="link bandwidth for the bound (default: best 256 MiB row of bench/results/"
                        "transport-all-*.json on this fabric)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sequential", action="store_true",
                   help="time each row's iterations back to back (default: interleaved, one "
                        "iteration of every row of a cdf in turn, each round starting one row "
                        "later, so drift and what ran just before reach all rows alike)")
    p.add_argument("--seed", type=int, default=None,
                   help="the synthetic workload's seed (default 0; with --calibration the file's, so not with it)")
    p.add_argument("--input-sets", type=positive_int, default=1, metavar="N",
                   help="cycle the timed calls of every row through N input sets (seeds seed … "
                        "seed+N−1): the mask and its demand change from call to call as a "
                        "denoising loop's do, which is what strategy=auto's caches meet (1: the same inputs every "
                        "call; the split and bytes come from the first set)")
    p.add_argument("--torch-profile", type=Path, default=None, metavar="DIR",
                   help="write, per row and rank, torch.profiler tables of one call (ops by device "
                        "and by host time) and a gzipped Chrome trace into DIR (sparsp bench timeline "
                        "prints one)")
    p.add_argument("--profile", action=Renamed, verb="attention", new="--torch-profile DIR")
    add_density_profile_arguments(
        p, use=f"rows per --layer, each on q/k of synthetic heads calibrated to that layer; results go to "
               f"OUT/{PROFILE_DIR}/", fitted=f"the asked layers' fit to OUT/{PROFILE_DIR}/")
    p.add_argument("--layer", nargs="+", type=layer_arg, default=None, metavar="L",
                   help="with --density-profile (and needed by it): the layers to run, each a 0-based index or "
                        f"{', '.join(LAYER_PICKS)} (by the layers' mean density at --step, or over steps)")
    p.add_argument("--out", type=Path, default=None,
                   help=OUT_HELP + "; the bound's link bandwidth is read from its transport files")


def check_attention(args) -> None:
    """Refuse (``refuse``: one line, exit 2) ``bench attention`` options that cannot apply
    together, before anything starts: the profile's flags without ``--density-profile``, and
    with it what would not measure the profile's layers."""
    given = {"--layer": args.layer, "--step": args.step, "--calibration": args.calibration}
    if args.density_profile is None:
        for flag, value in given.items():
            if value is not None:
                refuse("attention", f"{flag} applies with --density-profile only")
        return
    if args.layer is None:
        refuse("attention", f"--density-profile needs --layer: 0-based layer indices or {', '.join(LAYER_PICKS)}")
    if args.text:
        refuse("attention", "--text cannot apply with --density-profile: a profile gives the densities of the "
                            "video tokens only")
    if args.input_sets != 1:
        refuse("attention", "--input-sets cannot apply with --density-profile: the calibrated heads are fitted to "
                            "one seed's draws, other seeds' heads would not have the profile's densities")
    if args.calibration is not None and args.seed is not None:
        refuse("attention", "--seed cannot apply with --calibration: the heads were fitted with the file's seed, "
                            "which the run uses")


def add_e2e(p) -> None:
    p.add_argument("--model", default="wan2.1-14b", choices=TRACE_MODELS, help="model preset")
    p.add_argument("--steps", type=int, default=4, help="timed denoising steps per strategy")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--layers", type=int, default=None, help="truncate the block stack (default: all)")
    p.add_argument("--strategy", nargs="+", default=None, metavar="NAME",
                   help="1gpu-dense, 1gpu-sparse, diffusers-ring, diffusers-ulysses, diffusers-unified (with "
                        "--mesh), or any registered sparsp strategy (default: the rows named above); an unknown "
                        "name is refused with the known ones")
    p.add_argument("--mesh", type=mesh_arg, default=None, metavar="cfg=C,ulysses=U",
                   help="run the sparsp rows on a device mesh (sparsp.make_mesh; sp takes the rest of the ranks): "
                        "cfg=2 gives every row a batch of two branches (CFG's [uncond, cond]) that the sparsp rows "
                        "split over two halves (CFG parallel), and diffusers-unified runs Diffusers' own ring x "
                        "Ulysses attention at the same mesh (docs/diffusers.md)")
    p.add_argument("--cdf", type=float, default=0.9, help="CDF threshold of the sparse rows")
    p.add_argument("--dense-steps", type=non_negative_int, default=0, metavar="N",
                   help="the sparse rows' schedule: the first N timed steps dense (SparspConfig.dense_steps)")
    p.add_argument("--replan-every", type=positive_int, default=1, metavar="K",
                   help="the sparse rows' schedule: a plan every K steps after the dense ones, reused in "
                        "between (SparspConfig.replan_every; 1: every step plans)")
    p.add_argument("--schedule", action="append", default=[], type=schedule_arg, metavar="dense=N,replan=K",
                   help="one more row per sparse strategy under this schedule (repeatable), e.g. "
                        "--schedule dense=10,replan=5 --schedule dense=0,replan=10; every row has "
                        "schedule and total_ms (its timed steps' sum)")
    add_thresholds_argument(p, "the sparse rows")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"sparsp block size in tokens (default: {E2E_BLOCK_SIZE}; --block-size "
                        f"{E2E_TINY_BLOCK_SIZE} with --tiny unless given, so the tiny model has blocks "
                        "enough for every rank)")
    p.add_argument("--weights", default=None, choices=["random", "synthetic-structure"],
                   help="random (default): the model's own q/k; synthetic-structure: synthetic video q/k "
                        "into sparsp attention (implied by --density-profile)")
    add_density_profile_arguments(
        p, use="each layer's sparsp attention gets q/k of synthetic heads calibrated to that layer; the "
               "result file carries the profile's name", fitted="the model's layers' fit into --out")
    p.add_argument("--fabric", default=None, choices=FABRICS,
                   help=f"GPUs only: nvlink (default): peer copies; host: NCCL_P2P_DISABLE=1 and sparsp's "
                        f"host transport. A CPU run's rows say {CPU_FABRIC}")
    p.add_argument("--transport", default=None, choices=["auto", "nccl", "ipc", "host"],
                   help="sparsp transport (default: auto on nvlink, host on host)")
    p.add_argument("--kernel", default="auto", choices=["auto", "torch", "flex"], help="sparsp kernel")
    add_config_argument(p, reserved=E2E_RESERVED)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu (gloo smoke run)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny config and latent (CPU smoke test of the plumbing): --block-size "
                        f"{E2E_TINY_BLOCK_SIZE} and --out {CPU_RESULTS} unless given")
    p.add_argument("--latent", type=int, nargs=3, default=None, metavar=("F", "H", "W"),
                   help="latent frames, height, width before patchify (default: the preset's video)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP + f"; {CPU_RESULTS} with --tiny")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")


def add_kernel(p) -> None:
    p.add_argument("--shape", nargs="+", default=list(KERNEL_SHAPES),
                   help=f"preset names ({', '.join(KERNEL_SHAPES)}) or custom SQxSKxHxD")
    p.add_argument("--ranks", type=int, default=2, help="G: a preset shape is one rank's queries")
    p.add_argument("--kernel", nargs="+", default=None, choices=["fa4", "flex", "torch"],
                   help="sparse kernels (default: fa4 and flex where available; torch on CPU)")
    p.add_argument("--layout", nargs="+", default=["local", "packed"], choices=["local", "packed"])
    p.add_argument("--cdf", type=float, nargs="*", default=[0.85, 0.9, 0.95],
                   help="CDF thresholds of the benchmark's own (synthetic) masks")
    p.add_argument("--density", type=float, nargs="*", default=[0.25, 0.6],
                   help="densities of random per-head block masks")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)


def add_transport(p) -> None:
    p.add_argument("--fabric", default="nvlink", choices=FABRICS,
                   help="nvlink: peer access (nccl, ipc); host: NCCL_P2P_DISABLE=1 (nccl, host)")
    p.add_argument("--transports", nargs="+", default=None, choices=["nccl", "ipc", "host"],
                   help="transports to measure (default: those of --fabric)")
    p.add_argument("--min-bytes", type=parse_size, default=64 << 10, help="smallest message, e.g. 64KiB")
    p.add_argument("--max-bytes", type=parse_size, default=512 << 20, help="largest message, e.g. 512MiB")
    p.add_argument("--factor", type=int, default=2, help="size step (powers of this factor)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3,
                   help="times each size's median is measured; the row keeps all of them")
    p.add_argument("--gate-ms", type=float, default=1.0,
                   help="spin kernel before each timed exchange so the host has queued it (0: off)")
    p.add_argument("--no-align", action="store_true",
                   help="skip the 4-byte all-reduce after the gate that starts both GPUs together")
    p.add_argument("--pipeline", type=int, default=None,
                   help="exchanges in flight in the pipelined rows (default: --window; 0: none)")
    p.add_argument("--no-load", action="store_true", help="skip the under-attention-load runs")
    p.add_argument("--load-order", choices=LOAD_ORDERS, default="both",
                   help="under load: the first exchange in flight before the attention starts, the "
                        "attention queued before the exchanges, or both (default)")
    p.add_argument("--attn-tokens", type=int, default=32768)
    p.add_argument("--attn-heads", type=int, default=24)
    p.add_argument("--attn-dim", type=int, default=128)
    p.add_argument("--chunk-bytes", type=parse_size, default=16 << 20, help="host transport chunk")
    p.add_argument("--window", type=int, default=3, help="slots per peer (ipc, host)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a wait fails")
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    p.add_argument("--no-plot", action="store_true")


def add_report(p) -> None:
    p.add_argument("files", nargs="+", type=Path, metavar="RESULT.json",
                   help="result files of any sparsp bench verb (each checked before anything is printed)")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png",
                   help="also draw the attention files' speedup summary into OUT.png")
    p.add_argument("--scaling", type=Path, default=None, metavar="OUT.png",
                   help="also draw latency and speedup versus the number of GPUs from attention files "
                        "of several machines into OUT.png")


def add_timeline(p) -> None:
    p.add_argument("traces", nargs="+", type=Path, metavar="TRACE",
                   help="Chrome traces (.json or .json.gz) of bench attention --torch-profile DIR")
    p.add_argument("--min-us", type=float, default=20.0,
                   help="list GPU ops at least this long (µs; shorter ones are only counted)")


VERBS = {
    "attention": ("one attention layer per strategy", add_attention),
    "e2e": ("denoising steps of a Diffusers transformer per strategy", add_e2e),
    "kernel": ("block-sparse kernels vs dense kernels on one GPU", add_kernel),
    "transport": ("bandwidth per transport, alone and under attention load", add_transport),
    "report": ("a short table of result files, and the summary and scaling plots (CPU)", add_report),
    "timeline": ("a profiled call's trace as host ranges and per-stream GPU work (CPU)", add_timeline),
}
"""``sparsp bench`` sub-verb (its module in ``sparsp.bench``) → (help line, arguments). Every
verb's ``--help`` shows its module's docstring as written (``HELP_FORMATTER``: paragraphs and
example commands keep their lines) and each default but ``None``."""
HELP_FORMATTER = HelpFormatter
