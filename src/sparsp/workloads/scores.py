"""Token-level scores of sampled query rows against every key, drawn directly, and the token
density they give: what ``sparsp.workloads.calibration`` measures a head by.

A head's density is counted on a few query rows against ALL keys (75,600 for Wan 2.1, 126,976
for HunyuanVideo). Forming the generator's q and k (``token_qk``) and their product would cost
an S × D noise draw, its rotation and R × D × S products per head and per trial of a; none of it
is needed, because of what the generator is (``sparsp.workloads.synthetic``):

- **Key noise.** k_m = R(p_m)(a c + σ ε'_m [+ a s_m]) with ε'_m iid N(0, I) and R(p_m)
  orthogonal, so R(p_m) ε'_m is N(0, I) too, and its projection on a query x is N(0, |x|²),
  independent across keys. A row's key-noise part is σ |x| / √D · ξ_m with ξ_m iid N(0, 1):
  one number per (row, key), drawn directly. ``token_qk``'s rows share their keys' noise; here
  each row draws its own. A row's density depends on that row's scores alone, so each row's
  distribution, and the mean over rows, are the generator's; the same argument lets the heads
  of a layer share ξ.
- **The rest is a relative-position kernel.** Each RoPE pair turns with one axis, so
  x · R(p_m) c is a function of t_m plus one of h_m plus one of w_m: three small tables
  (T + H + W numbers per row) added over the latent grid, plus a column per sink. Text keys
  are not rotated: to a row they look like grid position (0, 0, 0).
- **The alignment.** x = R(p_n)(a c + σ ε_n), so the tables are a² (content) + a σ (query
  noise) and |x|² is quadratic in a: one set of tables serves every trial of a.

The density counts, per row, the fewest keys holding ``mass`` of its softmax over all keys,
from a histogram of the scores (bins of 1/20 nat below the row's top) rather than a sort.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..geometry import VideoGeometry
from .rope import angles, frequencies, rotate_pairs
from .synthetic import DEFAULT_MIX, HeadMix, HeadParams, draw_heads, seeded_generator

_BIN = 0.05  # nats: keys within 5 % of each other in p share a bin
_WINDOW = 30.0  # keys more than 30 nats below a row's top hold under S e^-30 of its mass: never counted
_BINS = round(_WINDOW / _BIN) + 1  # per row; the last holds the top key
_CHUNK_ROWS = 8  # rows per histogram: a temporary of 8 × S floats stays in the cache
_MAGIC = 12582912.0  # 1.5 × 2^23
_MAGIC_BITS = 0x4B400000  # its float32 bits
_FLOORS = 8


@dataclass(frozen=True, eq=False)
class RowScores:
    """The scores of one layer's sampled query rows, per head, as functions of the alignment a:

        score(a)[n, m] = a² C[n, m] + a σ E[n, m] + scale_n(a) ξ[n, m]

    with C and E kept as per-axis tables (``tables`` [2, heads, rows, T + H + W]: t, h, w
    parts) plus sink columns, scale_n(a) = σ |a c + σ ε_n| / √D, and ξ [rows, S] shared."""

    geom: VideoGeometry
    noise: float
    tables: torch.Tensor  # float64 [2, heads, rows, T + H + W]: content, query noise (÷ √D)
    sinks: tuple[torch.Tensor, ...]  # per head: key indices of its sinks
    sink_scores: tuple[torch.Tensor, ...]  # per head: float64 [2, rows, sinks]
    norms: torch.Tensor  # float64 [3, heads, rows]: |c|², c · ε_n, |ε_n|² (÷ D)
    xi: torch.Tensor  # float32 [rows, S]: iid N(0, 1), the keys' noise seen from each row

    @property
    def rows(self) -> int:
        return self.xi.shape[0]

    def scores(self, head: int, a: float, rows: slice = slice(None)) -> torch.Tensor:
        """Float32 [rows, S]: head ``head``'s scores at alignment ``a``."""
        parts = self._parts(head, a, rows)
        out = torch.empty(len(parts[0]), self.geom.num_tokens)
        self._fill(out, head, parts, rows.indices(self.rows)[0], 0)
        return out

    def count(self, head: int, a: float, mass: float, counter: KeyCounter, rows: slice) -> float:
        """The sum over ``rows`` of head ``head``'s fewest keys holding ``mass`` at ``a``."""
        parts = self._parts(head, a, rows)
        start, n = rows.indices(self.rows)[0], len(parts[0])
        hist = torch.empty(n, _BINS, dtype=torch.int64)
        for i in range(0, n, _CHUNK_ROWS):
            out = counter.buffer(min(_CHUNK_ROWS, n - i))
            self._fill(out, head, parts, start + i, i)
            hist[i:i + len(out)] = counter.histogram(out)
        return float(_fewest(hist, mass).sum())

    def density(self, head: int, a: float, mass: float, counter: KeyCounter) -> float:
        """Head ``head``'s token density at ``a``: its count over the keys, averaged over every row."""
        return self.count(head, a, mass, counter, slice(None)) / self.rows / self.geom.num_tokens

    def _parts(self, head: int, a: float, rows: slice) -> tuple[torch.Tensor, ...]:
        """At ``a``, per row of ``rows``: the h + w table over a frame [n, H·W], the t table
        [n, T], the text keys' score [n, 1], the noise scale [n, 1] and the sinks' [n, sinks]."""
        g = self.geom
        T = g.frames
        tab = (self.tables[0, head, rows] * (a * a) + self.tables[1, head, rows] * (a * self.noise)).float()
        ft, fh, fw = tab[:, :T], tab[:, T:T + g.height], tab[:, T + g.height:]
        c, e, ee = self.norms[:, head, rows]
        scale = self.noise * (a * a * c + 2 * a * self.noise * e + self.noise ** 2 * ee).clamp_min(0).sqrt()
        sink = self.sink_scores[head][:, rows]
        return ((fh[:, :, None] + fw[:, None, :]).flatten(1), ft, ft[:, :1] + fh[:, :1] + fw[:, :1],
                scale.float()[:, None], (sink[0] * (a * a) + sink[1] * (a * self.noise)).float())

    def _fill(self, out: torch.Tensor, head: int, parts: tuple[torch.Tensor, ...], row: int, at: int) -> None:
        """Rows ``row`` … of the scores into ``out`` [n, S], from ``parts`` (rows ``at`` …)."""
        g = self.geom
        n, T, hw, video = len(out), g.frames, g.frame_tokens, g.video_tokens
        fhw, ft, text, scale, sink = (p[at:at + n] for p in parts)
        xi = self.xi[row:row + n]
        grid = out[:, :video].view(n, T, hw)
        torch.addcmul(fhw[:, None, :], xi[:, :video].view(n, T, hw), scale[:, :, None], out=grid)
        grid.add_(ft[:, :, None])
        if video < g.num_tokens:  # text keys: grid position (0, 0, 0), no rotation
            torch.addcmul(text, xi[:, video:], scale, out=out[:, video:])
        if len(self.sinks[head]):
            out[:, self.sinks[head]] += sink


