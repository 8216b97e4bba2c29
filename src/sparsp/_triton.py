"""Triton, when importable, and the one rule for whether a call's Triton kernel runs.

sparsp's Triton kernels (the metadata's block sums, the mask's CDF selection, the block lists,
the pack's gather, the LSE merge, ``auto``'s demand figures, the payload layouts;
docs/kernels.md) each replace a few torch ops on CUDA. The torch form of each stays: it is the
CPU path, the fallback outside a kernel's limits, and the tests' oracle. ``SPARSP_TRITON=0``
(``sparsp.env``) turns every kernel off at once, for debugging. ``triton`` and ``tl`` are
``None`` where Triton is not installed (the CPU wheels of torch); every kernel is then defined
under ``if triton is not None`` and its torch form runs.
"""

from __future__ import annotations

import torch

from . import env

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch build without Triton
    triton = tl = None


def settings() -> tuple[bool]:
    """Whether the Triton kernels are on: part of the key of a captured plan stage
    (``strategies/captured.py``), so that a graph recorded with the kernels is never replayed
    after ``SPARSP_TRITON`` changed."""
    return (env.triton_enabled(),)


def runs(t: torch.Tensor) -> bool:
    """Whether a Triton kernel runs on ``t``: Triton importable, ``t`` on CUDA, and
    ``SPARSP_TRITON`` not ``0``. (The CPU suite calls the kernels itself, in Triton's
    interpreter.)"""
    return triton is not None and t.device.type == "cuda" and env.triton_enabled()


__all__ = ["runs", "settings", "tl", "triton"]
