"""sparsp's Triton kernels against the torch code they replace: the CDF selection
(``sparsp.cdf_select``) against the sort, the LSE merge (``kernels.merge``) against the eager one.

On a CPU machine the kernel runs in Triton's interpreter (``conftest`` turns it on), so its
logic — bisection over the probabilities' bits, ties taken in index order, at least one block,
``cdf`` ≥ 1 keeps all, rows of −inf — is checked here; on the GPU machine the same tests run
the compiled kernel. Masks must equal the sort's except in rows where some prefix mass lies
within float32 rounding of the threshold (summed by a tree there, a scan here).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from sparsp import cdf_select  # noqa: E402
from sparsp.masks import PooledBlocks, _select_sorted, select_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cuda":  # compiled on a GPU machine: part of its `-m gpu` run (scripts/gpu_check.sh)
    pytestmark = pytest.mark.gpu
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter was not switched on before Triton was imported",
                allow_module_level=True)


def _reference(scores: torch.Tensor, cdf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sort's mask, and per row whether a prefix mass is within rounding of its cdf."""
    mask = _select_sorted(scores, cdf, True, True)
    probs = torch.softmax(scores.double(), -1).nan_to_num(0.0)
    prefix = probs.sort(dim=-1, descending=True).values.cumsum(-1)
    close = ((prefix - cdf.double()[None, :, None, None]).abs() < 1e-5).any(-1)
    return mask, close


def _check(scores: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    got = cdf_select.select(scores.to(DEVICE), cdf.to(DEVICE)).cpu()
    want, close = _reference(scores, cdf)
    differ = (got != want).any(-1)
    assert not (differ & ~close).any(), f"rows differ away from the threshold: {differ.nonzero()[:5].tolist()}"
    assert got.any(-1).all(), "a row kept no block"
    return got


@pytest.mark.parametrize("cols", [1, 7, 144, 300])
def test_random_rows_match_the_sort(cols):
    g = torch.Generator().manual_seed(cols)
    scores = torch.randn(2, 4, 3, cols, generator=g) * 3
    _check(scores, torch.tensor([0.0, 0.5, 0.9, 1.0]))


def test_ties_are_taken_in_index_order():
    # quantized scores: many equal probabilities, the boundary inside a run of ties
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 3, (1, 3, 8, 40), generator=g).float()
    for cdf in (0.05, 0.2, 0.37, 0.5, 0.8):
        got = _check(scores, torch.full((3,), cdf))
        want, _ = _reference(scores, torch.full((3,), cdf))
        assert torch.equal(got, want)  # exact here: ties sum the same way on both sides
    flat = torch.zeros(1, 1, 1, 10)  # ten equal blocks: 0.1 each
    assert cdf_select.select(flat.to(DEVICE), torch.tensor([0.35], device=DEVICE)).cpu().sum() == 3


def test_near_ties_are_told_apart():
    # probabilities a few ulps apart: the bisection must end on the exact value, not near it
    scores = (torch.arange(40, dtype=torch.float32) * 1e-6).flip(0).expand(1, 2, 3, 40).contiguous()
    got = _check(scores, torch.tensor([0.51, 0.26]))
    assert (got[0, 0].sum(-1) == 20).all() and (got[0, 1].sum(-1) == 10).all()
    assert got[0, 0, :, :20].all()  # the largest (the first, here) are the kept ones


def test_empty_rows_and_excluded_columns():
    scores = torch.randn(1, 2, 4, 12)
    scores[0, 0, 1] = float("-inf")  # no similar key block at all: every block kept
    scores[0, 1, :, ::3] = float("-inf")  # excluded columns: probability 0
    got = _check(scores, torch.tensor([0.6, 0.6]))
    assert got[0, 0, 1].all()


