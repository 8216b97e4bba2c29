"""CFG parallel: the forwards of one denoising step spread over the two halves of a mesh.

On a mesh with ``cfg`` = 2 each half is an (sp x ulysses) mesh of its own, and each rank
computes one half of a step's branches; the predictions are exchanged once per step over the
cfg group, so every rank continues the pipeline's own guidance and scheduler code unchanged
(docs/diffusers.md, "CFG parallel"). A forward is, by its cache context and batch:

* **split**: an even batch (LTX-Video's and LTX-2's batched [uncond, cond] "cond_uncond", or a
  bare transformer's batch): each half computes its half of the samples (every argument the
  split plan names in ``batch``), and the outputs are all-gathered at model exit;
* **paired** (``plans.PIPELINES``, from the arguments of ``pipe(...)``): two forwards made one
  after the other on the same latents. *Deferred* (Wan's and HunyuanVideo's "cond" then
  "uncond", whose first result the pipeline reads only after the second returns): half 0
  computes the first while half 1 returns a placeholder of the result's shape and type
  (``plans.Output``), half 1 computes the second while half 0 returns one, and at the end of
  the second forward the halves exchange their results and fill the placeholders in place.
  *Ahead* (LTX-2's "uncond_stg" then "uncond_modality", whose first result is read at once):
  at the first forward half 0 computes it and half 1 the second from the first's arguments
  with the pair's ``ahead`` ones set; they exchange at once; the second forward returns the
  result kept for it after checking its arguments are those it was computed with;
* **whole**: any other forward inside ``pipe(...)`` (a step with one branch of an odd batch)
  runs whole on both halves, with one warning per run; outside a pipeline's call (a bare
  transformer) an odd batch is refused.

A placeholder holds NaN until it is filled; a placeholder still unfilled when another forward
arrives, or when ``pipe(...)`` returns, is a ``RuntimeError`` naming the pipeline, never a
result. ``wrap_pipeline`` gives the pipeline instance a subclass whose ``__call__`` reads the
pairs from its arguments (``unwrap_pipeline`` restores its class).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from diffusers.hooks.hooks import HookRegistry, ModelHook

from .plans import Pair, PipelineRule, SplitPlan

log = logging.getLogger("sparsp")

NAME = "sparsp_cfg"
"""The model's CFG hook in its ``HookRegistry``."""
ORIGINAL = "_sparsp_original_class"
"""The attribute of a wrapped pipeline's class that holds the class it replaced."""

__all__ = ["Halves", "NAME", "Run", "unwrap_pipeline", "wrap_pipeline"]


@dataclass
class Run:
    """One ``pipe(...)`` call: the pipeline's name, the pairs its arguments turn on (first
    branch -> pair) and whether its one warning was given."""

    pipeline: str
    pairs: dict
    warned: bool = False


@dataclass
class _Call:
    """What one forward does on this half (module docstring): ``kind`` is ``whole``,
    ``split``, ``first`` or ``second`` (a deferred pair's), ``ahead`` or ``kept`` (an ahead
    pair's first and second); ``compute``: this half runs the model."""

    kind: str
    compute: bool = True
    pair: Pair | None = None
    arguments: dict = field(default_factory=dict)  # the forward's arguments, defaults applied
    branch: str | None = None  # the branch this half computes, where not the context's


@dataclass
class _Pending:
    """A pair whose first forward has returned: this half's own result of it (None where it
    returned a placeholder), the placeholders to fill, or the second's result computed ahead
    with the arguments it was computed from."""

    pair: Pair
    own: list | None = None
    placeholders: list | None = None
    kept: object = None
    arguments: dict | None = None


