"""Every strategy at G = 8 (gloo, CPU) against a single-process float64 reference.

G = 2, 3 and 4 are covered in ``test_strategies.py``; this file adds eight ranks, where the
relay ring's hops carry blocks for up to six downstream consumers and ``sparsp`` runs seven
direct rounds. Spawning eight processes on a 2-core machine is the expensive part, so ONE
``run_distributed`` call runs every case: uneven slices with short blocks mid-sequence (CDF
masks), a random mask with an empty row, and a placed video sequence under both placements
whose moved bytes are held against ``demand.comm_bytes``.
"""

import torch

from dist_utils import placed_run, reference, run_distributed, slice_errors, structured_inputs
from test_strategies import slice_blocks, split_mask

from sparsp.strategies import strategy_names

STRATEGIES = strategy_names()

WORLD = 8
# Uneven slices; 21 and 27 end in short blocks in the middle of the sequence.
LENS = [32, 16, 48, 21, 32, 16, 40, 27]


def _slices_case(rank, world, lens, H, cdf, random_mask, seed):
    """Each rank's max abs error per strategy on a sequence cut into ``lens`` slices."""
    from sparsp import SparspConfig

    B, D, bs = 1, 8, 16
    q, k, v = structured_inputs(seed, B, sum(lens), H, D)
    tok_block, nblocks = slice_blocks(lens, bs)
    if random_mask:
        g = torch.Generator().manual_seed(seed + 1)
        gm = torch.rand(B, H, nblocks, nblocks, generator=g) < 0.3
        gm[0, 0, 0] = False  # an empty row: defined output is zeros
        mask = gm
    else:
        gm = None
        mask = split_mask(q, k, lens, bs, cdf, None)
    want = {"sparse": reference(q, k, v, tok_block, mask),
            "dense": reference(q, k, v, tok_block, torch.ones_like(mask))}
    cfg = SparspConfig(cdf_threshold=cdf, block_size=bs, transport="nccl", kernel="torch")
    return slice_errors(rank, world, q, k, v, lens, want, cfg, gm)


def _placed_case(rank, world, kind, cdf, seed):
    """A placed video sequence: outputs unpermute to plain attention; bytes equal demand.py's."""
    from sparsp.geometry import VideoGeometry

    # 4 frames of 4x16 tokens + 10 text tokens = 266 tokens, 17 blocks of 16: 2-3 blocks a rank.
    geom = VideoGeometry(frames=4, height=4, width=16, text_tokens=10, block_size=16, heads=8, head_dim=8)
    runs = placed_run(rank, world, geom, kind, cdf, seed)
    errors = {strategy: err for strategy, (err, _, _) in runs.items()}
    moved = {strategy: (got, predicted) for strategy, (_, got, predicted) in runs.items()}
    return errors, moved


def _worker(rank, world, seed):
    import torch.distributed as dist

    from sparsp.strategies import get_transport

    results = {
        "slices, cdf 0.8": _slices_case(rank, world, LENS, 8, 0.8, False, seed),
        "slices, random mask": _slices_case(rank, world, LENS, 8, 0.9, True, seed + 5),
    }
    moved = {}
    for kind in ("contiguous", "periodic"):
        results[f"placed {kind}"], moved[kind] = _placed_case(rank, world, kind, 0.8, seed + 9)
    get_transport("nccl", None, torch.device("cpu"), 60).fence()
    dist.barrier()
    return results, moved


def test_every_strategy_at_eight_ranks():
    out = run_distributed(_worker, WORLD, 7, timeout=240)
    for rank, (results, moved) in enumerate(out):
        for case, errors in results.items():
            assert set(errors) == set(STRATEGIES), f"{case}: ran {sorted(errors)}"  # H = 8: ulysses too
            bad = {s: e for s, e in errors.items() if not e <= 1e-5}
            assert not bad, f"rank {rank}, {case}: max abs error above 1e-5: {bad}"
        for kind, per_strategy in moved.items():
            for strategy, (got, predicted) in per_strategy.items():
                assert got == predicted, (f"{strategy} ({kind}) rank {rank}: moved {got} B, "
                                          f"demand.py says {predicted} B")
    # The relay ring moves more than direct routing somewhere at G = 8 (Figure 5), never less.
    for kind in ("contiguous", "periodic"):
        relay = sum(o[1][kind]["ring-relay"][0] for o in out)
        direct = sum(o[1][kind]["sparsp"][0] for o in out)
        ring = sum(o[1][kind]["ring"][0] for o in out)
        assert direct <= relay <= ring, (kind, direct, relay, ring)
