"""Custom ops: asserting wrappers with a pure-PyTorch reference for each.

The reference is the CPU path and the test oracle; CUDA kernels (plugins/) slot in behind
the same signatures. A wrapper rejects (or routes to the reference) what its kernel's own
checks would: with some torch builds a check that fires inside an extension op takes the
whole process down instead of raising (the GPU image's torch 2.11+cu130 with the system
g++), so the Python side is where bad input must stop.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from dflash_trt import fa3, plugins

log = logging.getLogger(__name__)

GRID_LIMIT = 65535  # a CUDA grid's y and z extents: the kernels put rows or heads there


def attention_mask(q_pos, k_pos, k_valid, causal: bool, window: int | None) -> torch.Tensor:
    """[bs, T, L] bool, True where query t may see key l: q_pos [bs, T] and k_pos [bs, L] are
    positions, k_valid [bs, L] marks keys holding data; causal: key <= query; window (None or
    <= 0: none): key > query - window. Also the SDPA baseline of bench/kernels.py."""
    visible = k_valid[:, None, :].expand(-1, q_pos.shape[1], -1)
    if causal:
        visible = visible & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None and window > 0:
        visible = visible & (k_pos[:, None, :] > q_pos[:, :, None] - window)
    return visible


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
    visible = attention_mask(q_pos, k_pos, k_valid, causal, window)  # [bs, T, L]
    # softmax(q.k * scale, masked) @ v in fp32; enable_gqa: query head h reads KV head h // G.
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=visible[:, None], scale=scale, enable_gqa=True).transpose(1, 2)
    out = out.masked_fill(~visible.any(-1)[:, :, None, None], 0.0)  # no visible key: zeros, whatever the backend
    return out.to(q.dtype)


def block_attention_kernel_supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the CUDA kernel (plugins/block_attention.cu) runs this dtype and head size.

    bf16/fp16 (tensor cores): head_dim 64, 128 or 256; fp32 (CUDA cores): a multiple of 8 up
    to 256. Pure: loads nothing. Mirrors dflash::block_attention_supports and ops.cpp's dtype
    switch (tests/test_ops.py checks both).
    """
    if dtype in (torch.bfloat16, torch.float16):
        return head_dim in (64, 128, 256)
    if dtype == torch.float32:
        return 8 <= head_dim <= 256 and head_dim % 8 == 0
    return False


def _plugins_loaded() -> bool:
    """Whether the CUDA plugin library is built and loaded (built on the first call)."""
    return plugins.load() is not None


def log_fallback(op: str, t: torch.Tensor) -> None:
    """A CUDA tensor about to take the PyTorch reference: say so (once per op and dtype), so a
    slow path is never silent. On the CPU the reference is the only path."""
    if t.is_cuda:
        _warn_once(op, t.dtype, _plugins_loaded())


@functools.cache
def _warn_once(op: str, dtype: torch.dtype, loaded: bool) -> None:
    why = "its kernel does not cover this dtype or shape" if loaded else "the CUDA plugins are not loaded"
    log.warning("%s on CUDA (%s) runs its PyTorch reference: %s", op, dtype, why)


def _cuda_block_attention_supported(q: torch.Tensor) -> bool:
    return q.is_cuda and block_attention_kernel_supports(q.dtype, q.shape[3]) and _plugins_loaded()


def paged_block_attention(q, k_cache, v_cache, slots, ctx_len, q_start, k_blk=None, v_blk=None, causal=False,
                          window=None, scale=None, *, max_keys: int | None = None, fa3_ok: bool = False):
    """Block attention over a KV cache -> [bs, T, Hq, d]; semantics of the reference above.

    Runs the CUDA kernel on CUDA tensors once the plugins are built, for the dtypes and head
    sizes block_attention_kernel_supports lists (bf16/fp16: 64, 128 or 256; fp32: multiples of
    8 up to 256), else the reference (CPU, other head sizes). `max_keys` is a host-side
    upper bound on ctx_len + block length (e.g. batch.max_end); it only tunes how the kernel
    splits long contexts, and defaults to the cache capacity. `fa3_ok` lets FlashAttention-3
    run the call where warm-up chose it for the shape (fa3.py); the caller vouches that every
    row's T tokens are real (a causal block in the cache: ctx_len = q_start + T) and, with
    k_blk (then q_start = ctx_len), that cache rows [ctx_len, ctx_len + T) may be written.
    """
    assert q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (q.shape, k_cache.shape)
    bs, T, Hq, d = q.shape
    Hkv = k_cache.shape[2]
    assert k_cache.shape[3] == d and Hkv > 0 and Hq > 0 and Hq % Hkv == 0, (q.shape, k_cache.shape)
    assert k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "last dim must be contiguous"
    assert k_cache.device == v_cache.device == q.device, f"the caches must be on q's {q.device}"
    for name, t in (("slots", slots), ("ctx_len", ctx_len), ("q_start", q_start)):
        assert t.dtype == torch.int32 and t.shape == (bs,) and t.device == q.device and t.is_contiguous(), \
            f"{name} must be a contiguous int32 [{bs}] on {q.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
    assert (k_blk is None) == (v_blk is None), "k_blk and v_blk go together"
    if k_blk is not None:
        assert k_blk.shape == v_blk.shape == (bs, T, Hkv, d), (k_blk.shape, v_blk.shape)
        assert k_blk.dtype == v_blk.dtype == q.dtype and k_blk.stride(-1) == 1 and v_blk.stride(-1) == 1
        assert k_blk.device == v_blk.device == q.device, f"k_blk and v_blk must be on q's {q.device}"
    scale = d ** -0.5 if scale is None else scale
    window = 0 if window is None else window
    if fa3_ok and fa3.runs(q, k_cache, causal, window, k_blk is not None):
        return fa3.attention(q, k_cache, v_cache, slots, ctx_len, scale, k_blk, v_blk)
    if _cuda_block_attention_supported(q) and q.numel() and k_cache.numel() and bs <= GRID_LIMIT:  # empty: no launch
        return torch.ops.dflash.block_attention(q, k_cache, v_cache, slots, ctx_len, q_start, k_blk, v_blk,
                                                bool(causal), int(window), float(scale), int(max_keys or 0))
    log_fallback("block_attention", q)
    return paged_block_attention_reference(q, k_cache, v_cache, slots, ctx_len, q_start, k_blk, v_blk, causal,
                                           window, scale)


# ----------------------------------------------------------------------------------------------
# Per-layer fused ops (plugins/layer_ops.cu). Each reference repeats the model code's torch ops
# one for one (layers.RMSNorm, AttentionProjections.qkv + apply_rope, qwen3_5.GatedAttention's
# norms + apply_partial_rope, MLP), so the CPU path rounds exactly as the model did; the kernels
# keep that rounding order too.


