"""Preallocated KV caches and the per-step batch description.

Each sequence owns a *slot*; position p of a slot holds the K/V of the token at absolute
position p. A sequence's committed length lives in the engine, so rolling back rejected
draft tokens means keeping the old length: the stale rows are masked out and overwritten
by the next step. Nothing is ever cropped or copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    """Which slots a forward pass touches and where its tokens sit.

    Row i carries `num_tokens[i]` real tokens (the rest is padding up to `width`) at
    positions `start[i] .. start[i] + num_tokens[i] - 1`.
    """

    slots: torch.Tensor  # [bs] long
    start: torch.Tensor  # [bs] long, committed length before this pass
    num_tokens: torch.Tensor  # [bs] long
    positions: torch.Tensor  # [bs, width] long
    valid: torch.Tensor  # [bs, width] bool
    width: int
    max_start: int
    max_end: int  # max(start + num_tokens): how many cache rows a pass reads

    @classmethod
    def make(cls, slots: list[int], start: list[int], num_tokens: list[int], width: int, device) -> "Batch":
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        s, n = as_tensor(start), as_tensor(num_tokens)
        offsets = torch.arange(width, device=device)
        return cls(
            slots=as_tensor(slots), start=s, num_tokens=n,
            positions=s[:, None] + offsets, valid=offsets < n[:, None], width=width,
            max_start=max(start), max_end=max(a + b for a, b in zip(start, num_tokens)),
        )

    def with_num_tokens(self, num_tokens: torch.Tensor, max_end: int) -> "Batch":
        """The same rows keeping only their first `num_tokens` tokens (the accepted prefix)."""
        offsets = torch.arange(self.width, device=num_tokens.device)
        return Batch(self.slots, self.start, num_tokens, self.positions, offsets < num_tokens[:, None],
                     self.width, self.max_start, max_end)

    @property
    def size(self) -> int:
        return self.slots.shape[0]


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, num_slots, capacity, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    def write(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the valid rows of k/v [bs, width, Hkv, d] at their positions."""
        rows = batch.slots[:, None].expand_as(batch.positions)[batch.valid]
        cols = batch.positions[batch.valid]
        self.k[layer, rows, cols] = k[batch.valid]
        self.v[layer, rows, cols] = v[batch.valid]
