"""Shared code of the example recipes (wan.py, ltx_video.py, ltx2.py, hunyuan_video.py).

A recipe loads a Diffusers pipeline from a local directory, makes its transformer run the
video self-attention sequence-parallel with ``sparsp.parallelize`` and generates one video:

    torchrun --nproc-per-node 4 examples/wan.py --pretrained ./Wan2.1-T2V-1.3B-Diffusers \\
        --prompt "a red fox running through snow" --out fox.mp4

Every rank loads the same pipeline and runs the same denoising loop on the same inputs (the
noise comes from a CPU ``torch.Generator`` seeded with ``--seed`` on every rank, so it is the
same everywhere whatever the device); sparsp splits the video tokens of every transformer call
across the ranks and gathers the transformer's output, so the latents stay identical on every
rank. Rank 0 alone decodes the latents with the VAE and writes the mp4: the other ranks ask
the pipeline for latents only. Without ``torchrun`` (one process) sparsp runs its
single-process sparse attention: the same masks as one rank would compute (or as
``--emulate-ranks N`` ranks would), nothing communicated.

``--compare-dense`` then runs the unparallelized dense model (``sparsp.unparallelize``) from
the same seed and prompt on rank 0, after the other ranks have finished, and prints PSNR and
SSIM of the sparse video against it (``psnr`` and ``ssim`` below). ``--dense-steps N
--replan-every K`` run the denoising schedule (``SparspConfig``: the first N steps dense, the
masks searched every K steps and reused in between) and ``--thresholds FILE`` a table of
thresholds per layer and head; with ``--compare-dense`` (and ``--emulate-ranks G`` in one
process, which follows the same schedule) the figures measure that schedule's quality.

``--cfg 2`` spreads each step's guidance branches over two halves of the ranks (CFG parallel)
and ``--ulysses U`` makes Ulysses groups of U ranks; the rest of the world goes to sparsp's
sequence-parallel dimension (``sparsp.make_mesh``; docs/mesh.md says which mesh where). Two
8-GPU nodes, one guidance branch each, the all-to-all inside each node:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        examples/wan.py --pretrained ./Wan2.1-T2V-14B-Diffusers --cfg 2 --ulysses 8

``--tiny`` replaces the checkpoint by a tiny random pipeline built in code (``_tiny.py``) to
try a recipe anywhere. Step times are printed per step; on a GPU the first one includes the
compilation of the attention kernel for the geometry.

The mp4 is written with PyAV (``pip install 'sparsp[examples]'``), whose wheel carries its
own FFmpeg libraries and H.264 encoder (libx264): nothing else to install. Everything that
can be checked without the pipeline (options, installed packages, ``--out``, a strategy one
process cannot run) is checked before it loads, as one line and exit status 2; the mp4 is
written whole or not at all, and Ctrl-C stops with one line and exit status 130.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DTYPES = ("float32", "bfloat16", "float16")
STRATEGIES = "sparsp (default), ring (dense ring attention baseline), ring-sparse, ring-relay, ulysses, auto"


class RecipeError(Exception):
    """Bad input: reported as one line (``<script>: error: ...``), exit status 2."""


@dataclass(frozen=True)
class Recipe:
    """What differs between model families.

    ``multiples(pipe) -> (spatial, temporal, latent_spatial)``: height and width must be
    multiples of ``spatial``, ``frames - 1`` a multiple of ``temporal``, and a pixel side
    divided by ``latent_spatial`` is the number of transformer tokens along it.
    ``call_kwargs(args, pipe)``: the family's own pipeline arguments.
    ``extra_args(parser)``: the family's own command-line options."""

    name: str
    kind: str  # sparsp's model kind (sparsp.integrations.models.CLASSES), for --tiny
    pipeline: str  # the Diffusers pipeline class
    script: str
    height: int
    width: int
    frames: int
    steps: int
    fps: float
    guidance: float
    multiples: Callable
    example_dir: str
    call_kwargs: Callable = lambda args, pipe: {}
    extra_args: Callable = lambda parser: None
    transformers: tuple[str, ...] = ("transformer",)
    audio: bool = False  # the pipeline also returns audio (LTX-2)
    notes: str = ""


# --- command line -------------------------------------------------------------------------------