def _layer_kernel_ready(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and _plugins_loaded()


def rms_norm_reference(x, weight, eps, zero_centered=False):
    """layers.RMSNorm: normalise in fp32, round to weight's dtype, scale in weight's dtype.
    zero_centered (qwen3_5.ZeroCenteredRMSNorm): scale by 1 + weight in fp32, round once."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x32 * (1.0 + weight.float())).to(weight.dtype)
    return weight * x32.to(weight.dtype)


def add_rms_norm_reference(x, delta, weight, eps, zero_centered=False):
    """(s, y): s = x.float() + delta (fp32, the residual stream), y = rms_norm(s)."""
    s = x.float() + delta
    return s, rms_norm_reference(s, weight, eps, zero_centered)


def gated_rms_norm_reference(x, gate, weight, eps):
    """qwen3_5.GatedRMSNorm: rms_norm_reference(x), then times silu(gate) in fp32, rounded."""
    return (rms_norm_reference(x, weight, eps) * F.silu(gate.float())).to(weight.dtype)


def _rope_reference(x, cos, sin):
    """layers.apply_rope on x [N, heads, d] with cos/sin [N, 1, r]; r < d is
    qwen3_5.apply_partial_rope: the first r channels turn, the rest pass unchanged."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([_rope_reference(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope_reference(qkv, num_q_heads, num_kv_heads, q_weight, k_weight, eps, cos, sin, k_cache=None,
                           v_cache=None, slots=None, positions=None, *, zero_centered=False, rotary_dim=0,
                           q_gate=False):
    """AttentionProjections.qkv after the projection, on qkv [N, (Hq + 2 Hkv) d] and cos/sin [N, d].

    Returns (q [N, Hq, d] or None when Hq == 0, k, v [N, Hkv, d]); with the caches, k and v
    of row r go to cache[slots[r], positions[r]] instead and come back as None.
    Qwen3.5's GatedAttention: zero_centered norms (ZeroCenteredRMSNorm), RoPE on the first
    rotary_dim channels only (apply_partial_rope, cos/sin [N, rotary_dim]), and with q_gate
    qkv [N, (2 Hq + 2 Hkv) d], each query head followed by its gate (not returned).
    """
    d = k_weight.shape[0]
    assert cos.shape[-1] == (rotary_dim or d), (cos.shape, rotary_dim, d)
    q, k, v = qkv.split([num_q_heads * d * (2 if q_gate else 1), num_kv_heads * d, num_kv_heads * d], dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    if num_q_heads:
        q = q.unflatten(-1, (num_q_heads, -1))[..., :d]
        q = _rope_reference(rms_norm_reference(q, q_weight, eps, zero_centered), cos, sin)
    else:
        q = None
    k = _rope_reference(rms_norm_reference(k.unflatten(-1, (num_kv_heads, d)), k_weight, eps, zero_centered), cos,
                        sin)
    v = v.unflatten(-1, (num_kv_heads, d)).clone(memory_format=torch.contiguous_format)
    if k_cache is None:
        return q, k, v
    index = (slots.long(), positions.long())
    k_cache[index] = k
    v_cache[index] = v
    return q, None, None


def silu_mul_reference(gate_up):
    """MLP's activation: gate_up [..., 2I] (gate first) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_gate_reference(x, gate):
    """Gated attention's output gate: x [..., H, D] times sigmoid(gate), gate x's shape."""
    return x * torch.sigmoid(gate)


def _check_rms_args(x, delta, weight, delta_name="delta"):
    assert weight.dim() == 1 and weight.shape[0] > 0 and weight.is_contiguous(), \
        f"weight must be a contiguous [H > 0] tensor, got {weight.shape}"
    assert x.dim() >= 1 and x.shape[-1] == weight.shape[0], f"x must be [..., {weight.shape[0]}], got {x.shape}"
    assert x.dtype in (torch.float32, weight.dtype), f"x must be fp32 or weight's {weight.dtype}, got {x.dtype}"
    assert x.device == weight.device, f"x on {x.device}, weight on {weight.device}"
    assert x.is_contiguous(), "x must be contiguous"
    if delta is not None:
        name = delta_name
        assert delta.shape == x.shape, f"{name} must have x's shape {x.shape}, got {delta.shape}"
        assert delta.dtype == weight.dtype, f"{name} must have weight's {weight.dtype}, got {delta.dtype}"
        assert delta.device == x.device and delta.is_contiguous(), f"{name} must be contiguous on x's device"


def rms_norm(x, weight, eps: float, zero_centered: bool = False):
    """RMSNorm of x [..., H] (fp32 or weight's dtype) -> [..., H] in weight's dtype: layers.RMSNorm,
    or with zero_centered the Qwen3.5 one (qwen3_5.ZeroCenteredRMSNorm)."""
    _check_rms_args(x, None, weight)
    if _layer_kernel_ready(weight):
        return torch.ops.dflash.rms_norm(x, weight, float(eps), zero_centered)
    log_fallback("rms_norm", weight)
    return rms_norm_reference(x, weight, eps, zero_centered)


def gated_rms_norm(x, gate, weight, eps: float):
    """RMSNorm of x [..., H] (weight's dtype) times silu(gate) -> [..., H] in weight's dtype
    (qwen3_5.GatedRMSNorm, the linear-attention output's norm). gate has x's shape, its rows
    in groups one stride apart (_grouped_rows: contiguous, or a slice of a packed projection's
    output, such as in_proj's z), read in place."""
    _check_rms_args(x, None, weight)
    assert gate.shape == x.shape and gate.dtype == weight.dtype and gate.device == x.device, \
        f"gate must have x's shape {tuple(x.shape)}, weight's dtype and x's device"
    assert _grouped_rows(gate) is not None, \
        f"gate's rows must be contiguous, in groups one stride apart, got strides {gate.stride()}"
    if _layer_kernel_ready(weight):
        return torch.ops.dflash.gated_rms_norm(x, gate, weight, float(eps))
    log_fallback("gated_rms_norm", weight)
    return gated_rms_norm_reference(x, gate, weight, eps)


def _grouped_rows(t: torch.Tensor) -> tuple[int, int] | None:
    """(G, S) when t [..., H]'s rows come in groups of G back to back (its innermost dims
    whose strides are those of contiguous rows), the groups S elements apart (its other
    dims collapse into one stride), else None. plugins/ops.cpp's rms_norm_common reads a gate
    the same way."""
    H = t.shape[-1]
    if t.dim() < 1 or t.stride(-1) != 1:
        return None
    dims = [(n, s) for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n != 1]
    g = 1
    while dims and dims[-1][1] == g * H:
        g *= dims.pop()[0]
    if any(s != n_inner * s_inner for (_, s), (n_inner, s_inner) in zip(dims, dims[1:])):
        return None
    return g, (dims[-1][1] if dims else g * H)


def add_rms_norm(x, delta, weight, eps: float, zero_centered: bool = False):
    """(s, y): s = x.float() + delta [..., H] fp32, y = rms_norm(s) in weight's dtype; delta in weight's dtype."""
    _check_rms_args(x, delta, weight)
    if _layer_kernel_ready(weight):
        return torch.ops.dflash.add_rms_norm(x, delta, weight, float(eps), zero_centered)
    log_fallback("add_rms_norm", weight)
    return add_rms_norm_reference(x, delta, weight, eps, zero_centered)


def qk_norm_rope(qkv, num_q_heads: int, num_kv_heads: int, q_weight, k_weight, eps: float, cos, sin, k_cache=None,
                 v_cache=None, slots=None, positions=None, *, zero_centered: bool = False, rotary_dim: int = 0,
                 q_gate: bool = False):
    """Per-head q/k RMSNorm + RoPE of the packed qkv [N, (Hq + 2 Hkv) d] -> (q, k, v).

    Semantics of qk_norm_rope_reference. cos/sin [N, d] in qkv's dtype. With k_cache/v_cache
    [num_slots, capacity, Hkv, d] (a layer view is fine) and slots/positions [N] int32, k and v
    are written to cache[slots[r], positions[r]] for every row (positions must be below the
    capacity) and returned as None. Qwen3.5's gated attention: zero_centered norms, RoPE on the
    first rotary_dim channels (even, 0: all; cos/sin [N, rotary_dim]) and, with q_gate, qkv
    [N, (2 Hq + 2 Hkv) d] with each query head followed by its gate, which the caller keeps.
    Runs the CUDA kernel (one launch) for bf16/fp16 with head_dim 64, 128 or 256 and a
    rotary_dim that is a multiple of 64 once the plugins are built, else the reference.
    """
    assert qkv.dim() == 2 and qkv.stride(-1) == 1, f"qkv must be [N, W] with a contiguous last dim, got {qkv.shape}"
    assert num_q_heads >= 0 and num_kv_heads >= 1, (num_q_heads, num_kv_heads)
    heads = (2 if q_gate else 1) * num_q_heads + 2 * num_kv_heads  # d wide each, gates included
    N, d = qkv.shape[0], qkv.shape[1] // heads
    assert d > 0 and qkv.shape[1] == heads * d, \
        f"qkv must be [N, ({'2 ' if q_gate else ''}Hq + 2 Hkv) d] with Hq = {num_q_heads}, Hkv = {num_kv_heads}, " \
        f"got {tuple(qkv.shape)}"
    rotary = rotary_dim or d
    assert 0 < rotary <= d and rotary % 2 == 0, \
        f"rotary_dim must be even and at most head_dim {d} (0: all of it), got {rotary_dim}"
    assert cos.shape == sin.shape == (N, rotary), \
        f"cos/sin must be [{N}, {rotary}] (rotary_dim, or head_dim {d}), got {tuple(cos.shape)}, {tuple(sin.shape)}"
    for name, t in (("cos", cos), ("sin", sin), ("k_weight", k_weight), ("q_weight", q_weight)):
        if t is not None:
            assert t.dtype == qkv.dtype and t.device == qkv.device, f"{name}: {t.dtype} on {t.device}, qkv: {qkv.dtype}"
            assert t.stride(-1) == 1, f"{name} must have a contiguous last dim"
    assert k_weight.shape == (d,), f"k_weight must be [{d}], got {k_weight.shape}"
    assert (q_weight is None) == (num_q_heads == 0), "q_weight goes with num_q_heads > 0"
    assert q_weight is None or q_weight.shape == (d,), f"q_weight must be [{d}], got {q_weight.shape}"
    cache_args = (k_cache, v_cache, slots, positions)
    assert all(t is None for t in cache_args) or all(t is not None for t in cache_args), \
        "k_cache, v_cache, slots and positions go together"
    if k_cache is not None:
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            assert c.dim() == 4 and c.shape[2:] == (num_kv_heads, d) and c.shape[0] * c.shape[1] > 0, \
                f"{name} must be [num_slots, capacity, {num_kv_heads}, {d}] with rows, got {c.shape}"
            assert c.dtype == qkv.dtype and c.device == qkv.device and c.stride(-1) == 1, \
                f"{name} must have qkv's dtype and device and a contiguous last dim"
        for name, t in (("slots", slots), ("positions", positions)):
            assert t.dtype == torch.int32 and t.shape == (N,) and t.device == qkv.device and t.is_contiguous(), \
                f"{name} must be contiguous int32 [{N}] on qkv's device, got {t.dtype} {tuple(t.shape)} {t.device}"
    if d in (64, 128, 256) and rotary % 64 == 0 and _layer_kernel_ready(qkv):
        q, k, v = torch.ops.dflash.qk_norm_rope(qkv, num_q_heads, num_kv_heads, q_weight, k_weight, float(eps), cos,
                                                sin, k_cache, v_cache, slots, positions, bool(zero_centered),
                                                int(rotary_dim), bool(q_gate))
        q = q if num_q_heads else None
        return (q, None, None) if k_cache is not None else (q, k, v)
    log_fallback("qk_norm_rope", qkv)
    return qk_norm_rope_reference(qkv, num_q_heads, num_kv_heads, q_weight, k_weight, eps, cos, sin, k_cache,
                                  v_cache, slots, positions, zero_centered=zero_centered, rotary_dim=rotary_dim,
                                  q_gate=q_gate)


GEMV_MAX_ROWS = 16  # plugins/gemv.h kGemvMaxRows: more rows of x go to cuBLAS


def gemv_reference(x, weight, bias=None):
    """x [M, K] @ weight [N, K]^T (+ bias [N]) with an fp32 sum, rounded once to x's dtype:
    the semantics of plugins/gemv.cu, whose fp32 summation order is its own."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gemv(x, weight, bias=None):
    """The skinny-matmul kernel: x [M <= 16, K] bf16/fp16 on CUDA, weight [N, K], bias [N] or
    None, one dtype, contiguous, K a multiple of 8 -> [M, N]; gemv_reference elsewhere."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], \
        f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
    assert x.dtype == weight.dtype and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1])), \
        f"x, weight and bias must share a dtype and bias be [N], got {x.dtype}, {weight.dtype}, " \
        f"{None if bias is None else (bias.dtype, tuple(bias.shape))}"
    assert weight.device == x.device and (bias is None or bias.device == x.device), \
        f"weight and bias must be on x's {x.device}"
    if _gemv_kernel_fits(x, weight, bias):
        return torch.ops.dflash.gemv(x, weight, bias)
    log_fallback("gemv", x)
    return gemv_reference(x, weight, bias)


def _gemv_kernel_fits(x, weight, bias) -> bool:
    # what the op checks too (linear passes anything: F.linear then says what is wrong)
    if not (weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.dtype == x.dtype
            and weight.device == x.device and (bias is None or (bias.shape == weight.shape[:1]
                                                               and bias.dtype == x.dtype and bias.device == x.device))):
        return False
    return (0 < x.shape[0] <= GEMV_MAX_ROWS and x.shape[1] > 0 and x.shape[1] % 8 == 0 and x.is_contiguous()
            and weight.is_contiguous() and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and (bias is None or bias.is_contiguous()) and _layer_kernel_ready(x))


def linear(x, weight, bias=None, out=None):
    """nn.Linear's forward, x [..., K] (into `out`, x's shape but the last dim, if given). Up to
    GEMV_MAX_ROWS rows on CUDA (an AR step at a small batch, a verify or draft block at batch 1:
    the weights streamed once) go to the gemv kernel, which reads them faster than cuBLAS there
    (BENCHMARKS.md, "GEMV"); everything else, and the CPU, is F.linear (a matmul into `out`)."""
    if out is not None:
        assert out.shape == (*x.shape[:-1], weight.shape[0]) and out.dtype == x.dtype and out.is_contiguous(), \
            f"out must be a contiguous {x.dtype} {(*x.shape[:-1], weight.shape[0])}, got {out.dtype} {tuple(out.shape)}"
    if x.dtype == weight.dtype and x.is_contiguous() and 0 < x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
        x2 = x.reshape(-1, x.shape[-1])
        if _gemv_kernel_fits(x2, weight, bias):
            y = torch.ops.dflash.gemv(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
            return y if out is None else out.copy_(y)  # a few rows: the copy is small
    if out is None:
        return F.linear(x, weight, bias)
    torch.matmul(x, weight.t(), out=out)
    return out if bias is None else out.add_(bias)


GEMV_NORM_MAX_FEATURES = 8192  # plugins/gemv.h kGemvNormMaxFeatures


def linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps: float, zero_centered: bool = False,
                        ticket: torch.Tensor | None = None):
    """add_rms_norm(residual, linear(x, weight, bias), norm_weight, eps, zero_centered) -> (s, y):
    a layer's last projection and the residual add + norm after it.

    Where x is one row that goes to the gemv kernel (an AR step at batch 1) and `ticket` is
    given, one launch: the GEMV's last CTA runs the add + norm (plugins/gemv.h, GemvNorm) with
    add_rms_norm's bits. `ticket` is an int32 [1] zero tensor the caller owns; the launch leaves
    it zero, and launches that may run at the same time need their own. Elsewhere the two ops."""
    H = weight.shape[0]
    if ticket is not None and _linear_norm_fits(x, weight, bias, residual, norm_weight):
        _check_ticket(ticket, x.device)
        return torch.ops.dflash.linear_add_rms_norm(x.reshape(1, -1), weight, bias, residual, norm_weight, float(eps),
                                                    zero_centered, ticket)
    assert residual.shape[-1] == H, f"residual must be [..., {H}], got {tuple(residual.shape)}"
    return add_rms_norm(residual, linear(x, weight, bias), norm_weight, eps, zero_centered)


def _linear_norm_fits(x, weight, bias, residual, norm_weight) -> bool:
    H = weight.shape[0]
    if not (x.dtype == weight.dtype and x.is_contiguous() and x.numel() == x.shape[-1]):
        return False
    return (_gemv_kernel_fits(x.reshape(1, -1), weight, bias) and H <= GEMV_NORM_MAX_FEATURES
            and _row_norm_fits(x, H, residual, norm_weight))


def _row_norm_fits(x, H: int, residual, norm_weight) -> bool:
    """Whether the add + norm a launch runs after its own output takes these arguments."""
    return (H % 8 == 0 and residual.dtype == torch.float32 and residual.numel() == H and residual.is_contiguous()
            and residual.device == x.device and residual.data_ptr() % 16 == 0
            and norm_weight.dtype == x.dtype and norm_weight.shape == (H,) and norm_weight.is_contiguous()
            and norm_weight.device == x.device and norm_weight.data_ptr() % 16 == 0)


def _check_ticket(ticket, device) -> None:
    assert ticket.dtype == torch.int32 and ticket.numel() == 1 and ticket.device == device, \
        f"ticket must be one int32 on {device}, got {ticket.dtype} {tuple(ticket.shape)} on {ticket.device}"


def silu_mul(gate_up):
    """silu(gate) * up for gate_up [..., 2I] (gate first, as MLP chunks it) -> [..., I]."""
    assert gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0, f"gate_up must be [..., 2I], got {gate_up.shape}"
    assert gate_up.is_contiguous(), "gate_up must be contiguous"
    if _layer_kernel_ready(gate_up):
        return torch.ops.dflash.silu_mul(gate_up)
    log_fallback("silu_mul", gate_up)
    return silu_mul_reference(gate_up)


def sigmoid_gate(x, gate):
    """x [..., H, D] contiguous times sigmoid(gate) (sigmoid_gate_reference): gate has x's shape
    and dtype and a contiguous last dim, e.g. the gate rows of the q projection's output read in
    place. On CUDA one kernel (plugins/layer_ops.cu) rounding where torch does; its GPU tests hold it
    within one unit in the last place of the reference."""
    assert x.dim() >= 2 and gate.shape == x.shape and gate.dtype == x.dtype, \
        f"x must be [..., H, D] and gate its shape and dtype, got {tuple(x.shape)} {x.dtype} and " \
        f"{tuple(gate.shape)} {gate.dtype}"
    assert x.is_contiguous() and gate.stride(-1) == 1, "x must be contiguous and gate's last dim contiguous"
    if _layer_kernel_ready(x):
        rows = (-1, *x.shape[-2:])  # a view of gate too where its leading dims collapse (the q projection's do)
        return torch.ops.dflash.sigmoid_gate(x.reshape(rows), gate.reshape(rows)).view(x.shape)
    log_fallback("sigmoid_gate", x)
    return sigmoid_gate_reference(x, gate)


# ----------------------------------------------------------------------------------------------
# Mixture of experts: the routing (softmax, top-k, renormalisation) and the expert MLPs of the
# tokens' picks, one op each (plugins/moe_route.cu, plugins/moe.cu); the experts' reference loops
# over the experts picked.


MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_TOP_K = 512, 16  # plugins/moe_route.h


def moe_route_reference(logits: torch.Tensor, top_k: int, renormalize: bool,
                        shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (the model dtype) -> (weights [N, k] fp32, expert ids [N, k] int32),
    as transformers' Qwen3 MoE routers compute them: softmax over all experts in fp32, the top
    k, optionally renormalised to sum 1, then rounded to the logits' dtype (HF multiplies the
    experts' outputs by weights of that dtype).

    `shared`: the logits have one column more, a shared expert's gate (Qwen3.5 MoE), and every
    token one pick more, expert E with weight sigmoid(gate) in the logits' dtype, as transformers
    scales the shared expert's output."""
    routed = logits[:, :-1] if shared else logits
    probs = torch.softmax(routed, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights, ids = weights.to(logits.dtype).float(), ids.int()
    if shared:
        weights = torch.cat([weights, torch.sigmoid(logits[:, -1:]).float()], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], routed.shape[1])], dim=1)
    return weights, ids


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool,
              shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_route_reference's routing; one kernel on CUDA (plugins/moe_route.cu) for up to 512
    experts and k <= 16, whose sums may differ from torch's in the last fp32 place. The logits
    may be a strided view (router_logits' transpose)."""
    E = logits.shape[1] - shared
    assert logits.dim() == 2 and 0 < top_k <= E, f"logits must be [N, E >= k], got {tuple(logits.shape)}, k {top_k}"
    if (logits.is_cuda and min(logits.stride()) >= 1 and E <= MOE_ROUTE_MAX_EXPERTS and top_k <= MOE_ROUTE_MAX_TOP_K
            and logits.dtype in (torch.bfloat16, torch.float16, torch.float32) and _plugins_loaded()):
        return torch.ops.dflash.moe_route(logits, int(top_k), bool(renormalize), bool(shared))
    log_fallback("moe_route", logits)
    return moe_route_reference(logits, top_k, renormalize, shared)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A router's logits x @ weight^T -> [N, E] for x [N, H] (linear's numbers). A Qwen3.5 MoE
    router has E = experts + 1 rows (the shared expert's gate): an output row that long is no
    multiple of 16 bytes, and cuBLAS runs it on its unaligned kernels (slower, in a 35B-A3B
    verify at 32: commit c65979d, and BENCHMARKS.md at ea06c68, "Mixture of experts"). So on
    CUDA, past the gemv kernel's rows and with N a multiple of 8, it computes weight @ x^T
    ([E, N], rows of N tokens) and returns that transposed: a strided view, which moe_route
    reads in place."""
    N = x.shape[0]
    if (x.is_cuda and x.dim() == 2 and weight.shape[0] % 8 != 0 and N > GEMV_MAX_ROWS and N % 8 == 0
            and x.dtype == weight.dtype):
        return torch.mm(weight, x.t()).t()
    return linear(x, weight)


def moe_experts_reference(x, gate_up, down, weights, ids, out_dtype=torch.float32):
    """The routed experts of x [N, H]: out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]),
    the sum in fp32 over j = 0..k-1 in order -> [N, H] fp32, or that rounded to out_dtype.

    An expert is the SwiGLU MLP of gate_up [E, 2I, H] (gate rows, then up rows) and down
    [E, H, I], rounding as layers.MLP does: each projection's output in x's dtype, silu * up
    in x's dtype (silu_mul_reference). Loops over the experts picked (a host sync: the CPU path
    and the oracle of the kernels)."""
    N, H = x.shape
    out = torch.zeros(N, ids.shape[1], H, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        token, j = (ids == e).nonzero(as_tuple=True)
        y = F.linear(silu_mul_reference(F.linear(x[token], gate_up[e])), down[e])
        out[token, j] = y.float()
    return (out * weights[..., None]).sum(dim=1).to(out_dtype)


# N k / E (picks per expert, on average) from which bf16 passes run the experts as two grouped
# GEMMs (torch._grouped_mm) rather than the fused kernels, which apply each expert's weights to
# 8 or 16 of its picks at a time and run out of tensor-core throughput as the picks grow. Set
# at the crossover bench/moe_kernels.py finds on Qwen3.6-35B-A3B's shape (gpu_check.sh moe).
MOE_GROUPED_MIN_PICKS_PER_EXPERT = 16
MOE_MAX_SLOTS = 1 << 19  # N k of one launch (its grid); larger passes go in token blocks
MOE_MAX_EXPERTS = 2048  # plugins/moe.h kMoeMaxExperts


def moe_experts(x, gate_up, down, weights, ids, out_dtype=torch.float32, shared_last: bool = False):
    """The routed experts of a pass (semantics of moe_experts_reference) -> [N, H] in
    out_dtype: fp32, or x's dtype (the sum rounded once, as .to() would, without a kernel more).
    shared_last: every token's last pick is expert E - 1 (a shared expert packed last, as
    moe_route(shared=True) picks it), a hint that lets one token's kernel fetch that expert's
    weights before the routing is done; the result is the same either way.

    On CUDA once the plugins are built (bf16, fp16 or fp32; H and I multiples of 8): the fused
    kernels of plugins/moe.cu, which read each picked expert's weights once per 8 or 16 of its
    picks (one token in bf16 or fp16: once, on CUDA cores), read nothing back on the host and
    size their launches from the shapes alone (CUDA graph capture works); for bf16 passes with
    MOE_GROUPED_MIN_PICKS_PER_EXPERT picks per expert or more, two torch._grouped_mm GEMMs
    between the same device-side sort and weighted sum. Both round where the reference rounds;
    their fp32 sums run in their own order, and fp32 inputs go through three TF32 products per
    term (within a few fp32 units in the last place of each product). A pick whose id is
    outside [0, E) adds nothing there (the reference raises). Elsewhere (CPU, other shapes) the
    reference.
    """
    assert x.dim() == 2, f"x must be [N, H], got {tuple(x.shape)}"
    N, H = x.shape
    assert gate_up.dim() == 3 and gate_up.shape[1] % 2 == 0 and gate_up.shape[2] == H, \
        f"gate_up must be [E, 2I, {H}], got {tuple(gate_up.shape)}"
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    assert down.shape == (E, H, I), f"down must be [{E}, {H}, {I}], got {tuple(down.shape)}"
    assert gate_up.dtype == x.dtype and down.dtype == x.dtype, \
        f"gate_up and down must have x's dtype {x.dtype}, got {gate_up.dtype} and {down.dtype}"
    assert ids.dim() == 2 and ids.shape[0] == N, f"ids must be [{N}, k], got {tuple(ids.shape)}"
    assert weights.shape == ids.shape, f"weights must be ids' shape {tuple(ids.shape)}, got {tuple(weights.shape)}"
    assert weights.dtype == torch.float32, f"weights must be fp32, got {weights.dtype}"
    assert ids.dtype == torch.int32, f"ids must be int32, got {ids.dtype}"
    assert E >= 1, "gate_up must hold at least one expert"
    for name, t in (("gate_up", gate_up), ("down", down), ("weights", weights), ("ids", ids)):
        assert t.device == x.device, f"{name} is on {t.device}, x on {x.device}"
    assert out_dtype in (torch.float32, x.dtype), f"out_dtype must be fp32 or x's {x.dtype}, got {out_dtype}"
    if not _moe_kernel_fits(x, gate_up, down):
        log_fallback("moe_experts", x)
        return moe_experts_reference(x, gate_up, down, weights, ids, out_dtype)
    step = MOE_MAX_SLOTS // max(ids.shape[1], 1)
    if N > step:
        return torch.cat([moe_experts(x[i:i + step], gate_up, down, weights[i:i + step], ids[i:i + step], out_dtype,
                                      shared_last) for i in range(0, N, step)])
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.contiguous()
    if _moe_grouped_fits(x, ids.numel(), E):
        return _moe_experts_grouped(x, gate_up, down, weights, ids, out_dtype)
    return torch.ops.dflash.moe_experts(x, gate_up, down, weights, ids, out_dtype == torch.float32, shared_last)


MOE_NORM_MAX_HIDDEN = 4096  # plugins/moe.h kMoeNormMaxHidden


def moe_experts_add_rms_norm(x, gate_up, down, logits, top_k: int, renormalize: bool, shared: bool, residual,
                             norm_weight, eps: float, zero_centered: bool = False,
                             ticket: torch.Tensor | None = None):
    """add_rms_norm(residual, moe_experts(x, gate_up, down, *moe_route(logits, top_k,
    renormalize, shared), out_dtype=x.dtype, shared_last=shared), norm_weight, eps,
    zero_centered) -> (s, y): an MoE block's routing, experts and the residual add + norm after
    them (with `shared` the shared expert packed last in gate_up and down, its gate the logits'
    last column).

    One token in bf16 or fp16 on CUDA with `ticket` given (an AR step at batch 1): one launch
    pair with the same bits: each CTA of the experts' kernels routes the token itself
    (plugins/route_warp.h, moe_route's arithmetic), so no routing kernel runs, and the one-token
    down kernel's last CTA runs the add + norm (plugins/moe.h, MoeTokenFusion::norm) with
    add_rms_norm's bits; `ticket` as for linear_add_rms_norm. Elsewhere the three ops."""
    H = x.shape[-1]
    E = logits.shape[-1] - shared
    if (ticket is not None and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and logits.dim() == 2 and logits.dtype == x.dtype and E <= MOE_ROUTE_MAX_EXPERTS
            and 0 < top_k <= MOE_ROUTE_MAX_TOP_K and min(logits.stride()) >= 1 and H <= MOE_NORM_MAX_HIDDEN
            and x.is_contiguous() and _moe_kernel_fits(x, gate_up, down) and _row_norm_fits(x, H, residual, norm_weight)):
        _check_ticket(ticket, x.device)
        return torch.ops.dflash.moe_experts_add_rms_norm(x, gate_up, down, logits, int(top_k), bool(renormalize),
                                                         bool(shared), residual, norm_weight, float(eps), zero_centered,
                                                         ticket)
    out = moe_experts(x, gate_up, down, *moe_route(logits, top_k, renormalize, shared), x.dtype, shared)
    return add_rms_norm(residual, out.reshape(residual.shape), norm_weight, eps, zero_centered)


def _moe_kernel_fits(x, gate_up, down) -> bool:
    E, I2, H = gate_up.shape
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and H >= 8 and H % 8 == 0
            and I2 >= 16 and I2 % 16 == 0 and E <= MOE_MAX_EXPERTS and gate_up.is_contiguous()
            and down.is_contiguous() and gate_up.data_ptr() % 16 == 0 and down.data_ptr() % 16 == 0
            and (x.data_ptr() % 16 == 0 or not x.is_contiguous())  # moe_experts copies a strided x, aligned
            and torch.cuda.get_device_capability(x.device) >= (8, 0) and _plugins_loaded())


