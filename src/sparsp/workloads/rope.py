"""The RoPE tables of a geometry, as the synthetic workloads use them: each dim pair's frequency
and axis, the angle of every token, block means of cos and sin, and the pair rotation
(docs/workloads.md, "The model"). Shared by ``synthetic`` (q/k and pooled blocks) and
``scores`` (token-level scores of sampled rows)."""

from __future__ import annotations

import torch

from ..geometry import Rope, VideoGeometry


def rope_of(geom: VideoGeometry) -> Rope:
    """The geometry's RoPE; a custom geometry without one gets Wan's split rule and θ = 1e4."""
    if geom.rope is not None:
        rope = geom.rope
    else:
        hw = 2 * (geom.head_dim // 6)
        rope = Rope(axes_dim=(geom.head_dim - 2 * hw, hw, hw))
    if sum(rope.axes_dim) > geom.head_dim or any(d < 2 for d in rope.axes_dim):
        raise ValueError(f"rope.axes_dim {rope.axes_dim} must be parts >= 2 within head_dim {geom.head_dim}")
    return rope


def frequencies(geom: VideoGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Per dim pair: ω (float64 [D/2]) and its axis (long [D/2]): 0/1/2 = t/h/w pairs in that
    order, then 3 for dims RoPE leaves alone (an odd axis part, as LTX pads; ω = 0)."""
    rope = rope_of(geom)
    omegas, axes = [], []
    for axis, d in enumerate(rope.axes_dim):
        i = torch.arange(d // 2, dtype=torch.float64)
        omegas.append(rope.theta ** (-2.0 * i / d) / rope.scale[axis])  # scale divides positions
        axes.append(torch.full((d // 2,), axis, dtype=torch.long))
    rest = geom.head_dim // 2 - sum(d // 2 for d in rope.axes_dim)
    omegas.append(torch.zeros(rest, dtype=torch.float64))
    axes.append(torch.full((rest,), 3, dtype=torch.long))
    return torch.cat(omegas), torch.cat(axes)


def angles(geom: VideoGeometry, tokens: torch.Tensor) -> torch.Tensor:
    """Rotation angle per (token, pair), float64 [len(tokens), D/2]; text tokens: 0 (no RoPE)."""
    omega, axis = frequencies(geom)
    coords = torch.zeros(len(tokens), 4, dtype=torch.float64)  # column 3: unrotated dims
    video = tokens < geom.video_tokens
    v = tokens[video]
    rem = v % geom.frame_tokens
    coords[video, :3] = torch.stack([v // geom.frame_tokens, rem // geom.width, rem % geom.width], 1).double()
    return coords[:, axis] * omega


def block_trig(geom: VideoGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-mean cos and sin per frequency, float64 [num_blocks, D/2], shared by all heads."""
    n, bs = geom.num_blocks, geom.block_size
    lengths = geom.block_lengths().double()[:, None]
    cos_sum, sin_sum = [], []
    for start in range(0, n, 256):  # chunks bound the memory of the token-level angles
        stop = min(n, start + 256)
        tokens = torch.arange(start * bs, min(stop * bs, geom.num_tokens))
        ang = torch.nn.functional.pad(angles(geom, tokens), (0, 0, 0, (stop - start) * bs - len(tokens)))
        # Padded rows get angle 0 → cos 1; remove them from the sums below.
        cos_sum.append(ang.cos().reshape(stop - start, bs, -1).sum(1))
        sin_sum.append(ang.sin().reshape(stop - start, bs, -1).sum(1))
    cos_sum, sin_sum = torch.cat(cos_sum), torch.cat(sin_sum)
    cos_sum[-1] -= bs - geom.tail_tokens
    return cos_sum / lengths, sin_sum / lengths


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of ``x`` (…, D) by cos/sin (…, D/2)."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
