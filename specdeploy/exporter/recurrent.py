"""Recurrent mixers, the explicit form: a hybrid family's layers that keep a state instead of K/V (torch, traced).

A mixer is what a block runs between its first norm and the residual add: attention (``llama.DecoderVerify``) or one
of these. Each reads its state at the positions before a call's first token from a buffer kept by position
(``contract.StateSpec``: slot p mod slots, where slots is the capacity or a ring's length) and returns the states of
the call's last min(tokens, slots) positions, which the engine writes at their slots: so every position a row's length
can roll back to keeps its own state, and rollback moves a length, as for K/V.

- ``ShortConv`` (LFM2): in_proj to B, C, x; a depthwise causal convolution of B * x over the last ``kernel`` positions;
  C times it; out_proj. Its state at a position is that position's B * x: [hidden], kept positionally (every slot, as
  K/V: a verification, a rollback and a reused prefix at any length read what a fresh prefill would).
- ``Mamba2`` (Granite 4.0-H): in_proj to the gate z, xBC and dt; a depthwise causal convolution of xBC (SiLU); the
  selective state-space scan h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, y_t = C_t h_t + D x_t over the call's tokens
  from the state before them, in its quadratic ("SSD") form within the call; a norm of y * SiLU(z) per group;
  out_proj. Two states: the convolution's input xBC [conv_dim] and the scan's h [heads, head_dim, d_state], both in
  rings (a state a position at every slot would be gigabytes).
"""

from __future__ import annotations

import torch
from torch import nn

from ..contract import StateSpec
from .layers import transposed
from .registry import ExportError, take

# The most drafts a cycle may verify over a ring of states (``StateSpec.max_drafts``): its length is this plus the
# verified tokens' + 1, exact mode's padding token and the positions the state reads before a call
RING_DRAFTS = 16


def read_states(cache: torch.Tensor, past_len: torch.Tensor, lookback: int) -> torch.Tensor:
    """The states of positions past_len[b] - lookback .. past_len[b] - 1 from ``cache`` [batch, slots, *shape] (position
    p at slot p mod slots); zeros for positions before 0, as a fresh sequence starts.  # [batch, lookback, *shape]"""
    batch, slots = cache.shape[0], cache.shape[1]
    pos = past_len[:, None] + torch.arange(-lookback, 0, dtype=past_len.dtype)  # [batch, lookback]
    slot = torch.remainder(pos, torch.full_like(pos, slots))
    flat = cache.reshape(batch * slots, -1)
    index = (torch.arange(batch, dtype=past_len.dtype)[:, None] * slots + slot).reshape(-1)
    found = flat.index_select(0, index).reshape(batch, lookback, *cache.shape[2:])
    valid = (pos >= 0).reshape(batch, lookback, *([1] * (cache.dim() - 2)))
    return torch.where(valid, found, torch.zeros_like(found))


