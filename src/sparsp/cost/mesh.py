"""A device mesh of ``cfg`` × ``ulysses`` × ``sp`` ranks: what it is and what its call moves.

Ranks are numbered with ``ulysses`` varying fastest, then ``sp``, then ``cfg``: rank (c, r, u)
is ``c·U·R + r·U + u``, so a Ulysses group (consecutive ranks) stays inside a host where the
sizes allow and ``sp`` spans the hosts. A mesh call with ``ulysses`` U × ``sp`` R:

1. the sequence is placed over the R sp ranks (the strategy's placement and block cut of R
   ranks); sp slice r is cut at block boundaries into U pieces (``piece_tokens``), piece u on
   rank (r, u) with every head;
2. one all-to-all inside each Ulysses group turns a rank's piece with all H heads into the
   whole slice with H/U heads: Ulysses rank u takes the heads ``ulysses_heads`` gives it (by
   density, as flat ``ulysses`` gives heads to ranks: ``cost.balance``; the same order in every
   group);
3. the ``sp`` strategy runs over the R ranks of each u on those H/U heads;
4. an all-to-all brings each piece's output of every head back.

``cfg`` = 2 splits a step's guidance branches over two halves, each such a mesh; the halves
exchange their predictions once per step (``cost.mesh_step``). ``mesh_comm_bytes`` counts one
call's bytes on one half: the sp strategy's on the H/U heads of each u (its byte rule on the
head-restricted masks) and the all-to-alls', reported apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..demand import comm_bytes, head_split
from ..placement import Placement
from .balance import balanced_heads

__all__ = ["DIMENSIONS", "Mesh", "all_to_all_bytes", "head_pairs", "mesh_comm_bytes", "piece_tokens",
           "ulysses_heads", "valid_meshes"]

DIMENSIONS = ("cfg", "ulysses", "sp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh:
    """Sizes of the mesh's three dimensions (``cfg`` slowest, ``ulysses`` fastest)."""

    cfg: int = 1
    ulysses: int = 1
    sp: int = 1

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh {name} must be an int >= 1, got {value!r}")
        if self.cfg > 2:
            raise ValueError(f"mesh cfg must be 1 or 2 (a step's branches over two halves), got {self.cfg}")

    @property
    def world(self) -> int:
        return self.cfg * self.ulysses * self.sp

    @property
    def flat(self) -> bool:
        """One sequence-parallel group: no CFG halves, no Ulysses dimension."""
        return self.cfg == 1 and self.ulysses == 1

    @classmethod
    def parse(cls, text: str, world: int) -> "Mesh":
        """``cfg=C,ulysses=U`` (either may be left out: 1), ``sp`` the rest of ``world``; an
        explicit ``sp=R`` must make the sizes multiply to ``world``."""
        sizes: dict[str, int] = {}
        for part in str(text).split(","):
            name, eq, value = part.strip().partition("=")
            if not eq or name not in DIMENSIONS or name in sizes:
                raise ValueError(f"--mesh {text!r}: expected NAME=SIZE pairs of {', '.join(DIMENSIONS)} separated "
                                 f"by commas (e.g. cfg=2,ulysses=4), or auto")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(f"--mesh {text!r}: {name}={value!r} is not an int") from None
        rest = sizes.get("cfg", 1) * sizes.get("ulysses", 1)
        if rest < 1 or world % rest:
            raise ValueError(f"--mesh {text!r}: cfg x ulysses = {rest} does not divide {world} ranks")
        sizes.setdefault("sp", world // rest)
        mesh = cls(**sizes)
        if mesh.world != world:
            raise ValueError(f"--mesh {text!r}: {mesh.label} is {mesh.world} ranks, not {world}")
        return mesh

    @property
    def label(self) -> str:
        return f"cfg {self.cfg} x ulysses {self.ulysses} x sp {self.sp}"

    def check(self, heads: int, blocks: int | None = None) -> None:
        """``ValueError`` (one line) where this mesh cannot run ``heads`` heads (and ``blocks``
        blocks: every piece of every sp slice at least one block)."""
        if heads % self.ulysses:
            raise ValueError(f"mesh {self.label}: {heads} heads are not divisible by ulysses {self.ulysses}")
        if blocks is not None and blocks < self.sp * self.ulysses:
            raise ValueError(f"mesh {self.label}: {blocks} blocks cannot fill sp {self.sp} x ulysses "
                             f"{self.ulysses} pieces")

    def to_dict(self) -> dict:
        return {"cfg": self.cfg, "ulysses": self.ulysses, "sp": self.sp}


def valid_meshes(world: int, heads: int, *, branches: int = 1, blocks: int | None = None) -> list[Mesh]:
    """Every mesh of ``world`` ranks a model of ``heads`` heads (and ``blocks`` blocks) can run:
    ``ulysses`` dividing the heads, ``cfg`` 2 only where a step runs several guidance
    ``branches``; in (cfg, ulysses) order."""
    out = []
    for cfg in (1, 2) if branches > 1 else (1,):
        for u in range(1, world // cfg + 1):
            if (world // cfg) % u or world % cfg or heads % u:
                continue
            mesh = Mesh(cfg=cfg, ulysses=u, sp=world // (cfg * u))
            if blocks is None or blocks >= mesh.sp * u:
                out.append(mesh)
    return out


def head_pairs(masks: torch.Tensor, lengths: torch.Tensor) -> list[int]:
    """Kept (query token, key token) pairs per head of masks bool [heads, nB, nB] whose blocks
    have ``lengths`` tokens: what heads are given to ranks by."""
    L = lengths.double()
    return [round(x) for x in ((masks.double() @ L) * L).sum(dim=-1).tolist()]


def ulysses_heads(kept: list[int], ulysses: int) -> tuple[tuple[int, ...], ...]:
    """The heads of each Ulysses rank, ascending: heads given to ranks by their kept pairs
    (``balance.balanced_heads``; the contiguous order where that is no better)."""
    order = balanced_heads(kept, ulysses)
    per = len(kept) // ulysses
    return tuple(tuple(order[u * per:(u + 1) * per]) for u in range(ulysses))


def piece_tokens(placement: Placement, ulysses: int) -> tuple[tuple[int, ...], ...]:
    """Tokens of each piece: sp slice r (rank r's blocks in placed order) cut at block
    boundaries into ``ulysses`` runs of near-equal block counts, the longer ones first (the
    slice's short tail block, if any, in its last piece)."""
    lens = placement.geometry.block_lengths()
    out = []
    for r in range(placement.ranks):
        mine = lens[placement.blocks_of(r)].tolist()
        if len(mine) < ulysses:
            raise ValueError(f"sp slice {r} has {len(mine)} blocks, fewer than ulysses {ulysses} pieces")
        cut = [0]
        for n in head_split(len(mine), ulysses):
            cut.append(cut[-1] + n)
        out.append(tuple(sum(mine[a:b]) for a, b in zip(cut, cut[1:])))
    return tuple(out)


def all_to_all_bytes(pieces: tuple[tuple[int, ...], ...], heads: int, *, head_dim: int,
                     dtype_bytes: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """The Ulysses all-to-alls of one call: per rank (r·U + u) the bytes it receives, and per
    slice r the bytes of each round in (Q, K, V of its heads for a peer's piece) and back (its
    piece's output of a peer's heads), rank by rank: (per rank, in[r·U+u][k−1], back[...])."""
    U = len(pieces[0])
    per_head = heads // U
    row = head_dim * dtype_bytes
    total, into, back = [], [], []
    for piece in pieces:
        for u in range(U):
            into.append([3 * piece[(u - k) % U] * per_head * row for k in range(1, U)])
            back.append([piece[u] * per_head * row for _ in range(1, U)])
            total.append(sum(into[-1]) + sum(back[-1]))
    return total, into, back


def mesh_comm_bytes(masks: torch.Tensor, placement: Placement, rule, mesh: Mesh, *, head_dim: int,
                    dtype_bytes: int = 2) -> dict:
    """Bytes each rank of one half receives in one call on ``mesh`` (module docstring):
    ``placement`` is the R sp ranks'; ``rule`` a ``demand.BYTE_RULES`` name or function.
    ``{"total", "per_rank"}`` (rank r·U + u) as ``demand.comm_bytes`` gives them, and apart
    ``sp`` (the rule's bytes on each u's heads, ``demand.comm_bytes`` of the head-restricted
    masks) and ``ulysses`` (the all-to-alls'), and ``heads`` (each Ulysses rank's)."""
    U, R = mesh.ulysses, mesh.sp
    if placement.ranks != R:
        raise ValueError(f"mesh {mesh.label}: the placement has {placement.ranks} ranks, not sp {R}")
    mesh.check(masks.shape[0], placement.geometry.num_blocks)
    groups = ulysses_heads(head_pairs(masks.bool(), placement.geometry.block_lengths()), U)
    sp = [comm_bytes(masks[list(heads)], placement, rule, head_dim=head_dim, dtype_bytes=dtype_bytes)["per_rank"]
          for heads in groups]
    sp_rank = [sp[u][r] for r in range(R) for u in range(U)]
    a2a = [0] * (U * R)
    if U > 1:
        a2a = all_to_all_bytes(piece_tokens(placement, U), masks.shape[0], head_dim=head_dim,
                               dtype_bytes=dtype_bytes)[0]
    per_rank = [a + b for a, b in zip(sp_rank, a2a)]
    return {"total": sum(per_rank), "per_rank": per_rank,
            "sp": {"total": sum(sp_rank), "per_rank": sp_rank},
            "ulysses": {"total": sum(a2a), "per_rank": a2a}, "heads": [list(h) for h in groups]}
