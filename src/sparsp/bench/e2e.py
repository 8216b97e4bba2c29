"""End-to-end denoising steps of a full-size Diffusers transformer per strategy (torchrun).

    torchrun --nproc-per-node 2 -m sparsp.cli bench e2e --model wan2.1-14b --steps 4 --layers 8
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 -m sparsp.cli bench e2e --model wan2.1-14b --fabric host

Every rank builds the transformer from its config with random weights directly on its GPU (same
seed everywhere; ``--layers`` truncates the block stack), then runs ``--steps`` flow-matching
Euler steps (one transformer forward + the latent update each) from the same random latents and
precomputed random text embeddings, for each strategy:

* ``1gpu-dense``: the plain Diffusers model on rank 0, the others idle;
* ``1gpu-sparse``: rank 0 alone, sparsp's primary strategy on a group of one (``sp_attention``:
  per call the block-sparse or the dense kernel, whichever its mask pays for,
  ``strategies/one_gpu.py``); the row's ``attention_kernels`` and ``dense_layers`` say which ran;
* ``diffusers-ring`` / ``diffusers-ulysses``: Diffusers' own ``ContextParallelConfig``; a
  failure is recorded in the row's ``error`` and the run goes on;
* any sparsp strategy (``ring-sparse``, ``ulysses``, ``sparsp``, ...): ``sparsp.parallelize``.

The dense rows (``1gpu-dense``, ``diffusers-*``) run on the fastest Diffusers attention
backend installed for the model and its mask, chosen by measurement (``bench/backends.py``;
``1gpu-dense`` also tries ``sparsp-dense``, sparsp's processors with the fastest dense kernel):
the row's ``backends_tried`` holds every backend tried with its step time, attention time and
dense attention TFLOP/s per GPU, or its error; ``attention_backend`` is the one chosen and
``attention_tflops`` its rate in the timed steps. A text mask that marks every token valid is
not passed (HunyuanVideo's dense rows: its blocks get no mask), so cuDNN and flash can apply.

By default (``--strategy`` not given) the rows are ``1gpu-dense``, ``1gpu-sparse``, both
``diffusers-*`` rows, ``ring-sparse``, ``ulysses`` and ``sparsp``.

A step's time is the slowest rank's wall time (CUDA events), median over the steps after
``--warmup``; ``attention_ms`` sums the video self-attention modules' time in a step (mean
over the timed steps, slowest rank); ``per_layer_ms`` = step / layers. Random weights give
near-uniform attention, so masks are nearly dense; ``--weights synthetic-structure`` feeds the
synthetic video Q/K of ``sparsp.workloads.token_qk`` (the model's RoPE structure) into sparsp's
attention instead, labelled as such (dense rows are timed unchanged: their time does not depend
on q/k values).
Results: ``bench/results/e2e-<model>-<machine>-<date>.json`` (kind ``e2e``) + a PNG of step
time per strategy. ``--tiny --device cpu`` is the CPU smoke path (gloo; under ``torchrun
--nproc-per-node 2`` for the parallel rows): a tiny config and latent, ``--block-size 8`` unless
given (the tiny models have 48 to 192 tokens), fabric ``gloo`` and, unless ``--out`` is given,
``results/bench`` instead of the tracked ``bench/results``. ``--config KEY=VALUE``
(repeatable) sets a ``SparspConfig`` field of the sparsp rows (e.g. ``cuda_graphs=off``); the
row's ``config`` holds what was set.

``--density-profile FILE`` (``--step S``, ``--calibration FILE``) gives each layer of the model
its own heads, calibrated to that layer of a published per-head density profile
(``sparsp.workloads.calibration``; fitted before the process group starts unless ``--calibration`` holds
them): the whole model's step on a real model's spread of densities. The result file carries
the profile and step in its name (``e2e-<model>-<profile>-step<S|mean>-…``) and
``"workload": "density-profile"``.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..timing import times_ms
from .args import (CPU_FABRIC, E2E_BLOCK_SIZE, E2E_OUT, E2E_RESERVED, E2E_TINY_BLOCK_SIZE, E2E_TINY_OUT,
                   check_names, refuse)
from .backends import CANDIDATES, BackendFailed, attention_flops, fastest, pick_fastest, try_each
from .common import (config_overrides, init_distributed, median, profile_name, save_figure, time_ms,
                     write_result)

RESERVED = E2E_RESERVED
ONE_GPU = ("1gpu-dense", "1gpu-sparse")
PROCESSOR_DENSE = "sparsp-dense"
"""A dense candidate of ``1gpu-dense`` beside Diffusers' backends: sparsp's processors running
the fastest dense kernel on the GPU, FlashAttention-4's dense forward where it runs
(``_sparsp_dense``)."""
DIFFUSERS = {"diffusers-ring": "ring_degree", "diffusers-ulysses": "ulysses_degree"}


def default_strategies() -> list[str]:
    """The rows run when ``--strategy`` is not given: the one-GPU rows, Diffusers' own context
    parallelism (the dense baselines), and every registered block-sparse strategy that moves
    no relayed bytes (a relay ring's whole model step adds nothing the attention bench lacks)."""
    from ..strategies.registry import strategies_where, strategy_spec

    sparse = [s for s in strategies_where(sparse=True) if strategy_spec(s).byte_rule != "relay"]
    return [*ONE_GPU, *DIFFUSERS, *sparse]




class _AttentionTimer:
    """Wall time of the video self-attention modules in one step (CUDA events on GPU), and the
    dense FLOPs of their calls (``flops``, since the last ``take_ms``)."""

    def __init__(self, modules, device: torch.device) -> None:
        self.device, self.spans, self.handles, self.flops = device, [], [], 0.0
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._start, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._stop))

    def _now(self):
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _start(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:  # joint attention: the text joins the video
            text = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
            tokens = hidden.shape[1] + (text.shape[1] if isinstance(text, torch.Tensor) else 0)
            self.flops += attention_flops(hidden.shape[0], tokens, getattr(module, "inner_dim", hidden.shape[-1]))
        self.spans.append([self._now(), None])

    def _stop(self, module, args, output):
        self.spans[-1][1] = self._now()

    def take_ms(self) -> float:
        """Total of the spans since the last call (synchronises the device); a span a failed
        call left open (a backend that could not run) counts nothing."""
        spans = [(a, b) for a, b in self.spans if b is not None]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            total = sum(a.elapsed_time(b) for a, b in spans)
        else:
            total = sum(b - a for a, b in spans) * 1e3
        self.spans, self.flops = [], 0.0
        return total

    def take(self) -> tuple[float, float]:
        """(ms, dense FLOPs) of the attention calls since the last take."""
        flops = self.flops
        return self.take_ms(), flops

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _attention_modules(model):
    import fnmatch

    from ..integrations.plans import plan_for

    pats = plan_for(model).self_attention
    return [m for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in pats)]


