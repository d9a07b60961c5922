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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the new tokens over the valid cache prefix and, causally, over each other.

    q: [batch, heads, tokens, head_dim], already scaled; k_new, v_new: [batch, kv_heads, tokens,
    head_dim]; cache_k, cache_v: [batch, kv_heads, capacity, head_dim]; past_len: [batch].
    Returns [batch, tokens, heads * head_dim]. ``window``: a sliding window, as transformers masks it: the
    query at position p sees keys at p - window + 1 .. p, each query's bound computed from its own position, so
    a verification of K + 1 tokens, a rollback and a ragged row are as exact as with full attention.
    ``cap``: scores soft-capped (``softcap``) before the mask. ``sinks`` [heads]: a logit per head that joins each
    softmax's denominator and nothing else (gpt-oss's attention sinks: a query may attend to nothing).

    The new tokens' K/V are written into a copy of the cache at their own slots (past_len[b] + j) and one MatMul,
    one softmax and one MatMul run over every slot: a key sits in the same column, and its score and value join
    the same sums in the same order, whichever call wrote it. So a position's arithmetic does not depend on the call
    that computes it (a plain step or a verification's row j), only on the kernels its rows run, which in calls of
    an even number of tokens are the same for every row (exact mode, ``engines/even.py``; docs/results/exactness/).
    Scoring the cache and the new tokens apart and joining them for the softmax, as before, put a key in another
    column, and another partial sum, by the call: a position moved by a few ulp between calls. The copy costs one
    read and one write of each cache per layer. Query heads are folded into the kv-head axis (row = g * tokens + t),
    so the keys are read once per kv head, never repeated for grouped-query heads. Slots past a query's own
    position are replaced, not added to, so finite garbage there can never reach the output.
    """
    batch, heads, tokens, head_dim = q.shape
    kv_heads, capacity = cache_k.shape[1], cache_k.shape[2]
    group = heads // kv_heads
    query_pos = positions(past_len, tokens)  # [batch, tokens]: each new token's slot, and the last it sees
    slot_of_new = query_pos[:, None, :, None].expand(batch, kv_heads, tokens, head_dim)
    keys = cache_k.scatter(2, slot_of_new, k_new)  # [batch, kv_heads, capacity, head_dim]
    values = cache_v.scatter(2, slot_of_new, v_new)
    qg = q.reshape(batch, kv_heads, group * tokens, head_dim)  # row = g * tokens + t
    scores = qg @ keys.transpose(-1, -2)  # [batch, kv_heads, group * tokens, capacity]
    if cap is not None:
        scores = softcap(scores, cap)
    slots = torch.arange(capacity)
    seen = slots[None, None, :] <= query_pos[:, :, None]  # [batch, tokens, capacity]
    if window is not None:
        seen = seen & (slots[None, None, :] > query_pos[:, :, None] - window)
    scores = torch.where(seen.repeat(1, group, 1)[:, None], scores, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # one more column per row, its head's sink (row g * tokens + t is head kv * group + g), dropped after
        sink = sinks.reshape(1, kv_heads, group, 1, 1).expand(batch, kv_heads, group, tokens, 1)
        probs = torch.softmax(torch.cat([scores, sink.reshape(batch, kv_heads, group * tokens, 1)], dim=-1), dim=-1)
        probs = probs[..., :capacity]
    out = probs @ values  # [batch, kv_heads, group * tokens, head_dim]
    out = out.reshape(batch, heads, tokens, head_dim).transpose(1, 2)
    return out.reshape(batch, tokens, heads * head_dim)


def transposed(weight: torch.Tensor) -> nn.Parameter:
    """A linear weight [out, in] stored as [in, out], so the graph holds a plain MatMul with a
    constant right-hand side: the form ONNX Runtime's MatMulNBits quantizer rewrites."""
    return nn.Parameter(weight.t().contiguous().to(torch.float32), requires_grad=False)


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.contiguous().to(torch.float32), requires_grad=False)