def test_threshold_one_keeps_everything_and_zero_keeps_the_largest():
    scores = torch.randn(1, 2, 5, 33) * 4
    got = cdf_select.select(scores.to(DEVICE), torch.tensor([1.0, 0.0], device=DEVICE)).cpu()
    assert got[0, 0].all()
    assert torch.equal(got[0, 1], torch.nn.functional.one_hot(scores[0, 1].argmax(-1), 33).bool())


def test_bad_arguments():
    with pytest.raises(ValueError, match="one value per head"):
        cdf_select.select(torch.zeros(1, 2, 3, 4, device=DEVICE), torch.tensor([0.5], device=DEVICE))
    with pytest.raises(ValueError, match="MAX_COLS"):
        cdf_select.select(torch.zeros(1, 1, 1, cdf_select.MAX_COLS + 1, device=DEVICE),
                          torch.tensor([0.5], device=DEVICE))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), cols=st.integers(1, 70), scale=st.sampled_from([0.1, 1.0, 8.0]),
       cdf=st.sampled_from([0.0, 0.3, 0.85, 0.9, 0.95, 0.999, 1.0]))
def test_kept_set_is_the_top_mass(seed, cols, scale, cdf):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, 1, 4, cols, generator=g) * scale
    got = _check(scores, torch.tensor([cdf]))
    probs = torch.softmax(scores.double(), -1)
    for row, keep in zip(probs[0, 0], got[0, 0]):
        if cdf < 1.0 and keep.sum() > 1:  # the kept mass stays within the threshold ...
            assert row[keep].sum() <= cdf + 1e-5
        if (~keep).any():  # ... every kept block outweighs every dropped one
            assert row[keep].min() >= row[~keep].max()


@pytest.mark.skipif(DEVICE != "cuda", reason="select_blocks takes the kernel on CUDA only")
def test_select_blocks_takes_the_kernel_on_cuda():
    g = torch.Generator().manual_seed(3)
    pq = PooledBlocks(torch.randn(1, 3, 20, 16, generator=g).cuda(), None, None)
    pk = PooledBlocks(torch.randn(1, 3, 50, 16, generator=g).cuda(), None, None)
    assert cdf_select.available(torch.zeros(1, 1, 1, 50, device="cuda"))
    got = select_blocks(pq, pk, cdf_threshold=0.9).cpu()
    scores = (pq.mean @ pk.mean.transpose(-1, -2) * 16**-0.5).cpu()
    want, close = _reference(scores, torch.full((3,), 0.9))
    assert not ((got != want).any(-1) & ~close).any()


# --- the Triton LSE merge (kernels.merge): the same interpreter / GPU arrangement ------------


