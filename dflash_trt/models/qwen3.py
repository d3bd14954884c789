"""Qwen3 target, dense or mixture of experts (Qwen3 MoE: the MLP of the config's sparse
layers is models/moe.py's). HF parameter names are kept, so checkpoints load as they are.

The forward pass writes K/V for the batch's tokens into the cache, attends causally over
the slot's cache rows, and also returns the residual stream after the requested layers
(the drafter's taps).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.config import LayerDims, TargetConfig
from dflash_trt.kv_cache import Batch, KVCache
from dflash_trt.models.layers import AttentionProjections, DecoderLayer, LMHead, RMSNorm, Rotary, run_layers
from dflash_trt.models.moe import feed_forward
from dflash_trt.ops import paged_block_attention


class Qwen3Attention(AttentionProjections):
    def __init__(self, dims: LayerDims, layer_idx: int):
        super().__init__(dims)
        self.layer_idx = layer_idx

    def forward(self, x, cos, sin, lengths, batch: Batch, cache: KVCache):
        slots, end, start, rows = lengths
        q, _, _ = self.qkv(x, cos, sin, cache.layer(self.layer_idx, rows))  # k, v go to the cache
        # keys: the slot's cache rows [0, start + num_tokens), the new ones included; causal
        out = paged_block_attention(q, cache.k[self.layer_idx], cache.v[self.layer_idx], slots, end, start,
                                    causal=True, scale=self.scale, max_keys=batch.max_end,
                                    fa3_ok=batch.full_rows)
        return self.o_proj.deferred(out.flatten(2))


class Qwen3Model(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        dims = config.dims
        self.embed_tokens = nn.Embedding(config.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(dims, Qwen3Attention(dims, i), mlp=feed_forward(dims, config.moe, i))
                                    for i in range(dims.num_hidden_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.rotary = Rotary(dims.head_dim, dims.rope_theta, dims.rope_yarn)

    def forward(self, input_ids, batch: Batch, cache: KVCache, taps: tuple[int, ...] = ()):
        """input_ids [bs, width] -> (final hidden [bs, width, H], taps [bs, width, K*H] or None)."""
        # The residual stream stays fp32 even for bf16 weights: rounding it to bf16 after
        # every layer is the largest source of bf16 noise, and that noise decides greedy
        # near-ties differently for a verify block than for one-token AR steps.
        packing = batch.packing()  # a ragged prefill: the token-wise work skips the padding
        x = self.embed_tokens(input_ids if packing is None else packing.pack(input_ids)).float()
        cos, sin = self.rotary(batch.positions, self.embed_tokens.weight.dtype)
        # once per pass: lengths for attention, slot/position of each token for cache writes
        lengths = (batch.slots.int(), (batch.start + batch.num_tokens).int(), batch.start.int(), batch.token_rows())
        return run_layers(self.layers, self.norm, x, (cos, sin, lengths, batch, cache), taps, packing)


class Qwen3ForCausalLM(nn.Module):
    config_class = TargetConfig
    graph_safe = True  # no host sync in a pass: decode passes may run as CUDA graphs
    stateful = False  # rollback is by length alone: commit() has nothing to do
    graph_prefill_tokens = 1 << 30  # a prefill of any width reads no device value on the host either

    def __init__(self, config: TargetConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = LMHead(config.dims.hidden_size, config.vocab_size, bias=False)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, batch: Batch, cache: KVCache, taps: tuple[int, ...] = ()):
        return self.model(input_ids, batch, cache, taps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def commit(self, cache: KVCache, batch: Batch, num_committed: torch.Tensor) -> None:
        """Rows past a sequence's committed length are ignored and overwritten later."""

    def new_cache(self, num_slots: int, capacity: int, device=None) -> KVCache:
        d, w = self.config.dims, self.lm_head.weight
        return KVCache(d.num_hidden_layers, num_slots, capacity, d.num_key_value_heads, d.head_dim, w.dtype,
                       device or w.device)
