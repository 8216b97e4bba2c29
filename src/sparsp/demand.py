"""Demand sets and the exact bytes each strategy moves — analysis only, no communication.

Notation (paper §4.1): for consumer rank r, head h and producer peer p ≠ r,

    D[r, h, p] = { kb : owner(kb) = p  and  some query block qb of r has M[h, qb, kb] }.

Demand stays per head (§5.2: the union over heads is nearly dense). Bytes count K and V of the
real tokens of every block: ``2 · tokens · head_dim · dtype_bytes``. All numbers are bytes
*received* per rank; every strategy's total is the sum over ranks.

Byte rules (``BYTE_RULES``; each strategy names its rule when it registers, see
``sparsp.strategies.registry``; ``sparsp.strategies.comm_bytes`` takes a strategy name):

* ``full-shards`` every rank receives every other full shard (``ring``, ``ring-sparse``).
* ``relay``       relay ring with selective KV (§3.3, §5.1's conventional routing): at hop k
                  rank r receives from r−1 the blocks of origin p = r−k that any consumer still
                  downstream (r, r+1, …, p−1) needs (``ring-relay``).
* ``direct``      direct owner→consumer: rank r receives exactly ∪_p D[r, ·, p] (``sparsp``).
* ``all-to-all``  Q, K, V (sequence → heads) and the output back (``ulysses``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .placement import Placement

from ._triton import runs, tl, triton

def _check_masks(masks: torch.Tensor, placement: Placement) -> torch.Tensor:
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a sparsp.placement.Placement, got {type(placement).__name__}")
    n = placement.geometry.num_blocks
    if not isinstance(masks, torch.Tensor):
        raise ValueError(f"masks must be bool [heads, {n}, {n}] in original block order, got {type(masks).__name__}")
    if masks.dim() != 3 or masks.shape[1:] != (n, n):
        raise ValueError(f"masks must be bool [heads, {n}, {n}] in original block order, got {tuple(masks.shape)}")
    return masks.bool()


def remote_demand(mask: torch.Tensor, owner: torch.Tensor, ranks: int,
                  rows: list[slice] | None = None) -> torch.Tensor:
    """The demand of every rank: bool [G, *lead, nB] from a block mask [*lead, nB, nB].

    ``owner`` [nB]: the rank of every block (rows and columns alike). ``out[r, ..., kb]``: some
    query block of rank r keeps key block kb, and kb is remote to r. D[r, ·, p] is
    ``out[r] & (owner == p)``. The one demand function: the strategies call it on the call's
    mask (placed order, ``rows`` given), ``comm_bytes`` on analysis masks (original order).
    """
    owner = owner.to(mask.device)
    if rows is None:  # boolean row selection (a host sync on GPU; analysis runs on CPU)
        out = torch.stack([mask[..., owner == r, :].any(dim=-2) for r in range(ranks)])
    else:  # ``rows[r]``: rank r's rows as a slice (placed order at run time): no host sync
        out = torch.stack([mask[..., rows[r], :].any(dim=-2) for r in range(ranks)])
    remote = owner[None, :] != torch.arange(ranks, device=mask.device)[:, None]  # [G, nB]
    return out & remote.view(ranks, *([1] * (mask.dim() - 2)), -1)


def demand_sets(masks: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Bool [G, H, nB]: ``out[r, h, kb]`` — rank r needs remote block kb for head h.

    D[r, h, p] is ``out[r, h] & (owner == p)``; a rank never demands its own blocks.
    """
    masks = _check_masks(masks, placement)
    return remote_demand(masks, placement.owner, placement.ranks)


def block_bytes(placement: Placement, *, head_dim: int, dtype_bytes: int = 2) -> torch.Tensor:
    """LongTensor [nB]: K+V bytes of one head of every block (real token counts)."""
    return placement.geometry.block_lengths() * (2 * head_dim * dtype_bytes)


ByteRule = Callable[..., torch.Tensor]
"""``rule(masks, placement, *, head_dim, dtype_bytes) -> LongTensor [G]`` bytes received per rank
(``masks`` already checked: bool [heads, nB, nB], original block order)."""


def full_shard_bytes(masks, placement, *, head_dim, dtype_bytes) -> torch.Tensor:
    bb = block_bytes(placement, head_dim=head_dim, dtype_bytes=dtype_bytes)
    shard = torch.zeros(placement.ranks, dtype=torch.long).index_add_(0, placement.owner, bb)
    shard = shard * masks.shape[0]  # K+V, all heads
    return shard.sum() - shard


def direct_bytes(masks, placement, *, head_dim, dtype_bytes) -> torch.Tensor:
    bb = block_bytes(placement, head_dim=head_dim, dtype_bytes=dtype_bytes)
    return (demand_sets(masks, placement).cpu().long() * bb).sum(dim=(1, 2))


