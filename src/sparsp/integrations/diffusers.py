"""``sparsp.parallelize`` / ``sparsp.unparallelize`` for Diffusers video transformers.

    import sparsp
    sparsp.parallelize(pipe.transformer, config=sparsp.SparspConfig(cdf_threshold=0.9))
    latents = pipe(prompt_embeds=..., output_type="latent").frames   # under torchrun

Supported: HunyuanVideo, Wan (2.1/2.2), LTX-Video and LTX-2 (its video self-attention); the
split of each is declared as data in ``plans.py``. What ``parallelize`` does, in this order:

1. validate everything that needs no communication (model class and config; strategy, never
   ``auto`` without a process group; placement; heads divisible by G for ``ulysses``; a
   thresholds table against the model's self-attention layers and heads) — ``ValueError``
   before any collective;
2. attach a ``Runtime`` (group, config, strategy, placement cache) to the model;
3. replace the processors of the video self-attention modules (and LTX-2's video-K/V
   attention) by sparsp processors, remembering the originals;
4. hook the model's forward (geometry of this call → placement; its step and branch for the
   schedule, ``steps.py``, from the pipeline's cache context, ``context.py``; cut entry
   tensors), the submodules whose inputs or outputs carry one entry per video token (cut to
   this rank's tokens in placed order: hidden states, RoPE), HunyuanVideo's text stream
   (trimmed to its valid tokens) and the output projection (all-gather, back to the original
   order).

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

import fnmatch
import inspect
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import SparspConfig
from ..geometry import VideoGeometry
from ..kernels import merge_partials
from ..placement import PLACEMENTS, Placement, make_placement
from .plans import Split, SplitPlan, plan_for
from .processors import PROCESSORS, VideoKVProcessor
from .steps import ScheduledReference, StepCounter, timestep_value

log = logging.getLogger("sparsp")

_ATTR = "_sparsp_runtime"


def _strategy_spec(strategy: str):
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

    spec = _strategy_spec(strategy)
    if strategy == AUTO and not distributed:
        raise ValueError(f"strategy={AUTO!r} picks a strategy per call from the demand of a process group's "
                         f"ranks; one process (no process group, or emulate_ranks) runs a fixed one: "
                         f"{', '.join(strategy_names())}")
    return spec


@dataclass
class TokenLayout:
    """Which tokens this process holds for one geometry, and how to put them back.

    ``video_ids``: original video token ids held here, in order (placed order; a rank's own in
    SP, all of them in the single-process mode). ``attn_index``: positions, in
    ``cat([held video, all text])``, of the attention sequence this process computes (its
    placed slice; the whole placed sequence in the single-process mode). ``lens``: tokens per
    slice of that sequence (the simulated ranks' in the single-process mode)."""

    geometry: VideoGeometry
    placement: Placement
    video_ids: torch.Tensor
    attn_index: torch.Tensor
    lens: list[int]
    video_parts: list[int]  # video tokens per rank (SP: gather sizes)
    video_order: torch.Tensor  # original order ← cat of every rank's video ids
    text_parts: list[int]  # text tokens per rank
    text_order: torch.Tensor  # text ids ← cat of every rank's text ids
    attn_tokens: torch.Tensor  # original token id of every token of the attention sequence
    cache: dict = field(default_factory=dict)
    identity: bool = False  # a group of one in the model's own order: nothing to cut, permute or gather

    def on(self, name: str, device) -> torch.Tensor:
        """An index tensor on ``device`` (moved once, kept)."""
        key = (name, str(device))
        if key not in self.cache:
            self.cache[key] = getattr(self, name).to(device)
        return self.cache[key]


class Runtime:
    """Per model: the group, config and strategy, the placement cache, the hooks, and where the
    forward now running is in its denoising run (``step``, ``branch``). It owns the model's
    kept plans (``sp_attention(_owner=)``)."""

    def __init__(self, model, plan: SplitPlan, *, group, ranks: int, rank: int, distributed: bool,
                 config: SparspConfig, strategy: str, placement: str, heads: int, head_dim: int):
        self.model_name = type(model).__name__
        self.plan, self.group, self.ranks, self.rank = plan, group, ranks, rank
        self.distributed, self.config, self.strategy = distributed, config, strategy
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
        self.reference = ScheduledReference()  # the single-process path's kept masks

    def new_run(self) -> None:
        """Count steps from 0 again (``sparsp.new_run``; a pipeline's end)."""
        from ..strategies import new_run

        self.steps.new_run()
        new_run(self)  # the branch counts of calls without a branch

    def describe(self) -> str:
        mode = f"rank {self.rank} of {self.ranks}" if self.distributed else f"1 process as {self.ranks} ranks"
        return f"{self.strategy}, {self.placement_kind}, {mode}"

    # --- geometry -> layout -----------------------------------------------------------------
    def layout_for(self, geom: VideoGeometry) -> TokenLayout:
        lay = self.layouts.get(geom)
        if lay is None:
            lay = self._make_layout(geom)
            self.layouts[geom] = lay
            log.info("sparsp: %s: new geometry %s → %r", self.model_name, geom.describe(), lay.placement)
        return lay

    def _make_layout(self, geom: VideoGeometry) -> TokenLayout:
        try:
            pl = make_placement(self.placement_kind, geom, self.ranks)
        except ValueError as e:
            raise ValueError(f"sparsp: {self.model_name} cannot split {geom.describe()} over {self.ranks} "
                             f"ranks: {e}; use a smaller config.block_size or fewer ranks") from None
        nv = geom.video_tokens
        vids, tids = [], []
        for r in range(self.ranks):
            ids = pl.perm[pl.token_slice(r)]
            vids.append(ids[ids < nv])
            tids.append(ids[ids >= nv] - nv)
        if self.distributed:
            r = self.rank
            attn_tokens = pl.perm[pl.token_slice(r)]
            video_ids = vids[r]
            attn_index = torch.cat([torch.arange(len(vids[r])), len(vids[r]) + tids[r]])
            lens = [len(vids[r]) + len(tids[r])]
        else:
            video_ids = torch.cat(vids)
            offsets = torch.tensor([0] + [len(x) for x in vids]).cumsum(0)
            attn_index = torch.cat([torch.cat([offsets[r] + torch.arange(len(vids[r])), nv + tids[r]])
                                    for r in range(self.ranks)])
            lens = pl.tokens_per_rank
            attn_tokens = pl.perm
        identity = self.ranks == 1 and bool((pl.perm == torch.arange(len(pl.perm))).all())
        return TokenLayout(geom, pl, video_ids, attn_index, lens, [len(x) for x in vids],
                           torch.argsort(torch.cat(vids)), [len(x) for x in tids], torch.cat(tids), attn_tokens,
                           identity=identity)

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
        return x.index_select(dim, lay.on("video_order", x.device))

    def _all_gather(self, x: torch.Tensor, dim: int, sizes: list[int]) -> list[torch.Tensor]:
        """Every rank's ``x`` (``sizes[r]`` entries along ``dim``), padded for the collective."""
        if self.ranks == 1:  # a group of one: nothing to gather
            return [x]
        x = x.movedim(dim, 0).contiguous()
        pad = max(sizes)
        buf = torch.zeros((pad, *x.shape[1:]), dtype=x.dtype, device=x.device)
        buf[: x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in range(self.ranks)]
        dist.all_gather(parts, buf, group=self.group)
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

            return sp_attention(q, k, v, group=self.group, strategy=self.strategy, config=self.config, layer=layer,
                                step=self.step, branch=self.branch, _owner=self)
        from .reference import split_block_mask

        config = self.config.at_layer(layer)
        out, mask = self.reference.attend(q, k, v, lens=lay.lens, strategy=self.strategy, config=config, layer=layer,
                                          step=self.step, branch=self.branch, owner=self)
        if self.on_mask is not None:  # a dense run still reports the mask at its thresholds
            if not _strategy_spec(self.strategy).sparse:  # a dense baseline's run ignores the thresholds
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
        if self.distributed:
            outs = [torch.empty_like(out) for _ in range(self.ranks)]
            lses = [torch.empty_like(lse) for _ in range(self.ranks)]
            dist.all_gather(outs, out.contiguous(), group=self.group)
            dist.all_gather(lses, lse.contiguous(), group=self.group)
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
        rt.current = rt.layout_for(_geometry(rt, model, bound))
        # the step and branch of this forward (``steps.py``); the timestep is read (a host read)
        # only where the pipeline gives no step index and the config has a schedule to follow
        def timestep():
            return timestep_value(bound.arguments.get("timestep")) if rt.config.scheduled else None

        rt.step, rt.branch = rt.steps.advance(rt.context_hook.context, rt.current.geometry, timestep)
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


# --- public API ---------------------------------------------------------------------------------


def _modules(model, patterns) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}


