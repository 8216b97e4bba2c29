"""What each strategy is, in one place: ``register_strategy`` and the lookups everything reads.

A strategy registers once, in its own module, with the facts every other part needs:

    @register_strategy("sparsp", sparse=True, placement="periodic", byte_rule="direct",
                       description="round k: exactly D[r,·,(r−k) mod G] from its owner")
    def run(call: Call) -> None: ...

``sp_attention``, the plan, the benchmarks, ``sparsp analyze`` and the tests read names,
choices and facts from here (``strategy_names()``, ``strategy_spec(name)``); none of them keeps
a list of its own. ``StrategyName`` names the built-in strategies for typed references; any
new name may be registered.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .. import demand
from ..plan import strategy_code

if TYPE_CHECKING:
    from .base import Call

__all__ = ["StrategyName", "StrategySpec", "register_strategy", "strategy_names", "strategy_spec"]


class StrategyName(str, enum.Enum):
    """The built-in strategies (DESIGN.md, "Baselines")."""

    RING = "ring"
    RING_SPARSE = "ring-sparse"
    RING_RELAY = "ring-relay"
    ULYSSES = "ulysses"
    SPARSP = "sparsp"


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategySpec:
    name: str
    run: Callable[["Call"], None]
    """Moves K/V and calls the kernel for one attention call (``strategies/base.py``)."""
    plan: Callable[["Call"], dict] | None
    """Before any payload moves: the payload selections whose layouts the run needs
    (``{key: (selected bool [B·H, n_p], p)}``, or [U, B·H, n_p] for U head-group units laid
    out as ``(*key, i)``: ``Metadata.stage``), resolved in the call's one host sync."""
    sparse: bool
    """Reads the block mask (False: a dense baseline that ignores the thresholds)."""
    heads_divisible: bool
    """Needs heads % G == 0 (head-sharded strategies)."""
    placement: str
    """The placement it runs with by default in the benchmarks (``contiguous``/``periodic``)."""
    byte_rule: str | demand.ByteRule
    """How many bytes each rank receives (``demand.BYTE_RULES`` name or a function)."""
    description: str = ""
    local_first: bool = False
    """Its run computes the local shard (``Call.attend_local``) before any payload: the call
    then queues that kernel before its host read, and the run issues its first round's packs
    and transfers on a side stream (``Call.side``) while the kernel runs."""

    def comm_bytes(self, masks, placement, *, head_dim: int, dtype_bytes: int = 2) -> dict:
        """Bytes each rank receives per call → ``{"total", "per_rank"}`` (``demand.comm_bytes``)."""
        return demand.comm_bytes(masks, placement, self.byte_rule, head_dim=head_dim,
                                 dtype_bytes=dtype_bytes)


_REGISTRY: dict[str, StrategySpec] = {}


def register_strategy(name: str, *, sparse: bool, placement: str, byte_rule,
                      heads_divisible: bool = False, plan: Callable | None = None,
                      description: str = "", local_first: bool = False) -> Callable:
    """Decorator: register ``run(call)`` as strategy ``name`` with its facts."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a strategy name must be a non-empty str, got {name!r}")
    if placement not in ("contiguous", "periodic"):
        raise ValueError(f"placement must be 'contiguous' or 'periodic', got {placement!r}")
    if isinstance(byte_rule, str) and byte_rule not in demand.BYTE_RULES:
        raise ValueError(f"byte_rule {byte_rule!r} is not one of {', '.join(demand.BYTE_RULES)}")

    strategy_code(name)  # the header's code of this name, known for error messages

    def deco(run):
        _REGISTRY[name] = StrategySpec(name=name, run=run, plan=plan, sparse=sparse,
                                       heads_divisible=heads_divisible, placement=placement,
                                       byte_rule=byte_rule, description=description,
                                       local_first=local_first)
        return run

    return deco


def strategy_names() -> tuple[str, ...]:
    """Registered strategy names, in registration order."""
    return tuple(_REGISTRY)


def strategy_spec(name: str) -> StrategySpec:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"strategy={name!r} is not one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]
