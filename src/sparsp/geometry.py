"""Video geometry in latent tokens, model presets, and token/block arithmetic.

A DiT sees a video as T×H×W latent tokens in row-major (t, h, w) order, optionally followed
by text tokens that take part in the same joint attention (HunyuanVideo). The attention kernel
tiles that sequence into *blocks* of ``block_size`` consecutive tokens; the last block may be
short. Everything downstream (placement, masks, demand) speaks in those blocks.

Token counts follow the VAE/patch formula (docs/design.md, "Models and geometry"):

    tokens = (F'/p_t) · (H/c_s/p) · (W/c_s/p),   F' = (F − 1)/c_t + 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor is made: the presets load without it
    import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class Rope:
    """The model's 3D rotary embedding, used by the synthetic workloads (``workloads``).

    ``axes_dim`` splits the head dim into (t, h, w) parts; ``theta`` is the base; ``scale``
    divides positions per axis (LTX normalises positions by base frames/height/width).
    """

    axes_dim: tuple[int, int, int]
    theta: float = 10_000.0
    scale: tuple[float, float, float] = (1.0, 1.0, 1.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """How a model maps pixels to latent tokens, and the attention shape it runs."""

    name: str
    heads: int
    head_dim: int
    layers: int
    temporal_compression: int  # c_t
    spatial_compression: int  # c_s
    patch_t: int  # p_t
    patch: int  # p (spatial)
    text_tokens: int
    rope: Rope
    default_video: tuple[int, int, int]  # (width, height, frames) in pixels
    note: str = ""


@dataclass(frozen=True, slots=True)
class VideoGeometry:
    """One attention sequence: ``frames × height × width`` latent tokens plus text tokens.

    ``frames``, ``height``, ``width`` are in latent tokens (after VAE and patchify).
    """

    frames: int
    height: int
    width: int
    text_tokens: int = 0
    block_size: int = 128
    heads: int = 24
    head_dim: int = 128
    layers: int = 1
    name: str = "custom"
    rope: Rope | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for attr in ("frames", "height", "width", "block_size", "heads", "head_dim", "layers"):
            value = getattr(self, attr)
            if not _is_int(value) or value < 1:
                raise ValueError(f"VideoGeometry.{attr} must be a positive int, got {value!r}")
        if not _is_int(self.text_tokens) or self.text_tokens < 0:
            raise ValueError(f"VideoGeometry.text_tokens must be an int >= 0, got {self.text_tokens!r}")

    # --- token arithmetic -------------------------------------------------------------------
    @property
    def frame_tokens(self) -> int:
        """Tokens in one latent frame (the multi-diagonal period)."""
        return self.height * self.width

    @property
    def video_tokens(self) -> int:
        return self.frames * self.frame_tokens

    @property
    def num_tokens(self) -> int:
        return self.video_tokens + self.text_tokens

    # --- block arithmetic -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return math.ceil(self.num_tokens / self.block_size)

    @property
    def tail_tokens(self) -> int:
        """Tokens in the last block (``block_size`` when the sequence divides evenly)."""
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block_lengths(self) -> torch.Tensor:
        """LongTensor [num_blocks]: the real token count of every block."""
        import torch  # here, not at import: the command line's --help reads PRESETS without torch

        lengths = torch.full((self.num_blocks,), self.block_size, dtype=torch.long)
        lengths[-1] = self.tail_tokens
        return lengths

    def block_starts(self) -> torch.Tensor:
        import torch

        return torch.arange(self.num_blocks, dtype=torch.long) * self.block_size

    def token_coords(self) -> torch.Tensor:
        """LongTensor [video_tokens, 3]: the (t, h, w) of every video token, in order."""
        import torch

        idx = torch.arange(self.video_tokens)
        t = idx // self.frame_tokens
        rem = idx % self.frame_tokens
        return torch.stack([t, rem // self.width, rem % self.width], dim=1)

    def with_block_size(self, block_size: int) -> "VideoGeometry":
        return replace(self, block_size=block_size)

    def describe(self) -> str:
        text = f" + {self.text_tokens} text" if self.text_tokens else ""
        return (
            f"{self.name}: {self.frames}x{self.height}x{self.width} latent tokens{text} = "
            f"{self.num_tokens:,} tokens, {self.num_blocks} blocks of {self.block_size}, "
            f"{self.heads}x{self.head_dim} heads, {self.layers} layers"
        )


# Diffusers 0.42.1 facts (docs/design.md). RoPE: HunyuanVideo rope_axes_dim (16, 56, 56), θ=256;
# Wan splits 128 into t/h/w = 44/42/42, θ=1e4; LTX scales positions by base frames/height/
# width (20, 2048, 2048 in pixels → divide latent positions accordingly), θ=1e4.
MODELS: dict[str, ModelSpec] = {
    "hunyuan-video": ModelSpec(
        name="hunyuan-video", heads=24, head_dim=128, layers=60, temporal_compression=4,
        spatial_compression=8, patch_t=1, patch=2, text_tokens=256,
        rope=Rope(axes_dim=(16, 56, 56), theta=256.0), default_video=(1280, 768, 129),
        note="20 dual-stream + 40 single-stream blocks; joint video+text attention",
    ),
    "wan2.1-14b": ModelSpec(
        name="wan2.1-14b", heads=40, head_dim=128, layers=40, temporal_compression=4,
        spatial_compression=8, patch_t=1, patch=2, text_tokens=0,
        rope=Rope(axes_dim=(44, 42, 42)), default_video=(1280, 720, 81),
    ),
    "wan2.1-1.3b": ModelSpec(
        name="wan2.1-1.3b", heads=12, head_dim=128, layers=30, temporal_compression=4,
        spatial_compression=8, patch_t=1, patch=2, text_tokens=0,
        rope=Rope(axes_dim=(44, 42, 42)), default_video=(1280, 720, 81),
    ),
    "ltx-video": ModelSpec(
        name="ltx-video", heads=32, head_dim=64, layers=28, temporal_compression=8,
        spatial_compression=32, patch_t=1, patch=1, text_tokens=0,
        rope=Rope(axes_dim=(22, 21, 21), scale=(20 / 8, 2048 / 32, 2048 / 32)),
        default_video=(1536, 768, 121),
    ),
    "ltx-video-161f": ModelSpec(
        name="ltx-video-161f", heads=32, head_dim=64, layers=28, temporal_compression=8,
        spatial_compression=32, patch_t=1, patch=1, text_tokens=0,
        rope=Rope(axes_dim=(22, 21, 21), scale=(20 / 8, 2048 / 32, 2048 / 32)),
        default_video=(1536, 768, 161), note="13B variant: 32x128 heads, 48 layers",
    ),
    "ltx-2": ModelSpec(
        name="ltx-2", heads=32, head_dim=128, layers=48, temporal_compression=8,
        spatial_compression=32, patch_t=1, patch=1, text_tokens=0,
        rope=Rope(axes_dim=(44, 42, 42), scale=(20 / 8, 2048 / 32, 2048 / 32)),
        default_video=(1536, 768, 121), note="video stream of LTX2VideoTransformer3DModel",
    ),
}

PRESETS = tuple(MODELS)


def latent_grid(model: str, width: int, height: int, frames: int) -> tuple[int, int, int]:
    """(T, H, W) latent tokens of a ``width × height × frames`` video for ``model``."""
    spec = _spec(model)
    for what, value in (("width", width), ("height", height), ("frames", frames)):
        if not _is_int(value):
            raise ValueError(f"{model}: {what} must be an int (pixels or frames), got {value!r}")
    if frames < 1 or (frames - 1) % spec.temporal_compression:
        raise ValueError(
            f"{model}: frames must be 1 + a multiple of {spec.temporal_compression}, got {frames}"
        )
    pixel = spec.spatial_compression * spec.patch
    for what, value in (("width", width), ("height", height)):
        if value < pixel or value % pixel:
            raise ValueError(f"{model}: {what} must be a positive multiple of {pixel}, got {value}")
    latent_frames = (frames - 1) // spec.temporal_compression + 1
    if latent_frames % spec.patch_t:
        raise ValueError(f"{model}: {latent_frames} latent frames do not divide by p_t={spec.patch_t}")
    return latent_frames // spec.patch_t, height // pixel, width // pixel


def preset(
    name: str,
    *,
    width: int | None = None,
    height: int | None = None,
    frames: int | None = None,
    block_size: int = 128,
) -> VideoGeometry:
    """The geometry of a model preset, at its default video size or at the one given."""
    spec = _spec(name)
    dw, dh, df = spec.default_video
    # ``is None``, not ``or``: width=0 is a mistake to report, not a request for the default.
    t, h, w = latent_grid(name, dw if width is None else width, dh if height is None else height,
                          df if frames is None else frames)
    return VideoGeometry(
        frames=t, height=h, width=w, text_tokens=spec.text_tokens, block_size=block_size,
        heads=spec.heads, head_dim=spec.head_dim, layers=spec.layers, name=name, rope=spec.rope,
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int in Python


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
