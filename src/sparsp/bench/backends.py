"""The dense baselines at their best: the fastest Diffusers attention backend, by measurement.

A dense row of ``bench e2e`` (``1gpu-dense``, ``diffusers-*``) stands for what a Diffusers user
runs without sparsp, so it runs on the fastest attention backend that user has for the model
and its mask on this machine. Which one that is depends on the GPU, the dtype, the head dim and
whether a mask is passed (cuDNN and flash take no arbitrary mask), so it is measured, not
assumed: every candidate is tried in turn and the row records each one's time, or why it
could not run. ``try_backend`` measures one backend on a model; ``use_backend`` runs the
model on the one chosen.
"""

from __future__ import annotations

from collections.abc import Callable

from ..timing import times_ms
from .args import BenchFailed
from .common import failure_text, first_error, median, over_ranks, time_ms

CANDIDATES = ("native", "_native_cudnn", "_native_flash", "_native_efficient", "_native_math", "flex", "flash",
              "_flash_3")
"""Diffusers attention backends tried for a dense row, in this order. A backend whose library is
not installed fails and is recorded as such; those that fetch a kernel from the Hub (``*_hub``,
the only form of FlashAttention-4 in Diffusers 0.42) are not tried: a benchmark downloads
nothing."""
PROCESSOR_DENSE = "sparsp-dense"
"""A dense candidate of ``1gpu-dense`` beside Diffusers' backends: sparsp's processors running
the fastest dense kernel on the GPU, FlashAttention-4's dense forward where it runs
(``sparsp_dense``)."""


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


def one_gpu_config(config):
    """The one-GPU rows' config: nothing moves on a group of one; its metadata all-gather goes
    through the group's own backend (``nccl``: torch.distributed, as ``bench attention``'s
    one-GPU row)."""
    from dataclasses import replace

    return replace(config, transport="nccl")


def sparsp_dense(model, one, args, other: str) -> None:
    """``PROCESSOR_DENSE``: sparsp's processors on the group of one with the dense baseline
    strategy, so the video self-attention runs the fastest dense kernel ``strategies/one_gpu.py``
    measures (FA4's dense forward among them); the model's other attention on ``other``, the
    fastest Diffusers backend."""
    import sparsp

    from ..strategies.registry import strategies_where

    model.set_attention_backend(other)
    config = sparsp.SparspConfig(block_size=args.block_size, kernel=args.kernel, **dict(args.config))
    sparsp.parallelize(model, group=one, config=one_gpu_config(config), strategy=strategies_where(baseline=True)[0])


def use_backend(model, backend: str, other: str, one, args) -> None:
    """Run ``model`` on ``backend`` (the fastest tried) from now on; ``PROCESSOR_DENSE`` with its
    other attention on ``other``."""
    if backend == PROCESSOR_DENSE:
        sparsp_dense(model, one, args, other)
    else:
        model.set_attention_backend(backend)


def tflops(flops: float, ms: float) -> float | None:
    """The rate as measured (the result file keeps it whole: a tiny CPU model's rate rounded
    to a few decimals reads 0.0); None without a time or FLOPs to divide."""
    return flops / (ms * 1e-3) / 1e12 if ms > 0 and flops > 0 else None


def try_backend(model, backend: str, step, timer, device, gang: int, iters: int, *, one=None, args=None,
                 other: str | None = None) -> dict:
    """Step time, attention time and dense attention TFLOP/s (per GPU) of ``model`` on
    ``backend``: untimed steps first (one; enough for ``PROCESSOR_DENSE`` to measure its kernels),
    then ``iters`` timed ones. ``gang`` > 1: every rank of the process group runs it together
    (Diffusers' context parallelism), and a failure on any rank is raised on all of them, so
    they all go on to the next backend together. ``PROCESSOR_DENSE`` is undone after its try."""
    from ..integrations.diffusers import unparallelize
    from ..strategies import one_gpu

    def agreed(error):
        error = first_error(error) if gang > 1 else error
        if error is not None:
            raise BackendFailed(error)

    def attempt(fn):
        try:
            fn()
        except Exception as e:  # reported by ``agreed``, on every rank
            return failure_text(e)
        return None

    ours = backend == PROCESSOR_DENSE
    try:
        if ours:
            agreed(attempt(lambda: sparsp_dense(model, one, args, other)))
        else:
            agreed(attempt(lambda: model.set_attention_backend(backend)))
        for _ in range(one_gpu.MEASURE_AT if ours else 1):
            agreed(attempt(step))
        timer.take()
        if gang > 1:
            try:
                times = time_ms(step, warmup=0, iters=iters, device=device)
            except BenchFailed as e:  # on every rank: this backend's error, the next one is tried
                raise BackendFailed(str(e)) from None
        else:  # rank 0 alone (a one-GPU row): no collective
            times = times_ms(step, warmup=0, iters=iters, device=device)
        ms, flops = timer.take()
        kernel = one_gpu.last_choice().kernel if ours and one_gpu.last_choice() else None
    finally:
        if ours:
            unparallelize(model)
    figures = [ms / iters, flops / iters * gang]
    attn_ms, flops = over_ranks(figures, device) if gang > 1 else figures
    out = {"step_ms": median(times), "attention_ms": attn_ms, "attention_tflops": tflops(flops, attn_ms)}
    return out if kernel is None else {**out, "kernel": kernel}
