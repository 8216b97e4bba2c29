"""CPU tests of sparsp.kernels: both K/V layouts, torch backend, LSE merge, the flex and FA4
wrappers' logic (with their kernel call emulated), the kernel benchmark's plumbing.

The torch backend is checked against a slow, obviously correct float64 reference that builds
a dense boolean token mask from (kv_num_blocks, kv_indices, K/V); the dense case is checked
against SDPA; the merge against the kernel on the union of key sets. Packed buffers in the
layout tests are built the way the strategies build them (``sparsp.packing``: layout, pack,
``KVBuffer.from_payload``).
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsp.kernels import (
    KernelName,
    KVBuffer,
    LocalKV,
    canonical_block_ids,
    fa4,
    flex,
    get_kernel,
    kernel_indices,
    merge_partials,
    torch_ref,
    update_out_and_lse,
)
from sparsp.kernels.buffer import split_lists

TOL = 1e-5


# ---------------------------------------------------------------------------- helpers


def make_buffer(gen, n_full, short_lens, bs, d, *, dtype=torch.float32, slack=0, device="cpu"):
    """A random KVBuffer: ``n_full`` aligned blocks, then short blocks at random offsets
    (random gaps of 0-2 rows) and unused rows at the end. The capacity depends only on the
    arguments (not on the random gaps), like a fixed-capacity receive slot."""
    starts, lens = [j * bs for j in range(n_full)], [bs] * n_full
    pos = n_full * bs
    for length in short_lens:
        pos += int(torch.randint(0, 3, (1,), generator=gen))  # a gap: any offset is legal
        starts.append(pos)
        lens.append(length)
        pos += length
    n = n_full * bs + sum(short_lens) + 2 * len(short_lens) + slack
    k = torch.randn(n, d, generator=gen).to(dtype)
    v = torch.randn(n, d, generator=gen).to(dtype)
    kv = KVBuffer(
        k.to(device), v.to(device),
        torch.tensor(starts, dtype=torch.long, device=device),
        torch.tensor(lens, dtype=torch.long, device=device),
        bs, n_full,
    )
    kv.validate(uniform_short=False)  # the torch reference reads short blocks of any length
    return kv


def random_selection(gen, b, h, n_q, nb, k, *, p_empty=0.2, device="cpu"):
    """Duplicate-free block ids in random order; unused slots hold random junk ids."""
    num = torch.zeros(b, h, n_q, dtype=torch.int32)
    idx = torch.randint(0, max(nb, 1), (b, h, n_q, k), generator=gen, dtype=torch.int32)
    for r in range(b * h * n_q):
        bi, hi, qi = r // (h * n_q), (r // n_q) % h, r % n_q
        if float(torch.rand(1, generator=gen)) < p_empty:
            continue
        count = int(torch.randint(1, min(k, nb) + 1, (1,), generator=gen)) if nb else 0
        num[bi, hi, qi] = count
        idx[bi, hi, qi, :count] = torch.randperm(nb, generator=gen)[:count].to(torch.int32)
    return num.to(device), idx.to(device)


def dense_reference(q, kv, num, idx, scale=None):
    """Plain softmax attention in float64 under a dense token mask built slot by slot."""
    B, H, Sq, D = q.shape
    bs, N = kv.block_size, kv.capacity
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    mask = torch.zeros(B, H, Sq, N, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(num.shape[2]):
                for s in range(int(num[b, h, i])):
                    j = int(idx[b, h, i, s])
                    st, ln = int(kv.block_start[j]), int(kv.block_len[j])
                    mask[b, h, i * bs : (i + 1) * bs, st : st + ln] = True
    scores = torch.einsum("bhqd,nd->bhqn", q.double().cpu(), kv.k.double().cpu()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.where(mask, torch.exp(scores - safe.unsqueeze(-1)), torch.zeros_like(scores))
    return p @ kv.v.double().cpu(), lse


def assert_matches(out, lse, ref_out, ref_lse, tol=TOL):
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse.cpu()), torch.isneginf(ref_lse))
    fin = ~torch.isneginf(ref_lse)
    assert (lse.cpu().double()[fin] - ref_lse[fin]).abs().max().item() <= tol if fin.any() else True
    assert (out.cpu().double() - ref_out).abs().max().item() <= tol
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


def run_case(seed, B, H, Sq, D, bs, n_full, short_lens, K, slack=0, scale=None):
    gen = torch.Generator().manual_seed(seed)
    kv = make_buffer(gen, n_full, short_lens, bs, D, slack=slack)
    n_q = math.ceil(Sq / bs)
    num, idx = random_selection(gen, B, H, n_q, kv.num_blocks, K)
    q = torch.randn(B, H, Sq, D, generator=gen)
    return q, kv, num, idx


def packed_buffer(k, v, selected, bs, *, slack_rows=0):
    """A KVBuffer holding the ``selected`` (bool [B*H, n]) blocks of shard ``k, v (B, S, H, D)``,
    built as the strategies build payloads (sparsp.packing + KVBuffer.from_payload), in a
    buffer with ``slack_rows`` unused rows (a fixed-capacity slot). Returns (kv, block_ids)."""
    from sparsp.packing import layout, pack

    B, S, H, D = k.shape
    lay = layout(selected, S, bs)
    flat = torch.zeros((lay.num_rows + slack_rows) * 2 * D, dtype=k.dtype, device=k.device)
    pack(k, v, lay, H, flat)
    kv = KVBuffer.from_payload(flat, rows=lay.num_rows, block_start=lay.block_start,
                               block_len=lay.block_len, num_aligned=lay.num_aligned,
                               block_size=bs, head_dim=D)
    kv.validate()
    return kv, lay.block_ids


def shard_case(seed, B, H, Sq, S, D, bs, *, p_keep=0.5, p_block=0.6, dtype=torch.float32,
               device="cpu"):
    """q (B, H, Sq, D) head-major, a shard k, v (B, S, H, D), a random per-head block mask
    [B, H, nQ, n] over the shard, and the packed selection (blocks some row keeps; a random
    share of the others too, as a payload may carry blocks this rank does not read)."""
    gen = torch.Generator().manual_seed(seed)
    n_q, n = math.ceil(Sq / bs), math.ceil(S / bs)
    q = torch.randn(B, H, Sq, D, generator=gen).to(dtype).to(device)
    k = torch.randn(B, S, H, D, generator=gen).to(dtype).to(device)
    v = torch.randn(B, S, H, D, generator=gen).to(dtype).to(device)
    mask = torch.rand(B, H, n_q, n, generator=gen) < p_block
    mask[0, 0, 0] = False  # always one empty row
    selected = mask.any(dim=2).reshape(B * H, n) | (torch.rand(B * H, n, generator=gen) < p_keep)
    return q, k, v, mask.to(device), selected.to(device)


def local_reference(q, k, v, mask, bs, scale=None):
    """float64 attention of q (B, H, Sq, D) over a shard (B, S, H, D) under a block mask."""
    B, H, Sq, D = q.shape
    S = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    tok = mask.cpu().repeat_interleave(bs, dim=2)[:, :, :Sq].repeat_interleave(bs, dim=3)[..., :S]
    s = torch.einsum("bhqd,bshd->bhqs", q.double().cpu(), k.double().cpu()) * scale
    s = s.masked_fill(~tok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.where(tok, torch.exp(s - safe.unsqueeze(-1)), torch.zeros_like(s))
    return torch.einsum("bhqs,bshd->bhqd", p, v.double().cpu()), lse


# ---------------------------------------------------------------------------- torch backend


@pytest.mark.parametrize(
    "B,H,Sq,D,bs,n_full,short_lens,K",
    [
        (1, 2, 64, 16, 16, 6, [], 4),  # Sq a multiple of bs, no short blocks
        (2, 3, 50, 8, 16, 5, [3, 15, 1], 6),  # Sq not a multiple, short blocks at offsets
        (1, 1, 7, 4, 8, 0, [5, 2], 2),  # only short blocks, one partial query block
        (2, 2, 33, 8, 8, 4, [7], 12),  # K larger than the number of buffer blocks
    ],
)
def test_torch_backend_matches_reference(B, H, Sq, D, bs, n_full, short_lens, K):
    q, kv, num, idx = run_case(0, B, H, Sq, D, bs, n_full, short_lens, K, slack=5)
    num[0, 0, 0] = 0  # always at least one empty query block
    out, lse = torch_ref.block_sparse_attention(q, kv, num, idx)
    ref_out, ref_lse = dense_reference(q, kv, num, idx)
    assert_matches(out, lse, ref_out, ref_lse)
    assert torch.isneginf(lse[0, 0, :bs]).all() and (out[0, 0, :bs] == 0).all()


def test_torch_backend_custom_scale_and_small_chunks(monkeypatch):
    # A tiny chunk budget forces one query block per chunk: the loop must stitch correctly.
    monkeypatch.setattr(torch_ref, "_CHUNK_ELEMS", 1)
    q, kv, num, idx = run_case(1, 2, 2, 45, 8, 16, 5, [4, 9], 5)
    out, lse = torch_ref.block_sparse_attention(q, kv, num, idx, scale=0.3)
    assert_matches(out, lse, *dense_reference(q, kv, num, idx, scale=0.3))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 2),
    H=st.integers(1, 3),
    Sq=st.integers(1, 40),
    bs=st.sampled_from([4, 8, 16]),
    n_full=st.integers(0, 5),
    short_lens=st.lists(st.integers(1, 3), max_size=3),
    K=st.integers(1, 6),
)
def test_torch_backend_property(seed, B, H, Sq, bs, n_full, short_lens, K):
    short_lens = [min(s, bs - 1) for s in short_lens if bs > 1]
    q, kv, num, idx = run_case(seed, B, H, Sq, 8, bs, n_full, short_lens, K, slack=3)
    out, lse = torch_ref.block_sparse_attention(q, kv, num, idx)
    assert out.shape == (B, H, Sq, 8) and lse.shape == (B, H, Sq)
    assert_matches(out, lse, *dense_reference(q, kv, num, idx))


@pytest.mark.parametrize("S", [64, 70])
@pytest.mark.parametrize("layout_kind", ["local", "packed"])
def test_dense_selection_equals_sdpa(S, layout_kind):
    gen = torch.Generator().manual_seed(2)
    B, H, D, bs = 2, 3, 16, 16
    q, k, v = (torch.randn(B, S, H, D, generator=gen) for _ in range(3))
    n = math.ceil(S / bs)
    if layout_kind == "local":
        kv = LocalKV(k, v, bs)
        block_ids = kv.block_ids()
    else:
        kv, block_ids = packed_buffer(k, v, torch.ones(B * H, n, dtype=torch.bool), bs, slack_rows=7)
    mask = torch.ones(B, H, n, n, dtype=torch.bool)
    num, idx = kernel_indices(mask, block_ids, n)
    qh = q.transpose(1, 2)
    out, lse = torch_ref.block_sparse_attention(qh, kv, num, idx)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(qh, k.transpose(1, 2), v.transpose(1, 2))
    assert (out - ref).abs().max().item() <= TOL
    scores = qh @ k.transpose(1, 2).transpose(-1, -2) / math.sqrt(D)
    assert (lse - torch.logsumexp(scores, dim=-1)).abs().max().item() <= TOL


@pytest.mark.parametrize(
    "B,H,Sq,S,bs",
    [
        (1, 2, 64, 64, 16),  # no tail on either side
        (2, 3, 50, 70, 16),  # query tail and key tail
        (2, 2, 7, 5, 8),  # one partial query block, one partial key block
        (1, 1, 33, 48, 16),  # query tail only
    ],
)
def test_local_and_packed_match_reference(B, H, Sq, S, bs):
    """The same shard read as a LocalKV and as a packed payload gives the same attention, and
    both match the float64 reference: tails on both sides, B > 1, an empty row."""
    q, k, v, mask, selected = shard_case(11, B, H, Sq, S, 8, bs)
    ref_out, ref_lse = local_reference(q, k, v, mask, bs)
    local = LocalKV(k, v, bs)
    n = local.num_blocks
    out_l, lse_l = torch_ref.block_sparse_attention(q, local, *kernel_indices(mask, local.block_ids(), n))
    assert_matches(out_l, lse_l, ref_out, ref_lse)
    kv, block_ids = packed_buffer(k, v, selected, bs, slack_rows=5)
    out_p, lse_p = torch_ref.block_sparse_attention(q, kv, *kernel_indices(mask, block_ids, n + 2))
    assert_matches(out_p, lse_p, ref_out, ref_lse)
    assert torch.isneginf(lse_l[0, 0, :bs]).all() and (out_l[0, 0, :bs] == 0).all()


def test_local_kv_block_ids_and_shape_checks():
    k = torch.randn(2, 37, 3, 8)
    kv = LocalKV(k, k.clone(), 16)
    assert (kv.num_blocks, kv.tail_len, kv.batch, kv.heads, kv.head_dim) == (3, 5, 2, 3, 8)
    assert torch.equal(kv.block_ids(), torch.arange(3).repeat(6, 1))
    q = torch.randn(2, 4, 20, 8)  # 4 heads against a 3-head shard
    num = torch.zeros(2, 4, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="heads"):
        torch_ref.block_sparse_attention(q, kv, num, torch.zeros(2, 4, 2, 1, dtype=torch.int32))
    with pytest.raises(AssertionError, match="contiguous"):
        LocalKV(k.transpose(1, 2), k.transpose(1, 2), 16)


def test_input_validation():
    q, kv, num, idx = run_case(4, 1, 2, 20, 8, 8, 4, [], 2)
    with pytest.raises(ValueError, match="kv_num_blocks"):
        torch_ref.block_sparse_attention(q, kv, num[:, :, :1], idx)
    with pytest.raises(ValueError, match="kv_indices"):
        torch_ref.block_sparse_attention(q, kv, num, idx[0])
    with pytest.raises(ValueError, match="head dim"):
        torch_ref.block_sparse_attention(q[..., :4], kv, num, idx)
    with pytest.raises(ValueError, match="dtype"):
        torch_ref.block_sparse_attention(q.double(), kv, num, idx)
    with pytest.raises(ValueError, match="KVBuffer or a LocalKV"):
        torch_ref.block_sparse_attention(q, (kv.k, kv.v), num, idx)


# ---------------------------------------------------------------------------- layout


@pytest.mark.parametrize("S", [48, 53, 5])
def test_payload_round_trip(S):
    """A payload packed by sparsp.packing and viewed by from_payload holds every selected
    block where its id says, full blocks first, and knows its short length without a sync."""
    gen = torch.Generator().manual_seed(5)
    B, H, D, bs = 2, 3, 4, 16
    k, v = torch.randn(B, S, H, D, generator=gen), torch.randn(B, S, H, D, generator=gen)
    n, n_full = math.ceil(S / bs), S // bs
    selected = torch.rand(B * H, n, generator=gen) < 0.7
    kv, block_id = packed_buffer(k, v, selected, bs, slack_rows=9)
    n_short = int(selected[:, -1].sum()) if S % bs else 0
    assert kv.num_aligned == int(selected.sum()) - n_short and kv.num_short == n_short
    assert kv.short_len == (S % bs if n_short else 0) and kv.tail_length() == kv.short_len
    for bh in range(B * H):
        b, h = divmod(bh, H)
        for kb in range(n):
            j = int(block_id[bh, kb])
            assert (j >= 0) == bool(selected[bh, kb])
            if j < 0:
                continue
            st, ln = int(kv.block_start[j]), int(kv.block_len[j])
            assert ln == min(bs, S - kb * bs) and (j < kv.num_aligned) == (ln == bs)
            assert torch.equal(kv.k[st : st + ln], k[b, kb * bs : kb * bs + ln, h])
            assert torch.equal(kv.v[st : st + ln], v[b, kb * bs : kb * bs + ln, h])
    assert not hasattr(KVBuffer, "from_dense")


def test_validate_rejects_short_blocks_of_different_lengths():
    k = torch.randn(40, 4)
    kv = KVBuffer(k, k.clone(), torch.tensor([0, 16, 21]), torch.tensor([16, 5, 6]), 16, 1)
    with pytest.raises(ValueError, match="same length"):
        kv.validate()


def test_split_lists_gives_one_short_slot_per_row():
    """The width fix: a packed buffer's lists split into full blocks and ONE short slot per
    row (the row's own tail), found without a loop; the scratch rows are that tail's rows."""
    B, H, Sq, S, bs = 2, 3, 40, 53, 16
    q, k, v, mask, selected = shard_case(12, B, H, Sq, S, 4, bs, p_keep=1.0)
    kv, block_ids = packed_buffer(k, v, selected, bs)
    n = math.ceil(S / bs)
    num, idx = kernel_indices(mask, block_ids, n)
    split = split_lists(kv, num, idx, 7)
    assert split.idx.shape[-1] == 7 and bool((split.idx < kv.num_aligned).all())
    assert torch.equal(split.num, mask[..., : n - 1].sum(-1, dtype=torch.int32))
    assert torch.equal(split.has_short, mask[..., n - 1])
    assert split.rows.shape == (B * H, S % bs)
    for bh in range(B * H):
        tail = int(block_ids[bh, n - 1])
        if split.has_short.reshape(B * H, -1)[bh].any():
            start = int(kv.block_start[tail])
            assert torch.equal(split.rows[bh], torch.arange(start, start + S % bs))
    # A row naming two short blocks breaks the buffer's rules: caught on CPU.
    bad = idx.clone()
    bad[0, 0, 1, :2] = torch.tensor([kv.num_aligned, kv.num_aligned + 1], dtype=bad.dtype)
    bad_num = num.clone()
    bad_num[0, 0, 1] = 2
    with pytest.raises(AssertionError, match="more than one short"):
        split_lists(kv, bad_num, bad, 7)


def brute_block_ids(selected, tail):
    bh, nk = selected.shape
    ids = torch.full((bh, nk), -1, dtype=torch.long)
    nxt = 0
    for r in range(bh):
        for c in range(nk):
            if selected[r, c] and not (tail and c == nk - 1):
                ids[r, c] = nxt
                nxt += 1
    if tail:
        for r in range(bh):
            if selected[r, nk - 1]:
                ids[r, nk - 1] = nxt
                nxt += 1
    return ids


@settings(max_examples=60, deadline=None)
@given(
    bh=st.integers(0, 6), nk=st.integers(1, 7), p=st.floats(0, 1), tail=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_canonical_block_ids_matches_brute_force(bh, nk, p, tail, seed):
    gen = torch.Generator().manual_seed(seed)
    selected = torch.rand(bh, nk, generator=gen) < p
    assert torch.equal(canonical_block_ids(selected, tail), brute_block_ids(selected, tail))


@settings(max_examples=30, deadline=None)
@given(units=st.integers(1, 4), bh=st.integers(0, 6), nk=st.integers(1, 7), p=st.floats(0, 1),
       tail=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_canonical_block_ids_numbers_each_stacked_selection_on_its_own(units, bh, nk, p, tail, seed):
    gen = torch.Generator().manual_seed(seed)
    stacked = torch.rand(units, bh, nk, generator=gen) < p
    got = canonical_block_ids(stacked, tail)
    assert torch.equal(got, torch.stack([brute_block_ids(s, tail) for s in stacked]))


# ---------------------------------------------------------------------------- merge


@pytest.mark.parametrize("parts", [2, 3])
def test_split_and_merge_equals_union(parts):
    q, kv, num, idx = run_case(6, 2, 2, 40, 8, 8, 10, [3, 6], 8)
    gen = torch.Generator().manual_seed(7)
    full_out, full_lse = torch_ref.block_sparse_attention(q, kv, num, idx)
    # Give every used slot to one part at random: disjoint, and often empty for some rows.
    owner = torch.randint(0, parts, idx.shape, generator=gen)
    used = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)
    partials = []
    for p in range(parts):
        p_num, p_idx = torch_ref.compact_indices(used & (owner == p), idx, idx.shape[-1])
        partials.append(torch_ref.block_sparse_attention(q, kv, p_num, p_idx))
    out, lse = merge_partials(partials)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(full_lse))
    fin = ~torch.isneginf(full_lse)
    assert (lse[fin] - full_lse[fin]).abs().max().item() <= TOL
    assert (out - full_out).abs().max().item() <= TOL and not out.isnan().any()


def test_merge_handles_neg_inf():
    ninf = float("-inf")
    out_a, out_b = torch.randn(1, 1, 4, 3), torch.randn(1, 1, 4, 3)
    lse_a = torch.tensor([[[ninf, 0.5, ninf, 1.0]]])
    lse_b = torch.tensor([[[ninf, ninf, 2.0, 1.0]]])
    out_a[0, 0, 0], out_b[0, 0, :2] = 0, 0  # the contract: empty rows carry out 0
    out_a[0, 0, 2] = 0
    out, lse = update_out_and_lse(out_a, lse_a, out_b, lse_b)
    assert not out.isnan().any() and not lse.isnan().any()
    assert lse[0, 0, 0] == ninf and (out[0, 0, 0] == 0).all()
    assert torch.allclose(out[0, 0, 1], out_a[0, 0, 1]) and lse[0, 0, 1] == 0.5
    assert torch.allclose(out[0, 0, 2], out_b[0, 0, 2]) and lse[0, 0, 2] == 2.0
    assert torch.allclose(out[0, 0, 3], (out_a[0, 0, 3] + out_b[0, 0, 3]) / 2)
    assert torch.isclose(lse[0, 0, 3], torch.tensor(1.0 + math.log(2.0)))
    first_out, first_lse = update_out_and_lse(None, None, out_b.bfloat16(), lse_b)
    assert first_out.dtype == torch.float32 and torch.equal(first_lse, lse_b)
    with pytest.raises(ValueError):
        merge_partials([])


# ---------------------------------------------------------------------------- registry


def test_registry():
    assert get_kernel("auto", "cpu") is torch_ref.block_sparse_attention
    assert get_kernel(KernelName.TORCH, torch.device("cpu")) is torch_ref.block_sparse_attention
    with pytest.raises(ValueError, match="allowed"):
        get_kernel("triton", "cpu")
    for name in ("flex", "fa4"):
        with pytest.raises(ValueError, match="does not run on"):
            get_kernel(name, "cpu")
    assert {n.value for n in KernelName} == {"torch", "flex", "fa4", "auto"}
    assert not fa4.fa4_available("cpu")


# ---------------------------------------------------------------------------- flex, FA4 wrappers


def _token_mask(blocks, bs, sq, skv):
    """[..., nQ, W] block flags -> [..., Sq, Skv] token flags (blocks past Skv cut off)."""
    tok = blocks.repeat_interleave(bs, -2)[..., :sq, :].repeat_interleave(bs, -1)[..., :skv]
    return torch.nn.functional.pad(tok, (0, skv - tok.shape[-1]))


def _softmax_with_lse(q, k, v, tok, scale):
    s = (torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale).masked_fill(~tok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v.float(), lse


def _emulated_flex_call(q, k, v, block_mask, scale, enable_gqa):
    """Dense stand-in for compiled flex that honours the BlockMask's kv indices (CPU)."""
    bs = block_mask.BLOCK_SIZE[1]
    Sq, Skv = q.shape[2], k.shape[2]
    assert block_mask.seq_lengths == (Sq, Skv)
    tok = _token_mask(block_mask.to_dense().bool(), bs, Sq, Skv)
    rep = q.shape[1] // k.shape[1]
    assert rep == 1 or enable_gqa
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out, lse = _softmax_with_lse(q, k, v, tok, scale)
    return out.to(q.dtype), lse


def _emulated_fa4_run(q4, k4, v4, num, idx, bs, scale):
    """Dense stand-in for FA4's block-sparse forward with its layout and its rules: (B, S, H, D)
    tensors, lists no wider than the key blocks, keys past the end masked only in the last
    listed block (so a list holding a block that reaches past Sk must end with it)."""
    Sq, Sk, Hq, Hk = q4.shape[1], k4.shape[1], q4.shape[2], k4.shape[2]
    n_k = math.ceil(Sk / bs)
    assert idx.dtype == torch.int32 and num.dtype == torch.int32 and idx.is_contiguous()
    assert 1 <= idx.shape[-1] <= n_k, (idx.shape, n_k)
    slots = torch.arange(idx.shape[-1])
    used = slots < num.unsqueeze(-1)
    past_end = used & ((idx.long() + 1) * bs > Sk)
    last = slots == (num.long() - 1).unsqueeze(-1)
    assert bool((~past_end | last).all()), "a block past the end is not the last listed"
    dense = torch.zeros(*num.shape, n_k + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(used, idx.long(), n_k), True)
    tok = _token_mask(dense[..., :n_k], bs, Sq, Sk)
    q, k, v = (x.transpose(1, 2) for x in (q4, k4, v4))
    k, v = k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1)
    out, lse = _softmax_with_lse(q, k, v, tok, scale)
    return out.to(q4.dtype).transpose(1, 2).contiguous(), lse


