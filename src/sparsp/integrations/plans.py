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
  video-to-audio attention whose keys are the (sharded) video, inputs sparsp cannot honour;
* for CFG parallel (``cfg.py``): ``batch``, the forward arguments that carry the batch (cut to
  a CFG half's samples, as Diffusers' ``_cp_plan`` names what it splits), and ``output``, the
  shape and structure of the forward's result as it follows from the inputs and the config
  (what a half that does not compute a branch returns until the halves exchange).

Everything else (text cross-attention, LTX-2's audio stream, modulation) stays as it is: it
runs per token or on replicated tensors, so it needs no plan.

``PIPELINES`` declares, per Diffusers pipeline, which forwards of one denoising step CFG
parallel pairs, decided from the arguments of ``pipe(...)`` (``cfg.py``).
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
class Like:
    """One tensor of a forward's result: the shape of the forward argument ``arg`` with
    dimension ``dim`` of size ``size(config)``, and that argument's dtype."""

    arg: str
    dim: int
    size: Callable


@dataclass(frozen=True)
class Output:
    """A forward's result: its tensors in order (``fields``: name → ``Like``), returned as a
    tuple with ``return_dict=False``, else as the output class ``cls`` ("module:Class")."""

    fields: Mapping[str, Like]
    cls: str = "diffusers.models.modeling_outputs:Transformer2DModelOutput"


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
    batch: tuple[str, ...] = ()
    """forward arguments whose dimension 0 is the batch (a CFG half takes its samples; one of
    size 1 is a broadcast and stays whole)."""
    output: Output | None = None


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


def _out_channels(cfg) -> int:
    return cfg.out_channels or cfg.in_channels  # the models' own rule


def _audio_out_channels(cfg) -> int:
    return cfg.audio_out_channels or cfg.audio_in_channels


# The result of the 5-D latent models: the latent (B, C, F, H, W) with out_channels channels.
_LATENT_OUT = Output(_frozen({"sample": Like("hidden_states", 1, _out_channels)}))
# LTX: packed latents (B, S, C) in and out.
_PACKED_OUT = Output(_frozen({"sample": Like("hidden_states", 2, _out_channels)}))


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
        batch=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
               "pooled_projections", "guidance"),
        output=_LATENT_OUT,
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
        batch=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
        output=_LATENT_OUT,
    ),
    SplitPlan(
        model="LTXVideoTransformer3DModel",
        grid=Grid("kwargs", _ltx_patch),
        entry=_frozen({"hidden_states": Split(1), "timestep": Split(1, when_full=True)}),
        outputs=_rope_split(1),  # (B, S, D) each
        gather=_GATHER_PROJ_OUT,
        self_attention=("transformer_blocks.*.attn1",),
        processor="ltx",
        batch=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask", "video_coords"),
        output=_PACKED_OUT,
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
        batch=("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
               "timestep", "audio_timestep", "sigma", "audio_sigma", "encoder_attention_mask",
               "audio_encoder_attention_mask", "video_coords", "audio_coords", "perturbation_mask",
               "video_keyframes_mask"),
        output=Output(_frozen({"sample": Like("hidden_states", 2, _out_channels),
                               "audio_sample": Like("audio_hidden_states", 2, _audio_out_channels)}),
                      cls="diffusers.models.transformers.transformer_ltx2:AudioVisualModelOutput"),
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


# --- pipelines: the forwards of one denoising step that CFG parallel pairs ---------------------


@dataclass(frozen=True)
class Pair:
    """Two forwards of one step, made one after the other on the same latents (their cache
    contexts ``first`` then ``second``), that the two CFG halves compute one each (``cfg.py``).

    ``ahead`` None: the pipeline reads the first forward's result only after the second
    returns, so the half that does not compute a forward returns a placeholder, filled at the
    end of the second forward. ``ahead`` a mapping: the pipeline reads the first result at once,
    and the second forward's arguments are the first's with ``ahead`` set, so at the first
    forward one half computes it and the other the second (checked against the second call's
    own arguments when it comes)."""

    first: str
    second: str
    ahead: Mapping[str, object] | None = None


@dataclass(frozen=True)
class PipelineRule:
    """A Diffusers pipeline's step, read from the arguments of one ``pipe(...)`` call (bound to
    its signature, defaults applied): ``pairs(args)``, the pairs that call makes in every step;
    ``branches(args)``, the forwards of a step counted per branch (a batched [uncond, cond]
    call counts two), what ``mesh="auto"`` prices; ``transformers``, the pipeline's
    attributes holding a transformer to parallelize."""

    pipeline: str
    pairs: Callable
    branches: Callable
    transformers: tuple[str, ...] = ("transformer",)


def _wan_pairs(a) -> tuple[Pair, ...]:
    # pipeline_wan.py: "cond", then "uncond" where guidance_scale > 1 (do_classifier_free_guidance);
    # noise_pred is read after the uncond forward returns
    return (Pair("cond", "uncond"),) if a["guidance_scale"] > 1.0 else ()


def _hunyuan_true_cfg(a) -> bool:
    # pipeline_hunyuan_video.py: do_true_cfg = true_cfg_scale > 1 and a negative prompt
    negative = a["negative_prompt"] is not None or (a["negative_prompt_embeds"] is not None
                                                    and a["negative_pooled_prompt_embeds"] is not None)
    return a["true_cfg_scale"] > 1 and negative


def _ltx2_guides(a) -> tuple[bool, bool, bool]:
    """(CFG, STG, modality isolation) of an LTX2Pipeline call, as its do_* properties decide
    them (an unset audio scale takes the video one: ``audio_x or x``)."""
    g, stg, mod = a["guidance_scale"], a["stg_scale"], a["modality_scale"]
    return (g > 1.0 or (a["audio_guidance_scale"] or g) > 1.0, stg > 0.0 or (a["audio_stg_scale"] or stg) > 0.0,
            mod > 1.0 or (a["audio_modality_scale"] or mod) > 1.0)


def _ltx2_pairs(a) -> tuple[Pair, ...]:
    # pipeline_ltx2.py reads the STG prediction right after its forward (.float(), x0), so the
    # pair runs ahead: the modality forward is the STG one's with these two arguments set
    _, stg, mod = _ltx2_guides(a)
    ahead = _frozen({"isolate_modalities": True, "spatio_temporal_guidance_blocks": None})
    return (Pair("uncond_stg", "uncond_modality", ahead=ahead),) if stg and mod else ()


def _by_pipeline(*rules: PipelineRule) -> Mapping[str, PipelineRule]:
    return MappingProxyType({rule.pipeline: rule for rule in rules})


PIPELINES: Mapping[str, PipelineRule] = _by_pipeline(
    PipelineRule("WanPipeline", pairs=_wan_pairs, branches=lambda a: 1 + (a["guidance_scale"] > 1.0),
                 transformers=("transformer", "transformer_2")),
    PipelineRule("HunyuanVideoPipeline",
                 pairs=lambda a: (Pair("cond", "uncond"),) if _hunyuan_true_cfg(a) else (),
                 branches=lambda a: 1 + _hunyuan_true_cfg(a)),
    # one batched [uncond, cond] forward ("cond_uncond"): its batch is split, nothing to pair
    PipelineRule("LTXPipeline", pairs=lambda a: (), branches=lambda a: 1 + (a["guidance_scale"] > 1.0)),
    PipelineRule("LTX2Pipeline", pairs=_ltx2_pairs, branches=lambda a: sum(map(int, _ltx2_guides(a))) + 1),
)
"""The pipelines CFG parallel knows (Diffusers 0.42.1), by class name."""