def _basis(geom: VideoGeometry, rotate: bool) -> torch.Tensor:
    """Float64 [D, T + H + W]: row j (pair j's cos part) and D/2 + j (its sin part) give
    pair j's term cos(ω_j v), sin(ω_j v) at every position v of its axis; unrotated pairs
    (and every pair of a head without RoPE) add their constant to the t table."""
    omega, axis = frequencies(geom)
    half = len(omega)
    sizes = (geom.frames, geom.height, geom.width)
    out = torch.zeros(2 * half, sum(sizes), dtype=torch.float64)
    start = 0
    for ax, n in enumerate(sizes):
        v = torch.arange(n, dtype=torch.float64)
        on = (axis == ax) if rotate else torch.zeros(half, dtype=torch.bool)
        ang = omega[on, None] * v
        out[:half][on, start:start + n] = ang.cos()
        out[half:][on, start:start + n] = ang.sin()
        start += n
    flat = ~(axis < 3) if rotate else torch.ones(half, dtype=torch.bool)
    out[:half][flat, :sizes[0]] = 1.0
    return out


def _pair_terms(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """[..., D]: per pair j, (x0 c0 + x1 c1, x1 c0 − x0 c1), so that x · R(θ) c =
    Σ_j first_j cos θ_j + second_j sin θ_j; as [..., D] (the D/2 firsts, then the seconds)."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c0, c1 = c.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.cat([x0 * c0 + x1 * c1, x1 * c0 - x0 * c1], -1)


def row_scores(
    geom: VideoGeometry,
    kinds: Sequence[str],
    *,
    seed: int,
    layer: int,
    rows: torch.Tensor,
    noise_seed: int,
    mix: HeadMix | None = None,
) -> RowScores:
    """The scores of query ``rows`` of every head of ``kinds`` (``token_qk`` with
    ``HeadParams(kinds, …)``: the same c, ρ and sinks) against every key. The noise comes
    from its own streams per ``noise_seed``, so two seeds give two independent samples."""
    mix = mix or DEFAULT_MIX
    H, D, S = geom.heads, geom.head_dim, geom.num_tokens
    drawn = draw_heads(geom, mix, seed, layer, HeadParams(tuple(kinds), (1.0,) * H))  # sink_dir per unit a
    rows = rows.long()
    ang = angles(geom, rows)
    cos_q, sin_q = ang.cos(), ang.sin()
    bases = {r: _basis(geom, r) for r in (True, False)}
    tables = torch.empty(2, H, len(rows), bases[True].shape[1], dtype=torch.float64)
    norms = torch.empty(3, H, len(rows), dtype=torch.float64)
    sink_scores = []
    for h in range(H):
        eps = torch.randn(len(rows), D, generator=seeded_generator(seed, layer, f"scores/{noise_seed}/{h}"),
                          dtype=torch.float64)
        c = drawn.c[h]
        rot = bool(drawn.rotate[h])
        xc = rotate_pairs(c.expand(len(rows), D), cos_q, sin_q) if rot else c.expand(len(rows), D)
        xe = rotate_pairs(eps, cos_q, sin_q) if rot else eps
        tables[0, h] = _pair_terms(xc, c) @ bases[rot] / math.sqrt(D)
        tables[1, h] = _pair_terms(xe, c) @ bases[rot] / math.sqrt(D)
        norms[:, h] = torch.stack([(c * c).sum().expand(len(rows)), eps @ c, (eps * eps).sum(1)]) / D
        idx = drawn.sinks[h]
        if len(idx):
            sa = angles(geom, idx)
            k_sink = rotate_pairs(drawn.sink_dir[h].expand(len(idx), D), sa.cos(), sa.sin())
            sink_scores.append(torch.stack([xc @ k_sink.T, xe @ k_sink.T]) / math.sqrt(D))
        else:
            sink_scores.append(torch.empty(2, len(rows), 0, dtype=torch.float64))
    xi = torch.randn(len(rows), S, generator=seeded_generator(seed, layer, f"scores/{noise_seed}/keys"))
    return RowScores(geom=geom, noise=mix.noise, tables=tables, sinks=tuple(drawn.sinks),
                     sink_scores=tuple(sink_scores), norms=norms, xi=xi)


def token_density(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """Per leading index of ``scores`` [..., rows, keys]: the fewest keys holding ``mass`` of
    each row's softmax, over the number of keys, averaged over the rows.

    Counted from a histogram of the scores (bins of 1/20 nat below each row's top) instead of
    a sort; the bin that crosses ``mass`` is split in proportion to its mass, so the count is
    within a fraction of one bin of the sorted one (tests/test_calibration.py)."""
    *lead, rows, keys = scores.shape
    counter = KeyCounter(keys)
    hist = torch.cat([counter.histogram(counter.buffer(len(part)).copy_(part))
                      for part in scores.reshape(-1, keys).split(_CHUNK_ROWS)])
    return (_fewest(hist, mass).reshape(*lead, rows) / keys).mean(-1)


class KeyCounter:
    """Histograms of rows of scores, for counting the fewest keys that hold a share of each
    row's softmax; holds the buffers they need, so that counting allocates nothing new."""

    def __init__(self, keys: int) -> None:
        self.keys = keys
        self._scores = torch.empty(_CHUNK_ROWS, keys)
        # Keys _WINDOW nats or more below the top go to one of _FLOORS bins below the window,
        # by their index: a count's increments of one bin wait on each other, and most keys of
        # a sharp head lie that low.
        self._floor = -_WINDOW - (torch.arange(keys) % _FLOORS + 1).float() * _BIN
        # Row i's bins start at i × (_FLOORS + _BINS); a row's top key lands in its last bin.
        self._top = torch.arange(_CHUNK_ROWS, dtype=torch.float32)[:, None] * (_FLOORS + _BINS) + (
            _MAGIC + _FLOORS + _BINS - 1)

    def buffer(self, rows: int) -> torch.Tensor:
        """A float32 [rows, keys] buffer (rows <= 8) to put scores in for ``histogram``."""
        return self._scores[:rows]

    def histogram(self, scores: torch.Tensor) -> torch.Tensor:
        """Int64 [rows, _BINS]: per row of ``scores`` (a ``buffer``, overwritten), its keys in
        bins of 1/20 nat down from its top (bin 0), the last ``_WINDOW`` nats below it."""
        n = len(scores)
        scores.sub_(scores.amax(1, keepdim=True))  # first, so the top is exact whatever its size
        torch.maximum(scores, self._floor, out=scores)
        # Bins as integers: adding 1.5 × 2^23 to a float32 below 2^22 leaves its nearest
        # integer in the low bits, cheaper than a conversion.
        torch.add(self._top[:n], scores, alpha=1 / _BIN, out=scores)
        bins = scores.view(torch.int32).sub_(_MAGIC_BITS).flatten()
        return torch.bincount(bins, minlength=n * (_FLOORS + _BINS)).view(n, -1)[:, _FLOORS:].flip(1)


_MASS = ((torch.arange(_BINS, dtype=torch.float64)) * -_BIN).exp()
"""A key's share of its row's top key, at its bin's centre (the top bin's is the top key's, 1)."""


def _fewest(hist: torch.Tensor, mass: float) -> torch.Tensor:
    """Float64 [rows]: per row of ``hist`` (``KeyCounter.histogram``), the fewest keys holding
    ``mass`` of its softmax; the bin that crosses ``mass`` counts in proportion to its mass."""
    count = hist.double()
    pm = count * _MASS
    cm, cc = pm.cumsum(1), count.cumsum(1)
    i = (cm < mass * cm[:, -1:]).sum(1, keepdim=True).clamp(max=_BINS - 1)
    bin_m, bin_c = pm.gather(1, i), count.gather(1, i)
    frac = ((mass * cm[:, -1:] - (cm.gather(1, i) - bin_m)) / bin_m.clamp_min(1e-300)).clamp(0, 1)
    return (cc.gather(1, i) - bin_c + torch.ceil(frac * bin_c)).clamp_min(1).flatten()
