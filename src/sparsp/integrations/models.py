"""Build the four supported Diffusers transformers from configs and make inputs for them.

No weights are downloaded anywhere in sparsp: ``build_transformer`` makes a model from its
config with random weights (the same seed gives the same weights on every rank), either the
full-size preset (``sparsp bench e2e``) or a tiny one (tests, CPU examples). ``dummy_inputs``
makes the keyword arguments of one denoising step — random latents and random precomputed
text embeddings — for a latent video of ``frames x height x width`` (before the model's own
patchify), as the Diffusers pipelines would pass them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Diffusers class name of every supported model kind.
CLASSES = {
    "hunyuan-video": "HunyuanVideoTransformer3DModel",
    "wan": "WanTransformer3DModel",
    "ltx-video": "LTXVideoTransformer3DModel",
    "ltx-2": "LTX2VideoTransformer3DModel",
}
KINDS = tuple(CLASSES)


@dataclass(frozen=True)
class ModelPreset:
    """A full-size model: its kind, the config overrides on Diffusers' defaults, its default
    latent video (frames, height, width before patchify) and text length."""

    kind: str
    config: dict
    latent: tuple[int, int, int]
    text_tokens: int


# Full-size configs (Diffusers 0.42.1 class defaults are the released models unless noted).
# Latent sizes follow sparsp.geometry's presets: e.g. HunyuanVideo 129f 768x1280 → 33x96x160
# latents (patch 2 → 33x48x80 tokens).
PRESETS = {
    "hunyuan-video": ModelPreset("hunyuan-video", {}, (33, 96, 160), 256),
    "wan2.1-14b": ModelPreset("wan", {}, (21, 90, 160), 512),
    "wan2.1-1.3b": ModelPreset("wan", {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
                               (21, 90, 160), 512),
    "ltx-video": ModelPreset("ltx-video", {}, (16, 24, 48), 128),
    "ltx-video-161f": ModelPreset("ltx-video", {}, (21, 24, 48), 128),
    "ltx-2": ModelPreset("ltx-2", {}, (16, 24, 48), 128),
}

# Tiny configs for CPU tests: a few heads of dim 8-16, one or two layers.
TINY = {
    "hunyuan-video": dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                          num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
                          patch_size=2, patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
                          rope_axes_dim=(4, 6, 6), guidance_embeds=True),
    "wan": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=64),
    "ltx-video": dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12,
                      cross_attention_dim=24, num_layers=2, caption_channels=16),
    "ltx-2": dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12,
                  cross_attention_dim=24, audio_in_channels=4, audio_out_channels=4,
                  audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
                  num_layers=2, caption_channels=16),
}


def model_class(kind: str):
    import diffusers

    if kind not in CLASSES:
        raise ValueError(f"unknown model kind {kind!r}; choose one of {', '.join(KINDS)}")
    return getattr(diffusers, CLASSES[kind])


def kind_of(transformer) -> str:
    """The model kind of a Diffusers transformer instance (``ValueError`` if unsupported)."""
    name = type(transformer).__name__
    for kind, cls in CLASSES.items():
        if name == cls:
            return kind
    raise ValueError(f"{name} is not supported by sparsp.parallelize; supported: "
                     f"{', '.join(CLASSES.values())}")


def build_transformer(kind: str, *, config: dict | None = None, layers: int | None = None,
                      seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu"):
    """A transformer of ``kind`` with random weights drawn from ``seed`` (same on every rank).

    ``config`` overrides Diffusers' defaults (``TINY[kind]`` or ``PRESETS[name].config``);
    ``layers`` truncates the block stack (HunyuanVideo: dual-stream blocks first). The model is
    built directly on ``device`` in ``dtype``, in eval mode."""
    cls = model_class(kind)
    cfg = dict(config or {})
    if layers is not None:
        cfg.update(_truncate(kind, cfg, layers))
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed_all(seed)
    previous = torch.get_default_dtype()
    try:  # made directly in ``dtype``: a 14B model never exists in fp32 first
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = cls(**cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _truncate(kind: str, cfg: dict, layers: int) -> dict:
    if kind != "hunyuan-video":
        return {"num_layers": layers}
    dual = cfg.get("num_layers", 20)
    return {"num_layers": min(dual, layers), "num_single_layers": max(0, layers - dual)}


def attention_shape(preset: str, *, tiny: bool = False, layers: int | None = None) -> tuple[int, int]:
    """(self-attention layers, heads) of the model ``build_transformer`` makes for ``preset``
    (its ``TINY`` config with ``tiny``; ``layers`` truncating it), read from the config and
    Diffusers' defaults without building it: what a thresholds table must match."""
    import inspect

    kind = PRESETS[preset].kind
    cfg = dict(TINY[kind] if tiny else PRESETS[preset].config)
    if layers is not None:
        cfg.update(_truncate(kind, cfg, layers))
    defaults = {name: p.default for name, p in inspect.signature(model_class(kind).__init__).parameters.items()}
    get = lambda name: cfg.get(name, defaults.get(name, 0))  # noqa: E731
    return get("num_layers") + (get("num_single_layers") if kind == "hunyuan-video" else 0), get("num_attention_heads")


