"""Bad input raises a clear ValueError before any communication; a silent peer times out."""

import time

import pytest
import torch

from dist_utils import run_distributed


def _bad_inputs_worker(rank, world):
    from sparsp import SparspConfig, sp_attention

    q = torch.randn(1, 32, 4, 8)
    cases = [
        (dict(q=q[0]), "must be \\(B, S_local, H, D\\)"),
        (dict(q=q.half()), "dtypes differ"),
        (dict(q=q.int()), "dtype"),
        (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), "not contiguous"),
        (dict(k=torch.randn(1, 16, 4, 8)), "same shape"),
        (dict(strategy="allgather"), "strategy='allgather'"),
        (dict(strategy="ulysses", q=torch.randn(1, 32, 3, 8), k=torch.randn(1, 32, 3, 8),
              v=torch.randn(1, 32, 3, 8)), "heads divisible"),
        (dict(config=SparspConfig(cdf_threshold=(0.5, 0.5))), "per-head|values for 4 heads"),
        (dict(config="fast"), "SparspConfig"),
    ]
    for overrides, match in cases:
        args = dict(q=q, k=torch.randn_like(q), v=torch.randn_like(q), strategy="sparsp", config=SparspConfig())
        args.update(overrides)
        with pytest.raises(ValueError, match=match):
            sp_attention(args["q"], args["k"], args["v"], strategy=args["strategy"], config=args["config"])
    # config validation happens when the config is made
    for kwargs, match in [(dict(cdf_threshold=1.5), "cdf_threshold"), (dict(block_size=0), "block_size"),
                          (dict(transport="tcp"), "transport"), (dict(kernel="cuda"), "kernel"),
                          (dict(timeout_s=0), "timeout_s"), (dict(sim_threshold=-1.0), "sim_threshold")]:
        with pytest.raises(ValueError, match=match):
            SparspConfig(**kwargs)
    # geometry disagreement between ranks: found by the one cheap all-gather, on every rank
    heads = 4 if rank == 0 else 2
    x = torch.randn(1, 32, heads, 8)
    with pytest.raises(ValueError, match="ranks disagree on heads"):
        sp_attention(x, x, x, config=SparspConfig(block_size=16, transport="nccl", kernel="torch"))
    return True


def test_bad_inputs_raise_value_errors():
    run_distributed(_bad_inputs_worker, 2, timeout=120)


def _silent_peer_worker(rank, world):
    from sparsp import SparspConfig, sp_attention

    if rank == 1:
        time.sleep(12)  # never joins the attention call
        return "slept"
    q = torch.randn(1, 32, 2, 8)
    cfg = SparspConfig(block_size=16, transport="nccl", kernel="torch", timeout_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        sp_attention(q, q, q, config=cfg)
    took = time.monotonic() - t0
    assert took < 10, f"the timeout of 3 s took {took:.1f} s to fire"
    return took


def test_silent_peer_raises_timeout_not_hang():
    results = run_distributed(_silent_peer_worker, 2, timeout=90)
    assert results[1] == "slept"