CASES = [(2, 3, 45, 53, 8), (1, 2, 40, 48, 8), (2, 2, 7, 20, 8)]  # (B, H, Sq, S, bs)


@pytest.mark.skipif(not flex.FLEX_AVAILABLE, reason="flex_attention not in this torch")
@pytest.mark.parametrize("B,H,Sq,S,bs", CASES)
@pytest.mark.parametrize("layout_kind", ["local", "packed"])
def test_flex_wrapper_logic_on_cpu(monkeypatch, B, H, Sq, S, bs, layout_kind):
    # Compiled flex cannot return an LSE on CPU (torch 2.13), so the kernel call is replaced
    # by a dense emulation of the same BlockMask: this still checks the layouts, the BlockMask
    # built from_kv_blocks, the short-block scratch call and the merge.
    monkeypatch.setattr(flex, "_flex_call", _emulated_flex_call)
    _check_wrapper(flex.block_sparse_attention, B, H, Sq, S, bs, layout_kind)


@pytest.mark.parametrize("B,H,Sq,S,bs", CASES)
@pytest.mark.parametrize("layout_kind", ["local", "packed"])
def test_fa4_wrapper_logic_on_cpu(monkeypatch, B, H, Sq, S, bs, layout_kind):
    # FA4 needs a GPU; its call is replaced by an emulation that enforces its layout and list
    # rules, so this checks the (B, S, H, D) views, the sorting, the split and the merge.
    monkeypatch.setattr(fa4, "_load", lambda: (None, None, None))
    monkeypatch.setattr(fa4, "unsupported_reason", lambda q, block_size: None)
    monkeypatch.setattr(fa4, "_run", _emulated_fa4_run)
    _check_wrapper(fa4.block_sparse_attention, B, H, Sq, S, bs, layout_kind, shuffle=True)