def num_layers(transformer) -> int:
    """Transformer blocks in the stack (HunyuanVideo: dual- plus single-stream)."""
    cfg = transformer.config
    return cfg.num_layers + getattr(cfg, "num_single_layers", 0)


def dummy_inputs(transformer, latent: tuple[int, int, int], *, text_tokens: int = 8, batch: int = 1,
                 seed: int = 0, timestep: float = 500.0, audio_frames: int | None = None,
                 valid_text: int | None = None) -> dict:
    """Keyword arguments of one forward call on a ``frames x height x width`` latent video.

    Latents and text embeddings are random (seeded: equal on every rank); ``valid_text`` marks
    only the first tokens of the text mask as real (HunyuanVideo, LTX). LTX models take packed
    latents (B, S, C) with the grid as ``num_frames``/``height``/``width``.
    """
    kind = kind_of(transformer)
    p = next(transformer.parameters())
    device, dtype = p.device, p.dtype
    cfg = transformer.config
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    F, H, W = latent
    B, L = batch, text_tokens
    mask = torch.zeros(B, L, dtype=torch.long)
    mask[:, : (L if valid_text is None else valid_text)] = 1
    mask = mask.to(device)
    t = torch.full((B,), timestep, device=device, dtype=dtype)
    if kind == "hunyuan-video":
        out = dict(hidden_states=randn(B, cfg.in_channels, F, H, W), timestep=t,
                   encoder_hidden_states=randn(B, L, cfg.text_embed_dim), encoder_attention_mask=mask,
                   pooled_projections=randn(B, cfg.pooled_projection_dim))
        if cfg.guidance_embeds:
            out["guidance"] = torch.full((B,), 6000.0, device=device, dtype=dtype)
        return out
    if kind == "wan":
        return dict(hidden_states=randn(B, cfg.in_channels, F, H, W), timestep=t,
                    encoder_hidden_states=randn(B, L, cfg.text_dim))
    S = F * H * W
    if kind == "ltx-video":
        return dict(hidden_states=randn(B, S, cfg.in_channels), encoder_hidden_states=randn(B, L, cfg.caption_channels),
                    timestep=t, encoder_attention_mask=mask, num_frames=F, height=H, width=W,
                    rope_interpolation_scale=(8 / 25, 32, 32))
    A = audio_frames if audio_frames is not None else max(2, 2 * F)
    out = dict(hidden_states=randn(B, S, cfg.in_channels), audio_hidden_states=randn(B, A, cfg.audio_in_channels),
               encoder_hidden_states=randn(B, L, cfg.caption_channels),
               audio_encoder_hidden_states=randn(B, L, cfg.caption_channels),
               timestep=t, audio_timestep=t, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
               num_frames=F, height=H, width=W, fps=24.0, audio_num_frames=A)
    if cfg.cross_attn_mod or cfg.audio_cross_attn_mod:
        out.update(sigma=t / 1000, audio_sigma=t / 1000)
    return out


def sample_of(output) -> torch.Tensor:
    """The video output of a forward call (``return_dict`` either way)."""
    return output[0] if isinstance(output, tuple) else output.sample
