"""The ``host`` transport's slot protocol on CPU: shared memory, several processes over gloo.

What must hold (DESIGN "Decoupled transfer runtime"): payloads arrive intact for any
size up to the slot; producers run ahead by at most ``window`` slots and then wait for the
consumer's release; slots are reused across many attention calls; a flag left from an earlier
call is never taken for a fresh one; every wait ends in a ``TimeoutError`` that names the peer,
the slot and the epoch; segments are 0600 and gone from /dev/shm after a normal exit, an
exception, or (at the next start) a crash.
"""

from __future__ import annotations

import glob
import os
import random
import stat
import struct
import time

import pytest
import torch

from dist_utils import run_distributed
from sparsp.transport import flags, shm
from sparsp.transport.flags import decode_flag, encode_flag, flag_reached
from sparsp.transport.host import HostTransport
from sparsp.transport.shm import ShmSegment, sweep_stale

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16)
_KEEP: list = []  # segments a rank holds until its interpreter exits


def _leftovers(tag: str) -> list[str]:
    return glob.glob(os.path.join(shm.SHM_DIR, f"{shm.PREFIX}{tag}*"))


def _tag(label: str) -> str:
    return f"t{os.getpid()}.{label}.{random.randrange(1 << 30)}"


def _payload(nbytes: int, *key: int) -> torch.Tensor:
    """Random bytes both ends can regenerate from the message's identity."""
    g = torch.Generator().manual_seed(hash(key) & 0x7FFFFFFF)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _send(t, peer: int, numel: int, dtype, *key: int) -> int:
    buf = t.send_buffer(peer, numel, dtype)
    nbytes = numel * dtype.itemsize
    assert buf.dtype == dtype and buf.numel() == numel
    buf.view(torch.uint8).copy_(_payload(nbytes, *key))  # pack in place, into the slot
    t.publish(peer, buf)
    return nbytes


def _recv(t, peer: int, numel: int, dtype, *key: int, release: bool = True) -> int:
    out = torch.empty(numel, dtype=dtype)
    t.fetch(peer, out).wait()
    nbytes = numel * dtype.itemsize
    assert torch.equal(out.view(torch.uint8), _payload(nbytes, *key)), f"payload {key} differs"
    if release:
        t.release(peer)
    return nbytes


def _exchange(t, rank: int, world: int, numel: int, dtype, epoch: int) -> None:
    """Every rank publishes to every peer first, then fetches from every peer."""
    for p in range(world):
        if p != rank:
            _send(t, p, numel, dtype, epoch, rank, p)
    for p in range(world):
        if p != rank:
            _recv(t, p, numel, dtype, epoch, p, rank)


# --------------------------------------------------------------------------- in-process


def test_flag_encoding_and_epochs():
    rng = random.Random(0)
    for _ in range(2000):
        e, u, c = rng.randrange(1 << 20), rng.randrange(flags.MAX_USES), rng.randrange(1, 1 << 14)
        v = encode_flag(e, u, c)
        assert decode_flag(v) == (e % 256, u, c)
        assert flag_reached(v, v)
        # same epoch: reached exactly when (use, count) is at least the expected one
        u2, c2 = rng.randrange(flags.MAX_USES), rng.randrange(1, 1 << 14)
        assert flag_reached(encode_flag(e, u2, c2), v) == ((u2, c2) >= (u, c))
        # a flag from any of the 127 previous calls is never taken for this call's
        for back in (1, 2, rng.randrange(1, 128)):
            stale = encode_flag(e - back, rng.randrange(flags.MAX_USES), rng.randrange(1 << 14))
            assert not flag_reached(stale, v), (e, back)
        # the value a fence resets to means "nothing published in this epoch yet"
        assert not flag_reached(encode_flag(e, 0, 0), encode_flag(e, 0, 1))
    with pytest.raises(ValueError):
        encode_flag(0, flags.MAX_USES, 1)
    with pytest.raises(ValueError):
        encode_flag(0, 0, flags.MAX_COUNT + 1)


