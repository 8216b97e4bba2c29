"""One attention layer per strategy on several GPUs, with its time split and bound.

    torchrun --nproc-per-node 2 -m sparsp.cli bench attention --model hunyuan-video --fabric nvlink
    torchrun --nproc-per-node 2 -m sparsp.cli bench attention --fabric host   # NCCL_P2P_DISABLE=1

Inputs are the synthetic video Q/K of ``sparsp.workloads.synthetic`` (V random) at the model's full
geometry, placed as each strategy runs by default (its registration). Every strategy uses the
same kernel. Per row:

* ``median_ms``: CUDA events around the whole call (mask, plan, transfers, kernels, merge),
  warm-up first, median of ≥ 10 iterations, the slowest rank each iteration. The rows of one
  cdf are timed *interleaved* (``timing``): each timed round runs one iteration of every row
  in turn, starting one row later than the round before (every row follows every other
  alike), so clock and thermal drift over the minutes a run takes reaches every row alike
  (back-to-back timing of one row after another put 10 % between two runs of the same
  configuration at LTX-Video size); ``--sequential`` times row after row;
* the time split of one more call, timed phase by phase with CUDA events on the compute
  stream (``timing.PhaseTimer``), the slowest rank's: ``mask_ms`` (metadata
  all-gather, whole mask, up to the host read's copy), ``pack_ms``, ``compute_ms`` (kernels),
  ``merge_ms`` (LSE merges), ``transfer_ms`` (each fetch from issue to landed, summed; overlaps
  compute), ``exposed_comm_ms`` = call − mask − pack − compute − merge (the compute stream
  waiting). A ``local_first`` strategy queues its local kernel before the host read and packs
  its first round on a side stream while that kernel runs (``strategies.call.Call.side``):
  that pack is in ``pack_ms`` and in ``pack_side_ms``, but not subtracted for ``exposed``;
* ``host_syncs`` and ``collectives`` of one call, counted by ``torch.profiler``
  (``cudaStreamSynchronize``/``cudaDeviceSynchronize``/``cudaEventSynchronize`` calls, and
  event polls that waited — ``groups.to_host`` — counted once per read; ``c10d::`` collective
  ops other than the transports' send/recv);
* the bound: C = the slowest rank's kept-block FLOPs (real tokens) / ``dense_tflops`` (the
  fastest dense kernel measured in this run at this head dim), T = ``bytes_max_rank`` /
  ``link_gbps`` (the best 256 MiB bandwidth any transport reached on the fabric, from this
  machine's ``bench transport`` result or ``--link-gbps``), ``bound_ms`` = max(C, T),
  ``efficiency`` = bound / median.

Plan and reuse calls: every strategy row (each ``call: "plan"``) has a ``STRATEGY (reuse)`` row
(``call: "reuse"``, not for the ablation rows; ``--no-reuse`` skips them) timing calls that
reuse the plan one call on the first input set solved, as a schedule's reuse steps do
(``SparspConfig.replan_every``: no summaries, no metadata collective, no host read), split
phase by phase like the others; it carries its plan row's ``plan_median_ms`` and
``plan_mask_ms`` and ``reuse_ratio`` = median / (plan median − plan mask phase)
(``attention_rows.with_reuse_figures``). On a group of one (``--nproc-per-node 1``) the
strategy rows are the one-GPU plan and reuse calls. ``--thresholds FILE`` gives every call
(layer 0, or the profile layer it runs) a per-head thresholds table, checked against the
preset's layers and heads before anything starts.

One-GPU rows over the whole sequence (rank 0, timed in the same rounds as the strategies):
``1gpu-dense`` (the fastest dense kernel: what a user without sparsp runs) and ``1gpu-sparse``
(the strategies' kernel and mask on one GPU).
``--ablation`` adds rows that switch on one thing at a time from ``ring-sparse`` on contiguous
placement over NCCL: periodic placement, direct routing (``ring-relay`` → ``sparsp``), the
copy-engine transport (``ipc`` / ``host``), then, each added to that row, the chunked drain
(the last peer's payload in 4 head groups) and the CUDA-graph plan stage
(``strategies/captured.py``), and to the latter the local kernel queued first
(``SparspConfig.local_first``); all three are off in the other ablation rows, and each row
names what it switches on in ``ablation``. ``cuda_graphs`` says whether a row replayed the
stage, ``local_first`` whether its timed split call queued the local kernel first
(``local_first_config``: the setting; automatic by default), and ``drain_chunks`` in how
many messages its last round's payload came (``sparsp``; else None).
``--config KEY=VALUE`` (repeatable) sets a ``SparspConfig`` field for every row, e.g.
``--config drain_chunks=1 --config local_first=on`` (docs/configuration.md); the row's
``config`` holds what was set. The ablation rows' own settings win over it.

``--density-profile FILE --layer L [L ...]`` measures chosen layers of a real model instead:
each layer's q/k come from synthetic heads calibrated to that layer's per-head densities in the
profile (``sparsp.workloads.calibration``; at ``--step``, or the mean over steps), and every row carries
its ``layer``, how it was asked for (``layer_pick``: ``densest``, ``median``, ``sparsest`` by
the layers' mean density, or None for an index) and the layer's mean density in the profile
(``profile_density``). Without ``--calibration FILE`` the asked layers alone are fitted first
(on the CPU of every rank, rank 0 printing its progress) and the fit is written next to the
results, for a later run's ``--calibration``. Such a run's files go to ``OUT/density-profile/``
(``attention-<model>-<profile>-step<S|mean>-<machine>-<date>.json``, ``"workload":
"density-profile"`` in the file and its rows), apart from the preset's results.

``--mesh ulysses=U[,sp=R]`` runs the strategy rows on a device mesh (``sparsp.make_mesh``; sp
takes the rest of the ranks): the inputs placed over the R sp ranks, rank (sp=r, ulysses=u)
holding piece u of slice r, every call ``sp_attention(mesh=)``; such a row is named
``STRATEGY [ulysses U x sp R]`` (its ``mesh`` field the same), and its bytes are those of the
sp group and the Ulysses all-to-alls together. On one GPU ``--mesh ulysses=1`` runs the mesh
path on a mesh of one, timed in the same rounds as the flat ``1gpu-sparse`` call:

    torchrun --nproc-per-node 1 -m sparsp.cli bench attention --model wan2.1-14b --strategy sparsp --mesh ulysses=1

Results: ``bench/results/attention-<model>-<machine>-<date>.json`` (+ PNG: stacked time split
per strategy, the bound marked); a second run with the other ``--fabric`` extends the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..timing import call_ms
from .args import (ATTENTION_RESERVED, PROFILE_DIR, check_attention, check_names, check_out, check_thresholds,
                   default_out, mesh_label, mesh_sizes, refuse)
from .attention_rows import SPLIT, AttentionRow, plot, table, with_reuse_figures
from .common import (barrier, config_overrides, init_distributed, over_ranks, profile_name, shutdown, stage,
                     time_interleaved, time_ms, wide_console, world_size, write_result)
from .measure import count_syncs_and_collectives, dense_call, dense_tflops, kept_flops, link_gbps
from .profile_layers import LayerWorkload, read_layers, workloads_of

COPY_ENGINE = {"nvlink": "ipc", "host": "host"}  # sparsp's own transport on each fabric
RESERVED = ATTENTION_RESERVED


@dataclass(frozen=True)
class _Setup:
    """What the checks settled before any work: the geometry, the ``--config`` overrides, the
    bound's link rate, and the ``--density-profile`` layers read (None: the preset's heads)."""

    geom: object  # geometry.VideoGeometry
    overrides: dict
    gbps: float
    layers: object | None  # profile_layers.ProfileLayers
    mesh: tuple[int, int, int] | None = None  # --mesh: (cfg 1, ulysses, sp)


@dataclass
class _Run:
    """What every row of a run shares: its arguments and setup, this rank, the dtype, the group
    of rank 0 alone (the one-GPU rows; None with one rank) and rank 0's console. ``dense``:
    the fastest dense kernel's (TFLOP/s, name), measured on the run's first inputs."""

    args: object
    setup: _Setup
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    one_gpu: object
    console: object
    dense: tuple[float, str] | None = None
    mesh: object = None  # --mesh: the strategy rows' DeviceMesh

    @property
    def place(self) -> dict:
        """Where a strategy row's calls run: ``sp_attention``'s ``mesh=`` (None: the world)."""
        return {} if self.mesh is None else {"mesh": self.mesh}

    @property
    def ulysses(self) -> int:
        return 1 if self.setup.mesh is None else self.setup.mesh[1]

    def layer(self, workload: LayerWorkload | None) -> int:
        """The ``layer`` of a row's calls: the profile layer it runs, else 0 (``--thresholds``:
        the table's first layer)."""
        return 0 if workload is None else workload.layer

    def row(self, cdf: float, workload: LayerWorkload | None, **fields) -> AttentionRow:
        """A row of this run at ``cdf``: its fields shared by every row, and ``fields``."""
        g, args = self.setup.geom, self.args
        return AttentionRow(model=g.name, tokens=g.num_tokens, heads=g.heads, head_dim=g.head_dim, fabric=args.fabric,
                            cdf=cdf, timing="sequential" if args.sequential else "interleaved",
                            link_gbps=self.setup.gbps, dense_tflops=self.dense[0], dense_kernel=self.dense[1],
                            thresholds=None if args.thresholds is None else str(args.thresholds),
                            workload=workload, **fields)


