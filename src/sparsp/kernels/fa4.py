"""Block-sparse attention through FlashAttention-4's CuTe-DSL forward (GPU default on sm90).

Measured on H200 (docs/design.md "Kernels and transports"): 584 TFLOP/s per kept block at d128,
density 0.236, and 478 at d64, density 0.6: 0.96-1.01x cuDNN dense, against flex's 409 / 392.
Install: the optional extra ``sparsp[fa4]`` (flash-attn-4 4.0.0b36 + nvidia-cutlass-dsl 4.8.1;
docs/kernels.md, "Installing FA4").

FA4 takes ``(B, S, H, D)`` tensors and per-(batch, head, query block) lists of key blocks
(``BlockSparseTensorsTorch``; we pass ours as *full* blocks, so no ``mask_mod`` runs):

- ``LocalKV``: ``q.transpose(1, 2)`` (a view) against ``k, v (B, S, H, D)`` as given, one K/V
  head per query head: no copy. FA4 masks keys past ``S`` only in the first block it
  processes, which is the LAST id of a list, so lists that may hold the short tail block are
  sorted ascending first (``kernel_indices`` gives them ascending anyway).
- ``KVBuffer``: the queries as ``(1, Sq, B*H, D)`` (a view of head-major ``q``), the buffer
  as ONE shared K/V head ``(1, N, 1, D)``, lists per ``b*h``. ``pack_gqa=False``: with
  per-head lists FA4 must not pack query heads into one tile (it turns pack_gqa off itself
  when the lists have a head dim != 1; we say so explicitly). Short blocks (one per row) run
  as a second call over a per-head scratch ``(1, short_len, B*H, D)``, merged by LSE.

Supported: fp16/bf16, head dim 8..128 (multiple of 8), ``block_size`` 128, sm90. On sm90
FA4 fits its tile to the sparse block (128 x 128 here); on sm100 a 128-token query block is
smaller than its two-stage 256-row tile and other block sizes are untested, so any other
case runs the flex backend instead (a warning names the reason once).

LSE: natural log (FA4 keeps log2 statistics and multiplies by ln 2 at the end); an empty row
gets out 0 and lse -inf (FA4 zeroes a tile with no block). Compilation: FA4 JIT-compiles on
the first call of a compile key (about 3 s); its key holds dtype, head dim, the query-heads-
per-K/V-head ratio and tile options but no sequence length, so new geometries with the same
head dim and ratio reuse the kernel (the packed path's ratio is ``B*H``). FA4 caches the
kernels in memory (on disk with ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``).

Prepared launches: ``flash_attn_func`` re-derives its whole configuration in Python on every
call (argument checks, tile choice, the block-sparse tensors' normalisation, the compile key),
which costs more host time than an LTX-size kernel of a call's critical path can hide. The
first call of a *launch signature* (device, dtype, head dims, head counts, batch, the stride-0
and unit-stride pattern of every tensor, block size, scale: everything FA4's compile key and
argument list depend on besides sequence lengths and addresses) goes through
``flash_attn_func`` with its compiled kernel watched, and the arguments the kernel received are
kept as a template in which every tensor is named by the input it is (same address, shape and
strides). Later calls of the signature build that argument list from their own tensors and
call the compiled kernel directly. A signature whose arguments cannot all be named that way
(FA4 copied or reshaped an input) keeps using ``flash_attn_func``; so do empty sequences.
Before a template is used it is tried once on the first call's inputs and its result compared
bit for bit with ``flash_attn_func``'s, on the device (``_Trial``: the host reads the verdict
once it has landed, never waiting for it); a template that disagrees is dropped with a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import warnings
from typing import Any, Callable

import torch
from torch import Tensor

from ..caches import per_geometry
from . import flex, torch_ref
from .buffer import KVBuffer, fit_width, packed_result, sorted_lists, split_lists
from .local import LocalKV
from .merge import fold

__all__ = ["SUPPORTED_BLOCK_SIZES", "block_sparse_attention", "dense", "fa4_available",
           "import_error", "reads_token_major", "unsupported_reason"]

SUPPORTED_BLOCK_SIZES = (128,)
_WARNED: set[str] = set()


@functools.lru_cache(maxsize=None)
def _load() -> tuple:
    """(flash_attn_func, BlockSparseTensorsTorch, None) or (None, None, error text)."""
    try:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        from flash_attn.cute.interface import flash_attn_func
    except Exception as e:  # ImportError, or a CUDA runtime library that does not load
        return None, None, f"{type(e).__name__}: {e}"
    return flash_attn_func, BlockSparseTensorsTorch, None


def import_error() -> str | None:
    """Why ``flash_attn.cute`` does not import here (``None`` when it does)."""
    return _load()[2]


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fa4_available(device: torch.device | str) -> bool:
    """CUDA device of compute capability 9.0 or newer and ``flash_attn.cute`` importable."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9 and _load()[0] is not None