def _moe_grouped_fits(x, slots: int, num_experts: int) -> bool:
    return (x.dtype == torch.bfloat16 and slots >= MOE_GROUPED_MIN_PICKS_PER_EXPERT * num_experts
            and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device) >= (9, 0))


def _moe_experts_grouped(x, gate_up, down, weights, ids, out_dtype=torch.float32):
    """moe_experts as GEMMs over the picks in expert order: the kernels' sort, x gathered, a
    grouped GEMM, silu_mul, a grouped GEMM, then the kernels' weighted sum reading each pick's
    row where the sort put it (and storing it in out_dtype). Picks with an id outside [0, E)
    sort last, past every group."""
    order, rows, ends = torch.ops.dflash.moe_sort(ids, gate_up.shape[0])
    xs = x.index_select(0, torch.div(order, ids.shape[1], rounding_mode="floor"))  # [N k, H]
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends)  # [N k, 2I]
    ys = torch._grouped_mm(torch.ops.dflash.silu_mul(h), down.transpose(1, 2), offs=ends)  # [N k, H]
    return torch.ops.dflash.moe_combine(ys, weights, ids, rows, gate_up.shape[0], out_dtype == torch.float32)


# ----------------------------------------------------------------------------------------------
# The Gated DeltaNet recurrence of a decode/verify pass (plugins/gated_delta.cu), on the cache in
# place: the committed state is read from state_cache[slots] and the snapshots are written to
# snapshot_cache[slots], with no gathered copy of either.