def parallelize(transformer, *, group=None, config: SparspConfig = SparspConfig(), strategy: str = "sparsp",
                placement: str = "auto", emulate_ranks: int | None = None):
    """Run ``transformer``'s video self-attention sequence-parallel over ``group`` (in place).

    Args:
        transformer: a Diffusers ``HunyuanVideoTransformer3DModel``, ``WanTransformer3DModel``,
            ``LTXVideoTransformer3DModel`` or ``LTX2VideoTransformer3DModel`` — the same model
            (same weights) on every rank of ``group``, called with the same inputs.
        group: the process group (``None``: the default group). A group of one process runs
            ``sp_attention`` on it (one GPU: the sparse kernel where the mask pays, else the
            dense one). With no process group (``torch.distributed`` not initialised),
            ``parallelize`` installs the single-process sparse processor (the reference).
        config: thresholds, block size, transport, kernel (``SparspConfig``).
        strategy: any registered strategy (``sparsp.strategies.registry.strategy_names()``;
            ``ring`` is the dense baseline), or ``auto`` over a process group (``check_strategy``).
        placement: ``contiguous``, ``periodic`` or ``auto`` (the strategy's own: periodic for
            ``sparsp`` and ``ring-relay``, contiguous for the rest).
        emulate_ranks: single-process mode for a group of this size: no communication, the
            placement and block cut of G ranks, so the masks are exactly theirs.

    Returns the same ``transformer``. ``ValueError`` (before any communication) for an
    unsupported model or option; ``unparallelize`` undoes everything.
    """
    # 1. Validate: model, options, group — nothing communicates yet.
    plan = plan_for(transformer)
    if getattr(transformer, _ATTR, None) is not None:
        raise ValueError(f"{type(transformer).__name__} is already parallelized; call sparsp.unparallelize first")
    for attr, bad in plan.unsupported_config.items():
        if getattr(transformer.config, attr, None) in bad:
            raise ValueError(f"sparsp.parallelize does not support {type(transformer).__name__} with "
                             f"{attr}={getattr(transformer.config, attr)!r}")
    if not isinstance(config, SparspConfig):
        raise ValueError(f"config must be a sparsp.SparspConfig, got {type(config).__name__}")
    if placement not in ("auto", *PLACEMENTS):
        raise ValueError(f"placement={placement!r} is not one of auto, {', '.join(PLACEMENTS)}")
    if emulate_ranks is not None:
        if group is not None:
            raise ValueError("emulate_ranks runs in one process: pass group=None with it")
        if isinstance(emulate_ranks, bool) or not isinstance(emulate_ranks, int) or emulate_ranks < 1:
            raise ValueError(f"emulate_ranks must be a positive int, got {emulate_ranks!r}")
        distributed, ranks, rank = False, emulate_ranks, 0
    elif dist.is_available() and dist.is_initialized():
        # any process group, one process included (``sp_attention`` on one GPU: its kernels, mask
        # and choice of the dense kernel, ``strategies/one_gpu.py``)
        distributed, ranks, rank = True, dist.get_world_size(group), dist.get_rank(group)
    elif group is not None:
        raise ValueError("group was given but torch.distributed is not initialised")
    else:
        distributed, ranks, rank = False, 1, 0
    spec = check_strategy(strategy, distributed=distributed)
    kind = spec.placement if placement == "auto" else placement  # auto: the strategy's own (§4.3)
    attn = _modules(transformer, plan.self_attention)
    if not attn:
        raise ValueError(f"{type(transformer).__name__} has no module matching {plan.self_attention}")
    first = next(iter(attn.values()))
    heads = first.heads
    head_dim = first.to_q.out_features // heads
    if spec.heads_divisible and heads % ranks:
        raise ValueError(f"{strategy} needs heads divisible by the group size: {type(transformer).__name__} "
                         f"has {heads} heads, G={ranks}")
    if config.table is not None:  # a table of another model: its layers x heads against this one's
        config.table.check(layers=len(attn), heads=heads,
                           what=f"{type(transformer).__name__} ({len(attn)} self-attention layers)")
    rt = Runtime(transformer, plan, group=group, ranks=ranks, rank=rank, distributed=distributed,
                 config=config, strategy=strategy, placement=kind, heads=heads, head_dim=head_dim)
    # 2. Attach the runtime: the model now knows it is parallelized.
    setattr(transformer, _ATTR, rt)
    log.info("sparsp: parallelize %s: %s, %d self-attention modules, %d heads x %d", rt.model_name,
             rt.describe(), len(attn), heads, head_dim)
    # 3. Processors: video self-attention (and LTX-2's video-K/V attention); originals kept.
    proc_cls = PROCESSORS[plan.processor]
    for layer, (name, module) in enumerate(attn.items()):  # layer: its place in named_modules order
        rt.originals[name] = module.processor
        module.set_processor(proc_cls(rt, layer=layer))
    # attention over the sharded video keys (LTX-2's audio queries); one rank holds them all, so
    # there the model's own processor serves, on its fused kernel
    kv_modules = _modules(transformer, plan.video_kv_attention) if not (distributed and ranks == 1) else {}
    for name, module in kv_modules.items():
        rt.originals[name] = module.processor
        module.set_processor(VideoKVProcessor(rt))
    log.info("sparsp: installed %s processors on %d modules", proc_cls.__name__, len(rt.originals))
    # 4. Hooks: entry (geometry, placement, entry tensors), token-carrying submodules, the text
    #    stream, and the output gather.
    modules = dict(transformer.named_modules())
    rt.handles.append(transformer.register_forward_pre_hook(_entry_hook(rt), with_kwargs=True))
    for where, specs in plan.inputs.items():
        rt.handles.append(modules[where].register_forward_pre_hook(_input_hook(rt, specs, where), with_kwargs=True))
    for where, specs in plan.outputs.items():
        rt.handles.append(modules[where].register_forward_hook(_output_hook(rt, specs, where)))
    if plan.text is not None:
        rt.handles.append(modules[plan.text.stream].register_forward_hook(_text_hook(rt)))
    for where, dim in plan.gather.items():
        rt.handles.append(modules[where].register_forward_hook(_gather_hook(rt, dim)))
    # the pipeline's cache context (its branch and step index) for the schedule (``steps.py``)
    from . import context

    rt.context_hook = context.add(transformer, rt.new_run)
    log.info("sparsp: hooked entry, %s, gather at %s", ", ".join([*plan.inputs, *plan.outputs]) or "-",
             ", ".join(plan.gather))
    return transformer


