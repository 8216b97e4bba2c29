"""Block-sparse attention kernels with LSE, and the one LSE merge.

Layers (STYLE §2): ``KVBuffer`` is the packed K/V every kernel reads; each backend exposes
the same forward function

    block_sparse_attention(q, kv, kv_num_blocks, kv_indices, *, scale=None) -> (out, lse)

with q ``(B, H, Sq, D)``, kv_num_blocks int32 ``[B, H, nQ]``, kv_indices int32
``[B, H, nQ, K]`` (buffer block ids), out ``(B, H, Sq, D)`` and lse ``(B, H, Sq)`` float32
(natural log; ``-inf`` and out 0 for a query row with no block). Backends are picked by
name through a small registry (STYLE §7):

    kernel = get_kernel("auto", q.device)   # flex on CUDA when available, else torch
    out, lse = kernel(q, kv, kv_num_blocks, kv_indices)

Partial results over disjoint key sets combine with ``update_out_and_lse``/``merge_partials``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import flex, torch_ref
from .buffer import KVBuffer, canonical_block_ids
from .merge import merge_partials, update_out_and_lse

__all__ = [
    "KVBuffer",
    "KernelFn",
    "KernelName",
    "block_sparse_attention",
    "canonical_block_ids",
    "get_kernel",
    "merge_partials",
    "register_kernel",
    "update_out_and_lse",
]

KernelFn = Callable[..., tuple[Tensor, Tensor]]


class KernelName(str, enum.Enum):
    """Names accepted wherever a kernel is chosen (``SparspConfig.kernel``)."""

    TORCH = "torch"  # reference: plain PyTorch, CPU and GPU
    FLEX = "flex"  # torch.compile(flex_attention), CUDA
    AUTO = "auto"  # flex on CUDA when available, else torch


@dataclass(frozen=True)
class _Entry:
    fn: KernelFn
    devices: tuple[str, ...]
    available: Callable[[torch.device], bool]


_REGISTRY: dict[KernelName, _Entry] = {}


def _parse_name(name: KernelName | str) -> KernelName:
    try:
        return KernelName(name)
    except ValueError:
        allowed = ", ".join(repr(n.value) for n in KernelName)
        raise ValueError(f"unknown kernel {name!r}; allowed: {allowed}") from None


def register_kernel(
    name: KernelName | str,
    *,
    devices: tuple[str, ...] = ("cpu", "cuda"),
    available: Callable[[torch.device], bool] | None = None,
) -> Callable[[KernelFn], KernelFn]:
    """Decorator registering a forward function under ``name``.

    Args:
        name: a ``KernelName`` other than ``auto``.
        devices: device types (``torch.device.type``) the kernel runs on.
        available: optional runtime check (e.g. an importable dependency) per device.
    """
    key = _parse_name(name)
    if key is KernelName.AUTO:
        raise ValueError("'auto' is resolved by get_kernel and cannot be registered")

    def decorate(fn: KernelFn) -> KernelFn:
        _REGISTRY[key] = _Entry(fn, tuple(devices), available or (lambda _device: True))
        return fn

    return decorate


def get_kernel(name: KernelName | str, device: torch.device | str) -> KernelFn:
    """The forward function registered as ``name`` for ``device``.

    ``auto`` resolves to ``flex`` on CUDA when flex_attention is importable, else ``torch``.
    Raises ``ValueError`` for an unknown name or a device type the kernel does not support,
    ``RuntimeError`` when the kernel's runtime check fails.
    """
    key = _parse_name(name)
    dev = torch.device(device)
    if key is KernelName.AUTO:
        flex_entry = _REGISTRY.get(KernelName.FLEX)
        use_flex = (
            flex_entry is not None
            and dev.type in flex_entry.devices
            and flex_entry.available(dev)
        )
        key = KernelName.FLEX if use_flex else KernelName.TORCH
    entry = _REGISTRY.get(key)
    if entry is None:
        raise ValueError(f"kernel {key.value!r} is not registered")
    if dev.type not in entry.devices:
        raise ValueError(
            f"kernel {key.value!r} does not run on device type {dev.type!r}; "
            f"it supports {', '.join(entry.devices)}"
        )
    if not entry.available(dev):
        raise RuntimeError(
            f"kernel {key.value!r} is not available on {dev} (torch {torch.__version__})"
        )
    return entry.fn


def block_sparse_attention(
    q: Tensor,
    kv: KVBuffer,
    kv_num_blocks: Tensor,
    kv_indices: Tensor,
    *,
    scale: float | None = None,
    kernel: KernelName | str = KernelName.AUTO,
) -> tuple[Tensor, Tensor]:
    """Dispatch to the kernel named ``kernel`` for ``q.device``; see the module docstring."""
    fn = get_kernel(kernel, q.device)
    return fn(q, kv, kv_num_blocks, kv_indices, scale=scale)


# Built-in backends. Registered here rather than by decorators inside the backend modules so
# that importing a backend module never needs this package's namespace (no import cycle).
register_kernel(KernelName.TORCH, devices=("cpu", "cuda"))(torch_ref.block_sparse_attention)
register_kernel(KernelName.FLEX, devices=("cuda",), available=flex.flex_available)(
    flex.block_sparse_attention
)
