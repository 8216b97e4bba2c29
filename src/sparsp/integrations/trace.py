"""``sparsp trace``: record the block masks of a real transformer into a mask-trace file.

Users with weights run their transformer once with hooks — the single-process sparse processor
of ``sparsp.parallelize`` (one process, contiguous placement, so blocks are in original order)
records the block mask of every video self-attention call — and ``sparsp analyze --trace``
reads the file (``sparsp.traces``: bool [layers, heads, nQ, nK], original block order, batch
element 0). By default the model runs with the sparse attention it would run under sparsp at
that threshold, so later layers see what they would see deployed; ``dense_attention=True``
records the masks of the dense model instead.

    sparsp trace --model wan2.1-1.3b --pretrained /models/Wan2.1-T2V-1.3B-Diffusers \\
                 --embeds prompt.pt --cdf 0.9 --out wan-trace.pt
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from ..config import SparspConfig
from .diffusers import parallelize, runtime_of, unparallelize

try:
    from ..traces import save_trace
except ImportError:  # trace I/O before it moved out of workloads
    from ..workloads import save_trace

log = logging.getLogger("sparsp")


def record_trace(transformer, inputs: dict, path: str | Path, *, cdf_threshold: float = 0.9,
                 sim_threshold: float | None = None, block_size: int = 128, dense_attention: bool = False,
                 source: str = "") -> Path:
    """Run ``transformer(**inputs)`` once and write the block masks of its video self-attention
    calls (in call order = layer order) to ``path``. Returns the path."""
    if runtime_of(transformer) is not None:
        raise ValueError("record_trace needs an unparallelized transformer (call sparsp.unparallelize first)")
    config = SparspConfig(cdf_threshold=cdf_threshold, sim_threshold=sim_threshold, block_size=block_size)
    parallelize(transformer, config=config, strategy="ring" if dense_attention else "sparsp",
                placement="contiguous", emulate_ranks=1)
    rt = runtime_of(transformer)
    masks = []
    rt.on_mask = lambda mask: masks.append(mask.cpu())
    try:
        with torch.no_grad():
            transformer(**inputs)
        geom = rt.current.geometry
    finally:
        unparallelize(transformer)
    if not masks:
        raise ValueError(f"{type(transformer).__name__} made no video self-attention call")
    stacked = torch.stack(masks)  # [layers, H, N, N]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_trace(path, stacked, geom, cdf_threshold=cdf_threshold, sim_threshold=sim_threshold,
               source=source or f"sparsp trace of {type(transformer).__name__}")
    log.info("sparsp trace: %d layers of %s, density %.3f → %s", len(masks), geom.describe(),
             stacked.float().mean().item(), path)
    return path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with defaults, and the module docstring's examples kept as written."""


def add_arguments(p) -> None:
    from .models import PRESETS

    p.add_argument("--model", default="wan2.1-1.3b", choices=list(PRESETS),
                   help="model preset: its Diffusers class, config and default latent size")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--pretrained", default=None,
                     help="a Diffusers model directory or hub id to load the transformer from (with weights)")
    src.add_argument("--tiny", action="store_true",
                     help="a tiny random model instead of the full-size config (smoke test)")
    p.add_argument("--subfolder", default="transformer", help="subfolder of --pretrained holding the transformer")
    p.add_argument("--frames", type=int, default=None, help="latent frames; None: the preset's video")
    p.add_argument("--height", type=int, default=None,
                   help="latent height before the model's patchify; None: the preset's")
    p.add_argument("--width", type=int, default=None,
                   help="latent width before the model's patchify; None: the preset's")
    p.add_argument("--text-tokens", type=int, default=None, help="random text embedding length; None: the preset's")
    p.add_argument("--embeds", type=Path, default=None,
                   help="a torch file with a dict of forward arguments that replace the random ones "
                        "(e.g. encoder_hidden_states, encoder_attention_mask, pooled_projections)")
    p.add_argument("--timestep", type=float, default=999.0, help="denoising timestep of the traced call")
    p.add_argument("--cdf", type=float, default=0.9, help="CDF threshold of the recorded masks")
    p.add_argument("--sim", type=float, default=None, help="similarity threshold; None: off")
    p.add_argument("--block-size", type=int, default=128, help="block size in tokens")
    p.add_argument("--dense-attention", action="store_true",
                   help="run dense attention while recording, not the sparse attention at --cdf")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="model dtype")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and inputs")
    p.add_argument("--out", type=Path, default=Path("results/trace.pt"), help="trace file to write")


def main(args) -> int:
    from .models import PRESETS, TINY, build_transformer, dummy_inputs, model_class

    preset = PRESETS[args.model]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.pretrained:
        model = model_class(preset.kind).from_pretrained(args.pretrained, subfolder=args.subfolder or None,
                                                        torch_dtype=dtype).to(device).eval()
        source = f"{args.pretrained} ({preset.kind})"
    else:
        cfg = TINY[preset.kind] if args.tiny else preset.config
        model = build_transformer(preset.kind, config=cfg, seed=args.seed, dtype=dtype, device=device)
        source = f"random weights, {'tiny' if args.tiny else 'full-size'} {args.model} config (seed {args.seed})"
    default = (3, 8, 8) if args.tiny else preset.latent
    latent = tuple(d if v is None else v for d, v in zip(default, (args.frames, args.height, args.width)))
    text = args.text_tokens or (8 if args.tiny else preset.text_tokens)
    inputs = dummy_inputs(model, latent, text_tokens=text, seed=args.seed + 1, timestep=args.timestep)
    if args.embeds is not None:
        extra = torch.load(args.embeds, map_location=device, weights_only=True)
        if not isinstance(extra, dict):
            raise ValueError(f"--embeds {args.embeds}: expected a dict of forward arguments, "
                             f"got {type(extra).__name__}")
        inputs.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extra.items()})
    path = record_trace(model, inputs, args.out, cdf_threshold=args.cdf, sim_threshold=args.sim,
                        block_size=args.block_size, dense_attention=args.dense_attention, source=source)
    print(f"wrote {path}: read it with `sparsp analyze --trace {path} --ranks G`")
    return 0
