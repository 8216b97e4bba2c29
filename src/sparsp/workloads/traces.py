"""Mask traces: recorded block masks in a file that ``sparsp analyze --trace`` reads.

A trace holds bool masks [layers, heads, nQ, nK] in the model's ORIGINAL block order, the
``VideoGeometry`` they belong to and the thresholds that made them (``sparsp trace`` writes
one from a real model; ``save_trace`` from any masks). The format is a ``torch.save`` dict
with ``format = "sparsp-trace"`` and a version; ``load_trace`` validates every field and
names the file in each ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import errno
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

from ..geometry import MODELS, VideoGeometry

__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "Trace", "load_trace", "read_torch_file", "save_trace"]

TRACE_FORMAT = "sparsp-trace"
TRACE_VERSION = 1

_GEOMETRY_FIELDS = tuple(f.name for f in dataclasses.fields(VideoGeometry) if f.name != "rope")
# Fields a trace must agree on with an expected geometry (name and model layer count may differ).
_SHAPE_FIELDS = ("frames", "height", "width", "text_tokens", "block_size", "heads", "head_dim")


@dataclass(frozen=True)
class Trace:
    """A recorded set of block masks. ``masks``: bool [layers, heads, nQ, nK], original order."""

    masks: torch.Tensor
    geometry: VideoGeometry
    cdf_threshold: float
    sim_threshold: float | None
    source: str


def _check_masks(masks, geom: VideoGeometry, where: str) -> None:
    if not isinstance(masks, torch.Tensor) or masks.dtype != torch.bool:
        raise ValueError(f"{where}: masks must be a bool tensor, got {getattr(masks, 'dtype', type(masks))}")
    want = (geom.heads, geom.num_blocks, geom.num_blocks)
    if masks.dim() != 4 or masks.shape[0] < 1 or tuple(masks.shape[1:]) != want:
        raise ValueError(f"{where}: masks must have shape [layers, {', '.join(map(str, want))}] for "
                         f"{geom.describe()}, got {tuple(masks.shape)}")


def _check_thresholds(cdf, sim, where: str) -> None:
    if isinstance(cdf, bool) or not isinstance(cdf, (int, float)) or not 0.0 <= cdf <= 1.0:
        raise ValueError(f"{where}: cdf_threshold must be a float in [0, 1], got {cdf!r}")
    if sim is not None and (isinstance(sim, bool) or not isinstance(sim, (int, float)) or not 0.0 <= sim <= 1.0):
        raise ValueError(f"{where}: sim_threshold must be None or a float in [0, 1], got {sim!r}")


def save_trace(
    path: str | Path,
    masks: torch.Tensor,
    geom: VideoGeometry,
    *,
    cdf_threshold: float,
    sim_threshold: float | None = None,
    source: str,
) -> None:
    """Write ``masks`` (bool [layers, heads, nQ, nK], original block order) as a trace file."""
    _check_masks(masks, geom, "save_trace")
    _check_thresholds(cdf_threshold, sim_threshold, "save_trace")
    torch.save({
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "masks": masks.detach().cpu().contiguous(),
        "geometry": {name: getattr(geom, name) for name in _GEOMETRY_FIELDS},
        "cdf_threshold": float(cdf_threshold),
        "sim_threshold": None if sim_threshold is None else float(sim_threshold),
        "source": str(source),
    }, Path(path))


def read_torch_file(path: str | Path, what: str, map_location="cpu"):
    """``torch.load(path, weights_only=True)``, or one-line ``ValueError`` naming ``path`` and
    saying what is wrong: a directory, an empty file, text or other bytes that are no
    ``torch.save`` archive, a truncated archive, or one holding arbitrary Python objects.
    A missing file raises ``FileNotFoundError``."""
    from ..inputs import describe_content

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "No such file", str(path))
    if path.is_dir():
        raise ValueError(f"{path}: not a readable {what}: it is a directory")
    with path.open("rb") as f:
        head = f.read(64)
    if not head:
        raise ValueError(f"{path}: not a readable {what}: the file is empty")
    if not head.startswith(b"PK\x03\x04"):  # torch.save writes a zip archive
        raise ValueError(f"{path}: not a readable {what}: it is {describe_content(head)}, not a torch.save archive")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:  # weights_only refused a global: not a file sparsp wrote
        raise ValueError(f"{path}: not a readable {what}: it holds Python objects other than tensors "
                         f"and plain containers") from None
    except Exception as exc:  # noqa: BLE001  (torch raises RuntimeError, EOFError, KeyError, ...)
        reason = " ".join(str(exc).split()).split(". ")[0][:160] or type(exc).__name__
        raise ValueError(f"{path}: not a readable {what} (truncated or corrupt?): {reason}") from None


def load_trace(path: str | Path, expected_geometry: VideoGeometry | None = None) -> Trace:
    """Read and validate a trace; ``ValueError`` naming ``path`` on any defect."""
    if expected_geometry is not None and not isinstance(expected_geometry, VideoGeometry):
        raise ValueError(f"expected_geometry must be a VideoGeometry or None, got {type(expected_geometry).__name__}")
    path = Path(path)
    data = read_torch_file(path, "trace file")
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        if isinstance(data, dict) and "format" not in data:
            keys = ", ".join(map(str, list(data)[:5])) + (", …" if len(data) > 5 else "")
            raise ValueError(f"{path}: not a {TRACE_FORMAT} file: a torch file of a dict without a format "
                             f"(keys: {keys or 'none'})")
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: not a {TRACE_FORMAT} file (format {found!r})")
    if data.get("version") != TRACE_VERSION:
        raise ValueError(f"{path}: trace version {data.get('version')!r} is not supported (expected {TRACE_VERSION})")
    missing = {"masks", "geometry", "cdf_threshold", "sim_threshold", "source"} - data.keys()
    if missing:
        raise ValueError(f"{path}: trace lacks {sorted(missing)}")
    fields = data["geometry"]
    if not isinstance(fields, dict) or set(fields) != set(_GEOMETRY_FIELDS):
        raise ValueError(f"{path}: geometry must be a dict of {_GEOMETRY_FIELDS}, got {fields!r}")
    try:
        geom = VideoGeometry(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: invalid geometry: {exc}") from exc
    if geom.name in MODELS:
        geom = dataclasses.replace(geom, rope=MODELS[geom.name].rope)
    _check_masks(data["masks"], geom, str(path))
    _check_thresholds(data["cdf_threshold"], data["sim_threshold"], str(path))
    if expected_geometry is not None and any(
        getattr(geom, f) != getattr(expected_geometry, f) for f in _SHAPE_FIELDS
    ):
        raise ValueError(f"{path}: trace geometry {geom.describe()} does not match the expected "
                         f"{expected_geometry.describe()}")
    return Trace(data["masks"], geom, float(data["cdf_threshold"]),
                 None if data["sim_threshold"] is None else float(data["sim_threshold"]), str(data["source"]))
