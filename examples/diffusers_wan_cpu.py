"""A Diffusers WanPipeline with sparsp, on CPU, under torchrun (tiny random model, no downloads).

    torchrun --nproc-per-node 2 examples/diffusers_wan_cpu.py

Every rank builds the same tiny WanTransformer3DModel (same seed), the pipeline runs from
precomputed (random) prompt embeddings and returns latents (``output_type="latent"``: no VAE,
no text encoder). The run is done three times: the plain pipeline, sparsp at
``cdf_threshold=1.0`` (exact: equal to the plain run), and sparsp at 0.9 (block-sparse).
"""

import os
import warnings

import torch
import torch.distributed as dist
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

import sparsp
from sparsp import SparspConfig
from sparsp.integrations.models import TINY, build_transformer

warnings.filterwarnings("ignore")


def main() -> None:
    dist.init_process_group("gloo")  # NCCL on GPUs, with the transformer on cuda:LOCAL_RANK
    rank = dist.get_rank()
    transformer = build_transformer("wan", config=TINY["wan"], seed=0)  # random weights, same everywhere
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(1, 16, TINY["wan"]["text_dim"], generator=g)  # from your text encoder, once

    def generate():
        return pipe(prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), height=64,
                    width=96, num_frames=9, num_inference_steps=4, guidance_scale=5.0, output_type="latent",
                    generator=torch.Generator().manual_seed(2)).frames

    plain = generate()  # 3 x 8 x 12 latents -> 3 x 4 x 6 = 72 tokens per sample
    sparsp.parallelize(pipe.transformer, config=SparspConfig(cdf_threshold=1.0, block_size=16))
    exact = generate()
    sparsp.unparallelize(pipe.transformer)
    sparsp.parallelize(pipe.transformer, config=SparspConfig(cdf_threshold=0.9, block_size=16))
    sparse = generate()
    sparsp.unparallelize(pipe.transformer)
    if rank == 0:
        print(f"{dist.get_world_size()} ranks, latents {tuple(plain.shape)}")
        print(f"sparsp cdf 1.0 vs plain pipeline: max abs diff {(exact - plain).abs().max().item():.2e}")
        print(f"sparsp cdf 0.9 vs plain pipeline: max abs diff {(sparse - plain).abs().max().item():.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
