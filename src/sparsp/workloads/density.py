"""Per-head density profiles of real video DiTs: read, check against a preset, summarise.

A profile gives, for every denoising step, layer and head, the token-level *density* of that
head: the share of keys that hold ``mass`` (0.95) of a query's attention. Published profiles
are CSV files with the columns ``Step,Layer,Head,Sparsity`` (steps 1-based, layers and heads
0-based; despite its name the last column is the density). sparsp also writes and reads a JSON
form of its own that round-trips exactly. Every reading error is a one-line ``ValueError``
naming the file and, for a CSV, the line.

Plain Python on purpose: profiles are small (at most a few 10^5 numbers) and this module must
load without torch, like the presets it is checked against.

``sparsp density FILE`` prints the summary that docs/workloads.md quotes.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..inputs import read_format
from ..geometry import VideoGeometry, preset

__all__ = [
    "CSV_COLUMNS",
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "DensityProfile",
    "DensitySummary",
    "read_csv",
    "read_json",
    "read_profile",
    "write_json",
]

PROFILE_FORMAT = "sparsp-density-profile"
PROFILE_VERSION = 1
CSV_COLUMNS = ("Step", "Layer", "Head", "Sparsity")

Grid = tuple[tuple[float, ...], ...]  # [layer][head]


@dataclass(frozen=True, slots=True)
class DensitySummary:
    """The figures docs/workloads.md states for a profile (see ``DensityProfile.summary``)."""

    mean: float
    median: float
    layer_mean_min: float  # per-layer means (over steps and heads): their range
    layer_mean_max: float
    densest_over_layer_mean: float  # max head / its layer's mean, median over layers, at `step`
    step: int  # the step of densest_over_layer_mean
    min: float
    max: float
    corr_first: float  # Pearson correlation of per-head densities, step 1 vs step 2
    corr_later_min: float  # the lowest correlation of step s vs s + 1 over s >= 2

    def lines(self) -> list[str]:
        return [
            f"mean {self.mean:.3f}, median {self.median:.3f}",
            f"per-layer means {self.layer_mean_min:.3f}-{self.layer_mean_max:.3f}",
            (f"densest head / its layer's mean at step {self.step}: median over layers "
             f"{self.densest_over_layer_mean:.2f}x"),
            f"head densities {self.min:.4f}-{self.max:.4f}",
            (f"correlation of per-head densities: step 1 vs 2 {self.corr_first:.3f}, "
             f"step s vs s+1 for s >= 2 at least {self.corr_later_min:.3f}"),
        ]


@dataclass(frozen=True, slots=True)
class DensityProfile:
    """Token-level density of every (step, layer, head); ``densities[step - 1][layer][head]``."""

    source: str  # the model or the file it came from
    steps: int
    layers: int
    heads: int
    densities: tuple[Grid, ...]
    mass: float = 0.95

    def __post_init__(self) -> None:
        grid = _normalised(self.source, self.steps, self.layers, self.heads, self.densities, self.mass)
        object.__setattr__(self, "densities", grid)

    def step(self, s: int) -> Grid:
        """The [layer][head] densities of step ``s`` (1-based, as published)."""
        if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= self.steps:
            raise ValueError(f"{self.source}: step {s!r} outside 1..{self.steps}")
        return self.densities[s - 1]

    def mean_over_steps(self) -> Grid:
        """The [layer][head] densities averaged over every step."""
        return tuple(
            tuple(math.fsum(d[ly][hd] for d in self.densities) / self.steps for hd in range(self.heads))
            for ly in range(self.layers)
        )

    def layer_means(self, step: int | None = None) -> tuple[float, ...]:
        """Each layer's mean density over its heads, at ``step`` or over every step."""
        grid = self.mean_over_steps() if step is None else self.step(step)
        return tuple(math.fsum(row) / self.heads for row in grid)

    def values(self, step: int | None = None) -> list[float]:
        """Every density, flat (of one step, or of all)."""
        grids = self.densities if step is None else (self.step(step),)
        return [v for grid in grids for row in grid for v in row]

    def densest_over_layer_mean(self, step: int | None = None) -> tuple[float, ...]:
        """Per layer, its densest head divided by the layer's mean at ``step`` (default the
        middle step; inf for a layer whose heads are all 0)."""
        step = self.middle_step() if step is None else step
        out = []
        for row in self.step(step):
            mean = math.fsum(row) / self.heads
            out.append(max(row) / mean if mean > 0 else math.inf)
        return tuple(out)

    def step_correlation(self, a: int, b: int) -> float:
        """Pearson correlation of the per-head densities of steps ``a`` and ``b`` (nan if
        either step is constant)."""
        x, y = self.values(a), self.values(b)
        try:
            return statistics.correlation(x, y)
        except statistics.StatisticsError:
            return math.nan

    def check_preset(self, geometry: str | VideoGeometry) -> DensityProfile:
        """Raise ``ValueError`` unless the layers and heads equal the preset's; return self."""
        problem = _preset_mismatch(self, geometry)
        if problem:
            raise ValueError(f"{self.source}: {problem}")
        return self

    def middle_step(self) -> int:
        """The step that stands for the run where one step is reported (the lower middle)."""
        return (self.steps + 1) // 2

    def summary(self, step: int | None = None) -> DensitySummary:
        """Mean, median, range of layer means, densest head over its layer mean (median over
        layers at ``step``, by default the middle step, since the ratio drifts along a run), min/max,
        and how alike consecutive steps are."""
        step = self.middle_step() if step is None else step
        flat = self.values()
        means = self.layer_means()
        later = [self.step_correlation(s, s + 1) for s in range(2, self.steps)]
        return DensitySummary(
            mean=math.fsum(flat) / len(flat),
            median=statistics.median(flat),
            layer_mean_min=min(means),
            layer_mean_max=max(means),
            densest_over_layer_mean=statistics.median(self.densest_over_layer_mean(step)),
            step=step,
            min=min(flat),
            max=max(flat),
            corr_first=self.step_correlation(1, 2) if self.steps >= 2 else math.nan,
            corr_later_min=min(later) if later else math.nan,
        )


