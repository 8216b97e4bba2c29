"""Per-model split plans, declared as data (in the spirit of Diffusers' ``_cp_plan``).

A plan says, for one Diffusers transformer class, everything ``sparsp.parallelize`` needs to
run its video self-attention sequence-parallel without touching the model's code:

* ``grid``: where the latent token grid (T, H, W) of a forward call comes from, so the
  geometry (and with it the placement) is known before the first block runs;
* ``entry`` / ``inputs`` / ``outputs``: which tensors carry one entry per video token and must be
  cut to this rank's tokens, in placed order (hidden states, RoPE cos/sin or the coordinates they
  are made from, per-token timesteps), at the model's entry or at a submodule's input or output;
* ``gather``: the submodule whose output is all-gathered and put back in the original order;
* ``self_attention``: the modules (``fnmatch`` patterns over ``named_modules``) whose processor is
  replaced, and by which processor kind (``processors.PROCESSORS``);
* model specifics: HunyuanVideo's text tokens that join the joint attention, LTX-2's
  video-to-audio attention whose keys are the (sharded) video, inputs sparsp cannot honour.

Everything else (text cross-attention, LTX-2's audio stream, modulation) stays as it is: it
runs per token or on replicated tensors, so it needs no plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Split:
    """Cut a tensor to this rank's video tokens (placed order) along ``dim``.

    ``when_full``: only when ``dim`` has the full video token count; a broadcast tensor (a
    per-sample timestep of size 1 there) is left alone."""

    dim: int
    when_full: bool = False


@dataclass(frozen=True)
class Grid:
    """The latent token grid (T, H, W) of a forward call.

    ``latent``: a 5-D (B, C, F, H, W) forward argument ``arg`` divided by the patch;
    ``kwargs``: the int forward arguments ``frames``, ``height``, ``width``, divided (rounding up)
    by the patch. ``patch(config) -> (p_t, p_h, p_w)`` reads the model config."""

    source: str
    patch: Callable
    arg: str = "hidden_states"
    frames: str = "num_frames"
    height: str = "height"
    width: str = "width"


@dataclass(frozen=True)
class JointText:
    """Text tokens that join the video in one self-attention (HunyuanVideo).

    The text stream is the output of ``stream``; it is trimmed to the valid tokens that the
    forward argument ``mask`` (B, L) marks (Diffusers uses only its per-sample sum, as a
    prefix length), replicated on every rank, and its tokens are placed (last) and masked
    with the video in the attention."""

    stream: str
    mask: str


def _frozen(d: Mapping | None = None) -> Mapping:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class SplitPlan:
    model: str
    grid: Grid
    self_attention: tuple[str, ...]
    processor: str
    gather: Mapping[str, int]
    entry: Mapping[str, Split] = field(default_factory=_frozen)
    inputs: Mapping[str, Mapping[str, Split]] = field(default_factory=_frozen)
    outputs: Mapping[str, Mapping[int | None, Split]] = field(default_factory=_frozen)
    video_kv_attention: tuple[str, ...] = ()
    """Modules whose queries are replicated and whose keys/values are the video (LTX-2's
    ``video_to_audio_attn``: audio queries): partial results merged across ranks by LSE."""
    text: JointText | None = None
    defaults: Mapping[str, str] = field(default_factory=_frozen)
    """forward argument ← another argument's value before splitting, when it is None."""
    must_be_none: Mapping[str, str] = field(default_factory=_frozen)
    """forward arguments sparsp cannot honour: name → why."""
    unsupported_config: Mapping[str, tuple] = field(default_factory=_frozen)
    """config attribute → values sparsp cannot run."""


def _hunyuan_patch(cfg):
    return (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)


def _wan_patch(cfg):
    return tuple(cfg.patch_size)


def _ltx_patch(_cfg):
    return (1, 1, 1)  # LTX-Video's forward takes the token grid itself


def _ltx2_patch(cfg):
    return (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)


def _rope_split(dim: int) -> Mapping:
    """Cut both outputs of the ``rope`` module (cos, sin) along ``dim``."""
    return _frozen({"rope": _frozen({0: Split(dim), 1: Split(dim)})})


# Every model ends in ``proj_out``, whose (B, S, C) output is gathered along the tokens.
_GATHER_PROJ_OUT = _frozen({"proj_out": 1})


def _by_model(*plans: SplitPlan) -> Mapping[str, SplitPlan]:
    return MappingProxyType({plan.model: plan for plan in plans})


PLANS: Mapping[str, SplitPlan] = _by_model(
    SplitPlan(
        model="HunyuanVideoTransformer3DModel",
        grid=Grid("latent", _hunyuan_patch),
        # Cut after patchify: x_embedder's output is (B, S, C); RoPE (cos, sin) are (S, D).
        outputs=_frozen({"x_embedder": _frozen({None: Split(1)}), **_rope_split(0)}),
        gather=_GATHER_PROJ_OUT,
        self_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
        processor="hunyuan",
        text=JointText(stream="context_embedder", mask="encoder_attention_mask"),
        # token_replace (I2V) modulates the first frame's tokens by position in the local slice.
        unsupported_config=_frozen({"image_condition_type": ("token_replace",)}),
    ),
    SplitPlan(
        model="WanTransformer3DModel",
        grid=Grid("latent", _wan_patch),
        # Wan 2.2 TI2V passes one timestep per token (B, S): cut it like the tokens.
        entry=_frozen({"timestep": Split(1, when_full=True)}),
        inputs=_frozen({"blocks.0": _frozen({"hidden_states": Split(1)})}),
        outputs=_rope_split(1),  # (1, S, 1, D) each
        gather=_GATHER_PROJ_OUT,
        self_attention=("blocks.*.attn1",),
        processor="wan",
    ),
    SplitPlan(
        model="LTXVideoTransformer3DModel",
        grid=Grid("kwargs", _ltx_patch),
        entry=_frozen({"hidden_states": Split(1), "timestep": Split(1, when_full=True)}),
        outputs=_rope_split(1),  # (B, S, D) each
        gather=_GATHER_PROJ_OUT,
        self_attention=("transformer_blocks.*.attn1",),
        processor="ltx",
    ),
    SplitPlan(
        model="LTX2VideoTransformer3DModel",
        grid=Grid("kwargs", _ltx2_patch),
        entry=_frozen({"hidden_states": Split(1), "timestep": Split(1, when_full=True),
                       "video_keyframes_mask": Split(1, when_full=True)}),
        # Cut the coordinates the video RoPEs are made from (B, 3 or 1, S[, 2]), so the
        # interleaved (B, S, D) and split (B, H, S, D/2) layouts both come out local.
        inputs=_frozen({"rope": _frozen({"coords": Split(2)}),
                        "cross_attn_rope": _frozen({"coords": Split(2)})}),
        gather=_GATHER_PROJ_OUT,
        self_attention=("transformer_blocks.*.attn1",),
        processor="ltx",
        video_kv_attention=("transformer_blocks.*.video_to_audio_attn",),
        # The audio stream reads the video timestep when it has none of its own: keep it whole.
        defaults=_frozen({"audio_timestep": "timestep"}),
        must_be_none=_frozen({"video_self_attention_mask":
                              "an arbitrary token-by-token mask cannot be block-sparse sequence parallel"}),
    ),
)


def plan_for(transformer) -> SplitPlan:
    """The plan of ``transformer``'s class; ``ValueError`` naming the supported ones."""
    name = type(transformer).__name__
    try:
        return PLANS[name]
    except KeyError:
        raise ValueError(f"sparsp.parallelize does not support {name}; supported: "
                         f"{', '.join(PLANS)}") from None
