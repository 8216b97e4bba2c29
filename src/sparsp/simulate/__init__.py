"""``sparsp simulate``: a CPU cost model of every strategy on a fabric profile (issue 12).

``profiles``: built-in and calibrated hardware profiles; ``model``: per-rank, per-round work
from the exact demand of ``sparsp analyze`` (or of one call's mask: ``strategy="auto"``);
``timeline``: that work scheduled on a profile; ``calibrate``: a profile fitted to ``bench
transport`` and ``bench kernel`` results; ``opcount``: the host's op counts the model charges;
``job``: the ``sparsp simulate`` run (sweep over G, validation, JSON + PNG). Method, figures
and sources: docs/simulate.md.
"""

from .model import Blocks, Demand, Work, build_work, measure, work
from .timeline import Timeline, bottleneck, timeline
from .profiles import PROFILES, KernelFigure, KernelPoint, Profile, TransportFigure, get_profile

__all__ = ["PROFILES", "Blocks", "Demand", "KernelFigure", "KernelPoint", "Profile", "Timeline", "TransportFigure",
           "Work", "bottleneck", "build_work", "get_profile", "measure", "timeline", "work"]
