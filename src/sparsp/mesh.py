"""The device mesh a call runs on: ``make_mesh`` builds one, ``mesh_groups`` reads any.

Three dimensions compose (docs/mesh.md), each used by the layer that owns it, as torchtitan
applies each parallelism to its own dimension of one ``DeviceMesh``:

* ``cfg``: the branches of a denoising step (classifier-free guidance's cond and uncond) on
  separate parts of the ranks — a pipeline's, never one attention call's;
* ``ulysses``: an all-to-all from sequence pieces to head shards (``sp_attention(mesh=)``);
* ``sp``: the sparse sequence-parallel strategy over the slices (``sp_attention``'s strategy).

A mesh is PyTorch's own ``torch.distributed.device_mesh.DeviceMesh``: ``make_mesh`` builds one
with dimensions named ``cfg``, ``sp``, ``ulysses``, ``ulysses`` varying fastest, so that a
Ulysses group is consecutive ranks (one host's, where the sizes allow) and ``sp`` spans hosts.
Any other mesh works with a ``dims=`` map naming which of its dimensions plays which role
(``{"sp": "ring", "ulysses": "ulysses"}`` for Diffusers' meshes); every dimension of the mesh
must be mapped (slice a larger mesh first: ``mesh["ring", "ulysses"]``), and a role no
dimension plays has size 1.

Rank (sp=r, ulysses=u) holds piece u of sp slice r, by mesh coordinates: the (sp × ulysses)
sub-mesh read sp-major, ulysses-minor is the order of the sequence. A process group orders its
ranks by global rank (``dist.new_group`` sorts them), so that order must ascend in global rank
— ulysses varies faster than sp, as ``make_mesh`` builds it — and a mesh where it does not is
refused. Everything ``MeshLayout`` checks is read from the mesh without communication; the
groups (``MeshGroups``) are made the first time a call needs them: the mesh's own dimension
groups, and for the (sp × ulysses) sub-mesh the default group where it is the whole world in
order, else one ``dist.new_group`` made by its own ranks alone (local synchronisation, so a
sub-mesh of a larger mesh needs no call from the other ranks) and kept per rank list.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import env
from .caches import per_geometry

log = logging.getLogger("sparsp")

ROLES = ("cfg", "sp", "ulysses")
"""The mesh dimensions sparsp knows, in ``make_mesh``'s order (the last varies fastest)."""

__all__ = ["ROLES", "MeshGroups", "MeshLayout", "make_mesh", "mesh_groups"]


def _size(name: str, value, *, none: bool = False) -> None:
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{' or None' if none else ''}, got {value!r}")


def make_mesh(cfg: int = 1, ulysses: int = 1, sp: int | None = None, device_type: str | None = None) -> DeviceMesh:
    """A ``DeviceMesh`` of the whole world with dimensions ``("cfg", "sp", "ulysses")`` of
    sizes (cfg, sp, ulysses), ``ulysses`` varying fastest; ``sp`` None: what is left of the
    world size. ``device_type`` None: ``"cuda"`` where the default group's backend is NCCL,
    else ``"cpu"``. ``ValueError`` (one line, before any communication) where the sizes do not
    multiply to the world size. Under ``torchrun``, a Ulysses group that does not fit in one
    node is logged as a warning: its all-to-all then crosses hosts."""
    _size("cfg", cfg)
    _size("ulysses", ulysses)
    _size("sp", sp, none=True)
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("make_mesh needs torch.distributed initialised: call dist.init_process_group first")
    world = dist.get_world_size()
    if sp is None:
        if world % (cfg * ulysses):
            raise ValueError(f"cfg={cfg} x ulysses={ulysses} does not divide the world size {world}")
        sp = world // (cfg * ulysses)
    elif cfg * sp * ulysses != world:
        raise ValueError(f"cfg={cfg} x sp={sp} x ulysses={ulysses} = {cfg * sp * ulysses} ranks, "
                         f"but the world size is {world}")
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    node = env.torchrun_node()
    if node is not None and ulysses > 1 and node[1] % ulysses:
        log.warning("sparsp: ulysses=%d does not divide the %d processes of a node: Ulysses groups "
                    "cross hosts, and their all-to-all with them", ulysses, node[1])
    return init_device_mesh(device_type, (cfg, sp, ulysses), mesh_dim_names=ROLES)


@dataclass(frozen=True)
class MeshLayout:
    """What a mesh says about this rank, read without communication (``layout``)."""

    sizes: tuple[int, int, int]  # (cfg, sp, ulysses)
    names: tuple[str | None, str | None, str | None]  # the mesh dimension of each role (None: none)
    coordinate: tuple[int, int, int]  # this rank's (cfg, sp, ulysses)
    sequence: tuple[int, ...]  # global ranks of this rank's (sp × ulysses) sub-mesh, sp-major

    @property
    def cfg(self) -> int:
        return self.sizes[0]

    @property
    def sp(self) -> int:
        return self.sizes[1]

    @property
    def ulysses(self) -> int:
        return self.sizes[2]

    def name(self, role: str) -> str:
        """The mesh's own name of ``role``'s dimension (the role's name where none plays it)."""
        return self.names[ROLES.index(role)] or role


