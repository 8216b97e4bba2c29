"""Block-sparse attention kernels with LSE, and the one LSE merge.

Layers (STYLE §2): every backend reads two K/V types, a packed ``KVBuffer`` (payloads: ONE
buffer of token rows for all heads) and a ``LocalKV`` (this rank's shard as given,
``(B, S, H, D)``), and exposes the same forward function

    block_sparse_attention(q, kv, kv_num_blocks, kv_indices, *, scale=None) -> (out, lse)

with q ``(B, H, Sq, D)``, kv ``KVBuffer | LocalKV``, kv_num_blocks int32 ``[B, H, nQ]``,
kv_indices int32 ``[B, H, nQ, K]`` (block ids: buffer ids for a ``KVBuffer``, block indices
within the shard for a ``LocalKV``; ``kernel_indices`` builds both from a block mask), out
``(B, H, Sq, D)`` and lse ``(B, H, Sq)`` float32 (natural log; ``-inf`` and out 0 for a query
row with no block). Backends are picked by name through a small registry (STYLE §7):

    kernel = get_kernel("auto", q.device)   # fa4, else flex on CUDA; torch on CPU
    out, lse = kernel(q, kv, kv_num_blocks, kv_indices)

Partial results over disjoint key sets combine with ``update_out_and_lse``/``merge_partials``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import fa4, flex, torch_ref
from .buffer import KVBuffer, canonical_block_ids, kernel_indices
from .local import LocalKV
from .merge import merge_final, merge_into, merge_pair, merge_partials, update_out_and_lse

__all__ = [
    "KVBuffer",
    "KernelFn",
    "KernelName",
    "LocalKV",
    "block_sparse_attention",
    "canonical_block_ids",
    "get_kernel",
    "kernel_indices",
    "kernel_names",
    "merge_final",
    "merge_into",
    "resolve_kernel",
    "merge_pair",
    "reads_token_major",
    "merge_partials",
    "register_kernel",
    "update_out_and_lse",
]

KernelFn = Callable[..., tuple[Tensor, Tensor]]


class KernelName(str, enum.Enum):
    """Names accepted wherever a kernel is chosen (``SparspConfig.kernel``)."""

    TORCH = "torch"  # reference: plain PyTorch, CPU and GPU
    FLEX = "flex"  # torch.compile(flex_attention), CUDA
    FA4 = "fa4"  # FlashAttention-4 CuTe DSL, CUDA sm90+, optional extra sparsp[fa4]
    AUTO = "auto"  # fa4 where available, else flex on CUDA, else torch


@dataclass(frozen=True)
class _Entry:
    fn: KernelFn
    devices: tuple[str, ...]
    available: Callable[[torch.device], bool]
    token_major: Callable[[Tensor, int], bool]


_REGISTRY: dict[KernelName, _Entry] = {}
# What ``auto`` tries, fastest first (docs/design.md "Kernels and transports": FA4 block-sparse
# 0.96-1.01x cuDNN dense per kept block on H200, flex 0.66-0.70x).
_AUTO_ORDER = (KernelName.FA4, KernelName.FLEX, KernelName.TORCH)


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
    token_major: Callable[[Tensor, int], bool] | None = None,
) -> Callable[[KernelFn], KernelFn]:
    """Decorator registering a forward function under ``name``.

    Args:
        name: a ``KernelName`` other than ``auto``.
        devices: device types (``torch.device.type``) the kernel runs on.
        available: optional runtime check (e.g. an importable dependency) per device.
        token_major: ``(q, block_size) -> bool``: the kernel reads queries given as a
            (B, H, S, D) view of token-major (B, S, H, D) memory at full speed for this call
            (``reads_token_major``); default: never.
    """
    key = _parse_name(name)
    if key is KernelName.AUTO:
        raise ValueError("'auto' is resolved by get_kernel and cannot be registered")

    def decorate(fn: KernelFn) -> KernelFn:
        _REGISTRY[key] = _Entry(fn, tuple(devices), available or (lambda _device: True),
                                token_major or (lambda _q, _block_size: False))
        return fn

    return decorate


def kernel_names(*, with_auto: bool = False) -> tuple[str, ...]:
    """Registered kernel names, optionally with ``auto`` first (``SparspConfig.kernel``)."""
    names = tuple(k.value for k in _REGISTRY)
    return (KernelName.AUTO.value,) + names if with_auto else names


def _resolve(name: KernelName | str, dev: torch.device) -> KernelName:
    key = _parse_name(name)
    if key is KernelName.AUTO:
        key = KernelName.TORCH
        for candidate in _AUTO_ORDER:
            entry = _REGISTRY.get(candidate)
            if entry is not None and dev.type in entry.devices and entry.available(dev):
                key = candidate
                break
    return key


def resolve_kernel(name: KernelName | str, device: torch.device | str) -> str:
    """The kernel ``get_kernel(name, device)`` runs, by name (``auto`` resolved)."""
    return _resolve(name, torch.device(device)).value


def get_kernel(name: KernelName | str, device: torch.device | str) -> KernelFn:
    """The forward function registered as ``name`` for ``device``.

    ``auto`` resolves to the first of ``fa4``, ``flex``, ``torch`` that is registered for the
    device type and passes its runtime check (``fa4``: CUDA sm90+ with ``flash_attn.cute``
    importable; ``flex``: CUDA). ``fa4`` itself runs ``flex`` for a call it does not support
    (dtype, head dim, block size, architecture: ``fa4.unsupported_reason``).
    Raises ``ValueError`` for an unknown name or a device type the kernel does not support,
    ``RuntimeError`` when the kernel's runtime check fails.
    """
    key = _resolve(name, torch.device(device))
    dev = torch.device(device)
    entry = _REGISTRY.get(key)
    if entry is None:
        raise ValueError(f"kernel {key.value!r} is not registered")
    if dev.type not in entry.devices:
        raise ValueError(
            f"kernel {key.value!r} does not run on device type {dev.type!r}; "
            f"it supports {', '.join(entry.devices)}"
        )
    if not entry.available(dev):
        why = fa4.import_error() if key is KernelName.FA4 and dev.type == "cuda" else None
        raise RuntimeError(
            f"kernel {key.value!r} is not available on {dev} (torch {torch.__version__})"
            + (f": flash_attn.cute does not import ({why}); pip install 'sparsp[fa4]'" if why else "")
        )
    return entry.fn


def reads_token_major(kernel: KernelFn, q: Tensor, block_size: int) -> bool:
    """True when ``kernel`` (a function ``get_kernel`` returned) reads queries given as a
    (B, H, S, D) view of token-major (B, S, H, D) memory at full speed for this call, so the
    caller need not copy them head-major (its registration's ``token_major``)."""
    entry = next((e for e in _REGISTRY.values() if e.fn is kernel), None)
    return entry is not None and entry.token_major(q, block_size)


def block_sparse_attention(
    q: Tensor,
    kv: KVBuffer | LocalKV,
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
register_kernel(KernelName.FA4, devices=("cuda",), available=fa4.fa4_available,
                token_major=fa4.reads_token_major)(
    fa4.block_sparse_attention
)
