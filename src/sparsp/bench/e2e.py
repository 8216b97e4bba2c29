"""End-to-end denoising steps of a full-size Diffusers transformer per strategy (torchrun).

    torchrun --nproc-per-node 2 -m sparsp.cli bench e2e --model wan2.1-14b --steps 4 --layers 8
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m sparsp.cli bench e2e --model wan2.1-14b --fabric host

Every rank builds the transformer from its config with random weights directly on its GPU (same
seed everywhere; ``--layers`` truncates the block stack), then runs ``--steps`` flow-matching
Euler steps (one transformer forward + the latent update each) from the same random latents and
precomputed random text embeddings, for each strategy:

* ``1gpu-dense``: the plain Diffusers model on rank 0 (cuDNN attention on GPU), the others idle;
* ``1gpu-sparse``: rank 0 with sparsp's single-process sparse processor (``emulate_ranks=1``);
* ``diffusers-ring`` / ``diffusers-ulysses``: Diffusers' own ``ContextParallelConfig``
  (``_native_cudnn``); a failure is recorded in the row's ``error`` and the run goes on;
* any sparsp strategy (``ring-sparse``, ``ulysses``, ``sparsp``, ...): ``sparsp.parallelize``.

A step's time is the slowest rank's wall time (CUDA events), median over the steps after
``--warmup``; ``attention_ms`` sums the video self-attention modules' time in a step (mean
over the timed steps, slowest rank); ``per_layer_ms`` = step / layers. Random weights give near-uniform attention, so masks
are nearly dense; ``--weights synthetic-structure`` feeds the synthetic video Q/K of
``sparsp.workloads.token_qk`` (the model's RoPE structure) into sparsp's attention instead,
labelled as such (dense rows are timed unchanged: their time does not depend on q/k values).
Results: ``bench/results/e2e-<model>-<machine>-<date>.json`` (kind ``e2e``) + a PNG of step
time per strategy. ``--tiny --device cpu`` is the CPU smoke path (gloo).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .common import init_distributed, median, save_figure, time_ms, write_result

FABRICS = ("nvlink", "host")
ONE_GPU = ("1gpu-dense", "1gpu-sparse")
DIFFUSERS = {"diffusers-ring": "ring_degree", "diffusers-ulysses": "ulysses_degree"}
DEFAULT_STRATEGIES = ("1gpu-dense", "1gpu-sparse", "diffusers-ring", "diffusers-ulysses", "ring-sparse",
                      "ulysses", "sparsp")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with defaults, and the module docstring's examples kept as written."""


def add_arguments(p) -> None:
    from ..integrations.models import PRESETS

    p.add_argument("--model", default="wan2.1-14b", choices=list(PRESETS), help="model preset")
    p.add_argument("--steps", type=int, default=4, help="timed denoising steps per strategy")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--layers", type=int, default=None, help="truncate the block stack (default: all)")
    p.add_argument("--strategy", nargs="+", default=list(DEFAULT_STRATEGIES),
                   help="1gpu-dense, 1gpu-sparse, diffusers-ring, diffusers-ulysses, or any sparsp strategy")
    p.add_argument("--cdf", type=float, default=0.9, help="CDF threshold of the sparse rows")
    p.add_argument("--block-size", type=int, default=128, help="sparsp block size (tokens)")
    p.add_argument("--weights", default="random", choices=["random", "synthetic-structure"],
                   help="random: the model's own q/k; synthetic-structure: synthetic video q/k into sparsp attention")
    p.add_argument("--fabric", default="nvlink", choices=FABRICS,
                   help="nvlink: peer copies; host: NCCL_P2P_DISABLE=1 and sparsp's host transport")
    p.add_argument("--transport", default=None, choices=["auto", "nccl", "ipc", "host"],
                   help="sparsp transport (default: auto on nvlink, host on host)")
    p.add_argument("--kernel", default="auto", choices=["auto", "torch", "flex"], help="sparsp kernel")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run sparsp's plan stage eagerly (SparspConfig(cuda_graphs=False)); rows say "
                        "cuda_graphs: false (write them to another --out to plot them apart)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu (gloo smoke run)")
    p.add_argument("--tiny", action="store_true", help="a tiny config and latent (CPU smoke test of the plumbing)")
    p.add_argument("--latent", type=int, nargs=3, default=None, metavar=("F", "H", "W"),
                   help="latent frames, height, width before patchify (default: the preset's video)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")