def unsupported_reason(q: Tensor, block_size: int) -> str | None:
    """Why this call cannot run in FA4 (it then runs flex), or ``None``."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (FA4 takes float16 and bfloat16)"
    D = q.shape[-1]
    if D % 8 or not 8 <= D <= 128:
        return f"head dim {D} (FA4's block-sparse tiles here: 8..128, multiple of 8)"
    if block_size not in SUPPORTED_BLOCK_SIZES:
        return f"block_size {block_size} (FA4 block sparsity is used with {SUPPORTED_BLOCK_SIZES})"
    major = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())[0]
    if major != 9:
        return f"compute capability {major}.x (FA4's 128-token block-sparse tiles fit sm90)"
    return None


def reads_token_major(q: Tensor, block_size: int) -> bool:
    """FA4 reads a (B, H, S, D) view of token-major queries without a copy on a call it runs
    itself (not its flex fallback) with one batch: its packed path folds (b, h) into one dim,
    a view only when B = 1."""
    return q.shape[0] == 1 and import_error() is None and unsupported_reason(q, block_size) is None


def _warn_once(text: str) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        warnings.warn(f"sparsp kernel 'fa4': {text}", RuntimeWarning, stacklevel=4)


def _fallback(reason: str, q, kv, kv_num_blocks, kv_indices, scale):
    _warn_once(f"{reason}; running the flex kernel instead")
    fn = flex.block_sparse_attention if flex.flex_available(q.device) else torch_ref.block_sparse_attention
    return fn(q, kv, kv_num_blocks, kv_indices, scale=scale)


_NO_MASK = per_geometry("kernels: fa4 empty mask lists")  # key -> (Tensor, Tensor)


def _run(q4: Tensor, k4: Tensor, v4: Tensor, num: Tensor, idx: Tensor, bs: int,
         scale: float) -> tuple[Tensor, Tensor]:
    """FA4 forward: ``q4 (B', Sq, Hq, D)``, ``k4, v4 (B', Sk, Hk, D)``, full-block lists
    ``num int32 [B', Hq, nQ]``, ``idx int32 [B', Hq, nQ, W]`` with ``1 <= W <= ceil(Sk/bs)``.
    Returns ``out (B', Sq, Hq, D)`` and natural-log ``lse (B', Hq, Sq)``."""
    # The "mask" lists (blocks that need mask_mod) are required by the API; ours are empty.
    # Full shape, not broadcast: a head dim of 1 there would let FA4 pack query heads.
    key = (tuple(num.shape), str(num.device))
    empty = _NO_MASK.get(key)
    if empty is None:  # read-only zeros, made once per shape
        empty = (torch.zeros(num.shape, dtype=torch.int32, device=num.device),
                 torch.zeros(*num.shape, 1, dtype=torch.int32, device=num.device))
        _NO_MASK[key] = empty
    inputs = {"q": q4, "k": k4, "v": v4, "mask_cnt": empty[0], "mask_idx": empty[1],
              "full_cnt": num.contiguous(), "full_idx": idx.contiguous()}
    signature = _signature(inputs, bs, scale)
    if signature is None:
        return _call(inputs, bs, scale)
    prepared = _PREPARED.get(signature, _UNSEEN)
    if prepared is _UNSEEN:
        return _prepare(signature, inputs, bs, scale)
    if isinstance(prepared, _Trial):
        passed = prepared.passed()
        if passed is None:  # its verdict has not landed yet: FA4's own path this time
            return _call(inputs, bs, scale)
        _PREPARED[signature] = prepared = prepared.prepared if passed else None
        if not passed:
            _warn_once("a prepared launch disagreed with flash_attn_func on the same inputs; "
                       "this launch signature goes through flash_attn_func from now on")
    if prepared is None:
        return _call(inputs, bs, scale)
    return prepared.launch(inputs)


def _call(inputs: dict[str, Tensor], bs: int, scale: float) -> tuple[Tensor, Tensor]:
    """The launch through ``flash_attn_func`` (FA4's own argument handling)."""
    flash_attn_func, BlockSparse, _ = _load()
    sparse = BlockSparse(
        mask_block_cnt=inputs["mask_cnt"],
        mask_block_idx=inputs["mask_idx"],
        full_block_cnt=inputs["full_cnt"],
        full_block_idx=inputs["full_idx"],
        block_size=(bs, bs),
    )
    with torch.no_grad():
        out, lse = flash_attn_func(inputs["q"], inputs["k"], inputs["v"], softmax_scale=scale,
                                   causal=False, pack_gqa=False, block_sparse_tensors=sparse,
                                   return_lse=True)
    return out, lse


# -- prepared launches -----------------------------------------------------------------------

_UNSEEN = object()
_PREPARED = per_geometry("kernels: fa4 prepared launches")  # key -> _Prepared | _Trial | None
_PREPARE_LOCK = threading.Lock()


def _layout(t: Tensor) -> tuple:
    # What CuTe specialises on besides sizes: dims of stride 0 stay static, and FA4 copies
    # a tensor whose last dim is not unit-stride.
    st = t.stride()
    return (0 in st) and tuple(s == 0 for s in st), st[-1] == 1, len(st)


def _signature(inputs: dict[str, Tensor], bs: int, scale: float) -> tuple | None:
    """The launch signature of a call, or ``None`` when it must go through FA4's own path."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    if q.shape[1] == 0 or k.shape[1] == 0 or q.requires_grad:
        return None  # FA4 answers empty sequences without a kernel
    return (q.device.index, q.dtype, q.shape[0], q.shape[2], q.shape[3], k.shape[2],
            v.shape[3], bs, float(scale), tuple(map(_layout, inputs.values())))


@dataclasses.dataclass(frozen=True)
class _Slot:
    """A place in FA4's argument list that holds one of the call's tensors."""

    name: str


@dataclasses.dataclass(frozen=True)
class _Prepared:
    kernel: Callable[..., Any]
    build: Callable[[dict], list]  # the argument list from the call's tensors (``_builder``)

    def launch(self, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        q, v = inputs["q"], inputs["v"]
        B, Sq, H = q.shape[:3]
        inputs["out"] = out = torch.empty(B, Sq, H, v.shape[3], dtype=q.dtype, device=q.device)
        inputs["lse"] = lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
        self.kernel(*self.build(inputs))
        return out, lse


@dataclasses.dataclass(frozen=True)
class _Trial:
    """A prepared launch on trial: run once on its signature's first inputs and compared with
    ``flash_attn_func``'s result on the device; the bool verdict is copied to the host behind
    ``landed`` (no wait: until it has landed, calls keep going through ``flash_attn_func``)."""

    prepared: _Prepared
    verdict: Tensor
    landed: Any = None  # a torch.cuda.Event on CUDA

    def passed(self) -> bool | None:
        if self.landed is not None and not self.landed.query():
            return None
        return bool(self.verdict)


def _trial(prepared: _Prepared, inputs: dict[str, Tensor], out: Tensor, lse: Tensor) -> _Trial:
    """``prepared`` launched on the inputs ``flash_attn_func`` just answered with ``out``,
    ``lse``: bit-equal results pass (the same kernel on the same inputs)."""
    t_out, t_lse = prepared.launch(dict(inputs))
    same = torch.logical_and(torch.eq(t_out, out).all(), torch.eq(t_lse, lse).all())
    if same.device.type != "cuda":
        return _Trial(prepared, same)
    verdict = torch.empty((), dtype=torch.bool, pin_memory=True)
    verdict.copy_(same, non_blocking=True)
    landed = torch.cuda.Event()
    landed.record()
    return _Trial(prepared, verdict, landed)


def _rebuilt(like, parts: list):
    """``parts`` as a sequence of ``like``'s type (a named tuple such as FA4's ``AuxData``
    takes its fields as arguments)."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*parts)
    return type(like)(parts)


