"""A Diffusers transformer as ``bench e2e`` runs it: one flow-matching step per call, the timer
of its video self-attention (and that attention's dense FLOPs), the synthetic or calibrated
q/k it may take instead of its own, and the text masks a dense row leaves out."""

from __future__ import annotations

import time

import torch

from .backends import attention_flops


class AttentionTimer:
    """Wall time of the video self-attention modules in one step (CUDA events on GPU), and the
    dense FLOPs of their calls (``flops``, since the last ``take_ms``)."""

    def __init__(self, modules, device: torch.device) -> None:
        self.device, self.spans, self.handles, self.flops = device, [], [], 0.0
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._start, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._stop))

    def _now(self):
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _start(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:  # joint attention: the text joins the video
            text = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
            tokens = hidden.shape[1] + (text.shape[1] if isinstance(text, torch.Tensor) else 0)
            self.flops += attention_flops(hidden.shape[0], tokens, getattr(module, "inner_dim", hidden.shape[-1]))
        self.spans.append([self._now(), None])

    def _stop(self, module, args, output):
        self.spans[-1][1] = self._now()

    def take_ms(self) -> float:
        """Total of the spans since the last call (synchronises the device); a span a failed
        call left open (a backend that could not run) counts nothing."""
        spans = [(a, b) for a, b in self.spans if b is not None]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            total = sum(a.elapsed_time(b) for a, b in spans)
        else:
            total = sum(b - a for a, b in spans) * 1e3
        self.spans, self.flops = [], 0.0
        return total

    def take(self) -> tuple[float, float]:
        """(ms, dense FLOPs) of the attention calls since the last take."""
        flops = self.flops
        return self.take_ms(), flops

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def attention_modules(model):
    import fnmatch

    from ..integrations.plans import plan_for

    pats = plan_for(model).self_attention
    return [m for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in pats)]


DRIFT = 0.02
"""How far the synthetic q and k move per denoising step (``SyntheticQK.advance``), in units
of their per-token noise: every run of ``DRIFT_TOKENS`` consecutive tokens (the model's order)
gets its own offset per step. A real run's q and k change from step to step, and inputs that
did not would make a kept plan trivially exact; at this size consecutive steps' cdf-0.9 masks
share 97–98 % of their kept blocks (Jaccard), 92 % after 20 steps (3,072 tokens, 8 heads,
blocks of 64, on a CPU), and the density stays within 0.5 % of its start."""
DRIFT_TOKENS = 128


