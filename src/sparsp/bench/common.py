"""Shared benchmark plumbing: process group setup, CUDA-event timing, result files, plots."""

from __future__ import annotations

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


def time_ms(fn, *, warmup: int, iters: int, device: torch.device) -> list[float]:
    """Per-iteration wall time in ms, the slowest rank's (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t = torch.tensor([call_ms(fn, device)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return times


def time_interleaved(fns, *, warmup: int, iters: int, device: torch.device) -> list[list[float]]:
    """``time_ms`` of several functions, one iteration of each in turn (round robin): drift in
    clocks or temperature over the run reaches every function alike. Each timed round starts
    one function later than the one before, so every function follows every other equally
    often (in a fixed order the row after a long one — a 300 ms dense row at HunyuanVideo size —
    would always start on a hot, possibly throttled GPU). Times per function."""
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
