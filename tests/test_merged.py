"""A call's merged output (``strategies/merged.py``) against a float64 merge of the same partials.

Each partial is attention of every query against one disjoint set of keys: ``o`` (B, H', S, D)
and ``lse`` (B, H', S) of query heads [h0, h1). The reference merges every head's partials in
float64 — lse = logsumexp over the partials, o = Σ exp(lse_i − lse) o_i — and a head no partial
reached is zeros. The merged output must match it in the caller's layout (B, S, H, D) and dtype,
whichever path it took: whole-head partials (the first kept, the next ones folded), head-sliced
ones (an fp32 accumulator), the two-rank path (the slices written straight into the output).
"""

from __future__ import annotations

import pytest
import torch

from sparsp.strategies.merged import MergedOutput

B, S, H, D = 2, 24, 4, 8


def _partial(seed: int, heads: tuple[int, int], empty_rows: bool = False):
    g = torch.Generator().manual_seed(seed)
    h = heads[1] - heads[0]
    o = torch.randn(B, h, S, D, generator=g)
    lse = torch.randn(B, h, S, generator=g) * 3
    if empty_rows:  # rows with no key in this part: -inf and zeros, as a kernel writes them
        lse[:, :, ::5] = float("-inf")
        o[:, :, ::5] = 0.0
    return o, lse, heads


def _reference(parts) -> torch.Tensor:
    """float64 (B, S, H, D): every head's partials merged, zeros where none reached a row."""
    out = torch.zeros(B, H, S, D, dtype=torch.float64)
    for h in range(H):
        mine = [(o[:, h - a].double(), lse[:, h - a].double()) for o, lse, (a, b) in parts if a <= h < b]
        if not mine:
            continue
        lses = torch.stack([lse for _, lse in mine])
        total = torch.logsumexp(lses, dim=0)
        weights = torch.where(torch.isneginf(lses), 0.0, torch.exp(lses - total))
        out[:, h] = sum(w[..., None] * o for w, (o, _) in zip(weights, mine))
    return out.permute(0, 2, 1, 3)


def _merged(parts, *, last_slices: bool = False, dtype=torch.float32):
    """The parts merged as a call merges them: ``fold`` before each kernel (every partial but the
    first comes from a kernel launched after the previous merge), ``finish`` after the last."""
    out = MergedOutput((B, S, H, D), dtype, torch.device("cpu"), last_slices=last_slices)
    for i, (o, lse, heads) in enumerate(parts):
        if i:
            out.fold()
        # a copy, as a kernel's fresh output: the accumulator may be the kept first partial
        out.merge(o.to(dtype, copy=True), lse.clone(), None if heads == (0, H) else heads)
    out.finish()
    return out, out.result()


@pytest.fixture
def passes(monkeypatch):
    """How often each merge of ``kernels.merge`` ran (each is one pass over the output)."""
    from sparsp.strategies import merged

    seen = {"merge_pair": 0, "merge_into": 0, "merge_final": 0}
    for name in seen:
        real = getattr(merged, name)

        def counted(*args, real=real, name=name):
            seen[name] += 1
            return real(*args)
        monkeypatch.setattr(merged, name, counted)
    return seen


def _close(got: torch.Tensor, want: torch.Tensor, dtype=torch.float32) -> None:
    assert got.shape == (B, S, H, D) and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max() <= tol