class _AttentionTimer:
    """Wall time of the video self-attention modules in one step (CUDA events on GPU)."""

    def __init__(self, modules, device: torch.device) -> None:
        self.device, self.spans, self.handles = device, [], []
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._start))
            self.handles.append(m.register_forward_hook(self._stop))

    def _now(self):
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _start(self, module, args):
        self.spans.append([self._now(), None])

    def _stop(self, module, args, output):
        self.spans[-1][1] = self._now()

    def take_ms(self) -> float:
        """Total of the spans since the last call (synchronises the device)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            total = sum(a.elapsed_time(b) for a, b in self.spans)
        else:
            total = sum(b - a for a, b in self.spans) * 1e3
        self.spans = []
        return total

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _attention_modules(model):
    import fnmatch

    from ..integrations.plans import plan_for

    pats = plan_for(model).self_attention
    return [m for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in pats)]


def _synthetic_qk(model, seed: int):
    """q/k override for the runtime: the synthetic video q/k of this process's attention tokens."""
    from dataclasses import replace

    from ..workloads import token_qk

    def qk(layout, like: torch.Tensor):
        key = ("synthetic-qk", str(like.device), like.dtype)
        if key not in layout.cache:
            geom = replace(layout.geometry, rope=_rope_for(model))
            tokens = layout.attn_tokens
            q, k = token_qk(geom, seed=seed, tokens=tokens, device=like.device, dtype=like.dtype)
            layout.cache[key] = (q.expand(like.shape[0], -1, -1, -1).contiguous(),
                                 k.expand(like.shape[0], -1, -1, -1).contiguous())
        return layout.cache[key]

    return qk


