"""``sp_attention`` on a device mesh (``sparsp.mesh``, ``strategies/meshed.py``), on 4 gloo ranks.

Ulysses U × sp R equals the single-process reference of the R sp slices
(``reference_sp_attention(lens=<the slices>)``, what ``parallelize(emulate_ranks=R)`` runs) for
every strategy, at cdf 0.9 and, at cdf 1.0, dense attention; the sp dimension moves what the
flat strategy moves; a mesh call issues one collective and two host reads, a mesh of ulysses 1
exactly what ``group=`` does; a bad mesh is one line before any communication; a schedule's
reuse steps issue none. All of it runs in one 4-rank process group (``_worker``), whose results
the tests below read.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import ScheduleReference, count_collectives, run_distributed, structured_inputs

B, H, D, BS = 1, 4, 16, 16
LENS = [64, 75]  # two sp slices; the second ends in a short block: pieces (32, 32) and (48, 27)
STRATEGIES = ["sparsp", "ring", "ring-sparse", "ring-relay", "ulysses", "auto"]
BF16_TOL = 3e-2  # bf16 inputs and output against the reference on the same bf16 inputs: a few ulps of O(1) values


def _inputs(seed, S, heads=H, steps=None):
    """q, k, v [B, S, heads, D]: heads 0 and 1 nearly uniform (dense masks), the others sharp
    (sparse), so that balancing the heads over Ulysses ranks moves some. ``steps``: a stack of
    that many, each a little changed (a denoising run's masks move little)."""
    q, k, v = structured_inputs(seed, B, S, heads, D)
    scale = torch.tensor([0.2, 0.2] + [2.0] * (heads - 2)).view(1, 1, heads, 1)
    q = q * scale
    if steps is None:
        return q, k, v
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.stack([t + 0.05 * s * torch.randn(t.shape, generator=g) for s in range(steps)]) for t in (q, k, v)]


def _piece(rank, lens, U):
    """This rank's tokens of the whole sequence: piece u of sp slice r."""
    from sparsp.placement import ulysses_pieces

    r, u = divmod(rank, U)
    pieces = ulysses_pieces(lens[r], BS, U)
    a = sum(lens[:r]) + sum(pieces[:u])
    return slice(a, a + pieces[u])


def _config(cdf=0.9, **fields):
    from sparsp import SparspConfig

    return SparspConfig(cdf_threshold=cdf, block_size=BS, transport=fields.pop("transport", "nccl"), kernel="torch",
                        **fields)


def _against_reference(rank, mesh, dims, U, lens, strategy, cfg, dtype=torch.float32, heads=H):
    """(max abs error against the reference of the sp slices, this rank's output)."""
    from sparsp import sp_attention
    from sparsp.integrations.reference import reference_sp_attention
    from sparsp.strategies import auto

    q, k, v = (t.to(dtype) for t in _inputs(3, sum(lens), heads))
    sl = _piece(rank, lens, U)
    out = sp_attention(*(t[:, sl].contiguous() for t in (q, k, v)), mesh=mesh, dims=dims, strategy=strategy,
                       config=cfg)
    ran = auto.last_decision().strategy if strategy == "auto" else strategy
    want = reference_sp_attention(q, k, v, lens=lens, strategy=ran, config=cfg)[:, sl]
    return (out.double() - want.double()).abs().max().item(), out


def _strategies(rank, mesh):
    """Every strategy at ulysses 2 × sp 2; cdf 1.0 against dense attention; bf16."""
    from sparsp.integrations.reference import reference_sp_attention

    errors = {s: _against_reference(rank, mesh, None, 2, LENS, s, _config())[0] for s in STRATEGIES}
    q, k, v = _inputs(3, sum(LENS))
    sparse = reference_sp_attention(q, k, v, lens=LENS, config=_config())
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
    sl = _piece(rank, LENS, 2)
    _, out = _against_reference(rank, mesh, None, 2, LENS, "sparsp", _config(1.0))
    return {"errors": errors, "masked": (sparse.double() - dense).abs().max().item(),
            "dense": (out.double() - dense[:, sl]).abs().max().item(),
            "bf16": _against_reference(rank, mesh, None, 2, LENS, "sparsp", _config(), torch.bfloat16)[0]}