def causal_conv1d(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, num_tokens: torch.Tensor,
                  num_snapshots: int, full_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over a pass, continuing from `window`.

    x [bs, T, C] this pass's inputs; window [bs, K-1, C] the K-1 inputs before it (zeros
    for a new sequence); weight [C, K]; num_tokens [bs]. Returns (out [bs, T, C] in x's
    dtype, window snapshots [bs, S, K-1, C]: the window after each of the last S tokens).
    `full_rows` (known on the host): every row has T tokens, so the snapshots are a slice.
    """
    bs, T, C = x.shape
    W = weight.shape[1] - 1
    assert window.shape == (bs, W, C) and weight.shape == (C, W + 1), (x.shape, window.shape, weight.shape)
    assert num_tokens.shape == (bs,), num_tokens.shape
    full = torch.cat([window.to(x.dtype), x], dim=1)  # [bs, W + T, C]; input t sits at W + t
    weight = weight.to(x.dtype)
    # out[t] = sum_j weight[:, j] * full[t + j]: tap W (the last) meets input t itself
    acc = full[:, :T] * weight[:, 0]
    for j in range(1, W + 1):
        acc = acc + full[:, j: j + T] * weight[:, j]
    out = F.silu(acc)
    # The window after n tokens is full[n : n + W]; snapshot j is for n = num_tokens - S + 1 + j.
    if full_rows and num_snapshots <= T + 1:  # n = T - S + 1 + j >= 0 for every row: one slice
        return out, full.unfold(1, W, 1)[:, T - num_snapshots + 1:].transpose(-1, -2)
    n = (num_tokens[:, None] - num_snapshots + 1 + torch.arange(num_snapshots, device=x.device)).clamp(min=0)
    index = n[:, :, None] + torch.arange(W, device=x.device)  # [bs, S, W]
    snapshots = full.gather(1, index.flatten(1)[:, :, None].expand(-1, -1, C)).unflatten(1, (num_snapshots, W))
    return out, snapshots


def causal_conv_reference(x, weight, conv_cache, snapshots, slots, start, num_tokens=None):
    """The kernel's semantics (layer_ops.h, CausalConvParams) through causal_conv1d,
    the path of every pass: the window from the cache (zeros for a new sequence), then the
    window after all T tokens (after each row's num_tokens, when given) into conv_cache, or
    after each of the last NS into snapshots (those after the pass's tokens only: at most T + 1)."""
    slots = slots.long()
    window = conv_cache[slots].masked_fill((start == 0)[:, None, None], 0)
    full_rows = num_tokens is None
    if full_rows:
        num_tokens = torch.full((x.shape[0],), x.shape[1], device=x.device)
    out, windows = causal_conv1d(x, window, weight, num_tokens.long().clamp(0, x.shape[1]),
                                 1 if snapshots is None else snapshots.shape[1], full_rows=full_rows)
    if snapshots is None:
        conv_cache[slots] = windows[:, 0]
    else:
        m = min(windows.shape[1], x.shape[1] + 1)
        snapshots[slots, -m:] = windows[:, -m:]
    return out


def causal_conv(x, weight, conv_cache, snapshots, slots, start, num_tokens=None):
    """The causal conv + SiLU of a Gated DeltaNet pass -> out [bs, T, C] in x's dtype,
    continuing each row's window in conv_cache [num_slots, K-1, C] (zeros where start == 0);
    the window after the pass goes back to conv_cache (snapshots None), or the one after each
    of the last NS tokens to snapshots [num_slots, NS, K-1, C] (NS > T + 1, a verify narrower
    than the block: the first NS - T - 1, windows from before the pass, which a commit never
    reads, are left as they are). num_tokens [bs] int32
    (with snapshots None only: a padded prefill) has row b's window taken after its first
    num_tokens[b] tokens instead of all T. x [bs, T, C] may be a view of a packed projection
    (channels contiguous); weight [C, K]; slots, start [bs] int32. plugins/layer_ops.cu on
    CUDA for bf16/fp16 (K <= 8)."""
    assert x.dim() == 3 and x.stride(-1) == 1, f"x must be [bs, T, C] with contiguous channels, got {tuple(x.shape)}"
    bs, T, C = x.shape
    assert weight.dim() == 2 and weight.shape[0] == C and weight.is_contiguous(), f"weight must be [{C}, K]"
    W = weight.shape[1] - 1
    assert conv_cache.dim() == 3 and conv_cache.shape[1:] == (W, C) and conv_cache.is_contiguous(), \
        f"conv_cache must be [num_slots, {W}, {C}] contiguous, got {tuple(conv_cache.shape)}"
    if snapshots is not None:
        assert snapshots.dim() == 4 and snapshots.shape[0] == conv_cache.shape[0] and snapshots.shape[2:] == (W, C) \
            and snapshots.is_contiguous() and snapshots.shape[1] >= 1, \
            f"snapshots must be [num_slots, NS >= 1, {W}, {C}] contiguous, got {tuple(snapshots.shape)}"
    for name, t in (("weight", weight), ("conv_cache", conv_cache), ("snapshots", snapshots)):
        assert t is None or (t.dtype == x.dtype and t.device == x.device), f"{name} must have x's dtype and device"
    assert num_tokens is None or snapshots is None, "num_tokens (ragged rows) only without snapshots"
    for name, t in (("slots", slots), ("start", start), ("num_tokens", num_tokens)):
        assert t is None and name == "num_tokens" or t.dtype == torch.int32 and t.shape == (bs,) \
            and t.device == x.device and t.is_contiguous(), f"{name} must be contiguous int32 [{bs}]"
    assert C > 0, "x must have channels"
    if _layer_kernel_ready(x) and 1 <= W <= 7 and x.stride(0) == x.stride(1) * T and x.stride(1) >= C:
        return torch.ops.dflash.causal_conv(x, weight, conv_cache, snapshots, slots, start, num_tokens)
    log_fallback("causal_conv", x)
    return causal_conv_reference(x, weight, conv_cache, snapshots, slots, start, num_tokens)


def gated_delta_kernel_supports(key_dim: int, value_dim: int) -> bool:
    """Whether plugins/gated_delta.cu runs these head sizes (dflash::gated_delta_supports):
    dk and dv multiples of 16 from 16 to 256. Pure: loads nothing."""
    return all(16 <= d <= 256 and d % 16 == 0 for d in (key_dim, value_dim))


def gated_delta_prepare_reference(qkv, a, b, neg_a, dt_bias, num_k_heads, key_dim, value_dim, eps, q_scale):
    """The kernel's semantics (plugins/gated_delta.h, GatedDeltaPrepareParams) as PyTorch ops:
    what GatedDeltaNet.forward computed before the kernel, op for op."""
    Hv = neg_a.shape[0]
    q, k, v = qkv.split([num_k_heads * key_dim, num_k_heads * key_dim, Hv * value_dim], dim=-1)
    q, k = (x.unflatten(-1, (num_k_heads, key_dim)).float() for x in (q, k))
    q = (q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + eps) * q_scale).contiguous()
    k = (k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + eps)).contiguous()
    v = v.unflatten(-1, (Hv, value_dim)).float().contiguous()
    g = (neg_a * F.softplus(a + dt_bias)).contiguous()  # a is promoted to fp32
    return q, k, v, g, b.float().sigmoid().contiguous()


