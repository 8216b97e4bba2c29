"""A denoising run's cost from its calls: dense steps, plan steps and reuse steps.

A run of S steps follows ``SparspConfig``'s schedule (``dense_steps`` N, ``replan_every`` K;
``Schedule.kind`` is ``SparspConfig.step_kind``'s rule): step s < N runs exact dense attention
through the strategy's dense path (``dense_path``: the sequence-sharded strategies run the
dense baseline, the ``ring``; a head-sharded one its own all-to-all with the dense kernel); from
N on, step s solves a plan where (s − N) % K == 0 — the call as the model prices it, mask
phase included — and otherwise reuses the last one: the same call without its mask phase
(``Work.reused``: no metadata collective, no mask, no host read; the kept plan's bytes and
kernels). A step makes ``calls`` attention calls (the model's layers, times its guidance
branches where they run one after the other), so

    run = calls × (N × dense call + plans × plan call + reuses × reuse call)

(``run_cost``). Without a schedule every step plans: ``calls × S × plan call``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .figures import Demand, full_demand
from .model import Work, work

__all__ = ["STEPS", "DenseFacts", "Schedule", "call_works", "dense_path", "run_cost"]

STEPS = 50
"""Steps of a run when none are given (the pipelines' common default)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """A run's steps and its schedule (``SparspConfig.dense_steps``, ``replan_every``)."""

    steps: int = STEPS
    dense_steps: int = 0
    replan_every: int = 1

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("dense_steps", 0), ("replan_every", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= {low}, got {value!r}")
        if self.dense_steps > self.steps:
            raise ValueError(f"--dense-steps {self.dense_steps} exceeds the run's --steps {self.steps}")

    @property
    def scheduled(self) -> bool:
        """Some steps dense or some plans reused (else every step plans)."""
        return self.dense_steps > 0 or self.replan_every > 1

    def kind(self, step: int) -> str:
        """``"dense"``, ``"plan"`` or ``"reuse"``: what step ``step`` (from 0) does."""
        if step < self.dense_steps:
            return "dense"
        return "plan" if (step - self.dense_steps) % self.replan_every == 0 else "reuse"

    def counts(self) -> dict[str, int]:
        """How many steps of the run are dense, plan and reuse steps."""
        out = {"dense": 0, "plan": 0, "reuse": 0}
        for s in range(self.steps):
            out[self.kind(s)] += 1
        return out

    @property
    def summary(self) -> str:
        """What the run's steps do, in words."""
        n = self.counts()
        if not self.scheduled:
            return "every step plans"
        return f"{n['dense']} dense, {n['plan']} plan, {n['reuse']} reuse steps (replan every {self.replan_every})"

    def to_dict(self) -> dict:
        return {"steps": self.steps, "dense_steps": self.dense_steps, "replan_every": self.replan_every,
                "scheduled": self.scheduled, "summary": self.summary,
                **{f"{k}_steps_run": v for k, v in self.counts().items()}}


def run_cost(schedule: Schedule, *, plan_ms: float, reuse_ms: float, dense_ms: float, calls: int = 1) -> dict:
    """The run's time under ``schedule`` and with every step planning, from one call of each
    kind (ms) and the ``calls`` a step makes (module docstring): ``total_ms`` and
    ``per_step_ms`` each way, and the share of the run the schedule saves."""
    n = schedule.counts()
    total = calls * (n["dense"] * dense_ms + n["plan"] * plan_ms + n["reuse"] * reuse_ms)
    plain = calls * schedule.steps * plan_ms
    return {"calls_per_step": calls, "total_ms": round(total, 4), "per_step_ms": round(total / schedule.steps, 4),
            "every_step_plans_total_ms": round(plain, 4),
            "every_step_plans_per_step_ms": round(plain / schedule.steps, 4),
            "saved": round(1.0 - total / plain, 4) if plain > 0 else 0.0}


@dataclass(frozen=True, kw_only=True, slots=True)
class DenseFacts:
    """A head-sharded strategy's dense path: its own schedule on every block, no mask read."""

    name: str
    byte_rule: object
    sparse: bool = False
    local_first: bool = False


def dense_path(spec, baseline):
    """The facts (``model.StrategyFacts``) of the call a dense step of ``spec`` runs: the
    ``baseline`` (the registered dense ``ring``) for a sequence-sharded strategy, whose
    placement stays; the strategy's own all-to-all with the dense kernel for a head-sharded
    one. ``baseline`` may be None only for the latter."""
    if spec.byte_rule == "all-to-all":
        return DenseFacts(name=spec.name, byte_rule=spec.byte_rule)
    if baseline is None:
        raise ValueError(f"{spec.name}: a dense step runs the dense baseline; give its facts")
    return baseline


def call_works(spec, d: Demand, *, baseline=None, head_dim: int, dtype_bytes: int = 2, profile=None,
               transport: str | None = None, local_first=None, head_order=None) -> dict[str, Work]:
    """The work of each kind of step's call on demand ``d``: ``plan`` (``model.work``),
    ``reuse`` (the same without its mask phase) and ``dense`` (``dense_path`` on the full
    mask's demand, ``figures.full_demand``); keywords as ``model.work``'s."""
    kw = dict(head_dim=head_dim, dtype_bytes=dtype_bytes, profile=profile, transport=transport,
              local_first=local_first)
    plan = work(spec, d, head_order=head_order, **kw)
    dense = work(dense_path(spec, baseline), full_demand(d), **kw)
    return {"plan": plan, "reuse": plan.reused(), "dense": dense}