class AuxData(NamedTuple):  # as FA4's: its compiled kernel checks the type of each field
    tensors: tuple | None = None
    scalars: tuple | None = None


class FakeFA4:
    """FA4's call structure without its kernel: ``flash_attn_func`` checks its arguments,
    compiles into ``_flash_attn_fwd.compile_cache`` on a miss and calls the compiled kernel
    with the same argument list as FA4 4.0.0b36 on sm90 (detached q/k/v, out, lse, scale,
    five unused tensors, window sizes, sink, the eight block-sparse tensors, aux data, two
    scheduler tensors). ``copy_q`` makes it copy q first, as FA4 does with a q whose last dim
    is not contiguous."""

    def __init__(self, copy_q=False, wrong_outside=False):
        self.copy_q, self.api_calls, self.kernel_calls = copy_q, 0, 0
        self.wrong_outside, self.inside = wrong_outside, False
        fake = self

        def _flash_attn_fwd():  # the attribute holder, as in FA4
            raise AssertionError("not called directly")

        _flash_attn_fwd.compile_cache = {}
        self.fwd = _flash_attn_fwd

        def kernel(q, k, v, out, lse, scale, *rest):
            fake.kernel_calls += 1
            assert type(rest[9]) is AuxData and rest[9] == (None, None), rest[9]
            sparse = rest[8]
            full_cnt, full_idx = sparse[2], sparse[3]
            o, l = _emulated_fa4_run(q, k, v, full_cnt, full_idx, fake.bs, scale)
            out.copy_(o)
            lse.copy_(l)
            if fake.wrong_outside and not fake.inside:  # a template that misleads the kernel
                out.add_(1.0)
        self.kernel = kernel

    def flash_attn_func(self, q, k, v, softmax_scale, causal, pack_gqa, block_sparse_tensors,
                        return_lse):
        self.api_calls += 1
        self.bs = block_sparse_tensors.block_size[1]
        if self.copy_q:
            q = q.clone()
        key = (q.dtype, q.shape[-1])
        cache = self.fwd.compile_cache
        if key not in cache:
            cache[key] = self.kernel
        B, Sq, H, D = q.shape
        out = torch.empty(B, Sq, H, v.shape[-1], dtype=q.dtype)
        lse = torch.empty(B, H, Sq, dtype=torch.float32)
        s = block_sparse_tensors
        self.inside = True
        try:
            cache[key](q.detach(), k.detach(), v.detach(), out.detach(), lse, softmax_scale,
                       None, None, None, None, None, None, None, None,
                       (s.mask_block_cnt, s.mask_block_idx, s.full_block_cnt, s.full_block_idx,
                        None, None, None, None), AuxData(None, None), None, None)
        finally:
            self.inside = False
        return out, lse