def gated_delta_prepare(qkv, a, b, neg_a, dt_bias, num_k_heads: int, key_dim: int, value_dim: int, eps: float,
                        q_scale: float, out: tuple[torch.Tensor, ...] | None = None):
    """The recurrence's inputs of a decode/verify pass from a Gated DeltaNet layer's projections
    -> (q, k [..., Hk, dk] L2-normalised, q times q_scale; v [..., Hv, dv]; g = neg_a *
    softplus(a + dt_bias) and beta = sigmoid(b) [..., Hv]), all fp32 and contiguous.

    qkv [..., 2 Hk dk + Hv dv] after the causal conv, contiguous; a, b [..., Hv] in qkv's
    dtype (views of the packed projection: the last dim contiguous); neg_a = -exp(A_log) and
    dt_bias [Hv] fp32. `out`: five tensors of those shapes to write (a verify writes its
    inputs where commit replays them from), returned. plugins/gated_delta.cu on CUDA (one
    launch), else the reference.
    """
    Hv = neg_a.shape[0] if neg_a.dim() == 1 else -1
    width = 2 * num_k_heads * key_dim + Hv * value_dim
    assert Hv > 0 and qkv.shape[-1] == width, f"qkv must be [..., {width}] for {Hv} value heads, got {tuple(qkv.shape)}"
    assert qkv.is_contiguous(), "qkv must be contiguous"
    for name, t in (("a", a), ("b", b)):
        assert t.shape == (*qkv.shape[:-1], Hv) and t.dtype == qkv.dtype and t.device == qkv.device, \
            f"{name} must be [..., {Hv}] in qkv's {qkv.dtype} on its device, got {t.dtype} {tuple(t.shape)}"
        assert t.stride(-1) == 1, f"{name} must have a contiguous last dim"
    for name, t in (("neg_a", neg_a), ("dt_bias", dt_bias)):
        assert t.shape == (Hv,) and t.dtype == torch.float32 and t.device == qkv.device and t.is_contiguous(), \
            f"{name} must be a contiguous fp32 [{Hv}] on qkv's device"
    lead = tuple(qkv.shape[:-1])
    if out is not None:
        shapes = ((num_k_heads, key_dim), (num_k_heads, key_dim), (Hv, value_dim), (Hv,), (Hv,))
        assert len(out) == 5, "out must be five tensors: q, k, v, g, beta"
        for name, t, tail in zip(("q", "k", "v", "g", "beta"), out, shapes):
            assert t.shape == (*lead, *tail) and t.dtype == torch.float32 and t.device == qkv.device and \
                t.is_contiguous(), f"out {name} must be contiguous fp32 {[*lead, *tail]} on qkv's device, " \
                                   f"got {t.dtype} {list(t.shape)} {t.device}"
    if qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16, torch.float32) and 1 <= key_dim <= 256 and \
            a.dim() == 3 and a.stride() == b.stride() and a.stride(1) >= Hv and num_k_heads <= GRID_LIMIT and \
            a.stride(0) == a.stride(1) * a.shape[1] and _plugins_loaded():
        if out is None:
            return torch.ops.dflash.gated_delta_prepare(qkv, a, b, neg_a, dt_bias, num_k_heads, key_dim, value_dim,
                                                        float(eps), float(q_scale))
        torch.ops.dflash.gated_delta_prepare_into(qkv, a, b, neg_a, dt_bias, *out, num_k_heads, key_dim, value_dim,
                                                  float(eps), float(q_scale))
        return tuple(out)
    log_fallback("gated_delta_prepare", qkv)
    made = gated_delta_prepare_reference(qkv, a, b, neg_a, dt_bias, num_k_heads, key_dim, value_dim, eps, q_scale)
    if out is None:
        return made
    for t, x in zip(out, made):
        t.copy_(x)
    return tuple(out)


