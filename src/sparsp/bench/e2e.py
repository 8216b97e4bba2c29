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
* ``diffusers-ring`` / ``diffusers-ulysses``: Diffusers' own ``ContextParallelConfig`` (a model
  without Diffusers' context-parallel plan, or a CPU run, is recorded as such before trying);
* any sparsp strategy (``ring-sparse``, ``ulysses``, ``sparsp``, ...): ``sparsp.parallelize``.

A row that fails, on any rank, records the first failing rank's error in its ``error`` on every
rank, and the run goes on (``bench.common``: the ranks agree on failure before each collective).

The dense rows (``1gpu-dense``, ``diffusers-*``) run on the fastest Diffusers attention
backend installed for the model and its mask, chosen by measurement (``bench/backends.py``;
``1gpu-dense`` also tries ``sparsp-dense``, sparsp's processors with the fastest dense kernel):
the row's ``backends_tried`` holds every backend tried with its step time, attention time and
dense attention TFLOP/s per GPU, or its error; ``attention_backend`` is the one chosen and
``attention_tflops`` its rate in the timed steps. A text mask that marks every token valid is
not passed (HunyuanVideo's dense rows: its blocks get no mask), so cuDNN and flash can apply.

By default (``--strategy`` not given) the rows are ``1gpu-dense``, ``1gpu-sparse``,
``diffusers-ring`` and ``diffusers-ulysses`` (``diffusers-unified`` with ``--mesh``),
``ring-sparse``, ``ulysses`` and ``sparsp``.

``--mesh cfg=C,ulysses=U`` (sp takes the rest of the ranks) runs the sparsp rows on a device mesh
(``sparsp.make_mesh``, ``parallelize(mesh=)``) and adds ``diffusers-unified``: Diffusers' own
ring x Ulysses attention (``ContextParallelConfig(ring_degree=sp, ulysses_degree=U, mesh=)``)
at the same mesh as the sparsp rows, ``ring-sparse`` on it being the peers' composition with
sparsity added. With ``cfg=2`` every row's step carries two branches (a batch of two, CFG's
[uncond, cond]): the sparsp rows split it over the two halves (CFG parallel: each half one
branch, the predictions all-gathered once per step), ``diffusers-unified`` runs each half's
branch and exchanges the step's prediction once, and the other rows run the batch whole. The
rows run on the mesh carry ``mesh`` (``{"cfg", "ulysses", "sp"}``; None on the others):

    torchrun --nproc-per-node 8 -m sparsp.cli bench e2e --model wan2.1-14b --mesh cfg=2,ulysses=4

A step's time is the slowest rank's wall time (CUDA events), median over the steps after
``--warmup``; ``attention_ms`` sums the video self-attention modules' time in a step (mean
over the timed steps, slowest rank); ``per_layer_ms`` = step / layers. Random weights give
near-uniform attention, so masks are nearly dense; ``--weights synthetic-structure`` feeds the
synthetic video Q/K of ``sparsp.workloads.token_qk`` (the model's RoPE structure) into sparsp's
attention instead, labelled as such (dense rows are timed unchanged: their time does not depend
on q/k values); every step moves them a little, untimed, before it runs (``e2e_model.DRIFT``),
as a real run's q/k move, so a plan kept across steps meets inputs it was not made for.

Schedules (``e2e_rows``): the sparse rows run under ``--dense-steps N --replan-every K``
(``SparspConfig``'s schedule; default 0 and 1: every step plans), and once more under each
``--schedule dense=N,replan=K``. Every row has ``schedule`` (None on the dense rows) and
``total_ms``, the sum of its timed steps; a one-GPU schedule row also ``composed_ms``, its timed
steps at ``1gpu-dense``'s step where dense and the plain ``1gpu-sparse`` row's step elsewhere.
A scheduled row's untimed steps are at least N + K + 1 (every kind of step runs once before
the timed ones: dense, plan, reuse, a second plan), and the timed steps start a new run
(``sparsp.new_run``): they count from step 0, so its first N timed steps are the dense ones.
``--thresholds FILE`` gives the sparse rows thresholds per layer and head; a table of another
model is refused before any process group starts.
Results: ``bench/results/e2e-<model>-<machine>-<date>.json`` (kind ``e2e``) + a PNG of step
time per strategy. ``--tiny --device cpu`` is the CPU smoke path (gloo; under ``torchrun
--nproc-per-node 2`` for the parallel rows): a tiny config and latent, ``--block-size 8`` unless
given (the tiny models have 48 to 192 tokens), fabric ``gloo``. A CPU run, or a ``--tiny`` one,
writes to ``results/bench`` unless ``--out`` is given, never to the tracked ``bench/results``.
``--config KEY=VALUE``
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
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .args import (CPU_FABRIC, E2E_BLOCK_SIZE, E2E_RESERVED, E2E_TINY_BLOCK_SIZE, ONE_GPU_ROWS, check_names,
                   check_out, check_thresholds, default_out, mesh_label, mesh_sizes, refuse)
from .backends import (CANDIDATES, PROCESSOR_DENSE, fastest, one_gpu_config, pick_fastest, tflops, try_backend,
                       try_each, use_backend)
from .common import (all_gather_halves, config_overrides, failure_text, first_error, init_distributed, median,
                     over_ranks, profile_name, share, shutdown, stage, time_ms, wide_console, world_size,
                     write_result)
from .e2e_model import AttentionTimer, attention_modules, drop_all_valid_text_masks, step_fn, synthetic_qk
from .e2e_rows import DIFFUSERS, compose, plot, result_table, row_label, row_plan, scheduled_warmup, what_ran

RESERVED = E2E_RESERVED


UNIFIED = "diffusers-unified"
"""Diffusers' ring x Ulysses attention at ``--mesh``'s sizes (each CFG half its own)."""


def default_strategies(mesh: bool = False) -> list[str]:
    """The rows run when ``--strategy`` is not given: the one-GPU rows, Diffusers' own context
    parallelism (the dense baselines: ring and Ulysses over the world, or with ``--mesh`` its
    unified attention at the same mesh), and every registered block-sparse strategy that moves
    no relayed bytes (a relay ring's whole model step adds nothing the attention bench lacks)."""
    from ..strategies.registry import strategies_where, strategy_spec

    sparse = [s for s in strategies_where(sparse=True) if strategy_spec(s).byte_rule != "relay"]
    dense = [UNIFIED] if mesh else [n for n in DIFFUSERS if n != UNIFIED]
    return [*ONE_GPU_ROWS, *dense, *sparse]




@dataclass(frozen=True)
class _Run:
    """What every strategy of a run shares: this rank, the group's size, the device and dtype,
    sparsp's transport, the process group of rank 0 alone (the one-GPU rows run
    ``sp_attention`` on it; None without one-GPU rows), the ``--config`` fields, the console."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    transport: str
    one: object
    overrides: dict  # the --config fields
    console: object  # rank 0's; None on the others
    sizes: tuple[int, int, int] | None = None  # --mesh: (cfg, ulysses, sp)
    mesh: object = None  # --mesh: the sparsp rows' DeviceMesh (sparsp.make_mesh)

    @property
    def batch(self) -> int:
        """Samples per step: a CFG step's two branches batched with ``--mesh cfg=2``, else one."""
        return 2 if self.sizes is not None and self.sizes[0] == 2 else 1


@dataclass
class _Built:
    """One strategy's model as this rank runs it, with its inputs: one denoising step per
    ``step()`` call, its video self-attention ``modules``, the attention choices of a
    ``1gpu-sparse`` step (``choices``), the untimed steps first, and the row so far. A rank with
    nothing to run (ranks but 0 in a one-GPU row) keeps the defaults: a step that does nothing."""

    warmup: int
    row: dict
    model: object = None
    inputs: dict | None = None  # one step's keyword arguments
    step: object = lambda: None
    between: object = lambda: None  # before each step, untimed: the synthetic q/k's move (``SyntheticQK``)
    exchange: object = None  # a CFG half's exchange of each step's prediction (``diffusers-unified``)
    modules: list = field(default_factory=list)
    choices: list = field(default_factory=list)
    planned: dict = field(default_factory=dict)  # layer -> the choice of its last plan step


def _run_strategy(name, args, run: _Run, calibration=None, other=None, schedule=None) -> dict:
    """Build, set up, time one strategy; the row (without the shared fields). ``other``: the
    Diffusers backend of the attention sparsp does not replace (cross-attention, text): the
    one ``1gpu-dense`` found fastest when it ran before, else cuDNN where it applies.
    ``schedule``: a sparse row's (dense_steps, replan_every)."""
    active = name not in ONE_GPU_ROWS or run.rank == 0  # one-GPU rows: rank 0 works, the others wait
    # every stage on every rank, active or not: its work is this rank's alone (or a group of
    # one's), and the ranks agree after it, before the next collective
    with stage("building the model"):
        built = _build(name, args, run, other) if active else _Built(
            args.warmup, {"layers": None, "transport": None, "cdf": None, "density": None})
    with stage("parallelizing the model"):
        if active:
            _parallelize(name, built, args, run, schedule)
    with stage("setting up the steps"):
        if active:
            _set_up_steps(name, built, args, calibration)
        timer = AttentionTimer(built.modules, run.device)
    built.row["layers"] = int(over_ranks([built.row["layers"] or 0], run.device)[0])
    try:
        if name in DIFFUSERS or name == "1gpu-dense":
            with stage("choosing the dense attention backend"):
                if active:
                    _pick_backend(name, built, timer, args, run)
        built.row.update(_time_steps(name, built, timer, args, run))
    finally:
        timer.remove()
    row = built.row
    del built
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _build(name, args, run: _Run, other) -> _Built:
    """The model of row ``name`` on this rank, built from its config with the run's weights,
    and its inputs; its other attention on ``other`` (or cuDNN where it applies)."""
    from ..integrations.models import PRESETS, TINY, build_transformer, dummy_inputs, num_layers

    preset = PRESETS[args.model]
    model = build_transformer(preset.kind, config=TINY[preset.kind] if args.tiny else preset.config,
                              layers=args.layers, seed=args.seed, dtype=run.dtype, device=run.device)
    latent = tuple(args.latent) if args.latent else ((3, 8, 8) if args.tiny else preset.latent)
    inputs = dummy_inputs(model, latent, text_tokens=8 if args.tiny else preset.text_tokens, seed=args.seed + 1,
                          batch=run.batch)
    built = _Built(args.warmup, {"layers": num_layers(model), "transport": None, "cdf": None, "density": None},
                   model=model, inputs=inputs)
    drop_all_valid_text_masks(model, inputs, preset.kind, dense=name == "1gpu-dense" or name in DIFFUSERS)
    # The sparse rows' other attention (cross-attention, text): ``other`` (the dense row's fastest
    # Diffusers backend), else cuDNN where it applies (bf16/fp16, no key-padding mask); the
    # dense rows pick theirs by measurement (``_pick_backend``).
    backend = other or "native"
    if other is None and run.device.type == "cuda" and run.dtype != torch.float32 and preset.kind != "hunyuan-video":
        backend = "_native_cudnn"
    if backend != "native":
        model.set_attention_backend(backend)
    built.row["attention_backend"] = backend
    return built


def _set_up_steps(name, built: _Built, args, calibration) -> None:
    """The parallelized model's step function and attention modules: the synthetic or
    calibrated q/k where the weights say so, a ``1gpu-sparse`` row's choices recorded."""
    from ..integrations.diffusers import runtime_of
    from ..strategies import one_gpu

    rt = runtime_of(built.model)
    if rt is not None and args.weights == "synthetic-structure":
        rt.qk_override = synthetic_qk(built.model, args.seed, calibration)
        built.between = rt.qk_override.advance  # each step its own q/k, a little moved (DRIFT)
        built.row["qk"] = "synthetic" if calibration is None else "calibrated"
    sigmas = torch.linspace(1.0, 0.0, built.warmup + args.steps + 1).tolist()
    built.step = step_fn(built.model, built.inputs, sigmas, exchange=built.exchange)
    built.modules = attention_modules(built.model)
    if name == "1gpu-sparse":  # what each attention call chose (``strategies/one_gpu.py``)
        for i, m in enumerate(built.modules):
            m.register_forward_hook(lambda *_, i=i: built.choices.append(_choice(built, rt, i, one_gpu.last_choice())))


def _choice(built: _Built, rt, layer: int, choice) -> tuple:
    """(layer, what its call ran, the step's kind) of one attention call: a reuse step ran the
    kernel its plan step chose (``KeptPlan``), and made no choice of its own."""
    kind = rt.config.step_kind(rt.step) if rt.step is not None and rt.config.scheduled else "plan"
    if kind == "reuse" and layer in built.planned:
        return layer, built.planned[layer], kind
    built.planned[layer] = choice
    return layer, choice, kind


def _parallelize(name, built: _Built, args, run: _Run, schedule=None) -> None:
    """Parallelize the model as row ``name`` runs: sparsp's primary strategy on the group of one
    (``1gpu-sparse``, as ``bench attention`` runs it), Diffusers' own context parallelism
    (``diffusers-*``), a sparsp strategy over the group, under ``schedule`` (its untimed
    steps then run every kind of step once: ``scheduled_warmup``); ``1gpu-dense`` as it is."""
    import sparsp

    from ..strategies import one_gpu
    from ..strategies.registry import strategies_where

    dense_steps, replan_every = schedule or (0, 1)
    config = sparsp.SparspConfig(cdf_threshold=args.cdf, block_size=args.block_size, transport=run.transport,
                                 kernel=args.kernel, dense_steps=dense_steps, replan_every=replan_every,
                                 thresholds=args.thresholds, **dict(args.config))
    built.warmup = max(built.warmup, scheduled_warmup(schedule))
    if name == "1gpu-sparse":
        sparsp.parallelize(built.model, group=run.one, config=one_gpu_config(config),
                           strategy=strategies_where(primary=True)[0])
        built.row.update(cdf=args.cdf)
        built.warmup = max(built.warmup, one_gpu.MEASURE_AT)  # the kernels' rates measured before the timed steps
    elif name == UNIFIED:
        _unified(built, run)
    elif name in DIFFUSERS:
        from diffusers import ContextParallelConfig

        built.row.update(transport="nccl")
        built.model.enable_parallelism(config=ContextParallelConfig(**{DIFFUSERS[name]: run.world}))
    elif name != "1gpu-dense":
        sparsp.parallelize(built.model, mesh=run.mesh, config=config, strategy=name)
        built.row.update(transport=run.transport, cdf=args.cdf, mesh=_mesh_field(run))


def _mesh_field(run: _Run) -> dict | None:
    """A row's ``mesh``: the sizes it ran on (None: the flat group, or one GPU)."""
    return None if run.sizes is None else dict(zip(("cfg", "ulysses", "sp"), run.sizes))


def _unified(built: _Built, run: _Run) -> None:
    """``diffusers-unified``: Diffusers' ring x Ulysses attention on a mesh of ``--mesh``'s
    sizes (``ContextParallelConfig(ring_degree=sp, ulysses_degree=ulysses, mesh=)``, the mesh's
    dimensions named as Diffusers names them); with cfg 2 each half runs its sample of the
    batch, and each step's prediction is exchanged between the halves (what CFG parallel does
    per step), every rank going on with its own sample."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from ..integrations.plans import plan_for

    cfg, ulysses, sp = run.sizes
    mesh = init_device_mesh(run.device.type, (cfg, sp, ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
    built.row.update(transport="nccl", mesh=_mesh_field(run))
    built.model.enable_parallelism(config=ContextParallelConfig(ring_degree=sp, ulysses_degree=ulysses,
                                                                mesh=mesh["ring", "ulysses"]))
    if cfg == 2:
        half, group = mesh.get_local_rank("cfg"), mesh.get_group("cfg")
        for arg in plan_for(built.model).batch:
            value = built.inputs.get(arg)
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == 2:
                built.inputs[arg] = value[half:half + 1]
        built.exchange = lambda v: all_gather_halves(v, group)[half]


def _pick_backend(name, built: _Built, timer, args, run: _Run) -> None:
    """A dense row's attention on the fastest backend a Diffusers user has on this machine,
    measured (``diffusers-*``: every rank together); ``1gpu-dense`` also tries sparsp's
    processors with the dense kernel, the rest on Diffusers' best. The row records each try."""
    model, step, row = built.model, built.step, built.row
    gang, tries = (run.world if name in DIFFUSERS else 1), min(args.steps, 2)
    chosen, tried = pick_fastest(CANDIDATES, lambda b: try_backend(model, b, step, timer, run.device, gang, tries))
    row["other_backend"] = other = chosen
    if name == "1gpu-dense":
        chosen, tried = fastest(tried + try_each((PROCESSOR_DENSE,), lambda b: try_backend(
            model, b, step, timer, run.device, gang, tries, one=run.one, args=args, other=other)))
    row["attention_backend"], row["backends_tried"] = chosen, tried
    use_backend(model, chosen, row["other_backend"], run.one, args)


def _time_steps(name, built: _Built, timer, args, run: _Run) -> dict:
    """The row's figures: ``--steps`` steps timed after the untimed ones, the slowest rank's,
    and their sum (``total_ms``); the attention's time per step (and a dense row's rate); a
    ``1gpu-sparse`` row's density and kernels per step. A parallelized model starts a new run
    after the untimed steps (``sparsp.new_run``): its schedule counts the timed steps from 0."""
    import sparsp

    from ..integrations.diffusers import runtime_of

    with stage("the warm-up steps"):  # here, not in time_ms, so the attention spans exclude them
        for _ in range(built.warmup):
            built.between()
            built.step()
        timer.take_ms()
        built.choices.clear()
        if built.model is not None and runtime_of(built.model) is not None:
            sparsp.new_run(built.model)
    times = time_ms(built.step, warmup=0, iters=args.steps, device=run.device, what="the timed steps",
                    between=built.between)
    choices = built.choices
    with stage("the step's figures"):
        attn_ms, flops = timer.take()
        masked = [c for _, c, kind in choices if kind != "dense"]  # a dense step has no mask
        kept = sum(c.kept for c in masked) / len(masked) if masked else -1.0
    # the slowest rank's attention time and the dense FLOPs of a step (per GPU), and the density
    gang = run.world if name in DIFFUSERS else 1
    attn, step_flops, density = over_ranks([attn_ms / args.steps, flops / args.steps * gang, kept], run.device)
    out = {"density": density if density >= 0 else None}
    if name in ONE_GPU_ROWS[:1] or name in DIFFUSERS:  # dense: the rate its attention ran at, per GPU
        out["attention_tflops"] = tflops(step_flops, attn)
    if choices:
        out["dense_layers"] = sorted({i for i, c, kind in choices if c.dense and kind != "dense"})
        out["attention_kernels"] = {k: sum(c.kernel == k for _, c, _ in choices) // args.steps
                                    for k in sorted({c.kernel for _, c, _ in choices})}
    step_ms = median(times)
    return {**out, "step_ms": step_ms, "per_layer_ms": step_ms / built.row["layers"], "attention_ms": attn,
            "total_ms": sum(times), "step_ms_all": times, "warmup": built.warmup}


def settle_arguments(args) -> bool:
    """Fill the defaults that depend on other arguments and refuse what cannot apply; whether
    the run is on CUDA. ``--tiny``: ``--block-size 8`` (its 48-192 tokens in blocks enough for
    every rank); a CPU run or a ``--tiny`` one: ``--out results/bench`` (no result to track);
    a CPU run's rows say fabric ``gloo``, the only path between its processes."""
    from ..strategies import strategy_names

    known = (*ONE_GPU_ROWS, *DIFFUSERS, *strategy_names())
    if args.strategy is None:
        args.strategy = default_strategies(args.mesh is not None)
    check_names("e2e", "--strategy", args.strategy, known)
    check_mesh(args)
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
    if args.thresholds is not None:  # before any process group: a table of another model is one line
        from ..integrations.models import attention_shape

        layers, heads = attention_shape(args.model, tiny=args.tiny, layers=args.layers)
        check_thresholds("e2e", args.thresholds, layers=layers, heads=heads,
                         what=f"{args.model}{' --tiny' if args.tiny else ''} ({layers} self-attention layers)")
    if args.out is None:
        args.out = default_out(want_cuda and not args.tiny)
    check_out("e2e", "--out", args.out)
    return want_cuda


def check_mesh(args) -> None:
    """``--mesh`` against torchrun's world and the model's heads (``args.sizes``: its (cfg,
    ulysses, sp), None without it), before any process group: one line, exit 2."""
    from ..integrations.models import attention_shape

    args.sizes = None
    if args.mesh is None:
        if UNIFIED in args.strategy:
            refuse("e2e", f"{UNIFIED} runs Diffusers' ring x Ulysses attention at the sizes of --mesh: give --mesh")
        return
    args.sizes = mesh_sizes("e2e", args.mesh, world_size())
    _, heads = attention_shape(args.model, tiny=args.tiny, layers=args.layers)
    if heads % args.sizes[1]:
        refuse("e2e", f"--mesh ulysses={args.sizes[1]} does not divide the {heads} heads of {args.model}"
                      f"{' --tiny' if args.tiny else ''}")


def require_diffusers() -> None:
    """Refuse (one line naming the extra to install) a run without Diffusers, before any process
    group starts: every row builds a Diffusers transformer."""
    try:
        import diffusers  # noqa: F401
    except ImportError as e:
        refuse("e2e", f"needs Diffusers ({e}): pip install -e \".[diffusers]\"")


def diffusers_refusal(name: str, kind: str, device, sizes: tuple[int, int, int] | None = None) -> str | None:
    """Why Diffusers' own context parallelism (the ``diffusers-*`` rows) cannot run the model
    ``kind`` on ``device``, decided before trying (None: it can): a model without a
    context-parallel plan, or no accelerator to put each rank on."""
    import diffusers

    from ..integrations.models import CLASSES, model_class

    if name not in DIFFUSERS:
        return None
    if not getattr(model_class(kind), "_cp_plan", None):
        return f"Diffusers {diffusers.__version__} has no context-parallel plan for {CLASSES[kind]}"
    if device.type == "cpu":
        return "Diffusers' context parallelism needs an accelerator (it puts each rank on one); this run is on the CPU"
    if name == UNIFIED and sizes is not None and sizes[1] * sizes[2] == 1:
        return "each CFG half of --mesh is one rank: Diffusers' context parallelism has no sequence to split"
    return None


def main(args) -> int:
    if args.steps < 1 or args.warmup < 0:
        refuse("e2e", "--steps must be >= 1 and --warmup >= 0")
    overrides = config_overrides(args.config, reserved=RESERVED)
    want_cuda = settle_arguments(args)
    require_diffusers()
    if args.fabric == "host" and os.environ.get("NCCL_P2P_DISABLE") != "1":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # before NCCL creates its communicators
    # the profile read and the heads fitted before the process group starts: a bad file ends
    # every rank with one line, none waits for a peer
    first = os.environ.get("RANK", "0") == "0"
    calibration = _calibration(args, first) if args.density_profile is not None else None
    run = _start(args, want_cuda, overrides)
    try:
        rows, other = [], None
        for name, schedule in row_plan(args):
            rows.append(_strategy_row(name, args, run, calibration, other, schedule))
            if name == "1gpu-dense":  # the later rows' other attention: Diffusers' fastest here (rank 0 measured it)
                other = share(rows[-1].get("other_backend"))
        densities = {r["cdf"]: r["density"] for r in rows if r["density"] is not None and row_label(r) == r["strategy"]}
        for r in rows:  # every sparse row of a cdf has the masks 1gpu-sparse measured
            if r["cdf"] is not None and r["density"] is None:
                r["density"] = densities.get(r["cdf"])
        compose(rows)
        with stage("writing the results"):
            if run.rank == 0:
                _write(rows, args, run, calibration)
    finally:
        shutdown()
    return 0


def _start(args, want_cuda: bool, overrides: dict) -> _Run:
    """Join the process group (gloo on a CPU) and make what every strategy shares."""
    rank, world, device = init_distributed(None if want_cuda else "gloo")
    if not want_cuda:
        device = torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    transport = args.transport or ("host" if args.fabric == "host" and device.type == "cuda" else "auto")
    # the one-GPU rows' group: rank 0 alone (every rank takes part in making it)
    one = dist.new_group([0]) if any(n in ONE_GPU_ROWS for n in args.strategy) else None
    mesh = None
    if args.sizes is not None:  # the sparsp rows' mesh, made by every rank after the checks
        from ..mesh import make_mesh

        mesh = make_mesh(cfg=args.sizes[0], ulysses=args.sizes[1], sp=args.sizes[2])
    return _Run(rank, world, device, dtype, transport, one, overrides, wide_console() if rank == 0 else None,
                sizes=args.sizes, mesh=mesh)


def _strategy_row(name, args, run: _Run, calibration, other, schedule=None) -> dict:
    """Row ``name`` (under ``schedule``, a sparse row's), the same outcome on every rank: its
    figures, or why it could not run (decided before trying where it can be, else the first
    failing rank's error): a baseline that cannot run here is a result, not a crash."""
    from ..integrations.models import PRESETS

    base = {"model": args.model, "ranks": 1 if name in ONE_GPU_ROWS else run.world, "fabric": args.fabric,
            "strategy": name, "weights": args.weights, "steps": args.steps, "device": run.device.type,
            "cuda_graphs": run.overrides.get("cuda_graphs", True), "config": run.overrides or None,
            "schedule": None if schedule is None else {"dense_steps": schedule[0], "replan_every": schedule[1]},
            "thresholds": None if schedule is None or args.thresholds is None else str(args.thresholds),
            "mesh": None}
    row, error = None, diffusers_refusal(name, PRESETS[args.model].kind, run.device, run.sizes)
    if error is None:
        try:
            row = {**base, **_run_strategy(name, args, run, calibration, other, schedule)}
        except Exception as e:  # agreed by every rank below
            error = failure_text(e)[:500]
    error = first_error(error)
    if error is not None:
        row = {**base, "transport": None, "cdf": None, "density": None, "layers": args.layers,
               "step_ms": None, "per_layer_ms": None, "attention_ms": None, "total_ms": None, "error": error}
    if run.console:
        run.console.print(f"{row_label(row)}: " + (f"{row['step_ms']:.1f} ms/step" if row["step_ms"] is not None
                                         else row["error"]) + what_ran(row))
    return row


def _write(rows: list[dict], args, run: _Run, calibration) -> None:
    """Rank 0: the result file (a profile's workload: its own, never a preset's uniform
    result), its table and its plot."""
    extra = None
    if calibration is not None:
        extra = {"workload": "density-profile", "profile": str(args.density_profile), "source": calibration.source,
                 "step": args.step, "calibration_within": round(_share_within(calibration), 4)}
    path = write_result("e2e", _result_name(args), rows, args.out, extra=extra)
    mesh = "" if run.sizes is None else f", sparsp rows on mesh {mesh_label(run.sizes)}"
    run.console.print(result_table(rows, f"e2e {args.model}, {run.world} ranks, {args.fabric}, "
                                         f"weights={args.weights}{mesh}"))
    outputs = [path] if args.no_plot else [path, plot(path)]
    run.console.print("wrote " + ", ".join(map(str, outputs)))


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