class FakeBlockSparse:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def fake_fa4(monkeypatch):
    """Installs a ``FakeFA4`` as ``flash_attn.cute.interface`` (returned; ``.install(copy_q)``
    swaps in another) with the prepared-launch table emptied."""
    import sys
    import types

    def install(copy_q=False, wrong_outside=False):
        fake = FakeFA4(copy_q, wrong_outside)
        interface = types.ModuleType("flash_attn.cute.interface")
        interface._flash_attn_fwd = fake.fwd
        for name, mod in (("flash_attn", types.ModuleType("flash_attn")),
                          ("flash_attn.cute", types.ModuleType("flash_attn.cute")),
                          ("flash_attn.cute.interface", interface)):
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.setattr(fa4, "_load", lambda: (fake.flash_attn_func, FakeBlockSparse, None))
        monkeypatch.setattr(fa4, "_PREPARED", {})
        monkeypatch.setattr(fa4, "_WARNED", set())
        return fake

    monkeypatch.setattr(fa4, "unsupported_reason", lambda q, block_size: None)
    install.first = install()
    return install


def _fa4_case(seed, Sq, S, layout_kind="local"):
    q, k, v, mask, selected = shard_case(seed, 1, 2, Sq, S, 8, 8)
    if layout_kind == "local":
        kv = LocalKV(k, v, 8)
        block_ids = kv.block_ids()
    else:
        kv, block_ids = packed_buffer(k, v, selected, 8)
    num, idx = kernel_indices(mask, block_ids, math.ceil(S / 8) + 2)
    return (q, kv, num, idx), local_reference(q, k, v, mask, 8)


