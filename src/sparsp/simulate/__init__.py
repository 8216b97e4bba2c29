"""``sparsp simulate``: the cost model (``sparsp.cost``) swept over strategies and G on a profile.

``job``: the ``sparsp simulate`` run (sweep over G, validation, JSON + PNG); ``layers``: with
a density profile, the whole model's step, layer by layer on calibrated masks; ``calibrate``: a
profile fitted to ``bench transport`` and ``bench kernel`` results; ``opcount``: recounts the
host's op counts the model charges (``cost.ops``); ``cli``: the command line. ``model``,
``profiles`` and ``timeline`` are the cost model's modules as this package has always named
them, with strategies also taken by their registered name (``model.work("sparsp", ...)``).
Method, figures and sources: docs/simulate.md.
"""

_HOMES = {
    **dict.fromkeys(("PROFILES", "KernelFigure", "KernelPoint", "Profile", "TransportFigure", "get_profile"),
                    "..cost.profiles"),
    **dict.fromkeys(("Timeline", "bottleneck", "timeline"), "..cost.timeline"),
    **dict.fromkeys(("Blocks", "Demand", "Work", "build_work", "measure", "work"), ".model"),
}


def __getattr__(name):
    # Imported on first use, so ``sparsp simulate --help`` (which reads ``.cli``) needs no torch.
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PROFILES", "Blocks", "Demand", "KernelFigure", "KernelPoint", "Profile", "Timeline", "TransportFigure",
           "Work", "bottleneck", "build_work", "get_profile", "measure", "timeline", "work"]
