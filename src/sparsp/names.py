"""The names the command line offers as choices, as plain data (no torch).

``sparsp --help`` and the verbs' ``--help`` take their choices from this module, so they
answer without importing torch, Diffusers or matplotlib. The modules named beside each
constant stay the source of truth: ``tests/test_cli.py`` checks every constant against them.
Strategy names are not here: a strategy is named only where it registers, and the verbs
check the names they are given against the registry when they run.
"""

from __future__ import annotations

PLACEMENTS = ("contiguous", "periodic")
"""``placement.PLACEMENTS``."""
TRACE_MODELS = ("hunyuan-video", "wan2.1-14b", "wan2.1-1.3b", "ltx-video", "ltx-video-161f", "ltx-2")
"""``integrations.models.PRESETS``: the Diffusers models ``sparsp trace`` and ``bench e2e`` build."""
PROFILE_NAMES = ("h200x2-nvlink", "h200x2-host", "pcie4-8gpu-p2p", "pcie4-8gpu-nop2p", "pcie5-8gpu-p2p",
                 "pcie5-8gpu-nop2p", "dgx-h100-8hosts", "dgx-h200-8hosts", "pcie5-8hosts-p2p", "pcie5-8hosts-nop2p")
"""``cost.profiles.PROFILES``: the built-in fabric profiles of ``sparsp simulate``."""

