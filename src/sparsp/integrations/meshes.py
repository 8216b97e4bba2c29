"""Where a parallelized model's process stands: its group or mesh, read before anything moves.

``parallelize`` takes a flat process group (``group=``: a mesh of one ``sp`` dimension), a
``DeviceMesh`` (``mesh=``, with ``dims=`` for a mesh whose dimensions are named otherwise;
``sparsp.mesh``), ``mesh="auto"`` (``auto_mesh``: the mesh ``cost.mesh_step.best_mesh`` prices
fastest for the model's token count, once per model and world size), or none of them (the
default group, or one process). ``resolve`` reads every fact of it without communicating and
refuses a bad one with one line; ``Ranks.connect`` then makes the groups (the only step that
communicates). Rank (cfg=c, sp=r, ulysses=u) holds piece u of sp slice r of the branches its
CFG half c computes; the placement and block cut are those of the R sp ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import cached_property

import torch.distributed as dist

from ..caches import per_geometry
from ..geometry import VideoGeometry, preset
from ..mesh import ROLES, MeshGroups, mesh_groups

log = logging.getLogger("sparsp")

__all__ = ["Ranks", "auto_mesh", "resolve"]


@dataclass
class Ranks:
    """This process's place: ``sp`` R ranks (the placement's), ``ulysses`` U pieces per slice,
    ``cfg`` halves; its coordinates; the mesh's groups (None for a flat group or one process).
    ``distributed``: attention over a process group (False: one process emulating R ranks)."""

    distributed: bool
    sp: int = 1
    ulysses: int = 1
    cfg: int = 1
    sp_rank: int = 0
    piece: int = 0
    half: int = 0
    flat_group: object = None  # group= (None: the default group)
    groups: MeshGroups | None = None
    half_mesh: object = None  # the (sp x ulysses) sub-mesh of a mesh with ulysses > 1, for sp_attention
    half_dims: dict | None = None
    label: str = ""

    @property
    def pieces(self) -> int:
        """The ranks of one CFG half's (sp x ulysses) sub-mesh: the sequence's pieces."""
        return self.sp * self.ulysses

    @property
    def index(self) -> int:
        """This rank's piece in sequence order (sp-major, ulysses-minor)."""
        return self.sp_rank * self.ulysses + self.piece

    @property
    def group(self):
        """The group a ulysses-1 call runs its strategy over (``sp_attention(group=)``)."""
        return self.groups.sp if self.groups is not None else self.flat_group

    @property
    def sequence(self):
        """The group of this half's (sp x ulysses) ranks, in sequence order: what the hooks that
        gather tokens gather over."""
        return self.groups.sequence if self.groups is not None else self.flat_group

    @cached_property
    def cfg_peers(self) -> list[int]:
        """Positions in the cfg group's all-gather of halves 0 .. cfg-1 (a group orders its
        ranks by global rank, which a user's mesh need not follow along cfg)."""
        lay, mesh = self.groups.layout, self.groups.mesh
        names = list(mesh.mesh_dim_names)
        index = [slice(None)] * len(names)
        for role, coordinate in zip(ROLES, lay.coordinate):
            name = lay.names[ROLES.index(role)]
            if name is not None and role != "cfg":
                index[names.index(name)] = coordinate
        along = mesh.mesh[tuple(index)].flatten().tolist()  # global ranks of halves 0, 1, ...
        members = dist.get_process_group_ranks(self.groups.cfg)
        return [members.index(g) for g in along]

    def connect(self) -> None:
        """Make the groups this process will use (every rank of a group makes it; the mesh's own
        dimension groups exist already), after every check has passed."""
        if self.groups is not None:
            _ = self.groups.sp, self.groups.ulysses, self.groups.sequence
            if self.cfg > 1:
                _ = self.groups.cfg, self.cfg_peers

    def describe(self) -> str:
        if not self.distributed:
            return f"1 process as {self.sp} ranks"
        if self.groups is None:
            return f"rank {self.sp_rank} of {self.sp}"
        return (f"mesh {self.label}: cfg half {self.half}, sp rank {self.sp_rank}, ulysses rank {self.piece}")


