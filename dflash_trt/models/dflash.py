"""The z-lab DFlash drafter: Qwen3 layers over a block [bonus, MASK x (B-1)] that attend
to context K/V injected from the target's tapped hidden states.

Context rows (committed positions) are projected once by `append_context` and kept in the
draft cache; they never pass through q_proj, o_proj or the MLP. Block rows are computed
fresh every step and never written, so the draft side has nothing to roll back.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt import ops
from dflash_trt.config import DraftConfig, LayerDims
from dflash_trt.kv_cache import Batch, Context, DraftWindowCache, KVCache
from dflash_trt.models.layers import AttentionProjections, DecoderLayer, Linear, RMSNorm, Rotary
from dflash_trt.ops import paged_block_attention


class DFlashAttention(AttentionProjections):
    def __init__(self, dims: LayerDims, layer_idx: int, window: int | None):
        super().__init__(dims)
        self.layer_idx = layer_idx
        self.window = window  # sliding layers: causal in the block and `window` positions back

    def write_context(self, c, cos, sin, cache: KVCache, rows) -> None:
        """Context features c [bs, T, H] -> K (k_norm, RoPE) and V, written into this layer's
        draft cache at every token's slot and row (`rows`: cache.write_rows)."""
        d = self.dims
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[d.q_size:]
        kv = ops.linear(c, self.qkv_proj.weight[d.q_size:], bias).flatten(0, 1)  # one GEMM for K and V
        for where in rows:  # a draft window stores each row twice
            ops.qk_norm_rope(kv, 0, d.num_key_value_heads, None, self.k_norm.weight, d.rms_norm_eps,
                             cos.flatten(0, 1), sin.flatten(0, 1), *cache.layer(self.layer_idx, where))

    def forward(self, h, cos, sin, context: Context, batch: Batch, cache: KVCache):
        q, k, v = self.qkv(h, cos, sin)
        # keys: the row's context (cache.context) plus the block's own transient k/v right
        # after it; full layers are non-causal, sliding layers causal with a window. The rows
        # after a plain cache's context are dead (the next verify rewrites them), so FA3 may
        # append the block there; a draft window's rows are a ring stored twice.
        out = paged_block_attention(q, *cache.keys(self.layer_idx), context.slots, context.ctx_len, context.q_start,
                                    k, v, causal=self.window is not None, window=self.window, scale=self.scale,
                                    max_keys=context.max_keys, fa3_ok=not isinstance(cache, DraftWindowCache))
        return self.o_proj(out.flatten(2))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        dims = config.dims
        self.config = config
        self.fc = Linear(config.num_taps * dims.hidden_size, dims.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(dims, DFlashAttention(dims, i, window=config.sliding_window if kind == "sliding_attention" else None))
            for i, kind in enumerate(config.layer_types)
        )
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps)
        self.rotary = Rotary(dims.head_dim, dims.rope_theta, dims.rope_yarn)  # the drafter's own RoPE config
        self.vocab_ids = self.vocab_head = None  # prune_vocab: plain attributes, no state_dict entries

    def bind(self, target: nn.Module) -> None:
        """Borrow the target's embedding and LM head (DFlash ships neither).

        Set around nn.Module's registration on purpose: the weights stay the target's, with
        no second copy and no entry in the drafter's state_dict.
        """
        object.__setattr__(self, "embed_tokens", target.model.embed_tokens)
        object.__setattr__(self, "lm_head", target.lm_head)

    def append_context(self, taps: torch.Tensor, batch: Batch, cache: KVCache) -> None:
        """Project committed rows' taps [bs, width, K*H] into every layer's draft cache."""
        c = self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(batch.positions, c.dtype)
        rows = cache.write_rows(batch)
        for layer in self.layers:
            layer.self_attn.write_context(c, cos, sin, cache, rows)

    def forward(self, block_ids: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        """block_ids [bs, B] at positions start..start+B-1 -> final hidden [bs, B, H]."""
        x = self.embed_tokens(block_ids).float()  # fp32 residual stream, as in the target
        cos, sin = self.rotary(batch.positions, self.fc.weight.dtype)
        context = cache.context(batch)  # once per pass
        mlp_out = None
        for layer in self.layers:
            x, mlp_out = layer(x, mlp_out, cos, sin, context, batch, cache)
        return self.norm.add_and_norm(x, mlp_out)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def prune_vocab(self, ids: torch.Tensor) -> None:
        """Propose only these token ids: their rows of the LM head, gathered once."""
        self.vocab_ids = ids.to(self.lm_head.weight.device)
        self.vocab_head = self.lm_head.weight[self.vocab_ids]

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy proposal at each row of hidden [..., H] -> ids [...]."""
        if self.vocab_ids is None:
            return self.lm_head.argmax(hidden)
        return self.vocab_ids[ops.linear(hidden, self.vocab_head).argmax(dim=-1)]

    def new_cache(self, num_slots: int, capacity: int, device=None, window: int = 0, block_size: int = 0) -> KVCache:
        """A cache of `capacity` positions per slot, or, with a draft window W, of the last W
        committed positions (DraftWindowCache; `block_size`: the engine's)."""
        d, w = self.config.dims, self.fc.weight
        shape = (d.num_key_value_heads, d.head_dim, w.dtype, device or w.device)
        if window:
            return DraftWindowCache(len(self.layers), num_slots, window, block_size or self.config.block_size, *shape)
        return KVCache(len(self.layers), num_slots, capacity, *shape)
