"""``sparsp.parallelize`` / ``sparsp.unparallelize`` for Diffusers video transformers and pipelines.

    import sparsp
    sparsp.parallelize(pipe, mesh=sparsp.make_mesh(cfg=2, ulysses=4), config=sparsp.SparspConfig(cdf_threshold=0.9))
    video = pipe(prompt=..., output_type="latent").frames   # under torchrun

Supported: HunyuanVideo, Wan (2.1/2.2), LTX-Video and LTX-2 (its video self-attention), as
transformers or in their pipelines; the split of each is declared as data in ``plans.py``.
What ``parallelize`` does, in this order:

1. validate everything that needs no communication (model class and config; strategy, never
   ``auto`` without a process group; placement; the group or mesh, ``meshes.resolve``; heads
   divisible by ``ulysses``, and by G for ``ulysses``; a thresholds table against the model's
   self-attention layers and heads) — ``ValueError`` before any collective;
2. make the mesh (``mesh="auto"``: ``meshes.auto_mesh``) and its groups;
3. attach a ``Runtime`` (where the process stands, config, strategy, placement cache) to each
   model (``runtime.install``, which does 3 to 5);
4. replace the processors of the video self-attention modules (and LTX-2's video-K/V
   attention) by sparsp processors, remembering the originals;
5. hook the model's forward (its CFG half's share, ``cfg.py``; geometry of this call →
   placement; its step and branch for the schedule, ``steps.py``, from the pipeline's cache
   context, ``context.py``; cut entry tensors), the submodules whose inputs or outputs carry
   one entry per video token (cut to this rank's tokens in placed order: hidden states,
   RoPE), HunyuanVideo's text stream (trimmed to its valid tokens) and the output projection
   (all-gathered over the (sp x ulysses) sub-mesh, back to the original order);
6. on a mesh with ``cfg`` 2, wrap a pipeline's call to pair its forwards (``cfg.wrap_pipeline``).

The placement is a fixed permutation per (geometry, G) (docs/design.md, "The mechanism",
dependency-aware placement): the geometry is read from the latent shape at every forward and placements are
cached per geometry, so several video sizes in one process (LTX-2's two stages) just work.
Several sizes and ``torch.compile``: every hook and the attention call are excluded from
compilation (``torch.compiler.disable``: a graph break around them), so sparsp adds no guard
on token counts or placement indices and never causes a recompilation itself; the compiled
parts of the model see one new local sequence length per geometry, which dynamo handles
with its automatic dynamic shapes (one recompilation when the second size arrives, then a
dynamic graph), far from the recompile limit.

Without a process group (or with ``emulate_ranks=G``) nothing is communicated: the whole
placed sequence stays in the process and attention runs under the masks that G ranks would
compute (``reference.reference_sp_attention``, under the config's schedule:
``steps.ScheduledReference``), so a user sees what sparsity alone does. A process group of
one runs ``sp_attention`` on it: the fast one-GPU path.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch.distributed as dist

from ..config import SparspConfig
from ..placement import PLACEMENTS
from .meshes import Ranks, auto_mesh, build_mesh, resolve
from .plans import PIPELINES, SplitPlan, plan_for
from .runtime import ATTR, Runtime, check_strategy, install, modules_matching, strategy_facts, uninstall

log = logging.getLogger("sparsp")

__all__ = ["Runtime", "check_strategy", "new_run", "parallelize", "runtime_of", "unparallelize"]


@dataclass(frozen=True)
class _Model:
    """One transformer to parallelize, with what step 1 read from it."""

    model: object
    plan: SplitPlan
    attn: dict
    heads: int
    head_dim: int


def _models(target) -> tuple[list, object]:
    """(the transformers of ``target``, the pipeline's CFG rule or None): a Diffusers pipeline's
    transformers (its rule's attributes, else ``transformer`` and ``transformer_2``), or
    ``target`` itself."""
    from diffusers import DiffusionPipeline

    if not isinstance(target, DiffusionPipeline):
        return [target], None
    rule = PIPELINES.get(type(target).__name__)
    names = rule.transformers if rule is not None else ("transformer", "transformer_2")
    models = [m for m in (getattr(target, n, None) for n in names) if m is not None]
    if not models:
        raise ValueError(f"{type(target).__name__} has no transformer ({', '.join(names)}) to parallelize")
    return models, rule


def _check_model(model, *, where: Ranks, spec, strategy: str, config: SparspConfig) -> _Model:
    """Step 1 for one model: its plan, config, modules and heads against the mesh and strategy."""
    plan = plan_for(model)
    name = type(model).__name__
    if getattr(model, ATTR, None) is not None:
        raise ValueError(f"{name} is already parallelized; call sparsp.unparallelize first")
    for attr, bad in plan.unsupported_config.items():
        if getattr(model.config, attr, None) in bad:
            raise ValueError(f"sparsp.parallelize does not support {name} with {attr}={getattr(model.config, attr)!r}")
    attn = modules_matching(model, plan.self_attention)
    if not attn:
        raise ValueError(f"{name} has no module matching {plan.self_attention}")
    first = next(iter(attn.values()))
    heads = first.heads
    if heads % where.ulysses:
        raise ValueError(f"{name} has {heads} heads, which do not divide over ulysses={where.ulysses}")
    if spec.heads_divisible and (heads // where.ulysses) % where.sp:
        raise ValueError(f"{strategy} needs heads divisible by the group size: {name} has {heads} heads"
                         + (f" ({heads // where.ulysses} per Ulysses rank)" if where.ulysses > 1 else "")
                         + f", G={where.sp}")
    if config.table is not None:  # a table of another model: its layers x heads against this one's
        config.table.check(layers=len(attn), heads=heads, what=f"{name} ({len(attn)} self-attention layers)")
    return _Model(model, plan, attn, heads, first.to_q.out_features // heads)


def _auto(mesh, geometry, *, target, models: list, rule, spec, config: SparspConfig, group, dims, emulate_ranks):
    """``mesh="auto"``: the sizes ``meshes.auto_mesh`` picks for the first model (None where
    ``mesh`` is not ``"auto"``), for the branches a step of the pipeline's call makes at its
    defaults (a transformer: one); ``ValueError`` for ``geometry`` without it."""
    if isinstance(mesh, str) and mesh != "auto":
        raise ValueError(f"mesh must be a DeviceMesh, 'auto' or None, got {mesh!r}")
    if not (isinstance(mesh, str) and mesh == "auto"):
        if geometry is not None:
            raise ValueError("geometry= is what mesh='auto' picks a mesh for: pass mesh='auto' with it")
        return None
    if geometry is None:
        raise ValueError("mesh='auto' picks the mesh from the token count: pass geometry= (a VideoGeometry or a "
                         "preset name)")
    if group is not None or dims is not None or emulate_ranks is not None:
        raise ValueError("mesh='auto' makes its own mesh of the whole world: pass no group=, dims= or emulate_ranks= "
                         "with it")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("mesh='auto' needs torch.distributed initialised: call dist.init_process_group first")
    model = models[0]
    attn = modules_matching(model, plan_for(model).self_attention)
    if not attn:
        raise ValueError(f"{type(model).__name__} has no module matching {plan_for(model).self_attention}")
    first = next(iter(attn.values()))
    branches = 1
    if rule is not None:
        defaults = {n: p.default for n, p in inspect.signature(type(target).__call__).parameters.items()}
        branches = rule.branches(defaults)
    return auto_mesh(geometry, heads=first.heads, head_dim=first.to_q.out_features // first.heads,
                     block_size=config.block_size, layers=len(attn), world=dist.get_world_size(), spec=spec,
                     branches=branches, model=type(model).__name__)


def parallelize(target, *, mesh=None, dims=None, group=None, config: SparspConfig = SparspConfig(),
                strategy: str = "sparsp", placement: str = "auto", emulate_ranks: int | None = None, geometry=None):
    """Run the video self-attention of ``target``'s transformer(s) sequence-parallel (in place).

    Args:
        target: a Diffusers ``HunyuanVideoTransformer3DModel``, ``WanTransformer3DModel``,
            ``LTXVideoTransformer3DModel`` or ``LTX2VideoTransformer3DModel`` — the same model
            (same weights) on every rank, called with the same inputs — or a Diffusers pipeline
            holding them (its ``transformer``, and Wan 2.2's ``transformer_2``, are parallelized;
            with ``cfg`` 2 its call is wrapped, ``cfg.py``).
        mesh: a ``DeviceMesh`` (``sparsp.make_mesh``, or any mesh with ``dims``): rank
            (cfg=c, sp=r, ulysses=u) holds piece u of sp slice r, every self-attention runs
            ``sp_attention`` on the (sp x ulysses) half, and ``cfg`` 2 spreads a step's branches
            over the two halves (CFG parallel). ``"auto"``: the mesh ``cost.mesh_step.best_mesh``
            prices fastest for ``geometry``'s token count (``meshes.auto_mesh``), made with
            ``make_mesh``.
        dims: the role (``cfg``, ``sp``, ``ulysses``) of each of the mesh's dimensions
            (``sparsp.mesh``; None: the mesh's names are the roles).
        group: the process group (``None``: the default group), a mesh of one ``sp`` dimension.
            A group of one process runs ``sp_attention`` on it (one GPU: the sparse kernel where
            the mask pays, else the dense one). With no process group (``torch.distributed``
            not initialised), ``parallelize`` installs the single-process sparse processor.
        config: thresholds, block size, transport, kernel (``SparspConfig``).
        strategy: any registered strategy (``sparsp.strategies.registry.strategy_names()``;
            ``ring`` is the dense baseline), or ``auto`` over a process group (``check_strategy``).
        placement: ``contiguous``, ``periodic`` or ``auto`` (the strategy's own: periodic for
            ``sparsp`` and ``ring-relay``, contiguous for the rest).
        emulate_ranks: single-process mode for a group of this size: no communication, the
            placement and block cut of G ranks, so the masks are exactly theirs (what ulysses U
            x sp G computes).
        geometry: with ``mesh="auto"``, a ``VideoGeometry`` or a preset name whose token grid
            the mesh is chosen for.

    Returns ``target``. ``ValueError`` (one line, before any communication) for an unsupported
    model, option or mesh; ``unparallelize`` undoes everything.
    """
    # 1. Validate: targets, options, mesh, models — nothing communicates yet.
    models, rule = _models(target)
    if not isinstance(config, SparspConfig):
        raise ValueError(f"config must be a sparsp.SparspConfig, got {type(config).__name__}")
    if placement not in ("auto", *PLACEMENTS):
        raise ValueError(f"placement={placement!r} is not one of auto, {', '.join(PLACEMENTS)}")
    for model in models:
        plan_for(model)  # a model sparsp knows, before anything else is read from it
    sizes = _auto(mesh, geometry, target=target, models=models, rule=rule, spec=strategy_facts(strategy),
                  config=config, group=group, dims=dims, emulate_ranks=emulate_ranks)
    if sizes is not None:  # what the mesh will be, checked against the models before it is made
        where = Ranks(True, sp=sizes.sp, ulysses=sizes.ulysses, cfg=sizes.cfg)
    else:
        where = resolve(group=group, mesh=mesh, dims=dims, emulate_ranks=emulate_ranks)
    spec = check_strategy(strategy, distributed=where.distributed)
    kind = spec.placement if placement == "auto" else placement  # auto: the strategy's own (§4.3)
    checked = [_check_model(m, where=where, spec=spec, strategy=strategy, config=config) for m in models]
    if where.cfg > 1 and rule is None and models[0] is not target:  # a pipeline of unknown steps
        raise ValueError(f"CFG parallel knows the steps of {', '.join(PIPELINES)}, not {type(target).__name__}'s: "
                         f"parallelize its transformer (each forward's even batch is split) or use cfg 1")
    # 2. The groups (the first communication), on the mesh mesh="auto" chose where it did.
    if sizes is not None:
        mesh = build_mesh(sizes)
        where = resolve(group=None, mesh=mesh, dims=None, emulate_ranks=None)
    where.connect()
    # 3.-5. Each model's runtime, processors and hooks (``runtime.install``).
    halves = [install(m.model, m.plan, m.attn, where=where, config=config, strategy=strategy, kind=kind, heads=m.heads,
                      head_dim=m.head_dim) for m in checked]
    # 6. CFG parallel over a pipeline's forwards: its call reads which ones pair.
    if where.cfg > 1 and rule is not None:
        from .cfg import wrap_pipeline

        wrap_pipeline(target, rule, halves)
        log.info("sparsp: %s: CFG parallel over %d halves, its call wrapped", type(target).__name__, where.cfg)
    return target


def unparallelize(target):
    """Undo ``parallelize``: the original processors back, hooks removed, a pipeline's class
    back. Returns ``target``."""
    from diffusers import DiffusionPipeline

    if isinstance(target, DiffusionPipeline):
        from .cfg import unwrap_pipeline

        models = [m for m in _models(target)[0] if getattr(m, ATTR, None) is not None]
        if not models:
            raise ValueError(f"{type(target).__name__} is not parallelized by sparsp")
        unwrap_pipeline(target)
        for model in models:
            uninstall(model)
        return target
    uninstall(target)
    return target

def new_run(transformer) -> None:
    """Start a new denoising run of the parallelized ``transformer``: its next forward is step
    0 (``sparsp.new_run``; a pipeline's own end starts one too, docs/diffusers.md "Schedules")."""
    rt = getattr(transformer, ATTR, None)
    if rt is None:
        raise ValueError(f"{type(transformer).__name__} is not parallelized by sparsp")
    rt.new_run()


def runtime_of(transformer) -> Runtime | None:
    """The ``Runtime`` of a parallelized model (None otherwise)."""
    return getattr(transformer, ATTR, None)
