"""The output of one attention call, merged from its partial results as they arrive.

A strategy computes the local queries against disjoint sets of keys (the local shard, each
payload, each chunk of a payload) and hands every partial result ``(o, lse)`` to one
``MergedOutput``; it merges them with the one LSE merge of ``kernels.merge`` (docs/design.md,
"Conventions") — ring-flash-attn's ``update_out_and_lse`` state, given a name. What it keeps
between partials decides how many passes over the output a call pays (``cost.model``'s
``MERGE_*`` bytes count them):

- the first whole-head partial is kept as the kernel returned it (no copy);
- a later one waits (``pending``) until the next kernel's launch folds it into a float32
  accumulator (``fold``), or, when no kernel follows, is merged straight into the caller's
  dtype and layout (``finish``: one pass that writes the output);
- a head-sliced partial (a chunk of a payload, heads [h0, h1)) merges into that slice of the
  accumulator; on two ranks (``last_slices``) each slice after the kept local partial is its
  heads' last partial, so it merges straight into the output being written slice by slice.
"""

from __future__ import annotations

import torch

from ..kernels import merge_final, merge_into, merge_pair
from ..timing import PhaseTimer, phase_of

Heads = tuple[int, int]


class MergedOutput:
    """The merged output of one call on one rank, for q of shape (B, S, H, D).

    ``merge`` takes each partial ``o`` (B, H', S, D) and ``lse`` (B, H', S) of query heads
    ``heads`` (all when None); ``fold`` is called before each kernel launch, ``finish`` after
    the run's last kernel, ``result`` gives the output (B, S, H, D) in q's dtype. ``timer``: a
    benchmark's (``Call.timer``), which times the merges as the phase ``merge``.
    ``last_slices``: every head-sliced partial after the kept first whole one is its heads' last
    (two ranks: the local partial and one payload cut into disjoint head groups)."""

    def __init__(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device, *,
                 last_slices: bool = False, timer: PhaseTimer | None = None) -> None:
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.last_slices = last_slices
        self.timer = timer
        self.out: torch.Tensor | None = None  # (B, H, S, D): a kept partial, or the float32 accumulator
        self.lse: torch.Tensor | None = None  # (B, H, S)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the last whole-head partial
        self.direct: tuple[torch.Tensor, list[Heads]] | None = None  # output written by head slices
        self.accumulating = False  # ``out`` is the float32 accumulator (not a kept partial)
        self.final: torch.Tensor | None = None  # the output, once written

    def set_final(self, final: torch.Tensor) -> None:
        """The whole output (B, S, H, D) in q's dtype, made by a strategy that assembles it
        itself (``ulysses``, a one-rank call on the dense kernel): no partial is merged."""
        self.final = final

    def merge(self, o: torch.Tensor, lse: torch.Tensor, heads: Heads | None = None) -> None:
        """Fold a partial result of query heads ``heads`` (all when None) into the output (the
        module docstring says what is kept)."""
        H = self.shape[2]
        whole = heads is None or heads == (0, H)
        if whole and self.out is None:
            self.out, self.lse = o, lse
            return
        self.fold()
        with phase_of(self.timer, "merge"):
            if whole:
                assert self.direct is None, "a whole-head partial after head-sliced ones written out"
                self.pending = (o, lse)
                return
            if self.direct is not None or (self.last_slices and self.out is not None and not self.accumulating):
                self._merge_last(o, lse, heads)
                return
            self._accumulate(o, lse, heads)

    def _merge_last(self, o: torch.Tensor, lse: torch.Tensor, heads: Heads) -> None:
        """The heads' last partial, merged with the kept one straight into the output."""
        if self.direct is None:
            B, S, H, D = self.shape
            self.direct = (torch.empty(B, S, H, D, dtype=self.dtype, device=self.device), [])
        final, done = self.direct
        h0, h1 = heads
        assert all(h1 <= a or b <= h0 for a, b in done), f"heads {heads} merged twice"
        merge_into(self.out[:, h0:h1], self.lse[:, h0:h1], o, lse, final.permute(0, 2, 1, 3)[:, h0:h1])
        done.append((h0, h1))

    def _accumulate(self, o: torch.Tensor, lse: torch.Tensor, heads: Heads) -> None:
        """A head slice folded into that slice of the float32 accumulator."""
        if self.out is None:  # nothing merged yet: an empty partial for every head
            B, S, H, D = self.shape
            self.out = torch.zeros(B, H, S, D, dtype=torch.float32, device=self.device)
            self.lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=self.device)
        elif not self.accumulating:  # a kept first partial: accumulate in fp32 now
            self.out, self.lse = self.out.float(), self.lse.float()
        self.accumulating = True
        h0, h1 = heads
        merge_into(self.out[:, h0:h1], self.lse[:, h0:h1], o, lse, self.out[:, h0:h1], self.lse[:, h0:h1])

    def fold(self) -> None:
        """The pending partial into the float32 accumulator: another one follows it."""
        if self.pending is not None:
            with phase_of(self.timer, "merge"):
                self.out, self.lse = merge_pair(self.out, self.lse, *self.pending)
            self.pending = None
            self.accumulating = True

    def finish(self) -> None:
        """The last partial merged into the caller's output (``merge_final``: one pass that
        writes (B, S, H, D) in q's dtype), queued right after the run's last kernel; or the
        heads no head-sliced partial reached copied into the output being written by slices."""
        if self.pending is not None and self.final is None:
            with phase_of(self.timer, "merge"):
                self.final = merge_final(self.out, self.lse, *self.pending, self.dtype)
            self.out = self.lse = self.pending = None
        elif self.direct is not None and self.final is None:
            final, done = self.direct
            H = self.shape[2]
            with phase_of(self.timer, "merge"):
                h = 0
                for a, b in sorted(done) + [(H, H)]:
                    if h < a:  # heads no slice reached: the kept partial as it is
                        final.permute(0, 2, 1, 3)[:, h:a].copy_(self.out[:, h:a])
                    h = max(h, b)
            self.final, self.out, self.lse, self.direct = final, None, None, None

    def result(self) -> torch.Tensor:
        """The merged output in the caller's layout and dtype, (B, S, H, D)."""
        self.finish()
        if self.final is not None:
            return self.final
        if self.out is None:  # no block selected at all: every row is empty, output zeros
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.out.permute(0, 2, 1, 3).to(self.dtype).contiguous()


__all__ = ["MergedOutput"]
