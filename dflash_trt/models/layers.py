"""Pieces shared by the target and the drafter: norms, RoPE, fused linears, the MLP.

The elementwise work runs through the fused ops of dflash_trt.ops (one CUDA kernel each:
RMSNorm with the residual add, q/k norm + RoPE + the KV-cache write, SiLU * up); their
PyTorch references are the CPU path and round exactly like the plain code they replace.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from dflash_trt import ops
from dflash_trt.config import LayerDims, YaRN
from dflash_trt.kv_cache import Packing
from dflash_trt.sampling import Distribution, SamplingParams


class Projected(NamedTuple):
    """A layer part's output that ends in a projection (o_proj, out_proj, down_proj), not applied
    yet: so that the residual add + norm after it can run in the matmul's kernel
    (RMSNorm.add_and_norm). `value()` applies it. (moe.ExpertsOut is the MoE block's kind.)"""
    x: torch.Tensor
    linear: Linear

    def value(self) -> torch.Tensor:
        return self.linear(self.x)

    def add_rms_norm(self, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm.add_and_norm(residual, self.value()), in one launch for one row on CUDA unless the
        Linear has hooks (tensor parallelism's all-reduce, parallel.py): those need it called."""
        linear = self.linear
        if linear._forward_hooks or linear._forward_pre_hooks:
            return norm.add_and_norm(residual, self.value())
        return ops.linear_add_rms_norm(self.x, linear.weight, linear.bias, residual, norm.weight, norm.eps,
                                       norm.zero_centered, norm.ticket_on(residual.device))


def value(out) -> torch.Tensor:
    """A layer part's output as a tensor (a Projected or moe.ExpertsOut applied)."""
    return out if isinstance(out, torch.Tensor) else out.value()


class RMSNorm(nn.Module):
    zero_centered = False  # Qwen3.5's scales by 1 + weight (qwen3_5.ZeroCenteredRMSNorm)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if self.zero_centered else torch.ones(size))
        self.eps = eps
        self._ticket: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the weights' dtype: the order Qwen3 was trained with.
        # The input may be the fp32 residual stream; the output is always in the model dtype.
        return ops.rms_norm(x.contiguous(), self.weight, self.eps, self.zero_centered)

    def add_and_norm(self, x: torch.Tensor, delta) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta in fp32, its norm): a residual add fused into the norm that follows it. A
        delta not applied yet (Projected, moe.ExpertsOut) runs the add + norm with its own last
        kernel where it can."""
        if isinstance(delta, torch.Tensor):
            return ops.add_rms_norm(x, delta, self.weight, self.eps, self.zero_centered)
        return delta.add_rms_norm(x, self)

    def ticket_on(self, device: torch.device) -> torch.Tensor:
        # the int the fused launch counts its CTAs in: this norm's own, so no two launches share one
        if self._ticket is None or self._ticket.device != device:
            self._ticket = torch.zeros(1, dtype=torch.int32, device=device)
        return self._ticket


def rope_inv_freq(dim: int, theta: float, yarn: YaRN | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] fp32, the factor cos and sin are scaled by) of RoPE over
    `dim` channels, with YaRN's blend of interpolated and original frequencies when given."""
    # on the CPU even under torch.device("meta") (models are built there), moved on first use
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if yarn is None:
        return inv_freq, 1.0

    def channel_pair_turning(times: float) -> float:
        # the channel pair whose frequency turns `times` times over the original context
        return dim * math.log(yarn.original_max_position_embeddings / (times * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel_pair_turning(yarn.beta_fast), channel_pair_turning(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # a ramp of width 0 would divide by 0
    # 0 below `low` (fast pairs keep their frequency), 1 above `high` (slow pairs interpolate)
    interpolate = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    return inv_freq * (1 - interpolate) + inv_freq / yarn.factor * interpolate, yarn.attention_factor


class Rotary(nn.Module):
    """Neox-style RoPE (optionally YaRN-scaled); cos/sin are computed per call from
    absolute positions."""

    def __init__(self, head_dim: int, theta: float, yarn: YaRN | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq, self.scale = rope_inv_freq(head_dim, theta, yarn)  # a plain attribute: no state_dict entry

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[..., None] * self.inv_freq  # [..., d/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [..., d]
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [bs, T, heads, d]; cos/sin [bs, T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Linear(nn.Linear):
    """nn.Linear through ops.linear (decode-sized inputs on CUDA may take the gemv kernel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)

    def deferred(self, x: torch.Tensor) -> Projected:
        """This projection of x, left for the norm after it to apply (Projected)."""
        return Projected(x, self)


class LMHead(Linear):
    """The vocabulary projection. A decode pass keeps its `logits` (this device's vocabulary:
    all of it, or a rank's slice under tensor parallelism), takes the greedy choice from them
    (`greedy`) and a sampling request's `distribution` too, so that sampling reads the head's
    weights no second time; tensor parallelism replaces `greedy` and `distribution` by ones
    that gather the vocabulary only where top-p needs it (parallel.py)."""

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] -> this device's logits [..., V], in the weights' dtype (into `out`)."""
        return ops.linear(hidden, self.weight, self.bias, out=out)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)  # in the weights' dtype: no fp32 copy of the logits

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.greedy(self.logits(hidden))

    def distribution(self, logits: torch.Tensor, params: SamplingParams) -> Distribution:
        """`logits`' rows of positions -> their target distributions."""
        return Distribution(logits, params)


class PackedLinear(Linear):
    """One matmul for several checkpoint projections stacked by rows (q/k/v, gate/up).

    `shards` maps each checkpoint name to its row count, in stacking order; the loader
    reads this to fill the fused weight from the separate tensors.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = shards


class AttentionProjections(nn.Module):
    """Qwen3 attention weights (HF names): fused q/k/v, per-head q/k RMSNorm, o_proj.

    The target and drafter attention modules subclass this and differ only in what they
    attend over.
    """

    def __init__(self, dims: LayerDims):
        super().__init__()
        self.dims = dims
        self.scale = dims.head_dim ** -0.5
        self.qkv_proj = PackedLinear(
            dims.hidden_size, {"q_proj": dims.q_size, "k_proj": dims.kv_size, "v_proj": dims.kv_size},
            bias=dims.attention_bias,
        )
        self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)
        self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps)
        self.o_proj = Linear(dims.q_size, dims.hidden_size, bias=False)

    def qkv(self, x, cos, sin, cache_rows=None):
        """x [bs, T, H] -> q [bs, T, Hq, d], k and v [bs, T, Hkv, d], q/k normed, RoPE applied.

        With cache_rows = (k_cache, v_cache, slot, position) (one layer's cache views and
        the [bs * T] int32 slot/position of every token), k and v go straight into the
        cache and come back as None.
        """
        d = self.dims
        bs, T = x.shape[:2]
        q, k, v = ops.qk_norm_rope(self.qkv_proj(x).flatten(0, 1), d.num_attention_heads, d.num_key_value_heads,
                                   self.q_norm.weight, self.k_norm.weight, d.rms_norm_eps, cos.flatten(0, 1),
                                   sin.flatten(0, 1), *(cache_rows or ()))
        return tuple(None if t is None else t.unflatten(0, (bs, T)) for t in (q, k, v))


class MLP(nn.Module):
    input_norm_in_projection = True  # the norm before it may run in the projection before that (Projected)

    def __init__(self, dims: LayerDims, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or dims.intermediate_size  # another width: an MoE's shared expert
        self.gate_up_proj = PackedLinear(dims.hidden_size, {"gate_proj": width, "up_proj": width})
        self.down_proj = Linear(width, dims.hidden_size, bias=False)

    def forward(self, x) -> Projected:
        return self.down_proj.deferred(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block (HF names); the target and the drafter differ only in the
    attention module they pass in (Qwen3.5 layers also in their norm, and route `attend`), and
    a mixture-of-experts target in its `mlp` (models/moe.py)."""

    def __init__(self, dims: LayerDims, self_attn: nn.Module | None, norm: type[nn.Module] = RMSNorm,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = norm(dims.hidden_size, dims.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = norm(dims.hidden_size, dims.rms_norm_eps)
        self.mlp = mlp or MLP(dims)

    def attend(self, h, *attention_args):
        """The attention block on the normed input (a layer with another kind overrides it)."""
        return self.self_attn(h, *attention_args)

    def forward(self, x, mlp_out, *attention_args, packing: Packing | None = None):
        """x: the fp32 residual stream [bs, T, H] still without the previous layer's MLP output
        `mlp_out` (None before the first layer): that add is fused into this layer's input
        norm, which saves a kernel per layer. Returns (x, this layer's MLP output), likewise
        left for the caller to add (`RMSNorm.add_and_norm` or `x + value(mlp_out)`). The
        attention and the MLP may return their last projection not applied (Projected): the
        norm after each applies it. With `packing`, x and mlp_out are the pass's real tokens as
        one row, and only the mixer sees the rows."""
        if mlp_out is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, mlp_out)
        if packing is None:
            mixed = self.attend(h, *attention_args)
        else:
            mixed = packing.pack(value(self.attend(packing.unpack(h), *attention_args)))
        if not self.mlp.input_norm_in_projection:
            mixed = value(mixed)
        x, h = self.post_attention_layernorm.add_and_norm(x, mixed)
        return x, self.mlp(h)


def run_layers(layers: nn.ModuleList, final_norm: nn.Module, x: torch.Tensor, attention_args: tuple,
               taps: tuple[int, ...], packing: Packing | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 residual stream x through a target's layers -> (final hidden, taps [.., K*H] or
    None) in the batch's rows; x is packed already where `packing` is given."""
    tapped, mlp_out = [], None
    for i, layer in enumerate(layers):
        x, mlp_out = layer(x, mlp_out, *attention_args, packing=packing)
        # A tap id names the layer whose *output* is taken: here, right after layer i.
        # (In HF `output_hidden_states` terms that is hidden_states[i + 1].)
        if i in taps:
            mlp_out = value(mlp_out)
            tapped.append(x + mlp_out)
    tapped = [tapped[sorted(set(taps)).index(t)] for t in taps]  # back to the config's order
    hidden, tapped = final_norm.add_and_norm(x, mlp_out)[1], (torch.cat(tapped, dim=-1) if taps else None)
    if packing is None:
        return hidden, tapped
    return packing.unpack(hidden), (None if tapped is None else packing.unpack(tapped))
