"""The sparse MLP of the mixture-of-experts targets (Qwen3 MoE, Qwen3.5/3.6 MoE), HF names.

Per token, the router (`gate`) scores every expert; the top k are run and their outputs
summed with the routing weights (ops.moe_route: as transformers computes them). Qwen3.5 MoE
adds a shared expert that every token runs, scaled by a sigmoid gate of its own.

The routed experts are packed per layer, as the fused kernel reads them: gate_up_proj
[E, 2I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I], the layout
transformers uses for Qwen3.5 MoE checkpoints; checkpoints with one tensor per expert
(`experts.{e}.gate_proj.weight`, Qwen3 MoE) are stacked into it at load (weights.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt import ops
from dflash_trt.config import LayerDims, MoEDims
from dflash_trt.models.layers import MLP, Linear


class Experts(nn.Module):
    """All routed experts of one layer (HF `mlp.experts`)."""

    def __init__(self, num_experts: int, hidden_size: int, expert_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * expert_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, expert_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, dims: LayerDims, moe: MoEDims):
        super().__init__()
        self.moe = moe
        self.gate = Linear(dims.hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = Experts(moe.num_experts, dims.hidden_size, moe.expert_size)
        if moe.shared_expert_size:
            self.shared_expert = MLP(dims, moe.shared_expert_size)
            self.shared_expert_gate = Linear(dims.hidden_size, 1, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [bs, T, H] (normed, model dtype) -> [bs, T, H] in the model dtype."""
        x = h.flatten(0, 1)
        weights, ids = ops.moe_route(self.gate(x), self.moe.top_k, self.moe.norm_topk_prob)
        out = ops.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)  # fp32
        if self.moe.shared_expert_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)).float() * self.shared_expert(x).float()
        return out.to(h.dtype).unflatten(0, h.shape[:2])


def feed_forward(dims: LayerDims, moe: MoEDims | None, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: sparse where the config says so, else dense."""
    if moe is not None and layer in moe.sparse_layers:
        return SparseMoeBlock(dims, moe)
    return MLP(dims)