def _synthetic_qk(model, seed: int, calibration=None):
    """q/k override for the runtime: the synthetic video q/k of this process's attention tokens;
    with a ``calibration`` (``sparsp.workloads.calibration``), each layer's own calibrated heads."""
    from dataclasses import replace

    from ..workloads.synthetic import token_qk

    heads = calibration.head_params() if calibration is not None else None

    def qk(layout, like: torch.Tensor, layer: int | None = None):
        at = 0 if heads is None else layer  # uncalibrated: every layer draws the same heads
        if heads is not None and (at is None or not 0 <= at < len(heads)):
            raise ValueError(f"the calibration has {len(heads)} layers; attention call of layer {layer}")
        key = ("synthetic-qk", str(like.device), like.dtype, at)
        if key not in layout.cache:
            geom = replace(layout.geometry, rope=_rope_for(model))
            extra = {} if heads is None else {"heads": heads[at], "mix": calibration.mix, "layer": at}
            q, k = token_qk(geom, seed=seed if heads is None else calibration.seed, tokens=layout.attn_tokens,
                            device=like.device, dtype=like.dtype, **extra)
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


def _run_strategy(name, args, rank, world, device, dtype, fabric_transport, one, calibration=None, other=None):
    """Build, set up, time one strategy; the row (without the shared fields). ``one``: the
    process group of rank 0 alone (the one-GPU rows run ``sp_attention`` on it). ``other``: the
    Diffusers backend of the attention sparsp does not replace (cross-attention, text): the
    one ``1gpu-dense`` found fastest when it ran before, else cuDNN where it applies."""
    import sparsp
    from sparsp import SparspConfig

    from ..integrations.diffusers import runtime_of
    from ..integrations.models import PRESETS, TINY, build_transformer, dummy_inputs, num_layers
    from ..strategies import one_gpu
    from ..strategies.registry import strategies_where

    preset = PRESETS[args.model]
    cfg = TINY[preset.kind] if args.tiny else preset.config
    active = name not in ONE_GPU or rank == 0  # one-GPU rows: rank 0 works, the others wait
    row = {"layers": None, "transport": None, "cdf": None, "density": None}
    model = rt = None
    step, modules, choices, warmup = (lambda: None), [], [], args.warmup
    if active:
        model = build_transformer(preset.kind, config=cfg, layers=args.layers, seed=args.seed, dtype=dtype,
                                  device=device)
        latent = tuple(args.latent) if args.latent else ((3, 8, 8) if args.tiny else preset.latent)
        inputs = dummy_inputs(model, latent, text_tokens=8 if args.tiny else preset.text_tokens,
                              seed=args.seed + 1)
        row["layers"] = num_layers(model)
        dense = name == "1gpu-dense" or name in DIFFUSERS
        _drop_all_valid_text_masks(model, inputs, preset.kind, dense)
        # The sparse rows' other attention (cross-attention, text): ``other`` (the dense row's fastest
        # Diffusers backend), else cuDNN where it applies (bf16/fp16, no key-padding mask); the
        # dense rows pick theirs by measurement below.
        backend = other or "native"
        if other is None and device.type == "cuda" and dtype != torch.float32 and preset.kind != "hunyuan-video":
            backend = "_native_cudnn"
        if backend != "native":
            model.set_attention_backend(backend)
        row["attention_backend"] = backend
        config = SparspConfig(cdf_threshold=args.cdf, block_size=args.block_size, transport=fabric_transport,
                              kernel=args.kernel, **dict(args.config))
        if name == "1gpu-sparse":  # the primary strategy on a group of one, as ``bench attention`` runs it
            sparsp.parallelize(model, group=one, config=_one_gpu_config(config),
                               strategy=strategies_where(primary=True)[0])
            row.update(cdf=args.cdf)
            warmup = max(warmup, one_gpu.MEASURE_AT)  # the kernels' rates measured before the timed steps
        elif name in DIFFUSERS:
            from diffusers import ContextParallelConfig

            row.update(transport="nccl")
            model.enable_parallelism(config=ContextParallelConfig(**{DIFFUSERS[name]: world}))
        elif name != "1gpu-dense":
            sparsp.parallelize(model, config=config, strategy=name)
            row.update(transport=fabric_transport, cdf=args.cdf)
        rt = runtime_of(model)
        if rt is not None and args.weights == "synthetic-structure":
            rt.qk_override = _synthetic_qk(model, args.seed, calibration)
            row["qk"] = "synthetic" if calibration is None else "calibrated"
        sigmas = torch.linspace(1.0, 0.0, warmup + args.steps + 1).tolist()
        step = _step_fn(model, inputs, sigmas)
        modules = _attention_modules(model)
        if name == "1gpu-sparse":  # what each attention call chose (``strategies/one_gpu.py``)
            for i, m in enumerate(modules):
                m.register_forward_hook(lambda *_, i=i: choices.append((i, one_gpu.last_choice())))
    layers = torch.tensor([row["layers"] or 0], device=device)
    dist.all_reduce(layers, op=dist.ReduceOp.MAX)
    row["layers"] = int(layers.item())
    timer = _AttentionTimer(modules, device)
    if name in DIFFUSERS or (name == "1gpu-dense" and active):
        # What a Diffusers user runs at best: the fastest backend on this machine, measured
        gang, tries = (world if name in DIFFUSERS else 1), min(args.steps, 2)
        chosen, tried = pick_fastest(CANDIDATES, lambda b: _try_backend(model, b, step, timer, device, gang, tries))
        row["other_backend"] = other = chosen
        if name == "1gpu-dense":  # sparsp's processors with the dense kernel, the rest on Diffusers' best
            chosen, tried = fastest(tried + try_each((PROCESSOR_DENSE,), lambda b: _try_backend(
                model, b, step, timer, device, gang, tries, one=one, args=args, other=other)))
        row["attention_backend"], row["backends_tried"] = chosen, tried
        _use_backend(model, chosen, row["other_backend"], one, args)
    for _ in range(warmup):  # here, not in time_ms, so the attention spans exclude them
        step()
    timer.take_ms()
    choices.clear()
    times = time_ms(step, warmup=0, iters=args.steps, device=device)
    attn_ms, flops = timer.take()
    attn = torch.tensor([attn_ms / args.steps], dtype=torch.float64, device=device)
    dist.all_reduce(attn, op=dist.ReduceOp.MAX)
    timer.remove()
    if name in ONE_GPU[:1] or name in DIFFUSERS:  # dense: the rate its attention ran at, per GPU
        tflops = torch.tensor([flops / args.steps * (world if name in DIFFUSERS else 1)], dtype=torch.float64,
                              device=device)
        dist.all_reduce(tflops, op=dist.ReduceOp.MAX)
        row["attention_tflops"] = _tflops(tflops.item(), attn.item())
    density = torch.tensor([-1.0], dtype=torch.float64, device=device)
    if choices:
        density[0] = sum(c.kept for _, c in choices) / len(choices)
        row["dense_layers"] = sorted({i for i, c in choices if c.dense})
        row["attention_kernels"] = {k: sum(c.kernel == k for _, c in choices) // args.steps
                                    for k in sorted({c.kernel for _, c in choices})}
    dist.all_reduce(density, op=dist.ReduceOp.MAX)
    row["density"] = density.item() if density.item() >= 0 else None
    step_ms = median(times)
    row.update(step_ms=step_ms, per_layer_ms=step_ms / row["layers"], attention_ms=attn.item(),
               step_ms_all=times, warmup=warmup)
    del model, step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _one_gpu_config(config):
    """The one-GPU rows' config: nothing moves on a group of one; its metadata all-gather goes
    through the group's own backend (``nccl``: torch.distributed, as ``bench attention``'s
    one-GPU row)."""
    from dataclasses import replace

    return replace(config, transport="nccl")