def build_parser(recipe: Recipe) -> argparse.ArgumentParser:
    example = (f"examples:\n  python examples/{recipe.script} --pretrained {recipe.example_dir} --prompt \"a cat\" "
               f"--out cat.mp4\n  torchrun --nproc-per-node 4 examples/{recipe.script} --pretrained "
               f"{recipe.example_dir} --compare-dense")
    p = argparse.ArgumentParser(
        prog=recipe.script,
        description=textwrap.fill(
            f"Generate a video with a Diffusers {recipe.pipeline} whose transformer runs its video self-attention "
            f"sequence-parallel and block-sparse with sparsp. Run it under torchrun for several GPUs (one rank per "
            f"GPU; --cfg and --ulysses make a device mesh of them) or as a plain python process for one. "
            f"{recipe.notes}", 100, break_on_hyphens=False),
        epilog=example, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--pretrained", metavar="DIR",
                     help=f"a local Diffusers {recipe.pipeline} directory (the one with model_index.json), loaded "
                          f"with {recipe.pipeline}.from_pretrained(DIR); nothing is downloaded")
    src.add_argument("--tiny", action="store_true",
                     help="instead of --pretrained: a tiny random pipeline built in code (examples/_tiny.py), to "
                          "try the recipe without a checkpoint; the video is noise. Its defaults: 4 steps, a small "
                          "size and --block-size 8 on CPU, 17x128x128 and --block-size 64 on GPU (the GPU kernels "
                          "need larger blocks)")
    p.add_argument("--prompt", default="A red fox trots through fresh snow in a birch forest, soft morning light.",
                   help="what the video shows")
    p.add_argument("--negative-prompt", default=None,
                   help="what it should not show (the pipeline's default if omitted)")
    p.add_argument("--height", type=int, help=f"video height in pixels (default {recipe.height})")
    p.add_argument("--width", type=int, help=f"video width in pixels (default {recipe.width})")
    p.add_argument("--frames", type=int, help=f"number of frames (default {recipe.frames})")
    p.add_argument("--steps", type=int, help=f"denoising steps (default {recipe.steps})")
    p.add_argument("--guidance", type=float, default=recipe.guidance,
                   help=f"guidance scale (default {recipe.guidance})")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise, the same on every rank (default 0)")
    p.add_argument("--fps", type=float, default=recipe.fps, help=f"frame rate of the mp4 (default {recipe.fps:g})")
    p.add_argument("--max-sequence-length", type=int, default=None, metavar="N",
                   help="prompt tokens given to the text encoder (the pipeline's default if omitted)")
    p.add_argument("--out", default=f"{Path(recipe.script).stem}.mp4", metavar="FILE.mp4",
                   help="where rank 0 writes the video (default %(default)s)")
    g = p.add_argument_group("sparsp")
    g.add_argument("--strategy", default="sparsp", help=f"sequence-parallel strategy: {STRATEGIES}")
    g.add_argument("--cdf", type=float, default=0.9, metavar="THRESHOLD",
                   help="block-sparsity CDF threshold in [0, 1]: per query block, keep the key blocks that hold "
                        "this share of the attention mass; 1.0 keeps every block (exact dense attention). "
                        "Default 0.9")
    g.add_argument("--block-size", type=int, metavar="TOKENS",
                   help="attention block in tokens, for queries and keys (default 128)")
    g.add_argument("--kernel", default="auto",
                   help="block-sparse attention kernel: auto (default: sparsp picks for the device), torch "
                        "(reference, any device), flex (FlexAttention, GPU), fa4 (FlashAttention-4, GPU)")
    g.add_argument("--dense-steps", type=int, default=0, metavar="N",
                   help="the schedule: the first N denoising steps run exact dense attention (default 0; "
                        "docs/configuration.md, \"Schedules\")")
    g.add_argument("--replan-every", type=int, default=1, metavar="K",
                   help="the schedule: after the dense steps, the block masks are searched every K steps and "
                        "reused in between (default 1: every step)")
    g.add_argument("--thresholds", default=None, metavar="FILE",
                   help="a JSON table of CDF thresholds per layer and head (docs/configuration.md, \"Thresholds "
                        "per layer and head\"); layers it leaves out take --cdf")
    g.add_argument("--cfg", type=int, default=1, metavar="C",
                   help="under torchrun: 2 spreads each denoising step's guidance branches over two halves of the "
                        "ranks (CFG parallel; docs/diffusers.md), 1 (default) runs every branch on every rank")
    g.add_argument("--ulysses", type=int, default=1, metavar="U",
                   help="under torchrun: the ranks of a Ulysses group, an all-to-all of the heads inside it (U must "
                        "divide the heads; docs/mesh.md); the rest of the world, divided by --cfg, goes to sparsp's "
                        "sequence-parallel dimension (default 1: a flat group)")
    g.add_argument("--emulate-ranks", type=int, default=None, metavar="G",
                   help="without torchrun only: compute the masks G ranks would compute, in one process")
    g.add_argument("--compare-dense", action="store_true",
                   help="also run the unparallelized dense model (same seed, same prompt) on rank 0 and print "
                        "PSNR (dB, peak 1) and SSIM (11x11 Gaussian window, sigma 1.5, per colour channel, "
                        "averaged) of the video against it; with --dense-steps/--replan-every (and "
                        "--emulate-ranks G in one process) it measures that schedule's quality")
    r = p.add_argument_group("runtime")
    r.add_argument("--device", default=None,
                   help="cuda or cpu (default: cuda if available, else cpu); under torchrun each rank uses "
                        "cuda:LOCAL_RANK")
    r.add_argument("--dtype", default=None, choices=DTYPES,
                   help="weights and activations (default: bfloat16 on cuda, float32 on cpu)")
    r.add_argument("--vae-tiling", action="store_true", help="decode the video in tiles (less memory on large videos)")
    recipe.extra_args(p)
    return p


