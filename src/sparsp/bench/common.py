"""Shared benchmark plumbing: process group setup, failures every rank agrees on, CUDA-event
timing, result files, plots.

Every collective a benchmark driver makes goes through this module, and each one follows a
point where the ranks agreed that none of them failed (``stage``, ``time_ms``): an exception
on one rank is raised on every rank as the same ``BenchFailed`` at the same point, so no rank
is left waiting in a collective its peer never reaches.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..timing import call_ms
from .args import BenchFailed


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the torchrun process group (or make a 1-process group) and pick the device."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m sparsp ...`: one process
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group(backend)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def world_size() -> int:
    """The ranks of this run before ``init_distributed``: the process group's where one exists,
    else what torchrun says (``WORLD_SIZE``), else one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def shutdown() -> None:
    """Release sparsp's transports (IPC handles, shared memory) and leave the process group."""
    from ..strategies import close_transports

    close_transports()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def failure_text(error: BaseException) -> str:
    """An exception as one line: its type and message (a ``BenchFailed``: its message)."""
    text = str(error) if isinstance(error, BenchFailed) else f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def _every_rank(error: str | None) -> list[str | None]:
    """Every rank's ``error``, in rank order (this rank's alone without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [error]
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def first_error(error: str | None) -> str | None:
    """The lowest rank's ``error`` of every rank's (None where none failed), on every rank."""
    return next((e for e in _every_rank(error) if e is not None), None)


def agree(error: str | None, what: str) -> None:
    """Every rank, at the end of ``what``: raise the same ``BenchFailed`` on every rank if any
    rank's ``error`` is not None (the lowest failing rank's, naming ``what`` and that rank)."""
    failed = [(r, e) for r, e in enumerate(_every_rank(error)) if e is not None]
    if failed:
        rank, text = failed[0]
        raise BenchFailed(f"{what} failed on rank {rank}: {text}")


@contextlib.contextmanager
def stage(what: str):
    """Run the block, then agree (``agree``) on whether it failed on any rank, before the next
    collective. A ``BenchFailed`` from inside (raised on every rank already) passes through."""
    error = None
    try:
        yield
    except BenchFailed:
        raise
    except Exception as e:  # every rank raises it below, the same
        error = failure_text(e)
    agree(error, what)


def over_ranks(values, device, op: str = "max", *, error: str | None = None, what: str = "") -> list[float]:
    """``values`` reduced over the ranks (``max`` or ``sum``, in float64), with this rank's
    failure flag riding along: where any rank passes an ``error`` (its ``values`` then stand
    for nothing), every rank raises the same ``BenchFailed`` (``agree``, naming ``what``).
    Called where the ranks have agreed that none failed since their last collective."""
    flags = [float(error is not None)]
    t = torch.tensor([float(v) for v in values] + flags, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if op == "sum":  # the flag's sum is as good as its maximum
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[-1].item() > 0:
        agree(error, what)
    return t[:-1].tolist()


def barrier() -> None:
    """Every rank waits for the others; called where the ranks have agreed that none failed."""
    if dist.is_initialized():
        dist.barrier()


def share(value, src: int = 0):
    """Rank ``src``'s ``value`` on every rank (a picklable object)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def time_ms(fn, *, warmup: int, iters: int, device: torch.device, what: str = "the timed calls",
            between=None) -> list[float]:
    """Per-iteration wall time in ms, the slowest rank's (CUDA events on GPU). The ranks agree
    after the warm-up and with every timed call (its failure flag rides on the time's
    all-reduce): a call that fails on one rank raises the same ``BenchFailed`` on every rank.
    ``between``: called before each timed call, untimed (``bench e2e``: the next step's
    synthetic inputs); its failure counts as the call's. Called where the ranks have just
    agreed that none failed."""
    if warmup:
        with stage(f"{what} (warm-up)"):
            for _ in range(warmup):
                fn()
    times = []
    for _ in range(iters):
        ms, error = 0.0, None
        try:
            if between is not None:
                between()
        except Exception as e:  # reported with the call's flag below
            error = failure_text(e)
        barrier()
        try:
            if error is None:
                ms = call_ms(fn, device)
        except Exception as e:  # every rank learns of it from the flag of the maximum below
            error = failure_text(e)
        times += over_ranks([ms], device, error=error, what=what)
    return times


