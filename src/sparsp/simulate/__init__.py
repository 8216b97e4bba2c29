"""``sparsp simulate``: a CPU cost model of every strategy on a fabric profile (issue 12).

``profiles``: built-in and calibrated hardware profiles; ``model``: per-rank, per-round work
from the exact demand of ``sparsp analyze`` and its timeline on a profile; ``job``: the
``sparsp simulate`` run (sweep over G, calibration, validation, JSON + PNG). Method, figures
and sources: docs/simulate.md.
"""

from .model import Timeline, Work, bottleneck, build_work, timeline
from .profiles import PROFILES, KernelFigure, Profile, TransportFigure, get_profile

__all__ = ["PROFILES", "KernelFigure", "Profile", "Timeline", "TransportFigure", "Work", "bottleneck",
           "build_work", "get_profile", "timeline"]