def check_args(args, recipe: Recipe) -> None:
    """Everything that needs neither the pipeline nor the process group; fills the defaults."""
    if args.tiny:
        import torch
        from _tiny import GPU_BLOCK, GPU_SIZE, SIZES

        gpu = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
        size, steps, block = (GPU_SIZE, 4, GPU_BLOCK) if gpu else (SIZES[recipe.kind], 4, 8)
        if args.max_sequence_length is None:  # the tiny text encoders need no long prompt
            args.max_sequence_length = 16
    else:
        size, steps, block = (recipe.height, recipe.width, recipe.frames), recipe.steps, 128
    for name, value in zip(("height", "width", "frames", "steps", "block_size"), (*size, steps, block)):
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("height", "width", "frames", "steps", "block_size"):
        if getattr(args, name) < 1:
            raise RecipeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.cdf <= 1.0:
        raise RecipeError(f"--cdf must be in [0, 1], got {args.cdf}")
    if not args.fps > 0:
        raise RecipeError(f"--fps must be > 0, got {args.fps}")
    if Path(args.out).suffix.lower() != ".mp4":
        raise RecipeError(f"--out {args.out}: the video is written as mp4; give a FILE.mp4")
    if args.emulate_ranks is not None and args.emulate_ranks < 1:
        raise RecipeError(f"--emulate-ranks must be >= 1, got {args.emulate_ranks}")
    check_mesh(args, int(os.environ.get("WORLD_SIZE", "1")))
    if args.device not in (None, "cpu", "cuda"):
        raise RecipeError(f"--device must be cuda or cpu, got {args.device}")
    args.config = sparsp_config(args)
    _check_before_loading(args)
    if args.tiny:
        return
    d = Path(args.pretrained)
    if not d.is_dir():
        raise RecipeError(f"--pretrained {args.pretrained}: no such directory")
    index = d / "model_index.json"
    if not index.is_file():
        raise RecipeError(f"--pretrained {args.pretrained}: no model_index.json: not a Diffusers pipeline directory")
    try:
        found = json.loads(index.read_text()).get("_class_name")
    except (OSError, ValueError) as e:
        raise RecipeError(f"--pretrained {args.pretrained}: cannot read model_index.json: {e}") from None
    if found != recipe.pipeline:
        raise RecipeError(f"--pretrained {args.pretrained} holds a {found}, not a {recipe.pipeline}: "
                          f"use the recipe of that model family")