def _roles(mesh: DeviceMesh, dims) -> dict[str, str]:
    """mesh dimension name -> role, from ``dims`` (role -> mesh dimension name; None: the
    mesh's own names are the roles); ``ValueError`` for an unknown role or dimension, a
    dimension named twice, and a dimension no role names."""
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("the mesh's dimensions have no names: build it with mesh_dim_names "
                         "(sparsp.make_mesh does) so that dims= can name them")
    if dims is None:
        dims = {n: n for n in names if n in ROLES}
    if not isinstance(dims, Mapping):
        raise ValueError(f"dims must map roles ({', '.join(ROLES)}) to mesh dimensions, got {type(dims).__name__}")
    of: dict[str, str] = {}
    for role, name in dims.items():
        if role not in ROLES:
            raise ValueError(f"dims names the role {role!r}; the roles are {', '.join(ROLES)}")
        if name not in names:
            raise ValueError(f"dims maps {role} to {name!r}, which is not a dimension of the mesh "
                             f"({', '.join(names)})")
        if name in of:
            raise ValueError(f"dims maps both {of[name]} and {role} to the mesh dimension {name!r}")
        of[name] = role
    for i, name in enumerate(names):
        if name not in of:
            raise ValueError(f"the mesh dimension {name!r} (size {mesh.mesh.shape[i]}) is not mapped: pass dims= "
                             f"naming the role ({', '.join(ROLES)}) of each of {', '.join(names)} (e.g. "
                             f"dims={{'sp': {name!r}}}), a larger mesh sliced to the attention's dimensions first")
    return of


def layout(mesh, dims=None) -> MeshLayout:
    """This rank's ``MeshLayout`` of ``mesh`` under ``dims``; ``ValueError`` (one line) for
    anything that is not a mesh sparsp can run on (module docstring)."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    of = _roles(mesh, dims)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"global rank {dist.get_rank()} is not in the mesh {mesh.mesh.tolist()}")
    grid = mesh.mesh
    axis = {of[name]: i for i, name in enumerate(mesh.mesh_dim_names)}
    sizes = tuple(grid.shape[axis[r]] if r in axis else 1 for r in ROLES)
    coord = tuple(coordinate[axis[r]] if r in axis else 0 for r in ROLES)
    # the grid with one axis per role, in ROLES order (a role no dimension plays: size 1)
    order = [axis[r] for r in ROLES if r in axis]
    grid = grid.permute(*order).reshape(sizes)
    sequence = tuple(grid[coord[0]].flatten().tolist())
    if list(sequence) != sorted(sequence):
        raise ValueError(f"the mesh's (sp x ulysses) ranks read sp-major are {list(sequence)}: sparsp needs them "
                         f"ascending (ulysses varying faster than sp, as make_mesh builds it), since a process "
                         f"group orders its ranks by global rank")
    names = tuple(next((n for n, r in of.items() if r == role), None) for role in ROLES)
    return MeshLayout(sizes, names, coord, sequence)


_KEPT: dict = {}  # global ranks -> their group, made once per process (a group outlives any cache)


def _group_of(ranks: tuple[int, ...]):
    """The process group of exactly ``ranks`` (ascending): the default group where they are
    the whole world, else one made by those ranks alone and kept."""
    if list(ranks) == list(range(dist.get_world_size())):
        return None
    group = _KEPT.get(ranks)
    if group is None:
        group = _KEPT[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return group


class MeshGroups:
    """The process groups of one mesh under one ``dims`` map, made when first used (every rank
    of a group uses them in the same order, as every rank makes the same calls)."""

    def __init__(self, mesh: DeviceMesh, layout: MeshLayout) -> None:
        self.mesh = mesh
        self.layout = layout

    def _dimension(self, role: str):
        """The mesh's group of ``role``'s dimension; where no dimension plays it, this rank's
        group of one."""
        name = self.layout.names[ROLES.index(role)]
        return self.mesh.get_group(name) if name is not None else _group_of((dist.get_rank(),))

    @cached_property
    def cfg(self):
        """The group of the ``cfg`` dimension: the ranks that run the other branches."""
        return self._dimension("cfg")

    @cached_property
    def sp(self):
        """The group of the ``sp`` dimension: the ranks of the other sp slices, same piece."""
        return self._dimension("sp")

    @cached_property
    def ulysses(self):
        """The group of the ``ulysses`` dimension: the ranks holding the other pieces of this
        rank's sp slice."""
        return self._dimension("ulysses")

    @cached_property
    def sequence(self):
        """The group of the (sp × ulysses) sub-mesh, whose rank order is the sequence order
        (sp-major, ulysses-minor); where one of the two has size 1, the other's group."""
        lay = self.layout
        if lay.ulysses == 1:
            return self.sp
        if lay.sp == 1:
            return self.ulysses
        return _group_of(lay.sequence)


_GROUPS = per_geometry("mesh: each mesh's layout and groups")  # (id(mesh), dims) -> MeshGroups


def mesh_groups(mesh, dims=None) -> MeshGroups:
    """``mesh``'s ``MeshGroups`` under ``dims``, read once per (mesh, dims) and kept (the kept
    entry holds the mesh, so its id stays its own); ``ValueError`` from ``layout`` before any
    communication."""
    key = (id(mesh), tuple(dims.items()) if isinstance(dims, Mapping) else dims)
    try:
        got = _GROUPS.get(key)
    except TypeError:  # an unhashable dims: ``layout`` says what is wrong with it
        key, got = None, None
    if got is None:
        got = MeshGroups(mesh, layout(mesh, dims))
        if key is not None:
            _GROUPS[key] = got
    return got
