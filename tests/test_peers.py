"""Per-peer transports: two hosts emulated in one machine (``SPARSP_HOST_ID``), the pairs on one
host forced onto ``host`` (``SparspConfig.local_transport``: its own rule declines CPU tensors),
the pairs between hosts on ``nccl`` (gloo) — in the same call.

Checked per strategy at G = 4 and 6: the output against a float64 single-process reference,
the bytes each rank received against the byte rule (``comm_bytes``), the transport of every
pair, the counters summed over the sub-transports; then a silent peer's timeout names it in the
caller's numbering, and nothing is left in /dev/shm after close.
"""

import os

import pytest
import torch

from dist_utils import placed_run, run_distributed


def _emulate_hosts(rank: int, world: int, hosts: int = 2) -> int:
    host = rank * hosts // world  # ranks 0..G/2-1 on host0, the rest on host1
    os.environ["SPARSP_HOST_ID"] = f"host{host}"
    return host


def _mixed_worker(rank, world, cdf):
    from sparsp.geometry import VideoGeometry
    from sparsp.strategies import close_transports, get_transport
    from sparsp.transport.peers import PeerTransport

    host = _emulate_hosts(rank, world)
    geom = VideoGeometry(frames=4, height=4, width=12, text_tokens=10, block_size=16, heads=12, head_dim=8)
    H = geom.heads
    t = get_transport("auto", None, torch.device("cpu"), 60.0, "host")
    assert isinstance(t, PeerTransport), t.describe()
    # the transport of every pair: host inside a host, nccl (gloo) between hosts
    for p in range(world):
        if p != rank:
            same = p * 2 // world == host
            assert t.transport_of(p) == ("host" if same else "nccl"), (p, t.describe())
    for a in range(world):
        for b in range(world):
            if a != b:
                assert t.plan[a][b] == ("host" if a * 2 // world == b * 2 // world else "nccl")
    text = t.describe()
    assert "host for 0-1" in text and f"nccl for 0-{world // 2}" in text, text
    names = sorted(name for name, _, _ in t.sub_transports())
    assert names == ["host", "nccl"], names
    moved = {}
    for kind in ("contiguous", "periodic"):
        def after(strategy, tr, kind=kind):
            # the composite's counters are the sub-transports', translated to group ranks
            subs = {name: sub.total_received for name, _, sub in tr.sub_transports()}
            assert sum(subs.values()) == tr.total_received
            by_kind = {"host": 0, "nccl": 0}
            for p, n in tr.bytes_received.items():
                by_kind[tr.transport_of(p)] += n
            assert by_kind == subs, (strategy, by_kind, subs)
            assert sum(tr.bytes_sent.values()) == sum(sum(sub.bytes_sent.values()) for _, _, sub in tr.sub_transports())
            moved[(kind, strategy)] = by_kind

        runs = placed_run(rank, world, geom, kind, cdf, 5, transport="auto", local_transport="host",
                          after=after)
        for strategy, (err, received, predicted) in runs.items():
            assert err <= 1e-5, f"{strategy} ({kind}): error {err}"
            assert received == predicted, (strategy, kind, received, predicted)
    # ulysses is an all-to-all: both transports moved bytes in the same call on every rank
    if H % world == 0:
        both = moved[("contiguous", "ulysses")]
        assert both["host"] > 0 and both["nccl"] > 0, both
    both = moved[("periodic", "sparsp")]
    close_transports()
    close_transports()  # safe twice
    return os.getpid(), both


@pytest.mark.parametrize("world", [4, 6])
def test_mixed_host_and_nccl_pairs_match_reference_and_bytes(world):
    results = run_distributed(_mixed_worker, world, 0.8, timeout=300)
    pids = {pid for pid, _ in results}
    # sparsp fetches from every peer it demands from: across the ranks, both paths carried bytes
    assert sum(b["host"] for _, b in results) > 0 and sum(b["nccl"] for _, b in results) > 0
    left = [n for n in os.listdir("/dev/shm") if n.startswith("sparsp-")
            and any(f".{pid}." in n for pid in pids)]
    assert not left, f"segments left behind: {left}"


def _timeout_worker(rank, world):
    import time

    import torch.distributed as dist

    from sparsp.transport import make_transport

    _emulate_hosts(rank, world)
    t = make_transport("auto", None, device="cpu", timeout_s=1.0, local="host")
    assert t.name == "peers"
    t.reserve(4096)
    t.fence()
    message = None
    if rank == 1:  # rank 0 (same host, ``host`` transport) never publishes: a named timeout
        start = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            t.fetch(0, torch.empty(16)).wait()
        assert time.monotonic() - start < 20
        message = str(e.value)
    dist.barrier()
    t.close()
    t.close()
    return message


def test_silent_peer_times_out_naming_it():
    messages = run_distributed(_timeout_worker, 4, timeout=120)
    text = messages[1]
    assert text.startswith("rank 1: fetch from peer 0 over host"), text
    assert "sub-group of ranks [0, 1]" in text and "not published within" in text, text


def test_bad_local_transport_is_a_clear_error():
    from sparsp import SparspConfig
    from sparsp.transport.base import Topology
    from sparsp.transport.select import choose

    with pytest.raises(ValueError, match="local_transport='tcp' is not a transport"):
        choose(Topology("cpu", 2, True, True, False), local="tcp")
    with pytest.raises(ValueError, match="local_transport must be None or one of host, ipc, nccl; got 'peers'"):
        SparspConfig(local_transport="peers")


def test_local_transport_makes_peers_of_one_host_pairs():
    """``local`` on one host: every pair takes it, so ``auto`` builds ``peers`` with that plan
    when the rules would pick another transport for the group (CPU: gloo); with no ``local`` the
    rules' choice stands."""
    from sparsp.transport.base import Topology
    from sparsp.transport.select import choose

    topo = Topology("cpu", 3, True, True, False)
    assert choose(topo) == ("nccl", choose(topo)[1], None)
    name, reason, plan = choose(topo, local="host")
    assert name == "peers" and reason.startswith("local_transport=host: "), reason
    assert plan == ((None, "host", "host"), ("host", None, "host"), ("host", "host", None))
    assert choose(topo, local="nccl")[::2] == ("nccl", None)  # what the rules pick anyway
    assert choose(Topology("cpu", 1, True, True, False), local="host")[::2] == ("nccl", None)


def test_pair_rules_on_gpu_topologies():
    """The per-pair choice on described topologies (no GPU needed): what ``auto`` builds."""
    from sparsp.transport.base import Topology
    from sparsp.transport.peers import components, describe_plan, pair_plan
    from sparsp.transport.select import choose_by_rules

    def topo(hosts, peer):
        G = len(hosts)
        access = tuple(tuple(a != b and peer(a, b) for b in range(G)) for a in range(G))
        return Topology("cuda", G, len(set(hosts)) == 1, True,
                        len(set(hosts)) == 1 and all(access[a][b] for a in range(G) for b in range(G) if a != b),
                        tuple(range(G)), hosts=tuple(hosts), rank_gpus=tuple(range(G)), peer=access)

    # two hosts with NVLink inside: ipc inside, nccl between
    two = topo([0, 0, 1, 1], lambda a, b: a // 2 == b // 2)
    plan = pair_plan(two)
    assert describe_plan(plan) == "ipc for 0-1, 2-3; nccl for 0-2, 0-3, 1-2, 1-3"
    assert choose_by_rules(two)[0] == "peers"
    assert components(plan, "ipc") == [(0, 1), (2, 3)]
    # two hosts of PCIe GPUs without P2P: host inside, nccl between
    assert describe_plan(pair_plan(topo([0, 0, 1, 1], lambda a, b: False))) == \
        "host for 0-1, 2-3; nccl for 0-2, 0-3, 1-2, 1-3"
    # one host, two P2P islands (two PCIe switches): ipc inside an island, host between
    islands = topo([0, 0, 0, 0], lambda a, b: a // 2 == b // 2)
    assert describe_plan(pair_plan(islands)) == "host for 0-2, 0-3, 1-2, 1-3; ipc for 0-1, 2-3"
    assert choose_by_rules(islands)[0] == "peers"
    # uniform groups keep their one transport
    assert choose_by_rules(topo([0, 0, 0, 0], lambda a, b: True))[0] == "ipc"
    assert choose_by_rules(topo([0, 0, 0, 0], lambda a, b: False))[0] == "host"
    assert choose_by_rules(topo([0, 1, 2, 3], lambda a, b: False))[0] == "nccl"
    assert choose_by_rules(Topology("cpu", 4, True, True, False))[0] == "nccl"