def check_mesh(args, world: int) -> None:
    """``--cfg`` and ``--ulysses`` against the world size torchrun gives (sp takes the rest)."""
    if args.cfg not in (1, 2):
        raise RecipeError(f"--cfg must be 1 or 2 (a step's guidance branches over two halves), got {args.cfg}")
    if args.ulysses < 1:
        raise RecipeError(f"--ulysses must be >= 1, got {args.ulysses}")
    if args.cfg * args.ulysses == 1:
        return
    if world == 1:
        raise RecipeError(f"--cfg {args.cfg} --ulysses {args.ulysses} split the ranks of torchrun; one process has "
                          f"one (run the recipe under torchrun)")
    if world % (args.cfg * args.ulysses):
        raise RecipeError(f"--cfg {args.cfg} x --ulysses {args.ulysses} does not divide the {world} ranks")


def sparsp_config(args):
    """The ``SparspConfig`` of the options (its own one-line checks: a bad threshold, schedule
    or thresholds file), made before anything loads."""
    from sparsp import SparspConfig

    flags = {"cdf_threshold": "--cdf", "dense_steps": "--dense-steps", "replan_every": "--replan-every",
             "thresholds": "--thresholds"}
    try:
        return SparspConfig(cdf_threshold=args.cdf, block_size=args.block_size, kernel=args.kernel,
                            dense_steps=args.dense_steps, replan_every=args.replan_every, thresholds=args.thresholds)
    except ValueError as e:
        message = str(e)
        for field, flag in flags.items():  # the option's name, as the user wrote it
            if message.startswith(f"{field} "):
                message = flag + message[len(field):]
        raise RecipeError(message) from None


def _check_before_loading(args) -> None:
    """What would otherwise fail after loading or generating: the packages of the examples
    extra, a strategy one process cannot run, an --out that cannot be written."""
    from sparsp.integrations.diffusers import check_strategy
    from sparsp.preflight import check_out_file, require

    try:
        require("examples", "diffusers", "transformers", "av", purpose="the recipe")
        check_out_file(args.out, what="a FILE.mp4")
    except ValueError as e:
        raise RecipeError(str(e)) from None
    try:
        check_strategy(args.strategy, distributed=int(os.environ.get("WORLD_SIZE", "1")) > 1)
    except ValueError as e:  # an unknown name, or auto in one process
        raise RecipeError(f"{e}{' (run the recipe under torchrun)' if args.strategy == 'auto' else ''}") from None


# --- process group and device -------------------------------------------------------------------


def setup(args):
    """(rank, world, device, dtype): the process group under torchrun (nccl on CUDA, gloo on
    CPU), rank r on cuda:LOCAL_RANK."""
    import torch
    import torch.distributed as dist

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("--device cuda: no CUDA device is available (use --device cpu)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1 and args.emulate_ranks is not None:
        raise RecipeError("--emulate-ranks is for one process; under torchrun the ranks are real")
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise RecipeError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} CUDA devices")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    return rank, world, device, dtype


