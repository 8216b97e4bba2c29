"""A device mesh in the cost model (``cost.mesh``, ``cost.mesh_step``): its bytes against the
flat figures and the head-restricted masks, its Ulysses all-to-all against flat ``ulysses``,
``best_mesh`` against a brute-force sweep, the multi-host fabric, and ``--mesh`` on the
command line."""

from __future__ import annotations

import json

import pytest
from cli_utils import run_cli

from sparsp.cost import KernelFigure, Profile, TransportFigure, timeline
from sparsp.cost.flows import capacities, fair_rates, route
from sparsp.cost.mesh import Mesh, head_pairs, mesh_comm_bytes, ulysses_heads, valid_meshes
from sparsp.cost.mesh_step import best_mesh, mesh_step
from sparsp.cost.model import Work
from sparsp.cost.profiles import PROFILES
from sparsp.cost.schedule import Schedule
from sparsp.cost.timeline import timelines
from sparsp.demand import comm_bytes as rule_bytes
from sparsp.geometry import VideoGeometry
from sparsp.placement import make_placement
from sparsp.strategies import comm_bytes
from sparsp.strategies.registry import strategies_where, strategy_names, strategy_spec
from sparsp.workloads.synthetic import synthetic_masks

GEOM = VideoGeometry(name="toy", frames=2, height=8, width=16, heads=8, head_dim=64, block_size=32, layers=2)
HOSTS = Profile(name="hosts", gpus=8, gpus_per_host=4, peer_access=True, link_gbps=100.0, hbm_gbps=1000.0,
                network_gbps=10.0, gpus_per_nic=2, network=TransportFigure(name="nccl", latency_ms=0.3),
                transports=(TransportFigure(name="ipc", latency_ms=0.05),),
                kernels=(KernelFigure(head_dim=64, sparse_tflops=50.0, dense_tflops=80.0),))
BASE = strategy_spec(strategies_where(baseline=True)[0])


@pytest.fixture(scope="module")
def masks():
    return synthetic_masks(GEOM, [0.9], layers=1)[0.9][0]


@pytest.mark.parametrize("strategy", strategy_names())
@pytest.mark.parametrize("placement", ["contiguous", "periodic"])
def test_a_mesh_of_one_ulysses_rank_moves_the_flat_bytes(masks, strategy, placement):
    pl = make_placement(placement, GEOM, 4)
    flat = comm_bytes(masks, pl, strategy, head_dim=64)
    mesh = comm_bytes(masks, pl, strategy, head_dim=64, mesh=Mesh(ulysses=1, sp=4))
    assert (mesh["total"], mesh["per_rank"]) == (flat["total"], flat["per_rank"])
    assert mesh["ulysses"]["total"] == 0 and mesh["sp"]["total"] == flat["total"]


@pytest.mark.parametrize("strategy", ["sparsp", "ring-sparse", "ring-relay"])
def test_the_sp_bytes_are_those_of_each_ulysses_ranks_heads(masks, strategy):
    pl = make_placement("periodic", GEOM, 2)
    got = comm_bytes(masks, pl, strategy, head_dim=64, mesh=Mesh(ulysses=4, sp=2))
    groups = ulysses_heads(head_pairs(masks, GEOM.block_lengths()), 4)
    assert sorted(h for g in groups for h in g) == list(range(8)) and [list(g) for g in groups] == got["heads"]
    for u, heads in enumerate(groups):
        want = rule_bytes(masks[list(heads)], pl, strategy_spec(strategy).byte_rule, head_dim=64)["per_rank"]
        assert [got["sp"]["per_rank"][r * 4 + u] for r in range(2)] == want
    assert got["total"] == got["sp"]["total"] + got["ulysses"]["total"]


def test_ulysses_over_the_whole_mesh_is_flat_ulysses(masks):
    # sp 1: one slice, cut into U pieces as contiguous placement cuts the blocks over U ranks
    mesh = comm_bytes(masks, make_placement("contiguous", GEOM, 1), "sparsp", head_dim=64, mesh=Mesh(ulysses=4))
    flat = comm_bytes(masks, make_placement("contiguous", GEOM, 4), "ulysses", head_dim=64)
    assert mesh["ulysses"]["per_rank"] == flat["per_rank"] and mesh["sp"]["total"] == 0