def _builder(template) -> Callable[[dict], Any]:
    """A function of the call's tensors that returns ``template`` with its slots filled;
    parts without a slot are the template's own objects, built once."""
    if isinstance(template, _Slot):
        name = template.name
        return lambda tensors: tensors[name]
    if isinstance(template, (tuple, list)) and any(True for _ in _slots(template)):
        parts = [_builder(t) for t in template]
        return lambda tensors: _rebuilt(template, [p(tensors) for p in parts])
    return lambda tensors: template


def _template(args, tensors: dict[str, Tensor]):
    """``args`` with every tensor replaced by the ``_Slot`` of the input it is; ``None``
    when a tensor is not one of them as it is (FA4 made a copy or a reshaped view)."""
    if isinstance(args, Tensor):
        names = [name for name, t in tensors.items()
                 if args.data_ptr() == t.data_ptr() and args.shape == t.shape
                 and args.stride() == t.stride() and args.dtype == t.dtype]
        return _Slot(names[0]) if len(names) == 1 else None  # two inputs alike: ambiguous
    if isinstance(args, (tuple, list)):
        parts = [_template(a, tensors) for a in args]
        if any(p is None and a is not None for p, a in zip(parts, args)):
            return None
        return _rebuilt(args, parts)
    if isinstance(args, (int, float, bool, str, type(None))):
        return args
    return None  # an argument whose meaning per call we do not know: no template


