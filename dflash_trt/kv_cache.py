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

from dataclasses import dataclass, replace

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
    host_num_tokens: tuple[int, ...] | None = None  # num_tokens as the host knows them (Batch.make)

    @classmethod
    def make(cls, slots: list[int], start: list[int], num_tokens: list[int], width: int, device) -> "Batch":
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        s = as_tensor(start)
        return cls(slots=as_tensor(slots), start=s, num_tokens=as_tensor(num_tokens),
                   positions=s[:, None] + torch.arange(width, device=device), width=width,
                   max_end=max(a + b for a, b in zip(start, num_tokens)), full_rows=set(num_tokens) == {width},
                   host_num_tokens=tuple(num_tokens))

    @classmethod
    def full(cls, slots: torch.Tensor, start: torch.Tensor, width: int, max_end: int) -> "Batch":
        """Every row carries `width` tokens; built from device tensors without a host sync."""
        return replace(cls.padded(slots, start, torch.full_like(start, width), width, max_end), full_rows=True)

    @classmethod
    def padded(cls, slots: torch.Tensor, start: torch.Tensor, num_tokens: torch.Tensor, width: int,
               max_end: int) -> "Batch":
        """Row i carries num_tokens[i] <= width tokens, the rest padding; all on the device (a
        graph's prefill, whose prompt lengths change from replay to replay)."""
        return cls(slots=slots, start=start, num_tokens=num_tokens,
                   positions=start[:, None] + torch.arange(width, device=start.device), width=width, max_end=max_end)

    @property
    def size(self) -> int:
        return self.slots.shape[0]

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slot and position of every token, flattened to [bs * width] int32."""
        return (self.slots[:, None].expand_as(self.positions).flatten().int(), self.positions.flatten().int())

    def packing(self) -> "Packing | None":
        """The pass's real tokens packed into one row, where it has padding the host knows
        of (a prefill of prompts of several lengths); None otherwise (decode passes, graphs)."""
        counts = self.host_num_tokens
        if self.full_rows or counts is None or sum(counts) == self.size * self.width:
            return None
        real = torch.arange(self.width) < torch.tensor(counts)[:, None]  # on the host: no sync
        index = real.flatten().nonzero()[:, 0]
        return Packing(index.to(self.slots.device), self.size, self.width)


@dataclass(frozen=True)
class Packing:
    """A padded pass's real tokens as one row [1, N]. The token-wise work of a layer (its norms,
    its MLP or experts, the residual stream) runs on that row and skips the padding, a share of
    a prefill's matmuls as large as the share of padding in its rows; the mixers, which need each
    sequence as a row (attention, the recurrence), unpack to the padded rows and back."""

    index: torch.Tensor  # [N] long: row * width + t of each real token, in row order
    size: int
    width: int

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[bs, width, ...] -> [1, N, ...]"""
        return x.flatten(0, 1).index_select(0, self.index).unsqueeze(0)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] -> [bs, width, ...], the padding zeros (finite: a kernel that multiplies a
        masked-out key's value by 0 must not meet NaN there)."""
        out = x.new_zeros(self.size * self.width, *x.shape[2:])
        return out.index_copy_(0, self.index, x[0]).unflatten(0, (self.size, self.width))


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, capacity: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, num_slots, capacity, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    def layer(self, layer: int, rows: tuple[torch.Tensor, torch.Tensor]):
        """(k_cache, v_cache, slot, position): what ops.qk_norm_rope writes through."""
        return self.k[layer], self.v[layer], *rows

    # The drafter reads and writes its cache through the three methods below, so that a
    # DraftWindowCache can stand in for this one.

    def write_rows(self, batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Where a pass's tokens go: (slot, row) per token, once (see Batch.token_rows)."""
        return [batch.token_rows()]

    def context(self, batch: Batch) -> "Context":
        """Where each row's context sits, in block_attention's terms: slot rows [0, start)."""
        slots, start = batch.slots.int(), batch.start.int()
        return Context(slots, start, start, batch.max_end)

    def keys(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]


@dataclass(frozen=True)
class Context:
    """block_attention's view of a pass's context: row i reads rows [0, ctx_len[i]) of cache
    entry `slots[i]` and its block sits at q_start[i]; `max_keys` bounds ctx_len + block."""

    slots: torch.Tensor  # [bs] int32
    ctx_len: torch.Tensor  # [bs] int32
    q_start: torch.Tensor  # [bs] int32
    max_keys: int


class DraftWindowCache(KVCache):
    """The drafter's cache under a draft window W (`--draft-window-size`): the drafter attends
    to the last W committed rows only, so its memory and its attention time per pass are
    bounded by W, not by the context.

    Position p is stored twice, at rows p mod R and R + p mod R of its slot (R = W + B - 1),
    so the last n <= W positions are always one run of rows [o, o + n) in position order
    (o = (start - n) mod R). The attention kernel reads that run as a whole context: it is
    given the cache with one entry per row (`keys`), entry slot * 2R + o, ctx_len n, and the
    block right after at q_start n. Masks see only position differences and RoPE is already
    in the keys, so full, causal and sliding-window layers see what they would at the
    absolute positions.

    The B - 1 rows of slack in R: a pass writes all B rows of its block (rejected ones too,
    see the module doc) at positions start .. start + B - 1; with R >= W + B - 1 these land
    on rows of positions before start + 1 - W, which the next pass no longer reads. A prefill
    writes only the last R positions of each prompt (longer ones would wrap onto their own
    rows) and no padding; the rest goes to the scratch slot, the last one, which no request
    owns.
    """

    def __init__(self, num_layers: int, num_slots: int, window: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device):
        self.window, self.ring = window, window + block_size - 1
        super().__init__(num_layers, num_slots, 2 * self.ring, num_kv_heads, head_dim, dtype, device)

    def write_rows(self, batch: Batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        end = (batch.start + batch.num_tokens)[:, None]
        keep = (batch.positions < end) & (batch.positions >= end - self.ring)
        slots = torch.where(keep, batch.slots[:, None], self.k.shape[1] - 1).flatten().int()
        rows = torch.where(keep, batch.positions % self.ring, 0).flatten().int()
        return [(slots, rows), (slots, rows + self.ring)]

    def context(self, batch: Batch) -> Context:
        n = batch.start.clamp(max=self.window)
        first = batch.slots * (2 * self.ring) + (batch.start - n) % self.ring
        n = n.int()
        return Context(first.int(), n, n, min(batch.max_end, self.window + batch.width))

    def keys(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's cache as [entries, W, Hkv, d]: entry e starts at the e-th row of the
        flat cache (a strided view: no copy)."""
        return self._rows(self.k[layer]), self._rows(self.v[layer])

    def _rows(self, cache: torch.Tensor) -> torch.Tensor:
        num_slots, _, heads, dim = cache.shape
        row = cache.stride(1)
        entries = num_slots * 2 * self.ring - self.window + 1  # every entry's W rows stay inside
        return cache.as_strided((entries, self.window, heads, dim), (row, row, cache.stride(2), cache.stride(3)))