def test_segment_lifecycle_and_stale_cleanup():
    tag = _tag("seg")
    old_umask = os.umask(0)  # even with a permissive umask the segment is private
    try:
        a = ShmSegment.create(tag, 0, 10_000)
    finally:
        os.umask(old_umask)
    assert a.name == f"sparsp-{tag}-0" and a.size % 4096 == 0
    assert stat.S_IMODE(os.stat(a.path).st_mode) == 0o600
    b = ShmSegment.open(tag, 0)
    a.tensor[5000:5004] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert b.tensor[5000:5004].tolist() == [1, 2, 3, 4]  # one memory, two mappings
    with pytest.raises(FileExistsError, match="live process"):  # its owner (us) is alive
        ShmSegment.create(tag, 0, 4096)
    a.unlink()
    assert not os.path.exists(a.path)
    c = ShmSegment.create(tag, 0, 4096)  # the name is free again
    a.close()  # must not remove c's file, which reuses the name
    assert os.path.exists(c.path)
    b.close()
    c.close()
    assert _leftovers(tag) == []

    # a hand-made leftover with the same name (no header): reclaimed by the next create
    path = os.path.join(shm.SHM_DIR, f"sparsp-{tag}-1")
    with open(path, "wb") as f:
        f.write(b"junk" * 100)
    d = ShmSegment.create(tag, 1, 4096)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    d.close()

    # leftovers with a header: gone owner (start time differs: a reused pid) vs live owner
    me = shm._identity()
    dead = os.path.join(shm.SHM_DIR, f"sparsp-{tag}-2")
    live = os.path.join(shm.SHM_DIR, f"sparsp-{tag}-3")
    other_ns = os.path.join(shm.SHM_DIR, f"sparsp-{tag}-4")
    for p, start, ns in ((dead, me.start + 1, me.pidns), (live, me.start, me.pidns),
                         (other_ns, me.start + 1, me.pidns + 1)):
        with open(p, "wb") as f:
            f.write(shm._HEADER.pack(shm._MAGIC, me.pid, start, ns, me.boot, 4096).ljust(4096, b"\0"))
    removed = sweep_stale()
    assert f"sparsp-{tag}-2" in removed and not os.path.exists(dead)
    assert os.path.exists(live) and os.path.exists(other_ns)  # left alone
    for p in (live, other_ns):
        os.unlink(p)
    assert _leftovers(tag) == []


# --------------------------------------------------------------------------- distributed


def _run_ahead(t, rank: int, msgs: dict, call: int, slow: random.Random, sent: dict, received: dict) -> None:
    """One call's messages ``msgs[src, dst]`` (lists of (numel, dtype)): up to a full window
    to every peer before fetching anything, then fetch and send in turns (slot reuse waits)."""
    window = t.window
    peers = [p for p in range(t.world_size) if p != rank]
    out_q = {p: list(enumerate(msgs.get((rank, p), []))) for p in peers}
    inbox = {p: msgs.get((p, rank), []) for p in peers}
    for p in peers:
        for j, (numel, dtype) in out_q[p][:window]:
            sent[p] += _send(t, p, numel, dtype, call, rank, p, j)
    rounds = max([len(inbox[p]) for p in peers] + [len(q) - window for q in out_q.values()])
    for j in range(rounds):
        for p in peers:
            if j < len(inbox[p]):
                if slow.random() < 0.05:
                    time.sleep(slow.random() * 0.01)  # a slow consumer
                numel, dtype = inbox[p][j]
                received[p] += _recv(t, p, numel, dtype, call, p, rank, j)
        for p in peers:
            if j + window < len(out_q[p]):
                _, (numel, dtype) = out_q[p][j + window]
                sent[p] += _send(t, p, numel, dtype, call, rank, p, j + window)


def _soak(rank: int, world: int, seed: int, calls: int, tag: str) -> dict:
    """Random sizes and dtypes, run-ahead by a full window, slow consumers, many fences."""
    window, slot_bytes = 3, 16 << 10
    t = HostTransport(None, timeout_s=60, window=window, slot_bytes=slot_bytes, tag=tag)
    peers = [p for p in range(world) if p != rank]
    sent = {p: 0 for p in peers}
    received = {p: 0 for p in peers}
    slow = random.Random(seed * 1000 + rank)  # per rank: who dawdles where
    for call in range(calls):
        t.fence()
        assert t.epoch == call + 1
        plan = random.Random(seed * 7919 + call)  # the same on every rank: sizes are "derived"
        big = call % 50 == 0  # now and then whole slots
        msgs = {}
        for src in range(world):
            for dst in range(world):
                if src == dst:
                    continue
                n = plan.randrange(1, 8) if big else plan.randrange(0, 5)
                out = []
                for _ in range(n):
                    dtype = plan.choice(DTYPES)
                    cap = slot_bytes // dtype.itemsize
                    numel = cap if plan.random() < 0.2 else plan.randrange(0, cap + 1)
                    out.append((numel if big or plan.random() < 0.9 else 0, dtype))
                msgs[src, dst] = out
        _run_ahead(t, rank, msgs, call, slow, sent, received)
    assert dict(t.bytes_sent) == {p: n for p, n in sent.items() if n}
    assert dict(t.bytes_received) == {p: n for p, n in received.items() if n}
    t.close()
    return {"sent": sum(sent.values()), "received": sum(received.values())}