class _Watch:
    """Stands in for FA4's compile cache during one call and keeps what its kernel got."""

    def __init__(self, cache) -> None:
        self.cache, self.calls = cache, []

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __setitem__(self, key, fn) -> None:
        self.cache[key] = fn

    def __getitem__(self, key):
        fn = self.cache[key]

        def kernel(*args):
            self.calls.append((fn, args))
            return fn(*args)
        return kernel

    def __getattr__(self, name):
        return getattr(self.cache, name)


def _prepare(signature: tuple, inputs: dict[str, Tensor], bs: int,
             scale: float) -> tuple[Tensor, Tensor]:
    """Run the signature's first call through ``flash_attn_func`` and keep its template."""
    try:
        from flash_attn.cute import interface
        fwd = interface._flash_attn_fwd
        cache = fwd.compile_cache
    except (ImportError, AttributeError):  # another FA4 layout: no prepared launches
        _PREPARED[signature] = None
        return _call(inputs, bs, scale)
    with _PREPARE_LOCK:
        watch = _Watch(cache)
        fwd.compile_cache = watch
        try:
            out, lse = _call(inputs, bs, scale)
        finally:
            fwd.compile_cache = cache
    prepared = None
    if len(watch.calls) == 1:  # one kernel, no combine or scheduler pass around it
        kernel, args = watch.calls[0]
        template = _template(list(args), {**inputs, "out": out, "lse": lse})
        names = {s.name for s in _slots(template)} if template is not None else set()
        if {"q", "k", "v", "out", "lse", "full_cnt", "full_idx"} <= names:
            prepared = _trial(_Prepared(kernel, _builder(template)), inputs, out, lse)
    _PREPARED[signature] = prepared
    return out, lse


def _slots(template):
    if isinstance(template, _Slot):
        yield template
    elif isinstance(template, (tuple, list)):
        for t in template:
            yield from _slots(t)


