"""sparsp attention processors for the video attention of the supported Diffusers models.

Each processor does what the model's own processor does to make q, k, v (projections, q/k
norms, RoPE — applied here, before the attention call, so q and k arrive rotated) and after
it (gates, output projections), on this rank's tokens, and hands the attention itself to the
model's ``Runtime`` (``sparsp.integrations.diffusers``): ``sp_attention`` over the group, or
the single-process sparse attention. RoPE helpers are Diffusers' own functions where the
model exposes them; every processor is checked against the original at ``cdf_threshold=1.0``
by ``tests/test_integration_diffusers.py``.

Kinds (``PROCESSORS``): ``wan`` (Wan ``attn1``), ``ltx`` (LTX-Video and LTX-2 ``attn1``,
including LTX-2's gated attention and STG perturbation), ``hunyuan`` (HunyuanVideo's joint
video+text attention, dual- and single-stream), ``video-kv`` (LTX-2 ``video_to_audio_attn``:
replicated audio queries over the sharded video keys).
"""

from __future__ import annotations

import torch


class SparspProcessor:
    """Base: holds the model's runtime and, for a self-attention processor, its layer: the
    position of its module among the model's self-attention modules (``parallelize``), which
    each attention call passes on (``Runtime.attend(..., layer=)``: ``strategy="auto"`` logs
    its choice per layer). Subclasses implement ``__call__`` like Diffusers'."""

    kind = ""

    def __init__(self, runtime, layer: int | None = None) -> None:
        self.runtime = runtime
        self.layer = layer

    def __repr__(self) -> str:
        where = "" if self.layer is None else f", layer {self.layer}"
        return f"{type(self).__name__}({self.runtime.describe()}{where})"


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE: rotate consecutive pairs (x0, x1) of the head dim by the angle whose cos
    and sin are repeated per pair in ``cos``/``sin`` (1, S, 1, D)."""
    c, s = cos[..., 0::2], sin[..., 1::2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2).type_as(x)


class WanSelfProcessor(SparspProcessor):
    kind = "wan"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("sparsp's Wan processor serves self-attention without a mask only")
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _rotate_pairs(q, *rotary_emb), _rotate_pairs(k, *rotary_emb)
        out = self.runtime.attend(q, k, v, layer=self.layer).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def _ltx_rope(attn, x, freqs):
    from diffusers.models.transformers.transformer_ltx2 import (
        apply_interleaved_rotary_emb,
        apply_split_rotary_emb,
    )

    if getattr(attn, "rope_type", "interleaved") == "split":
        return apply_split_rotary_emb(x, freqs)
    return apply_interleaved_rotary_emb(x, freqs)  # LTX-Video's rotation too


def _gated(attn, out, gate_logits):
    """LTX-2 gated attention: per-head gates 2·sigmoid(logits) on the attention output."""
    if gate_logits is None:
        return out
    out = out.unflatten(2, (attn.heads, -1)) * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)
    return out.flatten(2, 3)


class LTXSelfProcessor(SparspProcessor):
    """LTX-Video ``attn1`` and LTX-2 ``attn1`` (interleaved or split RoPE, gates, STG)."""

    kind = "ltx"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 query_rotary_emb=None, key_rotary_emb=None, perturbation_mask=None, all_perturbed=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("sparsp's LTX processor serves video self-attention without a mask only")
        gate_proj = getattr(attn, "to_gate_logits", None)
        gate_logits = gate_proj(hidden_states) if gate_proj is not None else None
        v = attn.to_v(hidden_states)
        if all_perturbed is None:
            all_perturbed = bool((perturbation_mask == 0).all()) if perturbation_mask is not None else False
        if all_perturbed:  # STG on every sample: the values pass through, no attention
            out = v
        else:
            q, k = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(hidden_states))
            if query_rotary_emb is not None:
                q = _ltx_rope(attn, q, query_rotary_emb)
                k = _ltx_rope(attn, k, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
            q, k, vh = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
            out = self.runtime.attend(q, k, vh, layer=self.layer).flatten(2, 3).to(q.dtype)
            if perturbation_mask is not None:
                out = torch.lerp(v, out, perturbation_mask)
        out = _gated(attn, out, gate_logits)
        return attn.to_out[1](attn.to_out[0](out))


class VideoKVProcessor(SparspProcessor):
    """LTX-2 ``video_to_audio_attn``: the audio queries (replicated on every rank) attend to
    the whole video, whose keys and values are sharded; each rank attends to its own video
    tokens and the partial results are merged across ranks by LSE (``Runtime.attend_video_kv``)."""

    kind = "video-kv"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 query_rotary_emb=None, key_rotary_emb=None, perturbation_mask=None, all_perturbed=None):
        if encoder_hidden_states is None or attention_mask is not None or perturbation_mask is not None:
            raise ValueError("sparsp's video-K/V processor serves unmasked cross-attention to the video only")
        gate_proj = getattr(attn, "to_gate_logits", None)
        gate_logits = gate_proj(hidden_states) if gate_proj is not None else None
        q = attn.norm_q(attn.to_q(hidden_states))
        k = attn.norm_k(attn.to_k(encoder_hidden_states))
        v = attn.to_v(encoder_hidden_states)
        if query_rotary_emb is not None:
            q = _ltx_rope(attn, q, query_rotary_emb)
            k = _ltx_rope(attn, k, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        out = self.runtime.attend_video_kv(q, k, v).flatten(2, 3).to(q.dtype)
        out = _gated(attn, out, gate_logits)
        return attn.to_out[1](attn.to_out[0](out))


class HunyuanJointProcessor(SparspProcessor):
    """HunyuanVideo's joint attention over [video tokens, text tokens].

    Dual-stream blocks project text with the ``add_*`` projections, single-stream blocks with
    the shared ones; RoPE rotates the video tokens only. The text stream is replicated on
    every rank and already trimmed to its valid tokens (so the model's key-padding
    ``attention_mask`` is not needed and is ignored); ``Runtime.attend`` places the text with
    the video, masks it with the video, and hands every rank the whole text output."""

    kind = "hunyuan"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if encoder_hidden_states is None:
            raise ValueError("sparsp's HunyuanVideo processor needs the text stream (encoder_hidden_states)")
        n_video = hidden_states.shape[1]
        dual = attn.add_q_proj is not None
        x = hidden_states if dual else torch.cat([hidden_states, encoder_hidden_states], dim=1)
        q, k, v = (proj(x).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if image_rotary_emb is not None and n_video:  # a rank's share may hold only text
            qv = apply_rotary_emb(q[:, :n_video], image_rotary_emb, sequence_dim=1)
            kv = apply_rotary_emb(k[:, :n_video], image_rotary_emb, sequence_dim=1)
            q, k = torch.cat([qv, q[:, n_video:]], dim=1), torch.cat([kv, k[:, n_video:]], dim=1)
        if dual:
            tq, tk, tv = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                tq = attn.norm_added_q(tq)
            if attn.norm_added_k is not None:
                tk = attn.norm_added_k(tk)
            q, k, v = torch.cat([q, tq], dim=1), torch.cat([k, tk], dim=1), torch.cat([v, tv], dim=1)
        out = self.runtime.attend(q, k, v, layer=self.layer).flatten(2, 3).to(q.dtype)
        video, text = out[:, :n_video], out[:, n_video:]
        if getattr(attn, "to_out", None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, "to_add_out", None) is not None:
            text = attn.to_add_out(text)
        return video, text


PROCESSORS = {cls.kind: cls for cls in (WanSelfProcessor, LTXSelfProcessor, VideoKVProcessor, HunyuanJointProcessor)}
