"""Two ranks sharing one GPU over gloo and the ``host`` transport: the CUDA paths of a chunked
``sparsp`` drain (side stream, copy-engine pieces, stream waits on host flags) on a machine
with a single GPU, against a single-process reference. Not a speed test: both ranks share the
device.

The drain is cut into 5 head groups, more than the transport's window of 3 slots, so the
round's late steps go on the side stream after the chunk kernels (strategies/sparsp.py);
with ``local_first`` off and on (the local kernel queued after the first steps, or before the
host read). A denoising schedule (dense, plan and reuse steps) runs over both copy-engine
transports (``ipc`` and ``host``).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import random_slice_case, run_distributed, structured_inputs

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _pair_worker(rank, world, lens, H, kernel, chunks=None):
    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import close_transports

    torch.cuda.set_device(0)
    bs = 128
    shard, gm, want = random_slice_case(rank, lens, H, 64, bs, 11, density=0.6)
    errors = {}
    try:
        for local_first in (False, True):
            for drain in (1, 5):
                cfg = SparspConfig(block_size=bs, transport="host", kernel=kernel, drain_chunks=drain,
                                   chunks=chunks, local_first=local_first)
                for call in range(3):  # eager, then the plan stage captured, then replayed
                    out = sp_attention(*(t.cuda() for t in shard),
                                       strategy="sparsp", config=cfg, _global_mask=gm.cuda())
                    errors[(local_first, drain, call)] = (out.double().cpu() - want).abs().max().item()
    finally:
        close_transports()
    return errors


@pytest.mark.parametrize("kernel", ["torch", "flex"])
def test_chunked_drain_on_one_shared_gpu(kernel):
    H = 6
    for rank, errors in enumerate(run_distributed(_pair_worker, 2, [640, 600], H, kernel, timeout=400)):
        for key, err in errors.items():
            assert err <= 1e-3, f"rank {rank} (local_first, drain_chunks, call) {key}: error {err}"


def test_four_ranks_every_round_chunked_on_one_shared_gpu():
    # G = 4: three rounds, each in 5 chunks; the third round's buffer was the first's, so its
    # late steps on the side stream wait for the first round's kernels (strategies/sparsp.py)
    H = 5
    for rank, errors in enumerate(run_distributed(_pair_worker, 4, [512, 640, 600, 384], H, "torch", 5,
                                                  timeout=500)):
        for key, err in errors.items():
            assert err <= 1e-3, f"rank {rank} (local_first, drain_chunks, call) {key}: error {err}"


def _off_grid(x: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:]
    return flat.view(x.shape).copy_(x)


def _summing_graph_worker(rank, world, lens, H):
    import dataclasses

    from sparsp import SparspConfig, sp_attention, summaries
    from sparsp.strategies import close_transports

    torch.cuda.set_device(0)
    bs, D = 128, 64
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    graphed = SparspConfig(block_size=bs, transport="host", kernel="torch", cdf_threshold=0.8)
    # without CUDA graphs the summing kernel is launched every call (and the plan stage eager)
    configs = {"launched": dataclasses.replace(graphed, cuda_graphs=False), "graphed": graphed}
    outs, graphs = {}, {}
    try:
        for name, cfg in configs.items():
            for call in range(5):
                g = torch.Generator().manual_seed(100 + call)  # new values, new allocations each call
                qkv = torch.randn(1, sum(lens), 3, H, D, generator=g).to(torch.bfloat16)[:, sl]
                q, k, v = (qkv[:, :, i].contiguous().cuda() for i in range(3))
                if call == 3:  # contiguous tensors 2 bytes off the 16-byte grid: the launch again
                    q, k, v = (_off_grid(x) for x in (q, k, v))
                outs[(name, call)] = sp_attention(q, k, v, strategy="sparsp", config=cfg).cpu()
            graphs[name] = sum(isinstance(s, summaries._SumsGraph) for s in summaries._SUM_GRAPHS.values())
    finally:
        close_transports()
    same = {call: torch.equal(outs[("launched", call)], outs[("graphed", call)]) for call in range(5)}
    return same, graphs


def test_summing_graph_replays_new_inputs_as_the_launch_does():
    # the metadata's summing kernel replayed from a CUDA graph (summaries.kept_row) reads each
    # call's q, k, v through the offsets the host writes: outputs equal the launched kernel's
    # bit for bit, call by call (CDF masks from the summaries, no test mask)
    for rank, (same, graphs) in enumerate(run_distributed(_summing_graph_worker, 2, [640, 600], 4, timeout=300)):
        assert all(same.values()), f"rank {rank}: calls whose outputs differ: {same}"
        assert graphs == {"launched": 0, "graphed": 1}, f"rank {rank}: summing graphs captured {graphs}"


def _eviction_worker(rank, world):
    import dataclasses

    from sparsp import SparspConfig, sp_attention, summaries
    from sparsp.strategies import captured, close_transports

    torch.cuda.set_device(0)
    # two of each kept thing: every new geometry drops a summing graph, a plan stage, a send row
    # and its gathered rows, whose pinned table and host-read copies were used inside a capture
    summaries.MAX_SEND_ROWS = summaries.MAX_SUM_GRAPHS = captured.MAX_STAGES = 2
    cfg = SparspConfig(block_size=128, transport="host", kernel="torch", cdf_threshold=0.8)
    eager = dataclasses.replace(cfg, cuda_graphs=False)
    differ = []
    try:
        for round_ in range(2):
            for S in (640, 768, 896, 1024, 1152):
                for call in range(3):  # launched, captured, replayed
                    g = torch.Generator().manual_seed(S + call)
                    q, k, v = (torch.randn(1, S, 4, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(3))
                    got = sp_attention(q, k, v, strategy="sparsp", config=cfg)
                    want = sp_attention(q, k, v, strategy="sparsp", config=eager)
                    if not torch.equal(got, want):
                        differ.append((round_, S, call))
                # pinned memory churn between geometries: freed host blocks are reused
                pins = [torch.empty(1 << 16, pin_memory=True) for _ in range(8)]
                del pins
                torch.cuda.synchronize()
        graphs = sum(isinstance(s, summaries._SumsGraph) for s in summaries._SUM_GRAPHS.values())
    finally:
        close_transports()
    torch.cuda.synchronize()
    return differ, graphs


def test_evicted_graphs_and_buffers_leave_later_calls_intact():
    # more geometries than kept graphs and buffers: those dropped (their pinned memory used in a
    # capture included) break nothing, and every call equals the eager stage's
    (differ, graphs), = run_distributed(_eviction_worker, 1, timeout=300)
    assert not differ, f"(round, S, call) whose outputs differ from the eager stage's: {differ}"
    assert 1 <= graphs <= 2


def _schedule_worker(rank, world, lens, transport):
    """A 5-step schedule (dense, plan, reuse, plan, reuse) over ``transport`` on bf16 inputs
    that move a little from step to step; each step against the single-process reference of
    the same step kind (fp32, the bf16-rounded inputs), and the reuse steps' bytes."""
    from dataclasses import replace

    from sparsp import SparspConfig, sp_attention
    from sparsp.integrations.reference import reference_sp_attention
    from sparsp.strategies import close_transports, get_transport

    torch.cuda.set_device(0)
    H, D, bs = 4, 64, 128
    a = sum(lens[:rank])
    cfg = SparspConfig(cdf_threshold=0.8, block_size=bs, transport=transport, kernel="torch", dense_steps=1,
                       replan_every=2)
    base = structured_inputs(21, 1, sum(lens), H, D)
    g = torch.Generator().manual_seed(22)
    drift = [torch.randn(x.shape, generator=g) for x in base]
    errors, moved, mask = [], [], None
    t = get_transport(transport, None, torch.device("cuda", 0), cfg.timeout_s)
    try:
        for step in range(5):
            q, k, v = ((x + 0.05 * step * d).cuda().bfloat16().float() for x, d in zip(base, drift))
            t.reset_counters()
            out = sp_attention(*(x[:, a:a + lens[rank]].bfloat16().contiguous() for x in (q, k, v)),
                               strategy="sparsp", config=cfg, layer=0, step=step)
            t.fence()
            moved.append(t.total_received)
            kind = cfg.step_kind(step)
            if kind == "dense":
                want = reference_sp_attention(q, k, v, lens=lens, config=replace(cfg, cdf_threshold=1.0))
            elif kind == "plan":
                want, mask = reference_sp_attention(q, k, v, lens=lens, config=cfg, return_mask=True)
            else:
                want = reference_sp_attention(q, k, v, lens=lens, config=cfg, mask=mask)
            errors.append((out.float() - want[:, a:a + lens[rank]]).abs().max().item())
    finally:
        close_transports()
    return errors, moved


@pytest.mark.parametrize("transport", ["ipc", "host"])
def test_schedule_on_one_shared_gpu(transport):
    """A schedule's dense, plan and reuse steps over a copy-engine transport: each equals the
    reference of its kind; a reuse step moves its plan step's bytes."""
    for rank, (errors, moved) in enumerate(run_distributed(_schedule_worker, 2, [640, 600], transport,
                                                           timeout=300)):
        assert max(errors) <= 3e-2, f"rank {rank} {transport}: errors per step {errors}"
        assert moved[2] == moved[1] and moved[4] == moved[3], f"rank {rank} {transport}: bytes per step {moved}"