def block_sparse_attention(
    q: Tensor,
    kv: KVBuffer | LocalKV,
    kv_num_blocks: Tensor,
    kv_indices: Tensor,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-sparse attention with FA4; semantics as ``torch_ref.block_sparse_attention``.

    Args: q ``(B, H, Sq, D)`` (any strides; head-major contiguous is free for both layouts);
    kv a ``KVBuffer`` or ``LocalKV``; kv_num_blocks int ``[B, H, nQ]``; kv_indices int
    ``[B, H, nQ, K]`` (any order, duplicate-free), ``nQ = ceil(Sq / kv.block_size)``.

    Returns:
        ``out`` ``(B, H, Sq, D)`` in ``q.dtype`` (a transposed view of FA4's ``(B, Sq, H, D)``
        output) and ``lse`` ``(B, H, Sq)`` float32, natural log; empty rows 0 / -inf.
    """
    n_q = torch_ref.check_inputs(q, kv, kv_num_blocks, kv_indices)
    reason = _load()[2] or unsupported_reason(q, kv.block_size)
    if reason is not None:
        return _fallback(reason, q, kv, kv_num_blocks, kv_indices, scale)
    B, H, Sq, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    num = kv_num_blocks.to(device=q.device, dtype=torch.int32)
    idx = kv_indices.to(device=q.device)
    bs = kv.block_size
    if isinstance(kv, LocalKV):
        width = max(1, min(idx.shape[-1], kv.num_blocks))  # FA4 allows W <= ceil(S / bs)
        lists = sorted_lists(num, idx, width) if kv.tail_len < bs else fit_width(idx, width)
        out, lse = _run(q.transpose(1, 2), kv.k, kv.v, num, lists, bs, scale)
        return out.transpose(1, 2), lse
    return _packed(q, kv, num, idx, n_q, scale)


def _packed(q: Tensor, kv: KVBuffer, num: Tensor, idx: Tensor, n_q: int,
            scale: float) -> tuple[Tensor, Tensor]:
    B, H, Sq, D = q.shape
    BH, N, bs = B * H, kv.capacity, kv.block_size
    # (1, Sq, B*H, D): a view of head-major q (the (b, h) merge is free when q is contiguous).
    q4 = q.reshape(BH, Sq, D).transpose(0, 1).unsqueeze(0)
    # FA4 accepts lists narrower than the key blocks (it reads the first cnt slots only).
    width = max(1, min(idx.shape[-1], math.ceil(N / bs)))
    split = split_lists(kv, num, idx, width)
    out: Tensor | None = None
    lse: Tensor | None = None
    if kv.num_aligned > 0:
        o4, l4 = _run(q4, kv.k.view(1, N, 1, D), kv.v.view(1, N, 1, D),
                      split.num.reshape(1, BH, n_q), split.idx.reshape(1, BH, n_q, width), bs, scale)
        out, lse = o4[0].transpose(0, 1), l4[0]  # (BH, Sq, D), (BH, Sq)
    if split.rows is not None:
        length = split.rows.shape[1]
        rows = split.rows.t().reshape(-1)  # token-major: (1, short_len, BH, D)
        k_s = kv.k.index_select(0, rows).view(1, length, BH, D)
        v_s = kv.v.index_select(0, rows).view(1, length, BH, D)
        s_num = split.has_short.to(torch.int32).reshape(1, BH, n_q)
        s_idx = torch.zeros(1, BH, n_q, 1, dtype=torch.int32, device=q.device)
        o4, l4 = _run(q4, k_s, v_s, s_num, s_idx, bs, scale)
        s_out, s_lse = o4[0].transpose(0, 1), l4[0]
        out, lse = fold(out, lse, s_out, s_lse)
    return packed_result(q, out, lse)


def dense(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Dense FA4 forward on ``(B, S, H, D)`` tensors: the benchmark's dense baseline.
    Returns ``out (B, S, H, D)`` and natural-log ``lse (B, H, S)``."""
    flash_attn_func, _, err = _load()
    if err is not None:
        raise RuntimeError(f"flash_attn.cute does not import: {err}")
    with torch.no_grad():
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=False, return_lse=True)