def gated_delta_rule_reference(q, k, v, g, beta, state, num_tokens, num_snapshots):
    """The recurrence, one token at a time, in fp32.

    q, k [bs, T, Hk, dk] (normalised and scaled already); v [bs, T, Hv, dv]; g (log decay)
    and beta [bs, T, Hv]; state [bs, Hv, dk, dv] before the pass; num_tokens [bs].
    Returns (out [bs, T, Hv, dv] fp32, snapshots [bs, S, Hv, dk, dv] fp32).
    """
    bs, T, Hk, _ = q.shape
    group = v.shape[2] // Hk
    # grouped values: q/k head h serves value heads h*group .. (h+1)*group-1
    q, k = q.float().repeat_interleave(group, dim=2), k.float().repeat_interleave(group, dim=2)
    v, g, beta = v.float(), g.float(), beta.float()
    state = state.float().clone()
    out = torch.zeros_like(v)
    snapshots = torch.zeros((bs, num_snapshots, *state.shape[1:]), dtype=torch.float32, device=state.device)
    rows = torch.arange(bs, device=state.device)
    # Padding only ever follows a row's tokens, so it may run through the recurrence: its
    # outputs are ignored and the snapshots are taken before it.
    for t in range(T):
        decayed = state * g[:, t, :, None, None].exp()
        predicted = (decayed * k[:, t, :, :, None]).sum(-2)  # S^T k: [bs, Hv, dv]
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = decayed + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (state * q[:, t, :, :, None]).sum(-2)  # S^T q
        if num_snapshots:
            slot = t + num_snapshots - num_tokens  # right-aligned: the row's last token lands at S-1
            keep = ((slot >= 0) & (t < num_tokens))[:, None, None, None]
            slot = slot.clamp(0, num_snapshots - 1)  # no host sync: rows that keep nothing rewrite a value
            snapshots[rows, slot] = torch.where(keep, state, snapshots[rows, slot])
    return out, snapshots


