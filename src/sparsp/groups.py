"""Process-group helpers every stage shares: waits with timeouts, rank translation, gathering
Python objects, and the device a group's tensors live on.

They sit here, public, because the plan, the strategies and the transports all need them;
nothing here knows about attention.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "gather_objects", "global_rank", "resolve_device", "wait"]

# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single; the GPU
# machine's torch 2.11 has only the old name.
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group=None):
    """Async all-gather of equal-size ``inp`` into ``out`` (rank-major); returns the work."""
    return _ALL_GATHER_FLAT(out, inp, group=group, async_op=True)


def wait(work, timeout_s: float, what: str) -> None:
    """Wait for an async collective, turning a silent or dead peer into a ``TimeoutError``."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TimeoutError(f"{what}: {e}") from e
    if ok is False:
        raise TimeoutError(f"{what}: no answer from a peer within {timeout_s} s")


def global_rank(group, rank: int) -> int:
    """The global rank of ``group``'s member ``rank`` (p2p ops address global ranks)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


def gather_objects(obj, group=None) -> list:
    """``obj`` of every rank of ``group``, in rank order (one ``all_gather_object``)."""
    if dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def resolve_device(device, group=None) -> torch.device:
    """``device`` as a full ``torch.device`` (a CUDA device gets its index); ``None`` means
    the current CUDA device for an NCCL group and the CPU otherwise."""
    if device is None:
        device = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device} is not supported; use a cpu or cuda device")
    return device
