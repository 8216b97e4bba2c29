"""Distributed attention on CPU (gloo, 2–4 processes) against a single-process reference."""

import pytest
import torch

from dist_utils import placed_run, reference, run_distributed, slice_blocks, slice_errors
from dist_utils import structured_inputs as _inputs



def split_mask(q, k, lens, bs, cdf, sim):
    """The mask every strategy must use: per-slice blocks, pooled as in the split form."""
    from sparsp.masks import split_mask as split

    return split(q, k, lens, bs, cdf_threshold=cdf, sim_threshold=sim)


def _case_worker(rank, world, lens, H, bs, cdf, sim, random_mask, seed):
    import torch.distributed as dist

    from sparsp import SparspConfig
    from sparsp.masks import block_mask
    from sparsp.strategies import get_transport

    B, D = 2, 16
    S = sum(lens)
    q, k, v = _inputs(seed, B, S, H, D)
    tok_block, nblocks = slice_blocks(lens, bs)
    if random_mask:
        g = torch.Generator().manual_seed(seed + 1)
        gm = torch.rand(B, H, nblocks, nblocks, generator=g) < 0.35
        gm[0, 0, 0] = False  # an empty row: defined output is zeros
    else:
        gm = None
        m = split_mask(q, k, lens, bs, cdf, sim)
        if all(L % bs == 0 for L in lens[:-1]):  # the public contract: block_mask on the whole
            assert torch.equal(m, block_mask(q, k, cdf_threshold=cdf, sim_threshold=sim, block_q=bs, block_k=bs))
    mask = gm if random_mask else m
    want = {"sparse": reference(q, k, v, tok_block, mask),
            "dense": reference(q, k, v, tok_block, torch.ones_like(mask))}
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double()).transpose(1, 2)
    assert (sdpa - want["dense"]).abs().max() < 1e-10
    if cdf >= 1.0 and sim is None and not random_mask:
        assert mask.all()
    cfg = SparspConfig(cdf_threshold=cdf, sim_threshold=sim, block_size=bs, transport="nccl", kernel="torch")
    errors = slice_errors(rank, world, q, k, v, lens, want, cfg, gm)
    get_transport("nccl", None, torch.device("cpu"), 60).fence()
    dist.barrier()
    bad = {s: e for s, e in errors.items() if not e <= 1e-5}
    assert not bad, f"rank {rank}: max abs error above 1e-5: {bad}"
    return errors


CASES = [
    # world, per-rank lengths (tokens), heads, block, cdf, sim, random mask
    (2, [48, 32], 2, 16, 0.8, None, False),
    (2, [64, 53], 4, 16, 0.9, 0.5, False),  # tail block on the last rank, similarity on
    (3, [32, 48, 41], 3, 16, 0.7, None, False),
    (3, [40, 35, 50], 3, 16, 0.85, None, False),  # short blocks in the middle of the sequence
    (4, [32, 16, 48, 37], 4, 16, 0.75, None, False),
    (3, [32, 48, 41], 3, 16, 0.9, None, True),  # random masks, incl. an empty row
    (4, [16, 32, 32, 20], 4, 16, 0.9, None, True),
]


@pytest.mark.parametrize("world, lens, H, bs, cdf, sim, random_mask", CASES)
def test_strategies_match_reference(world, lens, H, bs, cdf, sim, random_mask):
    run_distributed(_case_worker, world, lens, H, bs, cdf, sim, random_mask, 7, timeout=240)


@pytest.mark.parametrize("world, lens", [(2, [48, 45]), (3, [32, 33, 16])])
def test_dense_threshold_equals_sdpa(world, lens):
    run_distributed(_case_worker, world, lens, 3 if world == 3 else 2, 16, 1.0, None, False, 11, timeout=240)


def _placed_worker(rank, world, kind, strategy_cdf, seed):
    """A placed video sequence: outputs unpermute to plain attention, bytes match demand.py."""
    from sparsp.geometry import VideoGeometry

    geom = VideoGeometry(frames=4, height=4, width=12, text_tokens=10, block_size=16, heads=4, head_dim=8)
    for strategy, (err, moved, predicted) in placed_run(rank, world, geom, kind, strategy_cdf, seed).items():
        assert err <= 1e-5, f"{strategy} ({kind}): error {err}"
        assert moved == predicted, f"{strategy} ({kind}) rank {rank}: moved {moved} B, demand.py says {predicted} B"
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", ["contiguous", "periodic"])
def test_placed_sequences_and_bytes(world, kind):
    run_distributed(_placed_worker, world, kind, 0.8, 3, timeout=240)


def _cached_plan_worker(rank, world, lens, H, bs):
    from sparsp import SparspConfig, plan, sp_attention
    from sparsp.strategies import call as call_module

    B, D = 1, 16
    S = sum(lens)
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    tok_block, _ = slice_blocks(lens, bs)
    cfg = SparspConfig(cdf_threshold=0.8, block_size=bs, transport="nccl", kernel="torch")
    gathers = []
    real = plan.all_gather_flat
    plan.all_gather_flat = lambda *args, **kw: gathers.append(1) or real(*args, **kw)
    buffers, masks = [], []
    try:
        for seed in (11, 12):  # the same geometry, other inputs: another mask
            q, k, v = _inputs(seed, B, S, H, D)
            mask = split_mask(q, k, lens, bs, 0.8, None)
            masks.append(mask)
            before = len(gathers)
            out = sp_attention(q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(),
                               strategy="sparsp", config=cfg)
            err = (out.double() - reference(q, k, v, tok_block, mask)[:, sl]).abs().max().item()
            assert err <= 1e-5, f"call with seed {seed}: error {err}"
            buffers.append([id(b) for g in call_module._GEOMETRIES.values() for b in g.buffers])
            if seed == 12:  # the shapes were known: one metadata all-gather, no re-gather
                assert len(gathers) - before == 1, len(gathers) - before
    finally:
        plan.all_gather_flat = real
    assert not torch.equal(masks[0], masks[1]), "the two calls must differ in their masks"
    assert buffers[1] == buffers[0] and buffers[0], "the payload buffers of the geometry are reused"
    assert len(plan._STATE) == 1 and len(next(iter(plan._STATE.values())).shapes) == 1
    return True


