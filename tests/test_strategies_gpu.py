"""GPU: every strategy on every transport, flex and the auto kernel (FA4 where installed), in
bf16 on 2 GPUs, and the chunked pipeline forced on (scripts/gpu_check.sh)."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_two = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

STRATEGIES = ("ring", "ring-sparse", "ring-relay", "ulysses", "sparsp")


def _spawn(fn, world, *args):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world, port, fn, args), nprocs=world, join=True)


def _entry(rank, world, port, fn, args):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        fn(rank, world, *args)
    finally:
        from sparsp.strategies import close_transports

        close_transports()
        dist.destroy_process_group()


def _worker(rank, world, transport, S_per_rank, tail, kernel):
    from sparsp import SparspConfig, sp_attention
    from sparsp.masks import block_mask

    B, H, D, bs = 1, 8, 128, 128
    lens = [S_per_rank] * (world - 1) + [S_per_rank - tail]
    S = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(5)
    c = torch.randn(1, 1, H, D, device="cuda", generator=g)
    pos = torch.linspace(-3, 3, S, device="cuda").view(1, S, 1, 1)
    q = c + torch.randn(B, S, H, D, device="cuda", generator=g) * 0.5
    k = c + torch.randn(B, S, H, D, device="cuda", generator=g) * 0.5 + pos
    v = torch.randn(B, S, H, D, device="cuda", generator=g)
    # The reference sees the same bf16-rounded inputs (so the same mask), computed in fp32.
    q, k, v = (x.to(torch.bfloat16).float() for x in (q, k, v))
    mask = block_mask(q, k, cdf_threshold=0.9, block_q=bs, block_k=bs)
    tok = torch.arange(S, device="cuda") // bs
    allowed = mask[:, :, tok][:, :, :, tok]
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref_sparse = t(sdpa(t(q), t(k), t(v), attn_mask=allowed))
    ref_dense = t(sdpa(t(q), t(k), t(v)))
    # A bf16 attention of the same problem sets the error scale (flash-attention's test rule).
    base_sparse = t(sdpa(*(t(x).bfloat16() for x in (q, k, v)), attn_mask=allowed)).float()
    base_dense = t(sdpa(*(t(x).bfloat16() for x in (q, k, v)))).float()
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    qb, kb, vb = (x[:, sl].to(torch.bfloat16).contiguous() for x in (q, k, v))
    cfg = SparspConfig(cdf_threshold=0.9, block_size=bs, transport=transport, kernel=kernel)
    for strategy in STRATEGIES:
        out = sp_attention(qb, kb, vb, strategy=strategy, config=cfg)
        ref, base = (ref_dense, base_dense) if strategy == "ring" else (ref_sparse, base_sparse)
        bound = 2 * (base[:, sl] - ref[:, sl]).abs().max().item() + 1e-3
        err = (out.float() - ref[:, sl]).abs().max().item()
        assert out.dtype == torch.bfloat16 and out.shape == qb.shape
        assert err <= bound, f"{strategy}/{transport}: error {err:.4f} > bound {bound:.4f}"
        print(f"rank {rank} {strategy}/{transport}: max abs error {err:.5f} (bound {bound:.5f})")
    # the chunked pipeline forced on (head groups of a payload, per-chunk readiness); a drain
    # of 5 messages to one peer is more than the slot transports' window of 3: its late steps
    # go on the side stream after the chunk kernels (strategies/sparsp.py)
    chunked = SparspConfig(cdf_threshold=0.9, block_size=bs, transport=transport, kernel=kernel,
                           chunks=3, drain_chunks=5)
    out = sp_attention(qb, kb, vb, strategy="sparsp", config=chunked)
    err = (out.float() - ref_sparse[:, sl]).abs().max().item()
    bound = 2 * (base_sparse[:, sl] - ref_sparse[:, sl]).abs().max().item() + 1e-3
    assert err <= bound, f"chunked sparsp/{transport}/{kernel}: error {err} > bound {bound}"
    dense = SparspConfig(cdf_threshold=1.0, block_size=bs, transport=transport, kernel=kernel)
    out = sp_attention(qb, kb, vb, strategy="sparsp", config=dense)
    err = (out.float() - ref_dense[:, sl]).abs().max().item()
    bound = 2 * (base_dense[:, sl] - ref_dense[:, sl]).abs().max().item() + 1e-3
    assert err <= bound, f"dense sparsp/{transport}: error {err} > bound {bound}"


def _cases_worker(rank, world, cases, kernel):
    for transport, tail in cases:  # one process pair for all: NCCL set up and kernels compiled once
        _worker(rank, world, transport, 4096, tail, kernel)


@needs_two
@pytest.mark.parametrize("kernel, cases", [
    ("flex", [("nccl", 0), ("nccl", 40), ("ipc", 0), ("host", 40)]),
    ("auto", [("nccl", 40), ("ipc", 40), ("host", 0)]),
])
def test_strategies_bf16(kernel, cases):
    _spawn(_cases_worker, 2, cases, kernel)


def _same_output_worker(rank, world, transports):
    from sparsp import SparspConfig, sp_attention

    g = torch.Generator(device="cuda").manual_seed(9 + rank)
    q, k, v = (torch.randn(1, 2048, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    outs = {}
    for t in transports:
        cfg = SparspConfig(cdf_threshold=0.9, transport=t, kernel="flex")
        outs[t] = sp_attention(q, k, v, strategy="sparsp", config=cfg)
    for t in transports[1:]:
        assert torch.equal(outs[t], outs[transports[0]]), f"sparsp output on {t} differs from {transports[0]}"


@needs_two
def test_sparsp_identical_across_transports():
    from sparsp.transport import transport_names

    transports = [t for t in ("nccl", "ipc", "host") if t in transport_names()]
    _spawn(_same_output_worker, 2, transports)


def _drifting_inputs(rank: int, step: int, S: int, H: int, D: int):
    """bf16 (1, S, H, D) q, k, v of one rank and call: a shared direction plus noise and a
    drift along the sequence (a mask that keeps some remote blocks and drops others)."""
    g = torch.Generator(device="cuda").manual_seed(100 * step + rank)
    c = torch.randn(1, 1, H, D, device="cuda", generator=g)
    drift = torch.linspace(-2, 2, S, device="cuda").view(1, S, 1, 1) * (rank + 1)
    qkv = (c + torch.randn(1, S, H, D, device="cuda", generator=g) + drift * i for i in range(3))
    return tuple(x.to(torch.bfloat16).contiguous() for x in qkv)


def _graph_worker(rank, world, kernel):
    import dataclasses

    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import captured

    H, D = 8, 128
    cases = [("sparsp", "nccl", {}), ("sparsp", "ipc", {"drain_chunks": 2}),
             ("ring-relay", "nccl", {}), ("ring-sparse", "host", {}), ("sparsp", "host", {})]
    for S in (3000 - 100 * rank, 2048):  # uneven shards with short blocks, then another geometry
        for strategy, transport, extra in cases:
            graphs = SparspConfig(cdf_threshold=0.9, transport=transport, kernel=kernel, **extra)
            eager = dataclasses.replace(graphs, cuda_graphs=False)
            for step in range(3):  # eager, capture + replay, replay: new inputs every call
                q, k, v = _drifting_inputs(rank, step, S, H, D)
                a = sp_attention(q, k, v, strategy=strategy, config=graphs)
                b = sp_attention(q, k, v, strategy=strategy, config=eager)
                err = (a.float() - b.float()).abs().max().item()
                assert err <= 1e-2, f"{strategy}/{transport} S={S} call {step}: graph vs eager {err}"
    assert captured.captured() == 2 * len(cases), f"captured stages: {captured.captured()}"


@needs_two
def test_captured_stage_equals_eager():
    """The plan stage replayed as a CUDA graph (strategies/captured.py) gives the eager output
    on every later call of a geometry, for new inputs, uneven shards and a second geometry."""
    _spawn(_graph_worker, 2, "auto")


def _local_first_worker(rank, world, kernel):
    import dataclasses

    from sparsp import SparspConfig, sp_attention
    from sparsp.transport import transport_names

    H, D, S = 8, 128, 3000 - 100 * rank  # uneven shards with short blocks
    transports = [t for t in ("nccl", "ipc", "host") if t in transport_names()]
    for transport in transports:
        for strategy in ("sparsp", "ring-relay", "ring-sparse", "ring"):
            first = SparspConfig(cdf_threshold=0.9, transport=transport, kernel=kernel, local_first=True)
            later = dataclasses.replace(first, local_first=False)
            for step in range(3):  # eager, capture + replay, replay
                q, k, v = _drifting_inputs(rank, step, S, H, D)
                want = sp_attention(q, k, v, strategy=strategy, config=later).clone()
                got = sp_attention(q, k, v, strategy=strategy, config=first)
                # the caller reuses its inputs at once: the side stream's packs must be ordered
                # before this (Call.join), or the peer would receive zeros
                for x in (q, k, v):
                    x.zero_()
                assert torch.equal(got, want), (
                    f"{strategy}/{transport} call {step}: local first differs by "
                    f"{(got.float() - want.float()).abs().max().item()}")


@needs_two
def test_local_first_equals_in_order():
    """The local kernel queued before the host read and the first round packed on the side
    stream (SparspConfig.local_first) give the same bits as the in-order call, on every
    transport, with the caller overwriting its inputs right after each call."""
    _spawn(_local_first_worker, 2, "auto")


def _thresholds_worker(rank, world, path, kernel):
    import dataclasses

    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import captured

    H, D, S = 8, 128, 3000 - 100 * rank
    graphs = SparspConfig(thresholds=path, transport="nccl", kernel=kernel)
    eager = dataclasses.replace(graphs, cuda_graphs=False)
    swapped = {}
    for step in range(3):  # eager, capture + replay, replay; the two layers alternate on one geometry
        for layer in (0, 1):
            q, k, v = _drifting_inputs(rank, step, S, H, D)
            got = sp_attention(q, k, v, strategy="sparsp", config=graphs, layer=layer)
            want = sp_attention(q, k, v, strategy="sparsp", config=eager, layer=layer)
            err = (got.float() - want.float()).abs().max().item()
            assert err <= 1e-2, f"layer {layer} call {step}: graph vs eager {err}"
            other = sp_attention(q, k, v, strategy="sparsp", config=eager, layer=1 - layer)
            swapped[(step, layer)] = (got.float() - other.float()).abs().max().item()
    assert captured.captured() == 1, f"captured stages: {captured.captured()}"  # one geometry, one stage
    assert min(swapped.values()) > 0.05, f"the two layers' tables give the same output: {swapped}"


def test_layers_with_their_own_thresholds_replay_one_stage(tmp_path):
    """Two layers of one geometry with different per-head CDF thresholds: the captured plan
    stage takes them as its input, so both replay one graph, each equal to the eager stage
    with its own table (and not with the other layer's)."""
    from sparsp.thresholds import write_thresholds

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    path = tmp_path / "t.json"
    write_thresholds(path, layers=2, heads=8, cdf=[[0.5, 0.6, 0.5, 0.7, 0.5, 0.6, 0.5, 0.6], 0.99])
    _spawn(_thresholds_worker, min(2, torch.cuda.device_count()), str(path), "auto")
