"""What the benchmarks and ``sparsp analyze`` attend over when no model runs: synthetic video
attention, recorded mask traces, published per-head density profiles, and heads fitted to them.

``synthetic``    q/k from each model's own 3D RoPE (docs/workloads.md); ``synthetic_masks``
``rope``         the RoPE tables ``synthetic`` and ``scores`` share
``traces``       recorded block masks (``sparsp trace`` writes them, ``analyze --trace`` reads)
``density``      per-(step, layer, head) density profiles (CSV of the public repositories, JSON)
``scores``       token-level scores of sampled query rows, drawn directly, and their density
``alignment``    the search for one head's alignment against a target density
``calibration``  the generator's heads fitted to a density profile, layer by layer

The documented names are importable from here (``from sparsp.workloads import synthetic_masks``).
"""

from .calibration import Calibration, calibrate, calibrate_layer, read_calibration
from .density import DensityProfile, read_profile
from .scores import row_scores
from .synthetic import DEFAULT_MIX, KINDS, HeadMix, HeadParams, head_kinds, pooled_qk, synthetic_masks, token_qk
from .traces import Trace, load_trace, save_trace

__all__ = ["DEFAULT_MIX", "KINDS", "Calibration", "DensityProfile", "HeadMix", "HeadParams", "Trace",
           "calibrate", "calibrate_layer", "head_kinds", "load_trace", "pooled_qk", "read_calibration",
           "read_profile", "row_scores", "save_trace", "synthetic_masks", "token_qk"]
