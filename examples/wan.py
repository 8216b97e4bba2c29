"""Wan 2.1 / 2.2 text-to-video with sparsp: the transformer's video self-attention runs
sequence-parallel and block-sparse across the ranks.

    torchrun --nproc-per-node 4 examples/wan.py --pretrained ./Wan2.1-T2V-1.3B-Diffusers \\
        --prompt "a red fox running through snow" --out fox.mp4 --compare-dense
    python examples/wan.py --tiny --device cpu --out tiny.mp4      # tiny random model, CPU

``--pretrained`` is a local ``WanPipeline`` directory (``WanPipeline.from_pretrained``; loading
Wan needs ``accelerate``, in the ``examples`` extra). Wan 2.2's second transformer
(``transformer_2``, the low-noise expert) is parallelized too. Height and width must be
multiples of 16 (VAE 8 x patch 2; 32 for Wan 2.2 TI2V's VAE 16) and frames 4k + 1.
``--help`` lists every option; the shared code is ``examples/_recipe.py``.
"""

import math

from _recipe import Recipe, start


def multiples(pipe):
    vae = pipe.vae_scale_factor_spatial
    patch = pipe.transformer.config.patch_size
    per_token = vae * max(patch[1], patch[2])
    spatial = per_token * 16 // math.gcd(per_token, 16)  # the pipeline also wants multiples of 16
    return spatial, pipe.vae_scale_factor_temporal * patch[0], per_token


RECIPE = Recipe(
    name="Wan", kind="wan", pipeline="WanPipeline", script="wan.py", height=480, width=832, frames=81,
    steps=50, fps=16, guidance=5.0, multiples=multiples, example_dir="./Wan2.1-T2V-1.3B-Diffusers",
    transformers=("transformer", "transformer_2"),
    notes="Wan 2.1 and 2.2 (both experts of 2.2 are parallelized).")

if __name__ == "__main__":
    start(RECIPE)
