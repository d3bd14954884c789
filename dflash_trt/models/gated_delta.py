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

import torch
import torch.nn.functional as F

from dflash_trt.ops import gated_delta_recurrent

L2_EPS = 1e-6  # of the q/k L2 norm, inside the root, as fla and transformers have it


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# -- the gated delta rule ---------------------------------------------------------------------


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, num_tokens: torch.Tensor, num_snapshots: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the gated delta rule -> (out [bs, T, Hv, dv] in v's dtype, snapshots); the
    model runs it for prefills (wider than S, with S = 1: only the final state is kept).

    q, k [bs, T, Hk, dk] raw (normalised and scaled here); v [bs, T, Hv, dv]; g (log decay,
    <= 0) and beta [bs, T, Hv]; state [bs, Hv, dk, dv] fp32, read only; num_tokens [bs].
    snapshots [bs, S, Hv, dk, dv] fp32, right-aligned as the module docstring says.
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
        out, snapshots = _chunked_head_then_recurrent_tail(q, k, v, g, beta, state, num_tokens, num_snapshots)
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


def _chunked_head_then_recurrent_tail(q, k, v, g, beta, state, num_tokens, num_snapshots):
    """Each row's tokens before its last S run through fla's chunked kernel (packed varlen,
    final state only); the last S run through recurrent_pass, which keeps the snapshots. q and
    k come normalised and scaled."""
    bs, T = q.shape[:2]
    S = num_snapshots
    head = (num_tokens - S).clamp(min=0)  # [bs] tokens before the snapshot window
    out = torch.zeros((bs, T, *v.shape[2:]), dtype=torch.float32, device=v.device)
    mid_state = state.clone()
    rows = (head > 0).nonzero()[:, 0]
    if rows.numel():
        lengths = head[rows]
        mask = torch.arange(T, device=q.device)[None, :] < lengths[:, None]  # [n, T]
        pack = lambda x: x[rows][mask][None]  # noqa: E731  [1, sum(lengths), ...]
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).long()
        # scale=1 and no in-kernel l2norm: q and k are normalised and scaled already
        o, final = _fla_chunk()(pack(q).to(v.dtype), pack(k).to(v.dtype), pack(v), pack(g).float(),
                                pack(beta).to(v.dtype), scale=1.0, initial_state=state[rows].contiguous(),
                                output_final_state=True, cu_seqlens=cu_seqlens)
        head_out = out[rows]
        head_out[mask] = o[0].float()
        out[rows] = head_out
        mid_state[rows] = final.float()
    # the tail: positions head .. head + S - 1 of each row (those past num_tokens are padding)
    index = (head[:, None] + torch.arange(S, device=q.device)).clamp(max=T - 1)  # [bs, S]
    take = lambda x: x.gather(1, index.view(bs, S, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))  # noqa: E731
    tail_out, snapshots = recurrent_pass(take(q), take(k), take(v), take(g), take(beta), mid_state,
                                         num_tokens - head, S)
    valid = torch.arange(S, device=q.device)[None, :] < (num_tokens - head)[:, None]
    out[torch.arange(bs, device=q.device)[:, None].expand(-1, S)[valid], index[valid]] = tail_out[valid]
    return out, snapshots
