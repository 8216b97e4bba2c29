"""Run a function on every rank of a fresh process group on this machine (tests only).

``run_distributed(fn, world_size, *args, timeout=...)`` spawns ``world_size`` processes
(start method ``spawn``), joins them in a gloo group on a free localhost port (or NCCL, one GPU
per rank, with ``backend="nccl"``), calls ``fn(rank, world_size, *args)`` on each and returns
the list of their return values. ``fn`` must be a module-level function (it is pickled by
name). An exception in any rank is re-raised here with that rank's traceback; a rank that dies
without reporting (a crash, ``os._exit``) is an error too; after ``timeout`` seconds, or a
short grace period after the first failure, every process still running is killed.

For the strategy tests that run on those ranks: ``structured_inputs`` (q, k, v whose CDF masks
are truly sparse), ``reference`` (float64 masked attention in one process), ``slice_errors``
(every strategy on this rank's slice of a sequence: errors against the reference) and
``placed_run`` (every strategy on a placed video sequence: errors and bytes moved against
``sparsp.demand``); for the schedule's tests, ``ScheduleReference`` (the reference step by step
under a schedule) and ``count_collectives``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import queue
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

_GRACE_S = 15.0  # how long the other ranks may keep running after one has failed


class AutoLog(logging.Handler):
    """The ``sparsp auto:`` lines logged at INFO, in ``lines`` (a spawned rank's own handler:
    pytest's log capture does not reach other processes)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        if record.levelno == logging.INFO and record.getMessage().startswith("sparsp auto:"):
            self.lines.append(record.getMessage())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world_size: int, init: str, backend: str, args: tuple, results,
           timeout: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    status = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
        results.put((rank, False, traceback.format_exc()))
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # sys.exit (not os._exit): atexit handlers and finalizers run, as in a real job
    sys.exit(status)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0,
                    backend: str = "gloo") -> list:
    """``[fn(rank, world_size, *args) for rank]``, each rank in its own process."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # a file store, not a TCP port: a port picked free here can be taken before rank 0 listens
    # (seen on the GPU machine: EADDRINUSE right after a test whose processes were killed)
    store = tempfile.NamedTemporaryFile(prefix="sparsp-store-", delete=False)
    store.close()
    os.unlink(store.name)  # the file store creates it; a stale file would hold old keys
    init = f"file://{store.name}"
    procs = [ctx.Process(target=_entry, name=f"rank{r}",
                         args=(fn, r, world_size, init, backend, args, results, timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while len(values) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                rank, ok, payload = results.get(timeout=min(1.0, left))
            except queue.Empty:
                for r, p in enumerate(procs):  # died without a report: crash or os._exit
                    if r not in values and r not in errors and p.exitcode not in (None, 0):
                        errors[r] = f"process exited with code {p.exitcode} without a report"
            else:
                (values if ok else errors)[rank] = payload
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
    finally:
        for p in procs:
            p.join(timeout=5.0 if not (errors or timed_out) else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(store.name)
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    if timed_out:
        missing = [r for r in range(world_size) if r not in values]
        raise TimeoutError(f"ranks {missing} did not finish within {timeout:g} s")
    return [values[r] for r in range(world_size)]


# --------------------------------------------------------------------------- strategy checks


def reference(q, k, v, block_of_token, mask):
    """float64 attention restricted to the block mask; rows with no block give zeros."""
    B, S, H, D = q.shape
    allowed = mask[:, :, block_of_token][:, :, :, block_of_token]  # [B, H, S, S]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(D)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double())


def slice_blocks(lens, bs):
    """Global block id of every token when each slice is cut into blocks from its start, and
    the number of blocks."""
    ids, base = [], 0
    for L in lens:
        ids.append(base + torch.arange(L) // bs)
        base += math.ceil(L / bs)
    return torch.cat(ids), base


def random_slice_case(rank: int, lens, H: int, D: int, bs: int, seed: int, density=None):
    """Random q, k, v of the whole sequence (``seed``, B = 1), a block mask (random at
    ``density``; ``None``: every block), and this rank's slice: ``(q, k, v)`` of the slice
    (contiguous), the mask, and the float64 reference of the slice's rows."""
    S = sum(lens)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
    tok_block, N = slice_blocks(lens, bs)
    gm = (torch.ones(1, H, N, N, dtype=torch.bool) if density is None
          else torch.rand(1, H, N, N, generator=g) < density)
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    want = reference(q, k, v, tok_block, gm)[:, sl]
    return tuple(t[:, sl].contiguous() for t in (q, k, v)), gm, want


