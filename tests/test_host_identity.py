"""A rank's host, as the transports see it (``transport.topology.host_id``): ``SPARSP_HOST_ID``
where set, else the node ``torchrun`` names, else the machine's own identity."""

from __future__ import annotations


def test_a_hosts_identity_is_sparsp_host_id_then_torchrun_then_the_machine(monkeypatch):
    from sparsp import env
    from sparsp.transport.topology import host_id, hosts_told

    for name in ("SPARSP_HOST_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not hosts_told() and env.torchrun_node() is None
    machine = host_id()
    monkeypatch.setenv("GROUP_RANK", "3")
    assert host_id() == machine  # GROUP_RANK alone is not torchrun's
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert env.torchrun_node() == (3, 8) and host_id() == "node:3" and hosts_told()
    monkeypatch.setenv("SPARSP_HOST_ID", "a")
    assert host_id() == "id:a"