def _lagging_resets(rank: int, world: int, calls: int, tag: str) -> dict:
    """``fence`` meets the group once, before the flag reset: a rank may still be resetting
    its words while a peer already publishes and fetches in the new epoch. Here every rank
    sometimes dawdles right before its reset, and one pair stays silent for longer than the
    epoch counter's half range (128 calls) before it talks again: every payload must still
    arrive intact and no old flag may pass for a new one."""
    window, slot_bytes = 2, 4096
    t = HostTransport(None, timeout_s=60, window=window, slot_bytes=slot_bytes, tag=tag)
    lag = random.Random(31 + rank)
    reset = t._reset_flags

    def late_reset() -> None:
        if lag.random() < 0.3:
            time.sleep(lag.random() * 0.004)
        reset()

    t._reset_flags = late_reset
    peers = [p for p in range(world) if p != rank]
    sent = {p: 0 for p in peers}
    received = {p: 0 for p in peers}
    slow = random.Random(7 + rank)
    for call in range(calls):
        t.fence()
        plan = random.Random(call)  # the same on every rank
        msgs = {}
        for src in range(world):
            for dst in range(world):
                silent = {src, dst} == {0, 1} and call % 137 != 136  # talks at calls 136 and 273
                if src != dst and not silent and plan.random() < 0.6:
                    msgs[src, dst] = [(plan.randrange(1, slot_bytes // 4 + 1), torch.float32)
                                      for _ in range(plan.randrange(1, 2 * window + 2))]
        _run_ahead(t, rank, msgs, call, slow, sent, received)
    t.close()
    return {"sent": sent, "received": received}


def test_soak_random_sizes_window_and_many_fences():
    tag = _tag("soak")
    stats = run_distributed(_soak, 4, 3, 200, tag, timeout=150)
    assert sum(s["sent"] for s in stats) == sum(s["received"] for s in stats) > 0
    assert _leftovers(tag) == []


def test_a_peer_in_the_next_epoch_before_our_flag_reset_reads_nothing_stale():
    tag = _tag("lag")
    calls = 300  # past 2 x 128 epochs: the silent pair spans the counter's wrap
    stats = run_distributed(_lagging_resets, 3, calls, tag, timeout=150)
    for src in range(3):
        for dst in range(3):
            if src != dst:
                assert stats[src]["sent"][dst] == stats[dst]["received"][src]
    assert stats[0]["sent"][1] > 0 and stats[1]["sent"][0] > 0  # the silent pair did talk
    assert _leftovers(tag) == []


def _failures(rank: int, world: int, tag: str) -> None:
    """Timeouts that name peer/slot/epoch; stale flags rejected; the window bounds run-ahead."""
    window = 2
    t = HostTransport(None, timeout_s=30, window=window, slot_bytes=4096, tag=tag)
    short = 0.5

    # epoch 1: rank 0 waits for a payload rank 2 never publishes
    t.fence()
    if rank == 0:
        t.timeout_s = short
        with pytest.raises(TimeoutError) as err:
            t.fetch(2, torch.empty(16))
        msg = str(err.value)
        assert "peer 2" in msg and "slot 0" in msg and "epoch 1" in msg, msg
        t.timeout_s = 30

    # epoch 2: rank 1 fills its window to rank 0, which never releases; then it must wait,
    # and the wait ends with an error naming peer, slot and epoch
    t.fence()
    if rank == 1:
        for j in range(window):
            _send(t, 0, 100, torch.float32, 2, j)
        t.timeout_s = short
        with pytest.raises(TimeoutError) as err:
            t.send_buffer(0, 100, torch.float32)
        msg = str(err.value)
        assert "peer 0" in msg and "slot 0" in msg and "epoch 2" in msg and "released" in msg
        t.timeout_s = 30

    # epoch 3: what rank 1 published in epoch 2 and nobody fetched is stale: not delivered
    t.fence()
    if rank == 0:
        t.timeout_s = short
        with pytest.raises(TimeoutError, match=r"epoch 3 .*flag holds epoch 3 use 0 count 0"):
            t.fetch(1, torch.empty(100))
        # forge the flag a publish in the previous call leaves behind: still not accepted
        words = t._flags[1]
        words[t._layout.published(0, 0)] = encode_flag(t.epoch - 1, 0, 1)
        with pytest.raises(TimeoutError, match=r"slot 0 .*epoch 3 .*flag holds epoch 2 use 0"):
            t.fetch(1, torch.empty(100))
        t.timeout_s = 30

    # epoch 4: the window lets a producer run exactly `window` slots ahead, then it waits
    t.fence()
    if rank == 1:
        time.sleep(1.5)  # a slow consumer
        for j in range(window + 1):
            _recv(t, 0, 64, torch.int64, 4, j)
    elif rank == 0:
        t0 = time.monotonic()
        for j in range(window):
            _send(t, 1, 64, torch.int64, 4, j)
        ahead = time.monotonic() - t0
        _send(t, 1, 64, torch.int64, 4, window)  # needs rank 1's first release
        waited = time.monotonic() - t0
        assert ahead < 0.5 and waited > 0.9, (ahead, waited)

    # epoch 5: settle(), the host check of waits left to the GPU (what a CUDA fetch with
    # stream waits registers): a published payload passes at once; one never published raises
    # naming peer, slot and epoch, and the awaited value is stored so a blocked stream runs on
    t.fence()
    if rank == 1:
        _send(t, 0, 50, torch.float32, 5, 0)
    elif rank == 0:
        t.timeout_s = short  # each wait's deadline: its registration + the timeout
        t0 = time.monotonic()
        t._await_on_gpu(1, 0, 0, 1, t.epoch)  # rank 1's first payload: published below
        t._await_on_gpu(2, 0, 0, 1, t.epoch)  # rank 2 never sends one
        with pytest.raises(TimeoutError, match=r"peer 2: slot 0 .*epoch 5 not published"):
            t.settle()
        assert short <= time.monotonic() - t0 < short + 1.0
        index = t._layout.published(0, 0)
        assert flag_reached(t._flags[2][index], encode_flag(t.epoch, 0, 1))  # unblocked
        assert flag_reached(t._flags[1][index], encode_flag(t.epoch, 0, 1))  # really published
        t.settle()  # nothing left to check
        # the host blocked elsewhere past the deadline: the watchdog lets the stream go and
        # the error waits for settle
        index = t._layout.published(0, 1)
        t._await_on_gpu(2, 1, 0, 1, t.epoch)
        time.sleep(short + 0.5)
        assert flag_reached(t._flags[2][index], encode_flag(t.epoch, 0, 1))  # released
        with pytest.raises(TimeoutError, match=r"peer 2: slot 1 .*epoch 5 not published.*released"):
            t.settle()
        t.settle()  # reported once
        t.timeout_s = 30
        _recv(t, 1, 50, torch.float32, 5, 0)

    # epoch 6: after all this, a plain all-to-all still works
    t.fence()
    _exchange(t, rank, world, 333, torch.bfloat16, 6)

    # a fence that a peer never joins: the error names the missing peer
    if rank == 2:
        time.sleep(2.0)
    else:
        t.timeout_s = short
        with pytest.raises(TimeoutError, match=r"fence .*peer 2 did not arrive"):
            t.fence()
    t.close()


def test_timeouts_stale_flags_and_window():
    tag = _tag("fail")
    run_distributed(_failures, 3, tag, timeout=120)
    assert _leftovers(tag) == []


def _raise_in_one_rank(rank: int, world: int, tag: str) -> None:
    t = HostTransport(None, timeout_s=20, slot_bytes=8192, tag=tag)
    seg = t._segs[rank]
    assert stat.S_IMODE(seg.fstat().st_mode) == 0o600
    assert not os.path.exists(seg.path)  # unlinked as soon as every peer had mapped it
    _KEEP.append(ShmSegment.create(tag + ".raw", rank, 4096))  # nobody closes or unlinks it
    t.fence()
    for p in range(world):
        if p != rank:
            _send(t, p, 10, torch.float32, rank, p)
    if rank == 1:
        raise RuntimeError("boom in rank 1")
    for p in range(world):
        if p not in (rank, 1):
            _recv(t, p, 10, torch.float32, p, rank)
    t.close()


def test_no_segment_left_after_an_exception():
    tag = _tag("exc")
    with pytest.raises(RuntimeError, match="boom in rank 1"):
        run_distributed(_raise_in_one_rank, 3, tag, timeout=90)
    assert _leftovers(tag) == []


def _crash(rank: int, world: int, tag: str) -> None:
    seg = ShmSegment.create(tag, rank, 4096)  # crash inside the create → unlink window
    os._exit(3 + 0 * seg.size)


def _restart(rank: int, world: int, tag: str) -> int:
    from sparsp.transport.select import make_transport
    from sparsp.transport.nccl import P2PTransport

    t = make_transport("host", None, timeout_s=30, slot_bytes=4096, tag=tag)
    assert isinstance(t, HostTransport) and t.slot_bytes == 4096
    t.fence()
    for p in range(world):
        if p != rank:
            _send(t, p, 1024, torch.float32, 1, rank, p)
            _recv(t, p, 1024, torch.float32, 1, p, rank)
    t.reserve(100)  # fits already: nothing happens, no fence
    assert t.slot_bytes == 4096 and t.epoch == 1
    t.reserve(100_000)  # collective re-export with larger slots
    assert t.slot_bytes >= 100_000 and t.epoch == 2
    t.fence()
    _exchange(t, rank, world, 25_000, torch.float32, 2)
    with pytest.raises(ValueError, match="reserve"):
        t.send_buffer((rank + 1) % world, 200_000, torch.uint8)
    t.close()
    t.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        t.fence()

    # auto on CPU is torch.distributed (gloo); an explicit name ignores ``local``
    assert isinstance(make_transport("auto", None), P2PTransport)
    assert isinstance(make_transport("nccl", None, local="host"), P2PTransport)

    # settings that differ between ranks are caught at export, on every rank
    with pytest.raises(ValueError, match="differ between ranks"):
        HostTransport(None, window=2 + (rank == 0), tag=tag + ".bad")
    return rank


def test_crash_leftover_is_reclaimed_at_next_start():
    tag = _tag("crash")
    with pytest.raises(RuntimeError, match="exited with code 3"):
        run_distributed(_crash, 1, tag, timeout=60)
    # what the crashed run left, plus a hand-made file with the same name as rank 1's
    assert _leftovers(tag) == [os.path.join(shm.SHM_DIR, f"sparsp-{tag}-0")]
    with open(os.path.join(shm.SHM_DIR, f"sparsp-{tag}-1"), "wb") as f:
        f.write(struct.pack("<8s", b"garbage!"))
    assert run_distributed(_restart, 3, tag, timeout=120) == [0, 1, 2]
    assert _leftovers(tag) == []


def _chunk_arg(rank: int, world: int, tag: str, values: list) -> tuple:
    """Each rank builds a transport with its own ``chunk_bytes`` (None: the default)."""
    options = {} if values[rank] is None else {"chunk_bytes": values[rank]}
    try:
        t = HostTransport(None, timeout_s=20, slot_bytes=8192, tag=tag, **options)
    except ValueError as e:
        return None, str(e)
    try:
        return t.chunk_bytes, [hi - lo for _, lo, hi in t._chunks(150 << 10)]
    finally:
        t.close()


def test_chunk_bytes_default_argument_and_agreement():
    # the default (16 MiB); a given size, whose chunks cut every payload; ranks that disagree
    # refuse the transport, naming it
    got = run_distributed(_chunk_arg, 2, _tag("chunkdefault"), [None, None], timeout=90)
    assert got == [(16 << 20, [150 << 10])] * 2
    got = run_distributed(_chunk_arg, 2, _tag("chunkarg"), [64 << 10, 64 << 10], timeout=90)
    assert got == [(64 << 10, [64 << 10, 64 << 10, 22 << 10])] * 2
    got = run_distributed(_chunk_arg, 2, _tag("chunkdiffer"), [64 << 10, 128 << 10], timeout=90)
    assert all(size is None and "chunk_bytes" in err for size, err in got), got
    with pytest.raises(ValueError, match="chunk_bytes=1024 must be >= 4096"):
        HostTransport(None, chunk_bytes=1024)
