"""What a machine profile is: links, contention, kernel rates, fixed costs (``Profile``).

What the cost model prices a call with: ``strategy="auto"``, the chunk rules and
``sparsp simulate`` read the same profiles; the built-in ones and their sources are in
``cost.profiles``.

A profile describes one box, or several hosts of such boxes: how many GPUs, whether they copy
peer to peer (``peer_access``) or stage every payload through pinned host memory, which paths
those copies share, the network between hosts, how fast the attention kernel runs per head
dim, and what one attention call costs before any payload moves.

Bandwidths are GB/s (10⁹ bytes/s) per direction; times are milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

BENCH_FABRICS = ("nvlink", "host")  # the fabric names `sparsp bench` writes into its rows


def _positive(owner: str, name: str, value, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        want = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ValueError(f"{owner}.{name} must be {want}{' or None' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportFigure:
    """How one transport (``SparspConfig.transport``) uses the fabric."""

    name: str
    """Transport name as ``sparsp bench`` writes it: ``ipc``, ``host`` or ``nccl``."""
    efficiency: float = 1.0
    """Share of the fabric's modelled bandwidth this transport reaches (1.0 = the copy-engine
    path the profile's capacities describe; NCCL's copy kernels reach less)."""
    latency_ms: float = 0.1
    """Fixed cost of one message (publish, fetch handshake, copy launch), before bytes flow."""
    loaded_efficiency: float | None = None
    """The same share while the GPU at either end runs the attention kernel (``bench
    transport``'s ``under_load`` rows, fitted by ``--fit-profile``); None = ``efficiency``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TransportFigure.name must be a non-empty str, got {self.name!r}")
        for attr in ("efficiency", "loaded_efficiency"):
            value = getattr(self, attr)
            _positive("TransportFigure", attr, value, allow_none=attr == "loaded_efficiency")
            if value is not None and value > 1.0:
                raise ValueError(f"TransportFigure.{attr} must lie in (0, 1], got {value!r}")
        _positive("TransportFigure", "latency_ms", self.latency_ms, allow_zero=True)

    @property
    def under_load(self) -> float:
        """The efficiency while a kernel runs at either end."""
        return self.efficiency if self.loaded_efficiency is None else self.loaded_efficiency


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelFigure:
    """Attention kernel throughput at one head dim, in TFLOP/s (4·q·k·D FLOPs per kept pair)."""

    head_dim: int
    sparse_tflops: float
    """The block-sparse kernel the strategies run, counted on kept blocks only."""
    dense_tflops: float
    """The best dense kernel on one GPU (the single-GPU reference)."""
    fa4_tflops: float | None = None
    """FlashAttention-4's block-sparse rate where the box runs it (``kernel=auto`` picks it
    there; ``sparse_tflops`` stays the portable kernel's): the run-time rules of
    ``cost/chunks.py`` use it for a call that runs FA4. None: FA4 does not run here."""

    def __post_init__(self) -> None:
        if not isinstance(self.head_dim, int) or isinstance(self.head_dim, bool) or self.head_dim < 1:
            raise ValueError(f"KernelFigure.head_dim must be a positive int, got {self.head_dim!r}")
        _positive("KernelFigure", "sparse_tflops", self.sparse_tflops)
        _positive("KernelFigure", "dense_tflops", self.dense_tflops)
        _positive("KernelFigure", "fa4_tflops", self.fa4_tflops, allow_none=True)

    def rate(self, kernel: str | None = None) -> float:
        """Block-sparse TFLOP/s of ``kernel`` (``fa4`` where measured; else ``sparse_tflops``)."""
        return self.fa4_tflops if kernel == "fa4" and self.fa4_tflops is not None else self.sparse_tflops


KERNEL_LAYOUTS = ("local", "packed", "dense")
"""``bench kernel`` K/V layouts: ``local`` (a rank's own shard as given, ``LocalKV``), ``packed``
(a received payload, ``KVBuffer``), ``dense`` (the dense kernel on contiguous K/V: every block)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelPoint:
    """One ``bench kernel`` row of the strategies' block-sparse kernel at one shape: one rank's
    queries against the whole sequence's keys, on the benchmark's own masks at one density
    (``layout="dense"``: the same kernel family's dense row, density 1)."""

    shape: str
    """The row's shape name (a preset, or ``SQxSKxHxD``): for reports only."""
    heads: int
    head_dim: int
    tokens: int
    """Key tokens: the whole sequence (``k_rows``)."""
    layout: str
    density: float
    """Kept share of the (query, key) pairs of the rank's queries over the whole sequence."""
    tflops: float
    """Kept-block TFLOP/s (4·q·k·D per kept pair)."""

    def __post_init__(self) -> None:
        for attr in ("heads", "head_dim", "tokens"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KernelPoint.{attr} must be a positive int, got {value!r}")
        if self.layout not in KERNEL_LAYOUTS:
            raise ValueError(f"KernelPoint.layout must be one of {', '.join(KERNEL_LAYOUTS)}, got {self.layout!r}")
        _positive("KernelPoint", "density", self.density)
        if self.density > 1.0:
            raise ValueError(f"KernelPoint.density must lie in (0, 1], got {self.density!r}")
        _positive("KernelPoint", "tflops", self.tflops)


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through (x, y) points (the mean of those at one x), held constant
    beyond the first and the last."""
    assert points, "_interpolate needs at least one point"
    by_x: dict[float, list[float]] = {}
    for px, py in points:
        by_x.setdefault(px, []).append(py)
    xs = sorted(by_x)
    ys = [sum(by_x[px]) / len(by_x[px]) for px in xs]
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """One box: topology, link and contention capacities, kernel rates and fixed costs."""

    name: str
    description: str = ""
    gpus: int
    """GPUs in the box; a simulation of more ranks is refused."""
    peer_access: bool
    """True: payloads go GPU→GPU directly (NVLink or PCIe P2P). False: each payload is staged
    through pinned host memory (D2H on the sender's link, H2D on the receiver's)."""
    link_gbps: float
    """One GPU's link, per direction, one copy alone (NVLink pair bandwidth or PCIe x16 achieved)."""
    duplex_gbps: float | None = None
    """Cap on a GPU's sending plus receiving at once (PCIe reads and writes share credits and the
    root port); None = full duplex."""
    host_gbps: float | None = None
    """DMA traffic one socket's host memory and root complex sustain, both directions together;
    a host-staged payload costs it twice (written by D2H, read by H2D). None = no limit."""
    sockets: int = 1
    """CPU sockets of a host; its GPUs are split evenly, GPU g on socket g // (GPUs of a host /
    sockets), numbered across hosts."""
    inter_socket_gbps: float | None = None
    """The sockets' interconnect (UPI / xGMI), per direction, shared by every payload whose
    path crosses it. None = not a bottleneck."""
    gpus_per_switch: int = 1
    """GPUs behind one PCIe switch (1 = each GPU on its own root port)."""
    switch_uplink_gbps: float | None = None
    """A switch's uplink to the socket, per direction, shared by its GPUs' traffic that leaves it."""
    hbm_gbps: float = 1000.0
    """Device memory copy bandwidth (pack of payloads, mask pooling), read and write counted once."""
    transports: tuple[TransportFigure, ...]
    """The transports this box runs; the first is the default (``--transport`` picks another)."""
    kernels: tuple[KernelFigure, ...]
    """Kernel rates per head dim; a head dim not listed takes the nearest one listed."""
    kernel_points: tuple[KernelPoint, ...] = ()
    """Measured rates per shape, layout and density (``--fit-profile`` from ``bench kernel``);
    ``kernel_rate`` prefers them to ``kernels`` for a shape they cover."""
    launch_ms: float = 0.1
    """Host time of one kernel call's launch (FA4's Python and the driver; an estimate), after
    the call's host sync: no kernel starts before the host launched it (``timeline``; the ops
    around it are counted, ``ops.RUN_OPS``). ``cost/chunks.py`` charges it per chunk."""
    call_ms: float = 1.0
    """Per attention call, every strategy: host time outside the counted ops — input
    validation, the plan's Python bookkeeping, the transport's fence. An estimate (1 ms), not
    measured by ``bench kernel`` or ``bench transport``; the layouts it once covered are counted
    ops of the mask phase now (``ops.MASK_OPS``)."""
    call_after_ms: float = 0.1
    """The part of ``call_ms`` a call spends after its host read was started: the transport's
    fence and the read's finish (``sp_attention``). In order it precedes the run as the rest
    does; a local-first call launches its local kernel before it, so there it runs beside that
    kernel (``timeline``). ≈ 0.1 ms: one fence 46 µs and the read's landing to the first pack
    83–105 µs, measured on one H200 with two ranks sharing it — not fitted. A
    profile whose ``call_ms`` is smaller has all of it after (``call_after``)."""
    sync_ms: float = 0.5
    """Latency of the call's one collective, the metadata all-gather (``model.SYNCS_PER_CALL``),
    on the device path (the host does not wait for it on NCCL); ``--fit-profile`` sets it to
    NCCL's fitted latency when the transport results have NCCL rows."""
    op_ms: float = 0.01
    """Host time to issue one eager PyTorch op (dispatch and launch), charged for the ops of the
    mask phase, which the GPU waits for (``ops.MASK_OPS``, ``ops.MASK_UNIT_OPS``), and for
    those after the host sync, which no kernel may outrun (``ops.RUN_OPS``): 10 µs, the
    commonly quoted eager overhead per op — stated, not measured by ``bench kernel`` or
    ``bench transport``."""
    gpus_per_host: int | None = None
    """GPUs in one host; GPU g sits in host g // ``gpus_per_host``, and a mesh's Ulysses groups
    (consecutive GPUs) stay inside one. None: every GPU in one host. The sockets, switches and
    their links above are those of each host."""
    network_gbps: float | None = None
    """Between hosts: one NIC's rate per direction, shared by the GPUs behind it
    (``gpus_per_nic``); every payload between hosts crosses the sender's NIC and the
    receiver's. Needed where the profile has several hosts."""
    gpus_per_nic: int = 1
    """GPUs sharing one NIC (1: a NIC per GPU, the rail-optimised HGX layout)."""
    network: TransportFigure | None = None
    """The transport of pairs on different hosts (``nccl`` over the network: the per-pair
    transports pick it there); None: the default transport (``network_figure``)."""
    sources: tuple[str, ...] = ()
    """Where the figures come from (short references; details in docs/simulate.md)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Profile.name must be a non-empty str, got {self.name!r}")
        for attr in ("gpus", "sockets", "gpus_per_switch", "gpus_per_nic"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Profile.{attr} must be a positive int, got {value!r}")
        if not isinstance(self.peer_access, bool):
            raise ValueError(f"Profile.peer_access must be True or False, got {self.peer_access!r}")
        self._check_hosts()
        _positive("Profile", "link_gbps", self.link_gbps)
        _positive("Profile", "hbm_gbps", self.hbm_gbps)
        for attr in ("duplex_gbps", "host_gbps", "inter_socket_gbps", "switch_uplink_gbps"):
            _positive("Profile", attr, getattr(self, attr), allow_none=True)
        for attr in ("launch_ms", "call_ms", "call_after_ms", "sync_ms", "op_ms"):
            _positive("Profile", attr, getattr(self, attr), allow_zero=True)
        if not self.transports or not all(isinstance(t, TransportFigure) for t in self.transports):
            raise ValueError(f"Profile.transports must be a non-empty tuple of TransportFigure, "
                             f"got {self.transports!r}")
        if not self.kernels or not all(isinstance(k, KernelFigure) for k in self.kernels):
            raise ValueError(f"Profile.kernels must be a non-empty tuple of KernelFigure, got {self.kernels!r}")
        if not all(isinstance(k, KernelPoint) for k in self.kernel_points):
            raise ValueError(f"Profile.kernel_points must be a tuple of KernelPoint, got {self.kernel_points!r}")
        names = [t.name for t in self.transports]
        if len(set(names)) != len(names):
            raise ValueError(f"Profile.transports names repeat: {names}")
        if self.network is not None and not isinstance(self.network, TransportFigure):
            raise ValueError(f"Profile.network must be None or a TransportFigure, got {self.network!r}")

    def _check_hosts(self) -> None:
        """The hosts, sockets, switches and NICs divide the GPUs evenly; several hosts need a
        network rate."""
        host = self.host_gpus
        if not isinstance(host, int) or isinstance(host, bool) or host < 1 or self.gpus % host:
            raise ValueError(f"Profile.gpus_per_host must be None or a positive int dividing gpus={self.gpus}, "
                             f"got {self.gpus_per_host!r}")
        if host % self.sockets:
            where = f"gpus={self.gpus}" if self.gpus_per_host is None else f"the {host} GPUs of a host"
            raise ValueError(f"Profile.sockets={self.sockets} must divide {where}")
        if (host // self.sockets) % self.gpus_per_switch:
            raise ValueError(f"Profile.gpus_per_switch={self.gpus_per_switch} must divide the "
                             f"{host // self.sockets} GPUs of a socket")
        if host % self.gpus_per_nic:
            raise ValueError(f"Profile.gpus_per_nic={self.gpus_per_nic} must divide the {host} GPUs of a host")
        _positive("Profile", "network_gbps", self.network_gbps, allow_none=self.hosts == 1)

    # --- lookups ------------------------------------------------------------------------------
    @property
    def bench_fabric(self) -> str:
        """The ``fabric`` value ``sparsp bench`` writes for this kind of path."""
        return "nvlink" if self.peer_access else "host"

    def transport(self, name: "str | TransportFigure | None" = None) -> TransportFigure:
        """The figure of transport ``name``: None, the profile's default (its first); a figure,
        itself (one its caller resolved already). A name the profile does not describe raises
        ``ValueError`` naming the ones it has: the cost model's one rule for an unknown name
        (``work``, ``timeline`` and the chunk rules alike). A running call, which must not fail
        over an estimate, maps its transport first (``call_transport``)."""
        if name is None:
            return self.transports[0]
        if isinstance(name, TransportFigure):
            return name
        for t in self.transports:
            if t.name == name:
                return t
        raise ValueError(f"profile {self.name} has no transport {name!r}; it has "
                         f"{', '.join(t.name for t in self.transports)}")

    def call_transport(self, name: str) -> TransportFigure:
        """The figure a running call estimates its transport ``name`` with (``strategy="auto"``,
        the chunk rules of ``sparsp``): the profile's figure of that name, else the profile's
        default. A transport the profile does not describe (``peers``, one registered by the
        user, a profile fitted without it) is estimated on the profile's default path, so that
        a call never fails over an estimate."""
        return self.transport(name if any(t.name == name for t in self.transports) else None)

    def kernel(self, head_dim: int) -> KernelFigure:
        return min(self.kernels, key=lambda k: (abs(k.head_dim - head_dim), -k.head_dim))

    def kernel_rate(self, head_dim: int, *, heads: int = 0, tokens: int = 0, layout: str = "local",
                    density: float | None = None) -> float:
        """Block-sparse TFLOP/s of a kernel step: from the ``kernel_points`` of this shape
        (``heads`` × ``head_dim`` over ``tokens`` keys) in ``layout``, linear in the rank's
        ``density`` between the measured densities and up to the dense row at 1 (a full mask
        walks every block as the dense kernel does), constant beyond them; without points
        for the shape and layout (or without a density), ``kernel(head_dim).sparse_tflops``."""
        pts = [(p.density, p.tflops) for p in self.kernel_points
               if (p.heads, p.head_dim, p.tokens) == (heads, head_dim, tokens) and p.layout in (layout, "dense")]
        if density is None or not any(d < 1.0 for d, _ in pts):
            return self.kernel(head_dim).sparse_tflops
        return _interpolate(pts, density)

    @property
    def host_gpus(self) -> int:
        """GPUs in one host (``gpus_per_host``; all of them where None)."""
        return self.gpus if self.gpus_per_host is None else self.gpus_per_host

    @property
    def hosts(self) -> int:
        return self.gpus // self.host_gpus

    @property
    def network_figure(self) -> TransportFigure:
        """The transport of pairs on different hosts (``network``; else the default one)."""
        return self.network or self.transports[0]

    def host_of(self, gpu: int) -> int:
        return gpu // self.host_gpus

    def nic_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_nic

    def socket_of(self, gpu: int) -> int:
        """GPU ``gpu``'s socket, numbered across hosts."""
        return gpu // (self.host_gpus // self.sockets)

    def same_host_sockets(self, a: int, b: int) -> bool:
        """Whether sockets ``a`` and ``b`` (``socket_of``) are in one host."""
        return a // self.sockets == b // self.sockets

    def switch_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_switch

    @property
    def call_after(self) -> float:
        """``call_after_ms``, at most ``call_ms`` (ms)."""
        return min(self.call_after_ms, self.call_ms)

    # --- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "Profile":
        doc = dict(doc)
        try:
            doc["transports"] = tuple(TransportFigure(**t) for t in doc["transports"])
            doc["kernels"] = tuple(KernelFigure(**k) for k in doc["kernels"])
            doc["kernel_points"] = tuple(KernelPoint(**k) for k in doc.get("kernel_points", ()))
            doc["sources"] = tuple(doc.get("sources", ()))
            if doc.get("network") is not None:
                doc["network"] = TransportFigure(**doc["network"])
            return cls(**doc)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a sparsp profile: {e}") from None

    def widened(self, ranks: int) -> "Profile":
        """This box grown to hold ``ranks`` GPUs with the same per-GPU figures: whole sockets and
        switches are added (itself when it already holds them). How ``strategy="auto"`` and the
        validation of rows measured on more GPUs than a profile describes predict them."""
        if ranks <= self.gpus:
            return self
        if self.gpus_per_host is not None:  # whole hosts
            hosts = math.ceil(ranks / self.gpus_per_host)
            return replace(self, name=f"{self.name}-x{ranks}", gpus=self.gpus_per_host * hosts)
        unit = self.sockets * self.gpus_per_switch
        return replace(self, name=f"{self.name}-x{ranks}", gpus=unit * math.ceil(ranks / unit))

    def scaled(self, factor: float) -> "Profile":
        """Every bandwidth capacity times ``factor`` (calibration keeps their ratios)."""
        def s(x):
            return None if x is None else x * factor
        return replace(self, link_gbps=self.link_gbps * factor, duplex_gbps=s(self.duplex_gbps),
                       host_gbps=s(self.host_gbps), inter_socket_gbps=s(self.inter_socket_gbps),
                       switch_uplink_gbps=s(self.switch_uplink_gbps))




__all__ = ["BENCH_FABRICS", "KERNEL_LAYOUTS", "KernelFigure", "KernelPoint", "Profile", "TransportFigure"]
