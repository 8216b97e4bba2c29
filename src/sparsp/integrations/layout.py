"""Which tokens a process holds for one geometry, and how to put them back (``TokenLayout``).

The placement is a fixed permutation per (geometry, R) for the R sp ranks (docs/design.md,
"The mechanism", dependency-aware placement). Over a flat group rank r holds sp slice r; on a
mesh of ulysses U, rank (sp=r, ulysses=u) holds piece u of slice r, the slice cut at block
boundaries (``placement.ulysses_pieces``), so the pieces in the (sp x ulysses) sub-mesh's
order are the placed sequence and the mask is the R sp ranks' own. In one process (no group,
or ``emulate_ranks=R``) the whole placed sequence stays here, attended as R slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..geometry import VideoGeometry
from ..placement import Placement, make_placement, ulysses_pieces
from .meshes import Ranks

__all__ = ["TokenLayout", "make_layout"]


@dataclass
class TokenLayout:
    """Which tokens this process holds for one geometry, and how to put them back.

    ``video_ids``: original video token ids held here, in order (placed order; a rank's own
    piece in SP, all of them in the single-process mode). ``attn_index``: positions, in
    ``cat([held video, all text])``, of the attention sequence this process computes (its
    piece; the whole placed sequence in the single-process mode). ``lens``: tokens per slice of
    that sequence (the emulated ranks' in the single-process mode)."""

    geometry: VideoGeometry
    placement: Placement
    video_ids: torch.Tensor
    attn_index: torch.Tensor
    lens: list[int]
    video_parts: list[int]  # video tokens per piece, in sequence order (SP: gather sizes)
    video_order: torch.Tensor  # original order ← cat of every piece's video ids
    text_parts: list[int]  # text tokens per piece
    text_order: torch.Tensor  # text ids ← cat of every piece's text ids
    attn_tokens: torch.Tensor  # original token id of every token of the attention sequence
    cache: dict = field(default_factory=dict)
    identity: bool = False  # a group of one in the model's own order: nothing to cut, permute or gather

    def on(self, name: str, device) -> torch.Tensor:
        """An index tensor on ``device`` (moved once, kept)."""
        key = (name, str(device))
        if key not in self.cache:
            self.cache[key] = getattr(self, name).to(device)
        return self.cache[key]


def _pieces(placement: Placement, ranks: Ranks) -> list[torch.Tensor]:
    """The token ids of every piece in sequence order: each sp slice cut into U pieces."""
    out = []
    for r in range(placement.ranks):
        ids = placement.perm[placement.token_slice(r)]
        cuts = ulysses_pieces(len(ids), placement.geometry.block_size, ranks.ulysses) if ranks.ulysses > 1 \
            else (len(ids),)
        out += list(torch.split(ids, list(cuts)))
    return out


def make_layout(geom: VideoGeometry, kind: str, ranks: Ranks, model: str) -> TokenLayout:
    """The layout of ``geom`` for this process (module docstring); ``ValueError`` naming the
    model where the R ranks (and U pieces of each slice) cannot split it."""
    try:
        pl = make_placement(kind, geom, ranks.sp)
        pieces = _pieces(pl, ranks) if ranks.distributed else [pl.perm[pl.token_slice(r)] for r in range(ranks.sp)]
    except ValueError as e:
        over = f"{ranks.sp} ranks" + (f" x {ranks.ulysses} Ulysses pieces" if ranks.ulysses > 1 else "")
        raise ValueError(f"sparsp: {model} cannot split {geom.describe()} over {over}: {e}; use a smaller "
                         f"config.block_size or fewer ranks") from None
    nv = geom.video_tokens
    vids = [ids[ids < nv] for ids in pieces]
    tids = [ids[ids >= nv] - nv for ids in pieces]
    if ranks.distributed:
        me = ranks.index
        attn_tokens = pieces[me]
        video_ids = vids[me]
        attn_index = torch.cat([torch.arange(len(vids[me])), len(vids[me]) + tids[me]])
        lens = [len(attn_tokens)]
    else:
        video_ids = torch.cat(vids)
        offsets = torch.tensor([0] + [len(x) for x in vids]).cumsum(0)
        attn_index = torch.cat([torch.cat([offsets[r] + torch.arange(len(vids[r])), nv + tids[r]])
                                for r in range(ranks.sp)])
        lens = pl.tokens_per_rank
        attn_tokens = pl.perm
    identity = len(pieces) == 1 and bool((pl.perm == torch.arange(len(pl.perm))).all())
    return TokenLayout(geom, pl, video_ids, attn_index, lens, [len(x) for x in vids],
                       torch.argsort(torch.cat(vids)), [len(x) for x in tids], torch.cat(tids), attn_tokens,
                       identity=identity)
