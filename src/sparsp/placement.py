"""Which rank owns which block, and the token permutation that realises it (paper §4.3).

A ``Placement`` assigns every block (in the model's original order) to a rank. The placed
sequence lists rank 0's blocks, then rank 1's, …, each rank's blocks in ascending original
order, so every rank holds one contiguous slice of the placed sequence and the only short
block (the global last one) is always the last block of its owner's slice. Permutation happens
once at model entry (hidden states and every position-dependent tensor such as RoPE cos/sin)
and is undone once at exit; it never changes the math.

``contiguous``: rank r owns a contiguous range of blocks (plain SP: whole frames per rank).
``periodic``: rank r owns the same spatial region of every frame, P(t, s) = ⌊G·s / S_frame⌋,
so multi-diagonal dependencies become local and remote demand shrinks to the halo (§4.3).

On a mesh with a ``ulysses`` dimension the placement is that of the ``sp`` ranks, and
``ulysses_pieces`` cuts each sp slice at block boundaries into the pieces of its Ulysses ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .geometry import VideoGeometry


@dataclass(frozen=True, eq=False)
class Placement:
    """``owner``: LongTensor [num_blocks], the rank of every block in original order."""

    geometry: VideoGeometry
    ranks: int
    owner: torch.Tensor
    kind: str = "custom"

    def __post_init__(self) -> None:
        if self.owner.shape != (self.geometry.num_blocks,):
            raise ValueError(
                f"owner must have one entry per block ({self.geometry.num_blocks}), got {tuple(self.owner.shape)}"
            )
        if self.owner.numel() and (self.owner.min() < 0 or self.owner.max() >= self.ranks):
            raise ValueError(f"owner entries must lie in [0, {self.ranks}), got {self.owner.unique().tolist()}")

    # --- blocks -----------------------------------------------------------------------------
    @cached_property
    def block_order(self) -> torch.Tensor:
        """Original block ids in placed order (rank-major, ascending within a rank)."""
        return torch.argsort(self.owner * self.geometry.num_blocks + torch.arange(self.owner.numel()))

    def blocks_of(self, rank: int) -> torch.Tensor:
        """Original block ids that ``rank`` owns, ascending."""
        return torch.nonzero(self.owner == rank).flatten()

    @cached_property
    def blocks_per_rank(self) -> list[int]:
        return torch.bincount(self.owner, minlength=self.ranks).tolist()

    # --- tokens -----------------------------------------------------------------------------
    @cached_property
    def perm(self) -> torch.Tensor:
        """LongTensor [num_tokens]: placed[i] = original[perm[i]]."""
        g = self.geometry
        starts = g.block_starts()[self.block_order]
        lens = g.block_lengths()[self.block_order]
        within = torch.arange(g.num_tokens) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        return torch.repeat_interleave(starts, lens) + within

    @cached_property
    def inverse(self) -> torch.Tensor:
        """LongTensor [num_tokens]: original[j] = placed[inverse[j]]."""
        inv = torch.empty_like(self.perm)
        inv[self.perm] = torch.arange(self.perm.numel())
        return inv

    @cached_property
    def tokens_per_rank(self) -> list[int]:
        lens = self.geometry.block_lengths()
        return torch.zeros(self.ranks, dtype=torch.long).index_add_(0, self.owner, lens).tolist()

    def token_slice(self, rank: int) -> slice:
        """The slice of the placed sequence that ``rank`` holds."""
        start = sum(self.tokens_per_rank[:rank])
        return slice(start, start + self.tokens_per_rank[rank])

    def permute(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Original order → placed order along ``dim`` (hidden states, RoPE cos/sin, …)."""
        return x.index_select(dim, self._on(self.perm, x, dim))

    def unpermute(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Placed order → original order along ``dim``."""
        return x.index_select(dim, self._on(self.inverse, x, dim))

    def _on(self, index: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
        n = x.shape[dim]
        if n != self.geometry.num_tokens:
            raise ValueError(f"dim {dim} has {n} tokens, the placement expects {self.geometry.num_tokens}")
        return index.to(x.device)

    def __repr__(self) -> str:
        return f"Placement({self.kind}, ranks={self.ranks}, blocks/rank={self.blocks_per_rank})"


def _balanced_chunks(order: torch.Tensor, ranks: int) -> torch.Tensor:
    """Give ``order`` (block ids) to ranks in consecutive chunks whose sizes differ by ≤ 1."""
    n = order.numel()
    sizes = torch.full((ranks,), n // ranks, dtype=torch.long)
    sizes[: n % ranks] += 1
    owner = torch.empty(n, dtype=torch.long)
    owner[order] = torch.repeat_interleave(torch.arange(ranks), sizes)
    return owner


def _check_ranks(geom: VideoGeometry, ranks: int) -> None:
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be a positive int, got {ranks!r}")
    if ranks > geom.num_blocks:
        raise ValueError(f"{ranks} ranks exceed the {geom.num_blocks} blocks of {geom.name}")


def contiguous(geom: VideoGeometry, ranks: int) -> Placement:
    """Plain sequence parallelism: rank r owns the r-th contiguous run of blocks."""
    _check_ranks(geom, ranks)
    return Placement(geom, ranks, _balanced_chunks(torch.arange(geom.num_blocks), ranks), "contiguous")


def periodic(geom: VideoGeometry, ranks: int) -> Placement:
    """Dependency-aware placement: the same spatial region of every frame per rank (§4.3).

    Blocks are ordered by the spatial position s of their centre within its frame (ties by
    original order, i.e. by frame) and cut into balanced consecutive chunks. When a frame is a
    whole number of blocks divisible by G this is exactly P(t, s) = ⌊G·s / S_frame⌋; otherwise
    it is the balanced version of it (blocks that straddle frames go by their centre). Text
    blocks go last in the order, so they land on the last rank(s) without unbalancing anyone.
    """
    _check_ranks(geom, ranks)
    starts = geom.block_starts()
    lens = geom.block_lengths()
    video_len = (geom.video_tokens - starts).clamp(min=0).minimum(lens)
    centre = starts + torch.div(video_len - 1, 2, rounding_mode="floor")
    s = (centre % geom.frame_tokens).double() / geom.frame_tokens
    key = torch.where(video_len > 0, s, torch.full_like(s, 2.0))  # text after all video
    order = torch.argsort(key, stable=True)  # stable: equal places keep frame order
    return Placement(geom, ranks, _balanced_chunks(order, ranks), "periodic")


def ulysses_pieces(tokens: int, block_size: int, ulysses: int) -> tuple[int, ...]:
    """The tokens of each of the ``ulysses`` pieces one sp slice of ``tokens`` is cut into at
    model entry, for a mesh whose Ulysses group holds the slice (``sp_attention(mesh=)``: rank
    (sp=r, ulysses=u) holds piece u of slice r, in order). The cut is at block boundaries, so
    the pieces' blocks are the slice's own blocks (each cut from the slice's start) and the
    mask, the placement and the strategy's blocks are those of the sp ranks alone; the pieces
    are as even as whole blocks allow (the first ones take the one block more), and the slice's
    short tail block, if any, ends the last piece. ``ValueError`` when the slice has fewer
    blocks than pieces."""
    for name, n in (("tokens", tokens), ("block_size", block_size), ("ulysses", ulysses)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    blocks = -(-tokens // block_size)
    if blocks < ulysses:
        raise ValueError(f"a slice of {tokens} tokens has {blocks} blocks of {block_size}: too few to cut "
                         f"into {ulysses} Ulysses pieces of whole blocks")
    base, extra = divmod(blocks, ulysses)
    pieces = [(base + (u < extra)) * block_size for u in range(ulysses)]
    pieces[-1] -= blocks * block_size - tokens  # the tail block is short
    return tuple(pieces)


PLACEMENTS = {"contiguous": contiguous, "periodic": periodic}


def make_placement(kind: str, geom: VideoGeometry, ranks: int) -> Placement:
    try:
        return PLACEMENTS[kind](geom, ranks)
    except KeyError:
        raise ValueError(f"unknown placement {kind!r}; choose one of {', '.join(PLACEMENTS)}") from None
