"""``strategy="auto"``: per call, the strategy the cost model predicts fastest.

After the call's metadata all-gather every rank holds the whole block mask (``plan.py``), so
it knows every rank's demand on every peer. The plan stage measures that demand on the device
(kept token pairs per pair of ranks, demanded K/V per pair, kept pairs per head:
``cost.figures.call_figures``, a few reductions); the O(G² + H) integers ride in the call's
one host read, beside the counts of ``sparsp``'s payloads (``PLANNED``: auto's plan stage
prepares them whatever it picks, ``captured.stage``). ``choose_from`` turns them into each
candidate's per-rank, per-round work (``cost.model.work``: the byte rules of
``sparsp.demand``) and schedules that on a machine profile (``cost.timeline.timeline``: the
cost model of ``sparsp simulate``, contention included). The fastest prediction wins:

- ``ulysses`` where the heads divide over the ranks and its all-to-all is cheaper;
- ``sparsp`` where sparsity pays (direct routing of exactly the demanded blocks, §5);
- ``ring``, the dense ring, where the mask is nearly full: then nothing is saved by skipping
  blocks, and predictions within ``MARGIN`` of the best go to the simpler strategy, in the
  order of ``CANDIDATES``. ``ring`` computes every block (it ignores the thresholds), so when
  it is picked the output is dense attention — what the mask nearly was.

Every rank makes the same choice: it is a pure function of integers every rank derives from
the same gathered summaries (exact sums, no floating-point reductions) and of the profile.
Placement is the caller's (the inputs arrive placed): auto picks among the strategies valid
for them (registered; ``ulysses`` only when heads % G == 0). Auto always needs the mask, also
when it picks ``ring``, so every candidate is charged the same mask cost.

The profile: ``use_profile(...)`` (a ``Profile`` or a name / profile JSON of
``sparsp.cost.get_profile``; ``sparsp simulate --fit-profile`` writes one for this machine),
else ``SPARSP_PROFILE``, else the measured 2×H200 profile of the transport's kind of path
(``h200x2-nvlink`` for ``ipc``, ``h200x2-host`` otherwise), widened to the group's size. The
transport figure is the call's transport if the profile has it, else the profile's default
(``Profile.call_transport``).

Predictions are cached per (profile, candidates, geometry) and demand rounded to three
significant digits (``Demand.rounded``: a choice never hinges on a few blocks, and denoising
steps repeat their masks), and the decision itself per exact figures: the choice runs on the
host between the call's read and its first transfer, so a call whose figures repeat (the same
mask) costs a lookup there instead of building and rounding its ``Demand`` again. A call whose
figures, shapes (the same object: the group's cached ones) and settings equal the previous
call's takes that call's decision after one list comparison, before any key is built. The
choice and its predicted times are logged once per geometry on the ``sparsp`` logger (and at
debug level whenever they change); a call that names its layer (``sp_attention(layer=...)``,
as the Diffusers processors do) is logged once per geometry and layer, since the layers of one
model differ in how dense their masks are and so in what pays. ``last_decision()`` returns the
latest one.
``SPARSP_PROFILE`` naming a JSON file is read once per value.

A denoising loop gives every layer a new mask each step, so exact figures rarely repeat there:
figures within ``NEAR`` (2 %, relative L1 per kind of figure) of figures the same group already
decided with the model take that decision (``_nearby``; kept per group, changed only by the
group's own calls, which every rank makes in the same order), and only the rest run the model.
A denoising loop's masks change a little per step, so without it the model would run on
nearly every call.
"""

from __future__ import annotations

import logging
import math
from operator import sub
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from ..env import profile as env_profile
from ..caches import lru_get, on_forget
from ..cost import demand_of, gather_bytes, get_profile, mask_bytes, resolve_local_first, timeline, work
from ..cost.figures import call_blocks
from ..plan import Shapes
from .registry import strategy_names, strategy_spec

log = logging.getLogger("sparsp")

