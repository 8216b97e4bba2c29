"""``strategy="auto"`` over the layers of a model whose masks differ: several calls of one
geometry, each naming its layer (``sp_attention(layer=i)``), on 2 gloo ranks. Layers whose q
and k have no block structure get a full mask (every query block is non-similar, so its row
is kept whole) and auto takes the dense ``ring``; layers with structured q and k get a sparse
CDF mask and auto takes another strategy. Checked: the choice per layer, the same on both
ranks; the output of every call against the single-process reference of the chosen strategy
(``reference_sp_attention``; for ``ring`` dense attention, which the full mask also gives);
one log line per layer."""

import logging

import torch

from dist_utils import AutoLog, run_distributed, structured_inputs

from sparsp.cost import KernelFigure, Profile, TransportFigure

TOL = 1e-4
LENS = [48, 40]  # tokens per rank: the second rank's slice ends in a short block
B, H, D, BS = 2, 4, 16, 16
LAYERS = ("sparse", "dense", "sparse", "dense", "sparse")  # what each layer's q/k are


def _slow_link() -> Profile:
    """An 8-GPU box with a very slow link and no fixed costs: the bytes a strategy moves decide,
    and predictions within the margin go to the simpler strategy (``ring`` first)."""
    return Profile(name="test-slow-link", gpus=8, peer_access=True, link_gbps=1e-6, hbm_gbps=1e6,
                   transports=(TransportFigure(name="nccl", efficiency=1.0, latency_ms=0.0),),
                   kernels=(KernelFigure(head_dim=D, sparse_tflops=1e-4, dense_tflops=1e-4),),
                   launch_ms=0.0, call_ms=0.0, sync_ms=0.0)


def _inputs(layer: int, kind: str):
    """Whole-sequence q, k, v of one layer: structured (a shared direction per head: similar
    blocks, a sparse CDF mask) or plain noise (no block is similar: a full mask)."""
    S = sum(LENS)
    if kind == "sparse":
        return structured_inputs(10 + layer, B, S, H, D)
    g = torch.Generator().manual_seed(10 + layer)
    return tuple(torch.randn(B, S, H, D, generator=g) for _ in range(3))


def _token_density(mask: torch.Tensor) -> float:
    """Kept (query, key) token pairs over all of them, the density auto logs."""
    n = torch.tensor([min(BS, L - i) for L in LENS for i in range(0, L, BS)], dtype=torch.float64)
    pairs = (mask.double() * n[:, None] * n[None, :]).sum()
    return float(pairs / (mask.shape[0] * mask.shape[1] * sum(LENS) ** 2))


def _worker(rank, world):
    from sparsp import SparspConfig, sp_attention
    from sparsp.integrations.reference import reference_sp_attention
    from sparsp.strategies import auto, close_transports

    lines = AutoLog()
    logger = logging.getLogger("sparsp")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    cfg = SparspConfig(cdf_threshold=0.9, sim_threshold=0.5, block_size=BS, transport="nccl", kernel="torch")
    a = sum(LENS[:rank])
    sl = slice(a, a + LENS[rank])
    auto.use_profile(_slow_link())
    try:
        chosen, errors, densities = [], {}, []
        for layer, kind in enumerate(LAYERS):
            q, k, v = _inputs(layer, kind)
            got = sp_attention(*(t[:, sl].contiguous() for t in (q, k, v)), strategy="auto", config=cfg,
                               layer=layer)
            decision = auto.last_decision()
            chosen.append(decision.strategy)
            want = reference_sp_attention(q, k, v, lens=LENS, strategy=decision.strategy, config=cfg)
            sparse_mask = reference_sp_attention(q, k, v, lens=LENS, strategy="sparsp", config=cfg,
                                                 return_mask=True)[1]
            densities.append(_token_density(sparse_mask))
            errors[layer] = (got - want[:, sl]).abs().max().item()
            if decision.strategy == "ring":  # dense attention, which the layer's full mask gives too
                dense = reference_sp_attention(q, k, v, lens=LENS, strategy="sparsp",
                                               config=SparspConfig(cdf_threshold=1.0, block_size=BS, kernel="torch"))
                errors[(layer, "dense")] = (got - dense[:, sl]).abs().max().item()
    finally:
        auto.use_profile(None)
        logger.removeHandler(lines)
        close_transports()
    return chosen, errors, densities, lines.lines


def test_auto_takes_ring_only_for_the_dense_layers():
    (chosen, errors, densities, lines), other = run_distributed(_worker, 2, timeout=180)
    assert other[0] == chosen  # every rank makes the same choice
    for layer, kind in enumerate(LAYERS):  # the masks are what the test says they are
        assert (densities[layer] == 1.0) == (kind == "dense"), densities
    assert chosen == ["ring" if kind == "dense" else chosen[i] for i, kind in enumerate(LAYERS)], chosen
    assert all(c != "ring" for c, kind in zip(chosen, LAYERS) if kind == "sparse"), chosen
    bad = {key: e for rank_errors in (errors, other[1]) for key, e in rank_errors.items() if not e <= TOL}
    assert not bad, bad
    # one line per layer (one geometry): its choice and the layer's mask density
    assert len(lines) == len(LAYERS) and len(other[3]) == len(LAYERS), lines
    for layer, line in enumerate(lines):
        assert f"sparsp auto: {chosen[layer]} for layer {layer}, G=2," in line, line
        assert f"density {densities[layer]:.3f}" in line, (line, densities[layer])