def _normalised(label, steps, layers, heads, densities, mass) -> tuple[Grid, ...]:
    """The densities as nested tuples of floats (so equal profiles compare equal whatever
    nesting was passed), after checking every field; errors start with ``label``."""
    for attr, value in (("steps", steps), ("layers", layers), ("heads", heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label}: {attr} must be an int >= 1, got {value!r}")
    if not isinstance(mass, (int, float)) or isinstance(mass, bool) or not 0.0 < mass <= 1.0:
        raise ValueError(f"{label}: mass {mass!r} outside (0, 1]")
    try:
        grid = tuple(tuple(tuple(_real(v) for v in row) for row in layer) for layer in densities)
    except TypeError as e:
        raise ValueError(f"{label}: densities must be numbers nested [step][layer][head] ({e})") from None
    if len(grid) != steps:
        raise ValueError(f"{label}: {len(grid)} steps of densities, expected {steps}")
    for s, layer in enumerate(grid, 1):
        if len(layer) != layers:
            raise ValueError(f"{label}: step {s} has {len(layer)} layers, expected {layers}")
        for ly, row in enumerate(layer):
            if len(row) != heads:
                raise ValueError(f"{label}: step {s} layer {ly} has {len(row)} heads, expected {heads}")
            for hd, v in enumerate(row):
                if not 0.0 <= v <= 1.0:
                    raise ValueError(f"{label}: step {s} layer {ly} head {hd}: density {v!r} outside [0, 1]")
    return grid


def _real(v) -> float:
    # Strict: a string "0.5" or a bool in a JSON profile is a fault, not a density.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{v!r} is not a number")
    return float(v)


def _number(cell: str, where: str, column: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(f"{where}: column {column} is not a number: {cell!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{where}: column {column} is not a finite number: {cell!r}")
    return value


def _index(cell: str, where: str, column: str, lowest: int) -> int:
    value = _number(cell, where, column)
    if value != int(value) or value < lowest:
        raise ValueError(f"{where}: column {column} must be an integer >= {lowest}, got {cell!r}")
    return int(value)


def read_csv(path: str | Path, *, source: str | None = None, mass: float = 0.95,
             expected: str | VideoGeometry | None = None) -> DensityProfile:
    """A profile from a published CSV (``Step,Layer,Head,Sparsity``; other columns ignored).

    The grid is 1..max step x 0..max layer x 0..max head and every cell of it must appear
    exactly once. ``expected`` (a preset name or geometry) must match in layers and heads.
    """
    path = Path(path)
    # utf-8-sig: a spreadsheet's byte-order mark must not hide the first column's name.
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, strict=True)  # a stray quote is a fault, not part of a cell
        try:
            return _checked(_parse(path, reader, source or path.name, mass), path, expected)
        except UnicodeDecodeError as e:  # decoded in chunks: no exact line to name
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start} of a chunk)") from None
        except csv.Error as e:
            raise ValueError(f"{path}:{reader.line_num}: not CSV ({str(e).splitlines()[0]})") from None