class Halves:
    """CFG parallel of one parallelized model (its ``Runtime.halves``)."""

    def __init__(self, model, plan: SplitPlan, ranks) -> None:
        self.model_name = type(model).__name__
        self.plan, self.ranks, self.config = plan, ranks, model.config
        self.signature = inspect.signature(model.forward)
        self.run: Run | None = None
        self.pending: _Pending | None = None
        self.call: _Call | None = None

    # --- a pipeline's call -------------------------------------------------------------------
    def start(self, run: Run) -> None:
        self.run, self.pending = run, None

    def end(self, failed: bool) -> str | None:
        """The run is over: what is wrong with it (a placeholder left unfilled), or None."""
        pending, run = self.pending, self.run
        self.run = self.pending = self.call = None
        if pending is None or failed:
            return None
        return (f"sparsp: {run.pipeline}: its {pending.pair.first!r} forward waits for its {pending.pair.second!r} "
                f"forward, but the pipeline's call returned without it: its result would be a placeholder")

    # --- a forward: its entry ------------------------------------------------------------------
    def begin(self, bound: inspect.BoundArguments, context) -> _Call:
        """Decide this forward (module docstring) and cut ``bound``'s arguments to this half
        (a split batch, an ahead pair's second arguments); every check here is made before any
        communication."""
        name = None if context is None else context.name
        pending = self.pending
        if pending is not None:
            pair, arguments = pending.pair, self._arguments(bound)
            if name != pair.second:
                self.pending = None
                raise RuntimeError(f"sparsp: {self._who()}: its {pair.first!r} forward waits for its {pair.second!r} "
                                   f"forward, but a {name!r} forward came: the placeholder of {pair.first!r} would "
                                   f"stay unfilled (the pipeline does not make the forwards sparsp's rule for it "
                                   f"says, integrations/plans.py PIPELINES)")
            if pair.ahead is not None:
                self._check_ahead(pending, arguments)
                self.call = _Call("kept", compute=False, pair=pair)
            else:
                self.call = _Call("second", compute=self.ranks.half == 1, pair=pair, arguments=arguments)
            return self.call
        pair = self.run.pairs.get(name) if self.run is not None else None
        arguments = {} if pair is None else self._arguments(bound)  # a pair's placeholders and checks read them
        if pair is not None and pair.ahead is not None:
            self.call = _Call("ahead", pair=pair, arguments=arguments)
            if self.ranks.half == 1:  # the second forward of the pair, from the first's arguments
                for key, value in pair.ahead.items():
                    bound.arguments[key] = value
                self.call.branch = pair.second
        elif pair is not None:
            self.call = _Call("first", compute=self.ranks.half == 0, pair=pair, arguments=arguments)
        else:
            self.call = self._unpaired(bound, name)
        return self.call

    @staticmethod
    def context_of(call: _Call, context):
        """The cache context this half's forward counts its step under: the pipeline's, or one
        naming the branch it computes instead (an ahead pair's second)."""
        if call.branch is None or context is None:
            return context
        return replace(context, name=call.branch)

    def _arguments(self, bound) -> dict:
        full = self.signature.bind(*bound.args, **bound.kwargs)
        full.apply_defaults()
        return dict(full.arguments)

    def _who(self) -> str:
        return self.run.pipeline if self.run is not None else self.model_name

    def _unpaired(self, bound, name) -> _Call:
        x = bound.arguments.get("hidden_states")
        batch = x.shape[0] if isinstance(x, torch.Tensor) else 0
        if batch % 2 == 0 and batch:
            half = batch // 2
            for arg in self.plan.batch:
                value = bound.arguments.get(arg)
                if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] == 1:
                    continue  # absent, or a broadcast over the batch
                if value.shape[0] != batch:
                    raise ValueError(f"sparsp: {self.model_name} argument {arg} has {value.shape[0]} entries along "
                                     f"dim 0; the batch (hidden_states) has {batch}")
                bound.arguments[arg] = value[self.ranks.half * half:(self.ranks.half + 1) * half]
            return _Call("split")
        if self.run is None:
            raise ValueError(f"sparsp: {self.model_name} on a mesh with cfg=2 splits the batch of a forward over the "
                             f"two halves; this forward's batch is {batch}: pass an even batch (e.g. [uncond, cond]), "
                             f"or parallelize the pipeline (sparsp.parallelize(pipe, mesh=...)) to pair its forwards")
        if not self.run.warned:
            self.run.warned = True
            log.warning("sparsp: %s: the %r forward has one branch of batch %d: both CFG halves compute it whole "
                        "(cfg=2 gains nothing in this run's steps)", self.run.pipeline, name, batch)
        return _Call("whole")

    def _check_ahead(self, pending: _Pending, arguments: dict) -> None:
        """The second forward of an ahead pair must have the arguments it was computed with."""
        for key in sorted(set(arguments) | set(pending.arguments)):
            want, got = pending.arguments.get(key), arguments.get(key)
            if not _same(want, got):
                self.pending = None
                raise RuntimeError(f"sparsp: {self._who()}: its {pending.pair.second!r} forward was computed ahead "
                                   f"from the {pending.pair.first!r} forward's arguments, but its argument {key} "
                                   f"differs from them (integrations/plans.py PIPELINES)")

    # --- a forward: its result -----------------------------------------------------------------
    def finish(self, call: _Call, output):
        """This forward's result on this half (module docstring): the exchange over the cfg
        group where the call has one."""
        self.call = None
        if call.kind == "whole":
            return output
        if call.kind == "split":
            return self._rebuilt(output, [torch.cat(parts, dim=0) for parts in zip(*self._gather(self._tensors(output)))])
        if call.kind == "kept":
            kept, self.pending = self.pending.kept, None
            return kept
        if call.kind == "ahead":
            halves = self._gather(self._tensors(output))
            first, second = self._rebuilt(output, halves[0]), self._rebuilt(output, halves[1])
            arguments = dict(call.arguments)
            arguments.update(call.pair.ahead)
            self.pending = _Pending(call.pair, kept=second, arguments=arguments)
            return first
        if call.kind == "first":
            if call.compute:
                self.pending = _Pending(call.pair, own=self._tensors(output))
                return output
            placeholders = self._placeholders(call.arguments)
            self.pending = _Pending(call.pair, placeholders=placeholders)
            return self._structure(placeholders, call.arguments)
        # the second forward of a deferred pair: exchange, fill the placeholders
        pending, self.pending = self.pending, None
        if call.compute:
            own, mine = self._tensors(output), pending.placeholders
        else:
            output = mine = self._placeholders(call.arguments)
            own = pending.own
            output = self._structure(output, call.arguments)
        halves = self._gather(own, like=mine)
        for placeholder, value in zip(mine, halves[1 - self.ranks.half]):
            placeholder.copy_(value)
        return output

    def _tensors(self, output) -> list:
        if isinstance(output, tuple):
            return list(output)
        return [output[name] for name in self.plan.output.fields]

    def _rebuilt(self, like, tensors: list):
        """``tensors`` in the structure of the model's result ``like``."""
        if isinstance(like, tuple):
            return tuple(tensors)
        return type(like)(**dict(zip(self.plan.output.fields, tensors)))

    def _structure(self, tensors: list, arguments: dict):
        """``tensors`` as the forward returns them: a tuple with ``return_dict=False``, else
        the plan's output class."""
        if not arguments.get("return_dict", True):
            return tuple(tensors)
        module, name = self.plan.output.cls.split(":")
        return getattr(importlib.import_module(module), name)(**dict(zip(self.plan.output.fields, tensors)))

    def _placeholders(self, arguments: dict) -> list:
        """The forward's result as NaN tensors of its shapes and types (``plans.Output``)."""
        out = []
        for like in self.plan.output.fields.values():
            x = arguments[like.arg]
            shape = list(x.shape)
            shape[like.dim] = like.size(self.config)
            out.append(torch.full(shape, float("nan"), dtype=x.dtype, device=x.device))
        return out

    def _gather(self, tensors: list, like: list | None = None) -> list[list]:
        """Every half's ``tensors`` (one all-gather of them packed over the cfg group), by half;
        ``like``: the tensors the other half sends, where not shaped as this half's."""
        like = tensors if like is None else like
        if [tuple(t.shape) for t in tensors] != [tuple(t.shape) for t in like] or \
                len({t.dtype for t in [*tensors, *like]}) != 1:
            raise RuntimeError(f"sparsp: {self._who()}: the CFG halves' results differ in shape or type "
                               f"({[tuple(t.shape) for t in tensors]} against {[tuple(t.shape) for t in like]}); "
                               f"the model's output rule (integrations/plans.py) does not fit its forward")
        flat = torch.cat([t.reshape(-1) for t in tensors])
        parts = [torch.empty_like(flat) for _ in range(self.ranks.cfg)]
        dist.all_gather(parts, flat, group=self.ranks.groups.cfg)
        out = []
        for half in range(self.ranks.cfg):
            buf, tensors_of = parts[self.ranks.cfg_peers[half]], []
            for t in like:
                tensors_of.append(buf[:t.numel()].view(t.shape))
                buf = buf[t.numel():]
            out.append(tensors_of)
        return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and (a is b or torch.equal(a, b)))
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # containers of tensors
        return a is b


