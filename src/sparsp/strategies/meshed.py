"""Ulysses × sparse sequence parallelism in one call: ``sp_attention(mesh=)`` with ulysses > 1.

On a mesh of ulysses U and sp R (``sparsp.mesh``), rank (sp=r, ulysses=u) holds piece u of sp
slice r, every head (``placement.ulysses_pieces`` cuts each slice at block boundaries into U
pieces at model entry). The pieces in the (sp × ulysses) sub-mesh's order are the sequence and
their blocks are the slices' blocks, so the call computes what the R sp ranks alone compute
(``reference_sp_attention(lens=<the R slices>)``, which ``parallelize(emulate_ranks=R)`` runs):

1. **head step**, over the sub-mesh group (``Request(heads_only=True)``): ONE metadata
   all-gather of every piece's header and summaries for all H heads (``plan.gather_metadata``);
   the plan stage makes the whole mask of all heads and the kept token pairs per head (a CUDA
   graph per geometry, as a flat call's stage); ONE host read (the headers' checks and those
   pairs), the Ulysses transport's fence beside it. Heads go to Ulysses ranks by density as
   flat ``ulysses`` gives them to ranks (``ulysses.balanced_order``): every rank holds the same
   mask, so every Ulysses group takes the same order;
2. **all-to-all** inside the Ulysses group, on its own transport (``ipc`` or ``host`` inside a
   host): the piece with all H heads → the whole sp slice with the rank's H/U heads; q, k and v
   one message each per peer (``ulysses.to_heads``);
3. **sp step**: the ``strategy`` (any registered one, ``auto`` included) over the sp group on
   those heads, under the whole mask restricted to them (``Request(given=Metadata.given(...))``:
   no second gather, no header to read), with its own host read of its payloads' counts;
4. **all-to-all** back: this piece's tokens with every head (``ulysses.to_tokens``).

Per call: one collective and two host reads (a flat call: one and one; docs/performance.md).
The sp step moves what the flat strategy moves for the H/U heads. A schedule (``step=``)
applies as to a flat call: a dense step runs the strategy's dense path with every block kept; a
plan step keeps a ``MeshPlan`` (the head order, the pieces' shapes and the sp step's
``KeptPlan``); a reuse step runs the two all-to-alls and the kept sp step: no summaries, no
collective, no host read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..config import SparspConfig
from ..mesh import MeshGroups, mesh_groups
from ..plan import Metadata, Shapes
from ..timing import phase_of
from . import schedule
from .request import Request
from .ulysses import balanced_order, exchange, ordered, to_heads, to_tokens


@dataclass
class MeshPlan:
    """What a mesh call's plan step decided, kept for the reuse steps of its key."""

    order: tuple[int, ...] | None  # the heads by Ulysses rank (None: contiguous)
    pieces: Shapes  # every piece's tokens: the sub-mesh group's shapes
    sp: schedule.KeptPlan  # the sp step's plan

    @property
    def nbytes(self) -> int:
        return self.sp.nbytes


def resolve(mesh, dims, group, q) -> MeshGroups:
    """The groups of a mesh call, after every check that needs no communication (one-line
    ``ValueError``): a mesh sparsp can run on under ``dims`` (``sparsp.mesh.layout``), no
    ``group=`` beside it, no ``cfg`` dimension of more than one rank, heads divisible by
    ``ulysses``."""
    if group is not None:
        raise ValueError("pass group= or mesh=, not both (group= is a mesh of one sp dimension)")
    if mesh is None:
        raise ValueError("dims= names the dimensions of a mesh: pass mesh= with it")
    groups = mesh_groups(mesh, dims)
    lay = groups.layout
    if lay.cfg > 1:
        rest = ", ".join(repr(n) for n in lay.names[1:] if n is not None)
        raise ValueError(f"sp_attention runs over the sp and ulysses dimensions; this mesh has cfg={lay.cfg} "
                         f"(dimension {lay.name('cfg')!r}), whose branches a pipeline spreads: pass the sub-mesh "
                         f"of one branch, mesh[{rest}]")
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[2] % lay.ulysses:
        raise ValueError(f"H={q.shape[2]} heads do not divide over ulysses={lay.ulysses} "
                         f"(the mesh dimension {lay.name('ulysses')!r})")
    return groups


def attention(q, k, v, groups: MeshGroups, strategy: str, config: SparspConfig, transports: tuple, *,
              layer: int | None, step: int | None, branch, global_mask: torch.Tensor | None, timer,
              owner) -> torch.Tensor:
    """One mesh call (``validate`` passed, ``resolve``'s checks made): this rank's piece
    (B, S_piece, H, D) in, its output out (module docstring). ``transports``: the Ulysses
    group's and the sp group's."""
    heads_t, sp_t = transports
    with torch.no_grad():
        strategy, config, key, kept = schedule.place(step, strategy, config, owner=owner, layer=layer,
                                                     branch=branch, q=q, group=groups, masked=global_mask is not None)
        if kept is not None:  # a reuse step: the kept head order and sp step
            heads_t.fence()
            slice_, back = _to_slice(q, k, v, None, kept.order, kept.pieces, groups, heads_t, timer)
            out = schedule.run_kept(kept.sp, *slice_.inputs, groups.sp, config, sp_t, timer)
        else:
            order, pieces, mask = _head_step(q, k, v, groups, strategy, config, heads_t, global_mask, timer, layer)
            slice_, back = _to_slice(q, k, v, mask, order, pieces, groups, heads_t, timer)
            call, spec = _sp_step(slice_, pieces, groups, strategy, config, sp_t, global_mask is not None, timer, layer)
            if key is not None:  # a plan step whose plan later steps reuse
                schedule.keep(key, MeshPlan(order, pieces, schedule.KeptPlan.of(call, spec)), config.kept_plans)
            call.run(spec)
            out = call.output.result()
        final = to_tokens(out, slice_.heads, slice_.toks, slice_.u, slice_.move)
        if back is not None:  # the caller's head order
            final = final.index_select(2, back)
    heads_t.settle()
    return final