def _bytes(rank, mesh):
    """Per strategy: the sp group's bytes of a mesh call at this rank, and a flat call's over
    the sp group on the whole slice with this rank's heads (those the mesh call gave it: its
    plan step keeps the order)."""
    from sparsp import sp_attention
    from sparsp.mesh import mesh_groups
    from sparsp.strategies import get_transport, schedule

    sp = mesh_groups(mesh).sp
    transport = get_transport("nccl", sp, torch.device("cpu"), 60.0)
    q, k, v = _inputs(3, sum(LENS))
    r, u = divmod(rank, 2)
    whole, piece = slice(sum(LENS[:r]), sum(LENS[:r + 1])), _piece(rank, LENS, 2)
    moved = {}
    for strategy in ("sparsp", "ring-sparse", "ring"):
        transport.fence()
        transport.reset_counters()
        sp_attention(*(t[:, piece].contiguous() for t in (q, k, v)), mesh=mesh, strategy=strategy,
                     config=_config(replan_every=2), layer=0, step=0)  # a plan step: its head order is kept
        transport.fence()
        mesh_bytes = transport.total_received
        (plan,) = schedule._PLANS.values()
        schedule.forget(None)
        heads = list((plan.order or tuple(range(H)))[2 * u:2 * u + 2])
        transport.reset_counters()
        sp_attention(*(t[:, whole][:, :, heads].contiguous() for t in (q, k, v)), group=sp, strategy=strategy,
                     config=_config())
        transport.fence()
        moved[strategy] = (mesh_bytes, transport.total_received, plan.order)
    return moved


def _counts(rank, mesh, flat_mesh):
    """(collectives, host reads) of a warm mesh call; a ulysses-1 mesh's and ``group=``'s, with
    whether their outputs are equal."""
    from sparsp import sp_attention
    from sparsp.mesh import mesh_groups

    q, k, v = _inputs(5, sum(LENS))
    x = [t[:, _piece(rank, LENS, 2)].contiguous() for t in (q, k, v)]
    flat = [t[:, 32 * rank:32 * rank + 32].contiguous() for t in (q, k, v)]  # 4 slices of 32
    counted = count_collectives()
    got, outs = {}, {}
    for name, call in (("mesh", lambda: sp_attention(*x, mesh=mesh, config=_config())),
                       ("ulysses 1", lambda: sp_attention(*flat, mesh=flat_mesh, config=_config())),
                       ("group", lambda: sp_attention(*flat, group=mesh_groups(flat_mesh).sp, config=_config()))):
        call()  # the geometry's first call reads its headers once more
        before = (counted["n"], counted["reads"])
        outs[name] = call()
        got[name] = (counted["n"] - before[0], counted["reads"] - before[1])
    counted["undo"]()
    return got, torch.equal(outs["ulysses 1"], outs["group"])


def _other_meshes(rank):
    """Ulysses 4 × sp 1 (4 heads, then 8), a one-dimension mesh named otherwise, a user's mesh
    with ``dims=``: errors, and whether the user's mesh gives make_mesh's output."""
    from torch.distributed.device_mesh import init_device_mesh

    from sparsp import make_mesh

    four, one_d = make_mesh(ulysses=4), init_device_mesh("cpu", (4,), mesh_dim_names=("u",))
    errors = {f"ulysses 4, {s}": _against_reference(rank, four, None, 4, [128], s, _config())[0]
              for s in ("sparsp", "ring", "ulysses")}
    errors["ulysses 4, 8 heads"] = _against_reference(rank, four, None, 4, [128], "sparsp", _config(), heads=8)[0]
    errors["dims={'ulysses': 'u'}"] = _against_reference(rank, one_d, {"ulysses": "u"}, 4, [128], "sparsp",
                                                         _config())[0]
    user = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    err, out = _against_reference(rank, user, {"sp": "ring", "ulysses": "ulysses"}, 2, LENS, "sparsp", _config())
    errors["dims={'sp': 'ring', ...}"] = err
    same = torch.equal(out, _against_reference(rank, make_mesh(ulysses=2), None, 2, LENS, "sparsp", _config())[1])
    return errors, same


def _hosts(rank, mesh):
    """Two emulated hosts (ranks 0-1, 2-3: ``SPARSP_HOST_ID`` set at the worker's start) with
    the ``auto`` transport: the error, and the transports of the Ulysses and sp groups."""
    from sparsp.mesh import mesh_groups
    from sparsp.strategies import get_transport

    cfg = _config(transport="auto", local_transport="host")
    err = _against_reference(rank, mesh, None, 2, LENS, "sparsp", cfg)[0]
    groups = mesh_groups(mesh)
    return err, [get_transport("auto", g, torch.device("cpu"), cfg.timeout_s, "host").name
                 for g in (groups.ulysses, groups.sp)]


