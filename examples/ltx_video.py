"""LTX-Video text-to-video with sparsp: the transformer's video self-attention runs
sequence-parallel and block-sparse across the ranks.

    torchrun --nproc-per-node 4 examples/ltx_video.py --pretrained ./LTX-Video \\
        --prompt "waves breaking on a rocky shore at sunset" --out waves.mp4
    python examples/ltx_video.py --tiny --device cpu --out tiny.mp4   # tiny random model, CPU

``--pretrained`` is a local ``LTXPipeline`` directory. Height and width must be multiples of
32 and frames 8k + 1; ``--fps`` is also the frame rate the model is conditioned on.
``--help`` lists every option; the shared code is ``examples/_recipe.py``.
"""

import math

from _recipe import Recipe, start


def multiples(pipe):
    per_token = pipe.vae_spatial_compression_ratio * pipe.transformer_spatial_patch_size
    return (per_token * 32 // math.gcd(per_token, 32), pipe.vae_temporal_compression_ratio
            * pipe.transformer_temporal_patch_size, per_token)


RECIPE = Recipe(
    name="LTX-Video", kind="ltx-video", pipeline="LTXPipeline", script="ltx_video.py", height=512, width=704,
    frames=161, steps=50, fps=25, guidance=3.0, multiples=multiples, example_dir="./LTX-Video",
    call_kwargs=lambda args, pipe: {"frame_rate": args.fps},
    notes="--fps is also the frame rate the model is conditioned on.")

if __name__ == "__main__":
    start(RECIPE)