def _partials(B, H, S, D, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    la, lb = torch.randn(B, H, S, generator=g) * 3, torch.randn(B, H, S, generator=g) * 3
    la[0, 0, :2] = float("-inf")  # empty on one side
    lb[0, 0, 1:3] = float("-inf")  # empty on both sides at row 1
    return a, la, b, lb


@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's log(0) = −inf: intended
@pytest.mark.parametrize("shape", [(1, 2, 5, 4), (2, 3, 70, 24), (1, 1, 129, 64)])
def test_triton_merge_equals_the_reference(shape):
    from sparsp.kernels import merge

    a, la, b, lb = _partials(*shape, seed=sum(shape))
    want_out, want_lse = merge.update_out_and_lse(a.bfloat16().float(), la, b.bfloat16(), lb)
    a, la, b, lb = (t.to(DEVICE) for t in (a, la, b, lb))
    out = torch.empty(a.shape, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(la.shape, dtype=torch.float32, device=DEVICE)
    merge._launch(a.bfloat16(), la, b.bfloat16(), lb, out, lse)  # head-major, fp32 (merge_pair)
    assert torch.allclose(out.cpu(), want_out, atol=1e-5)
    assert torch.equal(lse.isneginf().cpu(), want_lse.isneginf())
    finite = ~want_lse.isneginf()
    assert torch.allclose(lse.cpu()[finite], want_lse[finite], atol=1e-5)
    B, H, S, D = shape
    final = torch.empty(B, S, H, D, dtype=torch.bfloat16, device=DEVICE)
    # token-major in the caller's dtype (merge_final), from a head slice of wider partials
    merge._launch(a.bfloat16(), la, b.bfloat16(), lb, final.permute(0, 2, 1, 3), None)
    assert torch.allclose(final.cpu().float(), want_out.permute(0, 2, 1, 3), atol=1e-2, rtol=1e-2)  # bf16 rounding
    wide = torch.zeros(B, H + 2, S, D, device=DEVICE)
    wide_lse = torch.zeros(B, H + 2, S, device=DEVICE)
    merge._launch(a, la, b, lb, wide[:, 1:H + 1], wide_lse[:, 1:H + 1])
    assert (wide[:, 0] == 0).all() and (wide[:, H + 1] == 0).all()
    assert torch.allclose(wide[:, 1:H + 1].cpu(), merge.update_out_and_lse(a.cpu(), la.cpu(), b.cpu(), lb.cpu())[0], atol=1e-5)
    # in place over the first partial (``fold``: a kernel's short-block call into its main one)
    a2, la2 = a.clone(), la.clone()
    merge._launch(a2, la2, b, lb, a2, la2)
    assert torch.allclose(a2.cpu(), want_out, atol=1e-2, rtol=1e-2)  # b was bf16 above, fp32 here
    assert torch.equal(la2.isneginf().cpu(), want_lse.isneginf())


@pytest.mark.skipif(DEVICE != "cuda", reason="merge_pair / merge_final take Triton on CUDA only")
def test_merge_entry_points_take_triton_on_cuda():
    from sparsp.kernels import merge

    a, la, b, lb = (t.cuda() for t in _partials(1, 4, 300, 128, seed=5))
    out, lse = merge.merge_pair(a.bfloat16(), la, b.bfloat16(), lb)
    want_out, want_lse = merge._pair(a.bfloat16(), la, b.bfloat16(), lb)
    assert torch.allclose(out, want_out, atol=1e-5)
    final = merge.merge_final(a.bfloat16(), la, b.bfloat16(), lb, torch.bfloat16)
    assert final.shape == (1, 300, 4, 128) and final.is_contiguous()
    assert torch.allclose(final.float(), want_out.permute(0, 2, 1, 3), atol=1e-2, rtol=1e-2)  # bf16 rounding
    # the fp32 accumulator's merge takes the same kernel on CUDA
    acc = merge.update_out_and_lse(a, la, b.bfloat16(), lb)
    assert acc[0].dtype == torch.float32 and torch.allclose(acc[0], merge._pair(a, la, b.bfloat16(), lb)[0], atol=1e-5)
    # fold: a kernel's (BH, S, D) partials, token-major storage as FA4 returns them, merged in place
    store = a[0].bfloat16().transpose(0, 1).contiguous()  # (S, BH, D)
    main, main_lse = store.transpose(0, 1), la[0].clone()
    want = merge._pair(main[None], main_lse[None], b[0][None].bfloat16(), lb[0][None])
    got, got_lse = merge.fold(main, main_lse, b[0].bfloat16(), lb[0])
    assert got.data_ptr() == store.data_ptr() and got_lse.data_ptr() == main_lse.data_ptr()
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want[0][0], atol=1e-2, rtol=1e-2)  # bf16 rounding
    finite = ~want[1][0].isneginf()
    assert torch.allclose(got_lse[finite], want[1][0][finite], atol=1e-5)


# --- the pack's Triton gather (packing.gather_rows) ----------------------------------------


@pytest.mark.parametrize("D", [8, 64, 100])
def test_triton_gather_equals_index_select(D):
    from sparsp.packing import gather_rows

    g = torch.Generator().manual_seed(D)
    k, v = torch.randn(2, 50, 3, D, generator=g), torch.randn(2, 50, 3, D, generator=g)
    rows = torch.randint(0, 2 * 50 * 3, (137,), generator=g)
    out = torch.full((2 * 137 + 5, D), 7.0)  # a longer buffer: nothing past the payload is touched
    gather_rows(k.to(DEVICE), v.to(DEVICE), rows.to(DEVICE), out_d := out.to(DEVICE))
    got = out_d.cpu()
    assert torch.equal(got[:137], k.reshape(-1, D)[rows])
    assert torch.equal(got[137:274], v.reshape(-1, D)[rows])
    assert (got[274:] == 7.0).all()


# --- the kernels' block lists (kernels.buffer.compact_rows) ---------------------------------


@pytest.mark.parametrize("width", [37, 50])
def test_triton_compact_equals_the_torch_lists(width):
    from sparsp.kernels.buffer import compact_indices, compact_rows

    g = torch.Generator().manual_seed(width)
    whole = torch.rand(2, 3, 5, 60, generator=g) < 0.4
    keep = whole[..., 10:47]  # a column slice of a wider mask, as Call.rows_for gives
    keep[0, 0, 0] = False  # an empty list
    keep[1, 2, 4] = True  # a full one
    ids = (torch.arange(37) * 2 + 1).view(1, 1, 1, 37).expand(2, 3, 1, 37)
    want_num, want_idx = compact_indices(keep, ids, width)  # CPU: the torch form
    num, idx = compact_rows(keep.to(DEVICE), ids.to(DEVICE).expand(2, 3, 5, 37), width)
    assert torch.equal(num.cpu(), want_num) and torch.equal(idx.cpu(), want_idx)
    assert num[0, 0, 0] == 0 and num[1, 2, 4] == 37


# --- the payload layouts (packing.prepare_fused) -------------------------------------------


@pytest.mark.parametrize("S, bs, units, heads", [(64, 16, 0, 3), (61, 16, 0, 3), (45, 8, 3, 2),
                                                 (130, 32, 2, None), (7, 8, 0, 4)])
def test_triton_layout_equals_the_torch_layout(S, bs, units, heads):
    import math

    from sparsp.packing import prepare, prepare_fused

    B, H = 2, 3
    n = math.ceil(S / bs)
    g = torch.Generator().manual_seed(S + units)
    shape = (units, B * H, n) if units else (B * H, n)
    selected = torch.rand(*shape, generator=g) < 0.5
    selected.view(-1, n)[0] = False  # a row that selects nothing
    selected.view(-1, n)[-1] = True  # one that selects everything, the short block included
    want = prepare(selected, S, bs, heads=heads)  # CPU: the torch form
    got = prepare_fused(selected.to(DEVICE), S, bs, heads=heads)
    pairs = list(zip(want.unbind(), got.unbind())) if units else [(want, got)]
    for w, o in pairs:
        counts = (int(w.num_selected), int(w.num_short))
        assert (int(o.num_selected), int(o.num_short)) == counts
        a, b = w.finish(*counts), o.finish(*counts)
        assert torch.equal(a.block_ids, b.block_ids.cpu()), "ids"
        assert torch.equal(a.block_start, b.block_start.cpu()) and torch.equal(a.block_len, b.block_len.cpu())
        assert (a.num_rows, a.num_aligned) == (b.num_rows, b.num_aligned)
        if heads is None:
            assert b.rows is None
        else:
            assert torch.equal(a.rows, b.rows.cpu()), "token rows"


def test_triton_layout_checks_its_size():
    from sparsp.packing import LAYOUT_MAX_BLOCKS, prepare_fused

    with pytest.raises(ValueError, match="blocks per selection"):
        prepare_fused(torch.zeros(1, LAYOUT_MAX_BLOCKS + 1, dtype=torch.bool, device=DEVICE), 16, 16)


# --- strategy="auto"'s demand figures in one pass (demand.rank_figures) ----------------------


@pytest.mark.parametrize("lens, batch, density", [((300, 256), 1, 0.3), ((256, 200, 130), 2, 0.3),
                                                  ((128, 64, 200, 70), 1, 0.5), ((192, 64), 2, 0.0),
                                                  ((100, 160, 64), 1, 1.0)])
def test_column_figures_equal_the_torch_figures(lens, batch, density):
    from sparsp.cost.figures import Blocks, _column_figures, demand_figures

    blocks = Blocks.of_call(lens, 64)  # short tail blocks included
    N, H = len(blocks.lengths), 3
    g = torch.Generator().manual_seed(sum(lens))
    masks = torch.rand(batch * H, N, N, generator=g) < density
    masks[0, 0] = False  # a query block that keeps nothing
    want = demand_figures(masks, blocks, batch=batch)  # CPU: the torch form
    dev_blocks = Blocks.of_call(lens, 64, device=DEVICE)
    got = _column_figures(masks.to(DEVICE), dev_blocks, batch).cpu()
    assert got.dtype == want.dtype and torch.equal(got, want)


# --- the metadata's block sums (masks.summaries_into) ------------------------------------


@pytest.mark.parametrize("S, bs, dtype", [(300, 64, torch.bfloat16), (256, 128, torch.float32),
                                          (37, 16, torch.float16), (130, 50, torch.bfloat16)])
def test_triton_sums_equal_the_torch_sums(S, bs, dtype):
    """q's and k's block sums (short last blocks and blocks that are no multiple of the kernel's
    token tile included), v's partial sums, from views of one fused projection (free batch and
    sequence strides), against ``masks.block_sums``' torch form."""
    from sparsp.masks import SUM_FEATURES, check_parts, summaries_into

    g = torch.Generator().manual_seed(S)
    B, H, D = 2, 3, 100  # H·D = 300: two feature chunks, the second partly live
    qkv = torch.randn(B, S, 3, H, D, generator=g).to(dtype)
    q, k, v = (qkv[:, :, i] for i in range(3))
    n = -(-S // bs)
    want = {}
    for name, x in (("q", q), ("k", k)):
        xf = x.float()
        want[name] = torch.stack([xf[:, j * bs: (j + 1) * bs].sum(1) for j in range(n)], 1)
    out = torch.full((2 * B * n * H * D + check_parts(B, n, H * D),), 7.0)
    summaries_into(out_d := out.to(DEVICE), bs, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    got = out_d.cpu()
    plane = B * n * H * D
    torch.testing.assert_close(got[:plane].view(B, n, H, D), want["q"], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[plane: 2 * plane].view(B, n, H, D), want["k"], rtol=1e-5, atol=1e-4)
    parts = got[2 * plane:].view(B, n, -(-H * D // SUM_FEATURES))
    torch.testing.assert_close(parts.sum(), v.float().sum(), rtol=1e-4, atol=1e-3)
    # one chunk's partial: its features of one block
    torch.testing.assert_close(parts[1, 0, 1], v[1, :bs].float().reshape(-1, H * D)[:, SUM_FEATURES:].sum(),
                               rtol=1e-4, atol=1e-3)


def test_triton_sums_alone_and_beside_others_agree_bit_for_bit():
    """A tensor summed alone (``block_sums``: ``pool_blocks``, ``split_mask``) gets the bits it
    gets in the metadata row beside q and v: the mask of the distributed call and of
    ``split_mask`` agree bit for bit."""
    from sparsp.masks import summaries_into

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 200, 4, 64, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(3))
    n, plane = 4, 4 * 4 * 64
    row = torch.empty(2 * plane + 4, device=DEVICE)
    summaries_into(row, 64, q, k, v)
    alone = torch.empty(plane, device=DEVICE)
    summaries_into(alone, 64, k)
    assert torch.equal(row[plane: 2 * plane], alone)
    summaries_into(alone, 64, q)
    assert torch.equal(row[:plane], alone)


def test_triton_sums_read_through_a_table_equal_the_direct_launch():
    """``summaries_into(..., table=)`` (the launch a CUDA graph replays for new tensors:
    ``plan._graphed_summaries``) reads q, k, v at the table's offsets and writes the same bits as
    the launch on the tensors themselves; rewriting the table moves it to other tensors of the
    same shape and strides, among them views of one fused projection."""
    from sparsp.masks import SumsTable, check_parts, summaries_into

    g = torch.Generator().manual_seed(5)
    B, S, H, D, bs = 2, 200, 4, 64, 64
    n = -(-S // bs)
    size = 2 * B * n * H * D + check_parts(B, n, H * D)
    table = SumsTable(torch.bfloat16, DEVICE)
    for trial in range(3):
        qkv = torch.randn(B, S, 3, H, D, generator=g).to(torch.bfloat16).to(DEVICE)
        q, k, v = (qkv[:, :, i] for i in range(3))
        if trial == 2:  # separate tensors, other strides than the fused views'
            q, k, v = (x.contiguous() for x in (q, k, v))
        assert table.fits(q, k, v)
        want = torch.empty(size, device=DEVICE)
        summaries_into(want, bs, q, k, v)
        got = torch.full((size,), 7.0, device=DEVICE)
        table.set(q, k, v)
        table.upload()
        summaries_into(got, bs, q, k, v, table=table)
        assert torch.equal(got, want)
    # k alone (no b, no c): the table's unused entries repeat a's offset
    alone, want = torch.empty(B * n * H * D, device=DEVICE), torch.empty(B * n * H * D, device=DEVICE)
    table.set(k)
    table.upload()
    summaries_into(alone, bs, k, table=table)
    summaries_into(want, bs, k)
    assert torch.equal(alone, want)
    assert not table.fits(q.float()) and not table.fits(q.reshape(-1)[1:])  # dtype, 16-byte alignment


def test_triton_sums_flag_a_nonfinite_v_and_check_their_arguments():
    from sparsp.masks import summaries_into

    q = torch.zeros(1, 40, 2, 8, device=DEVICE)
    v = q.clone()
    v[0, 33, 1, 5] = float("nan")
    out = torch.empty(2 * 3 * 16 + 3, device=DEVICE)
    summaries_into(out, 16, q, q, v)
    assert torch.isnan(out[-1]) and torch.isfinite(out[:-1]).all()  # the last block's partial
    with pytest.raises(ValueError, match="float32 output of 99 values"):
        summaries_into(torch.empty(5, device=DEVICE), 16, q, q, v)
    with pytest.raises(ValueError, match="shapes differ"):
        summaries_into(out, 16, q, q[:, :30], v)


def test_one_switch_turns_every_kernel_off(monkeypatch):
    """``SPARSP_TRITON=0`` is the one switch: ``_triton.settings`` (part of a captured plan
    stage's key, ``strategies/captured.py``) follows it, ``runs`` answers False for every tensor
    under it, and every kernel asks ``runs(t)`` with one argument (no per-kernel switch left)."""
    import pathlib
    import re

    from sparsp import _triton

    monkeypatch.delenv("SPARSP_TRITON", raising=False)
    assert _triton.settings() == (True,)
    monkeypatch.setenv("SPARSP_TRITON", "1")
    assert _triton.settings() == (True,)
    monkeypatch.setenv("SPARSP_TRITON", "0")
    assert _triton.settings() == (False,)  # a graph captured with the kernels is not replayed
    assert not _triton.runs(torch.zeros(1, device=DEVICE))
    src = pathlib.Path(_triton.__file__).parent
    calls = [c for p in src.rglob("*.py") for c in re.findall(r"\bruns\(([^()]*)\)", p.read_text())
             if not p.name == "_triton.py"]
    assert calls and all("," not in c for c in calls), calls
