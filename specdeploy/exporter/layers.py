"""Building blocks of the explicit verify-v1 forward pass (torch, export time only).

The forward is written from the weights instead of tracing transformers' modules: the graph is
leaner, and it does not depend on transformers' cache classes.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * weight


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def positions(past_len: torch.Tensor, tokens: int) -> torch.Tensor:
    """Absolute position of each new token: past_len[b] + j.  # [batch, tokens]"""
    return past_len[:, None] + torch.arange(tokens, dtype=past_len.dtype)[None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of the first cos.shape[-1] dims of each head (partial rotary: the rest pass through)."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's soft-capping of attention scores and logits."""
    return torch.tanh(x * (1.0 / cap)) * cap


def cached_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    past_len: torch.Tensor,
    window: int | None = None,
    cap: float | None = None,
) -> torch.Tensor:
    """Attention of the new tokens over the valid cache prefix and, causally, over each other.

    q: [batch, heads, tokens, head_dim], already scaled; k_new, v_new: [batch, kv_heads, tokens,
    head_dim]; cache_k, cache_v: [batch, kv_heads, capacity, head_dim]; past_len: [batch].
    Returns [batch, tokens, heads * head_dim]. ``window``: a sliding window, as transformers masks it: the
    query at position p sees keys at p - window + 1 .. p, each query's bound computed from its own position, so
    a verification of K + 1 tokens, a rollback and a ragged row are as exact as with full attention.
    ``cap``: scores soft-capped (``softcap``) before the mask.

    The cache is never concatenated or repeated for grouped-query heads (that would copy it every
    call): query heads are folded into the kv-head axis, and the scores over the cache and over the
    new tokens are computed apart and joined only for the softmax. Slots >= past_len are replaced,
    not added to, so finite garbage there can never reach the output.
    """
    batch, heads, tokens, head_dim = q.shape
    kv_heads, capacity = cache_k.shape[1], cache_k.shape[2]
    group = heads // kv_heads
    qg = q.reshape(batch, kv_heads, group * tokens, head_dim)  # row = g * tokens + t
    s_cache = qg @ cache_k.transpose(-1, -2)  # [batch, kv_heads, group * tokens, capacity]
    s_new = qg @ k_new.transpose(-1, -2)  # [batch, kv_heads, group * tokens, tokens]
    if cap is not None:
        s_cache, s_new = softcap(s_cache, cap), softcap(s_new, cap)
    floor = torch.finfo(s_cache.dtype).min
    slots = torch.arange(capacity)
    valid = slots[None, :] < past_len[:, None]  # [batch, capacity]
    steps = torch.arange(tokens)
    causal = steps[:, None] >= steps[None, :]  # [tokens, tokens]
    if window is None:
        s_cache = torch.where(valid[:, None, None, :], s_cache, floor)
    else:
        query_pos = past_len[:, None] + steps[None, :]  # [batch, tokens]
        seen = valid[:, None, :] & (slots[None, None, :] > query_pos[:, :, None] - window)  # [batch, tokens, capacity]
        s_cache = torch.where(seen.repeat(1, group, 1)[:, None], s_cache, floor)
        causal = causal & (steps[:, None] - steps[None, :] < window)
    s_new = torch.where(causal.repeat(group, 1), s_new, floor)
    weights = torch.softmax(torch.cat([s_cache, s_new], dim=-1), dim=-1)
    out = weights[..., :capacity] @ cache_v + weights[..., capacity:] @ v_new  # [batch, kv, g*t, d]
    out = out.reshape(batch, heads, tokens, head_dim).transpose(1, 2)
    return out.reshape(batch, tokens, heads * head_dim)


def transposed(weight: torch.Tensor) -> nn.Parameter:
    """A linear weight [out, in] stored as [in, out], so the graph holds a plain MatMul with a
    constant right-hand side: the form ONNX Runtime's MatMulNBits quantizer rewrites."""
    return nn.Parameter(weight.t().contiguous().to(torch.float32), requires_grad=False)


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.contiguous().to(torch.float32), requires_grad=False)