def unparallelize(transformer):
    """Undo ``parallelize``: the original processors back, hooks removed. Returns the model."""
    rt = getattr(transformer, _ATTR, None)
    if rt is None:
        raise ValueError(f"{type(transformer).__name__} is not parallelized by sparsp")
    modules = dict(transformer.named_modules())
    for name, proc in rt.originals.items():
        modules[name].set_processor(proc)
    for h in rt.handles:
        h.remove()
    from ..strategies import schedule
    from . import context

    context.remove(transformer)
    plans = schedule.forget(rt)  # its kept plans and branch counts
    rt.reference.forget()
    delattr(transformer, _ATTR)
    log.info("sparsp: unparallelize %s: %d processors restored, %d kept plans freed", rt.model_name,
             len(rt.originals), plans)
    return transformer


def new_run(transformer) -> None:
    """Start a new denoising run of the parallelized ``transformer``: its next forward is step
    0 (``sparsp.new_run``; a pipeline's own end starts one too, docs/diffusers.md "Schedules")."""
    rt = getattr(transformer, _ATTR, None)
    if rt is None:
        raise ValueError(f"{type(transformer).__name__} is not parallelized by sparsp")
    rt.new_run()


def runtime_of(transformer) -> Runtime | None:
    """The ``Runtime`` of a parallelized model (None otherwise)."""
    return getattr(transformer, _ATTR, None)
