"""Shares that end in a partial block, or that hold only text, on tiny Diffusers models.

``parallelize`` splits the placed sequence by whole blocks, text blocks last (HunyuanVideo), so
a rank's share can hold no video token at all, or end in a short block. Every strategy must
still give the unparallelized model's output at ``cdf_threshold=1.0`` (fp32), at G = 2, 3 and
4 and block sizes down to 1. ``ulysses`` runs where the heads divide over the ranks and
raises ``ValueError`` in ``parallelize`` where they do not.
"""

import pytest
import torch

from dist_utils import run_distributed

pytest.importorskip("diffusers")

STRATEGIES = ("ring", "ring-sparse", "ring-relay", "ulysses", "sparsp")
TOL = 1e-4
# kind -> (latent (frames, height, width) before patchify, text tokens, valid text tokens,
#          block size): sizes that leave some rank with text only or a partial last block
CASES = {
    "hunyuan-video": ((1, 4, 4), 12, 12, 4),  # 4 video tokens, 12 text: ranks of text only
    "wan": ((1, 6, 6), 4, 4, 2),  # 9 tokens in blocks of 2: the last block is partial
    "ltx-video": ((1, 3, 3), 4, 4, 2),
    "ltx-2": ((1, 5, 1), 4, 4, 1),  # block size 1
}


def _check(rank, world, kind):
    import sparsp
    from sparsp import SparspConfig
    from sparsp.integrations.models import TINY, build_transformer, dummy_inputs

    latent, text, valid, bs = CASES[kind]
    model = build_transformer(kind, config=TINY[kind], seed=0)
    batch = 2 if kind == "ltx-2" else 1
    inputs = dummy_inputs(model, latent, text_tokens=text, valid_text=valid, seed=1, batch=batch)
    if kind == "ltx-2":
        g = torch.Generator().manual_seed(2)
        inputs["timestep"] = 1000 * torch.rand(batch, latent[0] * latent[1] * latent[2], generator=g)

    def run():
        with torch.no_grad():
            return [o for o in model(**inputs, return_dict=False) if isinstance(o, torch.Tensor)]

    ref = run()
    errors = {}
    for strategy in STRATEGIES:
        config = SparspConfig(cdf_threshold=1.0, block_size=bs)
        if strategy == "ulysses" and model.config.num_attention_heads % world:
            with pytest.raises(ValueError, match="ulysses needs heads divisible"):
                sparsp.parallelize(model, config=config, strategy=strategy)
            continue
        sparsp.parallelize(model, config=config, strategy=strategy)
        out = run()
        sparsp.unparallelize(model)
        errors[strategy] = max((a - b).abs().max().item() for a, b in zip(out, ref))
    bad = {s: e for s, e in errors.items() if not e <= TOL}
    assert not bad, f"rank {rank}, {kind}, G={world}: max abs error above {TOL}: {bad}"
    return errors


def _worker(rank, world):
    return {kind: _check(rank, world, kind) for kind in CASES}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_model_and_strategy_with_uneven_shares(world):
    errors = run_distributed(_worker, world, timeout=300)
    assert all(set(e) == set(CASES) for e in errors)
