"""HunyuanVideo text-to-video with sparsp: the transformer's joint video + text self-attention
runs sequence-parallel and block-sparse across the ranks (the text tokens are placed after
the video and attended like any token; the text stream is replicated on every rank).

    torchrun --nproc-per-node 4 examples/hunyuan_video.py --pretrained ./HunyuanVideo \\
        --prompt "a cat walks on the grass, realistic" --out cat.mp4
    python examples/hunyuan_video.py --tiny --device cpu --out tiny.mp4   # tiny random model, CPU

``--pretrained`` is a local ``HunyuanVideoPipeline`` directory. Height and width must be
multiples of 16 (VAE 8 x patch 2) and frames 4k + 1; ``--guidance`` is the embedded
(distilled) guidance scale. ``--help`` lists every option; the shared code is
``examples/_recipe.py``.
"""

import math

from _recipe import Recipe, start


def multiples(pipe):
    cfg = pipe.transformer.config
    per_token = pipe.vae_scale_factor_spatial * cfg.patch_size
    return per_token * 16 // math.gcd(per_token, 16), pipe.vae_scale_factor_temporal * cfg.patch_size_t, per_token


RECIPE = Recipe(
    name="HunyuanVideo", kind="hunyuan-video", pipeline="HunyuanVideoPipeline", script="hunyuan_video.py",
    height=320, width=512, frames=61, steps=30, fps=15, guidance=6.0, multiples=multiples,
    example_dir="./HunyuanVideo", notes="--guidance is the embedded (distilled) guidance scale.")

if __name__ == "__main__":
    start(RECIPE)