def time_interleaved(fns, *, warmup: int, iters: int, device: torch.device) -> list[list[float]]:
    """``time_ms`` of several functions, one iteration of each in turn (round robin): drift in
    clocks or temperature over the run reaches every function alike. Each timed round starts
    one function later than the one before, so every function follows every other equally
    often (in a fixed order the row after a long one — a 300 ms dense row at HunyuanVideo size —
    would always start on a hot, possibly throttled GPU). Times per function."""
    with stage("the warm-up calls"):
        for _ in range(warmup):
            for fn in fns:
                fn()
    times: list[list[float]] = [[] for _ in fns]
    n = len(fns)
    for r in range(iters):
        for j in range(n):
            i = (r + j) % n
            times[i] += time_ms(fns[i], warmup=0, iters=1, device=device)
    return times


def all_gather_halves(x: torch.Tensor, group) -> list[torch.Tensor]:
    """Every CFG half's ``x`` over ``group`` (its ``cfg`` dimension's), in group order: the one
    exchange of a step's prediction that CFG parallel makes (``bench e2e --mesh cfg=2``'s
    ``diffusers-unified`` row, inside its timed step, as sparsp's CFG parallel makes it inside
    the model)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine_name() -> str:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "")
        return f"{torch.cuda.device_count()}x{name}"
    return "cpu"


def result_path(kind: str, model: str, out_dir: Path) -> Path:
    date = datetime.date.today().isoformat()
    return Path(out_dir) / f"{kind}-{model}-{machine_name()}-{date}.json"


def profile_name(model: str, profile, step: int | None) -> str:
    """The model part of a ``--density-profile`` run's file names (``bench attention``,
    ``bench e2e``): the preset, the profile's file stem and the step (``mean``: the mean over
    steps), so nothing that looks for the preset's own results finds it."""
    return f"{model}-{Path(profile).stem}-step{'mean' if step is None else step}"


def write_result(kind: str, model: str, rows: list[dict], out_dir: Path, extra: dict | None = None,
                 merge: bool = True) -> Path:
    """Write (or extend, for a second fabric's run) ``<kind>-<model>-<machine>-<date>.json``."""
    path = result_path(kind, model, out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in ["sparsp", *sys.argv[1:]])
    doc = {"kind": kind, "machine": machine_name(), "date": datetime.date.today().isoformat(),
           "command": command, "rows": []}
    if merge and path.exists():
        doc = json.loads(path.read_text())
        doc.setdefault("commands", [doc.get("command")])
        doc["commands"].append(command)
    doc["rows"] = doc["rows"] + rows
    if extra:
        doc.update(extra)
    path.write_text(json.dumps(doc, indent=1))
    return path


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """Lay ``fig`` out, write it as the PNG next to the result file ``path``, close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def wide_console(width: int = 100, **kwargs):
    """A rich console at least ``width`` columns wide (``kwargs``: ``rich.console.Console``'s):
    in a pipe rich assumes 80, where a result table cuts its names to ``diffusers-…``."""
    from rich.console import Console

    console = Console(**kwargs)
    return console if console.width >= width else Console(width=width, **kwargs)


def config_overrides(items: list[tuple[str, object]], *, reserved: dict[str, str]) -> dict:
    """The ``--config`` items as ``SparspConfig`` keyword arguments (the last of a key wins);
    ``SystemExit`` naming the flag for a field the benchmark sets itself."""
    out = dict(items)
    for key in out:
        if key in reserved:
            raise SystemExit(f"--config {key}=...: set by {reserved[key]}")
    return out
