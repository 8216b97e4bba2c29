"""Tiny random Diffusers pipelines of the four families, built in code (no downloads).

Every component comes from a small config with random weights: the transformer from sparsp's
tiny config (``sparsp.integrations.models.TINY``), a small VAE, a one- or two-layer text
encoder, a flow-matching scheduler and a character-level tokenizer made with the
``tokenizers`` library. The recipes' ``--tiny`` runs them (a CPU try-out of the whole
pipeline: prompt encoding, denoising with sparsp, VAE decoding, mp4), and
``tests/test_examples.py`` saves them with ``save_pretrained`` and loads them back through
``--pretrained`` as a real checkpoint would be. The videos are noise: the weights are random.
"""

from __future__ import annotations

import torch

SEED = 0

# A valid size per family (height, width, frames) for its tiny VAE and patch, with enough
# video tokens for 2 ranks at block size 8.
SIZES = {
    "wan": (48, 64, 9),  # latent 3x6x8, patch 2: 3x3x4 = 36 tokens
    "ltx-video": (32, 64, 9),  # VAE /8 spatial (patch 2 x 2 scalings), /4 temporal: 3x4x8 = 96 tokens
    "ltx-2": (32, 64, 9),  # VAE /8, /4: 3x4x8 = 96 tokens
    "hunyuan-video": (48, 64, 9),  # latent 3x6x8, patch 2: 3x3x4 = 36 video tokens, + 16 text tokens
}
# On a GPU: the block-sparse kernels there need larger blocks (FlexAttention rejects blocks of
# 8), so a larger video (320 to 1280 video tokens) with blocks of 64.
GPU_SIZE, GPU_BLOCK = (128, 128, 17), 64


# --- tiny components --------------------------------------------------------------------------


def _tokenizer(max_length: int, *, bos: bool = False):
    """A character-level fast tokenizer (every printable ASCII character one token), built with
    the ``tokenizers`` library: no vocabulary file to download. It turns HunyuanVideo's long
    prompt template into more tokens than the pipeline crops, like the real Llama tokenizer."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "</s>", "<unk>", "<s>"]
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(special + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    single = "<s> $A </s>" if bos else "$A </s>"
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("</s>", 1), ("<s>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<s>", model_max_length=max_length)


VOCAB = 4 + 96


def _scheduler(**kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**kw)


# sparsp's tiny transformer configs, with heads of 16 dims: the GPU kernel (FlexAttention)
# needs at least 16, and the recipes' --tiny runs on a GPU too.
WIDER = {"wan": dict(attention_head_dim=16), "ltx-video": dict(attention_head_dim=16, cross_attention_dim=32),
         "ltx-2": dict(attention_head_dim=16, cross_attention_dim=32), "hunyuan-video": {}}


def _transformer(kind):
    from sparsp.integrations.models import TINY, build_transformer

    return build_transformer(kind, config={**TINY[kind], **WIDER[kind]}, seed=SEED)


def _wan():
    from diffusers import AutoencoderKLWan, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(SEED)
    text = UMT5EncoderModel(UMT5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                       relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1))
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return WanPipeline(tokenizer=_tokenizer(64), text_encoder=text, vae=vae, transformer=_transformer("wan"),
                       scheduler=_scheduler(shift=3.0))


def _ltx_video():
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(SEED)
    text = T5EncoderModel(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1))
    vae = AutoencoderKLLTXVideo(latent_channels=8, block_out_channels=(8, 8, 8, 8),
                                decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_layers_per_block=(1, 1, 1, 1, 1),
                                spatio_temporal_scaling=(True, True, False, False),
                                decoder_spatio_temporal_scaling=(True, True, False, False),
                                decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4,
                                upsample_factor=(1,) * 4, patch_size=2, patch_size_t=1)
    return LTXPipeline(scheduler=_scheduler(), vae=vae, text_encoder=text, tokenizer=_tokenizer(64),
                       transformer=_transformer("ltx-video"))


def _ltx2():
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(SEED)
    layers = 2
    text = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=8,
                         pad_token_id=0, eos_token_id=1, bos_token_id=3),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4),
        mm_tokens_per_image=4, image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3))
    connectors = LTX2TextConnectors(caption_channels=16, text_proj_in_factor=layers + 1,
                                    video_connector_num_attention_heads=2, video_connector_attention_head_dim=8,
                                    video_connector_num_layers=1, video_connector_num_learnable_registers=4,
                                    audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8,
                                    audio_connector_num_layers=1, audio_connector_num_learnable_registers=4,
                                    connector_rope_base_seq_len=32)
    vae = AutoencoderKLLTX2Video(latent_channels=8, block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                                 down_block_types=("LTX2VideoDownBlock3D",) * 2, layers_per_block=(1, 1, 1),
                                 decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
                                 decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False,) * 3,
                                 downsample_type=("spatiotemporal", "spatiotemporal"),
                                 upsample_type=("spatiotemporal", "spatiotemporal"), upsample_residual=(False, False),
                                 upsample_factor=(1, 1), patch_size=2, patch_size_t=1)
    audio_vae = AutoencoderKLLTX2Audio(base_channels=4, output_channels=2, ch_mult=(1, 1, 1), num_res_blocks=1,
                                       in_channels=2, latent_channels=1, mel_bins=16, resolution=16)
    vocoder = LTX2Vocoder(in_channels=2 * 16, hidden_channels=8, out_channels=2, upsample_kernel_sizes=[4],
                          upsample_factors=[2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
                          output_sampling_rate=16000)
    return LTX2Pipeline(scheduler=_scheduler(), vae=vae, audio_vae=audio_vae, text_encoder=text,
                        tokenizer=_tokenizer(64, bos=True), connectors=connectors,
                        transformer=_transformer("ltx-2"), vocoder=vocoder)


def _hunyuan_video():
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    torch.manual_seed(SEED)
    llama = LlamaModel(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                   bos_token_id=3))
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=77, pad_token_id=0,
                                        eos_token_id=1, bos_token_id=3, projection_dim=8))
    vae = AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                    norm_num_groups=4, mid_block_add_attention=False)
    return HunyuanVideoPipeline(text_encoder=llama, tokenizer=_tokenizer(256, bos=True),
                                transformer=_transformer("hunyuan-video"), vae=vae, scheduler=_scheduler(shift=7.0),
                                text_encoder_2=clip, tokenizer_2=_tokenizer(77, bos=True))


BUILDERS = {"wan": _wan, "ltx-video": _ltx_video, "ltx-2": _ltx2, "hunyuan-video": _hunyuan_video}


def build_pipeline(kind: str):
    """A tiny random pipeline of ``kind`` (fp32, CPU), its modules in training mode as built
    from their configs: the recipes put every component in eval (``_recipe.in_eval``)."""
    return BUILDERS[kind]()