def gated_delta_recurrent_reference(q, k, v, g, beta, state_cache, snapshot_cache, slots, start, num_tokens,
                                    out_dtype=torch.float32):
    """The kernel's semantics (plugins/gated_delta.h) on gated_delta_rule_reference.

    Gathers each row's state (zeros where start == 0), runs the reference recurrence, and
    writes into snapshot_cache[slots] only the snapshots the row's tokens reached: index j
    holds the state after token t = j + num_tokens - NS, written iff 0 <= t < num_tokens (and
    t < T). Returns out [bs, T, Hv, dv] fp32 (or rounded to out_dtype) with zeros at the padding tokens.
    """
    T, NS = q.shape[1], snapshot_cache.shape[1]
    slots, num_tokens = slots.long(), num_tokens.long()
    state = state_cache[slots].masked_fill((start == 0)[:, None, None, None], 0)
    out, snapshots = gated_delta_rule_reference(q, k, v, g, beta, state, num_tokens, NS)
    padding = torch.arange(T, device=q.device) >= num_tokens[:, None]  # [bs, T]
    out = out.masked_fill(padding[:, :, None, None], 0)
    t = torch.arange(NS, device=q.device) + num_tokens[:, None] - NS  # [bs, NS]: the token of snapshot j
    reached = (t >= 0) & (t < num_tokens.clamp(max=T)[:, None])
    rows = reached.any(dim=1)  # a row that writes nothing may share its slot with one that does
    snapshot_cache[slots[rows]] = torch.where(reached[rows][:, :, None, None, None], snapshots[rows],
                                              snapshot_cache[slots[rows]])
    return out.to(out_dtype)


GATED_DELTA_STEP_DIM = 128  # plugins/gated_delta.h kGatedDeltaStepDim: the fused step's dk = dv


def gated_delta_step(qkv, a, b, z, neg_a, dt_bias, norm_weight, norm_eps: float, l2_eps: float, q_scale: float,
                     state_cache, slots, start, num_tokens, num_k_heads: int):
    """One in-place decode step of a Gated DeltaNet layer (one token a row: an AR step) from
    its conv output to its gated norm -> y [bs, 1, Hv, dv] in qkv's dtype:
    gated_rms_norm(gated_delta_recurrent(*gated_delta_prepare(qkv, a, b, ...), state_cache,
    state_cache.unsqueeze(1), ...), z, norm_weight), the state stepped in place.

    qkv [bs, 1, 2 Hk dk + Hv dv] contiguous; a, b [bs, 1, Hv] and z [bs, 1, Hv, dv] (views of
    the packed projection); state_cache [num_slots, Hv, dk, dv] fp32; slots, start, num_tokens
    [bs] int32 (num_tokens 0: a padding row, its state kept, its y zeros). On CUDA in 16-bit
    with dk = dv = 128 one kernel (plugins/gated_delta.cu) with those three ops' arithmetic,
    the same bits; else the three ops.
    """
    bs, T = qkv.shape[:2]
    Hv, dv = z.shape[-2:]
    dk = (qkv.shape[-1] - Hv * dv) // (2 * num_k_heads)
    assert T == 1 and z.shape == (bs, 1, Hv, dv) and a.shape == b.shape == (bs, 1, Hv), \
        f"one token a row: qkv [bs, 1, C], a and b [bs, 1, {Hv}], z [bs, 1, {Hv}, {dv}], got " \
        f"{tuple(qkv.shape)}, {tuple(a.shape)}, {tuple(b.shape)}, {tuple(z.shape)}"
    if _gated_delta_step_fits(qkv, a, b, z, norm_weight, state_cache, dk, dv):
        y = torch.ops.dflash.gated_delta_step(qkv[:, 0], a[:, 0], b[:, 0], z[:, 0], neg_a, dt_bias, norm_weight,
                                              float(norm_eps), float(l2_eps), float(q_scale), state_cache, slots,
                                              start, num_tokens, int(num_k_heads))
        return y.unsqueeze(1)
    inputs = gated_delta_prepare(qkv, a, b, neg_a, dt_bias, num_k_heads, dk, dv, l2_eps, q_scale)
    out = gated_delta_recurrent(*inputs, state_cache, state_cache.unsqueeze(1), slots, start, num_tokens, qkv.dtype)
    return gated_rms_norm(out, z, norm_weight, norm_eps)