def main(args) -> int:
    setup = check(args)
    workloads, extra = [None], None  # None: the preset's synthetic heads, one set of rows
    if setup.layers is not None:
        # fitted before the process group starts: no rank waits for a peer while its heads are fitted
        workloads, extra = workloads_of(args, setup.geom, setup.layers, verbose=os.environ.get("RANK", "0") == "0")
        args.seed = workloads[0].seed  # the seed the heads were fitted with
    run = _start(args, setup)
    try:
        rows = []
        for workload in workloads:
            inputs = {}  # each placement's inputs of this layer: kept while its rows are timed together
            for cdf in args.cdf:
                rows += _time_rows(run, _rows_of(run, workload, cdf, inputs))
        with stage("writing the results"):
            if run.rank == 0:
                _report(run, rows, extra)
    finally:
        shutdown()
    return 0


def check(args) -> _Setup:
    """Refuse (one line, exit status 2) what cannot run, before any work: the options, the
    names, ``--out``, the profile's files and layers, a machine without CUDA, a fabric without
    a link rate for the bound."""
    from ..geometry import preset

    if args.iters < 10:
        refuse("attention", "--iters must be >= 10 (medians of at least ten timed iterations)")
    if args.out is None:
        args.out = default_out(torch.cuda.is_available())
    check_out("attention", "--out", args.out)
    check_attention(args)
    check_strategies(args)
    overrides = config_overrides(args.config, reserved=RESERVED)
    geom = preset(args.model)
    if not args.text:
        geom = replace(geom, text_tokens=0)
    if args.thresholds is not None:
        check_thresholds("attention", args.thresholds, layers=geom.layers, heads=geom.heads,
                         what=f"{geom.name} ({geom.layers} self-attention layers)")
    layers = None if args.density_profile is None else read_layers(args, geom)
    if layers is None and args.seed is None:
        args.seed = 0
    mesh = _check_mesh(args, geom)
    if not torch.cuda.is_available():
        refuse("attention", "needs CUDA GPUs (run it under torchrun on a GPU machine); this machine has none")
    gbps = args.link_gbps or link_gbps(args.fabric, args.out)
    if gbps is None:
        refuse("attention", f"no 256 MiB transport row for fabric {args.fabric} in {args.out}; run `sparsp bench "
                            "transport` first or pass --link-gbps")
    return _Setup(geom, overrides, gbps, layers, mesh)


