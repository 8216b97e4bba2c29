"""What each strategy is, in one place: ``register_strategy`` and the lookups everything reads.

A strategy registers once, in its own module, with the facts every other part needs:

    @register_strategy("sparsp", sparse=True, placement="periodic", byte_rule="direct",
                       description="round k: exactly D[r,·,(r−k) mod G] from its owner")
    def run(call: Call) -> None: ...

``sp_attention``, the plan, the cost model (``sparsp.cost``, which receives a ``StrategySpec``
as its ``StrategyFacts``), ``sparsp simulate``, ``sparsp analyze``, the benchmarks and the tests
read names, choices and facts from here (``strategy_names()``, ``strategy_spec(name)``,
``strategies_where(...)``); none of them keeps a list of its own. The keywords after
``local_first`` say what a strategy is to the tools around the library (which one is the
dense baseline, which one is the reference, which rows it adds to the benchmarks, its colour
in plots); every one has a default, so a new strategy registers with the four facts alone. ``StrategyName`` names the built-in strategies for typed references; any
new name may be registered.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from ..demand import BYTE_RULES, ByteRule, comm_bytes as demand_comm_bytes
from ..wire import strategy_code

__all__ = ["StrategyName", "StrategySpec", "register_strategy", "strategies_where", "strategy_names",
           "strategy_spec"]

ABLATION_TRANSPORTS = ("nccl", "copy-engine")
"""The transports an ablation row names: NCCL, or the fabric's copy-engine one (``ipc`` on
NVLink, ``host`` on the host fabric; ``bench attention`` resolves it)."""


class StrategyName(str, enum.Enum):
    """The built-in strategies (README, "Strategies")."""

    RING = "ring"
    RING_SPARSE = "ring-sparse"
    RING_RELAY = "ring-relay"
    ULYSSES = "ulysses"
    SPARSP = "sparsp"


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategySpec:
    name: str
    run: Callable[..., None]
    """``run(call)``: moves K/V and calls the kernel for one attention call (a
    ``strategies.call.Call``)."""
    plan: Callable[..., dict] | None
    """Before any payload moves: the payload selections whose layouts the run needs
    (``{key: (selected bool [B·H, n_p], p)}``, or [U, B·H, n_p] for U head-group units laid
    out as ``(*key, i)``: ``Metadata.stage``), resolved in the call's one host sync."""
    sparse: bool
    """Reads the block mask (False: a dense baseline that ignores the thresholds)."""
    heads_divisible: bool
    """Needs heads % G == 0 (head-sharded strategies)."""
    placement: str
    """The placement it runs with by default in the benchmarks (``contiguous``/``periodic``)."""
    byte_rule: str | ByteRule
    """How many bytes each rank receives (``demand.BYTE_RULES`` name or a function)."""
    description: str = ""
    local_first: bool = False
    """Its run computes the local shard (``Call.attend_local``) before any payload: the call
    then queues that kernel before its host read, and the run issues its first round's packs
    and transfers on a side stream (``Call.side``) while the kernel runs."""
    baseline: bool = False
    """The no-sparsity baseline the others are compared with: ``sparsp analyze``'s
    ``reduction_vs_ring`` and ``sparsp simulate``'s ``speedup_vs_ring`` are against it (the
    JSON keys keep the dense ring's name), and a dense trace records with it."""
    primary: bool = False
    """The library's own strategy, wherever a tool runs one strategy for reference: the
    one-GPU sparse rows (``bench attention``'s ``1gpu-sparse``, ``sparsp simulate``'s
    ``one_gpu``), the bound the summary plot marks, the sparse trace recording."""
    copy_engine: bool = False
    """``bench attention`` also runs it over the fabric's copy-engine transport (``ipc`` or
    ``host``), besides NCCL."""
    ablation: tuple[tuple[str, str, str], ...] = ()
    """Its rows of ``bench attention --ablation``: (placement, transport — one of
    ``ABLATION_TRANSPORTS`` —, what the row switches on), in order; the ablation lists the
    strategies' rows in registration order."""
    color: str | None = None
    """Its colour in the benchmark plots (a matplotlib colour); None: the next free one."""

    def comm_bytes(self, masks, placement, *, head_dim: int, dtype_bytes: int = 2) -> dict:
        """Bytes each rank receives per call → ``{"total", "per_rank"}`` (``demand.comm_bytes``)."""
        return demand_comm_bytes(masks, placement, self.byte_rule, head_dim=head_dim,
                                 dtype_bytes=dtype_bytes)


_REGISTRY: dict[str, StrategySpec] = {}


def register_strategy(name: str, *, sparse: bool, placement: str, byte_rule,
                      heads_divisible: bool = False, plan: Callable | None = None,
                      description: str = "", local_first: bool = False, baseline: bool = False,
                      primary: bool = False, copy_engine: bool = False, ablation=(),
                      color: str | None = None) -> Callable:
    """Decorator: register ``run(call)`` as strategy ``name`` with its facts (``StrategySpec``
    documents each keyword)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a strategy name must be a non-empty str, got {name!r}")
    if placement not in ("contiguous", "periodic"):
        raise ValueError(f"placement must be 'contiguous' or 'periodic', got {placement!r}")
    if isinstance(byte_rule, str) and byte_rule not in BYTE_RULES:
        raise ValueError(f"byte_rule {byte_rule!r} is not one of {', '.join(BYTE_RULES)}")

    ablation = tuple(tuple(row) for row in ablation)
    for row in ablation:
        if len(row) != 3 or row[0] not in ("contiguous", "periodic") or row[1] not in ABLATION_TRANSPORTS \
                or not isinstance(row[2], str):
            raise ValueError(f"an ablation row is (placement, one of {ABLATION_TRANSPORTS}, what it "
                             f"switches on), got {row!r}")
    strategy_code(name)  # the header's code of this name, known for error messages

    def deco(run):
        _REGISTRY[name] = StrategySpec(name=name, run=run, plan=plan, sparse=sparse,
                                       heads_divisible=heads_divisible, placement=placement,
                                       byte_rule=byte_rule, description=description,
                                       local_first=local_first, baseline=baseline, primary=primary,
                                       copy_engine=copy_engine, ablation=ablation, color=color)
        return run

    return deco


BUILTIN_ORDER = ("ring", "ring-sparse", "ring-relay", "sparsp", "ulysses")
"""The order in which tables, plots and messages list the built-in strategies, whichever of
their modules was imported first."""


def _ordered() -> list[str]:
    """The registered names: the built-in ones in ``BUILTIN_ORDER``, then any other in
    registration order."""
    builtin = [n for n in BUILTIN_ORDER if n in _REGISTRY]
    return builtin + [n for n in _REGISTRY if n not in builtin]


def strategy_names() -> tuple[str, ...]:
    """Registered strategy names: the built-in ones in ``BUILTIN_ORDER``, then the others in
    registration order."""
    return tuple(_ordered())


def strategies_where(**facts) -> tuple[str, ...]:
    """Registered names whose ``StrategySpec`` has every given fact, in ``strategy_names()``'s
    order (``strategies_where(baseline=True)``, ``strategies_where(byte_rule="relay")``)."""
    return tuple(n for n in _ordered() if all(getattr(_REGISTRY[n], k) == v for k, v in facts.items()))


def strategy_spec(name: str) -> StrategySpec:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"strategy={name!r} is not one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]
