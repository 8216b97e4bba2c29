"""What ``sparsp simulate`` is asked to do (``SimulateConfig``), checked when made, and the
synthetic masks it simulates on (``MaskCache``): every check before any work."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..analysis import DTYPE_BYTES
from ..cost.mesh import Mesh
from ..cost.model import LOCAL_FIRST, SCHEDULES
from ..cost.schedule import Schedule
from ..geometry import PRESETS, VideoGeometry, preset
from ..strategies.registry import strategy_names, strategy_spec

__all__ = ["BRANCHES", "PLACEMENTS", "RANKS", "MaskCache", "SimulateConfig", "default_ranks", "geometry", "modelled",
           "placement_for"]


PLACEMENTS = ("auto", "contiguous", "periodic")
RANKS = (2, 4, 8)
"""The G simulated when none are given: those of them the profile holds (``default_ranks``)."""
BRANCHES = {"wan2.1-14b": 2, "wan2.1-1.3b": 2, "ltx-video": 2, "ltx-video-161f": 2, "ltx-2": 3, "hunyuan-video": 1}
"""Guidance branches per denoising step of each preset's Diffusers 0.42.1 pipeline at its
defaults: Wan's cond and uncond forwards; LTX-Video's batched [uncond, cond] pair (two branches
in one call, priced here as two calls); LTX-2's cond/uncond pair, STG and modality forwards;
HunyuanVideo's one (a second only with ``true_cfg_scale`` > 1 and a negative prompt)."""