def _parse(path: Path, reader, source: str, mass: float) -> DensityProfile:
    values: dict[tuple[int, int, int], tuple[float, int]] = {}  # (step, layer, head) -> (density, line)
    header = next(reader, None)
    if header is None:
        raise ValueError(f"{path}:1: empty file, expected the header {','.join(CSV_COLUMNS)}")
    names = [h.strip() for h in header]
    for column in CSV_COLUMNS:
        if column not in names:
            raise ValueError(f"{path}:1: missing column {column!r} (header: {','.join(names)!r})")
    at = [names.index(c) for c in CSV_COLUMNS]
    for row in reader:
        line = reader.line_num
        if not any(cell.strip() for cell in row):
            continue  # a blank line (a trailing newline) holds no data
        where = f"{path}:{line}"
        if len(row) < len(names):
            raise ValueError(f"{where}: {len(row)} cells, the header has {len(names)}")
        step = _index(row[at[0]], where, "Step", 1)
        layer = _index(row[at[1]], where, "Layer", 0)
        head = _index(row[at[2]], where, "Head", 0)
        density = _number(row[at[3]], where, "Sparsity")
        if not 0.0 <= density <= 1.0:
            raise ValueError(f"{where}: Sparsity {density!r} outside [0, 1]")
        key = (step, layer, head)
        if key in values:
            raise ValueError(f"{where}: duplicate step {step}, layer {layer}, head {head} "
                             f"(first on line {values[key][1]})")
        values[key] = (density, line)
    if not values:
        raise ValueError(f"{path}: no data rows after the header")
    steps = max(k[0] for k in values)
    layers = max(k[1] for k in values) + 1
    heads = max(k[2] for k in values) + 1
    grid = []
    for s in range(1, steps + 1):
        layer_rows = []
        for ly in range(layers):
            row = []
            for hd in range(heads):
                found = values.get((s, ly, hd))
                if found is None:
                    raise ValueError(f"{path}: no row for step {s}, layer {ly}, head {hd} (the file "
                                     f"spans steps 1-{steps}, layers 0-{layers - 1}, heads 0-{heads - 1})")
                row.append(found[0])
            layer_rows.append(row)
        grid.append(layer_rows)
    return DensityProfile(source=source, steps=steps, layers=layers, heads=heads, densities=grid, mass=mass)


def _preset_mismatch(profile: DensityProfile, geometry: str | VideoGeometry) -> str | None:
    geom = preset(geometry) if isinstance(geometry, str) else geometry
    if (profile.layers, profile.heads) == (geom.layers, geom.heads):
        return None
    return (f"{profile.layers} layers x {profile.heads} heads, but preset {geom.name} has "
            f"{geom.layers} layers x {geom.heads} heads")


def _checked(profile: DensityProfile, path: Path, expected) -> DensityProfile:
    problem = None if expected is None else _preset_mismatch(profile, expected)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return profile


def write_json(profile: DensityProfile, path: str | Path) -> None:
    """Write sparsp's JSON form of a profile (``read_json`` gives back an equal profile)."""
    doc = {
        "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "source": profile.source,
        "mass": profile.mass, "steps": profile.steps, "layers": profile.layers,
        "heads": profile.heads, "densities": profile.densities,
    }
    Path(path).write_text(json.dumps(doc) + "\n")


def read_json(path: str | Path, *, expected: str | VideoGeometry | None = None) -> DensityProfile:
    """A profile from sparsp's JSON form; every fault is a ``ValueError`` naming the file."""
    path = Path(path)
    doc = read_format(path, PROFILE_FORMAT, PROFILE_VERSION)
    missing = [k for k in ("source", "mass", "steps", "layers", "heads", "densities") if k not in doc]
    if missing:
        raise ValueError(f"{path}: missing keys {', '.join(missing)}")
    # A bad file, not a bad argument: ValueError like every other fault of the file.
    if not isinstance(doc["source"], str):
        raise ValueError(f"{path}: source must be a string, got {doc['source']!r}")  # noqa: TRY004
    # Checked under the file's name first, so an error names the file, not the source inside it.
    _normalised(path, doc["steps"], doc["layers"], doc["heads"], doc["densities"], doc["mass"])
    profile = DensityProfile(source=doc["source"], steps=doc["steps"], layers=doc["layers"],
                             heads=doc["heads"], densities=doc["densities"], mass=doc["mass"])
    return _checked(profile, path, expected)


def read_profile(path: str | Path, *, expected: str | VideoGeometry | None = None) -> DensityProfile:
    """``read_json`` for a ``.json`` file, ``read_csv`` otherwise."""
    reader = read_json if Path(path).suffix.lower() == ".json" else read_csv
    return reader(path, expected=expected)

