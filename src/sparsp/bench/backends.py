"""The dense baselines at their best: the fastest Diffusers attention backend, by measurement.

A dense row of ``bench e2e`` (``1gpu-dense``, ``diffusers-*``) stands for what a Diffusers user
runs without sparsp, so it runs on the fastest attention backend that user has for the model
and its mask on this machine. Which one that is depends on the GPU, the dtype, the head dim and
whether a mask is passed (cuDNN and flash take no arbitrary mask), so it is measured, not
assumed: every candidate is tried in turn and the row records each one's time, or why it
could not run.
"""

from __future__ import annotations

from collections.abc import Callable

CANDIDATES = ("native", "_native_cudnn", "_native_flash", "_native_efficient", "_native_math", "flex", "flash",
              "_flash_3")
"""Diffusers attention backends tried for a dense row, in this order. A backend whose library is
not installed fails and is recorded as such; those that fetch a kernel from the Hub (``*_hub``,
the only form of FlashAttention-4 in Diffusers 0.42) are not tried: a benchmark downloads
nothing."""


class BackendFailed(RuntimeError):
    """A backend that could not run, its message already written (``pick_fastest`` records it
    as it is)."""


def pick_fastest(candidates, measure: Callable[[str], dict]) -> tuple[str, list[dict]]:
    """Measure every candidate (``measure(name)`` → a dict with ``step_ms`` and any other
    figures, or an exception) and return the fastest by ``step_ms`` with every try:
    ``{"backend", **figures}`` or ``{"backend", "error"}``. ``RuntimeError`` listing the errors
    when none runs."""
    return fastest(try_each(candidates, measure))


def try_each(candidates, measure: Callable[[str], dict]) -> list[dict]:
    """``pick_fastest``'s tries, without the pick: ``{"backend", **figures}`` or
    ``{"backend", "error"}`` per candidate."""
    tried = []
    for name in candidates:
        try:
            tried.append({"backend": name, **measure(name)})
        except Exception as e:  # a backend that cannot run here is a finding, not a failure
            text = str(e) if isinstance(e, BackendFailed) else f"{type(e).__name__}: {e}"
            tried.append({"backend": name, "error": " ".join(text.split())[:300]})
    return tried


def fastest(tried: list[dict]) -> tuple[str, list[dict]]:
    """The fastest of ``tried`` by ``step_ms``, and ``tried``; ``RuntimeError`` listing the
    errors when none ran."""
    ran = [t for t in tried if "error" not in t]
    if not ran:
        raise RuntimeError("no dense attention backend ran: " + "; ".join(f"{t['backend']}: {t['error']}"
                                                                          for t in tried))
    return min(ran, key=lambda t: t["step_ms"])["backend"], tried


def attention_flops(batch: int, tokens: int, width: int) -> float:
    """FLOPs of one dense self-attention over ``tokens`` tokens of ``width`` = heads x head dim:
    q·kᵀ and p·v, two FLOPs per multiply-add each."""
    return 4.0 * batch * tokens * tokens * width
