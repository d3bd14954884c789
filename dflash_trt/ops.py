"""Custom ops: asserting wrappers with a pure-PyTorch reference for each.

The reference is the CPU path and the test oracle; CUDA kernels (plugins/) slot in behind
the same signatures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    """[bs, T, L] bool, True where query t may attend key l.

    q_pos [bs, T] and k_pos [bs, L] are absolute positions; k_valid [bs, L] marks keys that
    hold real data (cache rows past a sequence's length are stale). `causal` means key
    position <= query position; `window` keeps keys with position > query - window (the
    Qwen3 / SpecForge sliding-window convention).
    """
    mask = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    if causal:
        mask = mask & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        mask = mask & (k_pos[:, None, :] > q_pos[:, :, None] - window)
    return mask


def block_attention_reference(q, k, v, mask, scale):
    """q [bs, T, Hq, d], k/v [bs, L, Hkv, d], mask [bs, T, L] -> [bs, T, Hq * d]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=True,
    )  # [bs, Hq, T, d]
    return out.transpose(1, 2).flatten(2)


def block_attention(q, k, v, mask, scale):
    assert q.dim() == 4 and k.dim() == 4 and k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3], (q.shape, k.shape)
    assert q.shape[2] % k.shape[2] == 0, f"query heads {q.shape[2]} not a multiple of kv heads {k.shape[2]}"
    assert mask.dtype == torch.bool and mask.shape == (q.shape[0], q.shape[1], k.shape[1]), mask.shape
    return block_attention_reference(q, k, v, mask, scale)
