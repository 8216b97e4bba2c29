"""``sparsp simulate``: a CPU cost model of every strategy on a fabric profile (issue 12).

``profiles``: built-in and calibrated hardware profiles; ``model``: per-rank, per-round work
from the exact demand of ``sparsp analyze`` (or of one call's mask: ``strategy="auto"``) and
its timeline on a profile; ``job``: the
``sparsp simulate`` run (sweep over G, calibration, validation, JSON + PNG). Method, figures
and sources: docs/simulate.md.
"""

from .model import Blocks, Demand, Work, build_work, measure, work
from .timeline import Timeline, bottleneck, timeline
from .profiles import PROFILES, KernelFigure, Profile, TransportFigure, get_profile

__all__ = ["PROFILES", "Blocks", "Demand", "KernelFigure", "Profile", "Timeline", "TransportFigure", "Work",
           "bottleneck", "build_work", "get_profile", "measure", "timeline", "work"]
