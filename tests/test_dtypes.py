"""Every strategy, ``auto`` included, in bf16 and fp16 on gloo against a float64 reference.

The CPU kernel computes in fp32; what a strategy sends must still be in q's dtype, or the
ranks' messages disagree in size (gloo aborts every rank). Whole blocks and a tail block on
the last rank both run (``ulysses`` takes a different path for each).
"""

import pytest
import torch

from dist_utils import reference, run_distributed, slice_blocks, slice_errors
from dist_utils import structured_inputs as _inputs


def _worker(rank, world, lens, dtype_name, seed):
    from sparsp import SparspConfig, sp_attention

    dtype = getattr(torch, dtype_name)
    B, H, D, bs = 1, 4, 16, 16
    q, k, v = _inputs(seed, B, sum(lens), H, D)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    tok_block, nblocks = slice_blocks(lens, bs)
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(B, H, nblocks, nblocks, generator=g) < 0.5
    mask[..., 0] = True  # every query block keeps one key block
    want = {"sparse": reference(q.double(), k.double(), v.double(), tok_block, mask),
            "dense": reference(q.double(), k.double(), v.double(), tok_block, torch.ones_like(mask))}
    cfg = SparspConfig(block_size=bs, transport="nccl", kernel="torch")
    errors = slice_errors(rank, world, q, k, v, lens, want, cfg, mask)
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    out = sp_attention(q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(),
                       strategy="auto", config=cfg, _global_mask=mask)
    assert out.dtype == dtype
    # auto may take the dense ring: either reference is right for it
    errors["auto"] = min((out.double() - want[w][:, sl]).abs().max().item() for w in want)
    return errors


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("world,lens", [(2, [48, 29]), (3, [32, 16, 21]), (4, [16, 32, 16, 16])])
def test_every_strategy_in_16_bit(dtype, world, lens):
    from sparsp.strategies import strategy_names

    errors = run_distributed(_worker, world, lens, dtype, 7, timeout=180)
    tol = 2e-2 if dtype == "bfloat16" else 4e-3  # one rounding of an O(1) output in that dtype
    for rank, errs in enumerate(errors):
        expected = set(strategy_names()) | {"auto"}
        if 4 % world:  # ulysses needs the heads to divide over the ranks
            expected.discard("ulysses")
        assert set(errs) == expected, (rank, sorted(errs))
        bad = {s: e for s, e in errs.items() if not e <= tol}
        assert not bad, f"rank {rank}, {dtype}: error above {tol}: {bad}"