def _sparsp_dense(model, one, args, other: str) -> None:
    """``PROCESSOR_DENSE``: sparsp's processors on the group of one with the dense baseline
    strategy, so the video self-attention runs the fastest dense kernel ``strategies/one_gpu.py``
    measures (FA4's dense forward among them); the model's other attention on ``other``, the
    fastest Diffusers backend."""
    import sparsp

    from ..strategies.registry import strategies_where

    model.set_attention_backend(other)
    config = sparsp.SparspConfig(block_size=args.block_size, kernel=args.kernel, **dict(args.config))
    sparsp.parallelize(model, group=one, config=_one_gpu_config(config), strategy=strategies_where(baseline=True)[0])


def _use_backend(model, backend: str, other: str, one, args) -> None:
    """Run ``model`` on ``backend`` (the fastest tried) from now on; ``PROCESSOR_DENSE`` with its
    other attention on ``other``."""
    if backend == PROCESSOR_DENSE:
        _sparsp_dense(model, one, args, other)
    else:
        model.set_attention_backend(backend)


def _tflops(flops: float, ms: float) -> float | None:
    return round(flops / (ms * 1e-3) / 1e12, 4) if ms > 0 and flops > 0 else None


def _try_backend(model, backend: str, step, timer, device, gang: int, iters: int, *, one=None, args=None,
                 other: str | None = None) -> dict:
    """Step time, attention time and dense attention TFLOP/s (per GPU) of ``model`` on
    ``backend``: untimed steps first (one; enough for ``PROCESSOR_DENSE`` to measure its kernels),
    then ``iters`` timed ones. ``gang`` > 1: every rank of the process group runs it together
    (Diffusers' context parallelism), and a failure on any rank is raised on all of them, so
    they all go on to the next backend together. ``PROCESSOR_DENSE`` is undone after its try."""
    from ..integrations.diffusers import unparallelize
    from ..strategies import one_gpu

    def agreed(error):
        if gang > 1:
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise BackendFailed(error)

    def attempt(fn):
        try:
            fn()
        except Exception as e:  # reported by ``agreed``, on every rank
            return f"{type(e).__name__}: {e}"
        return None

    ours = backend == PROCESSOR_DENSE
    try:
        if ours:
            agreed(attempt(lambda: _sparsp_dense(model, one, args, other)))
        else:
            agreed(attempt(lambda: model.set_attention_backend(backend)))
        for _ in range(one_gpu.MEASURE_AT if ours else 1):
            agreed(attempt(step))
        timer.take()
        if gang > 1:
            times = time_ms(step, warmup=0, iters=iters, device=device)
        else:  # rank 0 alone (a one-GPU row): no collective
            times = times_ms(step, warmup=0, iters=iters, device=device)
        ms, flops = timer.take()
        kernel = one_gpu.last_choice().kernel if ours and one_gpu.last_choice() else None
    finally:
        if ours:
            unparallelize(model)
    figures = torch.tensor([ms / iters, flops / iters * gang], dtype=torch.float64, device=device)
    if gang > 1:
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    attn_ms, flops = figures.tolist()
    out = {"step_ms": median(times), "attention_ms": attn_ms, "attention_tflops": _tflops(flops, attn_ms)}
    return out if kernel is None else {**out, "kernel": kernel}


