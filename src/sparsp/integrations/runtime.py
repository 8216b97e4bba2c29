"""A parallelized model's ``Runtime`` and the hooks that cut and gather its tokens.

``parallelize`` (``diffusers.py``) checks a model and calls ``install``: a ``Runtime`` attached
to the model (where its process stands, ``meshes.Ranks``; the config and strategy; a
``layout.TokenLayout`` per geometry; its step and branch), sparsp processors on its video
self-attention modules, and hooks on the model's forward (its CFG half's share, ``cfg.py``;
the geometry and placement; the step; the entry tensors cut), on the submodules whose inputs or
outputs carry one entry per video token, on HunyuanVideo's text stream and on the output
projection (all-gathered over the (sp x ulysses) sub-mesh, back to the original order).
``uninstall`` undoes it. Every hook and the attention call are excluded from compilation
(``torch.compiler.disable``).
"""

from __future__ import annotations

import fnmatch
import inspect
import logging

import torch
import torch.distributed as dist

from ..config import SparspConfig
from ..geometry import VideoGeometry
from ..kernels import merge_partials
from .layout import TokenLayout, make_layout
from .meshes import Ranks
from .plans import Split, SplitPlan
from .processors import PROCESSORS, VideoKVProcessor
from .steps import ScheduledReference, StepCounter, timestep_value

log = logging.getLogger("sparsp")

ATTR = "_sparsp_runtime"
"""The attribute of a parallelized model that holds its ``Runtime``."""

__all__ = ["ATTR", "Runtime", "check_strategy", "install", "modules_matching", "strategy_facts", "uninstall"]


def strategy_facts(strategy: str):
    """The registered facts of ``strategy`` (``ValueError`` naming the registered ones);
    ``auto`` (chosen per call, ``strategies/auto.py``) places like the strategy whose plan
    stage it uses (``auto.PLANNED``) and never needs heads divisible by the group (it picks a
    head-sharded strategy only where they are)."""
    from .. import strategies  # noqa: F401 - importing the package registers every strategy
    from ..strategies.auto import AUTO, PLANNED
    from ..strategies.registry import strategy_spec

    if strategy == AUTO:
        from dataclasses import replace

        return replace(strategy_spec(PLANNED), heads_divisible=False)
    return strategy_spec(strategy)


def check_strategy(strategy: str, *, distributed: bool):
    """The registered facts of ``strategy`` for a model run over a process group
    (``distributed``) or in one process (no group, or ``emulate_ranks``); ``ValueError`` for an
    unknown name, and for ``auto`` in one process: it picks a strategy per call from the demand
    of the group's ranks, which one process does not have. ``parallelize`` checks this first;
    a script can call it before loading its model."""
    from ..strategies.auto import AUTO
    from ..strategies.registry import strategy_names

    spec = strategy_facts(strategy)
    if strategy == AUTO and not distributed:
        raise ValueError(f"strategy={AUTO!r} picks a strategy per call from the demand of a process group's "
                         f"ranks; one process (no process group, or emulate_ranks) runs a fixed one: "
                         f"{', '.join(strategy_names())}")
    return spec