def last_states(states: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The call's last min(tokens, slots) positions of ``states`` [batch, tokens, *shape]: what the engine writes into
    ``cache`` [batch, slots, *shape] (a prefill chunk longer than a ring keeps only the ring's worth)."""
    keep = torch.sym_min(states.shape[1], cache.shape[1])
    return states[:, states.shape[1] - keep :]


def causal_conv(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A depthwise causal convolution of ``window`` [batch, kernel - 1 + tokens, channels] (the positions before the
    call, then its own) by ``weight`` [channels, kernel]: out[t] = sum_j weight[:, j] * window[t + j] (+ bias), as
    torch's conv1d computes it.  # [batch, tokens, channels]"""
    kernel = weight.shape[1]
    tokens = window.shape[1] - kernel + 1
    out = window[:, :tokens] * weight[:, 0]
    for j in range(1, kernel):
        out = out + window[:, j : j + tokens] * weight[:, j]
    return out if bias is None else out + bias


class ShortConv(nn.Module):
    """LFM2's short convolution (``Lfm2ShortConv``), weights under ``{prefix}conv.``."""

    kind = "short_conv"

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, config, eps: float):
        super().__init__()
        at = prefix + "conv."
        hidden, self.kernel = config.hidden_size, short_conv_kernel(config)
        conv, in_proj = take(weights, f"{at}conv.weight"), take(weights, f"{at}in_proj.weight")
        _check_shape(conv, (hidden, 1, self.kernel), f"{at}conv.weight", "hidden_size, 1, conv_L_cache")
        _check_shape(in_proj, (3 * hidden, hidden), f"{at}in_proj.weight", "3 x hidden_size, hidden_size")
        self.in_proj, self.in_bias = transposed(in_proj), _bias(weights, f"{at}in_proj.bias")
        self.out_proj, self.out_bias = transposed(take(weights, f"{at}out_proj.weight")), _bias(weights, f"{at}out_proj.bias")
        self.conv = nn.Parameter(conv[:, 0].to(torch.float32).contiguous(), requires_grad=False)  # [hidden, kernel]
        self.conv_bias = _bias(weights, f"{at}conv.bias")

    @staticmethod
    def states(config, layers: tuple[int, ...]) -> tuple[StateSpec, ...]:
        """B * x of each position, positional: [hidden] a slot, as K/V are kept."""
        return (StateSpec("conv", layers, (config.hidden_size,), short_conv_kernel(config) - 1),)

    def forward(self, h: torch.Tensor, past_len: torch.Tensor, conv_cache: torch.Tensor):
        """(output [batch, tokens, hidden], [B * x of the call's last positions]) of ``h`` [batch, tokens, hidden]."""
        bcx = _linear(h, self.in_proj, self.in_bias)
        b, c, x = bcx.chunk(3, dim=-1)
        bx = b * x
        window = torch.cat([read_states(conv_cache, past_len, self.kernel - 1), bx], dim=1)
        y = c * causal_conv(window, self.conv, self.conv_bias)
        return _linear(y, self.out_proj, self.out_bias), [last_states(bx, conv_cache)]


class Mamba2(nn.Module):
    """Granite 4.0-H's Mamba-2 mixer (``GraniteMoeHybridMambaLayer``), weights under ``{prefix}mamba.``."""

    kind = "mamba2"

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str, config, eps: float):
        super().__init__()
        at = prefix + "mamba."
        sizes = mamba_sizes(config)
        self.heads, self.head_dim, self.groups, self.d_state = sizes["heads"], sizes["head_dim"], sizes["groups"], sizes["d_state"]
        self.inner, self.conv_dim, self.kernel, self.eps = sizes["inner"], sizes["conv_dim"], sizes["kernel"], eps
        self.limits = tuple(float(v) for v in (config.time_step_limit or (0.0, float("inf"))))
        conv, in_proj = take(weights, f"{at}conv1d.weight"), take(weights, f"{at}in_proj.weight")
        _check_shape(conv, (self.conv_dim, 1, self.kernel), f"{at}conv1d.weight",
                     "mamba_expand x hidden_size + 2 x mamba_n_groups x mamba_d_state, 1, mamba_d_conv")
        _check_shape(in_proj, (self.inner + self.conv_dim + self.heads, config.hidden_size), f"{at}in_proj.weight",
                     "2 x mamba_expand x hidden_size + 2 x mamba_n_groups x mamba_d_state + mamba_n_heads, hidden_size")
        self.in_proj, self.in_bias = transposed(in_proj), _bias(weights, f"{at}in_proj.bias")
        self.out_proj, self.out_bias = transposed(take(weights, f"{at}out_proj.weight")), _bias(weights, f"{at}out_proj.bias")
        self.conv = nn.Parameter(conv[:, 0].to(torch.float32).contiguous(), requires_grad=False)
        self.conv_bias = _bias(weights, f"{at}conv1d.bias")
        for name in ("dt_bias", "A_log", "D"):
            tensor = take(weights, f"{at}{name}")
            _check_shape(tensor, (self.heads,), f"{at}{name}", "mamba_n_heads")
            setattr(self, name, nn.Parameter(tensor.to(torch.float32), requires_grad=False))
        self.norm = nn.Parameter(take(weights, f"{at}norm.weight").to(torch.float32), requires_grad=False)

    @staticmethod
    def states(config, layers: tuple[int, ...]) -> tuple[StateSpec, ...]:
        """The convolution's input xBC [conv_dim] and the scan's state [heads, head_dim, d_state], each in a ring."""
        sizes = mamba_sizes(config)
        lookback = sizes["kernel"] - 1
        return (StateSpec("conv", layers, (sizes["conv_dim"],), lookback, RING_DRAFTS + 2 + lookback),
                StateSpec("ssm", layers, (sizes["heads"], sizes["head_dim"], sizes["d_state"]), 1, RING_DRAFTS + 3))

    def forward(self, h: torch.Tensor, past_len: torch.Tensor, conv_cache: torch.Tensor, ssm_cache: torch.Tensor):
        """(output [batch, tokens, hidden], [xBC, then h, of the call's last positions]) of ``h`` [batch, tokens,
        hidden]."""
        batch, tokens, _ = h.shape
        z, xbc, dt = _linear(h, self.in_proj, self.in_bias).split([self.inner, self.conv_dim, self.heads], dim=-1)
        window = torch.cat([read_states(conv_cache, past_len, self.kernel - 1), xbc], dim=1)
        conv = causal_conv(window, self.conv, self.conv_bias)
        conv = conv * torch.sigmoid(conv)  # SiLU
        x, b, c = conv.split([self.inner, self.groups * self.d_state, self.groups * self.d_state], dim=-1)
        x = x.reshape(batch, tokens, self.heads, self.head_dim)
        per_group = self.heads // self.groups  # heads share their group's B and C
        b = b.reshape(batch, tokens, self.groups, 1, self.d_state).expand(-1, -1, -1, per_group, -1)
        c = c.reshape(batch, tokens, self.groups, 1, self.d_state).expand(-1, -1, -1, per_group, -1)
        b, c = b.reshape(batch, tokens, self.heads, self.d_state), c.reshape(batch, tokens, self.heads, self.d_state)
        dt = torch.clamp(nn.functional.softplus(dt + self.dt_bias), self.limits[0], self.limits[1])  # [batch, T, heads]
        decay = (dt * -torch.exp(self.A_log)).transpose(1, 2)  # log of each step's decay: [batch, heads, T]
        start = read_states(ssm_cache, past_len, 1)[:, 0]  # the state before the call: [batch, heads, head_dim, d_state]
        y, states = ssd(x, b, c, dt.transpose(1, 2), decay, start, ssm_cache.shape[1])
        y = y + self.D[:, None] * x
        y = y.reshape(batch, tokens, self.inner) * nn.functional.silu(z)
        grouped = y.reshape(batch, tokens, self.groups, self.inner // self.groups)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        y = grouped.reshape(batch, tokens, self.inner) * self.norm
        return _linear(y, self.out_proj, self.out_bias), [last_states(xbc, conv_cache), states]


def ssd(x, b, c, dt, decay, start, slots):
    """The selective scan over a call's tokens in its quadratic form: y_t = sum_{s <= t} exp(decay_{s+1..t})
    (C_t . B_s) dt_s x_s + exp(decay_{0..t}) C_t . start, and the states h_t of the last min(tokens, slots) positions.

    x [batch, T, heads, head_dim]; b, c [batch, T, heads, d_state]; dt, decay [batch, heads, T]; start [batch, heads,
    head_dim, d_state]. Returns y [batch, T, heads, head_dim] and states [batch, kept, heads, head_dim, d_state]. The
    decay between positions is summed directly (transformers' ``segment_sum``), not as a difference of running sums,
    which would cancel to nothing in float16 over a long prefill chunk."""
    tokens = x.shape[1]
    between = torch.exp(segment_sum(decay))  # [batch, heads, t, s]: 0 where s > t
    weights = between * dt[:, :, None, :]
    scores = torch.einsum("bthn,bshn->bhts", c, b) * weights
    y = torch.einsum("bhts,bshp->bthp", scores, x)
    from_start = torch.exp(torch.cumsum(decay, dim=-1))  # [batch, heads, T]
    y = y + from_start.transpose(1, 2)[..., None] * torch.einsum("bthn,bhpn->bthp", c, start)
    keep = torch.sym_min(tokens, slots)
    recent = weights[:, :, tokens - keep :]  # [batch, heads, kept, T]
    xs = x.permute(0, 2, 3, 1)  # [batch, heads, head_dim, T]
    states = (recent[:, :, :, None, :] * xs[:, :, None]) @ b.transpose(1, 2)[:, :, None]  # [batch, heads, kept, p, n]
    states = states + from_start[:, :, tokens - keep :, None, None] * start[:, :, None]
    return y, states.permute(0, 2, 1, 3, 4)


def segment_sum(decay: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: entry (t, s) the sum of decay[s + 1 .. t] for s <= t, -inf above the diagonal."""
    tokens = decay.shape[-1]
    rows = torch.arange(tokens)
    below = rows[:, None] > rows[None, :]
    summed = torch.cumsum(torch.where(below, decay[..., :, None], torch.zeros_like(decay[..., :, None])), dim=-2)
    return torch.where(rows[:, None] >= rows[None, :], summed, torch.full_like(summed, float("-inf")))


def short_conv_kernel(config) -> int:
    """LFM2's convolution kernel (``conv_L_cache``; its range checked with the config: declared.MIXERS)."""
    return config.conv_L_cache


def mamba_sizes(config) -> dict[str, int]:
    """Mamba-2's sizes from a GraniteMoeHybrid config (each checked, and against the others, with the config:
    declared.MIXERS): inner = mamba_expand * hidden_size = mamba_n_heads * mamba_d_head, conv_dim = inner + 2 *
    mamba_n_groups * mamba_d_state."""
    inner = config.mamba_expand * config.hidden_size
    return {"heads": config.mamba_n_heads, "head_dim": config.mamba_d_head, "groups": config.mamba_n_groups,
            "d_state": config.mamba_d_state, "kernel": config.mamba_d_conv, "inner": inner,
            "conv_dim": inner + 2 * config.mamba_n_groups * config.mamba_d_state}


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x @ weight if bias is None else x @ weight + bias


def _bias(weights: dict[str, torch.Tensor], name: str) -> nn.Parameter | None:
    return nn.Parameter(weights[name].to(torch.float32), requires_grad=False) if name in weights else None


def _check_shape(tensor: torch.Tensor, expected: tuple[int, ...], name: str, meaning: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ExportError(f"checkpoint tensor {name}: shape {list(tensor.shape)}; the config says {list(expected)} "
                          f"({meaning})")


# mixer kind -> class, each built as cls(weights, layer prefix, config, eps) and run as mixer(h, past_len, *its states'
# buffers); attention is the block builder's own
RECURRENT = {mixer.kind: mixer for mixer in (ShortConv, Mamba2)}
