"""GPU tests of the flex backend (run on the device machine with ``pytest -m gpu``).

Error bounds follow flash-attention's tests (STYLE §9): against an fp32 reference computed
on the same bf16-valued inputs, the flex error must stay within 2x the error of a plain
PyTorch computation done in bf16, plus the rounding error of bf16 at the output's scale.
At most four geometries are compiled here (dynamo's default recompile limit is eight).
"""

from __future__ import annotations

import math

import pytest
import torch

try:
    from test_kernels import make_buffer, random_selection
except ImportError:  # tests/ imported as a package
    from tests.test_kernels import make_buffer, random_selection

from sparsp.kernels import KVBuffer, flex, get_kernel, torch_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BS = 128


def token_mask(kv: KVBuffer, num, idx, sq: int) -> torch.Tensor:
    """Dense bool ``[B, H, Sq, N]``: which buffer rows each query row attends."""
    B, H, n_q, K = idx.shape
    nb, N = kv.num_blocks, kv.capacity
    used = torch.arange(K, device=idx.device) < num.unsqueeze(-1)
    sel = torch.zeros(B, H, n_q, nb + 1, dtype=torch.bool, device=idx.device)
    sel.scatter_(-1, torch.where(used, idx.long(), nb), True)  # slot nb: "unused"
    sel[..., nb] = False
    row_block = torch.full((N,), nb, dtype=torch.long)  # rows of no block map to slot nb
    for j, (st, ln) in enumerate(zip(kv.block_start.tolist(), kv.block_len.tolist())):
        row_block[st : st + ln] = j
    tok = sel[..., row_block.to(idx.device)]
    return tok.repeat_interleave(kv.block_size, dim=2)[:, :, :sq]


def dense_attention(q, k, v, mask, scale, compute_dtype):
    """Masked softmax attention with every step in ``compute_dtype``; lse in fp32."""
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    s = torch.einsum("bhqd,nd->bhqn", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v, lse


def bf16_atol(ref: torch.Tensor) -> float:
    # Rounding error of bf16 at the magnitude of the reference (flash-attention's fwd_atol).
    return 2 * ((ref.bfloat16() + 0.3 - 0.3).float() - ref).abs().max().item()


def check_against_reference(out, lse, ref_out, ref_lse, pt_out, pt_lse):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    empty = torch.isneginf(ref_lse)
    assert (out[empty] == 0).all()
    fin = ~empty
    err = (out.float() - ref_out).abs().max().item()
    err_pt = (pt_out.float() - ref_out).abs().max().item()
    assert err <= 2 * err_pt + bf16_atol(ref_out), (err, err_pt)
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item()
    lse_err_pt = (pt_lse[fin] - ref_lse[fin]).abs().max().item()
    # A log2-based LSE would be off by ~0.44 * |lse| here, far beyond this bound.
    assert lse_err <= 2 * lse_err_pt + 1e-3, (lse_err, lse_err_pt)


def make_case(seed, B, H, sq, D, n_full, short_lens, K, dtype):
    gen = torch.Generator().manual_seed(seed)
    kv = make_buffer(gen, n_full, short_lens, BS, D, dtype=dtype, slack=300, device=DEV)
    num, idx = random_selection(gen, B, H, math.ceil(sq / BS), kv.num_blocks, K, device=DEV)
    q = torch.randn(B, H, sq, D, generator=gen).to(dtype).to(DEV)
    return q, kv, num, idx


def as_fp32(kv: KVBuffer) -> KVBuffer:
    return KVBuffer(kv.k.float(), kv.v.float(), kv.block_start, kv.block_len, kv.block_size,
                    kv.num_aligned)


@pytest.mark.parametrize(
    "sq,short_lens", [(1000, [5, 127, 64, 1]), (1024, [])], ids=["short_blocks", "aligned"]
)
def test_flex_matches_torch_bf16(sq, short_lens):
    B, H, D = 2, 4, 128
    q, kv, num, idx = make_case(0, B, H, sq, D, 24, short_lens, 12, torch.bfloat16)
    num[0, 1, 2] = 0  # an empty query block
    ref_out, ref_lse = torch_ref.block_sparse_attention(q.float(), as_fp32(kv), num, idx)
    mask = token_mask(kv, num, idx, sq)
    pt_out, pt_lse = dense_attention(q, kv.k, kv.v, mask, D**-0.5, torch.bfloat16)
    out, lse = flex.block_sparse_attention(q, kv, num, idx)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    check_against_reference(out, lse, ref_out, ref_lse, pt_out, pt_lse)


def test_flex_matches_torch_fp32():
    q, kv, num, idx = make_case(1, 2, 4, 1000, 128, 24, [5, 127, 64, 1], 12, torch.float32)
    ref_out, ref_lse = torch_ref.block_sparse_attention(q, kv, num, idx)
    out, lse = flex.block_sparse_attention(q, kv, num, idx)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = ~torch.isneginf(ref_lse)
    # TF32 may be on for flex's fp32 dots depending on float32_matmul_precision.
    tol = 1e-4 if torch.get_float32_matmul_precision() == "highest" else 5e-3
    assert (out - ref_out).abs().max().item() <= tol
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= tol


def test_flex_does_not_recompile_for_new_indices():
    from torch._dynamo.utils import counters

    q, kv, num, idx = make_case(2, 2, 4, 1000, 128, 24, [5, 127, 64, 1], 12, torch.bfloat16)
    flex.block_sparse_attention(q, kv, num, idx)
    graphs = counters["stats"]["unique_graphs"]
    _, _, num2, idx2 = make_case(3, 2, 4, 1000, 128, 24, [5, 127, 64, 1], 12, torch.bfloat16)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out, lse = flex.block_sparse_attention(q, kv, num2, idx2)
    torch.cuda.synchronize()
    assert counters["stats"]["unique_graphs"] == graphs
    ref_out, ref_lse = torch_ref.block_sparse_attention(q.float(), as_fp32(kv), num2, idx2)
    fin = ~torch.isneginf(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() <= 1e-2


def test_flex_dense_selection_vs_sdpa():
    B, S, H, D = 1, 1000, 8, 128  # S % 128 != 0: one short tail block per head
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, S, H, D, generator=gen).bfloat16().to(DEV) for _ in range(3))
    kv, block_id = KVBuffer.from_dense(k, v, BS)
    n_q = math.ceil(S / BS)
    idx = block_id.reshape(B, H, 1, -1).expand(B, H, n_q, -1).to(torch.int32).contiguous()
    num = torch.full((B, H, n_q), idx.shape[-1], dtype=torch.int32, device=DEV)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(qh.float(), kh.float(), vh.float())
    ref_lse = torch.logsumexp(qh.float() @ kh.float().transpose(-1, -2) / math.sqrt(D), -1)
    err_pt = (sdpa(qh, kh, vh).float() - ref).abs().max().item()
    out, lse = get_kernel("auto", DEV)(qh, kv, num, idx)
    assert (out.float() - ref).abs().max().item() <= 2 * err_pt + bf16_atol(ref)
    assert (lse - ref_lse).abs().max().item() <= 1e-2


def test_auto_is_flex_on_cuda():
    assert get_kernel("auto", DEV) is flex.block_sparse_attention
    assert flex.flex_available(DEV)
