"""LTX-2 text-to-video-and-audio with sparsp: the transformer's video self-attention runs
sequence-parallel and block-sparse across the ranks (its audio stream stays whole on every
rank; the audio queries attend to every rank's video keys, merged exactly).

    torchrun --nproc-per-node 4 examples/ltx2.py --pretrained ./LTX-2 \\
        --prompt "a street musician plays the violin in the rain" --out violin.mp4
    python examples/ltx2.py --tiny --device cpu --out tiny.mp4        # tiny random model, CPU

``--pretrained`` is a local ``LTX2Pipeline`` directory. The mp4 carries the generated audio
(AAC) unless ``--no-audio``. Height and width must be multiples of 32 and frames 8k + 1;
``--fps`` is also the frame rate the model is conditioned on. ``--help`` lists every option;
the shared code is ``examples/_recipe.py``.
"""

import math

from _recipe import Recipe, start


def multiples(pipe):
    per_token = pipe.vae_spatial_compression_ratio * pipe.transformer_spatial_patch_size
    return (per_token * 32 // math.gcd(per_token, 32), pipe.vae_temporal_compression_ratio
            * pipe.transformer_temporal_patch_size, per_token)


def extra_args(parser):
    parser.add_argument("--no-audio", action="store_true", help="write the video without its generated audio")


RECIPE = Recipe(
    name="LTX-2", kind="ltx-2", pipeline="LTX2Pipeline", script="ltx2.py", height=512, width=768, frames=121,
    steps=30, fps=24, guidance=3.0, multiples=multiples, example_dir="./LTX-2",
    call_kwargs=lambda args, pipe: {"frame_rate": args.fps}, extra_args=extra_args, audio=True,
    notes="The mp4 carries the generated audio (AAC) unless --no-audio; --fps is also the frame rate "
          "the model is conditioned on.")

if __name__ == "__main__":
    start(RECIPE)