def _refusals(rank):
    """Each bad mesh's message and the collectives issued before it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from sparsp import make_mesh, sp_attention

    q = _inputs(3, 64)[0][:, 16 * rank:16 * rank + 16].contiguous()
    three = q[:, :, :3].contiguous()  # 3 heads for ulysses 2
    cfg2, user = make_mesh(cfg=2, ulysses=2), init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    crossed = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("sp", "ulysses"))
    mesh = make_mesh(ulysses=2)
    cases = [lambda: make_mesh(cfg=3), lambda: make_mesh(ulysses=2, sp=3),
             lambda: sp_attention(q, q, q, mesh=cfg2), lambda: sp_attention(q, q, q, mesh=user),
             lambda: sp_attention(q, q, q, mesh=user, dims={"ring": "ring", "ulysses": "ulysses"}),
             lambda: sp_attention(q, q, q, mesh=user, dims={"sp": "rnig", "ulysses": "ulysses"}),
             lambda: sp_attention(three, three, three, mesh=mesh),
             lambda: sp_attention(q, q, q, mesh=crossed),
             lambda: sp_attention(q, q, q, mesh=mesh, group=dist.group.WORLD),
             lambda: sp_attention(q, q, q, dims={"sp": "sp"})]
    got = []
    counted = count_collectives()
    for case in cases:
        before = counted["n"]
        try:
            case()
            got.append(("no error", 0))
        except ValueError as e:
            got.append((str(e), counted["n"] - before))
    counted["undo"]()
    return got


def _bad_cut(rank, mesh):
    """Pieces of 24 tokens (not whole 16-token blocks): every rank's message, after the
    metadata all-gather, before any payload; then a good call on the same mesh still runs."""
    from sparsp import sp_attention

    q, k, v = _inputs(3, 96)
    try:
        sp_attention(*(t[:, 24 * rank:24 * rank + 24].contiguous() for t in (q, k, v)), mesh=mesh, config=_config())
        message = "no error"
    except ValueError as e:
        message = str(e)
    return message, _against_reference(rank, mesh, None, 2, LENS, "sparsp", _config())[0]


def _scheduled(rank, mesh):
    """Six steps (dense, plan, reuse, plan, reuse, plan) against the reference under the same
    schedule: errors, collectives and host reads per step, and the kept plan's head order."""
    from sparsp import sp_attention
    from sparsp.strategies import schedule

    steps = 6
    cfg = _config(0.8, dense_steps=1, replan_every=2)
    ref = ScheduleReference(LENS, cfg)
    q, k, v = _inputs(11, sum(LENS), steps=steps)
    sl = _piece(rank, LENS, 2)
    counted = count_collectives()
    errors, issued = [], []
    for s in range(steps):
        before = counted["n"] + counted["reads"]
        out = sp_attention(*(t[s][:, sl].contiguous() for t in (q, k, v)), mesh=mesh, config=cfg, layer=0, step=s)
        issued.append(counted["n"] + counted["reads"] - before)
        errors.append((out.double() - ref.step(s, q[s], k[s], v[s], "sparsp")[:, sl].double()).abs().max().item())
    counted["undo"]()
    orders = [plan.order for plan in schedule._PLANS.values()]
    return errors, issued, orders


def _worker(rank, world):
    os.environ["SPARSP_HOST_ID"] = f"host{rank // 2}"  # read by the auto transport's topology only
    from sparsp import make_mesh
    from sparsp.strategies import close_transports

    mesh = make_mesh(ulysses=2)
    results = {"strategies": _strategies(rank, mesh), "bytes": _bytes(rank, mesh),
               "counts": _counts(rank, mesh, make_mesh()), "others": _other_meshes(rank),
               "hosts": _hosts(rank, mesh), "refusals": _refusals(rank), "bad cut": _bad_cut(rank, mesh),
               "scheduled": _scheduled(rank, mesh)}
    close_transports()
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_worker, 4, timeout=400)


def test_every_strategy_at_ulysses_2_sp_2_equals_the_reference(ranks):
    for rank, res in enumerate(ranks):
        got = res["strategies"]
        assert max(got["errors"].values()) < 1e-5, (rank, got["errors"])
        assert got["masked"] > 1e-2, "cdf 0.9 drops blocks: the sparse reference is not dense attention"
        assert got["dense"] < 1e-5, (rank, got["dense"])  # cdf 1.0: dense attention, fp32
        assert got["bf16"] < BF16_TOL, (rank, got["bf16"])


def test_the_sp_dimension_moves_what_the_flat_strategy_moves_for_its_heads(ranks):
    for rank, res in enumerate(ranks):
        for strategy, (mesh, flat, order) in res["bytes"].items():
            assert mesh == flat > 0, (rank, strategy, mesh, flat)
    assert any(order is not None for res in ranks for _, _, order in res["bytes"].values()), \
        "balancing moved heads in some call: the bytes are those of the heads the rank was given"


def test_a_mesh_call_issues_one_collective_and_ulysses_1_what_group_does(ranks):
    for res in ranks:
        counts, equal = res["counts"]
        assert counts["mesh"] == (1, 2)  # the metadata all-gather; the head step's and the sp step's reads
        assert counts["ulysses 1"] == counts["group"] == (1, 1)
        assert equal


def test_ulysses_4_a_one_dimension_mesh_and_a_users_mesh(ranks):
    for rank, res in enumerate(ranks):
        errors, same = res["others"]
        assert max(errors.values()) < 1e-5, (rank, errors)
        assert same, "a user's mesh with dims= gives make_mesh's output"