AUTO = "auto"
CANDIDATES = ("ring", "ulysses", "sparsp")
"""What auto chooses among, in order of preference when predictions are within ``MARGIN``."""
PLANNED = "sparsp"
"""The one candidate with a plan: auto's plan stage prepares its payloads before the host read,
with the mask figures the choice needs, so the call still has one host read whatever it picks
(``ring`` and ``ulysses`` need no plan)."""
MARGIN = 0.02
"""Relative margin within which a prediction counts as a tie (the model is coarser than that)."""
DIGITS = 3
"""Significant digits of the demand figures the predictions are cached by (0.5 %: well inside
``MARGIN``, so rounding never favours one byte rule over another)."""
_CACHE_SIZE = 4096
NEAR = MARGIN
"""Relative L1 distance within which a call's demand counts as one this group already decided
(in each group of figures: kept pairs per rank pair, demanded K/V per rank pair, kept pairs per
head, relay hops): its decision is taken without running the model again (``_nearby``). The
predictions move about as much as the figures do, and predictions within ``MARGIN`` are a tie
anyway. A denoising loop gives every layer a new mask each step, close to its mask of the step
before: without this, auto ran the model on nearly every call of a real loop (≈ 0.9 ms of host
per call at G = 2 and 32 heads on a CPU host, between the read and the first transfer,
measured with new inputs every call)."""
_NEAR_KEYS = 256  # (settings, bucket) entries kept per group
_NEAR_PER_KEY = 8  # decided demands kept per entry


@dataclass(frozen=True)
class Decision:
    """One call's choice: the strategy, every candidate's predicted ms, and on what."""

    strategy: str
    predicted_ms: dict
    profile: str
    transport: str


_profile = None
_cache: OrderedDict = OrderedDict()  # rounded demand and call settings → (choice, times)
_exact: OrderedDict = OrderedDict()  # exact figures, call settings, group → (Decision, density)
# group id → (settings id, bucket) → [(size, figures per kind, sums, (choice, times))]: the demands this group
# decided with the model. Per group and changed only by its own calls, which every rank of the
# group makes in the same order: the same on every rank, as the group's transport epochs are.
_near: dict[int, OrderedDict] = {}
_env_profiles: dict[str, object] = {}  # SPARSP_PROFILE's value → its profile
_settings: dict[tuple, int] = {}  # ``_nearby``'s settings → a small id (``_settings_id``)
_widened: dict[tuple, object] = {}  # (SPARSP_PROFILE, ipc?, ranks) → the widened profile
_logged: dict[tuple, str] = {}
_last: Decision | None = None
_repeat: tuple | None = None  # (figures, shapes, settings, decision, layer) of the last call decided


def use_profile(profile=None) -> None:
    """The machine profile auto predicts with: a ``sparsp.cost.Profile``, a profile name or
    JSON path (``sparsp.cost.get_profile``), or None for the default (module docstring)."""
    global _profile, _repeat
    if profile is not None and not hasattr(profile, "transports"):
        profile = get_profile(profile)
    _profile = profile
    _repeat = None
    _widened.clear()
    _settings.clear()
    _cache.clear()
    _exact.clear()
    _near.clear()


def forget() -> None:
    """Drop cached predictions, the once-per-geometry log memory and the last decision."""
    global _last, _repeat
    _repeat = None
    _cache.clear()
    _exact.clear()
    _near.clear()
    _env_profiles.clear()
    _widened.clear()
    _settings.clear()
    _logged.clear()
    _last = None


on_forget("auto: predictions and decisions", forget)


def last_decision() -> Decision | None:
    """The latest choice made in this process (None before the first ``auto`` call)."""
    return _last


def candidates(heads: int, ranks: int) -> tuple[str, ...]:
    """The strategies auto may pick for ``heads`` heads on ``ranks`` ranks."""
    names = strategy_names()
    return tuple(s for s in CANDIDATES if s in names
                 and not (strategy_spec(s).heads_divisible and heads % ranks))


def profile_for(transport: str, ranks: int):
    """The profile for a call over ``transport`` on ``ranks`` ranks (module docstring): the same
    object for the same source, kind of path and ``ranks`` (the prediction caches and
    ``_nearby`` key on its identity, so a profile widened anew per call would make every rank's
    caches miss, or hit on one rank and miss on another wherever the allocator happened to reuse
    an address)."""
    named = "" if _profile is not None else (env_profile() or "")
    key = (named, transport == "ipc", ranks)  # ``use_profile`` empties it
    kept = _widened.get(key)
    if kept is not None:
        return kept
    prof = _profile
    if prof is None:
        if named:
            prof = _env_profiles.get(named)
            if prof is None:  # a file is read once per value, not on every call
                prof = _env_profiles[named] = get_profile(named)
        else:
            prof = get_profile("h200x2-nvlink" if transport == "ipc" else "h200x2-host")
    wide = _widened[key] = prof.widened(ranks)  # the same per-GPU figures, whole sockets and switches
    return wide