class Runtime:
    """Per model: where this process stands (``meshes.Ranks``), the config and strategy, the
    placement cache, the hooks, CFG parallel's ``halves`` (None without a ``cfg`` of 2), and
    where the forward now running is in its denoising run (``step``, ``branch``). It owns the
    model's kept plans (``sp_attention(_owner=)``)."""

    def __init__(self, model, plan: SplitPlan, *, where: Ranks, config: SparspConfig, strategy: str, placement: str,
                 heads: int, head_dim: int):
        self.model_name = type(model).__name__
        self.plan, self.where = plan, where
        # the placement's ranks (R sp ranks; the emulated ones in one process) and this one's
        self.ranks, self.rank, self.distributed = where.sp, where.sp_rank, where.distributed
        self.config, self.strategy = config, strategy
        self.placement_kind = placement
        self.heads, self.head_dim = heads, head_dim
        self.layouts: dict[VideoGeometry, TokenLayout] = {}
        self.current: TokenLayout | None = None
        self.originals: dict[str, object] = {}
        self.handles: list = []
        self.text_tokens: int | None = None
        # sparsp trace / bench: called with the block mask bool [H, N, N] (batch element 0) of
        # every attention call of the single-process mode
        self.on_mask = None
        # bench e2e --weights synthetic-structure: (layout, q, layer) -> (q, k) of the attention sequence
        self.qk_override = None
        # where the forward now running is in its denoising run (``steps.py``): its step and
        # branch, passed to every attention call; the pipeline's cache context (``context.py``)
        self.steps, self.step, self.branch = StepCounter(), None, None
        self.context_hook = None
        self.halves = None  # cfg.Halves on a mesh with cfg 2
        self.reference = ScheduledReference()  # the single-process path's kept masks

    @property
    def group(self):
        """The process group a ulysses-1 call runs its strategy over."""
        return self.where.group

    def new_run(self) -> None:
        """Count steps from 0 again (``sparsp.new_run``; a pipeline's end)."""
        from ..strategies import new_run

        self.steps.new_run()
        new_run(self)  # the branch counts of calls without a branch

    def describe(self) -> str:
        return f"{self.strategy}, {self.placement_kind}, {self.where.describe()}"

    # --- geometry -> layout -----------------------------------------------------------------
    def layout_for(self, geom: VideoGeometry) -> TokenLayout:
        lay = self.layouts.get(geom)
        if lay is None:
            lay = make_layout(geom, self.placement_kind, self.where, self.model_name)
            self.layouts[geom] = lay
            log.info("sparsp: %s: new geometry %s → %r", self.model_name, geom.describe(), lay.placement)
        return lay

    # --- tensors ------------------------------------------------------------------------------
    def split(self, x: torch.Tensor, spec: Split, what: str) -> torch.Tensor:
        """``x`` cut to this process's video tokens along ``spec.dim``."""
        lay = self.current
        assert lay is not None, "sparsp: a split hook ran outside a forward call"
        if not isinstance(x, torch.Tensor):
            return x
        n = x.shape[spec.dim] if x.dim() > spec.dim else None
        if n != lay.geometry.video_tokens:
            if spec.when_full:
                return x
            raise ValueError(f"sparsp: {what} (shape {tuple(x.shape)}) has no {lay.geometry.video_tokens} "
                             f"entries along dim {spec.dim} for the video tokens of {lay.geometry.describe()}")
        if lay.identity:
            return x
        return x.index_select(spec.dim, lay.on("video_ids", x.device))

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole video along ``dim`` in original order, from every rank's part."""
        lay = self.current
        if lay.identity:
            return x
        if self.distributed:
            x = torch.cat(self._all_gather(x, dim, lay.video_parts), dim=dim)
        return x.index_select(dim, lay.on("video_order", x.device))

    def _all_gather(self, x: torch.Tensor, dim: int, sizes: list[int]) -> list[torch.Tensor]:
        """Every piece's ``x`` (``sizes[i]`` entries along ``dim``) from the ranks of this
        process's (sp x ulysses) sub-mesh in sequence order, padded for the collective."""
        pieces = self.where.pieces
        if pieces == 1:  # a group of one: nothing to gather
            return [x]
        x = x.movedim(dim, 0).contiguous()
        pad = max(sizes)
        buf = torch.zeros((pad, *x.shape[1:]), dtype=x.dtype, device=x.device)
        buf[: x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in range(pieces)]
        dist.all_gather(parts, buf, group=self.where.sequence)
        return [p[:n].movedim(0, dim) for p, n in zip(parts, sizes)]

    # --- attention ----------------------------------------------------------------------------
    @torch.compiler.disable
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Self-attention of the held video tokens (then all text tokens, HunyuanVideo):
        (B, n_video + n_text, H, D) in, same out. ``layer``: the calling processor's layer
        (``sp_attention(layer=)``; ``qk_override`` receives it too)."""
        lay = self.current
        text = lay.geometry.text_tokens
        if q.shape[1] != len(lay.video_ids) + text:
            raise ValueError(f"sparsp: attention got {q.shape[1]} tokens, expected "
                             f"{len(lay.video_ids)} video + {text} text tokens")
        if text and not lay.identity:
            idx = lay.on("attn_index", q.device)
            q, k, v = (t.index_select(1, idx) for t in (q, k, v))
        if self.qk_override is not None:
            q, k = self.qk_override(lay, q, layer)
        out = self._attention(q.contiguous(), k.contiguous(), v.contiguous(), lay, layer)
        if not text or lay.identity:
            return out
        full = torch.empty((q.shape[0], len(lay.video_ids) + text, *q.shape[2:]), dtype=out.dtype, device=out.device)
        full.index_copy_(1, lay.on("attn_index", q.device), out)
        if self.distributed:  # every rank needs the whole text output: its stream is replicated
            nv = len(lay.video_ids)
            parts = self._all_gather(out[:, nv:], 1, lay.text_parts)
            full[:, nv:].index_copy_(1, lay.on("text_order", q.device), torch.cat(parts, dim=1))
        return full

    def _attention(self, q, k, v, lay: TokenLayout, layer: int | None = None) -> torch.Tensor:
        if self.distributed:
            from ..strategies import sp_attention

            where = self.where
            place = dict(mesh=where.half_mesh, dims=where.half_dims) if where.half_mesh is not None \
                else dict(group=where.group)  # ulysses 1: the flat group= call over the sp group
            return sp_attention(q, k, v, **place, strategy=self.strategy, config=self.config, layer=layer,
                                step=self.step, branch=self.branch, _owner=self)
        from .reference import split_block_mask

        config = self.config.at_layer(layer)
        out, mask = self.reference.attend(q, k, v, lens=lay.lens, strategy=self.strategy, config=config, layer=layer,
                                          step=self.step, branch=self.branch, owner=self)
        if self.on_mask is not None:  # a dense run still reports the mask at its thresholds
            if not strategy_facts(self.strategy).sparse:  # a dense baseline's run ignores the thresholds
                mask = split_block_mask(q, k, lay.lens, config)
            self.on_mask(mask[0])
        return out

    @torch.compiler.disable
    def attend_video_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Dense attention of replicated queries (B, A, H, D) over the video keys/values held
        here; partial results of all ranks merged by LSE (fp32), the same on every rank."""
        qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))
        s = qh @ kh.transpose(-1, -2) * q.shape[-1] ** -0.5
        lse = torch.logsumexp(s, dim=-1)
        out = torch.softmax(s, dim=-1) @ vh
        if self.distributed:  # every piece's partial result, over the (sp x ulysses) sub-mesh
            pieces, group = self.where.pieces, self.where.sequence
            outs = [torch.empty_like(out) for _ in range(pieces)]
            lses = [torch.empty_like(lse) for _ in range(pieces)]
            dist.all_gather(outs, out.contiguous(), group=group)
            dist.all_gather(lses, lse.contiguous(), group=group)
            out, _ = merge_partials(zip(outs, lses))
        return out.transpose(1, 2).to(q.dtype)