@pytest.mark.parametrize("layout_kind", ["local", "packed"])
def test_fa4_prepared_launch_reuses_the_first_calls_arguments(fake_fa4, layout_kind):
    fake = fake_fa4.first
    for i, (Sq, S) in enumerate([(40, 48), (24, 64), (56, 40), (40, 48)]):
        args, (ref_out, ref_lse) = _fa4_case(20 + i, Sq, S, layout_kind)
        out, lse = fa4.block_sparse_attention(*args)
        assert_matches(out.float(), lse, ref_out, ref_lse, tol=1e-5)
        # only the first call of the signature goes through flash_attn_func (and tries the
        # template once on the same inputs); new lengths and new tensors reuse the template
        assert fake.api_calls == 1 and fake.kernel_calls == i + 2
    assert fake.fwd.compile_cache.__class__ is dict, "the compile cache is restored"
    assert [type(p).__name__ for p in fa4._PREPARED.values()] == ["_Prepared"]


def test_fa4_prepared_launch_that_disagrees_is_dropped(fake_fa4):
    fake = fake_fa4(wrong_outside=True)
    with pytest.warns(RuntimeWarning, match="disagreed with flash_attn_func"):
        for i in range(3):
            args, (ref_out, ref_lse) = _fa4_case(50 + i, 40, 48)
            out, lse = fa4.block_sparse_attention(*args)
            assert_matches(out.float(), lse, ref_out, ref_lse, tol=1e-5)  # never the wrong one
    # the trial on the first call disagreed: every call goes through flash_attn_func
    assert fake.api_calls == 3 and fake.kernel_calls == 4 and list(fa4._PREPARED.values()) == [None]


