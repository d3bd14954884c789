"""Qwen3.5 / Qwen3.6 hybrid target: Gated DeltaNet layers and gated full attention, with
dense MLPs or, in the MoE models (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B, Qwen3.5-397B-A17B),
models/moe.py's experts with a shared expert.

HF parameter names are kept. Released checkpoints are multimodal: the text model sits under
`model.language_model.` (the loader maps it), and the vision tower (`model.visual.*`) and
the multi-token-prediction head (`mtp.*`) are not loaded: this target serves text only.

Two layer kinds, each followed by the MLP (SwiGLU or the MoE), all norms zero-centred (1 + w):
- full attention: like Qwen3 (q/k RMSNorm, GQA, causal over the KV cache) plus an output
  gate (q_proj also yields a sigmoid gate per head) and RoPE on part of each head only;
- linear attention (Gated DeltaNet, see models/gated_delta.py): a causal conv window and a
  recurrent state matrix per head, kept per slot in the cache.

Rollback. Full-attention rows roll back by length as for Qwen3. A recurrent state cannot
be cropped, so a verify pass never overwrites the committed state: it computes its outputs
from it, keeps its recurrence inputs (q, k, v and the gates of each token), and `commit`
replays the accepted tokens over the committed state in place, with the same kernel and the
same token loop, so the result is bit for bit the state the pass went through. The conv
window is small: a pass records it after each of its last S tokens and commit copies the
kept one. A one-token pass (an AR step) keeps all it runs, so it steps both in place and
its commit has nothing to do; a prefill commits all it runs and writes them directly.

Why replay rather than per-token state snapshots: snapshots write S x (value heads x dk x
dv) fp32 per linear layer and row in every verify, more than the pass's own recurrence
reads, plus a gather-and-scatter commit, and hold S times the state in memory per slot. The
replay re-runs the ~tau accepted tokens from their saved inputs (a few KB per token and
layer); its commit is graphed like the passes. The measurements that decided it are in
BENCHMARKS.md at commit 003143e, "Qwen3.5 hybrid target" (its two rollback subsections).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt import ops
from dflash_trt.config import HybridTargetConfig
from dflash_trt.kv_cache import Batch, KVCache
from dflash_trt.models.gated_delta import L2_EPS, gated_delta_rule
from dflash_trt.models.layers import (DecoderLayer, Linear, LMHead, PackedLinear, RMSNorm, Rotary, apply_rope,
                                      run_layers)
from dflash_trt.models.moe import feed_forward
from dflash_trt.ops import causal_conv1d, gated_delta_prepare, gated_delta_recurrent, paged_block_attention

log = logging.getLogger(__name__)

# How far a pass can be cut back at commit: B = 16 drafters need 16 snapshots.
DEFAULT_SNAPSHOTS = 16
# A prefill up to this many tokens wide runs the token-by-token kernel of decode passes (a
# launch or two per layer) rather than the chunked form, whose many small launches cost
# more host time than a short prompt's recurrence costs the GPU (commit bcd0b21, BENCHMARKS.md
# at that commit, "Qwen3.5 hybrid").
RECURRENT_PREFILL_TOKENS = 512


class HybridCache(KVCache):
    """K/V rows for the full-attention layers (`k`, `v`, indexed by full-layer number) and,
    for the linear-attention layers (indexed by linear-layer number):

    per slot, committed: state [Ll, slots, Hv, dk, dv] fp32 and conv [Ll, slots, K-1, C];
    per slot, conv_snapshots [Ll, slots, S, K-1, C]: the window after each of the last
    pass's last S tokens, right-aligned (index S-1 = after all its tokens);
    per row of the last decode pass (rows <= slots, width <= S), the recurrence's inputs as
    the kernel took them, fp32: replay_q, replay_k, replay_v, replay_g, replay_beta, flat
    buffers whose first Ll x rows x width tokens are that pass's inputs [Ll, rows, width, ...]
    (`replay_inputs`), so that a layer's are one contiguous block the pass writes in place.

    A decode pass of several tokens (a verify) leaves `state` as it was; commit replays the
    accepted tokens from the saved inputs (the module docstring says why, not snapshots).
    """

    def __init__(self, config: HybridTargetConfig, num_slots: int, capacity: int, num_snapshots: int, dtype, device):
        d, lin = config.dims, config.linear
        super().__init__(len(config.full_layers), num_slots, capacity, d.num_key_value_heads, d.head_dim, dtype, device)
        n, S = len(config.linear_layers), num_snapshots
        state = (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim)
        window = (lin.conv_kernel_size - 1, lin.conv_size)
        self.num_snapshots = S
        self.state = torch.zeros((n, num_slots, *state), dtype=torch.float32, device=device)
        self.conv = torch.zeros((n, num_slots, *window), dtype=dtype, device=device)
        self.conv_snapshots = torch.zeros((n, num_slots, S, *window), dtype=dtype, device=device)
        self.replay_shapes = ((lin.num_key_heads, lin.key_head_dim), (lin.num_key_heads, lin.key_head_dim),
                              (lin.num_value_heads, lin.value_head_dim), (lin.num_value_heads,), (lin.num_value_heads,))
        tokens = n * num_slots * S
        self.replay_q, self.replay_k, self.replay_v, self.replay_g, self.replay_beta = (
            torch.zeros(tokens * math.prod(shape), dtype=torch.float32, device=device) for shape in self.replay_shapes)
        # the kernel's "no snapshots" (NS = 0): a verify pass writes nothing but its output
        self.no_snapshots = torch.zeros((num_slots, 0, *state), dtype=torch.float32, device=device)

    def replay_inputs(self, rows: int, width: int) -> list[torch.Tensor]:
        """q, k, v, g, beta of a decode pass of `rows` x `width` tokens, [Ll, rows, width, ...]
        (views: layer l's are contiguous, where its pass writes them). A layer-major layout,
        so that the one kernel of commit (below) reads them all as [Ll * rows, width, ...]."""
        layers, slots = self.state.shape[:2]
        assert rows <= slots and width <= self.num_snapshots, (rows, width)
        tokens = layers * rows * width
        return [t[: tokens * math.prod(shape)].view(layers, rows, width, *shape)
                for t, shape in zip((self.replay_q, self.replay_k, self.replay_v, self.replay_g, self.replay_beta),
                                    self.replay_shapes)]

    # Commit replays every linear layer's kept tokens in one kernel launch: the layers are
    # independent, and one layer's rows alone fill few CTAs (a launch per layer left the GPU
    # mostly idle at small batch). Layer l's row b is row l * rows + b of the flattened
    # replay inputs, its state the flattened state's row l * slots + slot.

    def all_layer_rows(self, batch: Batch, num_committed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The state cache, snapshot cache (the state in place), slots, start and kept counts of
        a replay over every layer of the batch's rows."""
        layers, slots = self.state.shape[:2]
        first = torch.arange(layers, dtype=torch.int32, device=batch.slots.device) * slots  # layer l's first slot
        state = self.state.flatten(0, 1)
        return (state, state.unsqueeze(1), (first[:, None] + batch.slots[None, :].int()).flatten(),
                batch.start.int().repeat(layers), num_committed.int().repeat(layers))


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm that scales by (1 + weight): a zero weight is the identity (HF Qwen3_5RMSNorm).
    fp32 throughout, then the model dtype; one fused kernel on CUDA (ops.rms_norm)."""

    zero_centered = True


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the delta-rule output, times SiLU of the z gate (plain weight)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # RMSNorm as Qwen3's (round, then scale in the model dtype), times silu(gate) in fp32;
        # one fused kernel on CUDA (ops.gated_rms_norm), which reads the gate (z, a slice of the
        # in_proj output) in place
        return ops.gated_rms_norm(x.contiguous(), gate, self.weight, self.eps)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] channels of each head; the rest pass unchanged."""
    r = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class GatedAttention(nn.Module):
    """Full attention over the KV cache (HF `self_attn`), with a sigmoid output gate."""

    def __init__(self, config: HybridTargetConfig, cache_layer: int):
        super().__init__()
        d = self.dims = config.dims
        self.cache_layer = cache_layer  # this layer's index among the full-attention layers
        self.scale = d.head_dim ** -0.5
        # q_proj rows hold, per head, head_dim query rows then head_dim gate rows
        self.qkv_proj = PackedLinear(
            d.hidden_size, {"q_proj": 2 * d.q_size, "k_proj": d.kv_size, "v_proj": d.kv_size}, bias=d.attention_bias
        )
        self.q_norm = ZeroCenteredRMSNorm(d.head_dim, d.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d.head_dim, d.rms_norm_eps)
        self.o_proj = Linear(d.q_size, d.hidden_size, bias=d.attention_bias)

    def forward(self, x, cos, sin, lengths, batch: Batch, cache: HybridCache):
        d = self.dims
        bs, T = x.shape[:2]
        slots, end, start, _, rows = lengths
        qkv = self.qkv_proj(x)
        # one kernel on CUDA: both zero-centred norms, RoPE on the first rotary_dim channels
        # (apply_partial_rope), k and v straight into the cache
        q, _, _ = ops.qk_norm_rope(qkv.flatten(0, 1), d.num_attention_heads, d.num_key_value_heads,
                                   self.q_norm.weight, self.k_norm.weight, d.rms_norm_eps, cos.flatten(0, 1),
                                   sin.flatten(0, 1), *cache.layer(self.cache_layer, rows), zero_centered=True,
                                   rotary_dim=cos.shape[-1], q_gate=True)
        gate = qkv[..., :2 * d.q_size].unflatten(-1, (d.num_attention_heads, 2 * d.head_dim))[..., d.head_dim:]
        out = paged_block_attention(q.unflatten(0, (bs, T)), cache.k[self.cache_layer], cache.v[self.cache_layer],
                                    slots, end, start, causal=True, scale=self.scale, max_keys=batch.max_end,
                                    fa3_ok=batch.full_rows)
        # one kernel on CUDA reads the gate where the projection left it (ops.sigmoid_gate)
        return self.o_proj.deferred(ops.sigmoid_gate(out, gate).flatten(2))


class GatedDeltaNet(nn.Module):
    """Linear attention (HF `linear_attn`): conv window + delta-rule state per slot."""

    def __init__(self, config: HybridTargetConfig, cache_layer: int):
        super().__init__()
        lin = self.lin = config.linear
        self.cache_layer = cache_layer  # this layer's index among the linear-attention layers
        H = config.dims.hidden_size
        self.in_proj = PackedLinear(H, {"in_proj_qkv": lin.conv_size, "in_proj_z": lin.value_size,
                                        "in_proj_b": lin.num_value_heads, "in_proj_a": lin.num_value_heads})
        # depthwise over the q|k|v channels; only its weight [C, 1, K] is used
        self.conv1d = nn.Conv1d(lin.conv_size, lin.conv_size, lin.conv_kernel_size, groups=lin.conv_size, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(lin.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(lin.num_value_heads))
        self.norm = GatedRMSNorm(lin.value_head_dim, config.dims.rms_norm_eps)
        self.out_proj = Linear(lin.value_size, H, bias=False)
        self._constants = None

    def _decay_constants(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(-exp(A_log), dt_bias) in fp32: functions of the weights alone, made once rather
        than in every pass (four kernels a layer). Keyed by the weights' storage, so a reload
        or a move to another device makes them again."""
        key = (self.A_log.data_ptr(), self.dt_bias.data_ptr(), self.A_log.device)
        if self._constants is None or self._constants[0] != key:
            self._constants = key, (-self.A_log.float().exp(), self.dt_bias.float())
        return self._constants[1]

    def _conv(self, qkv, batch: Batch, cache: HybridCache, lengths, to_cache: bool) -> torch.Tensor:
        """The causal conv + SiLU over the pass, continuing each row's committed window (a
        sequence starting at 0 from zeros, whatever an earlier occupant of the slot left);
        the window after the pass goes to the cache (to_cache), else the one after each of
        its last S tokens to the snapshots, for commit."""
        layer, S = self.cache_layer, cache.num_snapshots
        weight = self.conv1d.weight[:, 0]
        snapshots = None if to_cache else cache.conv_snapshots[layer]
        if to_cache or (batch.full_rows and batch.width <= S):
            # one kernel on CUDA: any width to the cache (padded rows each keep the window after
            # their own tokens), the snapshots of a verify of any width
            slots, _, start, num_tokens, _ = lengths
            return ops.causal_conv(qkv, weight, cache.conv[layer], snapshots, slots, start,
                                   None if batch.full_rows else num_tokens)
        # ragged rows kept for a commit (a packed prefill of short prompts): torch, said on CUDA
        ops.log_fallback("causal_conv of ragged rows with snapshots", qkv)
        window = cache.conv[layer, batch.slots].masked_fill((batch.start == 0)[:, None, None], 0)
        qkv, snapshots[batch.slots] = causal_conv1d(qkv, window, weight, batch.num_tokens, S, batch.full_rows)
        return qkv

    def forward(self, x, batch: Batch, cache: HybridCache, lengths):
        """`lengths`: (slots, end, start, num_tokens) of the batch as int32, made once per pass,
        and the cache slot and position of each token (Batch.token_rows, for attention layers)."""
        lin, layer, S = self.lin, self.cache_layer, cache.num_snapshots
        qkv, z, b, a = self.in_proj(x).split(
            [lin.conv_size, lin.value_size, lin.num_value_heads, lin.num_value_heads], dim=-1)
        # A one-token pass (an AR step) is never cut back: it steps the committed window and
        # state in place. A prefill (wider than S) commits all its tokens: its window and state
        # go straight to the cache. A verify keeps the window after each of its tokens.
        prefill = batch.width > S
        in_place = batch.width == 1 or (prefill and batch.width <= RECURRENT_PREFILL_TOKENS)
        qkv = self._conv(qkv, batch, cache, lengths, in_place or prefill)
        neg_a, dt_bias = self._decay_constants()
        if batch.width == 1:  # an AR step: the recurrence's inputs, its step and the gated norm in one op
            slots, _, start, num_tokens, _ = lengths
            out = ops.gated_delta_step(qkv, a, b, z.unflatten(-1, (lin.num_value_heads, lin.value_head_dim)), neg_a,
                                       dt_bias, self.norm.weight, self.norm.eps, L2_EPS, lin.key_head_dim**-0.5,
                                       cache.state[layer], slots, start, num_tokens, lin.num_key_heads)
            return self.out_proj.deferred(out.flatten(2))
        if not prefill or in_place:
            # The recurrence's inputs in one kernel on CUDA (normalised q/k, v, gates, all fp32);
            # the state is read from the cache in place, never gathered. An AR step or a short
            # prefill writes the new state over it; a verify writes nothing and saves its
            # inputs, from which commit replays the accepted tokens.
            slots, _, start, num_tokens, _ = lengths
            kept = None if in_place else [t[layer] for t in cache.replay_inputs(*x.shape[:2])]
            inputs = gated_delta_prepare(qkv, a, b, neg_a, dt_bias, lin.num_key_heads, lin.key_head_dim,
                                         lin.value_head_dim, L2_EPS, lin.key_head_dim**-0.5, out=kept)
            written = cache.state[layer].unsqueeze(1) if in_place else cache.no_snapshots
            out = gated_delta_recurrent(*inputs, cache.state[layer], written, slots, start, num_tokens, x.dtype)
        else:  # a long prefill: the chunked form (fla on CUDA); only the final state is kept
            q, k, v = qkv.split([lin.key_size, lin.key_size, lin.value_size], dim=-1)
            q = q.unflatten(-1, (lin.num_key_heads, lin.key_head_dim))
            k = k.unflatten(-1, (lin.num_key_heads, lin.key_head_dim))
            v = v.unflatten(-1, (lin.num_value_heads, lin.value_head_dim))
            g = neg_a * F.softplus(a + dt_bias)  # log decay <= 0, fp32 (a is promoted)
            state = cache.state[layer, batch.slots].masked_fill((batch.start == 0)[:, None, None, None], 0)
            out, final = gated_delta_rule(q, k, v, g, b.float().sigmoid(), state, batch.num_tokens, 1,
                                          batch.host_num_tokens)
            cache.state[layer, batch.slots] = final[:, 0]

        out = self.norm(out, z.unflatten(-1, (lin.num_value_heads, lin.value_head_dim)))
        return self.out_proj.deferred(out.flatten(2))


class HybridDecoderLayer(DecoderLayer):
    """layers.DecoderLayer (the residual adds fused into the norms) with zero-centred norms,
    whose attention is Gated DeltaNet (`linear_attn`) or gated full attention (`self_attn`),
    as the config's layer kind says."""

    def __init__(self, config: HybridTargetConfig, layer: int, cache_layer: int):
        linear = config.layer_types[layer] == "linear_attention"
        super().__init__(config.dims, None if linear else GatedAttention(config, cache_layer), ZeroCenteredRMSNorm,
                         feed_forward(config.dims, config.moe, layer))
        self.linear_attn = GatedDeltaNet(config, cache_layer) if linear else None

    def attend(self, h, cos, sin, lengths, batch: Batch, cache: HybridCache):
        if self.linear_attn is not None:
            return self.linear_attn(h, batch, cache, lengths)
        return self.self_attn(h, cos, sin, lengths, batch, cache)


class Qwen3_5Model(nn.Module):
    def __init__(self, config: HybridTargetConfig):
        super().__init__()
        d = config.dims
        self.embed_tokens = nn.Embedding(config.vocab_size, d.hidden_size)
        # each layer's index within its kind picks its rows of the cache
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i, config.layer_types[:i].count(kind))
            for i, kind in enumerate(config.layer_types)
        )
        self.norm = ZeroCenteredRMSNorm(d.hidden_size, d.rms_norm_eps)
        self.rotary = Rotary(config.rotary_dim, d.rope_theta, d.rope_yarn)  # partial: only rotary_dim channels turn

    def forward(self, input_ids, batch: Batch, cache: HybridCache, taps: tuple[int, ...] = ()):
        """input_ids [bs, width] -> (final hidden [bs, width, H], taps [bs, width, K*H] or None)."""
        packing = batch.packing()  # a ragged prefill: the token-wise work skips the padding
        # fp32 residual stream, as in the Qwen3 target
        x = self.embed_tokens(input_ids if packing is None else packing.pack(input_ids)).float()
        cos, sin = self.rotary(batch.positions, self.embed_tokens.weight.dtype)
        # once per pass: lengths for attention and the recurrence, slot/position of each token for cache writes
        lengths = (batch.slots.int(), (batch.start + batch.num_tokens).int(), batch.start.int(), batch.num_tokens.int(),
                   batch.token_rows())
        return run_layers(self.layers, self.norm, x, (cos, sin, lengths, batch, cache), taps, packing)


