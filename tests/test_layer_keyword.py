"""The layer index from a Diffusers model to ``sp_attention``: ``parallelize`` gives each
self-attention processor the position of its module among the model's self-attention modules
(named_modules order: HunyuanVideo's dual-stream blocks, then its single-stream ones), every
call passes it on (``Runtime.attend(..., layer=)`` → ``sp_attention(layer=)``, and to
``Runtime.qk_override``), and ``strategy="auto"`` logs its choice once per layer. 2 gloo
ranks, tiny random models."""

import logging

import pytest
import torch

from dist_utils import AutoLog, run_distributed

pytest.importorskip("diffusers")

# kind -> (extra config, latent before patchify, text tokens, valid text tokens)
MODELS = {
    "wan": ({"num_layers": 3}, (3, 8, 8), 6, 6),
    "hunyuan-video": ({"num_layers": 2, "num_single_layers": 2}, (3, 8, 8), 6, 4),
}


def _worker(rank, world):
    import sparsp
    from sparsp import SparspConfig, sp_attention
    from sparsp.integrations.diffusers import runtime_of
    from sparsp.integrations.models import TINY, build_transformer, dummy_inputs
    from sparsp.integrations.processors import SparspProcessor
    from sparsp.strategies import close_transports

    x = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="layer must be an int >= 0 or None, got -1"):
        sp_attention(x, x, x, strategy="auto", layer=-1)
    with pytest.raises(ValueError, match="got True"):
        sp_attention(x, x, x, strategy="auto", layer=True)

    lines = AutoLog()
    logger = logging.getLogger("sparsp")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    out = {}
    try:
        for kind, (extra, latent, text, valid) in MODELS.items():
            model = build_transformer(kind, config={**TINY[kind], **extra}, seed=0)
            inputs = dummy_inputs(model, latent, text_tokens=text, valid_text=valid, seed=1)
            with torch.no_grad():
                ref = model(**inputs, return_dict=False)[0]
            sparsp.parallelize(model, config=SparspConfig(cdf_threshold=1.0, block_size=8), strategy="auto")
            procs = [(n, m.processor.layer) for n, m in model.named_modules()
                     if isinstance(getattr(m, "processor", None), SparspProcessor)]
            del lines.lines[:]
            with torch.no_grad():
                got = model(**inputs, return_dict=False)[0]
            logged = list(lines.lines)
            seen = []

            def override(lay, q, layer, seen=seen):  # the runtime's q/k hook gets the layer too
                seen.append(layer)
                return q, q
            runtime_of(model).qk_override = override
            with torch.no_grad():
                model(**inputs, return_dict=False)
            sparsp.unparallelize(model)
            out[kind] = (procs, logged, seen, (got - ref).abs().max().item())
    finally:
        logger.removeHandler(lines)
        close_transports()
    return out


def test_processors_carry_their_layer_and_auto_logs_once_per_layer():
    results = run_distributed(_worker, 2, timeout=240)
    for rank, out in enumerate(results):
        for kind, (procs, logged, seen, err) in out.items():
            n = len(procs)
            assert [layer for _, layer in procs] == list(range(n)), (kind, procs)
            if kind == "hunyuan-video":  # dual-stream blocks, then single-stream ones
                assert [name for name, _ in procs] == ["transformer_blocks.0.attn", "transformer_blocks.1.attn",
                                                       "single_transformer_blocks.0.attn",
                                                       "single_transformer_blocks.1.attn"], procs
            else:
                assert [name for name, _ in procs] == [f"blocks.{i}.attn1" for i in range(n)], procs
            # one forward: one call per layer, one line per layer, in layer order
            assert len(logged) == n, (kind, rank, logged)
            for layer, line in enumerate(logged):
                assert f" for layer {layer}, G=2," in line, line
            assert seen == list(range(n)), (kind, seen)
            assert err <= 1e-4, (kind, err)  # cdf 1.0: whatever auto picks is dense attention