def structured_inputs(seed, B, S, H, D):
    """q, k, v [B, S, H, D] of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    # Structured inputs (a shared direction per head plus noise) so CDF masks are truly sparse.
    c = torch.randn(1, 1, H, D, generator=g)
    q = c * 2 + torch.randn(B, S, H, D, generator=g)
    k = c * 2 + torch.randn(B, S, H, D, generator=g) + torch.linspace(-2, 2, S).view(1, S, 1, 1)
    v = torch.randn(B, S, H, D, generator=g)
    return q, k, v


def slice_errors(rank: int, world: int, q, k, v, lens, want: dict, cfg,
                 global_mask=None) -> dict[str, float]:
    """Every strategy on this rank's slice of a sequence cut into ``lens`` (called on every rank).

    ``want``: the references over the whole sequence, ``{"sparse": ..., "dense": ...}`` (dense
    for ``ring``). Returns the max abs error per strategy; ``ulysses`` runs only when the heads
    divide over the ranks.
    """
    from sparsp import sp_attention
    from sparsp.strategies import strategy_names

    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    errors = {}
    for strategy in strategy_names():
        if strategy == "ulysses" and q.shape[2] % world:
            continue
        out = sp_attention(q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(),
                           strategy=strategy, config=cfg, _global_mask=global_mask)
        assert out.shape == q[:, sl].shape and out.dtype == q.dtype
        errors[strategy] = (out.double() - want["dense" if strategy == "ring" else "sparse"][:, sl]).abs().max().item()
    return errors


def placed_run(rank: int, world: int, geom, kind: str, cdf: float, seed: int, *,
               transport: str = "nccl", local_transport: str | None = None,
               after=None) -> dict[str, tuple[float, int, int]]:
    """Every strategy on a placed video sequence of ``geom`` (called on every rank, gloo).

    The outputs of all ranks are gathered and unpermuted; returns, per strategy, (max abs error
    against ``reference`` — dense for ``ring`` —, bytes this rank received, the bytes
    ``comm_bytes`` predicts for it). ``ulysses`` runs only when the heads divide over the ranks.
    ``transport``, ``local_transport``: the config's (``SparspConfig.local_transport``: the
    transport of the pairs on one host); ``after(strategy, transport)`` runs after each
    strategy, its counters still holding that call's bytes.
    """
    import torch.distributed as dist

    from sparsp import SparspConfig, sp_attention
    from sparsp.masks import block_mask
    from sparsp.placement import make_placement
    from sparsp.strategies import comm_bytes, get_transport, strategy_names

    pl = make_placement(kind, geom, world)
    B, H, D, bs = 1, geom.heads, geom.head_dim, geom.block_size
    q, k, v = structured_inputs(seed, B, geom.num_tokens, H, D)
    mask = block_mask(q, k, cdf_threshold=cdf, block_q=bs, block_k=bs)  # original order
    tok_block = torch.arange(geom.num_tokens) // bs
    want = {"sparse": reference(q, k, v, tok_block, mask),
            "dense": reference(q, k, v, tok_block, torch.ones_like(mask))}
    qp, kp, vp = (pl.permute(x, 1) for x in (q, k, v))
    sl = pl.token_slice(rank)
    cfg = SparspConfig(cdf_threshold=cdf, block_size=bs, transport=transport, kernel="torch", timeout_s=60.0,
                       local_transport=local_transport)
    transport = get_transport(transport, None, torch.device("cpu"), cfg.timeout_s, cfg.local_transport)
    n_max = max(pl.tokens_per_rank)
    runs = {}
    for strategy in strategy_names():
        if strategy == "ulysses" and H % world:
            continue
        transport.fence()
        transport.reset_counters()
        out = sp_attention(qp[:, sl].contiguous(), kp[:, sl].contiguous(), vp[:, sl].contiguous(),
                           strategy=strategy, config=cfg)
        transport.fence()
        # gather every rank's slice and undo the placement
        padded = torch.zeros(B, n_max, H, D)
        padded[:, : out.shape[1]] = out
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)  # gloo needs equal sizes
        full = pl.unpermute(torch.cat([p[:, :n] for p, n in zip(parts, pl.tokens_per_rank)], dim=1), 1)
        err = (full.double() - want["dense" if strategy == "ring" else "sparse"]).abs().max().item()
        predicted = comm_bytes(mask[0], pl, strategy, head_dim=D, dtype_bytes=4)["per_rank"][rank]
        runs[strategy] = (err, transport.total_received, predicted)
        if after is not None:
            after(strategy, transport)
    return runs


class ScheduleReference:
    """The single-process reference under ``cfg``'s schedule, step by step: dense steps exact,
    plan steps under their own mask, reuse steps under the mask of the last plan step."""

    def __init__(self, lens, cfg):
        self.lens, self.cfg, self.mask = lens, cfg, None

    def step(self, s, q, k, v, strategy):
        from dataclasses import replace

        from sparsp.integrations.reference import reference_sp_attention

        kind, lens, cfg = self.cfg.step_kind(s), self.lens, self.cfg
        if kind == "dense":
            return reference_sp_attention(q, k, v, lens=lens, strategy="ring", config=replace(cfg, cdf_threshold=1.0))
        if kind == "plan" or self.mask is None:
            out, self.mask = reference_sp_attention(q, k, v, lens=lens, strategy=strategy, config=cfg,
                                                    return_mask=True)
            return out
        return reference_sp_attention(q, k, v, lens=lens, strategy=strategy, config=cfg, mask=self.mask)


def count_collectives():
    """Count every torch.distributed collective this process issues (all-gathers, all-reduces,
    broadcasts, barriers, new groups) in ``["n"]`` and every host read of a call's counts
    (``Metadata.finish``) in ``["reads"]``; ``["undo"]()`` stops counting."""
    import torch.distributed as dist

    counted = {"n": 0, "reads": 0}
    names = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "barrier", "all_gather_object",
             "reduce_scatter_tensor", "all_to_all_single", "new_group")
    saved = {n: getattr(dist, n) for n in names}

    def wrap(fn, what="n"):
        def counting(*a, **kw):
            counted[what] += 1
            return fn(*a, **kw)
        return counting

    from sparsp import groups, plan

    flat = groups._ALL_GATHER_FLAT  # the metadata all-gather, bound once in sparsp.groups
    finish = plan.Metadata.finish  # the call's host read
    for n, fn in saved.items():
        setattr(dist, n, wrap(fn))
    groups._ALL_GATHER_FLAT = wrap(flat)
    plan.Metadata.finish = wrap(finish, "reads")

    def undo():
        for n, fn in saved.items():
            setattr(dist, n, fn)
        groups._ALL_GATHER_FLAT = flat
        plan.Metadata.finish = finish

    counted["undo"] = undo
    return counted