def resolve(*, group, mesh, dims, emulate_ranks) -> Ranks:
    """This process's ``Ranks``, read without communication; ``ValueError`` (one line) for
    arguments that do not go together or a mesh sparsp cannot run (``sparsp.mesh.layout``).
    ``mesh`` is a ``DeviceMesh`` here (``auto_mesh`` has turned ``"auto"`` into one)."""
    if mesh is not None and group is not None:
        raise ValueError("pass group= or mesh=, not both (group= is a mesh of one sp dimension)")
    if dims is not None and mesh is None:
        raise ValueError("dims= names the dimensions of a mesh: pass mesh= with it")
    if emulate_ranks is not None:
        if group is not None or mesh is not None:
            raise ValueError("emulate_ranks runs in one process: pass neither group= nor mesh= with it")
        if isinstance(emulate_ranks, bool) or not isinstance(emulate_ranks, int) or emulate_ranks < 1:
            raise ValueError(f"emulate_ranks must be a positive int, got {emulate_ranks!r}")
        return Ranks(False, sp=emulate_ranks)
    initialised = dist.is_available() and dist.is_initialized()
    if mesh is not None:
        if not initialised:
            raise ValueError("mesh was given but torch.distributed is not initialised")
        groups = mesh_groups(mesh, dims)
        lay = groups.layout
        if lay.cfg > 2:
            raise ValueError(f"cfg={lay.cfg} (the mesh dimension {lay.name('cfg')!r}): CFG parallel spreads a "
                             f"step's branches over 2 halves; use cfg 1 or 2")
        half_mesh = half_dims = None
        if lay.ulysses > 1:  # sp_attention(mesh=) on the (sp x ulysses) half, cfg sliced off
            half_dims = {role: lay.names[ROLES.index(role)] for role in ("sp", "ulysses")
                         if lay.names[ROLES.index(role)] is not None}
            kept = tuple(n for n in mesh.mesh_dim_names if n in half_dims.values())
            half_mesh = mesh if len(kept) == len(mesh.mesh_dim_names) else mesh[kept]
        label = f"cfg {lay.cfg} x ulysses {lay.ulysses} x sp {lay.sp}"
        return Ranks(True, sp=lay.sp, ulysses=lay.ulysses, cfg=lay.cfg, sp_rank=lay.coordinate[1],
                     piece=lay.coordinate[2], half=lay.coordinate[0], groups=groups, half_mesh=half_mesh,
                     half_dims=half_dims, label=label)
    if initialised:
        # any process group, one process included (``sp_attention`` on one GPU: its kernels, mask
        # and choice of the dense kernel, ``strategies/one_gpu.py``)
        return Ranks(True, sp=dist.get_world_size(group), sp_rank=dist.get_rank(group), flat_group=group)
    if group is not None:
        raise ValueError("group was given but torch.distributed is not initialised")
    return Ranks(False)


_AUTO = per_geometry("integrations: mesh='auto' choices")  # (geometry, world, strategy, branches, profile) -> Mesh
_BUILT: dict = {}  # (cfg, ulysses, sp) -> the DeviceMesh made for it (a mesh's groups outlive any cache)


def auto_mesh(geometry, *, heads: int, head_dim: int, block_size: int, layers: int, world: int, spec,
              branches: int, model: str):
    """The ``cost.mesh.Mesh`` ``best_mesh`` prices fastest for ``geometry`` (a ``VideoGeometry``
    or a preset name: its token grid, with the model's heads and ``layers`` self-attention
    layers) on ``world`` ranks, on the
    machine profile ``strategy="auto"`` predicts with (``SPARSP_PROFILE``, else the measured
    2×H200 NVLink profile widened to the world), for ``spec``'s facts and ``branches``
    branches per step; chosen once per (geometry, world, strategy, branches) and logged.
    ``ValueError`` (one line) for a geometry that is neither, or no mesh that runs."""
    from ..cost.mesh_step import best_mesh
    from ..strategies.auto import profile_for
    from ..strategies.registry import strategies_where, strategy_spec

    if isinstance(geometry, str):
        geometry = preset(geometry)
    if not isinstance(geometry, VideoGeometry):
        raise ValueError(f"geometry must be a sparsp.geometry.VideoGeometry or a preset name, got "
                         f"{type(geometry).__name__}")
    geom = replace(geometry, heads=heads, head_dim=head_dim, block_size=block_size, layers=layers)
    profile = profile_for("ipc", world)
    key = (geom, world, spec.name, branches, profile.name)
    chosen = _AUTO.get(key)
    if chosen is None:
        baseline = strategy_spec(strategies_where(baseline=True)[0])
        best, _ = best_mesh(geom, world, profile, strategy=spec, branches=branches, baseline=baseline)
        chosen = _AUTO[key] = best.mesh
        log.info("sparsp: mesh='auto' for %s (%s, %d ranks, %d branch(es) per step, profile %s, %s): %s, "
                 "predicted %.1f ms per step", model, geom.describe(), world, branches, profile.name, spec.name,
                 chosen.label, best.run["per_step_ms"])
    return chosen


def build_mesh(sizes):
    """A ``sparsp.make_mesh`` of ``sizes`` (a ``cost.mesh.Mesh``), made once per process and
    kept: two models (Wan 2.2's experts) or a second ``parallelize`` share it."""
    from ..mesh import make_mesh

    key = (sizes.cfg, sizes.ulysses, sizes.sp)
    if key not in _BUILT:
        _BUILT[key] = make_mesh(cfg=sizes.cfg, ulysses=sizes.ulysses, sp=sizes.sp)
    return _BUILT[key]
