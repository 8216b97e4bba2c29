"""The cost model: what one attention call costs each rank, on a machine profile (CPU only).

The runtime and ``sparsp simulate`` read the same model: ``strategy="auto"`` predicts every
candidate with it per call, the chunk rules decide the drain's units and the local-first order
from it, and ``sparsp simulate`` sweeps it over G.

* ``profiles``: built-in and calibrated hardware profiles (``get_profile``);
* ``figures``: a mask's demand in exact integers (``Blocks``, ``Demand``, ``measure``,
  ``demand_figures``);
* ``ops``: the host's op counts per kind of strategy;
* ``model``: per-rank, per-round ``Work`` from a ``Demand`` and a strategy's registered facts;
* ``timeline``: that work scheduled on a profile;
* ``chunks``: the chunk rules (units before the host read, chunks and their order after it);
* ``balance``: heads given to the ranks of a head-sharded strategy by their density.

A strategy reaches this package only as its registered facts (``model.StrategyFacts``: name,
``sparse``, ``byte_rule``, ``local_first``), so it imports no strategy, transport or kernel.
Method, figures and sources: docs/simulate.md.
"""

from .balance import balanced_heads, rank_loads
from .figures import Blocks, Demand, demand_figures, demand_of, measure, pair_flops
from .model import StrategyFacts, Work, build_work, gather_bytes, mask_bytes, resolve_local_first, work
from .profiles import PROFILES, KernelFigure, KernelPoint, Profile, TransportFigure, get_profile
from .timeline import Timeline, bottleneck, timeline

__all__ = ["PROFILES", "Blocks", "Demand", "KernelFigure", "KernelPoint", "Profile", "StrategyFacts", "Timeline",
           "TransportFigure", "Work", "balanced_heads", "bottleneck", "build_work", "demand_figures", "demand_of",
           "gather_bytes", "get_profile", "mask_bytes", "measure", "pair_flops", "rank_loads", "resolve_local_first",
           "timeline", "work"]
