"""Tensor parallelism over torch.distributed (Megatron-style), applied to loaded models.

`shard(target, drafter)` turns a rank's full copy of a Qwen3 target and its drafter into that
rank's shard, in place, so the model files never mention parallelism:
- attention: each rank keeps its slice of the query heads and the matching KV heads (KV heads
  are replicated when there are fewer than ranks), and o_proj's matching input columns; the
  partial outputs of o_proj are summed over the ranks (one all-reduce);
- MLP: gate/up's slice of the intermediate rows, down_proj's matching columns, one all-reduce;
- embedding: vocabulary-parallel (each rank looks up its rows, the rest are zeros, all-reduce);
- LM head: vocabulary-parallel, its logits gathered, so argmax and sampling see the whole
  vocabulary exactly as on one device;
- the drafter on the same group, the same way (its fc and norms are small and replicated).
The configs (and so the caches) take the per-rank head counts.

Only dense Qwen3 targets so far: Qwen3.5 hybrids and MoE targets are refused by name.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dflash_trt.config import LayerDims
from dflash_trt.errors import ConfigError
from dflash_trt.models.layers import MLP, AttentionProjections


@dataclasses.dataclass(frozen=True)
class Group:
    rank: int
    size: int

    @classmethod
    def current(cls) -> "Group":
        return cls(dist.get_rank(), dist.get_world_size())


def shard(target: nn.Module, drafter: nn.Module | None, group: Group | None = None) -> None:
    """Shard a loaded target (and drafter, bound to it) for this rank of the default process group."""
    group = group or Group.current()
    if group.size == 1:
        return
    check_supported(target.config, group.size)
    target.config = dataclasses.replace(target.config, dims=_local_dims(target.config.dims, group))
    _shard_layers(target.model.layers, group)
    embed = VocabParallelEmbedding(target.model.embed_tokens.weight, group)
    _shard_lm_head(target.lm_head, group)
    target.model.embed_tokens = embed
    if drafter is not None:
        drafter.config = dataclasses.replace(drafter.config, dims=_local_dims(drafter.config.dims, group))
        _shard_layers(drafter.layers, group)
        drafter.bind(target)


def check_supported(config, size: int) -> None:
    kind = getattr(config, "model_type", "qwen3")
    if kind != "qwen3" or getattr(config, "moe", None) is not None:
        raise ConfigError(f"tensor parallelism supports dense Qwen3 targets so far, not {kind!r}"
                          + (" with experts" if getattr(config, "moe", None) is not None else ""))
    d = config.dims
    for name, value in (("num_attention_heads", d.num_attention_heads), ("intermediate_size", d.intermediate_size)):
        if value % size:
            raise ConfigError(f"{name} = {value} does not split over {size} ranks")
    kv = d.num_key_value_heads
    if kv % size and size % kv:
        raise ConfigError(f"num_key_value_heads = {kv} neither splits over nor replicates onto {size} ranks")


def _local_dims(d: LayerDims, g: Group) -> LayerDims:
    return dataclasses.replace(d, num_attention_heads=d.num_attention_heads // g.size,
                               num_key_value_heads=max(d.num_key_value_heads // g.size, 1),
                               intermediate_size=d.intermediate_size // g.size)


def _kv_heads(d: LayerDims, g: Group) -> tuple[int, int]:
    """(first KV head, count) this rank keeps: its share, or the one head its queries read."""
    if d.num_key_value_heads >= g.size:
        n = d.num_key_value_heads // g.size
        return g.rank * n, n
    return g.rank * d.num_key_value_heads // g.size, 1


def _shard_layers(layers: nn.ModuleList, g: Group) -> None:
    for layer in layers:
        _shard_attention(layer.self_attn, g)
        _shard_mlp(layer.mlp, g)


def _shard_attention(attn: AttentionProjections, g: Group) -> None:
    d, hd = attn.dims, attn.dims.head_dim
    q_heads = d.num_attention_heads // g.size
    kv_first, kv_count = _kv_heads(d, g)
    q = slice(g.rank * q_heads * hd, (g.rank + 1) * q_heads * hd)
    kv = slice(kv_first * hd, (kv_first + kv_count) * hd)
    _keep_rows(attn.qkv_proj, [(0, q), (d.q_size, kv), (d.q_size + d.kv_size, kv)])
    _keep_columns(attn.o_proj, q)
    attn.dims = _local_dims(d, g)
    attn.o_proj.register_forward_hook(_sum_over_ranks)


def _shard_mlp(mlp: nn.Module, g: Group) -> None:
    if not isinstance(mlp, MLP):
        raise ConfigError(f"tensor parallelism cannot shard a {type(mlp).__name__} MLP yet")
    width = mlp.down_proj.weight.shape[1]
    n = width // g.size
    own = slice(g.rank * n, (g.rank + 1) * n)
    _keep_rows(mlp.gate_up_proj, [(0, own), (width, own)])
    _keep_columns(mlp.down_proj, own)
    mlp.down_proj.register_forward_hook(_sum_over_ranks)


def _keep_rows(linear: nn.Linear, parts: list[tuple[int, slice]]) -> None:
    """Keep, of each stacked part starting at row `offset`, the rows of its slice."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[offset + s.start:offset + s.stop] for offset, s in parts]).contiguous()
    linear.weight = nn.Parameter(take(linear.weight.data), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(take(linear.bias.data), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: nn.Linear, own: slice) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, own].contiguous(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]


def _sum_over_ranks(module, inputs, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)
    return output


def _vocab_slice(vocab: int, g: Group) -> slice:
    per = -(-vocab // g.size)  # the last rank's rows may be fewer
    return slice(min(g.rank * per, vocab), min((g.rank + 1) * per, vocab))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; a token outside them looks up zeros, and the
    ranks' lookups are summed."""

    def __init__(self, weight: torch.Tensor, g: Group):
        super().__init__()
        self.vocab = _vocab_slice(weight.shape[0], g)
        self.weight = nn.Parameter(weight.data[self.vocab].contiguous(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[..., None]
        dist.all_reduce(out)
        return out


def _shard_lm_head(head: nn.Linear, g: Group) -> None:
    vocab = head.weight.shape[0]
    per = -(-vocab // g.size)
    own = _vocab_slice(vocab, g)
    head.weight = nn.Parameter(head.weight.data[own].contiguous(), requires_grad=False)
    head.out_features = head.weight.shape[0]

    def gather(module, inputs, logits: torch.Tensor) -> torch.Tensor:
        # equal sizes for all_gather: the last rank pads, the padding is cut after
        padded = F.pad(logits, (0, per - logits.shape[-1]))
        parts = [torch.empty_like(padded) for _ in range(g.size)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab]

    head.register_forward_hook(gather)
