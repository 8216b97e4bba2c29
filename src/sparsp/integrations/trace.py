"""``sparsp trace``: record the block masks of a real transformer into a mask-trace file.

Users with weights run their transformer once with hooks — the single-process sparse processor
of ``sparsp.parallelize`` (one process, contiguous placement, so blocks are in original order)
records the block mask of every video self-attention call — and ``sparsp analyze --trace``
reads the file (``sparsp.workloads.traces``: bool [layers, heads, nQ, nK], original block order, batch
element 0). By default the model runs with the sparse attention it would run under sparsp at
that threshold, so later layers see what they would see deployed; ``dense_attention=True``
records the masks of the dense model instead.

    sparsp trace --model wan2.1-1.3b --pretrained /models/Wan2.1-T2V-1.3B-Diffusers \\
                 --embeds prompt.pt --cdf 0.9 --out wan-trace.pt
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

from ..names import TRACE_MODELS
from ..preflight import check_out_file, require, staged

log = logging.getLogger("sparsp")

BLOCK_SIZE = 128
"""``--block-size`` of a full-size model (the sparse kernels' block)."""
TINY_BLOCK_SIZE = 8
"""``--block-size`` with ``--tiny``: the tiny latent (3x8x8) patchifies to 48 tokens on Wan and
HunyuanVideo (192 on LTX), one block at 128 tokens and six at 8, so ``analyze --trace
--ranks 2`` (up to 6) works on the trace as written."""
TINY_LATENT = (3, 8, 8)
TINY_TEXT_TOKENS = 8


def record_trace(transformer, inputs: dict, path: str | Path, *, cdf_threshold: float = 0.9,
                 sim_threshold: float | None = None, block_size: int = 128, dense_attention: bool = False,
                 source: str = "") -> Path:
    """Run ``transformer(**inputs)`` once and write the block masks of its video self-attention
    calls (in call order = layer order) to ``path``. Returns the path."""
    import torch

    from ..config import SparspConfig
    from ..strategies.registry import strategies_where
    from ..workloads.traces import save_trace
    from .diffusers import parallelize, runtime_of, unparallelize

    if runtime_of(transformer) is not None:
        raise ValueError("record_trace needs an unparallelized transformer (call sparsp.unparallelize first)")
    config = SparspConfig(cdf_threshold=cdf_threshold, sim_threshold=sim_threshold, block_size=block_size)
    # the dense baseline or the primary strategy, on one emulated rank
    strategy = strategies_where(**({"baseline": True} if dense_attention else {"primary": True}))[0]
    parallelize(transformer, config=config, strategy=strategy,
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
    with staged(path.parent) as temp:  # the whole file or none, also when interrupted
        save_trace(temp / path.name, stacked, geom, cdf_threshold=cdf_threshold, sim_threshold=sim_threshold,
                   source=source or f"sparsp trace of {type(transformer).__name__}")
    log.info("sparsp trace: %d layers of %s, density %.3f → %s", len(masks), geom.describe(),
             stacked.float().mean().item(), path)
    return path


def add_arguments(p) -> None:
    p.add_argument("--model", default="wan2.1-1.3b", choices=TRACE_MODELS,
                   help="model preset: its Diffusers class, config and default latent size")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--pretrained", default=None,
                     help="a Diffusers model directory or hub id to load the transformer from (with weights)")
    src.add_argument("--tiny", action="store_true",
                     help="a tiny random model instead of the full-size config (smoke test): latent "
                          f"{'x'.join(map(str, TINY_LATENT))}, {TINY_TEXT_TOKENS} text tokens and "
                          f"--block-size {TINY_BLOCK_SIZE} unless given, so the trace has enough blocks "
                          "for analyze --trace --ranks 2 (up to 6)")
    p.add_argument("--subfolder", default=None,
                   help="subfolder of --pretrained holding the transformer (default: transformer; "
                        "only with --pretrained)")
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
    p.add_argument("--cdf", type=float, default=0.9, help="CDF threshold of the recorded masks, in [0, 1]")
    p.add_argument("--sim", type=float, default=None, help="similarity threshold in [0, 1]; None: off")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"block size in tokens (default: {BLOCK_SIZE}; {TINY_BLOCK_SIZE} with --tiny)")
    p.add_argument("--dense-attention", action="store_true",
                   help="run dense attention while recording, not the sparse attention at --cdf")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="model dtype")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and inputs")
    p.add_argument("--out", type=Path, default=Path("results/trace.pt"), help="trace file to write")