def decide(d, profile, transport: str, names: tuple[str, ...], *, head_dim: int, dtype_bytes: int,
           prefetch: int = 1, local_first: bool | None = None) -> tuple[str, dict]:
    """(choice, predicted ms per candidate) for a measured ``cost.Demand``.
    ``local_first``: the call's ``SparspConfig.local_first`` (None: automatic, the default),
    through the code's rule (``cost.model.resolve_local_first``: ``Call.local_first_pays``
    on ``PLANNED``'s payloads over ``transport`` with the figures of ``profile``). Auto's call is
    staged as ``PLANNED``'s, so only that candidate runs local first; another choice runs in
    order on a call of its own (``Call.without_plan``)."""
    figure = profile.call_transport(transport)
    planned_spec = strategy_spec(PLANNED)
    local_first = resolve_local_first(local_first, planned_spec, d, profile, figure, head_dim=head_dim,
                                      dtype_bytes=dtype_bytes)
    # auto computes the mask for every candidate: the same mask work and metadata all-gather
    masking = mask_bytes(d, head_dim=head_dim, dtype_bytes=dtype_bytes)
    gathered = gather_bytes(d, head_dim=head_dim, sparse=True)
    # ... and the same plan stage and host read (PLANNED's, with auto's figures): the same host
    # ops before the read and in its finish
    planned = work(planned_spec, d, head_dim=head_dim, dtype_bytes=dtype_bytes)
    times = {}
    for s in names:
        w = replace(work(strategy_spec(s), d, head_dim=head_dim, dtype_bytes=dtype_bytes, local_first=local_first and s == PLANNED),
                    mask_bytes=masking, gather_bytes=gathered, host_ops=planned.host_ops,
                    finish_ops=planned.finish_ops)
        times[s] = round(timeline(w, profile, transport=figure, head_dim=head_dim,
                                  prefetch=prefetch).latency_ms, 4)
    best = min(times.values())
    return next(s for s in names if times[s] <= best * (1 + MARGIN)), times


def _cached(cache: OrderedDict, key, make):
    """``cache[key]``, made by ``make()`` when missing; least recently used out past
    ``_CACHE_SIZE`` entries."""
    return lru_get(cache, key, make, _CACHE_SIZE)


def choose_from(host: list[int], sh: Shapes, q: torch.Tensor, group, config, transport,
                layer: int | None = None) -> str:
    """The strategy for this call (same on every rank) from ``cost.figures.call_figures`` read
    on the host; see the module docstring. ``layer``: the model layer of the call (None: not
    said), for the log."""
    global _last, _repeat
    token = ("set", id(_profile)) if _profile is not None else ("env", env_profile() or "")
    settings = (transport.name, q.dtype, config.prefetch, config.local_first, token, id(group))
    if _repeat is not None and _repeat[1] is sh and _repeat[2] == settings and _repeat[4] == layer \
            and _repeat[0] == host:
        # the same figures as the last call of this geometry (and layer: another layer may
        # still owe its log line): its decision
        _last = _repeat[3]
        return _last.strategy
    H, G = sh.heads, sh.world_size
    names = candidates(H, G)
    if len(names) == 1:
        return names[0]
    key = (tuple(host), sh, names, transport.name, q.dtype, config.prefetch, config.local_first, token,
           id(group))
    decision, density = _cached(_exact, key, lambda: _decision(host, sh, q, config, transport, names,
                                                               id(group)))
    _last = decision
    _repeat = (list(host), sh, settings, decision, layer)
    geometry = (id(group), sh, q.dtype, q.device, layer)
    if _logged.get(geometry) != decision.strategy:
        level = logging.INFO if geometry not in _logged else logging.DEBUG
        _logged[geometry] = decision.strategy
        log.log(level, "sparsp auto: %s for %sG=%d, %d tokens, %dx%d heads, density %.3f "
                "(predicted ms: %s; profile %s, transport %s)", decision.strategy,
                "" if layer is None else f"layer {layer}, ", G, sum(sh.seq_lens), H,
                sh.head_dim, density, ", ".join(f"{s} {t:.3g}" for s, t in decision.predicted_ms.items()),
                decision.profile, decision.transport)
    return decision.strategy


