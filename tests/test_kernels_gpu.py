"""GPU tests of the fast kernels (run on the device machine: ``pytest -o addopts="" -m gpu``).

Error bounds follow flash-attention's tests (STYLE §9): against an fp32 reference computed on
the same bf16-valued inputs, a kernel's error must stay within 2x the error of a plain PyTorch
computation done in bf16, plus the rounding error of bf16 at the output's scale; the LSE
within 2x PyTorch's LSE error + 1e-3 (a log2-based LSE would be off by ~0.44·|lse|).

Both K/V layouts (``LocalKV`` and a packed ``KVBuffer`` built as payloads are), query and key
tails (S % 128 != 0), B = 2, d64 and d128, empty rows. FA4 cases skip cleanly where
``flash_attn.cute`` does not import or the GPU is not sm90+.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

try:
    from test_kernels import packed_buffer, shard_case
except ImportError:  # tests/ imported as a package
    from tests.test_kernels import packed_buffer, shard_case

from sparsp.kernels import LocalKV, fa4, flex, get_kernel, kernel_indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BS = 128
KERNELS = {"flex": flex.block_sparse_attention, "fa4": fa4.block_sparse_attention}


def need(kernel: str) -> None:
    if kernel == "fa4" and not fa4.fa4_available(DEV):
        pytest.skip(f"FA4 not usable here: {fa4.import_error() or 'GPU older than sm90'}")


def shard_attention(q, k, v, mask, scale, compute_dtype):
    """Masked softmax attention of q (B, H, Sq, D) over a shard k, v (B, S, H, D) under a
    block mask [B, H, nQ, n], every step in ``compute_dtype``; lse in fp32."""
    Sq, S = q.shape[2], k.shape[1]
    tok = mask.repeat_interleave(BS, dim=2)[:, :, :Sq].repeat_interleave(BS, dim=3)[..., :S]
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    s = torch.einsum("bhqd,bshd->bhqs", q, k) * scale
    s = s.masked_fill(~tok, float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqs,bshd->bhqd", p, v), lse


def bf16_atol(ref: torch.Tensor) -> float:
    # Rounding error of bf16 at the magnitude of the reference (flash-attention's fwd_atol).
    return 2 * ((ref.bfloat16() + 0.3 - 0.3).float() - ref).abs().max().item()


def check(out, lse, q, k, v, mask):
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = shard_attention(q, k, v, mask, scale, torch.float32)
    pt_out, pt_lse = shard_attention(q, k, v, mask, scale, torch.bfloat16)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "empty rows must have lse -inf, others finite"
    assert (out[empty] == 0).all() and not out.isnan().any()
    fin = ~empty
    err = (out.float() - ref_out).abs().max().item()
    err_pt = (pt_out.float() - ref_out).abs().max().item()
    assert err <= 2 * err_pt + bf16_atol(ref_out), (err, err_pt)
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item()
    lse_err_pt = (pt_lse[fin] - ref_lse[fin]).abs().max().item()
    assert lse_err <= 2 * lse_err_pt + 1e-3, (lse_err, lse_err_pt)


def run(kernel, layout_kind, q, k, v, mask, selected, width=None):
    n = math.ceil(k.shape[1] / BS)
    if layout_kind == "local":
        kv = LocalKV(k, v, BS)
        ids = kv.block_ids()
    else:
        kv, ids = packed_buffer(k, v, selected, BS, slack_rows=300)
    num, idx = kernel_indices(mask, ids, width or n)
    return KERNELS[kernel](q, kv, num, idx)


@pytest.mark.parametrize("kernel", ["fa4", "flex"])
@pytest.mark.parametrize("layout_kind", ["local", "packed"])
@pytest.mark.parametrize(
    "B,H,Sq,S,D",
    [(2, 4, 1000, 1100, 128), (2, 4, 1000, 1100, 64), (1, 4, 1024, 1024, 128)],
    ids=["tails-d128", "tails-d64", "aligned-d128"],
)
def test_kernel_matches_fp32_reference(kernel, layout_kind, B, H, Sq, S, D):
    """Short blocks in the fast kernel (packed: scratch call + merge; local: the end of the
    sequence), query tails, B = 2, both head dims, empty rows (one whole head empty too)."""
    need(kernel)
    q, k, v, mask, selected = shard_case(0, B, H, Sq, S, D, BS, dtype=torch.bfloat16, device=DEV)
    mask[-1, -1] = False  # a head that reads nothing at all
    out, lse = run(kernel, layout_kind, q, k, v, mask, selected)
    check(out, lse, q, k, v, mask)


@pytest.mark.parametrize("kernel", ["fa4", "flex"])
def test_unordered_wide_lists(kernel):
    """Lists in any order and wider than the shard's block count (a geometry's fixed width)."""
    need(kernel)
    q, k, v, mask, selected = shard_case(5, 2, 2, 700, 900, 128, BS, dtype=torch.bfloat16, device=DEV)
    kv = LocalKV(k, v, BS)
    num, idx = kernel_indices(mask, kv.block_ids(), kv.num_blocks + 5)
    keys = torch.rand(idx.shape, device=DEV)
    keys = torch.where(torch.arange(idx.shape[-1], device=DEV) < num.unsqueeze(-1), keys, 2.0)
    idx = torch.gather(idx, -1, keys.argsort(-1)).contiguous()  # shuffle the used slots
    out, lse = KERNELS[kernel](q, kv, num, idx)
    check(out, lse, q, k, v, mask)


@pytest.mark.parametrize("layout_kind", ["local", "packed"])
def test_flex_does_not_recompile_for_new_indices(layout_kind):
    q, k, v, mask, selected = shard_case(2, 2, 4, 1000, 1100, 128, BS, p_keep=1.0,
                                         dtype=torch.bfloat16, device=DEV)
    run("flex", layout_kind, q, k, v, mask, selected)
    entries = flex.compiled_entries()
    mask2 = torch.rand(mask.shape, device=DEV) < 0.3
    with torch._dynamo.config.patch(error_on_recompile=True):
        out, lse = run("flex", layout_kind, q, k, v, mask2, selected)
    torch.cuda.synchronize()
    assert flex.compiled_entries() == entries
    check(out, lse, q, k, v, mask2)


@pytest.mark.parametrize("kernel", ["fa4", "flex"])
def test_ten_geometries_in_one_process(kernel):
    """Ten distinct shapes, both layouts, in one process: flex gets one compiled entry per
    geometry (no recompile limit), FA4 reuses its kernel across sequence lengths."""
    need(kernel)
    for i in range(10):
        sq, s = 256 + 96 * i, 384 + 80 * i
        q, k, v, mask, selected = shard_case(20 + i, 1, 2, sq, s, 64, BS, dtype=torch.bfloat16,
                                             device=DEV)
        for layout_kind in ("local", "packed"):
            out, lse = run(kernel, layout_kind, q, k, v, mask, selected)
            check(out, lse, q, k, v, mask)


@pytest.mark.parametrize("layout_kind", ["local", "packed"])
def test_fa4_prepared_launch_equals_flash_attn_func(monkeypatch, layout_kind):
    """New lengths and tails under one launch signature: the prepared launch (tried once, then
    used) gives FA4's own result bit for bit."""
    need("fa4")
    monkeypatch.setattr(fa4, "_PREPARED", {})
    for i, (sq, s) in enumerate([(512, 640), (1000, 1100), (700, 1024), (512, 640)]):
        q, k, v, mask, selected = shard_case(40 + i, 1, 4, sq, s, 128, BS, dtype=torch.bfloat16,
                                             device=DEV)
        with monkeypatch.context() as m:  # no signature: every launch through flash_attn_func
            m.setattr(fa4, "_signature", lambda *args: None)
            ref = run("fa4", layout_kind, q, k, v, mask, selected)
        got = run("fa4", layout_kind, q, k, v, mask, selected)
        torch.cuda.synchronize()
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (sq, s)
    torch.cuda.synchronize()
    states = [type(p).__name__ for p in fa4._PREPARED.values()]
    # the main signature was tried and passed; a signature seen once (the packed path's short
    # blocks appear only with a tail) may still wait for its verdict; none was declined
    assert "_Prepared" in states and "NoneType" not in states, states
    assert all(p.passed() for p in fa4._PREPARED.values() if type(p).__name__ == "_Trial")


