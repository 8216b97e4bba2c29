"""``ipc`` and ``host`` transports on 2 GPUs (NCCL group): payloads arrive bit-exact.

Sizes cross the chunk size (several chunks per slot, a ragged last chunk), rounds reuse every
slot of the window, producers run a full window ahead, several fences; the host transport is
checked with stream-ordered flag writes and host-polled waits (default), with device-side
waits, and with small chunks. Run on a 2-GPU machine:

    python -m pytest -q -m gpu tests/test_transport_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

MiB = 1 << 20


def _payload(nbytes: int, device, *key: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(hash(key) & 0x7FFFFFFF)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)


def _worker(rank: int, world: int, name: str, options: dict) -> dict:
    from sparsp.transport.select import make_transport

    device = torch.device("cuda", rank)
    peer = 1 - rank
    t = make_transport(name, None, device=device, timeout_s=60, **options)
    assert t.name == name
    sizes = [2 * 1001, 1 * MiB, 3 * MiB + 6, 40 * MiB + 2]  # bf16 elements: even byte counts
    t.reserve(max(sizes))
    if name == "host":
        seg = t._segs[rank]
        assert seg.tensor.is_pinned(), "the shared segment must be pinned (cuMemHostRegister)"
    compute = torch.cuda.Stream(device)
    with torch.cuda.stream(compute):  # not the default stream: ordering must come from events
        for call in range(4):
            t.fence()
            # a full window ahead: every send before the first fetch
            for j, n in enumerate(sizes[: t.window]):
                buf = t.send_buffer(peer, n // 2, torch.bfloat16)
                buf.view(torch.uint8).copy_(_payload(n, device, call, rank, j))
                t.publish(peer, buf)
            for j, n in enumerate(sizes):
                out = torch.full((n // 2,), float("nan"), dtype=torch.bfloat16, device=device)
                t.fetch(peer, out).wait()
                got = out.view(torch.uint8)
                assert torch.equal(got, _payload(n, device, call, peer, j)), (name, call, j, n)
                t.release(peer)
                if j + t.window < len(sizes):
                    k = j + t.window
                    buf = t.send_buffer(peer, sizes[k] // 2, torch.bfloat16)
                    buf.view(torch.uint8).copy_(_payload(sizes[k], device, call, rank, k))
                    t.publish(peer, buf)
        # the ring's pattern: receive straight into the next send buffer, forward it
        t.fence()
        n = 5 * MiB
        first = t.send_buffer(peer, n, torch.uint8)
        first.copy_(_payload(n, device, 99, rank))
        t.publish(peer, first)
        nxt = t.send_buffer(peer, n, torch.uint8)
        t.fetch(peer, nxt).wait()
        t.release(peer)
        t.publish(peer, nxt)  # forwards what the peer sent us back to it
        back = torch.empty(n, dtype=torch.uint8, device=device)
        t.fetch(peer, back).wait()
        t.release(peer)
        assert torch.equal(back, _payload(n, device, 99, rank))
        t.fence()
    info = {"describe": t.describe(), "sent": dict(t.bytes_sent)}
    t.close()
    return info


CASES = [
    ("ipc", {}),
    ("ipc", {"stream_waits": False}),
    ("host", {}),
    ("host", {"stream_waits": False}),
    ("host", {"chunk_bytes": 1 * MiB, "window": 2}),
]


@pytest.mark.parametrize("name, options", CASES, ids=lambda c: str(c))
def test_transport_moves_data_exactly(name, options):
    infos = run_distributed(_worker, 2, name, options, timeout=300, backend="nccl")
    for info in infos:
        print(info["describe"])
        assert sum(info["sent"].values()) > 0
        if name == "ipc":  # our own copy engine reads the peer's window
            assert "pull: " in info["describe"]
        if options.get("stream_waits") is False:  # host threads wait for the flags
            assert "host-polled waits" in info["describe"]


def _auto(rank: int, world: int) -> str:
    from sparsp.transport.select import make_transport

    t = make_transport("auto", None, device=torch.device("cuda", rank), timeout_s=60)
    name = t.name
    t.close()
    return name


def test_auto_picks_ipc_with_peer_access():
    names = run_distributed(_auto, 2, timeout=300, backend="nccl")
    expected = "ipc" if torch.cuda.can_device_access_peer(0, 1) else "host"
    assert names == [expected, expected]


def _silent_peer(rank: int, world: int, name: str) -> dict:
    """Rank 0 fetches a payload rank 1 never publishes, with the wait left to the GPU; then
    both fence (the transport is usable again) and close."""
    import time

    from sparsp.transport.select import make_transport

    device = torch.device("cuda", rank)
    t = make_transport(name, None, device=device, timeout_s=2.0)
    t.reserve(4 * MiB)
    t.fence()
    got = {"describe": t.describe()}
    if rank == 0:
        out = torch.zeros(MiB, dtype=torch.uint8, device=device)
        t0 = time.monotonic()
        t.fetch(1, out).wait()  # only orders the stream: returns at once
        got["wait_s"] = time.monotonic() - t0
        # a new allocation (cudaMalloc) blocks the host behind the blocked stream: measured
        # 2.0 s here, until the watchdog let the stream go at the deadline
        torch.ones(1, device=device).add_(1)
        try:
            t.settle()
        except TimeoutError as e:
            got["error"] = str(e)
        got["settle_s"] = time.monotonic() - t0
        torch.cuda.synchronize(device)  # the stream was let go: this returns
        got["sync_s"] = time.monotonic() - t0
    else:
        t.timeout_s = 20.0  # rank 0 reaches the fence after its settle timed out
    t.fence()
    t.close()
    return got


@pytest.mark.parametrize("name", ["ipc", "host"])
def test_silent_peer_raises_in_settle_and_frees_the_stream(name):
    got = run_distributed(_silent_peer, 2, name, timeout=120, backend="nccl")[0]
    print(got)
    assert "stream waits" in got["describe"], got
    assert name != "ipc" or "pull: " in got["describe"], got  # the default copy path
    assert got["wait_s"] < 0.5, got  # no host poll in wait()
    assert "from peer 1" in got["error"] and "not published" in got["error"], got
    assert 2.0 <= got["settle_s"] < 4.0 and got["sync_s"] < got["settle_s"] + 2.0, got