def _error(message) -> int:
    """A bad argument, the way argparse reports one: one line on stderr, exit status 2."""
    print(f"sparsp trace: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def check_arguments(args) -> None:
    """Every check that needs no model: ``ValueError`` naming the option, the value and the rule."""
    if not (math.isfinite(args.cdf) and 0.0 <= args.cdf <= 1.0):
        raise ValueError(f"--cdf must lie in [0, 1], got {args.cdf}")
    if args.sim is not None and not (math.isfinite(args.sim) and 0.0 <= args.sim <= 1.0):
        raise ValueError(f"--sim must lie in [0, 1], got {args.sim}")
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be a positive number of tokens, got {args.block_size}")
    for name in ("frames", "height", "width", "text_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not math.isfinite(args.timestep):
        raise ValueError(f"--timestep must be a finite number, got {args.timestep}")
    if args.subfolder is not None and not args.pretrained:
        raise ValueError("--subfolder applies only with --pretrained (the directory it names a subfolder of)")
    if args.pretrained and Path(args.pretrained).is_file():
        raise ValueError(f"--pretrained {args.pretrained}: is a file; give a Diffusers model directory or hub id")
    check_out_file(args.out, what="the trace file to write")
    device = args.device
    if device != "auto" and device != "cpu" and not (device == "cuda" or device.startswith("cuda:")
                                                    and device[5:].isdigit()):
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")


def read_embeds(path: Path, device) -> dict:
    """The ``--embeds`` file: a dict of forward arguments; ``ValueError`` naming the file."""
    from ..workloads.traces import TRACE_FORMAT, read_torch_file

    try:
        extra = read_torch_file(path, "forward-arguments file", map_location=device)
    except FileNotFoundError:
        raise ValueError(f"--embeds {path}: no such file") from None
    except ValueError as e:
        raise ValueError(f"--embeds {e}") from None
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise ValueError(f"--embeds {path}: expected a dict of forward arguments (names to tensors), "
                         f"got {type(extra).__name__}")
    if extra.get("format") == TRACE_FORMAT:
        raise ValueError(f"--embeds {path}: is a sparsp trace, not a dict of forward arguments")
    return extra


def _load_pretrained(args, preset, dtype, device):
    from .models import model_class

    cls = model_class(preset.kind)
    subfolder = "transformer" if args.subfolder is None else args.subfolder
    try:
        model = cls.from_pretrained(args.pretrained, subfolder=subfolder or None, torch_dtype=dtype)
    except Exception as e:  # noqa: BLE001  (Diffusers and huggingface_hub raise many kinds)
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"--pretrained {args.pretrained}: cannot load a {cls.__name__} from it "
                         f"(subfolder {subfolder!r}): {reason}") from None
    return model.to(device).eval()


def main(args) -> int:
    try:
        check_arguments(args)
        require("diffusers", "diffusers", purpose="sparsp trace")
    except ValueError as e:
        return _error(e)
    import inspect

    import torch

    from .models import PRESETS, TINY, build_transformer, dummy_inputs

    preset = PRESETS[args.model]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device is available here; use cpu")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        extra = read_embeds(args.embeds, device) if args.embeds is not None else {}
        if args.pretrained:
            model = _load_pretrained(args, preset, dtype, device)
            source = f"{args.pretrained} ({preset.kind})"
        else:
            cfg = TINY[preset.kind] if args.tiny else preset.config
            model = build_transformer(preset.kind, config=cfg, seed=args.seed, dtype=dtype, device=device)
            source = f"random weights, {'tiny' if args.tiny else 'full-size'} {args.model} config (seed {args.seed})"
        if args.text_tokens is not None and "encoder_hidden_states" in extra:
            raise ValueError(f"--text-tokens cannot apply: --embeds {args.embeds} gives encoder_hidden_states, "
                             f"whose length is the text length")
        if extra:
            accepted = inspect.signature(model.forward).parameters
            unknown = sorted(set(extra) - set(accepted))
            if unknown and not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values()):
                raise ValueError(f"--embeds {args.embeds}: {type(model).__name__}.forward takes no "
                                 f"{', '.join(unknown)}")
        default = TINY_LATENT if args.tiny else preset.latent
        latent = tuple(d if v is None else v for d, v in zip(default, (args.frames, args.height, args.width)))
        text = args.text_tokens or (TINY_TEXT_TOKENS if args.tiny else preset.text_tokens)
        block_size = args.block_size or (TINY_BLOCK_SIZE if args.tiny else BLOCK_SIZE)
        inputs = dummy_inputs(model, latent, text_tokens=text, seed=args.seed + 1, timestep=args.timestep)
        inputs.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extra.items()})
        try:
            path = record_trace(model, inputs, args.out, cdf_threshold=args.cdf, sim_threshold=args.sim,
                                block_size=block_size, dense_attention=args.dense_attention, source=source)
        except (RuntimeError, TypeError) as e:
            if not extra:
                raise
            raise ValueError(f"--embeds {args.embeds}: the model's forward failed on these arguments: "
                             f"{' '.join(str(e).split())[:200]}") from None
    except (ValueError, OSError) as e:
        return _error(e)
    print(f"wrote {path}: read it with `sparsp analyze --trace {path} --ranks G`")
    return 0