class SyntheticQK:
    """q/k override for the runtime: the synthetic video q/k of this process's attention tokens
    (``token_qk``; with a ``calibration``, each layer's own calibrated heads), made once per
    geometry and layer, and moved a little by each ``advance`` (one per denoising step, called
    outside the timed steps), the same on every rank."""

    def __init__(self, model, seed: int, calibration=None) -> None:
        self.model, self.seed, self.calibration = model, seed, calibration
        self.heads = calibration.head_params() if calibration is not None else None
        self.made: list = []  # (the layout's token ids, layer key, q, k) of every pair made
        self.steps = 0

    def __call__(self, layout, like: torch.Tensor, layer: int | None = None):
        from dataclasses import replace

        from ..workloads.synthetic import token_qk

        heads, cal = self.heads, self.calibration
        at = 0 if heads is None else layer  # uncalibrated: every layer draws the same heads
        if heads is not None and (at is None or not 0 <= at < len(heads)):
            raise ValueError(f"the calibration has {len(heads)} layers; attention call of layer {layer}")
        key = ("synthetic-qk", str(like.device), like.dtype, at)
        if key not in layout.cache:
            geom = replace(layout.geometry, rope=rope_for(self.model))
            extra = {} if heads is None else {"heads": heads[at], "mix": cal.mix, "layer": at}
            q, k = token_qk(geom, seed=self.seed if heads is None else cal.seed, tokens=layout.attn_tokens,
                            device=like.device, dtype=like.dtype, **extra)
            pair = (q.expand(like.shape[0], -1, -1, -1).contiguous(), k.expand(like.shape[0], -1, -1, -1).contiguous())
            layout.cache[key] = pair
            self.made.append((layout.attn_tokens, layout.geometry.num_tokens, at, *pair))
        return layout.cache[key]

    def advance(self) -> None:
        """Move every pair made so far by one step's drift (``DRIFT``)."""
        self.steps += 1
        for tokens, total, at, q, k in self.made:
            regions = -(-total // DRIFT_TOKENS)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.steps * 1009 + at)
            for x in (q, k):  # an offset per run of tokens, head and dim, drawn on the CPU: the same everywhere
                offset = (DRIFT * torch.randn(1, regions, *x.shape[2:], generator=g)).to(x.device, x.dtype)
                region = (tokens // DRIFT_TOKENS).to(x.device)
                for a in range(0, x.shape[1], 8192):  # bounded temporaries at full size
                    x[:, a:a + 8192] += offset.index_select(1, region[a:a + 8192])


def synthetic_qk(model, seed: int, calibration=None) -> SyntheticQK:
    """The runtime's q/k override of ``--weights synthetic-structure`` (``SyntheticQK``)."""
    return SyntheticQK(model, seed, calibration)


def rope_for(model):
    from ..geometry import MODELS
    from ..integrations.models import kind_of

    preset = {"hunyuan-video": "hunyuan-video", "wan": "wan2.1-14b", "ltx-video": "ltx-video", "ltx-2": "ltx-2"}
    spec = MODELS[preset[kind_of(model)]]
    rope = spec.rope
    D = model.config.attention_head_dim
    if sum(rope.axes_dim) > D:  # a tiny or custom head dim: split it like the model does, t gets the rest
        hw = 2 * (D // 6)
        rope = type(rope)(axes_dim=(D - 2 * hw, hw, hw), theta=rope.theta, scale=rope.scale)
    return rope


def step_fn(model, inputs: dict, steps_sigmas, latent_key: str = "hidden_states", exchange=None):
    """One flow-matching Euler step per call: x ← x + (σ_next − σ)·v(x, σ). ``exchange(v)``:
    what the step does with its prediction first (a CFG half's exchange with the other)."""
    from ..integrations.models import sample_of

    state = {"x": inputs[latent_key].clone(), "i": 0}

    def step():
        i = state["i"] % (len(steps_sigmas) - 1)
        sigma, nxt = steps_sigmas[i], steps_sigmas[i + 1]
        t = torch.full_like(inputs["timestep"], sigma * 1000.0)
        with torch.no_grad():
            v = sample_of(model(**{**inputs, latent_key: state["x"], "timestep": t}, return_dict=False))
        if exchange is not None:
            v = exchange(v)
        state["x"] = state["x"] + (nxt - sigma) * v.to(state["x"].dtype)
        state["i"] += 1

    return step


def drop_all_valid_text_masks(model, inputs: dict, kind: str, dense: bool) -> None:
    """A text mask that marks every token valid masks nothing, yet it keeps the fastest
    backends (cuDNN, flash: no arbitrary mask) from applying: pass None instead. HunyuanVideo
    builds its joint attention's mask from ``encoder_attention_mask`` whatever it holds, so
    there the blocks of a dense row get None in its place (sparsp's rows read the mask
    themselves); the other models take None for their text mask."""
    if kind == "hunyuan-video":
        mask = inputs.get("encoder_attention_mask")
        if not dense or mask is None or not bool(mask.bool().all()):
            return

        def no_mask(block, args, kwargs):
            if len(args) > 3 and isinstance(args[3], torch.Tensor) and bool(args[3].all()):
                args = (*args[:3], None, *args[4:])
            if isinstance(kwargs.get("attention_mask"), torch.Tensor) and bool(kwargs["attention_mask"].all()):
                kwargs = {**kwargs, "attention_mask": None}
            return args, kwargs

        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            block.register_forward_pre_hook(no_mask, with_kwargs=True)
        return
    for key in ("encoder_attention_mask", "audio_encoder_attention_mask"):
        mask = inputs.get(key)
        if isinstance(mask, torch.Tensor) and bool(mask.bool().all()):
            inputs[key] = None