@pytest.mark.parametrize("count", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_head_partials(count, dtype, passes):
    parts = [_partial(i, (0, H), empty_rows=i == 1) for i in range(count)]
    out, got = _merged(parts, dtype=dtype)
    _close(got, _reference(parts), dtype)
    # the first partial is kept as it is, every later one but the last folded into the float32
    # accumulator before the next kernel, the last merged straight into the output
    assert passes == {"merge_pair": max(count - 2, 0), "merge_into": 0, "merge_final": int(count > 1)}
    assert out.pending is None and (count == 1 or (out.final is got and out.out is None))


def test_a_single_partial_is_the_output_as_the_kernel_gave_it(passes):
    o, lse, _ = _partial(0, (0, H))
    out = MergedOutput((B, S, H, D), torch.float32, torch.device("cpu"))
    out.merge(o, lse)
    out.finish()
    assert out.final is None and out.out is o  # kept: no merge, one cast to the caller's layout
    got = out.result()
    assert not any(passes.values())
    _close(got, _reference([(o, lse, (0, H))]))


@pytest.mark.parametrize("slices", [
    [(0, 2), (2, 4)],  # a payload in two chunks after the local partial
    [(0, 1), (1, 3), (3, 4), (0, 4), (2, 4)],  # more partials of some heads than of others
    [(1, 3)],  # heads no slice reaches keep the whole-head partial
])
def test_head_sliced_partials(slices):
    parts = [_partial(0, (0, H))] + [_partial(10 + i, s, empty_rows=i == 0) for i, s in enumerate(slices)]
    out, got = _merged(parts)
    _close(got, _reference(parts))
    assert out.direct is None  # more than two ranks: an accumulator, never the direct output


def test_head_sliced_partials_before_any_whole_one():
    """The first partial is a slice (the local shard kept nothing): the other heads start empty."""
    parts = [_partial(0, (0, 2)), _partial(1, (2, 3)), _partial(2, (0, 4))]
    _, got = _merged(parts)
    _close(got, _reference(parts))


@pytest.mark.parametrize("slices", [[(0, 2), (2, 4)], [(2, 4), (0, 1)], [(1, 3)]])
def test_two_ranks_write_each_slice_into_the_output(slices, passes):
    parts = [_partial(0, (0, H), empty_rows=True)] + [_partial(5 + i, s) for i, s in enumerate(slices)]
    out = MergedOutput((B, S, H, D), torch.bfloat16, torch.device("cpu"), last_slices=True)
    out.merge(parts[0][0], parts[0][1])
    for o, lse, heads in parts[1:]:
        out.fold()
        out.merge(o, lse, heads)
        assert out.direct is not None and not out.accumulating  # no float32 accumulator
    out.finish()
    got = out.result()
    assert out.direct is None and got is out.final
    # one pass per slice, straight into the output: no accumulator, no final merge
    assert passes == {"merge_pair": 0, "merge_into": len(slices), "merge_final": 0}
    _close(got, _reference(parts), torch.bfloat16)
    with pytest.raises(AssertionError, match="merged twice"):
        twice = MergedOutput((B, S, H, D), torch.float32, torch.device("cpu"), last_slices=True)
        twice.merge(*parts[0][:2])
        twice.merge(*parts[1])
        twice.merge(*parts[1])


def test_two_ranks_accumulate_once_the_whole_partials_were_folded():
    """``last_slices`` holds only right after the kept local partial: slices after a folded
    partial go to the accumulator (whose heads may yet see more)."""
    parts = [_partial(0, (0, H)), _partial(1, (0, H)), _partial(2, (0, 2)), _partial(3, (2, 4))]
    out, got = _merged(parts, last_slices=True)
    assert out.direct is None
    _close(got, _reference(parts))


def test_no_partial_at_all_is_zeros():
    out = MergedOutput((B, S, H, D), torch.bfloat16, torch.device("cpu"))
    got = out.result()
    assert got.shape == (B, S, H, D) and got.dtype == torch.bfloat16 and not got.any()


def test_a_strategy_that_assembles_its_output_hands_it_over_whole():
    out = MergedOutput((B, S, H, D), torch.float32, torch.device("cpu"))
    final = torch.randn(B, S, H, D)
    out.set_final(final)
    out.finish()
    assert out.result() is final


def test_a_dropped_call_is_freed_at_once():
    """No reference cycle between a call and its merged output or side stream: a dropped call's
    tensors (its inputs, the mask, the kept partial) go when it does, not at the next collection
    (``captured._capture`` drops its capture call for that)."""
    import gc
    import weakref

    from sparsp import SparspConfig
    from sparsp.plan import Shapes
    from sparsp.strategies.call import Call
    from sparsp.timing import PhaseTimer

    q = torch.randn(1, 32, 2, 8)
    call = Call(q, q, q, Shapes(0, 2, 1, 2, 8, 16, (32, 32)), SparspConfig(block_size=16, kernel="torch"), None,
                None)
    call.timer = PhaseTimer()
    assert call.output.timer is call.timer  # the output times its merges with the call's timer
    call.output.merge(torch.zeros(1, 2, 32, 8), torch.zeros(1, 2, 32))  # a kept partial
    gone = weakref.ref(call)
    gc.disable()
    try:
        del call
        assert gone() is None
    finally:
        gc.enable()
