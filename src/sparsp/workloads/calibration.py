"""Synthetic heads calibrated to a real per-head density profile (``sparsp.workloads.density``).

The generator (``sparsp.workloads.synthetic``) draws every head's sharpness from one range; a profile
says how dense each (layer, head) of a real model is. Calibration keeps the preset's head-kind
shares (``HeadMix``) and gives the kinds to the heads by density rank, sparsest first:

    column  <  diagonal  <  multi-diagonal  <  dense

(a column head's sinks hold its mass in a few keys; a diagonal head needs its neighbourhood in
one frame; a multi-diagonal head the same place in every frame; the dense control the most).
Then each head's alignment a, which sets how sharply it decays, is searched for
(``workloads.alignment``) so that its TOKEN-level density at the profile's mass matches the
profile: per query, the fewest keys holding ``mass`` of its softmax attention over ALL keys,
over the number of keys, averaged over sampled query rows (``workloads.scores``, which draws
those rows' scores directly and serves every trial of a from one set of tables).

A head is within tolerance when |measured − target| <= max(10 % of the target, 0.002). The
result is then measured again with another noise seed and another sample of query rows; that
verified density is what ``within`` reports. A target the knob cannot reach (above the
density at the smallest a, or below it at the largest) is flagged ``reachable=False`` and the
head keeps the nearest end, never silently clipped. Block masks follow from the calibrated q/k
as before (``workloads.synthetic_masks(heads=…)``), not from the densities.

The fitted parameters are written as JSON (``Calibration.write`` / ``read_calibration``):
calibrate once, load many.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..inputs import read_format
from ..geometry import VideoGeometry, preset
from .alignment import ABSOLUTE_TOLERANCE, RELATIVE_TOLERANCE, fit_alignment, tolerance
from .density import DensityProfile
from .scores import KeyCounter, RowScores, row_scores
from .synthetic import HeadMix, HeadParams

CALIBRATION_FORMAT = "sparsp-calibration"
CALIBRATION_VERSION = 1
RANK_ORDER = ("column", "diagonal", "multi-diagonal", "dense")
"""Kinds from the sparsest heads of a layer to the densest."""
CALIBRATION_MIX = HeadMix(noise=0.5)
"""The default mix with half its noise. With only noise left (a -> 0), a head's scores are
about σ² × N(0, 1) per key, and the fewest keys holding 95 % of the mass are Φ(1.645 − σ²) of
them: 0.74 at σ = 1, short of the densest published heads (Wan 2.1 14B: up to 0.945, and 6.5 %
of its heads' means over steps above 0.81); at σ = 0.5 the ceiling is 0.92, which reaches them
within tolerance. The shares and every other field stay the default's."""


def assign_kinds(targets: Sequence[float], mix: HeadMix) -> tuple[str, ...]:
    """The kind of every head: the mix's head counts, handed out by density rank (sparsest
    first, ``RANK_ORDER``; ties by head index)."""
    counts = mix.counts(len(targets))
    order = sorted(range(len(targets)), key=lambda h: (targets[h], h))
    ranked = [k for k in RANK_ORDER for _ in range(counts[k])]
    kinds = [""] * len(targets)
    for h, k in zip(order, ranked):
        kinds[h] = k
    return tuple(kinds)


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadFit:
    head: int
    kind: str
    alignment: float
    target: float
    fit_density: float  # at the fit's noise seed and query rows
    density: float  # verified: another noise seed, other query rows
    reachable: bool

    @property
    def within(self) -> bool:
        return abs(self.density - self.target) <= tolerance(self.target)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerFit:
    layer: int
    heads: tuple[HeadFit, ...]

    def params(self) -> HeadParams:
        return HeadParams(tuple(h.kind for h in self.heads), tuple(h.alignment for h in self.heads))

    def share_within(self) -> float:
        return sum(h.within for h in self.heads) / len(self.heads)

    def worst(self) -> HeadFit:
        """The head furthest from its target, in units of its tolerance."""
        return max(self.heads, key=lambda h: abs(h.density - h.target) / tolerance(h.target))


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """Fitted kinds and alignments of a preset's heads for one profile and step."""

    model: str
    source: str  # the profile's source
    step: int | None  # 1-based step of the profile, None: the mean over steps
    mass: float
    seed: int  # the workload seed: c, ρ, sinks come from it
    rows: int  # sampled query rows per head
    mix: HeadMix
    layers: tuple[LayerFit, ...]

    def head_params(self) -> list[HeadParams]:
        return [ly.params() for ly in self.layers]

    def to_json(self) -> dict:
        return {
            "format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "model": self.model,
            "source": self.source, "step": self.step, "mass": self.mass, "seed": self.seed,
            "rows": self.rows, "mix": asdict(self.mix),
            "tolerance": {"relative": RELATIVE_TOLERANCE, "absolute": ABSOLUTE_TOLERANCE},
            "layers": [{"layer": ly.layer, "heads": [{**asdict(h), "within": h.within} for h in ly.heads]}
                       for ly in self.layers],
        }

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    def summary_rows(self) -> list[dict]:
        """Per layer: share of heads within tolerance, unreachable heads, the worst head."""
        out = []
        for ly in self.layers:
            w = ly.worst()
            out.append({"layer": ly.layer, "within": ly.share_within(),
                        "unreachable": [h.head for h in ly.heads if not h.reachable],
                        "worst_head": w.head, "worst_kind": w.kind, "worst_target": w.target,
                        "worst_density": w.density})
        return out


def read_calibration(path: str | Path, *, geometry: VideoGeometry | str | None = None,
                     source: str | None = None, step: int | None | str = "any",
                     chosen_layers: bool = False) -> Calibration:
    """A calibration from its JSON form; ``geometry`` (a preset name or geometry: its name and
    heads), ``source`` and ``step`` (when given; None is the mean over steps) must match what
    it was fitted for. Its layers must run 0, 1, ... (``head_params()[i]`` is layer i); with
    ``chosen_layers`` any increasing layer indices will do (a fit of chosen layers, as ``bench
    attention --layer`` writes it; look a layer up by its ``LayerFit.layer``). Every fault is a
    one-line ``ValueError`` naming the file."""
    path = Path(path)
    doc = read_format(path, CALIBRATION_FORMAT, CALIBRATION_VERSION)
    try:
        cal = Calibration(
            model=doc["model"], source=doc["source"], step=doc["step"], mass=float(doc["mass"]),
            seed=int(doc["seed"]), rows=int(doc["rows"]), mix=HeadMix(**{
                k: tuple(v) if isinstance(v, list) else v for k, v in doc["mix"].items()}),
            layers=tuple(LayerFit(layer=int(ly["layer"]), heads=tuple(
                HeadFit(head=int(h["head"]), kind=h["kind"], alignment=float(h["alignment"]),
                        target=float(h["target"]), fit_density=float(h["fit_density"]),
                        density=float(h["density"]), reachable=bool(h["reachable"]))
                for h in ly["heads"])) for ly in doc["layers"]),
        )
        for i, ly in enumerate(cal.layers):
            if chosen_layers and (ly.layer < 0 or i and ly.layer <= cal.layers[i - 1].layer):
                raise ValueError(f"layer {ly.layer} at position {i}; layers must increase from 0 or more")
            if not chosen_layers and ly.layer != i:
                raise ValueError(f"layer {ly.layer} at position {i}; layers must run 0, 1, ...")
            if [h.head for h in ly.heads] != list(range(len(ly.heads))):
                raise ValueError(f"layer {i}: heads must run 0, 1, ...")
            ly.params()  # checks kinds and alignments
        if not cal.layers:
            raise ValueError("no layers")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: bad calibration ({' '.join(str(e).split())})") from None
    geom = preset(geometry) if isinstance(geometry, str) else geometry
    if geom is not None and len(cal.layers[0].heads) != geom.heads:
        raise ValueError(f"{path}: {len(cal.layers[0].heads)} heads per layer, {geom.name} has {geom.heads}")
    for name, want, have in (("model", geom and geom.name, cal.model), ("source", source, cal.source)):
        if want is not None and want != have:
            raise ValueError(f"{path}: fitted for {name} {have!r}, not {want!r}")
    if step != "any" and step != cal.step:
        raise ValueError(f"{path}: fitted for step {cal.step or 'mean over steps'}, "
                         f"not {step or 'mean over steps'}")
    return cal


def _sample_rows(geom: VideoGeometry, seed: int, layer: int, sample: int, rows: int) -> torch.Tensor:
    # Hashed like the generator's streams: the CPU generator keeps only 32 bits of its seed.
    digest = hashlib.blake2b(f"sparsp-calibration/{seed}/{layer}/{sample}".encode(), digest_size=4).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.randperm(geom.num_tokens, generator=gen)[: min(rows, geom.num_tokens)]


def calibrate_layer(
    geom: VideoGeometry,
    targets: Sequence[float],
    *,
    layer: int,
    seed: int = 0,
    mix: HeadMix | None = None,
    mass: float = 0.95,
    rows: int = 128,
    iterations: int = 16,
    workers: int | None = None,
) -> LayerFit:
    """Fit one layer's kinds and alignments to ``targets`` (one token-level density per head)
    with ``mix``'s shares and noise (default ``CALIBRATION_MIX``), in at most ``iterations``
    measurements per head. The heads are fitted ``workers`` at a time (default: torch's CPU
    threads), each on one thread."""
    mix = mix or CALIBRATION_MIX
    if len(targets) != geom.heads:
        raise ValueError(f"{len(targets)} targets for {geom.heads} heads")
    kinds = assign_kinds(targets, mix)

    def scores(sample: int, counter: KeyCounter) -> RowScores:  # 1: another seed, other rows
        return row_scores(geom, kinds, seed=seed, layer=layer, rows=_sample_rows(geom, seed, layer, sample, rows),
                          noise_seed=sample, mix=mix)

    def one(h: int, counter: KeyCounter) -> HeadFit:
        a, fitted, reachable = fit_alignment(fit, h, float(targets[h]), kinds[h], mass, iterations, counter)
        return HeadFit(head=h, kind=kinds[h], alignment=a, target=float(targets[h]), fit_density=fitted,
                       density=check.density(h, a, mass, counter), reachable=reachable)

    with _Threads(workers, geom.num_tokens) as threads:
        fit, check = threads.map(scores, (0, 1))
        # Column heads take the most steps (docs/workloads.md): first, so no thread waits on one.
        order = sorted(range(geom.heads), key=lambda h: (kinds[h] != "column", h))
        fits = dict(zip(order, threads.map(one, order)))
    return LayerFit(layer=layer, heads=tuple(fits[h] for h in range(geom.heads)))


class _Threads:
    """``map(fn, items)``: ``fn(item, counter)`` for every item, ``workers`` at a time (default:
    torch's CPU threads), each on one CPU thread with a ``KeyCounter`` of its own (a count's
    histogram runs on one thread; heads side by side use them all)."""

    def __init__(self, workers: int | None, keys: int) -> None:
        self._threads = torch.get_num_threads()
        self._workers = max(1, workers or self._threads)
        self._keys = keys
        self._local = threading.local()
        self._pool = None

    def __enter__(self) -> _Threads:
        if self._workers > 1:
            torch.set_num_threads(1)
            self._pool = ThreadPoolExecutor(self._workers)
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            torch.set_num_threads(self._threads)

    def map(self, fn, items) -> list:
        def run(item):
            if not hasattr(self._local, "counter"):
                self._local.counter = KeyCounter(self._keys)
            return fn(item, self._local.counter)

        return list(self._pool.map(run, items) if self._pool is not None else map(run, items))


def calibrate(
    geom: VideoGeometry | str,
    profile: DensityProfile,
    *,
    step: int | None = None,
    layers: int | None = None,
    seed: int = 0,
    mix: HeadMix | None = None,
    rows: int = 128,
    on_layer: Callable[[LayerFit], None] | None = None,
) -> Calibration:
    """Fit the first ``layers`` layers (default all) of ``geom`` to ``profile`` at ``step``
    (1-based; None: the mean over steps). The geometry's heads and layers must match the
    profile's (``DensityProfile.check_preset``); a custom geometry gives its own name."""
    geom = preset(geom) if isinstance(geom, str) else geom
    mix = mix or CALIBRATION_MIX
    profile.check_preset(geom)
    grid = profile.mean_over_steps() if step is None else profile.step(step)
    n = geom.layers if layers is None else layers
    if not isinstance(n, int) or not 1 <= n <= geom.layers:
        raise ValueError(f"layers must be an int in 1..{geom.layers}, got {layers!r}")
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    fits = []
    for ly in range(n):
        fits.append(calibrate_layer(geom, grid[ly], layer=ly, seed=seed, mix=mix, mass=profile.mass, rows=rows))
        if on_layer is not None:
            on_layer(fits[-1])
    return Calibration(model=geom.name, source=profile.source, step=step, mass=profile.mass, seed=seed,
                       rows=rows, mix=mix, layers=tuple(fits))


def layer_lines(layers: int, emit: Callable[[str], None]) -> Callable[[LayerFit], None]:
    """An ``on_layer`` for ``calibrate`` that ``emit``s one line per fitted layer (where output
    is not a terminal, in place of a progress bar): its share within tolerance and the time
    since this was made."""
    t0, done = time.perf_counter(), []

    def on_layer(fit: LayerFit) -> None:
        done.append(fit.layer)
        out = sum(not h.reachable for h in fit.heads)
        emit(f"fitted layer {fit.layer} ({len(done)}/{layers}): {100 * fit.share_within():.0f} % of "
             f"{len(fit.heads)} heads within tolerance{f', {out} out of reach' if out else ''}, "
             f"{time.perf_counter() - t0:.0f} s")

    return on_layer


