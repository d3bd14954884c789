"""Gated DeltaNet math (the linear-attention layers of Qwen3.5/3.6), with state snapshots.

Per value head the layer keeps a state matrix S [dk, dv] and, for token t,

    S <- exp(g_t) * S                            decay (g_t <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T    delta rule: write only what S mispredicts
    o_t = S^T q_t

with q, k L2-normalised and q scaled by dk^-1/2. Before that, q, k and v pass through a
depthwise causal conv (kernel K, SiLU) whose window is the previous K-1 inputs.

A pass over T tokens never overwrites the state it starts from. It may record *snapshots*:
the state (and conv window) after each of the row's last S tokens, right-aligned, so index
S-1-d holds the state after `num_tokens - d` tokens. Rows are ragged: tokens at
t >= num_tokens are padding, never snapshotted.

Two entry points. A pass of at most S tokens (decode, verify) runs ops.gated_delta_recurrent
on the inputs ops.gated_delta_prepare makes from the projections: it reads the committed state from the cache in place
(plugins/gated_delta.cu on CUDA, no gathered copy) and writes at most one state, the new one
of an AR step; the model rolls a verify back by replaying its accepted tokens (models/
qwen3_5.py). A wider pass (a prefill) runs `gated_delta_rule` on a gathered state and
returns its final state; on CUDA its head runs through flash-linear-attention's chunked
kernel when `fla` is installed (tested on the GPU with fla-core 0.6.0), and the rest (or,
without fla, all of it) through the same recurrent kernel.

The recurrent form (`ops.gated_delta_rule_reference`) is the reference: the CPU path of
both entry points and the test oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dflash_trt.ops import gated_delta_recurrent

L2_EPS = 1e-6  # of the q/k L2 norm, inside the root, as fla and transformers have it


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# -- the gated delta rule ---------------------------------------------------------------------


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, num_tokens: torch.Tensor, num_snapshots: int,
                     host_num_tokens: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the gated delta rule -> (out [bs, T, Hv, dv] in v's dtype, snapshots); the
    model runs it for prefills (wider than S, with S = 1: only the final state is kept).

    q, k [bs, T, Hk, dk] raw (normalised and scaled here); v [bs, T, Hv, dv]; g (log decay,
    <= 0) and beta [bs, T, Hv]; state [bs, Hv, dk, dv] fp32, read only; num_tokens [bs].
    snapshots [bs, S, Hv, dk, dv] fp32, right-aligned as the module docstring says.
    `host_num_tokens`: num_tokens known on the host, which saves the chunked path its syncs.
    """
    bs, T, Hk, dk = q.shape
    Hv, dv = v.shape[2:]
    assert k.shape == q.shape and v.shape[:2] == (bs, T) and Hv % Hk == 0, (q.shape, k.shape, v.shape)
    assert g.shape == beta.shape == (bs, T, Hv), (g.shape, beta.shape)
    assert state.shape == (bs, Hv, dk, dv) and state.dtype == torch.float32, (state.shape, state.dtype)
    assert num_tokens.shape == (bs,) and num_snapshots >= 1, (num_tokens.shape, num_snapshots)
    q = l2_normalize(q.float()) * dk**-0.5
    k = l2_normalize(k.float())
    if q.is_cuda and T > num_snapshots and _fla_chunk() is not None:
        out, snapshots = _chunked_head_then_recurrent_tail(q, k, v, g, beta, state, num_tokens, num_snapshots,
                                                           host_num_tokens)
    else:  # the recurrent kernel on CUDA (a token at a time, but one launch), else the reference
        out, snapshots = recurrent_pass(q, k, v, g, beta, state, num_tokens, num_snapshots)
    return out.to(v.dtype), snapshots


def recurrent_pass(q, k, v, g, beta, state, num_tokens, num_snapshots):
    """gated_delta_rule_reference's contract (q, k normalised and scaled) through
    ops.gated_delta_recurrent: one kernel on CUDA, the reference on the CPU. The rows' states
    serve as a cache of bs slots; snapshots a row does not reach stay zero, as there."""
    bs = q.shape[0]
    snapshots = torch.zeros((bs, num_snapshots, *state.shape[1:]), dtype=torch.float32, device=state.device)
    i32 = dict(dtype=torch.int32, device=q.device)
    # start = 1: the given states are the starting points (a new sequence's is zeros already)
    out = gated_delta_recurrent(q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                g.float().contiguous(), beta.float().contiguous(), state.float().contiguous(),
                                snapshots, torch.arange(bs, **i32), torch.ones(bs, **i32), num_tokens.to(**i32))
    return out, snapshots


# -- CUDA: flash-linear-attention for long passes ---------------------------------------------