def test_fa4_prepared_launch_declines_when_fa4_copies_an_input(fake_fa4):
    fake = fake_fa4(copy_q=True)
    for i in range(3):
        args, (ref_out, ref_lse) = _fa4_case(30 + i, 40, 48)
        out, lse = fa4.block_sparse_attention(*args)
        assert_matches(out.float(), lse, ref_out, ref_lse, tol=1e-5)
    assert fake.api_calls == 3 and list(fa4._PREPARED.values()) == [None]


def test_fa4_prepared_launch_per_signature(fake_fa4):
    fake = fake_fa4.first
    args, _ = _fa4_case(40, 40, 48)
    fa4.block_sparse_attention(*args)
    fa4.block_sparse_attention(*args)
    assert fake.api_calls == 1
    q, kv, num, idx = args
    fa4.block_sparse_attention(q, kv, num, idx, scale=0.5)  # another scale: another signature
    assert fake.api_calls == 2 and len(fa4._PREPARED) == 2


def _check_wrapper(kernel, B, H, Sq, S, bs, layout_kind, shuffle=False):
    q, k, v, mask, selected = shard_case(13, B, H, Sq, S, 16, bs)  # flex takes head dims from 16
    ref_out, ref_lse = local_reference(q, k, v, mask, bs)
    n = math.ceil(S / bs)
    if layout_kind == "local":
        kv = LocalKV(k, v, bs)
        block_ids = kv.block_ids()
    else:
        kv, block_ids = packed_buffer(k, v, selected, bs, slack_rows=11)
    num, idx = kernel_indices(mask, block_ids, n + 3)
    if shuffle:  # any order is allowed: the wrapper must restore what its kernel needs
        num, idx = _permute_used(num, idx, torch.Generator().manual_seed(3))
    out, lse = kernel(q, kv, num, idx)
    assert out.shape == (B, H, Sq, 16) and lse.shape == (B, H, Sq)
    assert_matches(out.float(), lse, ref_out, ref_lse, tol=1e-5)


