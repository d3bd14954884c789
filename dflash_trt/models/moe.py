"""The sparse MLP of the mixture-of-experts targets (Qwen3 MoE, Qwen3.5/3.6 MoE), HF names.

Per token, the router (`gate`) scores every expert; the top k are run and their outputs
summed with the routing weights (ops.moe_route: as transformers computes them). Qwen3.5 MoE
adds a shared expert that every token runs, scaled by a sigmoid gate of its own.

The routed experts are packed per layer, as the fused kernel reads them: gate_up_proj
[E, 2I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I], the layout
transformers uses for Qwen3.5 MoE checkpoints; checkpoints with one tensor per expert
(`experts.{e}.gate_proj.weight`, Qwen3 MoE) are stacked into it at load (weights.py).

A shared expert as wide as the routed ones (all Qwen3.5/3.6 MoE releases) is packed as one
expert more, index E, and its gate as one router row more (`router`: HF's `gate` and
`shared_expert_gate` stacked): every token then picks it with weight sigmoid(gate), and one
launch of the experts' kernels runs it with the routed picks, instead of a dense MLP, its gate
and the scaling and adding around them (a dozen small kernels per layer of a decode step).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dflash_trt import ops
from dflash_trt.config import LayerDims, MoEDims
from dflash_trt.models.layers import MLP, Linear, PackedLinear, RMSNorm, value


class Experts(nn.Module):
    """All routed experts of one layer (HF `mlp.experts`), and with `shared` the shared expert
    (HF `mlp.shared_expert`) as expert number `num_experts`."""

    def __init__(self, num_experts: int, hidden_size: int, expert_size: int, shared: bool = False):
        super().__init__()
        self.num_experts, self.shared = num_experts, shared
        n = num_experts + shared
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * expert_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n, hidden_size, expert_size))


class ExpertsOut(NamedTuple):
    """A block's routing and experts (a packed shared expert among them) of one token, not run
    yet: so that they and the residual add + norm after them can run as the experts' two
    kernels (RMSNorm.add_and_norm, as layers.Projected for a matmul). `value()` runs the routing
    and the experts alone."""
    h: torch.Tensor  # [bs, T, H], the block's normed input
    logits: torch.Tensor  # the router's, [bs T, E (+ 1: the shared expert's gate)]
    moe: MoEDims
    experts: Experts

    def value(self) -> torch.Tensor:
        weights, ids = ops.moe_route(self.logits, self.moe.top_k, self.moe.norm_topk_prob, shared=self.experts.shared)
        out = ops.moe_experts(self.h.flatten(0, 1), self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                              self.h.dtype, shared_last=self.experts.shared)
        return out.unflatten(0, self.h.shape[:2])

    def add_rms_norm(self, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.moe_experts_add_rms_norm(self.h.flatten(0, 1), self.experts.gate_up_proj, self.experts.down_proj,
                                            self.logits, self.moe.top_k, self.moe.norm_topk_prob, self.experts.shared,
                                            residual, norm.weight, norm.eps, norm.zero_centered,
                                            norm.ticket_on(residual.device))


class SparseMoeBlock(nn.Module):
    # The norm before this block runs as its own kernel, not in the projection before it: its
    # consumer is the small router, and with the norm in the projection the 35B-A3B's AR step
    # measured slower, the dense models' faster (BENCHMARKS.md, "GEMV").
    input_norm_in_projection = False
    # One token's norm after the block (the next layer's input norm) runs in the experts' down
    # kernel (ExpertsOut): its consumer is a large projection that loads its weights while the
    # last CTA norms; measured faster (bench/gpu_check.sh moe-norm, benchmarks/ar_b1_ab_h200.json).
    output_norm_in_experts = True

    def __init__(self, dims: LayerDims, moe: MoEDims):
        super().__init__()
        self.moe = moe
        H, E = dims.hidden_size, moe.num_experts
        # a shared expert as wide as the routed ones runs as one of them (the module docstring)
        self.packed_shared = moe.shared_expert_size == moe.expert_size
        if self.packed_shared:
            self.router = PackedLinear(H, {"gate": E, "shared_expert_gate": 1})
        else:
            self.gate = Linear(H, E, bias=False)
        self.experts = Experts(E, H, moe.expert_size, shared=self.packed_shared)
        if moe.shared_expert_size and not self.packed_shared:
            self.shared_expert = MLP(dims, moe.shared_expert_size)
            self.shared_expert_gate = Linear(H, 1, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor | ExpertsOut:
        """h [bs, T, H] (normed, model dtype) -> [bs, T, H] in the model dtype (one token with
        output_norm_in_experts: an ExpertsOut)."""
        x = h.flatten(0, 1)
        logits = ops.router_logits(x, (self.router if self.packed_shared else self.gate).weight)
        if not (self.moe.shared_expert_size and not self.packed_shared):  # the sum rounded once, by the kernel
            experts = ExpertsOut(h, logits, self.moe, self.experts)
            # not run yet only without hooks: tensor parallelism sums a tensor
            return experts if self.output_norm_in_experts and x.shape[0] == 1 and not self._forward_hooks \
                else experts.value()
        # a separate shared expert adds to the routed ones' fp32 sum, rounded once after it
        weights, ids = ops.moe_route(logits, self.moe.top_k, self.moe.norm_topk_prob)
        out = ops.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, torch.float32)
        out = out + torch.sigmoid(self.shared_expert_gate(x)).float() * value(self.shared_expert(x)).float()
        return out.to(h.dtype).unflatten(0, h.shape[:2])


def feed_forward(dims: LayerDims, moe: MoEDims | None, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: sparse where the config says so, else dense."""
    if moe is not None and layer in moe.sparse_layers:
        return SparseMoeBlock(dims, moe)
    return MLP(dims)