def default_ranks(gpus: int) -> tuple[int, ...]:
    """``RANKS`` up to ``gpus`` (the profile's, or the largest of several): ``sparsp simulate
    --fabric h200x2-nvlink`` simulates G = 2 without being told."""
    held = tuple(G for G in RANKS if G <= gpus)
    if not held:
        raise ValueError(f"a profile of {gpus} GPU(s) holds no G of {', '.join(map(str, RANKS))}; give --ranks")
    return held


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulateConfig:
    model: str = "hunyuan-video"
    """Preset name (``sparsp.geometry.PRESETS``)."""
    ranks: tuple[int, ...] = ()
    """Sequence-parallel degrees G to simulate; empty: ``default_ranks`` of the profile(s)."""
    fabric: str = "pcie4-8gpu-nop2p"
    """A built-in profile name or a profile JSON file."""
    cdf: tuple[float, ...] = (0.9,)
    strategies: tuple[str, ...] = ()
    """Empty: every registered strategy."""
    placement: str = "auto"
    """``auto``: each strategy's registered placement (as ``bench attention`` runs it)."""
    transport: str | None = None
    """A transport of the profile; None = its default (the copy-engine one)."""
    text: bool = False
    """Include the model's text tokens (``bench attention`` leaves them out by default)."""
    dtype: str = "bf16"
    prefetch: int = 1
    local_first: bool | None = LOCAL_FIRST
    """``SparspConfig.local_first`` of the simulated calls: strategies registered
    ``local_first`` launch the local kernel before the host read — None (the config's default,
    automatic): where ``model.local_first_pays`` says so on the simulated profile and transport,
    as ``Call.local_first_pays`` decides; True: always —; False: every strategy in order
    (``--no-local-first``)."""
    seed: int = 0
    fit_profile: tuple[Path, ...] = ()
    """``bench transport`` / ``bench kernel`` result files to fit the profile to (of its GPU:
    ``calibrate.check_machine``)."""
    validate: tuple[Path, ...] | None = None
    """``bench attention`` result files to predict; () = discover ``bench/results/attention-*.json``;
    None = no validation."""
    density_profile: Path | None = None
    """A per-(step, layer, head) density profile (``sparsp.workloads.density``) matching the preset: the
    whole model's step is predicted, each layer on its own calibrated masks (``simulate.layers``)."""
    step: int | None = None
    """With ``density_profile``: the profile's step (1-based); None: the mean over steps."""
    calibration: Path | None = None
    """With ``density_profile``: fitted parameters to reuse (``sparsp.workloads.calibration`` JSON);
    None: fit them now (and write ``out``/calibration.json)."""
    layers: int | None = None
    """With ``density_profile``: the model's first N layers; None: all of them."""
    fabrics: tuple[str, ...] = ()
    """With ``density_profile``: the profiles to predict on (names, profile JSON files, or
    ``all``: every built-in one); empty: ``fabric`` alone."""
    out: Path | None = None
    """Where a calibration fitted now is written (``density_profile``)."""
    steps: int = 50
    """Denoising steps of the run whose cost is reported (``cost.schedule``)."""
    dense_steps: int = 0
    """``SparspConfig.dense_steps`` of the run."""
    replan_every: int = 1
    """``SparspConfig.replan_every`` of the run."""
    branches: int | None = None
    """Guidance branches per step (the model's calls per step are its layers × these); None:
    the preset's pipeline default (``BRANCHES``)."""
    thresholds: Path | None = None
    """A per-(layer, head) thresholds table (``sparsp.thresholds``): each layer's masks at its
    own thresholds (the one-call sweep simulates layer 0's call)."""
    mesh: str | None = None
    """``auto`` or ``cfg=C,ulysses=U`` (``cost.mesh.Mesh.parse``; sp takes the rest of each G):
    the step of a device mesh (``simulate.meshes``) instead of the one-call sweep."""

    @property
    def schedule(self) -> Schedule:
        return Schedule(steps=self.steps, dense_steps=self.dense_steps, replan_every=self.replan_every)

    @property
    def calls_per_step(self) -> int:
        """Attention calls per denoising step: the model's layers × its branches."""
        return preset(self.model).layers * (BRANCHES[self.model] if self.branches is None else self.branches)

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"unknown --model {self.model!r}; choose one of {', '.join(PRESETS)}")
        for G in self.ranks:
            if not isinstance(G, int) or isinstance(G, bool) or G < 2:
                raise ValueError(f"--ranks must be ints >= 2, got {G!r}")
        for c in self.cdf:
            if not 0.0 <= c <= 1.0:
                raise ValueError(f"--cdf values must lie in [0, 1], got {c}")
        for s in self.strategies:
            if s not in strategy_names():
                raise ValueError(f"unknown --strategy {s!r}; choose from {', '.join(strategy_names())}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(f"--prefetch must be an int >= 1, got {self.prefetch!r}")
        if self.local_first is not None and not isinstance(self.local_first, bool):
            raise ValueError(f"local_first must be None (automatic), True or False, got {self.local_first!r}")
        self.schedule  # noqa: B018  (its checks: ValueError before any work)
        if self.mesh is not None and self.mesh != "auto":
            for G in self.ranks:
                Mesh.parse(self.mesh, G)
        if self.branches is not None and (not isinstance(self.branches, int) or self.branches < 1):
            raise ValueError(f"--branches must be an int >= 1, got {self.branches!r}")
        if self.density_profile is None:
            for name, value in (("--step", self.step), ("--calibration", self.calibration),
                                ("--layers", self.layers),
                                ("several --fabric", None if self.mesh is not None else self.fabrics or None)):
                if value is not None:
                    raise ValueError(f"{name} needs --density-profile")
        else:
            if self.validate is not None:
                raise ValueError("--validate cannot apply with --density-profile: it predicts bench attention "
                                 "rows, measured on synthetic masks; drop one of them")
            if self.text:
                raise ValueError("--text cannot apply with --density-profile: the calibrated masks are those of "
                                 "`sparsp analyze`, on the preset's whole sequence; drop --text")
            if self.fit_profile and len(self.fabric_names()) > 1:
                raise ValueError("--fit-profile fits one profile: give one --fabric with it")
            given = [name for name, on in (("--steps", self.steps != 50), ("--dense-steps", self.dense_steps != 0),
                                           ("--replan-every", self.replan_every != 1),
                                           ("--branches", self.branches is not None), ("--mesh", self.mesh is not None))
                     if on]
            if given:
                raise ValueError(f"{' and '.join(given)} cannot apply with --density-profile: it predicts one step "
                                 f"of every layer; drop {'it' if len(given) == 1 else 'them'}")
            if self.layers is not None and self.layers < 1:
                raise ValueError(f"--layers must be >= 1, got {self.layers}")

    def fabric_names(self) -> tuple[str, ...]:
        """The profiles asked for: ``fabrics`` (``all``: every built-in one), else ``fabric``."""
        from ..names import PROFILE_NAMES

        names = self.fabrics or (self.fabric,)
        out = tuple(dict.fromkeys(n for f in names for n in (PROFILE_NAMES if f == "all" else (f,))))
        return out


def geometry(model: str, text: bool = False) -> VideoGeometry:
    g = preset(model)
    return g if text else replace(g, text_tokens=0)


class MaskCache:
    """Synthetic masks bool [heads, nB, nB] of layer 0 per (geometry, cdf), made once per run;
    ``table``: a ``sparsp.thresholds.ThresholdTable`` whose layer-0 values replace the cdf."""

    def __init__(self, seed: int = 0, table=None) -> None:
        self.seed, self.table = seed, table
        self._masks: dict = {}

    def get(self, geom: VideoGeometry, cdf: float) -> torch.Tensor:
        from ..workloads.synthetic import synthetic_masks

        key = (geom, float(cdf))
        if key not in self._masks:
            self._masks[key] = synthetic_masks(geom, [float(cdf)], seed=self.seed,
                                               thresholds=self.table)[float(cdf)][0]
        return self._masks[key]


def modelled(strategy: str) -> bool:
    """Whether the cost model schedules ``strategy``: its byte rule is one of ``SCHEDULES`` (a
    strategy registered with a byte-rule function is accounted by ``sparsp analyze`` only)."""
    rule = strategy_spec(strategy).byte_rule
    return isinstance(rule, str) and rule in SCHEDULES


def placement_for(strategy: str, kind: str) -> str:
    return strategy_spec(strategy).placement if kind == "auto" else kind
