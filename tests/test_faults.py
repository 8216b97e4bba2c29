"""Fault injection (issue 5, item 2): a rank that raises, dies or stalls in the middle of an
``sp_attention`` call, on CPU with 3 processes, for the ``host`` (shared memory) and ``nccl``
(gloo) transports.

What must hold for every fault: each survivor raises a clear error (``TimeoutError`` or
``RuntimeError`` naming the peer it waited for) within about ``timeout_s``; every process ends
(none is killed by the harness for hanging); nothing this test created is left in /dev/shm or
in the children's temporary directory; and a fresh group with the same shared-memory tag then
runs a correct call (checked against the single-process reference).

The fault goes into rank 1's transport, after one healthy call has built and cached it: its
``publish`` raises, SIGKILLs its own process (the payload is already packed into the shared
slot, the 'published' flag not yet written: a transfer half done) or sleeps past the timeout.
Rank 1 faults before it sends anything in that call, so every survivor needs something from it
(the mask is dense), and the first thing each survivor misses is rank 1's payload.

``run_distributed`` raises as soon as a rank fails; here a dead rank is an expected outcome, so
``_launch`` below collects every rank's report and exit code and kills only what outlives the
limit (reported as hung).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from dist_utils import free_port
from test_strategies import _inputs, reference, slice_blocks, split_mask

WORLD = 3
FAULTY = 1
TIMEOUT_S = 2.0  # SparspConfig.timeout_s of every call here
STALL_S = 3 * TIMEOUT_S  # how long a stalled rank sleeps: well past everyone's timeout
PG_TIMEOUT_S = 30.0  # the process group's own timeout (collectives without a sparsp timeout)
LIMIT_S = 60.0  # the harness kills whatever is still running after this long: a hang
LENS = [32, 48, 40]  # tokens per rank (the last block of rank 2 is short)
B, H, D, BS = 1, 2, 16, 16


class InjectedFault(RuntimeError):
    """What the 'raise' fault throws from inside the transport."""


# --------------------------------------------------------------------------- harness


@dataclasses.dataclass
class Outcome:
    reports: dict  # rank -> ("ok", value) | ("error", traceback text)
    exitcodes: dict  # rank -> exit code (negative: killed by that signal)
    hung: list  # ranks the harness had to kill at the limit
    wall_s: float
    pids: dict


def _child(fn, rank: int, world: int, port: int, args: tuple, reports) -> None:
    import sys
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    status = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        reports.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent as text
        reports.put((rank, "error", traceback.format_exc()))
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(status)  # a normal exit: atexit handlers and finalizers run


def _launch(fn, world: int, *args, limit: float = LIMIT_S) -> Outcome:
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, name=f"rank{r}", args=(fn, r, world, port, args, reports))
             for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    got: dict = {}
    deadline = t0 + limit
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        try:
            rank, kind, payload = reports.get(timeout=0.2)
            got[rank] = (kind, payload)
        except queue.Empty:
            pass
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
    for p in procs:
        p.join(timeout=10)
    wall = time.monotonic() - t0
    while True:  # reports written just before an exit
        try:
            rank, kind, payload = reports.get(timeout=0.5)
            got[rank] = (kind, payload)
        except queue.Empty:
            break
    reports.close()
    return Outcome(got, {r: p.exitcode for r, p in enumerate(procs)}, hung, wall,
                   {r: p.pid for r, p in enumerate(procs)})


# --------------------------------------------------------------------------- workers


def _shard(rank: int, seed: int):
    q, k, v = _inputs(seed, B, sum(LENS), H, D)
    a = sum(LENS[:rank])
    sl = slice(a, a + LENS[rank])
    return (q, k, v), tuple(x[:, sl].contiguous() for x in (q, k, v)), sl


def _config(transport: str, cdf: float = 1.0):
    from sparsp import SparspConfig

    return SparspConfig(transport=transport, kernel="torch", block_size=BS, timeout_s=TIMEOUT_S,
                        cdf_threshold=cdf)


def _arm(t, fault: str) -> None:
    """Make ``t.publish`` fail in the way ``fault`` names, from its next call on."""
    inner = t.publish

    def publish(peer, buf):
        if fault == "raise":
            raise InjectedFault(f"injected fault: rank {t.rank} raises in publish to peer {peer}")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "stall":
            time.sleep(STALL_S)
        return inner(peer, buf)

    t.publish = publish


def _fault_worker(rank: int, world: int, transport: str, fault: str) -> dict:
    from sparsp import sp_attention
    from sparsp.strategies import get_transport

    cfg = _config(transport)
    _, (q, k, v), _ = _shard(rank, seed=1)
    sp_attention(q, k, v, strategy="sparsp", config=cfg)  # healthy: builds the transport
    if rank == FAULTY:
        _arm(get_transport(transport, None, q.device, cfg.timeout_s), fault)
    _, (q, k, v), _ = _shard(rank, seed=2)
    t0 = time.monotonic()
    try:
        sp_attention(q, k, v, strategy="sparsp", config=cfg)
    except Exception as e:  # noqa: BLE001 - what the survivors see is the point of the test
        return {"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}
    return {"error": None, "message": "", "elapsed": time.monotonic() - t0}


def _restart_worker(rank: int, world: int, transport: str) -> float:
    from sparsp import sp_attention

    cdf = 0.8
    (gq, gk, gv), (q, k, v), sl = _shard(rank, seed=3)
    out = sp_attention(q, k, v, strategy="sparsp", config=_config(transport, cdf))
    tok_block, _ = slice_blocks(LENS, BS)
    want = reference(gq, gk, gv, tok_block, split_mask(gq, gk, LENS, BS, cdf, None))[:, sl]
    err = (out.double() - want).abs().max().item()
    assert err <= 1e-5, f"rank {rank}: max abs error {err} after the restart"
    return err


# --------------------------------------------------------------------------- tests


def _ours(tag: str, pids) -> list[str]:
    """Entries of /dev/shm this test's processes could have made."""
    marks = [tag] + [f"_{pid}_" for pid in pids]
    return sorted(n for n in os.listdir("/dev/shm") if any(m in n for m in marks))


@pytest.mark.parametrize("transport", ["host", "nccl"])
@pytest.mark.parametrize("fault", ["raise", "kill", "stall"])
def test_fault(transport, fault, tmp_path, monkeypatch):
    tag = f"faults.{fault}.{transport}.{os.getpid()}"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("SPARSP_SHM_TAG", tag)
    monkeypatch.setenv("TMPDIR", str(tmp))
    res = _launch(_fault_worker, WORLD, transport, fault)
    print(res)
    restart = _launch(_restart_worker, WORLD, transport)
    print(restart)
    print(_ours(tag, list(res.pids.values()) + list(restart.pids.values())), os.listdir(tmp))