def _check_mesh(args, geom) -> tuple[int, int, int] | None:
    """``--mesh``'s (cfg, ulysses, sp) on torchrun's world, checked before anything starts: one
    attention call has no guidance branches (cfg is a pipeline's), and ulysses must divide the
    heads."""
    if args.mesh is None:
        return None
    if args.mesh.get("cfg", 1) != 1:
        refuse("attention", "--mesh cfg: one attention call has no guidance branches to spread; cfg is a "
                            "pipeline's (bench e2e --mesh cfg=2,...); give ulysses and sp")
    sizes = mesh_sizes("attention", args.mesh, world_size())
    if geom.heads % sizes[1]:
        refuse("attention", f"--mesh ulysses={sizes[1]} does not divide the {geom.heads} heads of {geom.name}")
    return sizes


def _start(args, setup: _Setup) -> _Run:
    """Join the process group (``--fabric host``: NCCL without peer copies, set before NCCL
    starts) and make what every row shares."""
    if args.fabric == "host" and os.environ.get("NCCL_P2P_DISABLE") != "1":
        os.environ["NCCL_P2P_DISABLE"] = "1"  # before NCCL creates its communicators
    rank, world, device = init_distributed()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    one_gpu = dist.new_group([0]) if world > 1 else None
    console = wide_console(160) if rank == 0 else None  # the table has 15 columns
    mesh = None
    if setup.mesh is not None:  # every rank makes it, after the checks
        from ..mesh import make_mesh

        mesh = make_mesh(ulysses=setup.mesh[1], sp=setup.mesh[2])
    return _Run(args, setup, rank, world, device, dtype, one_gpu, console, mesh=mesh)