def test_mesh_parse_and_valid_meshes():
    assert Mesh.parse("cfg=2,ulysses=4", 16) == Mesh(cfg=2, ulysses=4, sp=2)
    assert Mesh.parse("ulysses=2", 8) == Mesh(ulysses=2, sp=4)
    for text, message in [("ulysses=3", "does not divide 8 ranks"), ("cfg=3", "cfg must be 1 or 2"),
                          ("tp=2", "expected NAME=SIZE pairs"), ("ulysses=two", "is not an int"),
                          ("ulysses=2,sp=2", "is 4 ranks, not 12")]:
        with pytest.raises(ValueError, match=message):
            Mesh.parse(text, 8 if text == "ulysses=3" else 12)
    with pytest.raises(ValueError, match="40 heads are not divisible by ulysses 16"):
        Mesh(ulysses=16, sp=1).check(40)
    assert valid_meshes(8, 8, branches=1) == [Mesh(ulysses=u, sp=8 // u) for u in (1, 2, 4, 8)]
    two = valid_meshes(8, 6, branches=2)  # ulysses divides the heads; cfg 2 only with branches
    assert Mesh(ulysses=2, sp=4) in two and Mesh(cfg=2, ulysses=2, sp=2) in two
    assert not [m for m in two if m.ulysses in (4, 8)]


def test_best_mesh_is_the_brute_force_pick(masks):
    spec, sched = strategy_spec("sparsp"), Schedule(steps=10, dense_steps=2, replan_every=3)
    best, every = best_mesh(GEOM, 8, HOSTS, strategy=spec, baseline=BASE, branches=2, schedule=sched, masks=masks)
    sweep = {m: mesh_step(masks, GEOM, m, HOSTS, spec, baseline=BASE, branches=2, schedule=sched).run["total_ms"]
             for m in valid_meshes(8, GEOM.heads, branches=2, blocks=GEOM.num_blocks)}
    assert [s.mesh for s in every] == list(sweep)
    assert best.mesh == min(sweep, key=sweep.get) and best.run["total_ms"] == min(sweep.values())
    one = best_mesh(GEOM, 8, HOSTS, strategy=spec, baseline=BASE, branches=1, masks=masks)[1]
    assert {s.mesh.cfg for s in one} == {1}  # no guidance branches: no CFG halves


def test_a_flat_mesh_step_is_the_flat_call(masks):
    from sparsp.cost import Blocks, measure, work

    spec = strategy_spec("sparsp")
    step = mesh_step(masks, GEOM, Mesh(sp=4), HOSTS, spec, baseline=BASE, branches=2, layers=3)
    d = measure(masks, Blocks.of(make_placement("periodic", GEOM, 4)))
    call = timeline(work(spec, d, head_dim=64, profile=HOSTS), HOSTS, head_dim=64).latency_ms
    assert step.call_ms["plan"] == pytest.approx(call, abs=1e-4) and step.exchange_ms == 0.0
    assert step.step_ms["plan"] == pytest.approx(2 * 3 * call, abs=1e-3)  # two branches, three layers
    halves = mesh_step(masks, GEOM, Mesh(cfg=2, sp=4), HOSTS, spec, baseline=BASE, branches=2, layers=3)
    assert halves.exchange_ms > 0 and halves.step_ms["plan"] == pytest.approx(
        3 * halves.call_ms["plan"] + halves.exchange_ms, abs=1e-3)


def test_hosts_meet_through_their_nics():
    caps = capacities(HOSTS, range(8))
    assert route(HOSTS, 0, 1, caps) == (("tx0", 1.0), ("rx1", 1.0))  # inside a host: the peer link
    assert ("nictx0", 1.0) in route(HOSTS, 0, 4, caps) and ("nicrx2", 1.0) in route(HOSTS, 0, 4, caps)
    # GPUs 0 and 1 share NIC 0: two flows out of host 0 split its 10 GB/s
    both = fair_rates({0: route(HOSTS, 0, 4, caps), 1: route(HOSTS, 1, 6, caps)}, caps)
    assert both == pytest.approx({0: 5.0, 1: 5.0})
    # a pair across hosts pays the network transport's latency, inside a host the call's
    pair = Work("x", "relay-ring", 2, ((0.0, 0.0),) * 2, ((0, 0),) * 2, ((10_000_000,),) * 2)
    inside, across = timelines([(pair, (0, 1)), (pair, (2, 4))], HOSTS, head_dim=64, skip=frozenset({"fixed"}))
    assert inside.latency_ms == pytest.approx(0.05 + 10e6 / 1000e6 + 10e6 / 100e6)
    assert across.latency_ms == pytest.approx(0.3 + 10e6 / 1000e6 + 10e6 / 10e6)


def test_the_builtin_multi_host_profiles_state_their_sources():
    hosts = [p for p in PROFILES.values() if p.hosts > 1]
    assert len(hosts) >= 3 and all(p.gpus_per_host == 8 and p.network_gbps and p.sources for p in hosts)
    assert {p.peer_access for p in hosts} == {True, False}


def test_simulate_mesh_auto_on_the_command_line(tmp_path, capsys):
    code, out, err = run_cli(capsys, ["simulate", "--model", "ltx-video", "--ranks", "2", "4", "--fabric",
                                      "pcie4-8gpu-nop2p", "--mesh", "auto", "--no-plots", "--out", tmp_path])
    assert code == 0, err
    doc = json.loads((tmp_path / "simulate.json").read_text())
    assert doc["mode"] == "mesh" and [r["ranks"] for r in doc["results"]] == [2, 4]
    for r in doc["results"]:
        fastest = min(r["candidates"], key=lambda c: c["run"]["total_ms"])
        assert r["mesh"] == fastest["mesh"] and r["flat"]["mesh"] == {"cfg": 1, "ulysses": 1, "sp": r["ranks"]}
        assert r["peers_mesh"]["strategy"] == "ring-sparse" and r["peers_mesh"]["mesh"] == r["mesh"]
        assert r["vs_flat"] == pytest.approx(r["flat_step_ms"] / r["step_ms"], rel=1e-3)
    code, _, err = run_cli(capsys, ["simulate", "--model", "ltx-video", "--ranks", "8", "--mesh", "ulysses=3",
                                    "--out", tmp_path])
    assert code == 2 and "--mesh 'ulysses=3': cfg x ulysses = 3 does not divide 8 ranks" in err


def test_analyze_reports_a_meshs_bytes_apart(tmp_path, capsys):
    code, out, err = run_cli(capsys, ["analyze", "--model", "ltx-video", "--ranks", "8", "--cdf", "0.9",
                                      "--mesh", "cfg=2,ulysses=2", "--strategy", "sparsp", "--placement", "periodic",
                                      "--no-plots", "--out", tmp_path])
    assert code == 0, err
    doc = json.loads((tmp_path / "analysis.json").read_text())
    row = doc["results"][0]
    assert doc["mesh"]["sp"] == 2 and doc["mesh"]["cfg_exchange_bytes_per_rank_per_step"] > 0
    assert row["bytes_total"] == row["sp_bytes_total"] + row["ulysses_bytes_total"] and len(row["bytes_per_rank"]) == 4
