"""The packed order of K/V blocks in a payload, derived identically on both ends (paper §5.2).

A payload holds some selected blocks of ONE rank's shard: K rows, then V rows. Buffer block
ids follow the canonical order (``sparsp.kernels.canonical_block_ids``): every full selected
block in row-major (batch·head, block) order, then the short tail blocks, so full blocks sit at
multiples of ``block_size``. Producer and consumer call ``layout`` on the same (exchanged or
derived) selection and get the same offsets from prefix sums: nothing but payload bytes ever
crosses the wire.

Blocks: each rank's slice is cut into ``block_size`` tokens from its own start; only a slice's
last block may be short (``sparsp.placement`` guarantees that for placed sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.buffer import canonical_block_ids

from ._triton import runs, tl, triton
from .caches import per_geometry

__all__ = ["Layout", "Pending", "gather_rows", "halves", "layout", "pack", "prepare", "prepare_fused"]


@dataclass(frozen=True)
class Layout:
    """The canonical packed order of some selected blocks of one rank's shard."""

    block_ids: torch.Tensor  # [BH, n] buffer id of each selected block, −1 elsewhere
    block_start: torch.Tensor  # [nb] first row of each buffer block
    block_len: torch.Tensor  # [nb] rows of each buffer block
    num_aligned: int  # full blocks (they come first, at j · block_size)
    num_rows: int  # K rows (= V rows) of the payload
    selected: torch.Tensor  # [BH, n] bool
    seq_len: int  # tokens of the owner's shard
    block_size: int
    rows: torch.Tensor | None = None  # token rows in packed order, when ``prepare`` made them

    @property
    def num_blocks(self) -> int:
        return self.block_start.numel()

    def token_rows(self, heads: int, source: "Layout | None" = None) -> torch.Tensor:
        """Source row of every packed row, in packed order.

        Without ``source``: rows of the owner's (B, S, H, ·) tensor flattened to (B·S·H, ·).
        With ``source``: rows of a payload packed in ``source``'s layout — a relay forwarding a
        subset of what it received (``source.selected`` must cover ``self.selected``).
        """
        if source is None and self.rows is not None:
            return self.rows
        bs, S = self.block_size, self.seq_len
        # nonzero_static: the count is known on the host (layout's counts), so no host sync
        bh, j = torch.nonzero_static(self.selected, size=self.num_blocks).unbind(1)
        order = torch.argsort(self.block_ids[bh, j])
        bh, j = bh[order], j[order]
        lens = self.block_len
        within = torch.arange(self.num_rows, device=lens.device) - torch.repeat_interleave(
            self.block_start, lens, output_size=self.num_rows)
        if source is not None:
            src_ids = source.block_ids[bh, j]
            if src_ids.device.type == "cpu":
                assert (src_ids >= 0).all(), "forwarding a block the relay never received"
            return torch.repeat_interleave(source.block_start[src_ids], lens,
                                           output_size=self.num_rows) + within
        s = torch.repeat_interleave(j * bs, lens, output_size=self.num_rows) + within
        b = torch.repeat_interleave(bh // heads, lens, output_size=self.num_rows)
        h = torch.repeat_interleave(bh % heads, lens, output_size=self.num_rows)
        return (b * S + s) * heads + h


_ARANGE = per_geometry("packing: index ranges")  # key -> Tensor


def _arange(n: int, device) -> torch.Tensor:
    """``arange(n)`` on ``device``, cached (capacity-sized index vectors of a geometry)."""
    key = (n, str(device))
    t = _ARANGE.get(key)
    if t is None:
        t = torch.arange(n, device=device)
        _ARANGE[key] = t
    return t


@dataclass(frozen=True)
class Pending:
    """A layout before its counts reach the host (``prepare``): everything that does not depend
    on them, made at the selection's capacity (every block selected) on the device, so that
    the call's host synchronisation is followed by slicing only. ``num_selected`` and
    ``num_short`` are the 0-dim device counts the caller copies to the host. Made from stacked
    selections, every tensor has their leading dimension (``unbind`` splits it)."""

    ids: torch.Tensor
    starts: torch.Tensor  # [BH·n] capacity
    lens: torch.Tensor
    rows: torch.Tensor | None  # [BH·n·block_size] capacity token rows (producer side)
    num_selected: torch.Tensor
    num_short: torch.Tensor
    selected: torch.Tensor
    seq_len: int
    block_size: int

    def unbind(self) -> list["Pending"]:
        """One ``Pending`` per stacked selection (views: no kernel)."""
        parts = zip(self.ids, self.starts, self.lens, self.num_selected, self.num_short, self.selected,
                    self.rows if self.rows is not None else [None] * self.ids.shape[0])
        return [Pending(ids, starts, lens, rows, n_sel, n_short, sel, self.seq_len, self.block_size)
                for ids, starts, lens, n_sel, n_short, sel, rows in parts]

    def finish(self, n_sel: int, n_short: int) -> Layout:
        """The ``Layout`` for the host counts (views of the capacity tensors: no kernel)."""
        n_full = n_sel - n_short
        tail_len = self.seq_len - (self.selected.shape[1] - 1) * self.block_size
        num_rows = n_full * self.block_size + n_short * tail_len
        rows = None if self.rows is None else self.rows[:num_rows]
        return Layout(self.ids, self.starts[:n_sel], self.lens[:n_sel], n_full, num_rows,
                      self.selected, self.seq_len, self.block_size, rows)


def prepare(selected: torch.Tensor, seq_len: int, block_size: int, *, heads: int | None = None) -> Pending:
    """Everything of ``layout`` that needs no host count; with ``heads`` also the token rows
    the producer packs (``Layout.token_rows``), made from the inverse of the block ids.

    ``selected``: bool [BH, n], or [U, BH, n] for U selections of one shard at once (a
    payload's head-group units: the same number of kernels as one, ``Pending.unbind``).

    On CUDA two Triton kernels make all of it (``prepare_fused``: ~20 torch kernels for a
    layout, ~25 more for its token rows, each a node of the captured plan stage)."""
    if _layout_ok(selected):
        return prepare_fused(selected, seq_len, block_size, heads=heads)
    *lead, BH, n = selected.shape
    tail = seq_len % block_size != 0
    device = selected.device
    ids = canonical_block_ids(selected, tail)
    tail_len = seq_len - (n - 1) * block_size
    n_sel = selected.sum((-2, -1))
    n_short = selected[..., -1].sum(-1) if tail else torch.zeros(lead, dtype=torch.long, device=device)
    n_full = n_sel - n_short
    if lead:  # [U, 1]: against the capacity positions
        n_full = n_full.unsqueeze(-1)
    cap = BH * n
    pos = _arange(cap, device)
    full = pos < n_full
    starts = torch.where(full, pos * block_size, n_full * block_size + (pos - n_full) * tail_len)
    lens = torch.where(full, block_size, tail_len)
    rows = None
    if heads is not None:
        # inverse of the ids: the flat (bh, j) of every buffer block (slot ``cap`` takes the
        # blocks that are not selected)
        inv = torch.zeros(*lead, cap + 1, dtype=torch.long, device=device)
        inv.scatter_(-1, torch.where(selected, ids, cap).reshape(*lead, cap), pos.expand(*lead, cap) if lead else pos)
        r = _arange(cap * block_size, device)
        in_full = r < n_full * block_size
        rr = r - n_full * block_size
        blk = torch.where(in_full, r // block_size, n_full + rr // tail_len).clamp_(max=cap)
        off = torch.where(in_full, r % block_size, rr % tail_len)
        src = inv.gather(-1, blk)
        bh, j = src // n, src % n
        rows = ((bh // heads) * seq_len + j * block_size + off) * heads + bh % heads
    return Pending(ids, starts, lens, rows, n_sel, n_short, selected, seq_len, block_size)


LAYOUT_MAX_BLOCKS = 32768
"""The most blocks (B·H·n) one selection may have for the Triton layout kernel, whose one program
holds a whole selection's prefix sums in registers (LTX-Video at G = 2: 2,304; HunyuanVideo and
Wan 2.1: ~11,900); larger ones take the torch ops."""

if triton is not None:
    @triton.jit
    def _layout(sel_ptr, ids_ptr, starts_ptr, lens_ptr, inv_ptr, counts_ptr, cap, n, bs, tail_len,
                TAIL: tl.constexpr, INV: tl.constexpr, BLOCK: tl.constexpr):
        # one program: one selection [B·H, n] flattened row-major (``canonical_block_ids``'s
        # order: full blocks by their prefix count, then the short last column's after them)
        u = tl.program_id(0).to(tl.int64)
        pos = tl.arange(0, BLOCK).to(tl.int64)
        inside = pos < cap
        sel = tl.load(sel_ptr + u * cap + pos, mask=inside, other=0) != 0
        if TAIL:
            last = (pos % n) == n - 1
            full = sel & (last == 0)
            short = sel & last
        else:
            full = sel
            short = sel & (pos < 0)
        f = full.to(tl.int64)
        sh = short.to(tl.int64)
        n_full = tl.sum(f, 0)
        n_short = tl.sum(sh, 0)
        ids = tl.where(full, tl.cumsum(f, 0) - 1, tl.where(short, tl.cumsum(sh, 0) - 1 + n_full, -1))
        tl.store(ids_ptr + u * cap + pos, ids, mask=inside)
        first = pos < n_full
        tl.store(starts_ptr + u * cap + pos,
                 tl.where(first, pos * bs, n_full * bs + (pos - n_full) * tail_len), mask=inside)
        tl.store(lens_ptr + u * cap + pos, tl.where(first, bs, tail_len), mask=inside)
        tl.store(counts_ptr + 2 * u, n_full + n_short)
        tl.store(counts_ptr + 2 * u + 1, n_short)
        if INV:  # buffer block -> flat (bh, j): the token rows' source (slots past the count unused)
            tl.store(inv_ptr + u * cap + ids, pos, mask=inside & sel)

    @triton.jit
    def _token_rows(inv_ptr, counts_ptr, rows_ptr, cap, n, bs, tail_len, heads, seq_len,
                    BLOCK: tl.constexpr):
        # program (i, u): BLOCK capacity rows of selection u; rows past its count are never read
        u = tl.program_id(1).to(tl.int64)
        r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = r < cap * bs
        n_full = tl.load(counts_ptr + 2 * u) - tl.load(counts_ptr + 2 * u + 1)
        in_full = r < n_full * bs
        rr = tl.where(in_full, 0, r - n_full * bs)
        blk = tl.minimum(tl.where(in_full, r // bs, n_full + rr // tail_len), cap - 1)
        off = tl.where(in_full, r % bs, rr % tail_len)
        src = tl.load(inv_ptr + u * cap + blk, mask=inside, other=0)
        bh = src // n
        j = src % n
        tl.store(rows_ptr + u * cap * bs + r, ((bh // heads) * seq_len + j * bs + off) * heads + bh % heads,
                 mask=inside)


def _layout_ok(selected: torch.Tensor) -> bool:
    return (runs(selected) and selected.dim() in (2, 3)
            and 0 < selected.shape[-2] * selected.shape[-1] <= LAYOUT_MAX_BLOCKS)


def prepare_fused(selected: torch.Tensor, seq_len: int, block_size: int, *, heads: int | None = None) -> Pending:
    """``prepare`` as two Triton kernels: the ids, starts, lengths and counts of every selection
    in one program each (prefix sums in registers), then the token rows (with ``heads``).
    Equal to the torch form on every row the layout uses. CUDA; on CPU tensors in Triton's
    interpreter. ``selected`` bool [BH, n] or [U, BH, n], at most ``LAYOUT_MAX_BLOCKS`` blocks
    each."""
    *lead, BH, n = selected.shape
    units = lead[0] if lead else 1
    cap = BH * n
    if not 0 < cap <= LAYOUT_MAX_BLOCKS:
        raise ValueError(f"prepare_fused takes 1 to {LAYOUT_MAX_BLOCKS} blocks per selection, got {cap}")
    device = selected.device
    tail = seq_len % block_size != 0
    tail_len = seq_len - (n - 1) * block_size
    sel = selected.contiguous().view(torch.uint8)
    ids = torch.empty(*lead, BH, n, dtype=torch.long, device=device)
    starts = torch.empty(*lead, cap, dtype=torch.long, device=device)
    lens = torch.empty(*lead, cap, dtype=torch.long, device=device)
    counts = torch.empty(*lead, 2, dtype=torch.long, device=device)
    inv = torch.empty(*lead, cap, dtype=torch.long, device=device) if heads is not None else ids
    block = triton.next_power_of_2(cap)
    _layout[(units,)](sel, ids, starts, lens, inv, counts, cap, n, block_size, tail_len,
                      TAIL=tail, INV=heads is not None, BLOCK=block,
                      num_warps=min(32, max(4, block // 512)))  # ≤ 16 blocks per thread
    rows = None
    if heads is not None:
        rows = torch.empty(*lead, cap * block_size, dtype=torch.long, device=device)
        block = 1024
        _token_rows[(triton.cdiv(cap * block_size, block), units)](
            inv, counts, rows, cap, n, block_size, tail_len, heads, seq_len, BLOCK=block)
    return Pending(ids, starts, lens, rows, counts[..., 0], counts[..., 1], selected, seq_len, block_size)


def layout(selected: torch.Tensor, seq_len: int, block_size: int,
           counts: tuple[int, int] | None = None, *, heads: int | None = None) -> Layout:
    """The packed layout of ``selected`` (bool [BH, n]) — the same on both ends.

    ``counts`` = (selected blocks, selected short blocks) when the caller already knows them
    on the host (``sparsp.plan`` copies every count of a call to the host at once); without
    them they are read from ``selected``, a host synchronisation on GPU. ``heads``: also make
    the producer's token rows (``prepare``).
    """
    pending = prepare(selected, seq_len, block_size, heads=heads)
    if counts is None:
        counts = (int(pending.num_selected), int(pending.num_short))
    return pending.finish(*counts)


def pack(k: torch.Tensor, v: torch.Tensor, lay: Layout, heads: int, out: torch.Tensor,
         source: Layout | None = None) -> int:
    """Gather the selected blocks into the flat ``out``: K rows, then V rows, in packed order.

    ``k, v`` are the owner's (B, S, H, D) tensors, or with ``source`` the [rows, D] halves of a
    payload packed in that layout (a relay forwarding a subset). Returns the elements written
    (``2 · rows · D``).
    """
    D = k.shape[-1]
    rows = lay.token_rows(heads, source).to(k.device)
    n = lay.num_rows * D
    if _gather_ok(k, v):
        gather_rows(k, v, rows, out[: 2 * n])
        return 2 * n
    torch.index_select(k.reshape(-1, D), 0, rows, out=out[:n].view(-1, D))
    torch.index_select(v.reshape(-1, D), 0, rows, out=out[n: 2 * n].view(-1, D))
    return 2 * n


if triton is not None:
    @triton.jit
    def _gather(k_ptr, v_ptr, rows_ptr, out_ptr, n_rows, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program: BLOCK_R payload rows of K and the same of V, each a whole head-dim row
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < n_rows
        src = tl.load(rows_ptr + r, mask=live, other=0)
        d = tl.arange(0, BLOCK_D)
        tile = live[:, None] & (d < D)[None, :]
        at = src[:, None] * D + d[None, :]
        tl.store(out_ptr + r[:, None] * D + d[None, :], tl.load(k_ptr + at, mask=tile), mask=tile)
        tl.store(out_ptr + (n_rows + r)[:, None] * D + d[None, :], tl.load(v_ptr + at, mask=tile), mask=tile)


def _gather_ok(k: torch.Tensor, v: torch.Tensor) -> bool:
    return runs(k) and k.is_contiguous() and v.is_contiguous()


def gather_rows(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` = K rows then V rows of contiguous ``k, v`` (any shape, last dim D) at the row
    indices ``rows`` (int64 into ``k.reshape(-1, D)``): ``pack``'s two ``index_select`` in one
    Triton kernel that keeps tiles of whole rows in flight (the ATen gather moved 0.4 TB/s on
    an H200 at LTX-Video's 128-byte rows). CUDA; on CPU tensors in Triton's interpreter."""
    D = k.shape[-1]
    n_rows = rows.numel()
    if n_rows == 0:
        return
    block_d = triton.next_power_of_2(D)
    block_r = max(1, 8192 // block_d)
    _gather[(triton.cdiv(n_rows, block_r),)](k, v, rows, out, n_rows, D, BLOCK_R=block_r, BLOCK_D=block_d)


def halves(flat: torch.Tensor, lay: Layout, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V row blocks [rows, D] of a payload packed in ``lay``."""
    n = lay.num_rows * head_dim
    return flat[:n].view(-1, head_dim), flat[n: 2 * n].view(-1, head_dim)
