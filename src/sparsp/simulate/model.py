"""The cost model's work (``sparsp.cost``), with strategies named as ``sparsp simulate`` names them.

Everything here is ``sparsp.cost.model``, ``cost.ops`` and ``cost.figures``; the functions that
take a strategy (``work``, ``build_work``, ``resolve_local_first``, ``local_first_pays``,
``schedule_of``) also take its registered name and look its facts up in the strategy registry,
which the cost package itself never imports.
"""

from __future__ import annotations

import torch

from ..cost import model as _model
from ..cost.figures import (Blocks, Demand, _column_figures, demand_figures, demand_of, measure,  # noqa: F401
                            pair_flops)
from ..cost.model import (CHECK_FINITE, FINAL_BYTES, FINAL_SECOND_BYTES, INPUT_PASSES, LOCAL_FIRST,  # noqa: F401
                          MERGE_BYTES, MERGE_FIRST_BYTES, MERGE_SECOND_BYTES, SCHEDULES, SIMILARITY, SYNCS_PER_CALL,
                          ULYSSES_FIRST_BYTES, ULYSSES_INPUT_BYTES, ULYSSES_MERGE_BYTES, ULYSSES_PIECE_BYTES,
                          ULYSSES_RESULT_BYTES, ULYSSES_WHOLE_COPY_BYTES, StrategyFacts, Work, chunk_ops,
                          drain_units, gather_bytes, kind_of, mask_bytes)
from ..cost.ops import *  # noqa: F401,F403
from ..cost.profiles import Profile
from ..placement import Placement
from ..strategies.registry import strategy_names, strategy_spec


def spec_of(strategy: str | StrategyFacts) -> StrategyFacts:
    """The registered facts of ``strategy`` (a name), or ``strategy`` itself when it is facts."""
    if isinstance(strategy, str):
        if strategy not in strategy_names():
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(strategy_names())}")
        return strategy_spec(strategy)
    return strategy


def schedule_of(strategy: str | StrategyFacts) -> str:
    """``cost.model.schedule_of`` of a strategy name or its facts."""
    return _model.schedule_of(spec_of(strategy))


def build_work(masks: torch.Tensor, placement: Placement, strategy: str | StrategyFacts, *, head_dim: int,
               dtype_bytes: int = 2, profile: Profile | None = None, transport: str | None = None,
               local_first: bool | None = LOCAL_FIRST, head_order: tuple[int, ...] | None = None) -> Work:
    """``cost.model.build_work`` of a strategy name or its facts."""
    return _model.build_work(masks, placement, spec_of(strategy), head_dim=head_dim, dtype_bytes=dtype_bytes,
                             profile=profile, transport=transport, local_first=local_first,
                             head_order=head_order)


def work(strategy: str | StrategyFacts, d: Demand, *, head_dim: int, dtype_bytes: int = 2,
         profile: Profile | None = None, transport: str | None = None, graphed: bool = True,
         local_first: bool | None = LOCAL_FIRST, head_order: tuple[int, ...] | None = None) -> Work:
    """``cost.model.work`` of a strategy name or its facts."""
    return _model.work(spec_of(strategy), d, head_dim=head_dim, dtype_bytes=dtype_bytes, profile=profile,
                       transport=transport, graphed=graphed, local_first=local_first, head_order=head_order)


def resolve_local_first(setting: bool | None, strategy: str | StrategyFacts, d: Demand, profile: Profile | None,
                        transport: str | None, *, head_dim: int, dtype_bytes: int = 2) -> bool:
    """``cost.model.resolve_local_first`` of a strategy name or its facts."""
    return _model.resolve_local_first(setting, spec_of(strategy), d, profile, transport, head_dim=head_dim,
                                      dtype_bytes=dtype_bytes)


def local_first_pays(strategy: str | StrategyFacts, d: Demand, profile: Profile, transport: str | None, *,
                     head_dim: int, dtype_bytes: int = 2) -> tuple[bool, ...]:
    """``cost.model.local_first_pays`` of a strategy name or its facts."""
    return _model.local_first_pays(spec_of(strategy), d, profile, transport, head_dim=head_dim,
                                   dtype_bytes=dtype_bytes)
