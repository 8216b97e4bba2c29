"""Triton, when importable, and the one rule for whether a call's Triton kernel runs.

sparsp's Triton kernels (the metadata's block sums, the mask's CDF selection, the block lists,
the pack's gather, the LSE merge, ``auto``'s demand figures, the payload layouts;
docs/kernels.md) each replace a
few torch ops on CUDA. Each has a switch back to those ops, an environment variable set to
``0``. ``triton`` and ``tl`` are ``None`` where Triton is not installed (the CPU wheels of
torch); every kernel is then defined under ``if triton is not None`` and its torch form runs.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a torch build without Triton
    triton = tl = None


SWITCHES = ("SPARSP_FUSED_SELECT", "SPARSP_TRITON_LISTS", "SPARSP_TRITON_PACK", "SPARSP_TRITON_MERGE",
            "SPARSP_TRITON_FIGURES", "SPARSP_TRITON_SUMS", "SPARSP_TRITON_LAYOUT")
"""Every kernel's switch (docs/kernels.md)."""


def settings() -> tuple[str | None, ...]:
    """The switches' current values: part of the key of a captured plan stage
    (``strategies/captured.py``), so that a graph recorded with a kernel is never replayed
    after its switch changed."""
    return tuple(os.environ.get(name) for name in SWITCHES)


def runs(t: torch.Tensor, switch: str) -> bool:
    """Whether a Triton kernel runs on ``t``: Triton importable, ``t`` on CUDA, and the
    kernel's environment ``switch`` not set to ``0``. (The CPU suite calls the kernels itself,
    in Triton's interpreter.)"""
    assert switch in SWITCHES, f"unknown switch {switch}: add it to SWITCHES"
    return triton is not None and t.device.type == "cuda" and os.environ.get(switch, "1") != "0"


__all__ = ["SWITCHES", "runs", "settings", "tl", "triton"]