@functools.cache
def _fla_chunk():
    """fla's chunked gated delta rule, or None where fla (or its triton) is missing."""
    try:  # fla is optional: without it, prefill runs the recurrent kernel
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # ImportError, or triton failing to initialise
        return None
    return chunk_gated_delta_rule


@dataclass(frozen=True)
class _Packing:
    """Where a prefill's tokens go between fla's packed head and the recurrent tail: index
    tensors made on the host from the rows' lengths, once per pass (every layer of a pass
    reuses them, and fla caches its chunk plan per cu_seqlens tensor), so no layer reads a
    device value on the host."""

    rows: torch.Tensor  # [n] the rows that have a head
    head_row: torch.Tensor  # per head token (packed order): its row
    head_pos: torch.Tensor  # ... and its position in the row
    cu_seqlens: torch.Tensor  # [n + 1] the heads' boundaries in the packed sequence
    cu_seqlens_cpu: torch.Tensor
    tail_index: torch.Tensor  # [bs, S] positions of the tail (clamped to the pass)
    tail_tokens: torch.Tensor  # [bs] real tokens in each row's tail
    tail_row: torch.Tensor  # per real tail token: its row ...
    tail_step: torch.Tensor  # ... its index in the tail ...
    tail_pos: torch.Tensor  # ... and its position in the row


@functools.lru_cache(maxsize=8)
def _packing(num_tokens: tuple[int, ...], width: int, num_snapshots: int, device: torch.device) -> _Packing:
    heads = [max(n - num_snapshots, 0) for n in num_tokens]
    tails = [n - h for n, h in zip(num_tokens, heads)]
    rows = [i for i, h in enumerate(heads) if h > 0]
    cu = [0]
    for i in rows:
        cu.append(cu[-1] + heads[i])
    tail = [(i, j, heads[i] + j) for i, t in enumerate(tails) for j in range(t)]
    host = dict(
        rows=rows, head_row=[i for i in rows for _ in range(heads[i])],
        head_pos=[p for i in rows for p in range(heads[i])],
        cu_seqlens=cu, tail_index=[[min(h + j, width - 1) for j in range(num_snapshots)] for h in heads],
        tail_tokens=tails, tail_row=[r for r, _, _ in tail], tail_step=[j for _, j, _ in tail],
        tail_pos=[p for _, _, p in tail])
    tensors = {k: torch.tensor(v, dtype=torch.long).pin_memory() if device.type == "cuda" else torch.tensor(v)
               for k, v in host.items()}
    on_device = {k: v.to(device, non_blocking=True) for k, v in tensors.items()}
    return _Packing(cu_seqlens_cpu=tensors["cu_seqlens"], **on_device)


def _chunked_head_then_recurrent_tail(q, k, v, g, beta, state, num_tokens, num_snapshots, host_num_tokens=None):
    """Each row's tokens before its last S run through fla's chunked kernel (packed varlen,
    final state only); the last S run through recurrent_pass, which keeps the snapshots. q and
    k come normalised and scaled. `host_num_tokens`: num_tokens as the host knows them (else
    read from the device, one sync)."""
    bs, T = q.shape[:2]
    S = num_snapshots
    plan = _packing(tuple(host_num_tokens or num_tokens.tolist()), T, S, q.device)
    out = torch.zeros((bs, T, *v.shape[2:]), dtype=torch.float32, device=v.device)
    mid_state = state.clone()
    if plan.rows.numel():
        pack = lambda x: x[plan.head_row, plan.head_pos][None]  # noqa: E731  [1, sum(heads), ...]
        # scale=1 and no in-kernel l2norm: q and k are normalised and scaled already
        o, final = _fla_chunk()(pack(q).to(v.dtype), pack(k).to(v.dtype), pack(v), pack(g).float(),
                                pack(beta).to(v.dtype), scale=1.0, initial_state=state[plan.rows].contiguous(),
                                output_final_state=True, cu_seqlens=plan.cu_seqlens,
                                cu_seqlens_cpu=plan.cu_seqlens_cpu)
        out[plan.head_row, plan.head_pos] = o[0].float()
        mid_state[plan.rows] = final.float()
    # the tail: positions head .. head + S - 1 of each row (those past num_tokens are padding)
    index = plan.tail_index
    take = lambda x: x.gather(1, index.view(bs, S, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))  # noqa: E731
    tail_out, snapshots = recurrent_pass(take(q), take(k), take(v), take(g), take(beta), mid_state,
                                         plan.tail_tokens, S)
    out[plan.tail_row, plan.tail_pos] = tail_out[plan.tail_row, plan.tail_step]
    return out, snapshots