def _drop_all_valid_text_masks(model, inputs: dict, kind: str, dense: bool) -> None:
    """A text mask that marks every token valid masks nothing, yet it keeps the fastest
    backends (cuDNN, flash: no arbitrary mask) from applying: pass None instead. HunyuanVideo
    builds its joint attention's mask from ``encoder_attention_mask`` whatever it holds, so
    there the blocks of a dense row get None in its place (sparsp's rows read the mask
    themselves); the other models take None for their text mask."""
    if kind == "hunyuan-video":
        mask = inputs.get("encoder_attention_mask")
        if not dense or mask is None or not bool(mask.bool().all()):
            return

        def no_mask(block, args, kwargs):
            if len(args) > 3 and isinstance(args[3], torch.Tensor) and bool(args[3].all()):
                args = (*args[:3], None, *args[4:])
            if isinstance(kwargs.get("attention_mask"), torch.Tensor) and bool(kwargs["attention_mask"].all()):
                kwargs = {**kwargs, "attention_mask": None}
            return args, kwargs

        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            block.register_forward_pre_hook(no_mask, with_kwargs=True)
        return
    for key in ("encoder_attention_mask", "audio_encoder_attention_mask"):
        mask = inputs.get(key)
        if isinstance(mask, torch.Tensor) and bool(mask.bool().all()):
            inputs[key] = None