def _head_step(q, k, v, groups: MeshGroups, strategy: str, config: SparspConfig, transport, global_mask, timer,
               layer) -> tuple:
    """The metadata all-gather over the sub-mesh, the whole mask of every head and the one
    host read: (the heads' order by Ulysses rank or None, the pieces' shapes, the whole mask
    or None for a dense call)."""
    request = Request(q, k, v, groups.sequence, strategy, config, transport, global_mask, timer, layer=layer,
                      heads_only=True)
    call, _ = _prepared(request)
    U, sh = groups.layout.ulysses, call.shapes
    for r in range(groups.layout.sp):
        mine = sh.seq_lens[r * U:(r + 1) * U]
        if any(n % sh.block_size for n in mine[:-1]):
            raise ValueError(f"the Ulysses pieces of sp slice {r} hold {list(mine)} tokens: each but the last must "
                             f"be whole {sh.block_size}-token blocks (sparsp.placement.ulysses_pieces cuts so)")
    return balanced_order(call.head_work, U), sh, call.full_mask


def _prepared(request: Request):
    """A request's four steps up to its run: ``(call, spec)``."""
    meta = request.gather()  # the metadata all-gather, or the metadata given
    call, staged = request.stage(meta)  # the mask, the payloads' selections, the counts to read
    call, resolved = request.resolve(meta, call, staged)  # the one host read
    return request.choose(call, resolved)  # auto's choice, the heads' ranks, one GPU's kernel


@dataclass
class _Slice:
    """This rank's sp slice of its heads, and how its output goes back to the pieces."""

    inputs: list  # q, k, v (B, S_slice, H/U, D)
    mask: torch.Tensor | None  # the whole mask of its heads
    heads: list  # each Ulysses rank's heads, as slices of the ordered heads
    toks: list  # each piece's tokens in the slice
    u: int  # this rank's Ulysses rank
    move: object  # move(sends, recvs): the Ulysses group's exchange


def _to_slice(q, k, v, mask, order, pieces: Shapes, groups: MeshGroups, transport, timer) -> tuple[_Slice, object]:
    """The all-to-all inside the Ulysses group (``order``: the heads by Ulysses rank): this
    rank's piece, every head → its sp slice, its heads; and the index back to the caller's
    head order (None: nothing moved)."""
    U = groups.layout.ulysses
    r, u = divmod(pieces.rank, U)
    assert transport.rank == u, (transport.rank, u)  # the mesh's layout checked the order
    q, k, v, mask, back = ordered(order, q, k, v, mask)
    B, _, H, D = q.shape
    hp = H // U
    heads = [slice(i * hp, (i + 1) * hp) for i in range(U)]
    mine = pieces.seq_lens[r * U:(r + 1) * U]
    ends = list(itertools.accumulate(mine))
    toks = [slice(a, b) for a, b in zip([0] + ends[:-1], ends)]
    # every message of the call (a piece's q, k or v of one rank's heads, and back) fits a slot
    transport.reserve(B * max(mine) * hp * D * q.element_size())

    def move(sends, recvs):
        exchange(transport, sends, recvs, phase=lambda name: phase_of(timer, name))

    inputs = to_heads([q, k, v], heads, toks, u, move)
    mask = None if mask is None else mask[:, heads[u]].contiguous()
    return _Slice(inputs, mask, heads, toks, u, move), back


def _sp_step(slice_: _Slice, pieces: Shapes, groups: MeshGroups, strategy: str, config: SparspConfig, transport,
             test_mask: bool, timer, layer):
    """The strategy's request over the sp group on this rank's slice and heads, its metadata
    given (the slices' shapes from the pieces', the whole mask of its heads): (call, spec),
    resolved and ready to run. A test's mask stays a test's mask (no one-GPU kernel choice)."""
    U, R = groups.layout.ulysses, groups.layout.sp
    lens = tuple(sum(pieces.seq_lens[i * U:(i + 1) * U]) for i in range(R))
    shapes = Shapes(pieces.rank // U, R, pieces.batch, pieces.heads // U, pieces.head_dim, pieces.block_size, lens)
    given = Metadata.given(shapes, None if test_mask else slice_.mask, slice_.inputs[0].device, config.timeout_s)
    request = Request(*slice_.inputs, groups.sp, strategy, config, transport, slice_.mask if test_mask else None,
                      timer, layer=layer, given=given)
    return _prepared(request)
