"""Dense attention kernels: what one GPU runs when a mask keeps too much to skip.

Each candidate takes q, k, v as (B, S, H, D) and returns the output (B, S, H, D) in q's dtype.
Which one is fastest depends on the GPU, dtype and head dim, so the caller measures them
(``strategies/one_gpu.py``) instead of assuming: FlashAttention-4's dense forward where it runs,
PyTorch's scaled-dot-product attention through cuDNN, flash and memory-efficient kernels on CUDA,
and its math kernel everywhere. A candidate that cannot run a shape raises; the caller records
that and moves on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import fa4

DenseFn = Callable[[Tensor, Tensor, Tensor, float], Tensor]


def _sdpa(backend) -> DenseFn:
    from torch.nn.attention import sdpa_kernel

    def run(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        return out.transpose(1, 2)

    return run


def _fa4(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return fa4.dense(q, k, v, scale=scale)[0]


def dense_kernels(device: torch.device) -> list[tuple[str, DenseFn]]:
    """(name, kernel) of every dense kernel worth measuring on ``device``."""
    from torch.nn.attention import SDPBackend

    if device.type != "cuda":
        return [("sdpa-math", _sdpa(SDPBackend.MATH))]
    out = []
    if fa4.fa4_available(device):
        out.append(("fa4", _fa4))
    out += [("sdpa-cudnn", _sdpa(SDPBackend.CUDNN_ATTENTION)), ("sdpa-flash", _sdpa(SDPBackend.FLASH_ATTENTION)),
            ("sdpa-efficient", _sdpa(SDPBackend.EFFICIENT_ATTENTION))]
    return out