@pytest.mark.parametrize("world, lens", [(2, [48, 37]), (3, [32, 48, 41])])
def test_second_call_reuses_the_plan_of_its_geometry(world, lens):
    """A second call on one geometry with another mask: the cached shapes, buffers and layouts
    serve it (one all-gather, the same payload buffers) and the output is right."""
    assert all(run_distributed(_cached_plan_worker, world, lens, 2, 16))


def _local_first_worker(rank, world, lens, H, bs):
    import dataclasses

    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import call as call_module

    B, D = 2, 16
    S = sum(lens)
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    q, k, v = (t[:, sl].contiguous() for t in _inputs(23, B, S, H, D))
    early = []
    real = call_module.Call.attend_local_early
    call_module.Call.attend_local_early = lambda call: early.append(1) or real(call)
    try:
        for strategy in ("sparsp", "ring-relay", "ring-sparse", "ring", "ulysses"):
            # automatic (None) on the CPU takes the early path: Call.local_first_pays
            first = SparspConfig(cdf_threshold=0.85, block_size=bs, transport="nccl", kernel="torch")
            later = dataclasses.replace(first, local_first=False)
            for step in range(2):  # the second call of the geometry too
                before = len(early)
                a_out = sp_attention(q, k, v, strategy=strategy, config=first)
                queued = len(early) - before
                b_out = sp_attention(q, k, v, strategy=strategy, config=later)
                assert len(early) - before == queued, f"{strategy}: local_first=False queued early"
                local_first = strategy != "ulysses"  # its run starts with the all-to-all
                assert queued == int(local_first), f"{strategy} call {step}: {queued} early kernels"
                # the same kernels on the same blocks, merged in the same order: the same bits
                assert torch.equal(a_out, b_out), f"{strategy} call {step}: local first changed the output"
    finally:
        call_module.Call.attend_local_early = real
    return True


@pytest.mark.parametrize("world, lens", [(2, [48, 37]), (3, [32, 48, 41])])
def test_local_first_gives_the_same_output(world, lens):
    """``SparspConfig.local_first`` (the local kernel queued before the host read) moves when
    the local shard is computed, nothing else: outputs equal bit for bit with it off, for every
    strategy that registers it; the others never queue early."""
    assert all(run_distributed(_local_first_worker, world, lens, 6, 16, timeout=240))


def test_local_first_pays_only_where_the_transfer_hides():
    """The automatic rule (``Call.local_first_pays``) on CUDA-like figures: in order on the
    first call of a geometry and over nccl; on a copy-engine transport local first exactly when
    the first round's rows move in less time than the local kept pairs compute."""
    from types import SimpleNamespace

    from sparsp.plan import Shapes
    from sparsp.cost import chunks
    from sparsp.strategies import call as call_module

    sh = Shapes(0, 2, 1, 8, 64, 128, (4096, 4096))
    fab = chunks.fabric("cuda", "host", 64, "fa4", path="host")  # the rule runs at the call's kernel's rate
    pair_s = 4 * 128 ** 2 * 64 / fab.flops_per_s  # one kept block pair
    row_s = 2 * 64 * 2 / fab.bytes_per_s  # one K row and its V row, bf16

    def pays(transport, last):
        call = SimpleNamespace(q=SimpleNamespace(device=torch.device("cuda"), element_size=lambda: 2),
                               shapes=sh, transport=SimpleNamespace(name=transport, fabric="host"),
                               _geo=SimpleNamespace(last_round=last), kernel_name="fa4")
        call.fabric = lambda: call_module.Call.fabric(call)
        return call_module.Call.local_first_pays(call)

    pairs = 1000
    balanced = int(pairs * pair_s / row_s)  # rows that move in the local kernel's time
    assert not pays("host", None)  # the geometry's first call
    assert pays("host", (balanced // 2, pairs))
    assert not pays("host", (balanced * 2, pairs))
    assert not pays("nccl", (1, pairs))


def _markers_worker(rank, world):
    from torch.profiler import profile

    from sparsp import SparspConfig, sp_attention
    from sparsp.simulate.opcount import _Counter

    q, k, v = (t[:, rank * 32:(rank + 1) * 32].contiguous() for t in _inputs(3, 1, 32 * world, 2, 8))
    cfg = SparspConfig(cdf_threshold=0.9, block_size=16, transport="nccl", kernel="torch")
    sp_attention(q, k, v, strategy="sparsp", config=cfg)
    counter = _Counter()
    with counter:  # no profiler: the call's ranges issue no op
        sp_attention(q, k, v, strategy="sparsp", config=cfg)
    assert not any("record_function" in name for name in counter.names), counter.names
    with profile() as prof:
        sp_attention(q, k, v, strategy="sparsp", config=cfg)
    names = {e.name for e in prof.events()}
    assert {"sparsp.metadata", "sparsp.plan", "sparsp.resolve", "sparsp.run"} <= names, sorted(names)[:20]
    return True


def test_profiler_ranges_only_while_a_profiler_records():
    """``groups.marker``: the call's named ranges (what ``bench attention --torch-profile`` reads)
    are there under a profiler and cost nothing without one (≈ 12 µs of host time each on an
    H200 host otherwise)."""
    assert all(run_distributed(_markers_worker, 2))