def load_pipeline(args, recipe: Recipe, device, dtype):
    import diffusers

    if args.tiny:  # the same seed on every rank: the same random weights everywhere
        from _tiny import build_pipeline

        return in_eval(build_pipeline(recipe.kind).to(device, dtype))
    cls = getattr(diffusers, recipe.pipeline)
    try:
        pipe = cls.from_pretrained(args.pretrained, torch_dtype=dtype)
    except (OSError, ValueError, TypeError, KeyError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "low_cpu_mem_usage" in first:  # Diffusers loads fp32-kept modules (Wan) only through accelerate
            first += " (install accelerate: pip install 'sparsp[examples]')"
        raise RecipeError(f"cannot load {recipe.pipeline} from {args.pretrained}: {first}") from None
    pipe.to(device)
    if args.vae_tiling and hasattr(pipe.vae, "enable_tiling"):
        pipe.vae.enable_tiling()
    return in_eval(pipe)


def in_eval(pipe):
    """``pipe`` with every component in eval mode, whatever built it: a module made from its
    config (the tiny pipelines) starts in training mode, and the dropout of its text encoder
    would then make two runs of the same prompt and seed differ (``--compare-dense`` would
    measure the dropout, not sparsity)."""
    import torch

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipe


def check_size(args, recipe: Recipe, pipe, ranks: int) -> int:
    """Height, width and frames valid for this pipeline, and enough attention blocks for the
    ranks; returns the number of video tokens per transformer call."""
    spatial, temporal, latent_spatial = recipe.multiples(pipe)
    for name in ("height", "width"):
        v = getattr(args, name)
        if v % spatial:
            raise RecipeError(f"--{name} {v} is not a multiple of {spatial} ({recipe.name}: VAE and patch size); "
                              f"try {max(spatial, round(v / spatial) * spatial)}")
    if (args.frames - 1) % temporal:
        near = max(1, round((args.frames - 1) / temporal) * temporal + 1)
        raise RecipeError(f"--frames {args.frames}: {recipe.name} needs frames = {temporal}k + 1 "
                          f"(its VAE compresses time by {temporal}); try {near}")
    latent_frames = (args.frames - 1) // temporal + 1
    tokens = latent_frames * (args.height // latent_spatial) * (args.width // latent_spatial)
    blocks = math.ceil(tokens / args.block_size)
    if blocks < ranks:
        raise RecipeError(f"{args.frames}x{args.height}x{args.width} makes {tokens} video tokens = {blocks} blocks of "
                          f"{args.block_size}, fewer than the {ranks} ranks: use a larger video, a smaller "
                          f"--block-size or fewer ranks")
    return tokens


# --- generation ---------------------------------------------------------------------------------


class StepTimer:
    """Progress bar and per-step time, on rank 0 only. A step runs from the first transformer
    call after the previous step ended (prompt encoding is not counted) to the pipeline's
    ``callback_on_step_end``; on CUDA the device is synchronised at both ends."""

    def __init__(self, transformers: list, steps: int, label: str, show: bool):
        import torch

        cuda = next(transformers[0].parameters()).is_cuda
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.start = None
        self.times: list[float] = []
        self.bar = None
        if show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=steps, desc=label, unit="step", dynamic_ncols=True)
        self.handles = [t.register_forward_pre_hook(self._pre) for t in transformers]

    def _pre(self, module, args):
        if self.start is None:
            self.sync()
            self.start = time.perf_counter()

    def __call__(self, pipe, step, timestep, callback_kwargs):
        self.sync()
        now = time.perf_counter()
        self.times.append(now - (self.start if self.start is not None else now))
        self.start = None
        if self.bar is not None:
            self.bar.set_postfix_str(f"{1000 * self.times[-1]:.0f} ms/step", refresh=False)
            self.bar.update(1)
        return {}

    def close(self) -> list[float]:
        for h in self.handles:
            h.remove()
        if self.bar is not None:
            self.bar.close()
        return self.times


def generate(args, recipe: Recipe, pipe, *, decode: bool, label: str, show: bool):
    """One pipeline call: (frames (F, H, W, 3) float in [0, 1] or None, audio or None, step
    times in s). ``decode=False`` returns latents only (ranks other than 0)."""
    import torch

    models = [getattr(pipe, n) for n in recipe.transformers if getattr(pipe, n, None) is not None]
    timer = StepTimer(models, args.steps, label, show)
    kwargs = dict(prompt=args.prompt, height=args.height, width=args.width, num_frames=args.frames,
                  num_inference_steps=args.steps, guidance_scale=args.guidance,
                  generator=torch.Generator("cpu").manual_seed(args.seed),  # the same noise on every rank
                  output_type="np" if decode else "latent", callback_on_step_end=timer)
    if args.negative_prompt is not None:
        kwargs["negative_prompt"] = args.negative_prompt
    if args.max_sequence_length is not None:
        kwargs["max_sequence_length"] = args.max_sequence_length
    kwargs.update(recipe.call_kwargs(args, pipe))
    pipe.set_progress_bar_config(disable=True)
    try:
        with torch.inference_mode():
            out = pipe(**kwargs)
    finally:
        times = timer.close()
    if not decode:
        return None, None, times
    frames = out.frames[0]
    if isinstance(frames, torch.Tensor):
        frames = frames.float().cpu().numpy()
    audio = getattr(out, "audio", None) if recipe.audio and not getattr(args, "no_audio", False) else None
    if isinstance(audio, torch.Tensor):
        audio = audio[0].float().cpu().numpy()
    return frames, audio, times


def describe_schedule(config) -> str:
    """The schedule and thresholds file of ``config`` for the run's summary line ('' for none)."""
    out = ""
    if config.scheduled:
        out += f", schedule dense={config.dense_steps},replan={config.replan_every}"
    if config.thresholds is not None:
        out += f", thresholds {config.thresholds}"
    return out


def describe_times(times: list[float]) -> str:
    ms = [1000 * t for t in times]
    if not ms:
        return "no steps"
    steady = ms[1:] or ms
    return (f"{len(ms)} steps, {sum(steady) / len(steady):.1f} ms/step"
            f"{' after the first' if len(ms) > 1 else ''} (first {ms[0]:.1f} ms); per step: "
            + " ".join(f"{m:.0f}" for m in ms))


# --- quality ------------------------------------------------------------------------------------


def psnr(a, b) -> float:
    """Peak signal-to-noise ratio in dB of two videos with values in [0, 1] (peak 1), over all
    frames, pixels and channels at once; ``inf`` when they are equal."""
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    mse = (a - b).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a, b, *, window: int = 11, sigma: float = 1.5) -> float:
    """Structural similarity of two videos (F, H, W, C) with values in [0, 1].

    The SSIM of Wang et al. (2004), computed per frame and per colour channel with an
    ``window x window`` Gaussian window of standard deviation ``sigma`` (11 and 1.5, as in the
    paper; shrunk to the frame for frames smaller than that), over the positions where the
    window fits inside the frame (no padding), with C1 = (0.01 L)^2, C2 = (0.03 L)^2 for the
    data range L = 1; the mean over positions, channels and frames."""
    import torch
    import torch.nn.functional as F

    x = torch.as_tensor(a, dtype=torch.float64).permute(0, 3, 1, 2)  # (F, C, H, W)
    y = torch.as_tensor(b, dtype=torch.float64).permute(0, 3, 1, 2)
    n = min(window, x.shape[-2], x.shape[-1])
    r = torch.arange(n, dtype=torch.float64) - (n - 1) / 2
    g = torch.exp(-(r ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    kernel = (g[:, None] * g[None, :]).expand(x.shape[1], 1, n, n).contiguous()

    def blur(t):
        return F.conv2d(t, kernel, groups=x.shape[1])

    mx, my = blur(x), blur(y)
    vx = blur(x * x) - mx ** 2
    vy = blur(y * y) - my ** 2
    cxy = blur(x * y) - mx * my
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return s.mean().item()


# --- mp4 ----------------------------------------------------------------------------------------


def to_uint8(frames):
    import numpy as np

    return (np.clip(np.asarray(frames, dtype=np.float32), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def write_mp4(path, frames, fps: float, *, audio=None, sample_rate: int | None = None, crf: int = 18) -> None:
    """Write ``frames`` (F, H, W, 3), float in [0, 1] or uint8, as H.264 (yuv420p) mp4, and
    ``audio`` (channels, samples), float in [-1, 1], as AAC beside it when given. yuv420p needs
    even sides: an odd one is padded by repeating the last row or column. The file is written
    whole or not at all (``sparsp.preflight.staged``), also when interrupted."""
    from sparsp.preflight import staged

    path = Path(path)
    with staged(path.parent) as temp:
        _encode_mp4(temp / path.name, frames, fps, audio=audio, sample_rate=sample_rate, crf=crf)


def _encode_mp4(path: Path, frames, fps: float, *, audio, sample_rate: int | None, crf: int) -> None:
    from fractions import Fraction

    import av
    import numpy as np

    video = frames if np.asarray(frames).dtype == np.uint8 else to_uint8(frames)
    video = np.asarray(video)
    ph, pw = video.shape[1] % 2, video.shape[2] % 2
    if ph or pw:
        video = np.pad(video, ((0, 0), (0, ph), (0, pw), (0, 0)), mode="edge")
    with av.open(str(path), mode="w") as box:
        stream = box.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = video.shape[2], video.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        sound = None
        if audio is not None:
            audio = np.asarray(audio, dtype=np.float32)
            audio = audio[None] if audio.ndim == 1 else audio
            sound = box.add_stream("aac", rate=int(sample_rate))
            sound.layout = "mono" if audio.shape[0] == 1 else "stereo"
            audio = audio[:2]
        for frame in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                box.mux(packet)
        for packet in stream.encode():
            box.mux(packet)
        if sound is not None:
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(np.clip(audio, -1, 1)), format="fltp",
                                               layout=sound.layout.name)
            chunk.sample_rate = int(sample_rate)
            for packet in sound.encode(chunk):
                box.mux(packet)
            for packet in sound.encode():
                box.mux(packet)


# --- main ---------------------------------------------------------------------------------------


def _say(rank: int, *lines) -> None:
    if rank == 0:
        for line in lines:
            print(line, flush=True)


def run(recipe: Recipe, argv=None) -> int:
    args = build_parser(recipe).parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return _run(args, recipe)
    except RecipeError as e:
        if rank == 0:
            print(f"{recipe.script}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT; the mp4 is staged
        if rank == 0:
            print(f"{recipe.script}: interrupted", file=sys.stderr, flush=True)
        return 130


def _run(args, recipe: Recipe) -> int:
    check_args(args, recipe)
    warnings.filterwarnings("ignore", module="diffusers|transformers")
    import torch.distributed as dist

    import sparsp

    rank, world, device, dtype = setup(args)
    try:
        from diffusers.utils import logging as dlog

        dlog.set_verbosity_error()  # every rank would repeat the same loading messages
        if rank != 0:
            import transformers

            dlog.disable_progress_bar()
            transformers.utils.logging.disable_progress_bar()
        pipe = load_pipeline(args, recipe, device, dtype)
        ranks = world // args.cfg if world > 1 else (args.emulate_ranks or 1)  # the pieces of a half's sequence
        tokens = check_size(args, recipe, pipe, ranks)
        config = args.config
        # a mesh where --cfg or --ulysses asks for one (sp: the rest of the world), else a flat group
        mesh = sparsp.make_mesh(cfg=args.cfg, ulysses=args.ulysses) if args.cfg * args.ulysses > 1 else None
        try:  # the pipeline's transformers (Wan 2.2's two experts), and with --cfg 2 its call
            sparsp.parallelize(pipe, mesh=mesh, config=config, strategy=args.strategy,
                               emulate_ranks=args.emulate_ranks if world == 1 else None)
        except ValueError as e:
            raise RecipeError(str(e)) from None
        mode = f"{world} ranks" if world > 1 else (f"1 process as {ranks} ranks" if ranks > 1 else "1 process")
        if mesh is not None:
            mode += f" (cfg {args.cfg} x ulysses {args.ulysses} x sp {world // (args.cfg * args.ulysses)})"
        _say(rank, f"{recipe.name}: {args.frames}x{args.height}x{args.width}, {tokens} video tokens per call, "
                   f"{mode} on {device.type} ({str(dtype).removeprefix('torch.')}), strategy {args.strategy}, "
                   f"cdf {args.cdf:g}, block {args.block_size}{describe_schedule(config)}")
        frames, audio, times = generate(args, recipe, pipe, decode=rank == 0, label=f"{args.strategy} cdf {args.cdf:g}",
                                        show=rank == 0)
        _say(rank, f"sparsp: {describe_times(times)}")
        if rank == 0:
            rate = pipe.vocoder.config.output_sampling_rate if audio is not None else None
            write_mp4(args.out, frames, args.fps, audio=audio, sample_rate=rate)
            print(f"wrote {args.out}: {frames.shape[0]} frames of {frames.shape[2]}x{frames.shape[1]} at "
                  f"{args.fps:g} fps{' with audio' if audio is not None else ''}", flush=True)
        if world > 1:
            dist.barrier()  # every rank is done with the group before any leaves it
        sparsp.close_transports()
        if world > 1:
            dist.destroy_process_group()
        if args.compare_dense and rank == 0:
            # The other ranks are done: the dense model runs here alone, whole, as Diffusers has it.
            sparsp.unparallelize(pipe)
            dense, _, dense_times = generate(args, recipe, pipe, decode=True, label="dense", show=True)
            print(f"dense: {describe_times(dense_times)}", flush=True)
            print(f"sparse vs dense ({frames.shape[0]} frames): PSNR {psnr(frames, dense):.2f} dB, "
                  f"SSIM {ssim(frames, dense):.4f}", flush=True)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def start(recipe: Recipe) -> None:
    """The entry point of a recipe script."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run(recipe))
