"""Where a parallelized model's forward is in its denoising run, for ``SparspConfig``'s schedule.

``sp_attention`` follows the schedule (``dense_steps``, ``replan_every``) for a call that says
its step and branch; a pipeline says neither, so the integration counts them (docs/diffusers.md,
"Schedules"). Diffusers 0.42 pipelines wrap every transformer call in
``transformer.cache_context(name, ...)``, which reaches the ``StateManager`` of every stateful
hook in the model's ``HookRegistry``: ``context.ContextHook`` is such a hook, registered by
``parallelize``, and the model's entry hook reads its context at each forward
(``StepCounter.advance``):

* the context's name is the branch (Wan: ``cond``, ``uncond``; LTX-Video: ``cond_uncond``;
  LTX-2: ``cond_uncond``, ``uncond_stg``, ``uncond_modality``; HunyuanVideo: ``cond``, and
  ``uncond`` with ``true_cfg_scale > 1`` and a negative prompt);
* the step is the context's ``step_index`` where the pipeline gives it (Wan, whose index counts
  the whole run across Wan 2.2's two experts), else the count of this run's earlier forwards of
  the same branch and geometry (a geometry first seen mid-run starts at step 0, its own plans);
* a run starts over where ``step_index`` goes back (to 0: a new ``pipe(...)``), where the
  timestep rises (read from the forward's ``timestep`` only when the pipeline gives no index
  and the config has a schedule: one host read per forward), at the pipeline's end (its
  ``maybe_free_model_hooks`` resets the stateful hooks) and at ``sparsp.new_run(transformer)``.

A forward without a context (``bench e2e``, a model called by hand) counts forwards per
geometry under branch None. Every rank makes the same forwards with the same contexts, so
every rank counts the same steps.

The single-process path (no process group, or ``emulate_ranks``) follows the same schedule in
``ScheduledReference``: dense steps attend to every block, a reuse step attends under the mask
of the last plan step of the same (layer, branch, geometry), kept eight blocks a byte, at most
``kept_plans`` of them (the least recently used dropped first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import torch

from ..config import SparspConfig
from ..masks import pack_bits, unpack_bits

class StepCounter:
    """The (step, branch) of each forward of one parallelized model, counted per run."""

    def __init__(self) -> None:
        self.counts: dict = {}  # (branch, geometry) -> forwards counted in this run
        self.last_index: int | None = None
        self.last_timestep: float | None = None

    def new_run(self) -> None:
        self.counts.clear()
        self.last_index = self.last_timestep = None

    def advance(self, context, geometry, timestep=lambda: None) -> tuple[int, str | None]:
        """The (step, branch) of a forward of ``geometry`` under ``context`` (a Diffusers
        ``CacheContext``, or None); ``timestep()`` reads the forward's timestep (None: not
        known), called only where the context has no ``step_index``."""
        if context is None:
            return self._count(None, geometry), None
        index = context.step_index
        if index is not None:
            if self.last_index is not None and index < self.last_index:
                self.new_run()
            self.last_index = index
            return int(index), context.name
        t = timestep()
        if t is not None and self.last_timestep is not None and t > self.last_timestep:
            self.new_run()  # noise added back: a new run of a pipeline that gives no index
        self.last_timestep = t
        return self._count(context.name, geometry), context.name

    def _count(self, branch, geometry) -> int:
        step = self.counts.get((branch, geometry), 0)
        self.counts[(branch, geometry)] = step + 1
        return step


def timestep_value(value) -> float | None:
    """The largest timestep of a forward's ``timestep`` argument (a number, or a tensor of one
    per sample or per token); None when there is none."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().max()) if value.numel() else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class ScheduledReference:
    """The single-process attention under a schedule: the reference's arguments for each call,
    and the masks kept for reuse steps."""

    def __init__(self) -> None:
        self.masks: OrderedDict = OrderedDict()  # key -> (packed mask, blocks), least recently used first

    def attend(self, q, k, v, *, lens, strategy: str, config: SparspConfig, layer, step, branch, owner):
        """``reference_sp_attention`` of this call as ``config``'s schedule has it (``config``:
        the layer's); returns (out, the mask it attended under)."""
        from ..strategies import schedule
        from .reference import reference_sp_attention

        key = mask = None
        if step is not None and config.scheduled:
            kind = config.step_kind(step)
            if kind == "dense":  # as sp_attention's dense path: every block, exact
                config = replace(config, cdf_threshold=1.0, sim_threshold=None)
            elif config.replan_every > 1:
                branch = schedule.branch_of(owner, layer, step, branch)
                key = (layer, branch, tuple(q.shape), tuple(lens), q.dtype, str(q.device))
                mask = self._lookup(key) if kind == "reuse" else None
        out, used = reference_sp_attention(q, k, v, lens=lens, strategy=strategy, config=config,
                                           return_mask=True, mask=mask)
        if key is not None and mask is None:
            self._keep(key, used, config.kept_plans)
        return out, used

    def _lookup(self, key):
        kept = self.masks.get(key)
        if kept is None:
            return None
        self.masks.move_to_end(key)
        return unpack_bits(*kept)

    def _keep(self, key, mask: torch.Tensor, limit: int) -> None:
        self.masks[key] = (pack_bits(mask), mask.shape[-1])
        self.masks.move_to_end(key)
        while len(self.masks) > limit:
            self.masks.popitem(last=False)

    def forget(self) -> None:
        self.masks.clear()


__all__ = ["ScheduledReference", "StepCounter", "timestep_value"]