def settle_arguments(args) -> bool:
    """Fill the defaults that depend on other arguments and refuse what cannot apply; whether
    the run is on CUDA. ``--tiny``: ``--block-size 8`` (its 48-192 tokens in blocks enough for
    every rank) and ``--out results/bench`` (a smoke run is no result to track); a CPU run's
    rows say fabric ``gloo``, the only path between its processes."""
    from ..strategies import strategy_names

    known = (*ONE_GPU, *DIFFUSERS, *strategy_names())
    if args.strategy is None:
        args.strategy = default_strategies()
    check_names("e2e", "--strategy", args.strategy, known)
    if args.device not in ("auto", "cuda", "cpu"):  # torchrun's LOCAL_RANK picks the GPU
        refuse("e2e", f"--device must be auto, cuda or cpu, got {args.device!r}")
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not want_cuda and args.fabric is not None:
        refuse("e2e", f"--fabric {args.fabric} names a path between GPUs; a CPU run goes through {CPU_FABRIC}")
    args.fabric = (args.fabric or "nvlink") if want_cuda else CPU_FABRIC
    if args.density_profile is None:
        for flag, value in (("--step", args.step), ("--calibration", args.calibration)):
            if value is not None:
                refuse("e2e", f"{flag} applies to --density-profile only")
        args.weights = args.weights or "random"
    else:
        for flag, value in (("--tiny", args.tiny or None), ("--latent", args.latent)):
            if value is not None:
                refuse("e2e", f"--density-profile calibrates the preset's full-size heads; {flag} cannot apply")
        if args.weights == "random":
            refuse("e2e", "--density-profile feeds calibrated q/k into sparsp attention; --weights random "
                          "cannot apply")
        args.weights = "synthetic-structure"
    if args.block_size is None:
        args.block_size = E2E_TINY_BLOCK_SIZE if args.tiny else E2E_BLOCK_SIZE
    if args.out is None:
        args.out = E2E_TINY_OUT if args.tiny else E2E_OUT
    return want_cuda