# --- the model's forward ------------------------------------------------------------------------


class CfgHook(ModelHook):
    """Runs the model's forward where this half computes the call, and hands its result (or
    none) to ``Halves.finish``: a hook in the model's Diffusers ``HookRegistry`` (its forward
    is the registry's), so ``unparallelize`` removes it by name."""

    def __init__(self, halves: Halves) -> None:
        super().__init__()
        self.halves = halves

    def new_forward(self, module, *args, **kwargs):
        call = self.halves.call
        if call is None:  # the entry hook decides every call
            raise RuntimeError("sparsp: a CFG-parallel forward ran without its entry hook")
        output = self.fn_ref.original_forward(*args, **kwargs) if call.compute else None
        return _finish(self.halves, call, output)


@torch.compiler.disable
def _finish(halves: Halves, call: _Call, output):
    return halves.finish(call, output)


def add(model, halves: Halves) -> None:
    HookRegistry.check_if_exists_or_initialize(model).register_hook(CfgHook(halves), NAME)


def remove(model) -> None:
    HookRegistry.check_if_exists_or_initialize(model).remove_hook(NAME, recurse=False)


# --- the pipeline's call ------------------------------------------------------------------------


def wrap_pipeline(pipe, rule: PipelineRule, halves: list[Halves]) -> None:
    """Give ``pipe`` a subclass of its class whose ``__call__`` binds the call's arguments, starts
    a ``Run`` of the pairs ``rule`` reads from them on every model's ``Halves``, calls the
    pipeline and ends the run (a placeholder left unfilled: ``RuntimeError``)."""
    original = type(pipe)
    call = original.__call__
    signature = inspect.signature(call)

    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        run = Run(original.__name__, {p.first: p for p in rule.pairs(bound.arguments)})
        for h in halves:
            h.start(run)
        failed = True
        try:
            out = call(self, *args, **kwargs)
            failed = False
        finally:
            errors = [e for e in (h.end(failed) for h in halves) if e is not None]
        if errors:
            raise RuntimeError(errors[0])
        return out

    pipe.__class__ = type(original.__name__, (original,), {"__call__": __call__, ORIGINAL: original,
                                                           "__module__": original.__module__,
                                                           "__qualname__": original.__qualname__})


def unwrap_pipeline(pipe) -> None:
    """Give ``pipe`` its own class back."""
    original = getattr(type(pipe), ORIGINAL, None)
    if original is not None and ORIGINAL in type(pipe).__dict__:
        pipe.__class__ = original
