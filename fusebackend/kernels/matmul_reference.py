"""A matmul group's math in torch ops (kernels/matmul.py's fallback where Triton cannot run,
and the tests' reference), rounded as the kernel rounds and as eager does; ``Heads``, what a
rotary group reads beside its weights."""

from __future__ import annotations

import dataclasses

import torch

from fusebackend.kernels.epilogue import activation_program, evaluate
from fusebackend.kernels.ir import MatmulGroup

__all__ = ["Heads", "reference"]


@dataclasses.dataclass(frozen=True)
class Heads:
    """What a rotary q, k, v group reads beside its weights: cos and sin, and the caches it
    writes k and v into at ``index`` (None without a cache write)."""

    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: torch.Tensor | None = None  # with ``head_norm``: the heads' norm weights [D]
    k_norm: torch.Tensor | None = None
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    index: torch.Tensor | None = None


def reference(
    group: MatmulGroup,
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    weights: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor, ...],
    heads: Heads | None = None,
) -> tuple[torch.Tensor, ...]:
    """``group``'s math in torch ops, rounded as the kernel rounds (and as eager does);
    ``weights`` ``[N_i, K]``, ``biases`` and ``heads`` as ``_split_params`` gives them."""
    a = x
    if group.norm in ("rms", "rms_offset"):
        a = _rms_reference(group.norm, x, norm_weight, group.eps)
    elif group.norm == "layer":
        a = torch.nn.functional.layer_norm(x, x.shape[-1:], norm_weight, norm_bias, group.eps)
    ys = [
        torch.nn.functional.linear(a, w, biases[k] if group.bias else None)
        for k, w in enumerate(weights)
    ]
    # the activations as the kernel's program spells them, run by torch's own ops
    if group.gate:
        ys = [evaluate(activation_program(group.gate, ys[0].dtype), ys[0]) * ys[1]]
    if group.activation:
        ys = [evaluate(activation_program(group.activation, ys[0].dtype), ys[0])]
    if group.epilogue is not None:
        ys = [evaluate(group.epilogue, ys[0])]
    if group.residual:
        ys = [ys[0] + residual]
    if group.residual_tail is not None:
        ys = [evaluate(group.residual_tail, ys[0])]
    if heads is not None:
        return _rotary_reference(group, ys, heads)
    return tuple(ys)


def _rms_reference(kind: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm ("rms": the weight times the normalised row rounded to x's
    dtype) or Gemma's ("rms_offset": times ``1 + weight`` in fp32, rounded once)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "rms":
        return weight * h.to(x.dtype)
    return (h * (1.0 + weight.float())).to(x.dtype)


def _rotary_reference(group: MatmulGroup, ys: list[torch.Tensor], heads: Heads):
    """q and k (``[B, T, N]``) rotated as transformers' ``apply_rotary_pos_emb`` rotates
    them, k and v written into the caches with ``index_copy_`` (returning q), or q, k, v."""
    batch, seq = ys[0].shape[:2]
    width = group.rotary
    cos = torch.broadcast_to(heads.cos, (batch, 1, seq, width))
    sin = torch.broadcast_to(heads.sin, (batch, 1, seq, width))
    by_heads = [y.view(batch, seq, -1, width).transpose(1, 2) for y in ys]
    for k, weight in ((0, heads.q_norm), (1, heads.k_norm)):
        y = by_heads[k]
        if group.head_norm:  # transformers' RMSNorm over each head, or Gemma3's
            y = _rms_reference(group.head_norm, y, weight, group.head_eps)
        rotated = torch.cat((-y[..., width // 2 :], y[..., : width // 2]), dim=-1)
        by_heads[k] = y * cos + rotated * sin
    flat = [y.transpose(1, 2).reshape(batch, seq, -1) for y in by_heads]
    if not group.cache_write:
        return tuple(flat)
    heads.k_cache.index_copy_(2, heads.index, by_heads[1])
    heads.v_cache.index_copy_(2, heads.index, by_heads[2])
    return (flat[0],)
