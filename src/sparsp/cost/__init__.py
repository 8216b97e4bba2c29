"""The cost model: what one attention call costs each rank, on a machine profile (CPU only).

The runtime and ``sparsp simulate`` read the same model: ``strategy="auto"`` predicts every
candidate with it per call, the chunk rules decide the drain's units and the local-first order
from it, ``sparsp simulate`` sweeps it over G, and ``best_mesh`` picks a device mesh with it.

* ``machine``: what a machine profile holds (``Profile``); ``profiles``: the built-in ones
  and calibrated files (``get_profile``);
* ``figures``: a mask's demand in exact integers (``Blocks``, ``Demand``, ``measure``,
  ``demand_figures``);
* ``ops``: the host's op counts per kind of strategy;
* ``model``: per-rank, per-round ``Work`` from a ``Demand`` and a strategy's registered facts;
* ``flows``: the fabric's shared resources and the fluid simulation of transfers;
* ``timeline``: that work scheduled on a profile (several calls at once: ``timelines``);
* ``schedule``: a denoising run's dense, plan and reuse steps (``Schedule``, ``run_cost``);
* ``mesh``, ``mesh_step``: a cfg × ulysses × sp device mesh, its bytes and its step
  (``Mesh``, ``best_mesh``);
* ``chunks``: the chunk rules (units before the host read, chunks and their order after it);
* ``balance``: heads given to the ranks of a head-sharded strategy by their density.

A strategy reaches this package only as its registered facts (``model.StrategyFacts``: name,
``sparse``, ``byte_rule``, ``local_first``), so it imports no strategy, transport or kernel.
Method, figures and sources: docs/simulate.md.
"""

from .balance import balanced_heads, rank_loads
from .figures import Blocks, Demand, demand_figures, demand_of, full_demand, measure, pair_flops
from .machine import KernelFigure, KernelPoint, Profile, TransportFigure
from .mesh import Mesh, mesh_comm_bytes, valid_meshes
from .mesh_step import MeshStep, best_mesh, mesh_step
from .model import StrategyFacts, Work, build_work, gather_bytes, mask_bytes, resolve_local_first, work
from .profiles import PROFILES, get_profile
from .schedule import Schedule, call_works, run_cost
from .timeline import Timeline, bottleneck, mask_phase_ms, timeline, timelines

__all__ = ["PROFILES", "Blocks", "Demand", "KernelFigure", "KernelPoint", "Mesh", "MeshStep", "Profile", "Schedule",
           "StrategyFacts", "Timeline", "TransportFigure", "Work", "balanced_heads", "best_mesh", "bottleneck",
           "build_work", "call_works", "demand_figures", "demand_of", "full_demand", "gather_bytes", "get_profile",
           "mask_bytes", "mask_phase_ms", "measure", "mesh_comm_bytes", "mesh_step", "pair_flops", "rank_loads",
           "resolve_local_first", "run_cost", "timeline", "timelines", "valid_meshes", "work"]