def main(args) -> int:
    from rich.console import Console
    from rich.table import Table

    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    overrides = config_overrides(args.config, reserved=RESERVED)
    want_cuda = settle_arguments(args)
    if args.fabric == "host" and os.environ.get("NCCL_P2P_DISABLE") != "1":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # before NCCL creates its communicators
    # the profile read and the heads fitted before the process group starts: a bad file ends
    # every rank with one line, none waits for a peer
    first = os.environ.get("RANK", "0") == "0"
    calibration = _calibration(args, first) if args.density_profile is not None else None
    rank, world, device = init_distributed(None if want_cuda else "gloo")
    if not want_cuda:
        device = torch.device("cpu")
    console = Console() if rank == 0 else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    transport = args.transport or ("host" if args.fabric == "host" and device.type == "cuda" else "auto")
    # the one-GPU rows' group: rank 0 alone (every rank takes part in making it)
    one = dist.new_group([0]) if any(n in ONE_GPU for n in args.strategy) else None
    rows, other = [], None
    for name in args.strategy:
        base = {"model": args.model, "ranks": 1 if name in ONE_GPU else world, "fabric": args.fabric,
                "strategy": name, "weights": args.weights, "steps": args.steps, "device": device.type,
                "cuda_graphs": overrides.get("cuda_graphs", True), "config": overrides or None}
        error = None
        try:
            row = {**base, **_run_strategy(name, args, rank, world, device, dtype, transport, one, calibration,
                                           other)}
        except Exception as e:  # a baseline that cannot run here is a result, not a crash
            error = f"{type(e).__name__}: {e}"[:500]
        errors = [None] * world
        dist.all_gather_object(errors, error)  # every rank records the same outcome
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            row = {**base, "transport": None, "cdf": None, "density": None, "layers": args.layers,
                   "step_ms": None, "per_layer_ms": None, "attention_ms": None, "error": error}
        rows.append(row)
        if name == "1gpu-dense":  # the later rows' other attention: Diffusers' fastest here (rank 0 measured it)
            got = [row.get("other_backend")]
            dist.broadcast_object_list(got, src=0)
            other = got[0]
        if console:
            console.print(f"{name}: " + (f"{row['step_ms']:.1f} ms/step" if row["step_ms"] is not None
                                         else row["error"]) + _what_ran(row))
    densities = {r["cdf"]: r["density"] for r in rows if r["density"] is not None}
    for r in rows:  # every sparse row of a cdf has the masks 1gpu-sparse measured
        if r["cdf"] is not None and r["density"] is None:
            r["density"] = densities.get(r["cdf"])
    if rank != 0:
        dist.barrier()
        _shutdown()
        return 0
    extra = None
    if calibration is not None:  # a profile's workload: its own file, never a preset's uniform result
        extra = {"workload": "density-profile", "profile": str(args.density_profile), "source": calibration.source,
                 "step": args.step, "calibration_within": round(_share_within(calibration), 4)}
    path = write_result("e2e", _result_name(args), rows, args.out, extra=extra)
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


def _what_ran(row: dict) -> str:
    """The attention a row ran: a dense row's backend, a one-GPU sparse row's kernels per step
    and the layers that took the dense kernel."""
    if row.get("attention_kernels"):
        kernels = ", ".join(f"{k} x{n}" for k, n in row["attention_kernels"].items())
        return f" (attention per step: {kernels}; dense kernel on layers {row['dense_layers'] or 'none'})"
    if row.get("backends_tried"):
        return f" (dense attention: {row['attention_backend']})"
    return ""


def _result_name(args) -> str:
    """The model part of the result's file name (``common.profile_name`` for a profile's run)."""
    return args.model if args.density_profile is None else profile_name(args.model, args.density_profile, args.step)


def _share_within(cal) -> float:
    heads = [h for ly in cal.layers for h in ly.heads]
    return sum(h.within for h in heads) / len(heads)


def _calibration(args, verbose: bool):
    """The calibrated heads of the model's layers (``--calibration``, else fitted now on this
    process's CPU and written into ``--out``): one ``sparsp.calibration.Calibration``."""
    from ..workloads.calibration import calibrate, layer_lines, read_calibration
    from ..workloads.density import read_profile
    from ..geometry import preset

    geom = preset(args.model)
    layers = args.layers or geom.layers
    try:
        profile = read_profile(args.density_profile, expected=geom)
        if args.calibration is not None:
            cal = read_calibration(args.calibration, geometry=geom, source=profile.source, step=args.step)
            if len(cal.layers) < layers:
                raise ValueError(f"{args.calibration}: fitted {len(cal.layers)} layer(s), the model runs {layers}")
            return cal
        if verbose:
            print(f"calibrating {layers} layer(s) of {geom.name} to {args.density_profile} ...", flush=True)
        cal = calibrate(geom, profile, step=args.step, layers=layers, seed=args.seed,
                        on_layer=layer_lines(layers, lambda line: print(line, flush=True)) if verbose else None)
    except (OSError, ValueError) as e:
        refuse("e2e", " ".join(str(e).split()))
    if verbose:
        path = cal.write(Path(args.out) / f"calibration-{_result_name(args)}.json")
        print(f"wrote {path} (pass it as --calibration next time)", flush=True)
    return cal


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