def test_flex_fp32():
    q, k, v, mask, selected = shard_case(1, 2, 4, 1000, 1100, 128, BS, device=DEV)
    for layout_kind in ("local", "packed"):
        out, lse = run("flex", layout_kind, q, k, v, mask, selected)
        ref_out, ref_lse = shard_attention(q, k, v, mask, 128**-0.5, torch.float64)
        fin = ~torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), ~fin)
        # TF32 may be on for flex's fp32 dots depending on float32_matmul_precision.
        tol = 1e-4 if torch.get_float32_matmul_precision() == "highest" else 5e-3
        assert (out.double() - ref_out).abs().max().item() <= tol
        assert (lse[fin].double() - ref_lse[fin]).abs().max().item() <= tol


def test_fa4_falls_back_to_flex_for_unsupported_calls():
    need("fa4")
    fa4._WARNED.clear()  # the warning is given once per reason and process
    q, k, v, mask, selected = shard_case(3, 1, 2, 300, 300, 128, BS, device=DEV)  # fp32
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = run("fa4", "local", q, k, v, mask, selected)
    assert any("running the flex kernel" in str(w.message) for w in caught)
    assert out.dtype == torch.float32 and not out.isnan().any()


def test_dense_selection_vs_sdpa():
    B, S, H, D = 1, 1000, 8, 128  # S % 128 != 0: one short tail block per head
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, S, H, D, generator=gen).bfloat16().to(DEV) for _ in range(3))
    kv = LocalKV(k, v, BS)
    n = kv.num_blocks
    num, idx = kernel_indices(torch.ones(B, H, n, n, dtype=torch.bool, device=DEV), kv.block_ids(), n)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(qh.float(), kh.float(), vh.float())
    ref_lse = torch.logsumexp(qh.float() @ kh.float().transpose(-1, -2) / math.sqrt(D), -1)
    err_pt = (sdpa(qh, kh, vh).float() - ref).abs().max().item()
    out, lse = get_kernel("auto", DEV)(qh.contiguous(), kv, num, idx)
    assert (out.float() - ref).abs().max().item() <= 2 * err_pt + bf16_atol(ref)
    assert (lse - ref_lse).abs().max().item() <= 1e-2


def test_auto_prefers_fa4_then_flex():
    expected = fa4.block_sparse_attention if fa4.fa4_available(DEV) else flex.block_sparse_attention
    assert get_kernel("auto", DEV) is expected
    assert flex.flex_available(DEV)
