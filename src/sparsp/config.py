"""``SparspConfig``: the knobs of one sequence-parallel attention call."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from .thresholds import ThresholdTable, read_thresholds

if TYPE_CHECKING:  # annotations only: importing the config (the command line's --help) needs no torch
    import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class SparspConfig:
    cdf_threshold: float | tuple[float, ...] = 0.9
    """SpargeAttn CDF threshold in [0, 1], or one value per head; 1.0 (with similarity off)
    selects every block: exact dense attention."""
    sim_threshold: float | tuple[float, ...] | None = None
    """Block self-similarity threshold in [0, 1], or one per head; None turns similarity off."""
    block_size: int = 128
    """Kernel tile in tokens, for queries and keys alike (the unit of demand and transfer)."""
    transport: str = "auto"
    """How payloads move: a registered transport (``sparsp.transport.transport_names()``:
    ``nccl`` = torch.distributed p2p, NCCL on GPU and gloo on CPU; ``ipc`` = CUDA IPC peer
    copies on copy engines; ``host`` = pinned shared host memory) or ``auto`` (ipc where peer
    access works, else host on GPU; nccl/gloo on CPU; ``sparsp.transport.select``)."""
    kernel: str = "auto"
    """Block-sparse kernel: a registered kernel (``sparsp.kernels.kernel_names()``: ``torch``
    reference on CPU/GPU, ``flex`` on GPU, ...) or ``auto``."""
    timeout_s: float = 120.0
    """Every wait on a peer raises ``TimeoutError`` after this many seconds instead of hanging."""
    prefetch: int = 1
    """Rounds fetched ahead of the one being computed (1 = double buffering)."""
    check_finite: bool = True
    """Count NaN/Inf in q, k, v on every call and raise ``ValueError`` on every rank (naming the
    tensor, the rank and the count) instead of letting them spread through the softmax merge
    into every peer's output. Costs one pass over the inputs and, on GPU, one host sync (the
    counts ride on the shape all-gather the call makes anyway). Turn it off in production once
    the inputs are trusted."""
    chunks: int | None = None
    """Steady-state chunks (paper §7.1): the remote payloads of rounds 1..G−2 travel as this
    many messages, one per head group, each computed as soon as it landed. None: automatic
    (``cost/chunks.py``: unchunked); 1: off. Clamped to the number of heads."""
    drain_chunks: int | None = None
    """Drain chunks: the same for the last remote payload (round G−1, whose transfer no later
    compute hides; with G = 2 the only one). None: automatic (chunked only where the pair is
    transfer-bound and the payload large enough, ``cost/chunks.py``); 1: off. Clamped
    to the number of heads. Both counts apply to the ``sparsp`` strategy only and must be the
    same on every rank (sender and consumer derive each message from them)."""
    cuda_graphs: bool = True
    """On CUDA, replay the shape-static stage of a call (gathered summaries → whole mask →
    the strategy's payload selections → layouts and counts, ``strategies/captured.py``) as one
    CUDA graph per geometry, captured on the geometry's second call: an LTX-size call issues
    ~200 small ops there, which the host needs longer to queue than the device to run. Keeps
    the stage's buffers (some MB at LTX size, up to ~1 GB at HunyuanVideo size) on the device
    until ``close_transports()``, for at most ``captured.MAX_STAGES`` (32) geometries and
    configs (the least recently used go first). Off, or on the CPU: eager, the same
    arithmetic."""

    local_first: bool | None = None
    """Queue the local shard's kernel before the call's host read and issue the first round's
    packs and transfers on a high-priority side stream while it runs (strategies registered
    ``local_first``: ``ring``, ``ring-sparse``, ``ring-relay``, ``sparsp``;
    ``strategies.call.Call.side``), so that the device computes while the host waits for the
    read, checks the headers and issues the pack; the same blocks and the same merge order.
    None (automatic): where it pays, per call and rank (``Call.local_first_pays``): on a
    copy-engine transport (``ipc``, ``host``) whose first round, as large as in the last call
    of the geometry, moves in less time than the local kernel computes; never over ``nccl``,
    whose copy kernels would queue behind the local kernel for the GPU's SMs. True: always;
    False: never (the local kernel runs where the strategy's run reaches it, after the first
    round's pack)."""
    local_transport: str | None = None
    """The transport of every pair of ranks on one host, in place of the one its ``auto`` rule
    picks (a registered transport other than ``peers``); pairs on different hosts keep
    theirs. Applies where ``transport`` is ``auto`` or ``peers``: where the pairs then want
    different transports, or the on-host pairs want another than the rules pick for the whole
    group, one ``peers`` transport serves each pair through its own (``transport/peers.py``).
    None: every pair by its rule. For tests (``host`` on CPU, whose rule declines CPU tensors)
    and for measuring one on-host path beside another on the same machine."""

    thresholds: str | None = None
    """A JSON table of ``cdf_threshold`` and ``sim_threshold`` per (layer, head)
    (``sparsp.thresholds``, docs/configuration.md): a call with ``layer=L`` takes layer L's
    values; a layer the table leaves out, or a call without a layer, takes the scalars above.
    Read and checked when the config is made (``ValueError`` naming the file)."""
    dense_steps: int = 0
    """The denoising schedule (docs/configuration.md, "Schedules"): steps 0 … dense_steps − 1 of
    a run run exact dense attention through the strategy's dense path (no mask, no demand).
    Applies to calls that say their step (``sp_attention(step=)``; the Diffusers integration
    counts steps itself); a call without a step plans afresh."""
    replan_every: int = 1
    """From step ``dense_steps`` on, step S solves its plan (the mask, the demand and payload
    sizes, ``auto``'s choice, ``ulysses``' head order) where (S − dense_steps) % replan_every
    == 0, and otherwise reuses the last plan solved for the same layer, branch and geometry
    (or solves one if there is none). 1: every step plans, as a call without a step does."""
    kept_plans: int = 256
    """Plans kept for reuse (``replan_every`` > 1), per process, least recently used first out:
    one per (model, layer, branch, geometry, strategy, config, dtype, device). Every rank makes
    the same calls, so every rank keeps and drops the same plans. What one plan holds is in
    docs/performance.md ("Plan and reuse calls")."""
    _table: ThresholdTable | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_threshold("cdf_threshold", self.cdf_threshold, allow_none=False)
        _check_threshold("sim_threshold", self.sim_threshold, allow_none=True)
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        from .kernels import kernel_names  # the registries, imported when a config is made
        from .transport import transport_names

        transports = transport_names(with_auto=True)
        if self.transport not in transports:
            raise ValueError(f"transport must be one of {', '.join(transports)}; got {self.transport!r}")
        kernels = kernel_names(with_auto=True)
        if self.kernel not in kernels:
            raise ValueError(f"kernel must be one of {', '.join(kernels)}; got {self.kernel!r}")
        if not _is_number(self.timeout_s) or not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if not _is_int(self.prefetch) or self.prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1, got {self.prefetch!r}")
        for name in ("chunks", "drain_chunks"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be None (automatic) or an int >= 1 (1 = off), "
                                 f"got {value!r}")
        if not isinstance(self.check_finite, bool):
            raise ValueError(f"check_finite must be True or False, got {self.check_finite!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.local_first is not None and not isinstance(self.local_first, bool):
            raise ValueError(f"local_first must be None (automatic), True or False, got {self.local_first!r}")
        if self.local_transport is not None:
            local = [n for n in transport_names() if n != "peers"]
            if self.local_transport not in local:
                raise ValueError(f"local_transport must be None or one of {', '.join(local)}; "
                                 f"got {self.local_transport!r}")
        if not _is_int(self.dense_steps) or self.dense_steps < 0:
            raise ValueError(f"dense_steps must be an int >= 0, got {self.dense_steps!r}")
        if not _is_int(self.replan_every) or self.replan_every < 1:
            raise ValueError(f"replan_every must be an int >= 1 (1 = plan every step), got {self.replan_every!r}")
        if not _is_int(self.kept_plans) or self.kept_plans < 1:
            raise ValueError(f"kept_plans must be an int >= 1, got {self.kept_plans!r}")
        if self.thresholds is not None:
            if not isinstance(self.thresholds, (str, os.PathLike)):
                raise ValueError(f"thresholds must be None or the path of a thresholds file, got "
                                 f"{type(self.thresholds).__name__}")
            object.__setattr__(self, "thresholds", os.fspath(self.thresholds))
            object.__setattr__(self, "_table", read_thresholds(self.thresholds, option="thresholds"))

    @classmethod
    def from_thresholds(cls, path, **fields) -> "SparspConfig":
        """A config whose per-(layer, head) thresholds come from the table at ``path``; ``fields``
        set the rest (their scalars serve the layers the table leaves out)."""
        return cls(thresholds=path, **fields)

    @property
    def table(self) -> ThresholdTable | None:
        """The thresholds table read from ``thresholds`` (None without one)."""
        return self._table

    def at_layer(self, layer: int | None) -> "SparspConfig":
        """The config a call attending for ``layer`` runs with: the table's values of that layer
        in place of the scalars, and no table (the same object without a table or a layer)."""
        if self._table is None:
            return self
        return _at_layer(self, layer)

    @property
    def scheduled(self) -> bool:
        """Whether a call that says its step follows a schedule: some steps dense or some
        plans reused."""
        return self.dense_steps > 0 or self.replan_every > 1

    def step_kind(self, step: int) -> str:
        """What step ``step`` (from 0) of a run does: ``"dense"``, ``"plan"`` or ``"reuse"``
        (a reuse step with no plan kept for its key plans instead)."""
        if step < self.dense_steps:
            return "dense"
        return "plan" if (step - self.dense_steps) % self.replan_every == 0 else "reuse"

    def cdf_tensor(self, heads: int) -> torch.Tensor | float:
        return _per_head(self.cdf_threshold, heads, "cdf_threshold")

    def sim_tensor(self, heads: int):
        return None if self.sim_threshold is None else _per_head(self.sim_threshold, heads, "sim_threshold")

    @property
    def dense(self) -> bool:
        """True when the mask is all ones whatever the inputs (cdf 1, similarity off)."""
        values = self.cdf_threshold if isinstance(self.cdf_threshold, tuple) else (self.cdf_threshold,)
        return self.sim_threshold is None and all(v >= 1.0 for v in values)


@lru_cache(maxsize=1024)
def _at_layer(config: SparspConfig, layer: int | None) -> SparspConfig:
    cdf, sim = config.table.at(layer)
    return replace(config, thresholds=None,
                   cdf_threshold=config.cdf_threshold if cdf is None else cdf,
                   sim_threshold=config.sim_threshold if sim is None else sim)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int in Python


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_threshold(name, value, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    values = value if isinstance(value, tuple) else (value,)
    if not values or not all(_is_number(v) and 0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"{name} must be a number in [0, 1] or a tuple of them, got {value!r}")


def _per_head(value, heads: int, name: str):
    if isinstance(value, tuple):
        if len(value) != heads:
            raise ValueError(f"{name} has {len(value)} per-head values but the inputs have {heads} heads")
        import torch  # here: importing the config (the command line's --help) needs no torch

        return torch.tensor(value, dtype=torch.float64)
    return float(value)
