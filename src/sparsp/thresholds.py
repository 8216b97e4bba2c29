"""Thresholds per layer and head: a documented JSON table that ``SparspConfig(thresholds=PATH)``
reads once, and that ``analyze``, ``simulate`` and ``bench`` take as ``--thresholds FILE``.

Block-sparse attention is tuned per head in practice (SpargeAttn's own tuned file for
CogVideoX-2b: median CDF threshold 0.985, 24 % of heads dense, 4 % below 0.95), so one scalar
for every head of every layer is a trade-off a user must be able to undo. The file
(docs/configuration.md, "Thresholds per layer and head")::

    {"format": "sparsp-thresholds", "version": 1,
     "model": "wan2.1-14b",            # optional: what it was tuned for (a preset name or any text)
     "layers": 40, "heads": 40,        # the model's self-attention layers and heads
     "cdf": [null, 0.95, [0.9, 0.99, ...], ...],   # one entry per layer
     "sim": null}                      # optional, the same shape, for sim_threshold

An entry is ``null`` (the layer uses the config's scalar), one number (every head of the layer)
or a list of one number per head; every number lies in [0, 1] (cdf 1.0 keeps every block). A
``sim`` entry turns block similarity on for that layer. ``cdf`` and ``sim`` may be shorter than
``layers``: the layers past their end use the scalar. Every error is one ``ValueError`` line
that names the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .inputs import read_json

FORMAT = "sparsp-thresholds"
VERSION = 1


@dataclass(frozen=True)
class ThresholdTable:
    """A thresholds file, checked: per layer, the cdf and sim thresholds (None: the scalar)."""

    path: str
    layers: int
    heads: int
    cdf: tuple  # per layer: None, a float, or a tuple of one float per head
    sim: tuple
    model: str | None = None

    def check(self, *, layers: int | None = None, heads: int | None = None, what: str = "the model") -> None:
        """``ValueError`` naming the file when the table is not for ``layers`` × ``heads``."""
        wrong = (layers is not None and layers != self.layers) or (heads is not None and heads != self.heads)
        if wrong:
            have = f"{layers if layers is not None else '?'} layers x {heads if heads is not None else '?'} heads"
            raise ValueError(f"--thresholds {self.path}: the table is for {self.layers} layers x {self.heads} "
                             f"heads; {what} has {have}")

    def at(self, layer: int | None) -> tuple:
        """``(cdf, sim)`` of ``layer``: each None (the config's scalar), a float or a per-head
        tuple. Layer None (not said) or past the table: (None, None)."""
        if layer is None:
            return None, None
        pick = lambda col: col[layer] if layer < len(col) else None  # noqa: E731
        return pick(self.cdf), pick(self.sim)

    def describe(self) -> str:
        """One line for a log: the file, its shape, and the range of the cdf values it sets."""
        values = [v for e in self.cdf if e is not None for v in (e if isinstance(e, tuple) else (e,))]
        span = f"cdf {min(values):g}..{max(values):g}" if values else "no cdf value"
        return f"{self.path} ({self.layers} layers x {self.heads} heads, {span})"


def _entry(value, heads: int, where: str, allow_null: bool = True):
    if value is None and allow_null:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{where}: {value!r} is not a threshold (a number in [0, 1])")
    if isinstance(value, (int, float)):
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"{where}: {value!r} lies outside [0, 1]")
        return float(value)
    if isinstance(value, list):
        if len(value) != heads:
            raise ValueError(f"{where}: {len(value)} values for {heads} heads")
        return tuple(_entry(v, heads, f"{where}[{h}]", allow_null=False) for h, v in enumerate(value))
    raise ValueError(f"{where}: expected null, a number in [0, 1] or a list of {heads} of them, got "
                     f"{type(value).__name__}")


def _column(doc: dict, name: str, layers: int, heads: int, label: str) -> tuple:
    col = doc.get(name)
    if col is None:
        return ()
    if not isinstance(col, list):
        raise ValueError(f"{label}: '{name}' must be a list of one entry per layer, got {type(col).__name__}")
    if len(col) > layers:
        raise ValueError(f"{label}: '{name}' has {len(col)} entries for {layers} layers")
    return tuple(_entry(v, heads, f"{label}: {name}[{i}]") for i, v in enumerate(col))


def _count(doc: dict, name: str, label: str) -> int:
    n = doc.get(name)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{label}: '{name}' must be a positive int, got {n!r}")
    return n


def read_thresholds(path, option: str | None = "--thresholds") -> ThresholdTable:
    """The checked table of ``path``; one ``ValueError`` line naming the option and the file."""
    label = f"{option} {path}" if option else str(path)
    doc = read_json(path, option, what="sparsp thresholds file (JSON)")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{label}: not a sparsp thresholds file (format {found!r}, expected {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise ValueError(f"{label}: version {doc.get('version')!r}; this sparsp reads version {VERSION}")
    layers, heads = _count(doc, "layers", label), _count(doc, "heads", label)
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"{label}: 'model' must be text, got {type(model).__name__}")
    cdf = _column(doc, "cdf", layers, heads, label)
    sim = _column(doc, "sim", layers, heads, label)
    unknown = sorted(set(doc) - {"format", "version", "model", "layers", "heads", "cdf", "sim"})
    if unknown:
        raise ValueError(f"{label}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    return ThresholdTable(str(Path(path)), layers, heads, cdf, sim, model)


def write_thresholds(path, *, layers: int, heads: int, cdf=(), sim=(), model: str | None = None) -> None:
    """Write a table (the inverse of ``read_thresholds``; entries as there, tuples as lists)."""
    import json

    as_json = lambda col: [list(e) if isinstance(e, tuple) else e for e in col]  # noqa: E731
    doc = {"format": FORMAT, "version": VERSION, "model": model, "layers": layers, "heads": heads,
           "cdf": as_json(cdf), "sim": as_json(sim) if sim else None}
    if model is None:
        del doc["model"]
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


__all__ = ["FORMAT", "VERSION", "ThresholdTable", "read_thresholds", "write_thresholds"]