class Qwen3_5ForCausalLM(nn.Module):
    config_class = HybridTargetConfig
    stateful = True  # recurrent state: commit() restores the accepted prefix's snapshot
    # Decode passes (width <= snapshots) read no device value on the host and run the gated
    # delta rule on the cache in place; only a prefill's chunked head (gated_delta.py) reads
    # one, so only prefills that take the recurrence may be graphed.
    graph_safe = True

    @property
    def graph_prefill_tokens(self) -> int:
        return RECURRENT_PREFILL_TOKENS

    def __init__(self, config: HybridTargetConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3_5Model(config)
        self.lm_head = LMHead(config.dims.hidden_size, config.vocab_size, bias=False)
        if config.has_vision:
            log.warning("this Qwen3.5 checkpoint has a vision tower; dflash-trt serves text only, "
                        "so images and videos are not served and the vision weights are not loaded")

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, batch: Batch, cache: HybridCache, taps: tuple[int, ...] = ()):
        return self.model(input_ids, batch, cache, taps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def commit(self, cache: HybridCache, batch: Batch, num_committed: torch.Tensor | list[int]) -> None:
        """Set each row's linear-attention state to the state after its first num_committed[i]
        tokens of the last pass; attention rows past that are ignored and overwritten later."""
        if batch.width == 1:
            return  # a one-token pass stepped the state in place (GatedDeltaNet.forward)
        S = cache.num_snapshots
        if batch.width > S:  # a prefill: it wrote its final state and window, so only a
            # full commit is possible (checked on the host; a graphed prefill skips the check)
            kept = torch.as_tensor(num_committed, device=batch.num_tokens.device)
            assert torch.equal(kept, batch.num_tokens), (
                f"a pass wider than {S} tokens (a prefill) commits all its tokens, "
                f"asked to keep {kept.tolist()} of {batch.num_tokens.tolist()}")
            return
        num_committed = torch.as_tensor(num_committed, device=batch.slots.device)  # a host list: one copy
        replay = [t.flatten(0, 1) for t in cache.replay_inputs(batch.slots.shape[0], batch.width)]
        gated_delta_recurrent(*replay, *cache.all_layer_rows(batch, num_committed), outputs=False)
        dropped = batch.num_tokens - num_committed  # 0 <= dropped < num_tokens, by the engine
        cache.conv[:, batch.slots] = cache.conv_snapshots[:, batch.slots, S - 1 - dropped]

    def new_cache(self, num_slots: int, capacity: int, num_snapshots: int = DEFAULT_SNAPSHOTS,
                  device=None) -> HybridCache:
        """`num_snapshots` bounds how far commit can cut a pass back: at least the block size."""
        w = self.lm_head.weight
        return HybridCache(self.config, num_slots, capacity, num_snapshots, w.dtype, device or w.device)