def _permute_used(num, idx, gen):
    """Shuffle the used slots of every list among themselves (lists stay duplicate-free)."""
    keys = torch.rand(idx.shape, generator=gen)
    keys = torch.where(torch.arange(idx.shape[-1]) < num.unsqueeze(-1), keys, 2.0)
    return num, torch.gather(idx, -1, keys.argsort(-1)).contiguous()


@pytest.mark.skipif(not flex.FLEX_AVAILABLE, reason="flex_attention not in this torch")
def test_flex_does_not_recompile_on_new_indices(monkeypatch):
    # Dynamo's guards do not depend on the backend, so compiling with backend="eager" on CPU
    # checks that new index contents (same geometry) reuse the graph. Its numbers are not
    # checked: eager flex ignores block indices.
    monkeypatch.setattr(flex, "_BACKEND", "eager")
    monkeypatch.setattr(flex, "_COMPILED", {})
    for layout_kind in ("local", "packed"):
        q, k, v, mask, selected = shard_case(9, 1, 2, 40, 53, 16, 8, p_keep=1.0)
        kv = LocalKV(k, v, 8) if layout_kind == "local" else packed_buffer(k, v, selected, 8)[0]
        ids = kv.block_ids() if layout_kind == "local" else packed_buffer(k, v, selected, 8)[1]
        flex.block_sparse_attention(q, kv, *kernel_indices(mask, ids, 7))
        entries = flex.compiled_entries()
        assert entries >= 1  # compiled, not run by the torch kernel
        mask2 = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) < 0.3
        with torch._dynamo.config.patch(error_on_recompile=True):
            flex.block_sparse_attention(q, kv, *kernel_indices(mask2, ids, 7))
        assert flex.compiled_entries() == entries


