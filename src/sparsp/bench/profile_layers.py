"""The layers of a density profile as ``bench attention --density-profile FILE --layer L ...``
runs them: which layers the names pick, and each layer's heads calibrated to its densities.

The files are read and the layers resolved first (``read_layers``: any fault refused in one
line), before the verb checks its GPUs; the heads are fitted after (``fit_layers``), on the CPU
of every rank before the process group starts, so no rank waits for a peer while they are
fitted. ``profile_workloads`` does both, for callers without a check in between.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .args import PROFILE_DIR, refuse
from .common import profile_name

PROFILE_WORKLOAD = "density-profile"
"""The ``workload`` of a ``--density-profile`` run's file and rows (a preset's rows have none)."""


@dataclass(frozen=True)
class LayerWorkload:
    """One layer of a density profile as ``--density-profile`` runs it: its calibrated heads
    (``workloads.HeadParams``, with the seed and mix they were fitted on) and what the rows
    report of it."""

    layer: int
    pick: str | None  # the ``LAYER_PICKS`` name it was asked by; None: by its index
    density: float  # the layer's mean density over its heads in the profile (at the step)
    within: float  # share of its heads whose fit is within tolerance
    heads: object  # workloads.HeadParams
    seed: int
    mix: object  # workloads.HeadMix

    def row_fields(self) -> dict:
        return {"workload": PROFILE_WORKLOAD, "layer": self.layer, "layer_pick": self.pick,
                "profile_density": round(self.density, 4), "heads_within": round(self.within, 4)}


@dataclass(frozen=True)
class ProfileLayers:
    """What ``read_layers`` found: the profile, the asked layers (index, name asked by or None),
    and the fit of ``--calibration`` (None: the layers are to be fitted)."""

    profile: object  # workloads.density.DensityProfile
    layers: list[tuple[int, str | None]]
    calibration: object | None  # workloads.calibration.Calibration


def resolve_layers(profile, asked, step: int | None = None) -> list[tuple[int, str | None]]:
    """(layer, name it was asked by or None) of every ``--layer`` value, in the order asked and
    each layer once: an index as given, a ``LAYER_PICKS`` name by the layers' mean densities
    over heads (``DensityProfile.layer_means`` at ``step``, or over every step; ties go to the
    lower index; ``median``: the lower median). ``ValueError`` for an index the profile lacks."""
    means = profile.layer_means(step)
    order = sorted(range(profile.layers), key=lambda i: (means[i], i))
    picks = {"sparsest": order[0], "median": order[(len(order) - 1) // 2],
             "densest": max(range(profile.layers), key=lambda i: (means[i], -i))}
    out: list[tuple[int, str | None]] = []
    for value in asked:
        if isinstance(value, str):
            layer, name = picks[value], value
        elif not 0 <= value < profile.layers:
            raise ValueError(f"--layer {value}: {profile.source} has layers 0 to {profile.layers - 1}")
        else:
            layer, name = value, None
        if layer not in [i for i, _ in out]:
            out.append((layer, name))
    return out


def read_layers(args, geom) -> ProfileLayers:
    """``--density-profile``, its ``--layer`` layers and ``--calibration`` (which must hold a
    fit of each of them), read and checked; any fault refused in one line."""
    from ..workloads.calibration import read_calibration
    from ..workloads.density import read_profile

    try:
        profile = read_profile(args.density_profile, expected=geom)
        layers = resolve_layers(profile, args.layer, args.step)
        cal = None
        if args.calibration is not None:
            cal = read_calibration(args.calibration, geometry=geom, source=profile.source, step=args.step,
                                   chosen_layers=True)
            have = [ly.layer for ly in cal.layers]
            missing = [i for i, _ in layers if i not in have]
            if missing:
                raise ValueError(f"--calibration {args.calibration}: no fit of layer {', '.join(map(str, missing))} "
                                 f"(it holds {', '.join(map(str, have))})")
    except (OSError, ValueError) as e:
        refuse("attention", str(e))
    return ProfileLayers(profile, layers, cal)


def fit_layers(args, geom, read: ProfileLayers, *, verbose: bool, rows: int = 128):
    """The asked layers' heads fitted with ``rows`` query rows per head (``--seed``, default 0),
    progress printed and the fit written to ``OUT/density-profile/`` where ``verbose``: a
    ``Calibration`` and the path written (None where not)."""
    from ..workloads.calibration import CALIBRATION_MIX, Calibration, calibrate_layer

    profile = read.profile
    grid = profile.mean_over_steps() if args.step is None else profile.step(args.step)
    seed = 0 if args.seed is None else args.seed
    fits = {}
    try:
        for n, (i, name) in enumerate(read.layers, 1):
            t0 = time.perf_counter()
            if verbose:
                print(f"calibrating layer {i}{f' ({name})' if name else ''} of {geom.name} to "
                      f"{profile.source}, {n}/{len(read.layers)} ...", flush=True)
            fits[i] = calibrate_layer(geom, grid[i], layer=i, seed=seed, mix=CALIBRATION_MIX, mass=profile.mass,
                                      rows=rows)
            if verbose:
                print(f"  layer {i}: {100 * fits[i].share_within():.0f} % of heads within tolerance "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        cal = Calibration(model=geom.name, source=profile.source, step=args.step, mass=profile.mass, seed=seed,
                          rows=rows, mix=CALIBRATION_MIX, layers=tuple(fits[i] for i in sorted(fits)))
        if not verbose:
            return cal, None
        name = profile_name(geom.name, args.density_profile, args.step)
        written = cal.write(Path(args.out) / PROFILE_DIR / (
            f"calibration-{name}-layer{'_'.join(str(i) for i in sorted(fits))}.json"))
    except (OSError, ValueError) as e:
        refuse("attention", str(e))
    print(f"wrote {written} (pass it as --calibration next time)", flush=True)
    return cal, written


def workloads_of(args, geom, read: ProfileLayers, *, verbose: bool, rows: int = 128) -> tuple[list[LayerWorkload], dict]:
    """Each asked layer with its calibrated heads (``--calibration``'s, else ``fit_layers``), and
    the result file's fields saying where they came from."""
    cal, written = (read.calibration, None) if read.calibration is not None else fit_layers(
        args, geom, read, verbose=verbose, rows=rows)
    means = read.profile.layer_means(args.step)
    fits = {ly.layer: ly for ly in cal.layers}
    workloads = [LayerWorkload(layer=i, pick=name, density=means[i], within=fits[i].share_within(),
                               heads=fits[i].params(), seed=cal.seed, mix=cal.mix) for i, name in read.layers]
    extra = {"workload": PROFILE_WORKLOAD, "density_profile": str(args.density_profile),
             "source": read.profile.source, "step": args.step, "calibration": str(written or args.calibration),
             "layers": [w.layer for w in workloads]}
    return workloads, extra


def profile_workloads(args, geom, *, verbose: bool = True, rows: int = 128) -> tuple[list[LayerWorkload], dict]:
    """``read_layers`` then ``workloads_of``: the ``--layer`` layers of ``--density-profile``
    with their calibrated heads, and the result file's fields."""
    return workloads_of(args, geom, read_layers(args, geom), verbose=verbose, rows=rows)