def _gated_delta_step_fits(qkv, a, b, z, norm_weight, state_cache, dk: int, dv: int) -> bool:
    D = GATED_DELTA_STEP_DIM
    return (qkv.is_cuda and qkv.dtype in (torch.bfloat16, torch.float16) and dk == dv == D
            and qkv.is_contiguous() and a.stride() == b.stride() and a.stride(-1) == 1
            and z.stride(-1) == 1 and z.stride(-2) == D and z.stride(0) % 8 == 0 and z.data_ptr() % 16 == 0
            and norm_weight.dtype == qkv.dtype and norm_weight.is_contiguous() and norm_weight.data_ptr() % 16 == 0
            and state_cache.data_ptr() % 16 == 0 and max(qkv.shape[0], z.shape[2]) <= GRID_LIMIT
            and _plugins_loaded())


def gated_delta_recurrent(q, k, v, g, beta, state_cache, snapshot_cache, slots, start, num_tokens,
                          out_dtype=torch.float32, outputs: bool = True):
    """One decode/verify pass of the gated delta rule, on the cache in place -> out [bs, T, Hv, dv]
    fp32, or rounded to out_dtype (bf16/fp16: what the model casts it to, without a kernel more);
    with outputs False None (a commit's replay, which wants only the state: the kernel then
    skips q and the outputs' arithmetic).

    q, k [bs, T, Hk, dk] (L2-normalised, q scaled); v [bs, T, Hv, dv]; g (log decay) and beta
    [bs, T, Hv]; state_cache [num_slots, Hv, dk, dv], one layer of HybridCache.state, read
    only (unless snapshot_cache is state_cache.unsqueeze(1), NS = 1: an in-place step);
    snapshot_cache [num_slots, NS, Hv, dk, dv] (NS = 0: the pass writes nothing but its
    output); slots, start, num_tokens [bs] int32. Row b starts from state_cache[slots[b]] (zeros when
    start[b] == 0) and writes snapshot j of its slot after token t = j + num_tokens[b] - NS for
    0 <= t < num_tokens[b]; the slot's other snapshots stay as they were. Padding tokens
    output zeros. All float tensors fp32 and contiguous. Slots should be distinct: rows sharing
    one (CUDA-graph padding rows on the scratch slot) leave it an unspecified mix of their
    snapshots. Runs plugins/gated_delta.cu on CUDA once the plugins are built (dk, dv
    multiples of 16 up to 256, gated_delta_kernel_supports), else the reference.
    """
    assert q.dim() == 4, f"q must be [bs, T, Hk, dk], got {tuple(q.shape)}"
    bs, T, Hk, dk = q.shape
    assert Hk > 0 and v.dim() == 4 and v.shape[:2] == (bs, T) and v.shape[2] > 0 and v.shape[2] % Hk == 0, \
        f"v must be [{bs}, {T}, Hv, dv] with Hv a positive multiple of {Hk}, got {tuple(v.shape)}"
    Hv, dv = v.shape[2:]
    assert snapshot_cache.dim() == 5, \
        f"snapshot_cache must be [num_slots, NS, {Hv}, {dk}, {dv}], got {tuple(snapshot_cache.shape)}"
    num_slots, NS = snapshot_cache.shape[:2]
    assert num_slots > 0 or bs * T == 0, "the caches must hold slots"
    shapes = {"q": (q, (bs, T, Hk, dk)), "k": (k, (bs, T, Hk, dk)), "v": (v, (bs, T, Hv, dv)), "g": (g, (bs, T, Hv)),
              "beta": (beta, (bs, T, Hv)), "state_cache": (state_cache, (num_slots, Hv, dk, dv)),
              "snapshot_cache": (snapshot_cache, (num_slots, NS, Hv, dk, dv))}
    for name, (t, shape) in shapes.items():
        assert t.shape == shape, f"{name} must be {list(shape)}, got {list(t.shape)}"
        assert t.dtype == torch.float32, f"{name} must be fp32, got {t.dtype}"
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
        assert t.is_contiguous(), f"{name} must be contiguous"
    for name, t in (("slots", slots), ("start", start), ("num_tokens", num_tokens)):
        assert t.dtype == torch.int32 and t.shape == (bs,) and t.device == q.device and t.is_contiguous(), \
            f"{name} must be contiguous int32 [{bs}] on q's device, got {t.dtype} {tuple(t.shape)} {t.device}"
    assert out_dtype in (torch.float32, torch.bfloat16, torch.float16), \
        f"out_dtype must be fp32, bf16 or fp16, got {out_dtype}"
    aligned = all(t.data_ptr() % 16 == 0 for t in (q, k, v, state_cache) + ((snapshot_cache,) if NS else ()))
    if q.is_cuda and gated_delta_kernel_supports(dk, dv) and aligned and max(bs, Hv) <= GRID_LIMIT and \
            _plugins_loaded():
        out = torch.ops.dflash.gated_delta_recurrent(q, k, v, g, beta, state_cache, snapshot_cache, slots, start,
                                                     num_tokens, out_dtype, outputs)
        return out if outputs else None
    log_fallback("gated_delta_recurrent", q)
    out = gated_delta_recurrent_reference(q, k, v, g, beta, state_cache, snapshot_cache, slots, start, num_tokens,
                                          out_dtype)
    return out if outputs else None


# ----------------------------------------------------------------------------------------------
# Sampling's random numbers (plugins/random.cu): counter-based, so one launch draws every sampled
# row of a step from its own key. The reference is the same 64-bit arithmetic on int64 tensors
# (torch's int64 products wrap as uint64 ones do; right shifts are masked to be logical).

_WEYL, _MIX_A, _MIX_B = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def as_int64(value: int) -> int:
    """An unsigned 64-bit value as the int64 that holds its bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def random_mix(z: int) -> int:
    """plugins/random.h's mix on a Python int, taken mod 2^64 (a bijection of 64-bit values)."""
    m = (1 << 64) - 1
    z &= m
    z = ((z ^ (z >> 30)) * _MIX_A) & m
    z = ((z ^ (z >> 27)) * _MIX_B) & m
    return z ^ (z >> 31)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def random_uniform_reference(keys: torch.Tensor, cols: int, gumbel: bool = False) -> torch.Tensor:
    """plugins/random.h: keys [R] int64 -> [R, cols] fp32, element i of row r a function of
    (keys[r], i) alone: uniforms in (0, 1) (23 random bits, exact in fp32), or with `gumbel`
    the Gumbel(0, 1) noise -log(-log(u))."""
    i = torch.arange(1, cols + 1, dtype=torch.int64, device=keys.device)
    x = keys[:, None] + i * as_int64(_WEYL)
    x = (x ^ _shift_right(x, 30)) * as_int64(_MIX_A)
    x = (x ^ _shift_right(x, 27)) * as_int64(_MIX_B)
    x = x ^ _shift_right(x, 31)
    u = (_shift_right(x, 41).float() + 0.5) * 2.0 ** -23
    return u.log_().neg_().log_().neg_() if gumbel else u


def random_uniform(keys: torch.Tensor, cols: int, gumbel: bool = False) -> torch.Tensor:
    """random_uniform_reference; on CUDA one launch of plugins/random.cu (the uniforms bit for
    bit, the noise to logf's last place)."""
    assert keys.dtype == torch.int64 and keys.dim() == 1 and keys.is_contiguous(), \
        f"keys must be a contiguous int64 [R] tensor, got {keys.dtype} {tuple(keys.shape)}"
    assert isinstance(cols, int) and cols >= 0, f"cols must be an int >= 0, got {cols!r}"
    if keys.is_cuda and _plugins_loaded():
        return torch.ops.dflash.random_uniform(keys, cols, gumbel)
    if keys.is_cuda:
        log_fallback("random_uniform", keys)
    return random_uniform_reference(keys, cols, gumbel)
