"""Preallocated KV caches and the per-step batch description.

Each sequence owns a *slot*; position p of a slot holds the K/V of the token at absolute
position p. A sequence's committed length lives in the engine, so rolling back rejected
draft tokens means keeping the old length: the stale rows are masked out and overwritten
by the next step. Nothing is ever cropped or copied.

Writes never look at which rows are real: a pass writes all `width` rows of each batch
row (padding and rejected drafts included) at positions from its committed length on.
Attention reads only rows below the committed length (plus the pass's own), and the next
pass overwrites from the committed length on, so stale rows are never seen. That keeps a
write free of data-dependent indexing, which CUDA graphs need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    """Which slots a forward pass touches and where its tokens sit.

    Row i carries `num_tokens[i]` real tokens (the rest is padding up to `width`) at
    positions `start[i] .. start[i] + num_tokens[i] - 1`. `max_end` is a host-side upper
    bound on start + num_tokens (how many cache rows a pass may read); it only tunes how
    the attention kernel splits long contexts. `full_rows`, also known on the host: every
    row carries `width` tokens (decode passes), which lets some layers skip ragged handling.
    """

    slots: torch.Tensor  # [bs] long
    start: torch.Tensor  # [bs] long, committed length before this pass
    num_tokens: torch.Tensor  # [bs] long
    positions: torch.Tensor  # [bs, width] long
    width: int
    max_end: int
    full_rows: bool = False

    @classmethod
    def make(cls, slots: list[int], start: list[int], num_tokens: list[int], width: int, device) -> "Batch":
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        s = as_tensor(start)
        return cls(slots=as_tensor(slots), start=s, num_tokens=as_tensor(num_tokens),
                   positions=s[:, None] + torch.arange(width, device=device), width=width,
                   max_end=max(a + b for a, b in zip(start, num_tokens)), full_rows=set(num_tokens) == {width})

    @classmethod
    def full(cls, slots: torch.Tensor, start: torch.Tensor, width: int, max_end: int) -> "Batch":
        """Every row carries `width` tokens; built from device tensors without a host sync."""
        return cls(slots=slots, start=start, num_tokens=torch.full_like(start, width),
                   positions=start[:, None] + torch.arange(width, device=start.device), width=width, max_end=max_end,
                   full_rows=True)

    @property
    def size(self) -> int:
        return self.slots.shape[0]

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slot and position of every token, flattened to [bs * width] int32."""
        return (self.slots[:, None].expand_as(self.positions).flatten().int(), self.positions.flatten().int())


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, num_slots, capacity, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    def layer(self, layer: int, rows: tuple[torch.Tensor, torch.Tensor]):
        """(k_cache, v_cache, slot, position): what AttentionProjections.qkv writes through."""
        return self.k[layer], self.v[layer], *rows

    def write(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [bs, width, Hkv, d] at their positions, every row (see the module doc)."""
        self.k[layer, batch.slots[:, None], batch.positions] = k
        self.v[layer, batch.slots[:, None], batch.positions] = v