# --- hooks ------------------------------------------------------------------------------------


def _bind(module, args, kwargs) -> inspect.BoundArguments:
    return inspect.signature(module.forward).bind_partial(*args, **kwargs)


def _geometry(rt: Runtime, model, bound: inspect.BoundArguments) -> VideoGeometry:
    plan, a = rt.plan, bound.arguments
    pt, ph, pw = plan.grid.patch(model.config)
    if plan.grid.source == "latent":
        x = a.get(plan.grid.arg)
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            raise ValueError(f"sparsp: {rt.model_name} expects {plan.grid.arg} (B, C, F, H, W), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
        t, h, w = x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw
    else:
        dims = [a.get(name) for name in (plan.grid.frames, plan.grid.height, plan.grid.width)]
        if any(not isinstance(d, int) for d in dims):
            raise ValueError(f"sparsp: {rt.model_name} needs the int forward arguments {plan.grid.frames}, "
                             f"{plan.grid.height}, {plan.grid.width} to know the video grid, got {dims}")
        t, h, w = (-(-d // p) for d, p in zip(dims, (pt, ph, pw)))
        x = a.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.shape[1] != t * h * w:
            raise ValueError(f"sparsp: hidden_states has {x.shape[1]} tokens but the grid {t}x{h}x{w} "
                             f"has {t * h * w}")
    text = 0
    if plan.text is not None:
        mask = a.get(plan.text.mask)
        counts = mask.sum(dim=1).tolist() if isinstance(mask, torch.Tensor) else []
        if not counts or len(set(counts)) != 1 or counts[0] < 1:
            raise ValueError(f"sparsp: {plan.text.mask} must mark the same number (>= 1) of valid text "
                             f"tokens in every sample, got {counts}; run samples of other lengths separately")
        text = int(counts[0])
    rt.text_tokens = text
    return VideoGeometry(frames=t, height=h, width=w, text_tokens=text, block_size=rt.config.block_size,
                         heads=rt.heads, head_dim=rt.head_dim, name=rt.model_name)


def _entry_hook(rt: Runtime):
    @torch.compiler.disable
    def hook(model, args, kwargs):
        bound = _bind(model, args, kwargs)
        for name, why in rt.plan.must_be_none.items():
            if bound.arguments.get(name) is not None:
                raise ValueError(f"sparsp: {rt.model_name} argument {name} is not supported: {why}")
        context, call = rt.context_hook.context, None
        if rt.halves is not None:  # CFG parallel: this half's share of the forward (``cfg.py``)
            call = rt.halves.begin(bound, context)
            context = rt.halves.context_of(call, context)
        # every check on every half, the one that skips the forward too, so all raise alike
        rt.current = rt.layout_for(_geometry(rt, model, bound))
        if call is not None and not call.compute:
            return bound.args, bound.kwargs
        # the step and branch of this forward (``steps.py``); the timestep is read (a host read)
        # only where the pipeline gives no step index and the config has a schedule to follow
        def timestep():
            return timestep_value(bound.arguments.get("timestep")) if rt.config.scheduled else None

        rt.step, rt.branch = rt.steps.advance(context, rt.current.geometry, timestep)
        for name, source in rt.plan.defaults.items():
            if bound.arguments.get(name) is None and bound.arguments.get(source) is not None:
                bound.arguments[name] = bound.arguments[source]
        for name, spec in rt.plan.entry.items():
            if bound.arguments.get(name) is not None:
                bound.arguments[name] = rt.split(bound.arguments[name], spec, name)
        return bound.args, bound.kwargs

    return hook


def _input_hook(rt: Runtime, specs: dict, where: str):
    @torch.compiler.disable
    def hook(module, args, kwargs):
        bound = _bind(module, args, kwargs)
        for name, spec in specs.items():
            if bound.arguments.get(name) is not None:
                bound.arguments[name] = rt.split(bound.arguments[name], spec, f"{where}({name})")
        return bound.args, bound.kwargs

    return hook


def _output_hook(rt: Runtime, specs: dict, where: str):
    @torch.compiler.disable
    def hook(module, args, output):
        if None in specs:
            return rt.split(output, specs[None], f"{where} output")
        out = list(output)
        for i, spec in specs.items():
            out[i] = rt.split(out[i], spec, f"{where} output {i}")
        return type(output)(out) if isinstance(output, tuple) else out

    return hook


def _text_hook(rt: Runtime):
    @torch.compiler.disable
    def hook(module, args, output):  # HunyuanVideo: the text stream, trimmed to its valid tokens
        return output[:, : rt.text_tokens]

    return hook


def _gather_hook(rt: Runtime, dim: int):
    @torch.compiler.disable
    def hook(module, args, output):
        return rt.gather(output, dim)

    return hook


# --- install and uninstall ----------------------------------------------------------------------


def modules_matching(model, patterns) -> dict[str, torch.nn.Module]:
    """``model``'s modules whose names match any of the ``fnmatch`` ``patterns``, in order."""
    return {n: m for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}


def install(transformer, plan: SplitPlan, attn: dict, *, where: Ranks, config: SparspConfig, strategy: str,
            kind: str, heads: int, head_dim: int):
    """``parallelize``'s steps 3-5 for one checked model: its runtime, the processors of its
    self-attention modules ``attn`` (name -> module) and its hooks; returns the model's
    ``cfg.Halves`` (None without CFG parallel)."""
    from . import context

    rt = Runtime(transformer, plan, where=where, config=config, strategy=strategy, placement=kind, heads=heads,
                 head_dim=head_dim)
    # 3. Attach the runtime: the model now knows it is parallelized.
    setattr(transformer, ATTR, rt)
    log.info("sparsp: parallelize %s: %s, %d self-attention modules, %d heads x %d", rt.model_name,
             rt.describe(), len(attn), heads, head_dim)
    # 4. Processors: video self-attention (and LTX-2's video-K/V attention); originals kept.
    proc_cls = PROCESSORS[plan.processor]
    for layer, (name, module) in enumerate(attn.items()):  # layer: its place in named_modules order
        rt.originals[name] = module.processor
        module.set_processor(proc_cls(rt, layer=layer))
    # attention over the sharded video keys (LTX-2's audio queries); one rank holds them all, so
    # there the model's own processor serves, on its fused kernel
    one = where.distributed and where.pieces == 1
    kv_modules = {} if one else modules_matching(transformer, plan.video_kv_attention)
    for name, module in kv_modules.items():
        rt.originals[name] = module.processor
        module.set_processor(VideoKVProcessor(rt))
    log.info("sparsp: installed %s processors on %d modules", proc_cls.__name__, len(rt.originals))
    # 5. Hooks: entry (CFG share, geometry, placement, entry tensors), token-carrying
    #    submodules, the text stream, and the output gather.
    modules = dict(transformer.named_modules())
    rt.handles.append(transformer.register_forward_pre_hook(_entry_hook(rt), with_kwargs=True))
    for where_, specs in plan.inputs.items():
        rt.handles.append(modules[where_].register_forward_pre_hook(_input_hook(rt, specs, where_), with_kwargs=True))
    for where_, specs in plan.outputs.items():
        rt.handles.append(modules[where_].register_forward_hook(_output_hook(rt, specs, where_)))
    if plan.text is not None:
        rt.handles.append(modules[plan.text.stream].register_forward_hook(_text_hook(rt)))
    for where_, dim in plan.gather.items():
        rt.handles.append(modules[where_].register_forward_hook(_gather_hook(rt, dim)))
    # the pipeline's cache context (its branch and step index) for the schedule (``steps.py``)
    rt.context_hook = context.add(transformer, rt.new_run)
    if where.cfg > 1:  # the model's forward runs, or not, as its CFG half's share says (``cfg.py``)
        from . import cfg

        rt.halves = cfg.Halves(transformer, plan, where)
        cfg.add(transformer, rt.halves)
    log.info("sparsp: hooked entry, %s, gather at %s%s", ", ".join([*plan.inputs, *plan.outputs]) or "-",
             ", ".join(plan.gather), ", CFG halves" if rt.halves is not None else "")
    return rt.halves


def uninstall(transformer) -> None:
    """Undo ``install``: the original processors back, every hook removed, the kept plans freed."""
    rt = getattr(transformer, ATTR, None)
    if rt is None:
        raise ValueError(f"{type(transformer).__name__} is not parallelized by sparsp")
    modules = dict(transformer.named_modules())
    for name, proc in rt.originals.items():
        modules[name].set_processor(proc)
    for h in rt.handles:
        h.remove()
    from ..strategies import schedule
    from . import context

    if rt.halves is not None:
        from . import cfg

        cfg.remove(transformer)
    context.remove(transformer)
    plans = schedule.forget(rt)  # its kept plans and branch counts
    rt.reference.forget()
    delattr(transformer, ATTR)
    log.info("sparsp: unparallelize %s: %d processors restored, %d kept plans freed", rt.model_name,
             len(rt.originals), plans)