def test_two_emulated_hosts_take_the_host_transport_inside_and_nccl_between(ranks):
    for rank, res in enumerate(ranks):
        err, names = res["hosts"]
        assert err < 1e-5, (rank, err)
        assert names == ["peers", "nccl"], names  # the Ulysses pairs on one host: host; sp pairs: nccl


def test_a_bad_mesh_is_one_line_before_any_communication(ranks):
    got = ranks[0]["refusals"]
    for message, issued in got:
        assert "\n" not in message and issued == 0, (message, issued)
    starts = ["cfg=3 x ulysses=1 does not divide the world size 4",
              "cfg=1 x sp=3 x ulysses=2 = 6 ranks, but the world size is 4",
              "sp_attention runs over the sp and ulysses dimensions; this mesh has cfg=2",
              "the mesh dimension 'ring' (size 2) is not mapped",
              "dims names the role 'ring'; the roles are cfg, sp, ulysses",
              "dims maps sp to 'rnig', which is not a dimension of the mesh (ring, ulysses)",
              "H=3 heads do not divide over ulysses=2 (the mesh dimension 'ulysses')",
              "the mesh's (sp x ulysses) ranks read sp-major are [0, 2, 1, 3]",
              "pass group= or mesh=, not both (group= is a mesh of one sp dimension)",
              "dims= names the dimensions of a mesh: pass mesh= with it"]
    assert len(got) == len(starts)
    for (message, _), start in zip(got, starts):
        assert message.startswith(start), (message, start)


def test_pieces_not_cut_at_blocks_are_one_line_on_every_rank(ranks):
    for rank, res in enumerate(ranks):
        message, after = res["bad cut"]
        assert message == (f"the Ulysses pieces of sp slice 0 hold [24, 24] tokens: each but the last must be whole "
                           f"16-token blocks (sparsp.placement.ulysses_pieces cuts so)"), (rank, message)
        assert after < 1e-5, "the mesh stays usable"


def test_a_scheduled_mesh_run_equals_the_reference_and_reuses_its_head_order(ranks):
    for rank, res in enumerate(ranks):
        errors, issued, orders = res["scheduled"]
        assert max(errors) < 1e-5, (rank, errors)
        assert issued[2] == issued[4] == 0, issued  # reuse steps: no collective, no host read
        assert issued[1] == issued[3] == 3, issued  # plan steps: one collective, two reads
        assert len(orders) == 1 and orders[0] is not None, orders  # one plan; balancing moved heads


def _halves_worker(rank, world):
    """cfg 2 × ulysses 2 × sp 2 on 8 ranks: each half runs its own inputs on its sub-mesh."""
    from sparsp import make_mesh
    from sparsp.mesh import mesh_groups
    from sparsp.strategies import close_transports

    mesh = make_mesh(cfg=2, ulysses=2)
    half = mesh["sp", "ulysses"]
    seq = mesh_groups(half).sequence
    errors = {s: _against_reference(rank % 4, half, None, 2, LENS, s, _config(), heads=H * (1 + rank // 4))[0]
              for s in STRATEGIES}
    close_transports()
    return errors, torch.distributed.get_process_group_ranks(seq)


@pytest.mark.slow
def test_the_sub_mesh_of_each_cfg_half(request):
    """The (sp × ulysses) group of a sub-mesh that is not the world is made by its own ranks
    (each half its own, with other heads). Eight processes: only under ``pytest -m slow``."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("eight processes: pytest -m slow tests/test_mesh.py")
    for rank, (errors, ranks) in enumerate(run_distributed(_halves_worker, 8, timeout=600)):
        assert max(errors.values()) < 1e-5, (rank, errors)
        assert ranks == list(range(4 * (rank // 4), 4 * (rank // 4) + 4))


def test_ulysses_pieces_cut_a_slice_at_blocks():
    from sparsp.placement import ulysses_pieces

    assert ulysses_pieces(75, 16, 2) == (48, 27)
    assert ulysses_pieces(96, 16, 4) == (32, 32, 16, 16)
    with pytest.raises(ValueError, match="^a slice of 40 tokens has 3 blocks of 16: too few to cut into 4"):
        ulysses_pieces(40, 16, 4)


def test_make_mesh_checks_its_sizes_before_anything():
    from sparsp import make_mesh

    with pytest.raises(ValueError, match=r"^ulysses must be an int >= 1, got 0$"):
        make_mesh(ulysses=0)
    with pytest.raises(ValueError, match=r"^sp must be an int >= 1 or None, got 1.5$"):
        make_mesh(sp=1.5)
    with pytest.raises(ValueError, match=r"^make_mesh needs torch.distributed initialised"):
        make_mesh()