def _rope_for(model):
    from ..geometry import MODELS
    from ..integrations.models import kind_of

    preset = {"hunyuan-video": "hunyuan-video", "wan": "wan2.1-14b", "ltx-video": "ltx-video", "ltx-2": "ltx-2"}
    spec = MODELS[preset[kind_of(model)]]
    rope = spec.rope
    D = model.config.attention_head_dim
    if sum(rope.axes_dim) > D:  # a tiny or custom head dim: split it like the model does, t gets the rest
        hw = 2 * (D // 6)
        rope = type(rope)(axes_dim=(D - 2 * hw, hw, hw), theta=rope.theta, scale=rope.scale)
    return rope


def _step_fn(model, inputs: dict, steps_sigmas, latent_key: str = "hidden_states"):
    """One flow-matching Euler step per call: x ← x + (σ_next − σ)·v(x, σ)."""
    from ..integrations.models import sample_of

    state = {"x": inputs[latent_key].clone(), "i": 0}

    def step():
        i = state["i"] % (len(steps_sigmas) - 1)
        sigma, nxt = steps_sigmas[i], steps_sigmas[i + 1]
        t = torch.full_like(inputs["timestep"], sigma * 1000.0)
        with torch.no_grad():
            v = sample_of(model(**{**inputs, latent_key: state["x"], "timestep": t}, return_dict=False))
        state["x"] = state["x"] + (nxt - sigma) * v.to(state["x"].dtype)
        state["i"] += 1

    return step


def _run_strategy(name, args, rank, world, device, dtype, fabric_transport):
    """Build, set up, time one strategy; the row (without the shared fields)."""
    import sparsp
    from sparsp import SparspConfig

    from ..integrations.diffusers import runtime_of
    from ..integrations.models import PRESETS, TINY, build_transformer, dummy_inputs, num_layers

    preset = PRESETS[args.model]
    cfg = TINY[preset.kind] if args.tiny else preset.config
    active = name not in ONE_GPU or rank == 0  # one-GPU rows: rank 0 works, the others wait
    row = {"layers": None, "transport": None, "cdf": None, "density": None}
    model = rt = None
    step, modules, densities = (lambda: None), [], []
    if active:
        model = build_transformer(preset.kind, config=cfg, layers=args.layers, seed=args.seed, dtype=dtype,
                                  device=device)
        latent = tuple(args.latent) if args.latent else ((3, 8, 8) if args.tiny else preset.latent)
        inputs = dummy_inputs(model, latent, text_tokens=8 if args.tiny else preset.text_tokens,
                              seed=args.seed + 1)
        row["layers"] = num_layers(model)
        # cuDNN is the dense reference (DESIGN.md); it takes bf16/fp16 only, and HunyuanVideo's
        # joint attention carries a key-padding mask, so that model keeps PyTorch's own choice.
        backend = "native"
        if device.type == "cuda" and dtype != torch.float32 and preset.kind != "hunyuan-video":
            backend = "_native_cudnn"
            model.set_attention_backend(backend)
        row["attention_backend"] = backend
        config = SparspConfig(cdf_threshold=args.cdf, block_size=args.block_size, transport=fabric_transport,
                              kernel=args.kernel, cuda_graphs=not args.no_cuda_graphs)
        if name == "1gpu-sparse":
            sparsp.parallelize(model, config=config, strategy="sparsp", emulate_ranks=1)
            row.update(cdf=args.cdf)
        elif name in DIFFUSERS:
            from diffusers import ContextParallelConfig

            row.update(transport="nccl")
            model.enable_parallelism(config=ContextParallelConfig(**{DIFFUSERS[name]: world}))
        elif name != "1gpu-dense":
            sparsp.parallelize(model, config=config, strategy=name)
            row.update(transport=fabric_transport, cdf=args.cdf)
        rt = runtime_of(model)
        if rt is not None and args.weights == "synthetic-structure":
            rt.qk_override = _synthetic_qk(model, args.seed)
            row["qk"] = "synthetic"
        if rt is not None and name == "1gpu-sparse":  # the mask density every sparse row shares
            rt.on_mask = lambda mask: densities.append(mask.float().mean().item())
        sigmas = torch.linspace(1.0, 0.0, args.warmup + args.steps + 1).tolist()
        step = _step_fn(model, inputs, sigmas)
        modules = _attention_modules(model)
    layers = torch.tensor([row["layers"] or 0], device=device)
    dist.all_reduce(layers, op=dist.ReduceOp.MAX)
    row["layers"] = int(layers.item())
    timer = _AttentionTimer(modules, device)
    for _ in range(args.warmup):  # here, not in time_ms, so the attention spans exclude them
        step()
    timer.take_ms()
    times = time_ms(step, warmup=0, iters=args.steps, device=device)
    attn = torch.tensor([timer.take_ms() / args.steps], dtype=torch.float64, device=device)
    dist.all_reduce(attn, op=dist.ReduceOp.MAX)
    timer.remove()
    density = torch.tensor([-1.0], dtype=torch.float64, device=device)
    if densities:
        density[0] = sum(densities) / len(densities)
    dist.all_reduce(density, op=dist.ReduceOp.MAX)
    row["density"] = density.item() if density.item() >= 0 else None
    step_ms = median(times)
    row.update(step_ms=step_ms, per_layer_ms=step_ms / row["layers"], attention_ms=attn.item(),
               step_ms_all=times)
    del model, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(args) -> int:
    from rich.console import Console
    from rich.table import Table

    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    if args.fabric == "host" and os.environ.get("NCCL_P2P_DISABLE") != "1":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # before NCCL creates its communicators
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rank, world, device = init_distributed(None if want_cuda else "gloo")
    if not want_cuda:
        device = torch.device("cpu")
    console = Console() if rank == 0 else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    transport = args.transport or ("host" if args.fabric == "host" and device.type == "cuda" else "auto")
    rows = []
    for name in args.strategy:
        base = {"model": args.model, "ranks": 1 if name in ONE_GPU else world, "fabric": args.fabric,
                "strategy": name, "weights": args.weights, "steps": args.steps, "device": device.type,
                "cuda_graphs": not args.no_cuda_graphs}
        error = None
        try:
            row = {**base, **_run_strategy(name, args, rank, world, device, dtype, transport)}
        except Exception as e:  # a baseline that cannot run here is a result, not a crash
            error = f"{type(e).__name__}: {e}"[:500]
        errors = [None] * world
        dist.all_gather_object(errors, error)  # every rank records the same outcome
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            row = {**base, "transport": None, "cdf": None, "density": None, "layers": args.layers,
                   "step_ms": None, "per_layer_ms": None, "attention_ms": None, "error": error}
        rows.append(row)
        if console:
            console.print(f"{name}: " + (f"{row['step_ms']:.1f} ms/step" if row["step_ms"] is not None
                                         else row["error"]))
    densities = {r["cdf"]: r["density"] for r in rows if r["density"] is not None}
    for r in rows:  # every sparse row of a cdf has the masks 1gpu-sparse measured
        if r["cdf"] is not None and r["density"] is None:
            r["density"] = densities.get(r["cdf"])
    if rank != 0:
        dist.barrier()
        _shutdown()
        return 0
    path = write_result("e2e", args.model, rows, args.out)
    table = Table(title=f"e2e {args.model}, {world} ranks, {args.fabric}, weights={args.weights}")
    for col in ("strategy", "ranks", "transport", "density", "step ms", "ms/layer", "attention ms"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        ok = r["step_ms"] is not None
        table.add_row(r["strategy"], str(r["ranks"]), str(r["transport"] or "-"),
                      "-" if r["density"] is None else f"{100 * r['density']:.1f}%",
                      f"{r['step_ms']:.1f}" if ok else "failed", f"{r['per_layer_ms']:.2f}" if ok else "-",
                      f"{r['attention_ms']:.1f}" if ok else "-")
    console.print(table)
    outputs = [path] if args.no_plot else [path, plot(path)]
    console.print("wrote " + ", ".join(map(str, outputs)))
    dist.barrier()
    _shutdown()
    return 0


def _shutdown() -> None:
    """Release sparsp's transports (IPC handles, shared memory) and the process group."""
    from ..strategies import close_transports

    close_transports()
    dist.destroy_process_group()


def plot(path: Path) -> Path:
    """Step time per strategy (one bar group per fabric and weights), PNG next to the JSON."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(path).read_text())
    rows = [r for r in doc["rows"] if r.get("step_ms") is not None]
    groups = sorted({(r["fabric"], r["weights"]) for r in rows})
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names) * max(1, len(groups))), 4))
    width = 0.8 / max(1, len(groups))
    for i, g in enumerate(groups):
        vals = {r["strategy"]: r["step_ms"] for r in rows if (r["fabric"], r["weights"]) == g}
        xs = [j + i * width for j, n in enumerate(names) if n in vals]
        ax.bar(xs, [vals[n] for n in names if n in vals], width, label=f"{g[0]}, {g[1]} weights")
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(names))], names, rotation=20)
    ax.set_ylabel("ms per denoising step (median)")
    models = sorted({r["model"] for r in rows})
    ax.set_title(f"e2e step time: {', '.join(models)} ({doc['machine']})")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