def _decision(host: list[int], sh: Shapes, q: torch.Tensor, config, transport,
              names: tuple[str, ...], group: int) -> tuple[Decision, float]:
    """``choose_from``'s work for figures not seen before: the decision of figures this group
    decided within ``NEAR`` (``_nearby``), else the ``Demand``, rounded, through the prediction
    cache (the model on a miss); and the mask's density for the log line."""
    B, H, G, N = sh.batch, sh.heads, sh.world_size, sh.total_blocks
    density = sum(host[2 * G * G: 2 * G * G + H]) / (B * H * sum(sh.seq_lens) ** 2)
    profile = profile_for(transport.name, G)
    settings = (profile.name, id(profile), transport.name, names, sh, q.element_size(),
                config.prefetch, config.local_first)
    cuts = (0, G * G, 2 * G * G, 2 * G * G + H, len(host))
    sid = _settings_id(settings)
    hit = _nearby(group, sid, host, cuts)
    if hit is None:
        d = demand_of(host, call_blocks(sh, q.device), B * H, N, batch=B).rounded(DIGITS)
        key = (profile.name, id(profile), transport.name, names, sh.head_dim, q.element_size(),
               config.prefetch, config.local_first, d)
        hit = _cached(_cache, key, lambda: decide(  # a pure function of the key: every group's
            d, profile, transport.name, names, head_dim=sh.head_dim, dtype_bytes=q.element_size(),
            prefetch=config.prefetch, local_first=config.local_first))
        _remember(group, sid, host, cuts, hit)
    choice, times = hit
    return Decision(choice, dict(times), profile.name, transport.name), density


def _bucket(pairs: int) -> int:
    """A log-scale bucket of the total kept pairs, ``NEAR`` wide: figures within ``NEAR`` of
    others lie in their bucket or a neighbour's."""
    return int(math.log1p(pairs) / math.log1p(NEAR))


def _settings_id(settings: tuple) -> int:
    """A small integer per distinct ``settings`` (hashed once per call, not per lookup)."""
    sid = _settings.get(settings)
    if sid is None:
        if len(_settings) >= _CACHE_SIZE:  # many geometries or configs: start over
            _settings.clear()
            _near.clear()
        sid = _settings[settings] = len(_settings)
    return sid


def _nearby(group: int, sid: int, host: list[int], cuts: tuple):
    """(choice, times) of figures this group decided whose relative L1 distance from ``host``
    is within ``NEAR`` in every kind of figure, or None. ``sid``: ``_settings_id``."""
    kept = _near.get(group)
    if not kept:
        return None
    b = _bucket(sum(host[cuts[0]:cuts[1]]))
    parts = None
    for near in (b, b - 1, b + 1, b - 2, b + 2):
        entries = kept.get((sid, near))
        if not entries:
            continue
        if parts is None:
            parts = [host[a:e] for a, e in zip(cuts, cuts[1:])]
        for size, theirs, sums, hit in entries:
            if size == len(host) and all(sum(map(abs, map(sub, mine, other))) <= NEAR * total
                                         for mine, other, total in zip(parts, theirs, sums)):
                return hit
    return None


def _remember(group: int, sid: int, host: list[int], cuts: tuple, hit) -> None:
    kept = _near.setdefault(group, OrderedDict())
    parts = tuple(host[a:e] for a, e in zip(cuts, cuts[1:]))
    sums = tuple(sum(p) for p in parts)
    key = (sid, _bucket(sums[0]))
    entries = kept.pop(key, [])
    kept[key] = [(len(host), parts, sums, hit)] + entries[:_NEAR_PER_KEY - 1]
    while len(kept) > _NEAR_KEYS:
        kept.popitem(last=False)


__all__ = ["AUTO", "CANDIDATES", "DIGITS", "Decision", "MARGIN", "PLANNED", "candidates", "choose_from",
           "decide", "forget", "last_decision", "profile_for", "use_profile"]