def _rows_of(run: _Run, workload: LayerWorkload | None, cdf: float, inputs: dict) -> list[tuple]:
    """(row without its times, its call) of every strategy row at ``cdf``, of each one's reuse
    row (a strategy row, not an ablation step, unless ``--no-reuse``) and of the one-GPU rows
    (on ranks but 0: (None, a call that does nothing)), to be timed together."""
    configs = _configs(run.args, run.world // run.ulysses, run.setup.geom.heads // run.ulysses)
    timed = [_strategy_row(run, workload, cdf, config, inputs) for config in configs]
    if not run.args.no_reuse:
        timed += [_strategy_row(run, workload, cdf, config, inputs, reuse=True)
                  for config in configs if config[3] is None]
    if not run.args.no_1gpu:  # timed with the rows above: the comparison the targets make
        with stage("the one-GPU rows"):  # rank 0's work, agreed on by every rank
            timed += _one_gpu_rows(run, cdf, workload)
    return timed


def _time_rows(run: _Run, timed: list[tuple]) -> list[AttentionRow]:
    """Time the calls together (interleaved, or one after another with ``--sequential``); the
    rows this rank reports, with their times, each printed on rank 0."""
    args, calls = run.args, [call for _, call in timed]
    if args.sequential:
        all_times = [time_ms(c, warmup=args.warmup, iters=args.iters, device=run.device) for c in calls]
    else:
        all_times = time_interleaved(calls, warmup=args.warmup, iters=args.iters, device=run.device)
    rows = with_reuse_figures([row.timed(times) for (row, _), times in zip(timed, all_times) if row is not None])
    for row in rows if run.console else ():
        run.console.print(row.line())
    return rows


def _report(run: _Run, rows: list[AttentionRow], extra: dict | None) -> None:
    """Rank 0: the result file, its table and its plot."""
    args, geom = run.args, run.setup.geom
    path = write_rows([r.as_json() for r in rows], geom.name, args, extra)
    mesh = "" if run.mesh is None else f", strategy rows on mesh {mesh_label(run.setup.mesh)}"
    run.console.print(table(rows, f"{geom.name}, {run.world} ranks, fabric {args.fabric}{mesh}"
                            + ("" if extra is None else f", {extra['source']} step {args.step or 'mean'}")))
    run.console.print(f"wrote {path}")
    plot(path)


def cycling(sets: list, fn):
    """A call of ``fn(*sets[i])`` that takes the next input set each time it is called."""
    state = {"i": 0}

    def call():
        i = state["i"]
        state["i"] = (i + 1) % len(sets)
        return fn(*sets[i])
    return call


def write_rows(rows: list[dict], model: str, args, extra: dict | None) -> Path:
    """Write (or extend) the run's result file: the preset's in ``--out``, or, for a
    ``--density-profile`` run (``extra``: its file fields), one named after the profile and
    step in ``OUT/density-profile/``, where nothing that looks up a preset's results goes."""
    if extra is None:
        return write_result("attention", model, rows, args.out)
    return write_result("attention", profile_name(model, args.density_profile, args.step), rows,
                        Path(args.out) / PROFILE_DIR, extra=extra)


def make_inputs(geom, placement, rank: int, device, dtype, seed: int, workload: LayerWorkload | None = None,
                ulysses: int = 1):
    """This rank's placed slice of synthetic q, k (model RoPE structure) and random v;
    ``workload``: one profile layer's calibrated heads instead of the drawn ones (the q/k of its
    layer index, seed and mix). ``ulysses`` U > 1: rank (sp=r, ulysses=u) of a mesh holds piece
    u of slice r (``placement.ulysses_pieces``)."""
    from ..placement import ulysses_pieces
    from ..workloads.synthetic import token_qk

    r, u = divmod(rank, ulysses)
    tokens = placement.perm[placement.token_slice(r)]
    if ulysses > 1:
        pieces = ulysses_pieces(len(tokens), geom.block_size, ulysses)
        tokens = tokens[sum(pieces[:u]):sum(pieces[:u + 1])]
    if workload is None:
        q, k = token_qk(geom, seed=seed, tokens=tokens, device=device, dtype=torch.float32)
    else:
        q, k = token_qk(geom, seed=workload.seed, tokens=tokens, device=device, dtype=torch.float32,
                        layer=workload.layer, heads=workload.heads, mix=workload.mix)
    g = torch.Generator(device=device).manual_seed(seed + 17 + rank)
    v = torch.randn(q.shape, generator=g, device=device, dtype=torch.float32)
    return tuple(x.to(dtype).contiguous() for x in (q, k, v))


def _inputs(run: _Run, kind: str, workload: LayerWorkload | None, inputs: dict):
    """The placement ``kind`` and this rank's ``--input-sets`` input sets on it (made once per
    layer); the first inputs of the run also measure the fastest dense kernel (``run.dense``)."""
    from ..placement import make_placement

    args, geom, world = run.args, run.setup.geom, run.world
    if kind not in inputs:  # on a mesh: placed over its sp ranks, each slice cut into Ulysses pieces
        pl = make_placement(kind, geom, world // run.ulysses)
        inputs[kind] = (pl, [make_inputs(geom, pl, run.rank, run.device, run.dtype, args.seed + i, workload,
                                         run.ulysses) for i in range(args.input_sets)])
    if run.dense is None:  # local queries against every key, as a strategy's kernel meets them
        q, k, v = inputs[kind][1][0]
        run.dense = dense_tflops(q, k if world == 1 else torch.cat([k] * world, 1),
                                 v if world == 1 else torch.cat([v] * world, 1), args.kernel)
    return inputs[kind]


def _configs(args, world: int, heads: int) -> list[tuple[str, str, str, str | None]]:
    """(strategy, placement, transport, ablation) of every row: ``world`` sp ranks, each call on
    ``heads`` heads (a mesh's: per Ulysses rank)."""
    from ..strategies import strategy_names, strategy_spec
    from ..strategies.auto import AUTO, PLANNED

    ce = COPY_ENGINE[args.fabric]
    rows = []
    for s in args.strategy:
        if s == AUTO:  # on its planned strategy's placement, over NCCL and the fabric's copy engine
            rows += [(AUTO, strategy_spec(PLANNED).placement, t, None)
                     for t in ("nccl",) + (() if args.no_copy_engine else (ce,))]
            continue
        spec = strategy_spec(s)
        if spec.heads_divisible and heads % world:
            continue
        # a strategy registered ``copy_engine`` also runs over the fabric's copy-engine transport
        transports = ("nccl",) + ((ce,) if spec.copy_engine and not args.no_copy_engine else ())
        rows += [(s, spec.placement, t, None) for t in transports]
    if args.ablation:  # each strategy's registered ``ablation`` rows, in registration order
        rows += [(s, placement, ce if t == "copy-engine" else t, what)
                 for s in strategy_names() for placement, t, what in strategy_spec(s).ablation]
    return rows


def check_strategies(args) -> None:
    """Fill the default ``--strategy`` (every registered one, then auto) and refuse an unknown
    strategy or kernel name in one line, listing the registered ones."""
    from ..kernels import kernel_names
    from ..strategies import strategy_names
    from ..strategies.auto import AUTO

    known = (*strategy_names(), AUTO)
    if args.strategy is None:
        args.strategy = list(known)
    check_names("attention", "--strategy", args.strategy, known)
    check_names("attention", "--kernel", [args.kernel], kernel_names(with_auto=True))


def ablation_config(ablation: str | None) -> dict:
    """``SparspConfig`` fields of an ablation row: chunking and the CUDA-graph plan stage stay
    off until their own steps (each added to the copy-engine row: the drain payload in 4 head
    groups; the plan stage replayed as a graph); rows that are no ablation use the defaults."""
    if ablation is None:
        return {}
    return {"chunks": 1, "drain_chunks": 4 if "chunked drain" in ablation else 1,
            "cuda_graphs": "CUDA graphs" in ablation, "local_first": "local first" in ablation}



def _strategy_row(run: _Run, workload: LayerWorkload | None, cdf: float, config: tuple, inputs: dict,
                  reuse: bool = False) -> tuple:
    """One strategy row before its timing: the calls that settle it (every input set's first
    call: eager plan stage, capture; on one GPU, the call its kernels' rates are measured on), then on the first set its bytes, time split, the
    profiler's counts and the bound; (row, the timed call, which takes the next set each time).
    ``reuse``: the row of calls that reuse the plan one call on the first set solved
    (``SparspConfig.replan_every``: a schedule's reuse step), named ``STRATEGY (reuse)``."""
    from .. import SparspConfig, sp_attention
    from ..strategies.auto import AUTO
    from ..strategies.one_gpu import MEASURE_AT

    args, device = run.args, run.device
    strategy, kind, transport, ablation = config
    # a mesh row is named apart (readers of registered strategies' rows pass over it, as over a reuse row)
    label = None if run.mesh is None else mesh_label(run.setup.mesh).removeprefix("cfg 1 x ")
    name = strategy + ("" if label is None else f" [{label}]") + (" (reuse)" if reuse else "")
    with stage(f"setting up {name} over {transport}"):
        _, sets = _inputs(run, kind, workload, inputs)
        cfg = SparspConfig(cdf_threshold=cdf, block_size=run.setup.geom.block_size, transport=transport,
                           kernel=args.kernel, timeout_s=300.0, thresholds=args.thresholds,
                           replan_every=2 if reuse else 1, **(run.setup.overrides | ablation_config(ablation)))
        t = _Transports(run, transport, cfg)
        # a reuse row's calls are step 1 of its own branch: step 0 solved the plan they reuse
        where = {"layer": run.layer(workload)} | ({"step": 1, "branch": f"bench {name} {transport}"} if reuse else {})
        where |= run.place  # on --mesh: the mesh call
        attend = lambda q, k, v: sp_attention(q, k, v, strategy=strategy, config=cfg, **where)  # noqa: E731
        if reuse:
            sp_attention(*sets[0], strategy=strategy, config=cfg, **(where | {"step": 0}))
        for other in sets[1:]:
            attend(*other)
        for _ in range(MEASURE_AT):  # one GPU: its kernels' rates are measured on a geometry's MEASURE_AT-th call
            attend(*sets[0])
        t.fence()
        t.reset_counters()
        attend(*sets[0])  # the bytes and the split: the first set's
        t.fence()
    moved, most = (int(over_ranks([t.total_received], device, op)[0]) for op in ("sum", "max"))
    split, density, flops, chosen = _split(*sets[0], strategy, cfg, t, device, where)
    with stage(f"profiling {name} over {transport}"):
        call = cycling(sets, attend)
        syncs, colls = count_syncs_and_collectives(call, _trace_stem(run, cdf, workload, config, t.name, reuse))
    c_ms = over_ranks([flops], device)[0] / (run.dense[0] * 1e9)
    t_ms = most / (run.setup.gbps * 1e6)
    row = run.row(cdf, workload, ranks=run.world, strategy=name, call="reuse" if reuse else "plan",
                  transport=t.name, placement=kind,
                  kernel=args.kernel, bytes_moved=moved, bytes_max_rank=most,
                  density=density, **{key: split.get(key, 0.0) for key in SPLIT},
                  pack_side_ms=split["pack_side_ms"], transfer_ms=split.get("transfer_ms", 0.0), host_syncs=syncs,
                  collectives=colls, compute_bound_ms=c_ms, transfer_bound_ms=t_ms, bound_ms=max(c_ms, t_ms),
                  ablation=ablation, cuda_graphs=cfg.cuda_graphs, local_first_config=cfg.local_first,
                  local_first=split["local_first"], drain_chunks=split["drain_chunks"],
                  auto_choice=chosen if strategy == AUTO else None, config=run.setup.overrides or None,
                  head_order="density",  # a head-sharded strategy's heads: by density (ulysses)
                  input_sets=args.input_sets, mesh=label)
    return row, call


class _Transports:
    """The transports a strategy row's calls move bytes over, as one: the world's, or on
    ``--mesh`` its sp group's and (ulysses > 1) its Ulysses groups' (``bytes_moved`` counts
    both: the all-to-alls' bytes with the strategy's)."""

    def __init__(self, run: _Run, name: str, cfg) -> None:
        from ..mesh import mesh_groups
        from ..strategies import get_transport

        groups = [None]
        if run.mesh is not None:
            mg = mesh_groups(run.mesh)
            groups = [mg.sp] + ([mg.ulysses] if run.ulysses > 1 else [])
        self.all = [get_transport(name, g, run.device, cfg.timeout_s, local=cfg.local_transport) for g in groups]

    @property
    def name(self) -> str:
        return self.all[0].name

    @property
    def total_received(self) -> int:
        return sum(t.total_received for t in self.all)

    def fence(self) -> None:
        for t in self.all:
            t.fence()

    def reset_counters(self) -> None:
        for t in self.all:
            t.reset_counters()


def _trace_stem(run: _Run, cdf: float, workload, config: tuple, transport: str, reuse: bool = False) -> Path | None:
    """Where ``--torch-profile DIR`` puts a row's tables and trace on this rank (None: nowhere)."""
    if run.args.torch_profile is None:
        return None
    strategy, kind, _, ablation = config
    return run.args.torch_profile / (
        f"{run.setup.geom.name}-{run.args.fabric}-{strategy}{'-reuse' if reuse else ''}-{transport}-{kind}-cdf{cdf}"
        + ("" if workload is None else f"-layer{workload.layer}")
        + (f"-{ablation.replace(' ', '').replace(',', '_')}" if ablation else "")
        + "".join(f"-{key}{value}" for key, value in run.setup.overrides.items()) + f"-r{run.rank}")


def _split(q, k, v, strategy, cfg, transport, device, where: dict):
    """One timed call (``where``: its layer, and a reuse row's step and branch): the slowest
    rank's phase times, the mask density, this rank's FLOPs."""
    from .. import sp_attention
    from ..plan import gather_metadata
    from ..strategies import auto, strategy_spec
    from ..timing import PhaseTimer

    timer = PhaseTimer()
    barrier()
    with stage(f"{strategy}'s timed split"):
        total = call_ms(lambda: sp_attention(q, k, v, strategy=strategy, config=cfg, _timer=timer, **where), device)
        s = timer.summary()
        split = {f"{key}_ms": s.get(key, 0.0) for key in ("mask", "pack", "compute", "merge", "transfer")}
        # a pack on the side stream (Call.side) overlaps the local kernel: not on the compute
        # stream's path, so not subtracted; the compute stream's wait for it is exposed time
        split["exposed_comm_ms"] = max(0.0, total - sum(split[f"{key}_ms"] for key in
                                                        ("mask", "pack", "compute", "merge")))
        split["pack_side_ms"] = s.get("pack_side", 0.0)
        split["pack_ms"] += split["pack_side_ms"]
        transport.fence()
        if strategy == auto.AUTO:
            strategy = auto.last_decision().strategy
    split = dict(zip(split, over_ranks(split.values(), device)))
    split["local_first"] = timer.local_first  # what this call did (the config may leave it open)
    split["drain_chunks"] = timer.drain_chunks  # sparsp: messages of the last round's payload
    sparse = strategy_spec(strategy).sparse
    meta = gather_metadata(q, k, v, None, cfg, strategy, sparse=sparse)
    with stage(f"{strategy}'s mask"):
        sh = meta.shapes
        mask = meta.block_mask(cfg.at_layer(where["layer"]))[:, :, sh.blocks_of(sh.rank)] if sparse else None
        kept, pairs = (1.0, 1.0) if mask is None else (float(mask.sum()), float(mask.numel()))
        flops = kept_flops(mask, sh)
    kept, pairs = over_ranks([kept, pairs], device, "sum")
    return split, kept / pairs, flops, strategy


def _one_gpu_rows(run: _Run, cdf: float, workload: LayerWorkload | None = None) -> list[tuple]:
    """``1gpu-dense`` and ``1gpu-sparse`` over the whole sequence, on rank 0: (row without its
    times, call) for each, timed with the strategies' rows. Every rank gets the same number of
    entries (the timing is collective); on the other ranks the row is None and the call does
    nothing."""
    from .. import SparspConfig, sp_attention
    from ..placement import make_placement
    from ..plan import gather_metadata
    from ..strategies.registry import strategies_where

    if run.rank != 0:
        return [(None, lambda: None), (None, lambda: None)]
    args, geom = run.args, run.setup.geom
    q, k, v = make_inputs(geom, make_placement("contiguous", geom, 1), 0, run.device, run.dtype, args.seed, workload)
    flops = 4.0 * q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] * q.shape[3]
    rate, name = dense_tflops(q, k, v, args.kernel)
    run.dense = run.dense or (rate, name)  # no strategy row ran (none applies to the geometry)
    cfg = SparspConfig(cdf_threshold=cdf, block_size=geom.block_size, transport="nccl", kernel=args.kernel,
                       timeout_s=300.0, thresholds=args.thresholds)
    # the primary strategy on a group of one: the whole sequence, the strategies' kernel and
    # mask, no packing
    primary, layer = strategies_where(primary=True)[0], run.layer(workload)
    sparse = lambda: sp_attention(q, k, v, group=run.one_gpu, strategy=primary, config=cfg, layer=layer)  # noqa: E731
    sparse()
    meta = gather_metadata(q, k, v, run.one_gpu, cfg, primary, sparse=True)
    whole = meta.block_mask(cfg.at_layer(layer))
    rows = []
    for strategy, kernel, c_ms, density in (("1gpu-dense", name, flops / (run.dense[0] * 1e9), 1.0),
                                            ("1gpu-sparse", args.kernel,
                                             kept_flops(whole, meta.shapes) / (run.dense[0] * 1e9),
                                             float(whole.float().mean()))):
        rows.append(run.row(cdf, workload, ranks=1, strategy=strategy, transport="none", placement="none",
                            kernel=kernel, density=density, compute_bound_ms=c_ms, bound_ms=c_ms))
    return [(rows[0], dense_call(q, k, v, name)), (rows[1], sparse)]
