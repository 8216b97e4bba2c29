"""Synthetic video attention from each model's own 3D RoPE, and mask traces.

THESE MASKS ARE SYNTHETIC. No model weights can be downloaded, and a generator drawn to flatter
periodic placement would prove nothing (docs/design.md, "Synthetic
workloads"), so every head is one content vector c_h turned by the model's real RoPE:

    q_n = R(p_n)(a_h c_h + σ ε_n),   k_m = R(p_m)(a_h c_h + σ ε'_m [+ g_h u_h if m is a sink])

R(p) rotates adjacent dim pairs; the head dim splits into t/h/w parts (``rope.axes_dim``); pair
i of an axis with d dims turns at ω_i = θ^(-2i/d) per position unit; positions are latent
(t, h, w) divided by ``rope.scale``. Noise-free, q_n·k_m = a² Σ_pairs |c_pair|² cos(ω·Δp): a
relative-position kernel shaped by where c puts its energy. h/w energy only → no Δt dependence
→ same place in every frame (multi-diagonal); t and h/w → same frame and nearby (diagonal);
large-norm sink keys on c's lowest-frequency h/w pairs, which RoPE barely turns, → columns;
content-only heads without RoPE → dense control. Text tokens (HunyuanVideo's 256) get no RoPE,
as in Diffusers' processor, so they look like position (0, 0, 0) to a positional head.

``pooled_qk`` works at block level: the mean of R(p_n)x over a block is x turned by the block
means of cos/sin (per frequency, shared by all heads), and the mean of ``len`` iid N(0, σ²)
noises is N(0, σ²/len) — 126,720 tokens × 24 heads never exist at token level.
Model, calibration and caveats: docs/workloads.md. ``HeadParams`` sets the heads' kinds and
alignments from outside, for ``sparsp.workloads.calibration``, which fits the heads to a real
model's per-head densities (measured on ``sparsp.workloads.scores``' token-level scores).
Recorded masks (traces) are read and written by ``sparsp.workloads.traces``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..geometry import VideoGeometry
from ..masks import PooledBlocks, select_blocks
from .rope import angles, block_trig, frequencies, rotate_pairs

KINDS = ("diagonal", "multi-diagonal", "column", "dense")
# Above this many elements per tensor token_qk refuses: full-size geometries use pooled_qk.
_TOKEN_LIMIT = 1 << 26


@dataclass(frozen=True, kw_only=True, slots=True)
class HeadMix:
    """Which kinds of heads a layer has and how sharp they are. Shares are rounded to head
    counts (largest remainder); which head gets which kind is drawn per layer."""

    diagonal: float = 0.375
    """Share of heads with content on t and h/w frequencies (same frame and nearby)."""
    multi_diagonal: float = 0.375
    """Share of heads with content on h/w frequencies only (same place in every frame)."""
    column: float = 0.15
    """Share of heads with ``sinks`` large-norm sink keys on top of a weak diagonal-like part."""
    dense: float = 0.1
    """Share of content-only heads without RoPE (dense control)."""
    alignment: tuple[float, float] = (0.8, 1.2)
    """Range of a (signal/noise per token); scores scale as a², so a sets the sharpness."""
    time_share: tuple[float, float] = (0.3, 0.6)
    """Range of the share of c's energy on t pairs for diagonal and column heads."""
    multi_time_share: tuple[float, float] = (0.02, 0.06)
    """The same for multi-diagonal heads: small but not zero, so their pull towards the same
    place in other frames fades with Δt as in real models; zero would be the best case for
    periodic placement, and the generator must not be drawn to flatter it."""
    tilt: float = 1.0
    """Spectral tilt: the energy of pair i of every axis ∝ (ω_i/ω_0)^tilt × a random draw;
    > 0 favours fast frequencies, i.e. a sharp decay with distance (0: RoPE's slow decay)."""
    sink_alignment: tuple[float, float] = (0.7, 1.0)
    """Range of a for column heads: their positional part is weak, the sinks carry them."""
    sinks: int = 16
    """Sink keys per column head, one each in distinct blocks drawn per head."""
    sink_share: float = 0.5
    """Share of a column head's content energy on the lowest-frequency h and w pairs."""
    sink_gain: float = 300.0
    """Norm of a sink's extra key component, in units of a·√head_dim (an ordinary key's content)."""
    noise: float = 1.0
    """σ of the per-token, per-dim noise of q and k (0: noise-free)."""

    def __post_init__(self) -> None:
        shares = self.shares()
        for kind, share in shares.items():
            if not math.isfinite(share) or share < 0:
                raise ValueError(f"HeadMix share for {kind} must be a finite float >= 0, got {share!r}")
        if abs(sum(shares.values()) - 1.0) > 1e-6:
            raise ValueError(f"HeadMix shares must sum to 1, got {shares} (sum {sum(shares.values())})")
        if not 0.0 < self.sink_share < 1.0:
            raise ValueError(f"HeadMix.sink_share must lie in (0, 1), got {self.sink_share!r}")
        for name, lo_min, hi_max in (
            ("alignment", 0.0, math.inf), ("sink_alignment", 0.0, math.inf), ("time_share", 0.0, 1.0),
            ("multi_time_share", 0.0, 1.0),
        ):
            lo, hi = getattr(self, name)
            if not (lo_min <= lo <= hi <= hi_max):
                raise ValueError(f"HeadMix.{name} must be (lo, hi) with {lo_min} <= lo <= hi <= {hi_max}, "
                                 f"got {(lo, hi)}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"HeadMix.sinks must be an int >= 0, got {self.sinks!r}")
        if not (self.sink_gain >= 0 and self.noise >= 0):
            raise ValueError(f"HeadMix.sink_gain and noise must be >= 0, got {self.sink_gain!r}, {self.noise!r}")

    def shares(self) -> dict[str, float]:
        return dict(zip(KINDS, (self.diagonal, self.multi_diagonal, self.column, self.dense)))

    def counts(self, heads: int) -> dict[str, int]:
        """Head count per kind: floor of share × heads, the rest by largest remainder."""
        raw = {k: s * heads for k, s in self.shares().items()}
        counts = {k: math.floor(v) for k, v in raw.items()}
        by_remainder = sorted(KINDS, key=lambda k: (-(raw[k] - counts[k]), KINDS.index(k)))
        for k in by_remainder[: heads - sum(counts.values())]:
            counts[k] += 1
        return counts


DEFAULT_MIX = HeadMix()


# --- per-head parameters -------------------------------------------------------------------------


@dataclass(frozen=True)
class Heads:
    """One layer's drawn heads (``draw_heads``): what q and k are made of, before noise."""

    kinds: tuple[str, ...]
    a: torch.Tensor  # float64 [H] alignment
    c: torch.Tensor  # float64 [H, D] content, |c|² = D
    rotate: torch.Tensor  # bool [H]: RoPE applied (False for dense heads)
    sink_dir: torch.Tensor  # float64 [H, D]: g·u_h, nonzero only for column heads
    sinks: tuple[torch.Tensor, ...]  # per head: LongTensor of sink token indices


def seeded_generator(seed: int, layer: int, stream: int | str) -> torch.Generator:
    """The generator of one stream of draws of (``seed``, ``layer``): every purpose has its own,
    so layers differ in every draw and adding a purpose moves no other draw."""
    # Hashed because the CPU generator keeps only 32 bits of its seed.
    digest = hashlib.blake2b(f"sparsp-workloads/{seed}/{layer}/{stream}".encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


@dataclass(frozen=True, slots=True)
class HeadParams:
    """One layer's heads set from outside (a calibration, ``sparsp.workloads.calibration``) instead of
    drawn: the kind and the alignment a of every head. The other draws (c, ρ, sinks, noise)
    still come from the seed, so the same (seed, layer, HeadParams) always gives the same q/k."""

    kinds: tuple[str, ...]
    alignment: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", tuple(self.kinds))
        object.__setattr__(self, "alignment", tuple(float(a) for a in self.alignment))
        if len(self.kinds) != len(self.alignment):
            raise ValueError(f"HeadParams: {len(self.kinds)} kinds but {len(self.alignment)} alignments")
        for k in self.kinds:
            if k not in KINDS:
                raise ValueError(f"HeadParams: unknown head kind {k!r}; choose from {KINDS}")
        for a in self.alignment:
            if not (math.isfinite(a) and a >= 0):
                raise ValueError(f"HeadParams: alignment must be a finite float >= 0, got {a!r}")


def draw_heads(geom: VideoGeometry, mix: HeadMix, seed: int, layer: int, given: HeadParams | None = None) -> Heads:
    """Layer ``layer``'s heads drawn from ``mix`` (kinds and alignments from ``given`` instead,
    when set): the parameters ``token_qk``, ``pooled_qk`` and ``workloads.scores`` share."""
    H, D = geom.heads, geom.head_dim
    if given is not None and len(given.kinds) != H:
        raise ValueError(f"HeadParams for {len(given.kinds)} heads, the geometry has {H}")
    gen = seeded_generator(seed, layer, 0)
    kinds = [k for k, n in mix.counts(H).items() for _ in range(n)]
    kinds = tuple(kinds[i] for i in torch.randperm(H, generator=gen).tolist())
    if given is not None:  # after the draw it replaces, so every later draw keeps its place in the stream
        kinds = given.kinds
    lo, hi = torch.tensor([mix.sink_alignment if k == "column" else mix.alignment for k in kinds]).double().T
    a = lo + (hi - lo) * torch.rand(H, generator=gen, dtype=torch.float64)
    if given is not None:
        a = torch.tensor(given.alignment, dtype=torch.float64)
    c = torch.randn(H, D, generator=gen, dtype=torch.float64)
    omega, axis = frequencies(geom)
    top = torch.stack([omega[axis == ax].max() for ax in range(3)] + [torch.ones((), dtype=torch.float64)])[axis]
    c *= ((omega / top).where(axis < 3, 1.0) ** (mix.tilt / 2)).repeat_interleave(2)  # amplitude = √energy
    t_lo, t_hi = mix.time_share
    rho = t_lo + (t_hi - t_lo) * torch.rand(H, generator=gen, dtype=torch.float64)
    m_lo, m_hi = mix.multi_time_share
    u = torch.rand(H, generator=gen, dtype=torch.float64)
    rho = torch.where(torch.tensor([k == "multi-diagonal" for k in kinds]), m_lo + (m_hi - m_lo) * u, rho)
    t_dims = (axis == 0).repeat_interleave(2)
    # Sinks live on the lowest-frequency pair of h and w: RoPE barely turns them across the
    # grid, so every query sees a sink alike (the "DC" dims that attention sinks use).
    low = torch.zeros(D // 2, dtype=torch.bool)
    low[[int((axis == ax).nonzero().max()) for ax in (1, 2)]] = True
    low = low.repeat_interleave(2)
    sink_dir = torch.zeros(H, D, dtype=torch.float64)
    sinks = []
    for h, kind in enumerate(kinds):
        if kind == "dense":
            c[h] *= math.sqrt(D) / c[h].norm()
        else:
            share = rho[h].item()
            c[h, t_dims] *= math.sqrt(share * D) / c[h, t_dims].norm()
            c[h, ~t_dims] *= math.sqrt((1.0 - share) * D) / c[h, ~t_dims].norm()
        n_sinks = mix.sinks if kind == "column" else 0
        blocks = torch.randperm(geom.num_blocks, generator=gen)[:n_sinks].sort().values
        offset = (torch.rand(len(blocks), generator=gen, dtype=torch.float64) * geom.block_lengths()[blocks]).long()
        sinks.append(blocks * geom.block_size + offset)
        if n_sinks:
            # The DC pairs take sink_share of c's energy (instead of their tiny tilted share).
            c[h, ~low] *= math.sqrt((1.0 - mix.sink_share) * D) / c[h, ~low].norm()
            c[h, low] *= math.sqrt(mix.sink_share * D) / c[h, low].norm()
            # Scaled by a like the content, so a sink's pull grows with the head's sharpness.
            sink_dir[h, low] = mix.sink_gain * a[h] * math.sqrt(D) * c[h, low] / c[h, low].norm()
    rotate = torch.tensor([k != "dense" for k in kinds])
    return Heads(kinds, a, c, rotate, sink_dir, tuple(sinks))


def head_kinds(geom: VideoGeometry, *, seed: int, mix: HeadMix | None = None, layer: int = 0) -> tuple[str, ...]:
    """The kind (one of ``KINDS``) of every head that ``token_qk``/``pooled_qk`` generate."""
    return draw_heads(geom, mix or DEFAULT_MIX, seed, layer).kinds


# --- generators ----------------------------------------------------------------------------------


def token_qk(
    geom: VideoGeometry,
    *,
    batch: int = 1,
    seed: int,
    mix: HeadMix | None = None,
    dtype: torch.dtype = torch.float32,
    layer: int = 0,
    tokens: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    heads: HeadParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level q, k (B, S, H, D). The batch shares the heads' parameters; noise differs
    per batch element.

    ``tokens`` (LongTensor of token ids in the model's order) generates only those tokens —
    one rank's slice of a placed full-size sequence, e.g. ``placement.perm[slice]`` — with
    the same heads; their noise is drawn afresh for the subset. On the CPU the size is capped
    (use ``pooled_qk`` for analysis of full geometries); on a GPU it is not. ``heads`` sets the
    kinds and alignments (a calibration) instead of drawing them.
    """
    mix = mix or DEFAULT_MIX
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    device = torch.device(device or "cpu")
    ids = torch.arange(geom.num_tokens) if tokens is None else tokens.long().cpu()
    if ids.numel() and (ids.min() < 0 or ids.max() >= geom.num_tokens):
        raise ValueError(f"tokens must lie in [0, {geom.num_tokens}), got [{ids.min()}, {ids.max()}]")
    B, S, H, D = batch, ids.numel(), geom.heads, geom.head_dim
    if device.type == "cpu" and B * S * H * D > _TOKEN_LIMIT:
        raise ValueError(f"token_qk of {geom.describe()} × batch {B} is too large on the CPU; use pooled_qk")
    work = torch.float64 if dtype == torch.float64 else torch.float32  # same draws for fp32/bf16
    heads = draw_heads(geom, mix, seed, layer, heads)
    if device.type == "cpu":
        gen = seeded_generator(seed, layer, 1)
    else:
        gen = torch.Generator(device=device).manual_seed(seeded_generator(seed, layer, 1).initial_seed())
    base = (heads.a[:, None] * heads.c).to(device, work)  # [H, D]
    xq = base + mix.noise * torch.randn(B, S, H, D, generator=gen, dtype=work, device=device)
    xk = base + mix.noise * torch.randn(B, S, H, D, generator=gen, dtype=work, device=device)
    where = torch.full((geom.num_tokens,), -1, dtype=torch.long)
    where[ids] = torch.arange(S)
    for h, idx in enumerate(heads.sinks):
        local = where[idx]
        local = local[local >= 0].to(device)
        xk[:, local, h] += heads.sink_dir[h].to(device, work)
    ang = angles(geom, ids)[:, None, :].to(device)  # [S, 1, D/2]
    rot = heads.rotate[None, :, None].to(device)
    cos = torch.where(rot, ang.cos(), 1.0).to(work)  # dense heads: no RoPE
    sin = torch.where(rot, ang.sin(), 0.0).to(work)
    return rotate_pairs(xq, cos, sin).to(dtype), rotate_pairs(xk, cos, sin).to(dtype)


def _pooled(geom: VideoGeometry, heads: Heads, trig, mix: HeadMix, gen: torch.Generator):
    H, D, S = geom.heads, geom.head_dim, geom.num_tokens
    lengths = geom.block_lengths()
    rot = heads.rotate[:, None, None]
    cos = torch.where(rot, trig[0][None], 1.0)  # [H, nB, D/2]
    sin = torch.where(rot, trig[1][None], 0.0)
    mean = rotate_pairs((heads.a[:, None] * heads.c)[:, None, :], cos, sin)  # [H, nB, D], q and k alike
    k_mean = mean.clone()
    for h, idx in enumerate(heads.sinks):
        if len(idx):
            ang, block = angles(geom, idx), idx // geom.block_size
            # A sink adds its rotated extra component to its block's sum (1/len of the mean).
            k_mean[h].index_add_(0, block, rotate_pairs(heads.sink_dir[h], ang.cos(), ang.sin()) / lengths[block, None])
    sd = mix.noise / lengths.double().sqrt()[None, :, None]  # mean of len iid N(0, σ²)
    q_mean = mean + sd * torch.randn(H, len(lengths), D, generator=gen, dtype=torch.float64)
    k_mean += sd * torch.randn(H, len(lengths), D, generator=gen, dtype=torch.float64)
    # Key smoothing (docs/design.md, "Mask semantics"): the exact sequence mean of k from block means.
    k_mean -= (k_mean * lengths.double()[None, :, None]).sum(1, keepdim=True) / S
    # Similarity is off in the analysis (sim = 1: every block similar), so no sim is modelled.
    ones = torch.ones(1, H, len(lengths))
    return (PooledBlocks(q_mean.float()[None], ones, lengths), PooledBlocks(k_mean.float()[None], ones, lengths))


def pooled_qk(
    geom: VideoGeometry, *, seed: int, mix: HeadMix | None = None, layer: int = 0,
    heads: HeadParams | None = None,
) -> tuple[PooledBlocks, PooledBlocks]:
    """Block summaries (batch 1) of the q and k that ``token_qk`` would give, generated at block
    level: keys smoothed by their exact sequence mean, ``sim`` = 1. Noise is drawn at block
    level, so it matches ``token_qk``'s in distribution only (equal when ``mix.noise`` = 0)."""
    mix = mix or DEFAULT_MIX
    heads = draw_heads(geom, mix, seed, layer, heads)
    return _pooled(geom, heads, block_trig(geom), mix, seeded_generator(seed, layer, 2))


def synthetic_masks(
    geom: VideoGeometry,
    cdf_thresholds: float | Sequence[float],
    *,
    layers: int = 1,
    seed: int = 0,
    mix: HeadMix | None = None,
    on_layer: Callable[[int], None] | None = None,
    heads: Sequence[HeadParams] | None = None,
    thresholds=None,
) -> dict[float, torch.Tensor]:
    """Synthetic block masks {cdf: bool [layers, H, nB, nB]} (original block order), similarity
    off. ``on_layer(i)`` is called after each layer (progress bars). ``heads[i]`` sets layer
    i's kinds and alignments (a calibration); it must cover every layer asked for.
    ``thresholds``: a ``sparsp.thresholds.ThresholdTable`` whose layer i's values replace the
    scalar cdf (and turn similarity on where it sets ``sim``: every synthetic block is fully
    similar, so only a threshold of 1 marks blocks dissimilar) in layer i's masks; the keys
    stay the scalars, which the layers the table leaves out use."""
    mix = mix or DEFAULT_MIX
    cdfs = [float(x) for x in ([cdf_thresholds] if isinstance(cdf_thresholds, (int, float)) else cdf_thresholds)]
    if not cdfs or any(not 0.0 <= x <= 1.0 for x in cdfs):
        raise ValueError(f"cdf_thresholds must be values in [0, 1], got {cdf_thresholds!r}")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a positive int, got {layers!r}")
    if heads is not None and len(heads) < layers:
        raise ValueError(f"{layers} layers asked for, but head parameters for only {len(heads)}")
    trig = block_trig(geom)
    n = geom.num_blocks
    out = {x: torch.empty(layers, geom.heads, n, n, dtype=torch.bool) for x in cdfs}
    for layer in range(layers):
        given = None if heads is None else heads[layer]
        pq, pk = _pooled(geom, draw_heads(geom, mix, seed, layer, given), trig, mix, seeded_generator(seed, layer, 2))
        # select_blocks sorts once per call; one call per threshold keeps its logic in one place.
        cdf, sim = (None, None) if thresholds is None else thresholds.at(layer)
        for x in cdfs:
            out[x][layer] = select_blocks(pq, pk, cdf_threshold=x if cdf is None else cdf, sim_threshold=sim)[0]
        if on_layer is not None:
            on_layer(layer)
    return out