@pytest.mark.skipif(not flex.FLEX_AVAILABLE, reason="flex_attention not in this torch")
def test_flex_many_geometries_never_hit_the_recompile_limit(monkeypatch):
    # Ten geometries in one process with dynamo's per-code-object limit at ONE graph: passes
    # only because every geometry gets its own compiled entry (its own code object).
    monkeypatch.setattr(flex, "_BACKEND", "eager")
    monkeypatch.setattr(flex, "_COMPILED", {})
    with torch._dynamo.config.patch(recompile_limit=1):
        for i in range(10):
            q, k, v, mask, _ = shard_case(i, 1, 2, 16 + 8 * i, 24 + 8 * i, 16, 8)
            kv = LocalKV(k, v, 8)
            flex.block_sparse_attention(q, kv, *kernel_indices(mask, kv.block_ids(), kv.num_blocks))
    assert flex.compiled_entries() == 10


# ---------------------------------------------------------------------------- bench kernel


def test_bench_kernel_plumbing_on_cpu(tmp_path):
    """`sparsp bench kernel` on CPU with a tiny shape (torch kernel): a result file of kind
    `kernel` with the documented row fields, dense rows included, and its PNG."""
    from sparsp.cli import main

    rc = main(["bench", "kernel", "--device", "cpu", "--shape", "96x160x2x16", "--block-size", "32",
               "--density", "0.5", "--cdf", "0.9", "--warmup", "1", "--iters", "10",
               "--out", str(tmp_path)])
    assert rc == 0
    files = list(tmp_path.glob("kernel-all-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    assert doc["kind"] == "kernel"
    rows = doc["rows"]
    fields = {"kernel", "head_dim", "density", "ms", "tflops_kept", "vs_cudnn", "vs_best_dense"}
    assert all(fields <= set(r) for r in rows)
    dense = [r for r in rows if r["mask"] == "dense"]
    sparse = [r for r in rows if r["mask"] != "dense"]
    assert dense and {r["mask"] for r in sparse} == {"cdf 0.9", "random 0.5"}
    assert all(r["head_dim"] == 16 for r in rows)
    # each rate is its row's kept FLOPs over its time (4 significant digits each): what the
    # clock says cancels out of the product; a dense row keeps every pair of 96 x 160 tokens
    assert all(r["tflops_kept"] * r["ms"] * 1e9 == pytest.approx(4.0 * 96 * 160 * 16 * 2, rel=1e-3)
               for r in dense)
    assert all(0 < r["density"] <= 1 for r in rows)
    assert all(r["vs_best_dense"] is not None for r in rows)
    assert max(r["vs_best_dense"] for r in dense) == pytest.approx(1.0)
    assert files[0].with_suffix(".png").exists()


@pytest.mark.skipif(not flex.FLEX_AVAILABLE, reason="flex_attention not in this torch")
def test_flex_outside_its_limits_runs_the_torch_kernel(monkeypatch):
    """A head dim under 16, or a block size flex's compile refuses (remembered after the first
    refusal), runs the torch kernel with one warning; any other error propagates."""
    from sparsp.kernels import torch_ref

    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise ValueError("Q and KV block size must be divisible by BLOCK_M and BLOCK_N. We got 8")

    monkeypatch.setattr(flex, "_flex_call", refuse)
    monkeypatch.setattr(flex, "_WARNED", set())
    for D, refused in ((8, False), (16, True)):
        q, k, v, mask, _ = shard_case(5, 1, 2, 24, 24, D, 8)
        kv = LocalKV(k, v, 8)
        num, idx = kernel_indices(mask, kv.block_ids(), kv.num_blocks)
        want = torch_ref.block_sparse_attention(q, kv, num, idx)
        with pytest.warns(RuntimeWarning, match="running the torch kernel instead"):
            got = flex.block_sparse_attention(q, kv, num, idx)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert len(calls) == int(refused)  # a head dim under 16 never reaches flex
    flex.block_sparse_attention(q, kv, num, idx)  # the refusal is remembered: no second try
    assert len(calls) == 1
    assert "flex's tile" in flex.unsupported_reason(q, 8)
    monkeypatch.setattr(flex, "_flex_call", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    q, k, v, mask, _ = shard_case(5, 1, 2, 32, 32, 16, 16)
    kv = LocalKV(k, v, 16)
    num, idx = kernel_indices(mask, kv.block_ids(), kv.num_blocks)
    with pytest.raises(RuntimeError, match="other"):
        flex.block_sparse_attention(q, kv, num, idx)
    flex._REFUSED.clear()
