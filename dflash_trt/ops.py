"""Custom ops: asserting wrappers with a pure-PyTorch reference for each.

The reference is the CPU path and the test oracle; CUDA kernels (plugins/) slot in behind
the same signatures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_block_attention_reference(q, k_cache, v_cache, slots, ctx_len, q_start, k_blk, v_blk, causal, window, scale):
    """Block attention over a KV cache, written plainly (the oracle of plugins/block_attention.cu).

    q [bs, T, Hq, d]; k_cache/v_cache [num_slots, capacity, Hkv, d] (one layer); slots,
    ctx_len, q_start [bs]. Row i's keys are cache rows [0, ctx_len[i]) of slot slots[i] (row
    p at position p), then, if k_blk/v_blk [bs, T, Hkv, d] are given, the block's T rows at
    positions q_start[i] + j. Query t sits at q_start[i] + t and sees key position kp iff
    (not causal or kp <= qp) and (no window or kp > qp - window); window None or <= 0 means
    none. Softmax in fp32; a query that sees no key gets zeros. Returns [bs, T, Hq, d] in
    q's dtype.
    """
    bs, T = q.shape[:2]
    dev = q.device
    # Cache rows [0, longest context) of every row's slot; rows past a row's own ctx_len are
    # gathered too but marked invalid.
    length = int(ctx_len.clamp(min=0).max()) if bs else 0
    k = k_cache[slots.long(), :length].float()  # [bs, L, Hkv, d]
    v = v_cache[slots.long(), :length].float()
    k_pos = torch.arange(length, device=dev).expand(bs, -1)
    k_valid = k_pos < ctx_len.long()[:, None]
    q_pos = q_start.long()[:, None] + torch.arange(T, device=dev)  # [bs, T]
    if k_blk is not None:
        k, v = torch.cat([k, k_blk.float()], 1), torch.cat([v, v_blk.float()], 1)
        k_pos = torch.cat([k_pos, q_pos], 1)
        k_valid = torch.cat([k_valid, torch.ones(bs, T, dtype=torch.bool, device=dev)], 1)
    visible = k_valid[:, None, :].expand(-1, T, -1)  # [bs, T, L]
    if causal:
        visible = visible & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None and window > 0:
        visible = visible & (k_pos[:, None, :] > q_pos[:, :, None] - window)
    # softmax(q.k * scale, masked) @ v in fp32; enable_gqa: query head h reads KV head h // G.
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=visible[:, None], scale=scale, enable_gqa=True).transpose(1, 2)
    out = out.masked_fill(~visible.any(-1)[:, :, None, None], 0.0)  # no visible key: zeros, whatever the backend
    return out.to(q.dtype)


def _cuda_block_attention_supported(q: torch.Tensor) -> bool:
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[3] not in (64, 128):
        return False
    from dflash_trt import plugins

    return plugins.load() is not None


def paged_block_attention(q, k_cache, v_cache, slots, ctx_len, q_start, k_blk=None, v_blk=None, causal=False,
                          window=None, scale=None, *, max_keys: int | None = None):
    """Block attention over a KV cache -> [bs, T, Hq, d]; semantics of the reference above.

    Runs the CUDA kernel for bf16/fp16 CUDA tensors with head_dim 64 or 128 once the plugins
    are built, else the reference (CPU, fp32, other head sizes). `max_keys` is a host-side
    upper bound on ctx_len + block length (e.g. batch.max_end); it only tunes how the kernel
    splits long contexts, and defaults to the cache capacity.
    """
    assert q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (q.shape, k_cache.shape)
    bs, T, Hq, d = q.shape
    Hkv = k_cache.shape[2]
    assert k_cache.shape[3] == d and Hq % Hkv == 0, (q.shape, k_cache.shape)
    assert k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "last dim must be contiguous"
    for name, t in (("slots", slots), ("ctx_len", ctx_len), ("q_start", q_start)):
        assert t.dtype == torch.int32 and t.shape == (bs,) and t.device == q.device, (name, t.dtype, t.shape, t.device)
    assert (k_blk is None) == (v_blk is None), "k_blk and v_blk go together"
    if k_blk is not None:
        assert k_blk.shape == v_blk.shape == (bs, T, Hkv, d), (k_blk.shape, v_blk.shape)
        assert k_blk.dtype == v_blk.dtype == q.dtype and k_blk.stride(-1) == 1 and v_blk.stride(-1) == 1
    scale = d ** -0.5 if scale is None else scale
    window = 0 if window is None else window
    if _cuda_block_attention_supported(q):
        return torch.ops.dflash.block_attention(q, k_cache, v_cache, slots, ctx_len, q_start, k_blk, v_blk,
                                                bool(causal), int(window), float(scale), int(max_keys or 0))
    return paged_block_attention_reference(q, k_cache, v_cache, slots, ctx_len, q_start, k_blk, v_blk, causal,
                                           window, scale)