def relay_bytes(masks, placement, *, head_dim, dtype_bytes) -> torch.Tensor:
    """Relay ring: hop k into rank r carries origin p = r − k's blocks still needed downstream."""
    need = demand_sets(masks, placement).cpu()
    owner = placement.owner
    bb = block_bytes(placement, head_dim=head_dim, dtype_bytes=dtype_bytes)
    G = need.shape[0]
    per_rank = torch.zeros(G, dtype=torch.long)
    for p in range(G):
        mine = (owner == p)[None, :]
        # Walk consumers from the far end of the ring back to p+1, accumulating what any of
        # them (the receiver included) still needs: that is what the hop into it carries.
        downstream = torch.zeros_like(need[0])
        for k in range(G - 1, 0, -1):
            r = (p + k) % G
            downstream |= need[r] & mine
            per_rank[r] += (downstream.long() * bb).sum()
    return per_rank


def head_split(heads: int, ranks: int) -> list[int]:
    """Heads per rank under Ulysses (balanced; equal when ``heads % ranks == 0``)."""
    return [heads // ranks + (1 if i < heads % ranks else 0) for i in range(ranks)]


def all_to_all_bytes(masks, placement, *, head_dim, dtype_bytes) -> torch.Tensor:
    H = masks.shape[0]
    tokens = torch.tensor(placement.tokens_per_rank, dtype=torch.long)
    heads = torch.tensor(head_split(H, placement.ranks), dtype=torch.long)
    row = head_dim * dtype_bytes
    # In: Q, K, V of my heads for every other rank's tokens. Back: the output of every other
    # rank's heads for my tokens.
    qkv_in = 3 * (tokens.sum() - tokens) * heads * row
    out_back = tokens * (heads.sum() - heads) * row
    return qkv_in + out_back


BYTE_RULES: dict[str, ByteRule] = {
    "full-shards": full_shard_bytes,
    "relay": relay_bytes,
    "direct": direct_bytes,
    "all-to-all": all_to_all_bytes,
}


def comm_bytes(
    masks: torch.Tensor,
    placement: Placement,
    rule: str | ByteRule,
    *,
    head_dim: int,
    dtype_bytes: int = 2,
) -> dict:
    """Bytes received per rank under a byte ``rule`` (a name of ``BYTE_RULES`` or a function)
    → ``{"total": int, "per_rank": [int] * G}``.

    ``masks``: bool [heads, nB, nB] in original block order (fold a batch into heads).
    """
    if isinstance(rule, str):
        if rule not in BYTE_RULES:
            raise ValueError(f"unknown byte rule {rule!r}; choose one of {', '.join(BYTE_RULES)}")
        rule = BYTE_RULES[rule]
    for name, value in (("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    masks = _check_masks(masks, placement)
    per_rank = rule(masks, placement, head_dim=head_dim, dtype_bytes=dtype_bytes)
    per_rank = [int(x) for x in per_rank.tolist()]
    return {"total": sum(per_rank), "per_rank": per_rank}


# --- the paper's Figure 4 and Figure 5 ---------------------------------------------------------


def sharing_curve(masks: torch.Tensor, placement: Placement, xs: torch.Tensor | None = None):
    """Figure 4: share of remote K blocks used by ≥ x of the receiving rank's Q blocks.

    Returns ``(xs, ys)``: for every remote (rank, head, K block) a rank receives, the fraction of
    that rank's local Q blocks that read it; ``ys[i]`` is the share with fraction ≥ ``xs[i]``.
    """
    masks = _check_masks(masks, placement)
    xs = torch.linspace(0, 1, 21) if xs is None else xs
    owner = placement.owner
    fractions = []
    for r in range(placement.ranks):
        local = owner == r
        use = masks[:, local, :].float().mean(dim=1)  # [H, nB]
        remote = use[:, ~local]
        fractions.append(remote[remote > 0])
    f = torch.cat(fractions)
    if f.numel() == 0:
        return xs, torch.zeros_like(xs)
    return xs, (f[None, :] >= xs[:, None] - 1e-12).float().mean(dim=1)


@dataclass(frozen=True)
class Amplification:
    ranks: int
    relay_bytes: int
    direct_bytes: int

    @property
    def ratio(self) -> float:
        return self.relay_bytes / self.direct_bytes if self.direct_bytes else float("nan")


def relay_amplification(masks, placement_fn, geometry, ranks_list, *, head_dim, dtype_bytes=2):
    """Figure 5: relay-ring bytes over consumer demand (direct) bytes for each G."""
    out = []
    for G in ranks_list:
        pl = placement_fn(geometry, G)
        relay = comm_bytes(masks, pl, "relay", head_dim=head_dim, dtype_bytes=dtype_bytes)["total"]
        direct = comm_bytes(masks, pl, "direct", head_dim=head_dim, dtype_bytes=dtype_bytes)["total"]
        out.append(Amplification(G, relay, direct))
    return out


# --- strategy="auto"'s demand figures of a mask in one pass -----------------------------------


if triton is not None:
    @triton.jit
    def _rank_figures(m_ptr, bounds_ptr, len_ptr, out_ptr, N, H, G: tl.constexpr, MOST: tl.constexpr,
                      BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
        # one program: one (batch·head) row of masks and BLOCK_J key blocks, every rank's rows;
        # its shares of the figures are added into ``out`` (float64 holding integers below
        # 2^53: every sum is exact, in any order)
        bh = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        cols = j < N
        lj = tl.load(len_ptr + j, mask=cols, other=0).to(tl.float64)
        owner = tl.zeros([BLOCK_J], dtype=tl.int32) - 1  # the rank whose slice holds key block j
        for p in tl.static_range(G):
            owner = tl.where((j >= tl.load(bounds_ptr + 2 * p)) & (j < tl.load(bounds_ptr + 2 * p + 1)),
                             p, owner)
        head = tl.zeros([BLOCK_J], dtype=tl.float64)
        for r in tl.static_range(G):
            start = tl.load(bounds_ptr + 2 * r)
            end = tl.load(bounds_ptr + 2 * r + 1)
            acc = tl.zeros([BLOCK_J], dtype=tl.int32)
            hit = tl.zeros([BLOCK_J], dtype=tl.int32)
            for i0 in range(0, MOST, BLOCK_I):  # MOST: the longest rank's blocks
                i = start + i0 + tl.arange(0, BLOCK_I)
                rows = i < end
                m = tl.load(m_ptr + bh * N * N + i[:, None].to(tl.int64) * N + j[None, :],
                            mask=rows[:, None] & cols[None, :], other=0).to(tl.int32)
                length = tl.load(len_ptr + i, mask=rows, other=0).to(tl.int32)
                acc += tl.sum(m * length[:, None], axis=0)
                hit = tl.maximum(hit, tl.max(m, axis=0))
            pairs = acc.to(tl.float64) * lj  # r's kept (query token, key token) pairs per column
            need = hit.to(tl.float64) * lj  # tokens of the key blocks r's queries keep
            head += pairs
            for p in tl.static_range(G):
                mine = owner == p
                tl.atomic_add(out_ptr + r * G + p, tl.sum(tl.where(mine, pairs, 0.0), axis=0))
                if p != r:  # direct demand: remote blocks only
                    tl.atomic_add(out_ptr + G * G + r * G + p, tl.sum(tl.where(mine, need, 0.0), axis=0))
        tl.atomic_add(out_ptr + 2 * G * G + bh % H, tl.sum(head, axis=0))


def rank_figures_ok(masks: torch.Tensor) -> bool:
    """Whether ``rank_figures`` runs on ``masks``: CUDA, Triton importable, Triton kernels not
    switched off (``_triton.runs``)."""
    return runs(masks)


def rank_figures(masks: torch.Tensor, bounds: torch.Tensor, lengths: torch.Tensor, heads: int,
                 rows: tuple[slice, ...] | None = None) -> torch.Tensor:
    """``cost.figures.demand_figures`` (without ``relay``) of masks bool [BH, N, N], BH =
    batch·``heads`` batch-major, whose query rows are cut into G contiguous ranges ``bounds``
    (int32 [G, 2]: start, end; ``rows``, the same as slices on the host, bound the loop) and
    blocks of ``lengths`` tokens (int [N]): float64 [2G² + heads] — kept (query token, key token)
    pairs per (rank, owner), the key tokens each rank demands of each other rank, kept pairs per
    head — from one pass over the mask and one zeroed output (one Triton program per row and
    column strip, its shares added atomically: exact integer sums in float64). CUDA; CPU tensors
    in Triton's interpreter."""
    BH, N, _ = masks.shape
    G = bounds.shape[0]
    if BH % heads:
        raise ValueError(f"{BH} mask rows are not a whole number of batches of {heads} heads")
    out = torch.zeros(2 * G * G + heads, dtype=torch.float64, device=masks.device)
    if BH == 0 or N == 0:
        return out
    most = int(max(r.stop - r.start for r in rows)) if rows is not None else N
    block_j = min(128, triton.next_power_of_2(N))
    m = masks.contiguous().view(torch.uint8)
    # G and the longest rank are compile-time: one compile per group size and geometry
    _rank_figures[(BH, triton.cdiv(N, block_j))](m, bounds, lengths, out, N, heads, G=G, MOST=most,
                                                  BLOCK_I=32, BLOCK_J=block_j)
    return out
