"""Fused layer ops (plugins/layer_ops.cu): each reference equals the plain PyTorch formulas its
op fuses bit for bit (CPU, fp32 and bf16), the wrappers reject bad arguments, and the CUDA kernels agree with the
references to within a unit in the last place (cuda marker)."""

import pytest
import torch
from conftest import write_report

from dflash_trt import plugins
from dflash_trt.config import HybridTargetConfig, LayerDims, LinearAttentionDims
from dflash_trt.kv_cache import Batch, KVCache
from dflash_trt.models.layers import MLP, AttentionProjections, RMSNorm, Rotary, apply_rope
from dflash_trt.models.qwen3_5 import GatedAttention, GatedRMSNorm, ZeroCenteredRMSNorm, apply_partial_rope
from dflash_trt.ops import (
    _grouped_rows,
    add_rms_norm,
    add_rms_norm_reference,
    causal_conv,
    causal_conv1d,
    causal_conv_reference,
    gated_rms_norm,
    gated_rms_norm_reference,
    paged_block_attention,
    qk_norm_rope,
    qk_norm_rope_reference,
    rms_norm,
    rms_norm_reference,
    sigmoid_gate,
    sigmoid_gate_reference,
    silu_mul,
    silu_mul_reference,
)

EPS = 1e-6


def dims_for(Hq, Hkv, d, hidden=64, inter=96):
    return LayerDims(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1, num_attention_heads=max(Hq, 1),
                     num_key_value_heads=Hkv, head_dim=d, rms_norm_eps=EPS, rope_theta=1e6, attention_bias=False,
                     max_position_embeddings=4096)


def randomise(module, seed=0):
    """Random weights; norm weights around 1 (as trained ones are), some far from it."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        p.data = (1 + 0.5 * noise if p.dim() == 1 else noise / p.shape[-1] ** 0.5).to(p.dtype)
    return module


def rand(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)


# ----------------------------------------------------------------------------------------------
# CPU: the references round exactly like the plain PyTorch formulas that these ops fuse
# (written out here, so the check does not go through dflash_trt.ops).


def plain_rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(weight.dtype)


def plain_zero_centered_rms_norm(x, weight, eps):
    """Qwen3.5's RMSNorm as a plain PyTorch formula: fp32 throughout, one rounding."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(weight.dtype)


def plain_gated_rms_norm(x, gate, weight, eps):
    """Qwen3.5's gated norm of the linear-attention output, as a plain PyTorch formula."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(weight.dtype) * torch.nn.functional.silu(gate.float())).to(weight.dtype)


def plain_qkv(attn, x, cos, sin):
    d = attn.dims
    q, k, v = attn.qkv_proj(x).split([d.q_size, d.kv_size, d.kv_size], dim=-1)
    q = apply_rope(plain_rms_norm(q.unflatten(-1, (d.num_attention_heads, d.head_dim)), attn.q_norm.weight, EPS),
                   cos, sin)
    k = apply_rope(plain_rms_norm(k.unflatten(-1, (d.num_key_value_heads, d.head_dim)), attn.k_norm.weight, EPS),
                   cos, sin)
    return q, k, v.unflatten(-1, (d.num_key_value_heads, d.head_dim))


def plain_mlp(mlp, x):
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    return mlp.down_proj(torch.nn.functional.silu(gate) * up)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("x_kind", ["fp32 residual", "model dtype"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_rms_norm_reference_is_the_model_rmsnorm(dtype, x_kind):
    norm = randomise(RMSNorm(96, EPS).to(dtype))
    x = rand(2, 5, 96, dtype=torch.float32 if x_kind == "fp32 residual" else dtype, scale=3.0)
    y = rms_norm(x, norm.weight, EPS)
    assert y.dtype == dtype and y.is_contiguous()
    assert torch.equal(y, plain_rms_norm(x, norm.weight, EPS)) and torch.equal(norm(x), y)
    assert torch.equal(rms_norm_reference(x, norm.weight, EPS), y)


@pytest.mark.parametrize("x_kind", ["fp32 residual", "model dtype"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_add_rms_norm_reference_is_the_residual_add_then_rmsnorm(dtype, x_kind):
    norm = randomise(RMSNorm(96, EPS).to(dtype))
    x = rand(3, 96, dtype=torch.float32 if x_kind == "fp32 residual" else dtype, scale=3.0)
    delta = rand(3, 96, dtype=dtype, seed=1)
    s, y = add_rms_norm(x, delta, norm.weight, EPS)
    expected_s = x.float() + delta  # DecoderLayer: `x + self.self_attn(...)` with x fp32
    if x.dtype == torch.float32:
        assert torch.equal(expected_s, x + delta)
    assert s.dtype == torch.float32 and torch.equal(s, expected_s)
    assert y.dtype == dtype and torch.equal(y, plain_rms_norm(expected_s, norm.weight, EPS))
    s_ref, y_ref = add_rms_norm_reference(x, delta, norm.weight, EPS)
    assert torch.equal(s_ref, s) and torch.equal(y_ref, y)


@pytest.mark.parametrize("x_kind", ["fp32 residual", "model dtype"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_zero_centered_references_are_the_qwen3_5_norm_and_its_residual_add(dtype, x_kind):
    norm = ZeroCenteredRMSNorm(96, EPS).to(dtype)
    norm.weight.data = (0.5 * torch.randn(96, generator=torch.Generator().manual_seed(3))).to(dtype)  # offsets from 1
    x = rand(2, 5, 96, dtype=torch.float32 if x_kind == "fp32 residual" else dtype, scale=3.0)
    delta = rand(2, 5, 96, dtype=dtype, seed=1)
    y = rms_norm(x, norm.weight, EPS, zero_centered=True)
    assert y.dtype == dtype and torch.equal(y, plain_zero_centered_rms_norm(x, norm.weight, EPS))
    assert torch.equal(norm(x), y) and torch.equal(rms_norm_reference(x, norm.weight, EPS, zero_centered=True), y)
    assert not torch.equal(y, rms_norm(x, norm.weight, EPS))  # not Qwen3's norm
    s, y = norm.add_and_norm(x, delta)
    assert torch.equal(s, x.float() + delta) and torch.equal(y, plain_zero_centered_rms_norm(s, norm.weight, EPS))


def test_a_gate_s_rows_are_read_as_groups_one_stride_apart():
    packed = torch.zeros(2, 3, 100)  # [bs, T, P]: a projection's output, z its columns 40..71
    z = packed[..., 40:72].unflatten(-1, (4, 8))  # [bs, T, heads, 8]
    assert _grouped_rows(z) == (4, 100)  # 4 heads back to back, tokens a row of P apart
    assert _grouped_rows(torch.zeros(2, 3, 8)) == (6, 48)  # contiguous: one group
    assert _grouped_rows(torch.zeros(4, 5, 6, 8)[:, :3]) == (18, 240)
    assert _grouped_rows(torch.zeros(4, 5, 6, 8)[:, :2, :3]) is None  # groups of 3, but not one stride apart
    assert _grouped_rows(torch.zeros(8, 3).t()) is None  # rows not contiguous


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_gated_rms_norm_reference_is_the_qwen3_5_gated_norm(dtype):
    norm = randomise(GatedRMSNorm(32, EPS).to(dtype))
    x, gate = rand(3, 4, 32, dtype=dtype, scale=3.0), rand(3, 4, 32, dtype=dtype, seed=1, scale=3.0)
    y = gated_rms_norm(x, gate, norm.weight, EPS)
    assert y.dtype == dtype and torch.equal(y, plain_gated_rms_norm(x, gate, norm.weight, EPS))
    assert torch.equal(norm(x, gate), y) and torch.equal(gated_rms_norm_reference(x, gate, norm.weight, EPS), y)
    # the model hands over strided views (heads of a packed projection), read in place
    packed = rand(3, 4, 64, dtype=dtype, seed=2)
    assert torch.equal(norm(x, packed[..., 32:]), plain_gated_rms_norm(x, packed[..., 32:], norm.weight, EPS))


def conv_case(bs, T, C, K, NS, dtype=torch.float32, device="cpu", seed=0):
    """causal_conv's arguments: x a view of a packed projection, garbage in every cache slot
    (row 1 starts a sequence and must ignore its slot's window), distinct slots."""
    packed = rand(bs, T, C + 5, dtype=dtype, device=device, seed=seed, scale=2.0)
    num_slots = bs + 2
    return dict(x=packed[..., 5:], weight=rand(C, K, dtype=dtype, device=device, seed=seed + 1),
                conv_cache=rand(num_slots, K - 1, C, dtype=dtype, device=device, seed=seed + 2),
                snapshots=None if NS == 0 else rand(num_slots, NS, K - 1, C, dtype=dtype, device=device, seed=seed + 3),
                slots=torch.arange(bs, dtype=torch.int32, device=device).flip(0) + 1,
                start=torch.tensor(([5, 0] + [2] * bs)[:bs], dtype=torch.int32, device=device))


@pytest.mark.parametrize("T, NS", [(1, 0), (3, 0), (4, 4), (4, 5), (4, 1)])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_causal_conv_reference_is_the_layer_conv_with_its_window(dtype, T, NS):
    """What GatedDeltaNet.forward does for a ragged pass (ops.causal_conv1d on the
    masked window, then the window(s) scattered to the cache), on every-row-full passes."""
    case = conv_case(3, T, 24, 4, NS, dtype)
    cache, snaps = case["conv_cache"].clone(), None if NS == 0 else case["snapshots"].clone()
    slots = case["slots"].long()
    window = cache[slots].masked_fill((case["start"] == 0)[:, None, None], 0)
    out_old, windows = causal_conv1d(case["x"], window, case["weight"], torch.full((3,), T), max(NS, 1))
    if NS == 0:
        cache[slots] = windows[:, 0]
    else:
        snaps[slots] = windows
    out = causal_conv(**case)
    assert out.dtype == dtype and torch.equal(out, out_old)
    assert torch.equal(case["conv_cache"], cache)  # NS > 0 leaves it alone
    if NS:
        assert torch.equal(case["snapshots"], snaps)


def test_a_verify_narrower_than_the_snapshots_writes_only_the_windows_after_its_tokens():
    """A verify of T tokens with NS > T + 1 snapshots (the block's): the last T + 1 are the
    windows of a verify with exactly T + 1, the older ones (before the pass) stay."""
    T, NS = 4, 9
    narrow, exact = conv_case(3, T, 24, 4, NS), conv_case(3, T, 24, 4, T + 1)
    before = narrow["snapshots"].clone()
    assert torch.equal(causal_conv(**narrow), causal_conv(**exact))
    slots = narrow["slots"].long()
    assert torch.equal(narrow["snapshots"][slots, NS - T - 1:], exact["snapshots"][slots])
    assert torch.equal(narrow["snapshots"][slots, :NS - T - 1], before[slots, :NS - T - 1])


def test_causal_conv_keeps_each_padded_rows_window_after_its_own_tokens():
    """A padded prefill: row b's window in the cache is the K-1 inputs before its
    num_tokens[b]-th token (reaching into its old window, zeros for a new sequence), and
    the outputs are the full-rows conv's (padding outputs included, never read)."""
    case = conv_case(4, 6, 24, 4, 0)
    old_cache = case["conv_cache"].clone()
    num_tokens = torch.tensor([6, 2, 0, 5], dtype=torch.int32)
    full_out = causal_conv(**{**case, "conv_cache": old_cache.clone()})
    out = causal_conv(**case, num_tokens=num_tokens)
    assert torch.equal(out, full_out)
    for b, (slot, start, n) in enumerate(zip(case["slots"].tolist(), case["start"].tolist(), num_tokens.tolist())):
        window = old_cache[slot] if start else torch.zeros_like(old_cache[slot])
        inputs = torch.cat([window, case["x"][b]])  # input t of the row at 3 + t
        assert torch.equal(case["conv_cache"][slot], inputs[n: n + 3]), (b, n)


# (Hq, Hkv, d)
QKV_SHAPES = {"GQA 2:1 d=16": (4, 2, 16), "MHA d=8": (3, 3, 8), "GQA 4:1 d=64": (8, 2, 64), "d=128": (2, 1, 128)}


def projections_case(Hq, Hkv, d, dtype, bs=2, T=5, seed=0):
    """A random AttentionProjections, its input x [bs, T, H] and cos/sin at ragged positions."""
    attn = randomise(AttentionProjections(dims_for(Hq, Hkv, d)).to(dtype), seed)
    x = rand(bs, T, 64, dtype=dtype, seed=seed + 1)
    positions = torch.tensor([3, 1000])[:bs, None] + torch.arange(T)
    cos, sin = Rotary(d, 1e6)(positions, dtype)
    return attn, x, cos, sin


@pytest.mark.parametrize("shape", QKV_SHAPES.values(), ids=QKV_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_qk_norm_rope_reference_is_the_model_qkv(dtype, shape):
    Hq, Hkv, d = shape
    attn, x, cos, sin = projections_case(Hq, Hkv, d, dtype)
    q_ref, k_ref, v_ref = plain_qkv(attn, x, cos, sin)
    qkv = attn.qkv_proj(x).flatten(0, 1)
    q, k, v = qk_norm_rope(qkv, Hq, Hkv, attn.q_norm.weight, attn.k_norm.weight, EPS, cos.flatten(0, 1),
                           sin.flatten(0, 1))
    for got, ref in ((q, q_ref), (k, k_ref), (v, v_ref)):
        assert got.dtype == dtype and got.is_contiguous() and got.shape == ref.flatten(0, 1).shape
        assert torch.equal(got, ref.flatten(0, 1))
    assert v.data_ptr() != qkv.data_ptr()  # a new tensor, not a view of qkv
    for got, ref in zip(attn.qkv(x, cos, sin), (q_ref, k_ref, v_ref)):  # the model's path through the op
        assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_qk_norm_rope_without_queries_is_the_drafter_context_kv(dtype):
    """num_q_heads=0: the drafter's context path gets the K/V half of the projection."""
    Hq, Hkv, d = 4, 2, 16
    attn, x, cos, sin = projections_case(Hq, Hkv, d, dtype)
    _, k_ref, v_ref = plain_qkv(attn, x, cos, sin)
    kv = attn.qkv_proj(x).flatten(0, 1)[:, Hq * d:]  # row stride (Hq + 2 Hkv) d
    q, k, v = qk_norm_rope(kv, 0, Hkv, None, attn.k_norm.weight, EPS, cos.flatten(0, 1), sin.flatten(0, 1))
    assert q is None
    assert torch.equal(k, k_ref.flatten(0, 1)) and torch.equal(v, v_ref.flatten(0, 1))


def ragged_rows(n, num_slots, capacity, seed=0):
    """n distinct (slot, position) pairs in random order, including position 0 and capacity - 1."""
    g = torch.Generator().manual_seed(seed)
    edges = [0 * capacity + 0, (num_slots - 1) * capacity + capacity - 1][:n]
    rest = [i for i in torch.randperm(num_slots * capacity, generator=g).tolist() if i not in edges]
    flat = torch.tensor(edges + rest[:n - len(edges)])
    flat = flat[torch.randperm(n, generator=g)]
    return (flat // capacity).to(torch.int32), (flat % capacity).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_qk_norm_rope_writes_exactly_the_addressed_cache_rows(dtype):
    Hq, Hkv, d = 4, 2, 16
    attn, x, cos, sin = projections_case(Hq, Hkv, d, dtype)
    q_ref, k_ref, v_ref = (t.flatten(0, 1) for t in plain_qkv(attn, x, cos, sin))
    num_layers, num_slots, capacity = 3, 4, 7
    k_all = rand(num_layers, num_slots, capacity, Hkv, d, dtype=dtype, seed=5)
    v_all = rand(num_layers, num_slots, capacity, Hkv, d, dtype=dtype, seed=6)
    k_before, v_before = k_all.clone(), v_all.clone()
    slots, positions = ragged_rows(q_ref.shape[0], num_slots, capacity)
    q, k, v = qk_norm_rope(attn.qkv_proj(x).flatten(0, 1), Hq, Hkv, attn.q_norm.weight, attn.k_norm.weight, EPS,
                           cos.flatten(0, 1), sin.flatten(0, 1), k_all[1], v_all[1], slots, positions)
    assert k is None and v is None and torch.equal(q, q_ref)
    k_before[1, slots.long(), positions.long()] = k_ref
    v_before[1, slots.long(), positions.long()] = v_ref
    assert torch.equal(k_all, k_before) and torch.equal(v_all, v_before)


def gated_attention_case(Hq, Hkv, d, rotary, dtype, bs=2, T=5, seed=0):
    """A random Qwen3.5 GatedAttention (cache layer 1), its input x [bs, T, H] and cos/sin
    [bs, T, rotary] at ragged positions."""
    config = HybridTargetConfig(dims=dims_for(Hq, Hkv, d), linear=LinearAttentionDims(1, 1, 16, 16, 4),
                                layer_types=("full_attention",), partial_rotary_factor=rotary / d, vocab_size=16,
                                tie_word_embeddings=False, eos_token_ids=(0,), has_vision=False)
    attn = randomise(GatedAttention(config, cache_layer=1).to(dtype), seed)
    x = rand(bs, T, 64, dtype=dtype, seed=seed + 1)
    positions = torch.tensor([3, 1000])[:bs, None] + torch.arange(T)
    cos, sin = Rotary(config.rotary_dim, 1e6)(positions, dtype)
    return attn, x, cos, sin


def old_gated_qkv(attn, x, cos, sin):
    """GatedAttention's q/k/v before the fused op: gate split, ZeroCenteredRMSNorm, apply_partial_rope."""
    d = attn.dims
    q_gate, k, v = attn.qkv_proj(x).split([2 * d.q_size, d.kv_size, d.kv_size], dim=-1)
    q, gate = q_gate.unflatten(-1, (d.num_attention_heads, 2 * d.head_dim)).chunk(2, dim=-1)
    q = apply_partial_rope(attn.q_norm(q), cos, sin)
    k = apply_partial_rope(attn.k_norm(k.unflatten(-1, (d.num_key_value_heads, d.head_dim))), cos, sin)
    return q, k, v.unflatten(-1, (d.num_key_value_heads, d.head_dim)), gate


# (Hq, Hkv, head_dim, rotary_dim)
GATED_SHAPES = {"d=256 rope 64": (4, 2, 256, 64), "d=256 full rope": (4, 2, 256, 256), "MHA d=32 rope 8": (3, 3, 32, 8)}


@pytest.mark.parametrize("to_cache", [False, True], ids=["returned", "cache write"])
@pytest.mark.parametrize("shape", GATED_SHAPES.values(), ids=GATED_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_qk_norm_rope_reference_is_the_gated_attention_qkv(dtype, shape, to_cache):
    Hq, Hkv, d, r = shape
    attn, x, cos, sin = gated_attention_case(Hq, Hkv, d, r, dtype)
    q_old, k_old, v_old = (t.flatten(0, 1) for t in old_gated_qkv(attn, x, cos, sin)[:3])
    qkv = attn.qkv_proj(x).flatten(0, 1)
    args = (qkv, Hq, Hkv, attn.q_norm.weight, attn.k_norm.weight, EPS, cos.flatten(0, 1), sin.flatten(0, 1))
    gated = dict(zero_centered=True, rotary_dim=r, q_gate=True)
    for op in (qk_norm_rope, qk_norm_rope_reference):
        if not to_cache:
            q, k, v = op(*args, **gated)
            for got, ref in ((q, q_old), (k, k_old), (v, v_old)):
                assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, ref)
            continue
        k_all = rand(3, 4, 7, Hkv, d, dtype=dtype, seed=5)
        v_all = rand(3, 4, 7, Hkv, d, dtype=dtype, seed=6)
        k_expected, v_expected = k_all.clone(), v_all.clone()
        slots, positions = ragged_rows(q_old.shape[0], 4, 7)
        q, k, v = op(*args, k_all[1], v_all[1], slots, positions, **gated)
        assert k is None and v is None and q.is_contiguous() and torch.equal(q, q_old)
        k_expected[1, slots.long(), positions.long()] = k_old
        v_expected[1, slots.long(), positions.long()] = v_old
        assert torch.equal(k_all, k_expected) and torch.equal(v_all, v_expected)


def old_gated_attention(attn, x, cos, sin, batch, cache):
    """GatedAttention.forward before the fused op, K/V written as its KVCache.write did."""
    q, k, v, gate = old_gated_qkv(attn, x, cos, sin)
    cache.k[attn.cache_layer, batch.slots[:, None], batch.positions] = k
    cache.v[attn.cache_layer, batch.slots[:, None], batch.positions] = v
    out = paged_block_attention(q, cache.k[attn.cache_layer], cache.v[attn.cache_layer], batch.slots.int(),
                                (batch.start + batch.num_tokens).int(), batch.start.int(), causal=True,
                                scale=attn.scale, max_keys=batch.max_end)
    return attn.o_proj(out.flatten(2) * torch.sigmoid(gate.flatten(2)))


# (slots, start, num_tokens, width)
GATED_PASSES = {"ragged prefill": ([2, 0], [0, 6], [5, 3], 5), "verify": ([1, 3], [7, 2], [4, 4], 4),
                "AR step": ([0, 3], [9, 1], [1, 1], 1)}


@pytest.mark.parametrize("rotary", [64, 256])
@pytest.mark.parametrize("rows", GATED_PASSES.values(), ids=GATED_PASSES.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_gated_attention_outputs_and_writes_what_it_did_before_the_fused_op(dtype, rows, rotary):
    """Same output, and exactly the cache rows KVCache.write wrote (a prefill's padding included)."""
    slots, start, num_tokens, width = rows
    batch = Batch.make(slots, start, num_tokens, width, "cpu")
    attn, x, _, _ = gated_attention_case(4, 2, 256, rotary, dtype, T=width)
    cos, sin = Rotary(rotary, 1e6)(batch.positions, dtype)
    caches = []
    for _ in range(2):  # the same garbage in both, so that untouched rows compare too
        cache = KVCache(2, 4, 16, 2, 256, dtype, "cpu")
        cache.k.copy_(rand(*cache.k.shape, dtype=dtype, seed=7))
        cache.v.copy_(rand(*cache.v.shape, dtype=dtype, seed=8))
        caches.append(cache)
    old = old_gated_attention(attn, x, cos, sin, batch, caches[0])
    lengths = (batch.slots.int(), (batch.start + batch.num_tokens).int(), batch.start.int(), batch.num_tokens.int(),
               batch.token_rows())  # as Qwen3_5Model.forward makes them
    new = attn(x, cos, sin, lengths, batch, caches[1]).value()
    assert torch.equal(new, old)
    assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@torch.no_grad()
def test_silu_mul_reference_is_the_model_mlp(dtype):
    mlp = randomise(MLP(dims_for(4, 2, 16)).to(dtype))
    x = rand(2, 5, 64, dtype=dtype, scale=2.0)
    gate_up = mlp.gate_up_proj(x)
    out = silu_mul(gate_up)
    assert out.dtype == dtype and out.shape == (2, 5, 96) and out.is_contiguous()
    assert torch.equal(mlp.down_proj(out), plain_mlp(mlp, x)) and torch.equal(mlp(x).value(), plain_mlp(mlp, x))
    assert torch.equal(silu_mul_reference(gate_up), out)


def bad_calls():
    w = torch.ones(16)
    x = torch.randn(3, 16)
    qkv, cs = torch.randn(3, (2 + 2 * 1) * 8), torch.randn(3, 8)
    w8 = torch.ones(8)
    cache = torch.zeros(2, 4, 1, 8)
    i32 = torch.zeros(3, dtype=torch.int32)
    return {
        "rms_norm x width": ("x must be", lambda: rms_norm(torch.randn(3, 15), w, EPS)),
        "rms_norm fp16 x, fp32 weight": ("x must be fp32", lambda: rms_norm(x.half(), w, EPS)),
        "rms_norm 2-D weight": ("weight must be", lambda: rms_norm(x, w[None], EPS)),
        "rms_norm strided x": ("x must be contiguous", lambda: rms_norm(torch.randn(16, 3).t(), torch.ones(16), EPS)),
        "add_rms_norm delta shape": ("delta must have x's shape", lambda: add_rms_norm(x, x[:2], w, EPS)),
        "add_rms_norm delta dtype": ("delta must have weight's", lambda: add_rms_norm(x, x.bfloat16(), w, EPS)),
        "causal_conv no snapshots": ("snapshots must be",
                                     lambda: causal_conv(**{**conv_case(2, 3, 8, 4, 1),
                                                            "snapshots": torch.zeros(4, 0, 3, 8)})),
        "causal_conv weight taps": ("conv_cache must be",
                                    lambda: causal_conv(**{**conv_case(2, 3, 8, 4, 0), "weight": torch.ones(8, 3)})),
        "causal_conv int64 slots": ("slots must be",
                                    lambda: causal_conv(**{**conv_case(2, 1, 8, 4, 0), "slots": torch.zeros(2).long()})),
        "causal_conv strided slots": ("slots must be contiguous", lambda: causal_conv(**{
            **conv_case(2, 1, 8, 4, 0), "slots": torch.zeros(2, 2, dtype=torch.int32)[:, 0]})),
        "causal_conv no channels": ("x must have channels", lambda: causal_conv(**conv_case(2, 1, 0, 4, 0))),
        "causal_conv ragged snapshots": (r"num_tokens \(ragged rows\) only", lambda: causal_conv(
            **conv_case(2, 3, 8, 4, 1), num_tokens=torch.ones(2, dtype=torch.int32))),
        "gated_rms_norm gate shape": ("gate must have x's shape", lambda: gated_rms_norm(x, x[:2], w, EPS)),
        "gated_rms_norm strided gate": ("gate's rows must be contiguous",
                                        lambda: gated_rms_norm(x, torch.randn(16, 3).t(), w, EPS)),
        "qk qkv width": ("qkv must be", lambda: qk_norm_rope(qkv[:, 1:], 2, 1, w8, w8, EPS, cs, cs)),
        "qk cos dtype": ("cos", lambda: qk_norm_rope(qkv, 2, 1, w8, w8, EPS, cs.double(), cs.double())),
        "qk k_weight size": ("k_weight must be", lambda: qk_norm_rope(qkv, 2, 1, w8, w, EPS, cs, cs)),
        "qk missing q_weight": ("q_weight", lambda: qk_norm_rope(qkv, 2, 1, None, w8, EPS, cs, cs)),
        "qk cache without slots": ("go together", lambda: qk_norm_rope(qkv, 2, 1, w8, w8, EPS, cs, cs, cache, cache)),
        "qk int64 positions": ("positions must be", lambda: qk_norm_rope(qkv, 2, 1, w8, w8, EPS, cs, cs, cache, cache,
                                                                         i32, i32.long())),
        "qk empty cache": ("k_cache must be", lambda: qk_norm_rope(qkv, 2, 1, w8, w8, EPS, cs, cs, cache[:0],
                                                                   cache, i32, i32)),
        "qk cache heads": ("k_cache must be", lambda: qk_norm_rope(qkv, 2, 1, w8, w8, EPS, cs, cs, cache[..., None, :],
                                                                   cache, i32, i32)),
        "qk odd rotary_dim": ("rotary_dim must be", lambda: qk_norm_rope(qkv, 2, 1, w8, w8, EPS, cs[:, :3], cs[:, :3],
                                                                         rotary_dim=3)),
        "qk rotary_dim over head_dim": ("rotary_dim must be",
                                        lambda: qk_norm_rope(qkv, 2, 1, w8, w8, EPS, x, x, rotary_dim=16)),
        "qk cos not rotary_dim wide": ("cos/sin must be", lambda: qk_norm_rope(qkv, 2, 1, w8, w8, EPS, cs, cs,
                                                                               rotary_dim=4)),
        "qk q_gate without gate rows": ("qkv must be", lambda: qk_norm_rope(qkv, 2, 1, w8, w8, EPS, cs, cs,
                                                                            q_gate=True)),
        "rms_norm empty weight": ("weight must be a contiguous \\[H > 0\\]",
                                  lambda: rms_norm(torch.randn(2, 0), torch.randn(0), EPS)),
        "silu_mul odd width": ("gate_up must be", lambda: silu_mul(torch.randn(3, 7))),
        "silu_mul strided": ("gate_up must be contiguous", lambda: silu_mul(torch.randn(8, 3).t())),
        "sigmoid_gate shapes": ("gate its shape", lambda: sigmoid_gate(torch.randn(2, 4, 8), torch.randn(2, 4, 16))),
        "sigmoid_gate gate dtype": ("gate its shape and dtype", lambda: sigmoid_gate(torch.randn(2, 4, 8),
                                                                                   torch.randn(2, 4, 8).half())),
        "sigmoid_gate strided x": ("x must be contiguous", lambda: sigmoid_gate(torch.randn(4, 2, 8).transpose(0, 1),
                                                                             torch.randn(2, 4, 8))),
        "sigmoid_gate strided gate": ("gate's last dim contiguous",
                                      lambda: sigmoid_gate(torch.randn(2, 4, 8), torch.randn(2, 8, 4).transpose(1, 2))),
    }


@pytest.mark.parametrize("case", bad_calls().values(), ids=bad_calls().keys())
def test_wrappers_reject_bad_arguments_naming_them(case):
    message, call = case
    with pytest.raises(AssertionError, match=message):
        call()


def test_layer_ops_are_part_of_the_plugin_library():
    # The nvcc compile check (tests/test_ops.py) covers every plugins/*.cu, this one included.
    assert "layer_ops.cu" in plugins.SOURCES
    assert (plugins.plugin_dir() / "layer_ops.cu").is_file()


# ----------------------------------------------------------------------------------------------
# CUDA kernels against the references run on the same CUDA tensors (torch's own kernels).
#
# Every rounding step of the kernels is torch's (fp32 op, then round to the dtype), and the
# products of two bf16/fp16 values are exact in fp32, so all steps but one are bit-exact. The
# exception is an RMSNorm's fp32 sum of squares, summed in another order than torch's: its
# last bits, and so rsqrt's, may differ, which flips the rounding of n = s * rsqrt(.) to the
# dtype where n sits next to a rounding boundary (about 2^-16 of bf16 elements, 2^-13 of
# fp16). One flip moves n by ulp(n), so y = round(w * n) by |w| ulp(n) plus its own rounding:
# at most 2 ulp(y) (a zero-centred norm rounds only y = round(n (1 + w)): at most 1 ulp(y)).
# RoPE mixes two normalised values h_i, h_j (|cos|, |sin| <= 1) and rounds three times, so
# there a flip moves the output by at most 4 ulp of the head's largest |h|; channels past
# rotary_dim are h itself.
# Besides that bound, flips must stay rare: a wrong rounding order would change a large share
# of the elements, so at most 1e-3 of them may differ at all. silu_mul has no reduction and
# must be within 1 ulp. The totals (elements that differ, the worst error in ulps) are printed
# at the end of the module.

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
MIN_EXPONENT = {torch.bfloat16: -133, torch.float16: -24}  # the smallest subnormal
MAX_DIFFERING = 1e-3
STATS = {}  # (op, dtype name) -> [elements, differing, over 1 ulp, worst ulps, worst abs]
CUDA_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of `dtype` at |t|, in fp32."""
    _, e = torch.frexp(t.float())  # |t| = m 2^e, 0.5 <= m < 1
    step = torch.ldexp(torch.ones_like(e, dtype=torch.float32), (e - 1 - MANTISSA_BITS[dtype]).clamp(
        min=MIN_EXPONENT[dtype]))
    return torch.where(t == 0, 2.0 ** MIN_EXPONENT[dtype], step)


def check_close(op: str, got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor):
    """got within `bound` of ref everywhere, and rarely different at all; records the totals."""
    dtype = ref.dtype
    assert got.dtype == dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
    err = (got.float() - ref.float()).abs()
    unit = ulp(ref, dtype)
    differing = int((err > 0).sum())
    stats = STATS.setdefault((op, str(dtype).removeprefix("torch.")), [0, 0, 0, 0.0, 0.0])
    stats[0] += ref.numel()
    stats[1] += differing
    stats[2] += int((err > unit).sum())
    stats[3] = max(stats[3], float((err / unit).max()) if ref.numel() else 0.0)
    stats[4] = max(stats[4], float(err.max()) if ref.numel() else 0.0)
    worst = (err - bound).argmax() if ref.numel() else 0
    assert bool((err <= bound).all()), \
        f"{op}: error {err.flatten()[worst]} > bound {bound.flatten()[worst]} at {worst} (ref {ref.flatten()[worst]})"
    assert differing <= MAX_DIFFERING * ref.numel() + 2, f"{op}: {differing} of {ref.numel()} elements differ"


@pytest.fixture(scope="module", autouse=True)
def report_stats(request):
    yield
    if not STATS:
        return
    lines = ["layer ops, kernel vs reference: op dtype elements differing >1ulp worst-ulps worst-abs"]
    for (op, dtype), (n, differing, over, worst_ulp, worst_abs) in sorted(STATS.items()):
        lines.append(f"  {op:<14} {dtype:<9} {n:>10} {differing:>8} {over:>6} {worst_ulp:>8.2f} {worst_abs:.3g}")
    write_report(request, lines, "DFLASH_LAYER_OPS_STATS")


def cuda_norm_weight(H, dtype, seed):
    return (1 + 0.5 * rand(H, device="cuda", seed=seed)).to(dtype)


ROWS = [1, 7, 33, 513]
HIDDEN = [256, 1004, 4096, 8192]  # 1004: not a multiple of 8, the scalar path


@pytest.mark.cuda
@pytest.mark.parametrize("norm", ["qwen3", "zero-centered"])
@pytest.mark.parametrize("x_kind", ["fp32", "model"])
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES.values(), ids=CUDA_DTYPES.keys())
def test_cuda_rms_norms_match_the_reference(dtype, N, H, x_kind, norm):
    assert plugins.load() is not None
    zc = norm == "zero-centered"
    w = cuda_norm_weight(H, dtype, seed=H) - (1 if zc else 0)  # a zero-centred weight is an offset from 1
    x = rand(N, H, dtype=torch.float32 if x_kind == "fp32" else dtype, device="cuda", seed=N, scale=4.0)
    delta = rand(N, H, dtype=dtype, device="cuda", seed=N + 1)
    two_ulp = lambda ref: 2 * ulp(ref, dtype)  # noqa: E731
    y_ref = rms_norm_reference(x, w, EPS, zc)
    check_close("rms_norm", rms_norm(x, w, EPS, zc), y_ref, two_ulp(y_ref))
    s, y = add_rms_norm(x, delta, w, EPS, zc)
    s_ref, y_ref = add_rms_norm_reference(x, delta, w, EPS, zc)
    assert s.dtype == torch.float32 and torch.equal(s, s_ref)
    check_close("add_rms_norm", y, y_ref, two_ulp(y_ref))


@pytest.mark.cuda
@pytest.mark.parametrize("H", [128, 1004])  # Qwen3.5's value head; the scalar path
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES.values(), ids=CUDA_DTYPES.keys())
def test_cuda_gated_rms_norm_matches_the_reference(dtype, N, H):
    assert plugins.load() is not None
    w = cuda_norm_weight(H, dtype, seed=H)
    x = rand(N, H, dtype=dtype, device="cuda", seed=N, scale=4.0)
    gate = rand(N, H, dtype=dtype, device="cuda", seed=N + 1, scale=4.0)
    y_ref = gated_rms_norm_reference(x, gate, w, EPS)
    check_close("gated_rms_norm", gated_rms_norm(x, gate, w, EPS), y_ref, 2 * ulp(y_ref, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("width", [1032, 1027], ids=["16-byte rows", "unaligned rows"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES.values(), ids=CUDA_DTYPES.keys())
def test_cuda_gated_rms_norm_reads_a_gate_slice_in_place(dtype, width):
    packed = rand(2, 3, width, dtype=dtype, device="cuda", seed=3, scale=4.0)  # [bs, T, P]: in_proj's output
    gate = packed[..., 512:1024].unflatten(-1, (4, 128))  # z: 4 heads of 128
    x = rand(2, 3, 4, 128, dtype=dtype, device="cuda", seed=4, scale=4.0)
    w = cuda_norm_weight(128, dtype, seed=5)
    y = gated_rms_norm(x, gate, w, EPS)
    if width % 8 == 0:  # the same 16-byte loads as the copy's, so the same sums
        assert torch.equal(y, gated_rms_norm(x, gate.contiguous(), w, EPS))
    else:  # element loads (the copy's rows are aligned): the sums in another order
        y_ref = gated_rms_norm_reference(x, gate, w, EPS)
        check_close("gated_rms_norm", y, y_ref, 2 * ulp(y_ref, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 1, 8192, 4, 0), (8, 1, 8192, 4, 0), (4, 16, 8192, 4, 16), (4, 8, 8192, 4, 16),
                                   (3, 4, 1000, 4, 5), (3, 2, 64, 2, 1), (2, 3, 96, 8, 0)],
                         ids=["qwen AR b1", "qwen AR b8", "qwen verify", "qwen narrow verify", "NS = T + 1", "K=2",
                              "K=8"])
@pytest.mark.parametrize("dtype", CUDA_DTYPES.values(), ids=CUDA_DTYPES.keys())
def test_cuda_causal_conv_equals_the_reference_bit_for_bit(dtype, shape):
    """Every step rounds as torch does and the windows are copies: no tolerance."""
    assert plugins.load() is not None
    case = conv_case(*shape, dtype=dtype, device="cuda")
    ref = {**case, "conv_cache": case["conv_cache"].clone(),
           "snapshots": None if case["snapshots"] is None else case["snapshots"].clone()}
    out = causal_conv(**case)
    ref_out = causal_conv_reference(**ref)
    assert torch.equal(out, ref_out)
    assert torch.equal(case["conv_cache"], ref["conv_cache"])
    if case["snapshots"] is not None:
        assert torch.equal(case["snapshots"], ref["snapshots"])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES.values(), ids=CUDA_DTYPES.keys())
def test_cuda_causal_conv_of_padded_rows_equals_the_reference_bit_for_bit(dtype):
    assert plugins.load() is not None
    case = conv_case(5, 98, 8192, 4, 0, dtype=dtype, device="cuda")
    num_tokens = torch.tensor([98, 1, 0, 57, 200], dtype=torch.int32, device="cuda")  # 200: clamped to the width
    ref_cache = case["conv_cache"].clone()
    out = causal_conv(**case, num_tokens=num_tokens)
    ref_out = causal_conv_reference(**{**case, "conv_cache": ref_cache}, num_tokens=num_tokens)
    assert torch.equal(out, ref_out)
    assert torch.equal(case["conv_cache"], ref_cache)


@pytest.mark.cuda
def test_cuda_rms_norm_reads_rows_that_are_not_16_byte_aligned():
    N, H, dtype = 5, 4096, torch.bfloat16
    w = cuda_norm_weight(H, dtype, seed=1)
    x = rand(N * H + 1, device="cuda")[1:].view(N, H)  # contiguous, 4 bytes off
    delta = rand(N * H + 1, dtype=dtype, device="cuda", seed=2)[1:].view(N, H)
    y_ref = rms_norm_reference(x, w, EPS)
    check_close("rms_norm", rms_norm(x, w, EPS), y_ref, 2 * ulp(y_ref, dtype))
    s, y = add_rms_norm(x, delta, w, EPS)
    s_ref, y_ref = add_rms_norm_reference(x, delta, w, EPS)
    assert torch.equal(s, s_ref)
    check_close("add_rms_norm", y, y_ref, 2 * ulp(y_ref, dtype))


def qkv_case(N, Hq, Hkv, d, dtype, seed=0, zero_centered=False, rotary_dim=0, q_gate=False):
    """qkv [N, W] (with q_gate, each query head followed by a gate head), norm weights (a
    zero-centred one an offset from 1), cos/sin [N, rotary_dim or d] at random positions."""
    qkv = rand(N, ((2 if q_gate else 1) * Hq + 2 * Hkv) * d, dtype=dtype, device="cuda", seed=seed, scale=2.0)
    offset = 1 if zero_centered else 0
    q_w = cuda_norm_weight(d, dtype, seed=seed + 1) - offset if Hq else None
    k_w = cuda_norm_weight(d, dtype, seed=seed + 2) - offset
    positions = torch.randint(0, 40000, (N,), generator=torch.Generator().manual_seed(seed)).cuda()
    cos, sin = Rotary(rotary_dim or d, 1e6)(positions, dtype)
    return qkv, q_w, k_w, cos, sin


def rope_bound(qkv, first_head, heads, weight, ref, d, zero_centered=False):
    """4 ulp of the largest normalised |h| of each head (see the note above), at least 1 ulp(ref)."""
    h = rms_norm_reference(qkv[:, first_head * d:(first_head + heads) * d].unflatten(-1, (heads, d)), weight, EPS,
                           zero_centered)
    scale = h.float().abs().amax(-1, keepdim=True)
    return torch.maximum(4 * ulp(scale, ref.dtype), ulp(ref, ref.dtype))


def without_gates(qkv, Hq, d):
    """A q_gate layout's qkv without the gate after each query head: [N, (Hq + 2 Hkv) d]."""
    heads = qkv.unflatten(-1, (-1, d))
    return torch.cat([heads[:, :2 * Hq:2], heads[:, 2 * Hq:]], dim=1).flatten(1)


def check_qk(N, Hq, Hkv, d, qkv, q_w, k_w, q, k, q_ref, k_ref, zero_centered=False, q_gate=False):
    qkv = without_gates(qkv, Hq, d) if q_gate else qkv
    if Hq:
        check_close("qk_norm_rope q", q, q_ref, rope_bound(qkv, 0, Hq, q_w, q_ref, d, zero_centered))
    else:
        assert q is None and q_ref is None
    check_close("qk_norm_rope k", k, k_ref, rope_bound(qkv, Hq, Hkv, k_w, k_ref, d, zero_centered))


@pytest.mark.cuda
@pytest.mark.parametrize("to_cache", [False, True], ids=["returned", "cache write"])
@pytest.mark.parametrize("heads", [(0, 8), (32, 8), (16, 8), (4, 2)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES.values(), ids=CUDA_DTYPES.keys())
def test_cuda_qk_norm_rope_matches_the_reference(dtype, N, d, heads, to_cache):
    check_qk_norm_rope_case(dtype, N, *heads, d, to_cache)


# (head_dim, rotary_dim, zero_centered, q_gate): Qwen3.5/3.6's gated attention (head_dim 256,
# rotary_dim 64), and each extension apart; rotary_dim 192 turns chunks whose partner is not j ^ 3.
QK_VARIANTS = {
    "d256": (256, 0, False, False),
    "qwen3.5 rope64": (256, 64, True, True),
    "qwen3.5 full rope": (256, 256, True, True),
    "d256 rope192 gated": (256, 192, False, True),
    "d256 rope128 zero-centred": (256, 128, True, False),
    "d128 rope64 gated zero-centred": (128, 64, True, True),
}


@pytest.mark.cuda
@pytest.mark.parametrize("to_cache", [False, True], ids=["returned", "cache write"])
@pytest.mark.parametrize("heads", [(0, 2), (16, 4), (4, 2)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}")
@pytest.mark.parametrize("variant", QK_VARIANTS.values(), ids=QK_VARIANTS.keys())
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES.values(), ids=CUDA_DTYPES.keys())
def test_cuda_gated_partial_qk_norm_rope_matches_the_reference(dtype, N, variant, heads, to_cache):
    d, rotary_dim, zero_centered, q_gate = variant
    check_qk_norm_rope_case(dtype, N, *heads, d, to_cache, zero_centered=zero_centered, rotary_dim=rotary_dim,
                            q_gate=q_gate)


def check_qk_norm_rope_case(dtype, N, Hq, Hkv, d, to_cache, zero_centered=False, rotary_dim=0, q_gate=False):
    """The kernel against the reference on the same inputs, k and v returned or written to a cache."""
    assert plugins.load() is not None
    variant = dict(zero_centered=zero_centered, rotary_dim=rotary_dim, q_gate=q_gate)
    qkv, q_w, k_w, cos, sin = qkv_case(N, Hq, Hkv, d, dtype, seed=N + d, **variant)
    bound = dict(zero_centered=zero_centered, q_gate=q_gate)
    if not to_cache:
        q, k, v = qk_norm_rope(qkv, Hq, Hkv, q_w, k_w, EPS, cos, sin, **variant)
        q_ref, k_ref, v_ref = qk_norm_rope_reference(qkv, Hq, Hkv, q_w, k_w, EPS, cos, sin, **variant)
        assert k.is_contiguous() and v.is_contiguous() and (q is None or q.is_contiguous())
        assert torch.equal(v, v_ref)
        check_qk(N, Hq, Hkv, d, qkv, q_w, k_w, q, k, q_ref, k_ref, **bound)
        return
    # A layer view of 5-D caches; rows of other layers, slots and positions must stay as they are.
    num_slots, capacity = 6, 100
    k_all = rand(3, num_slots, capacity, Hkv, d, dtype=dtype, device="cuda", seed=7)
    v_all = rand(3, num_slots, capacity, Hkv, d, dtype=dtype, device="cuda", seed=8)
    k_ref_all, v_ref_all = k_all.clone(), v_all.clone()
    slots, positions = (t.cuda() for t in ragged_rows(N, num_slots, capacity, seed=N))
    q, k, v = qk_norm_rope(qkv, Hq, Hkv, q_w, k_w, EPS, cos, sin, k_all[1], v_all[1], slots, positions, **variant)
    assert k is None and v is None
    q_ref, _, _ = qk_norm_rope_reference(qkv, Hq, Hkv, q_w, k_w, EPS, cos, sin, k_ref_all[1], v_ref_all[1], slots,
                                         positions, **variant)
    written = torch.zeros(3, num_slots, capacity, dtype=torch.bool, device="cuda")
    written[1, slots.long(), positions.long()] = True
    assert torch.equal(k_all[~written], k_ref_all[~written]) and torch.equal(v_all, v_ref_all)
    index = (1, slots.long(), positions.long())
    check_qk(N, Hq, Hkv, d, qkv, q_w, k_w, q, k_all[index], q_ref, k_ref_all[index], **bound)


@pytest.mark.cuda
@pytest.mark.parametrize("inter", [256, 100, 4096, 12288])  # 100: not a multiple of 8, the scalar path
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES.values(), ids=CUDA_DTYPES.keys())
def test_cuda_silu_mul_matches_the_reference(dtype, N, inter):
    assert plugins.load() is not None
    gate_up = rand(N, 2 * inter, dtype=dtype, device="cuda", seed=N, scale=3.0)
    ref = silu_mul_reference(gate_up)
    check_close("silu_mul", silu_mul(gate_up), ref, ulp(ref, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("heads, head_dim, extra", [(16, 256, 2304), (32, 128, 0), (4, 100, 8), (2, 64, 3)])
@pytest.mark.parametrize("N", ROWS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES.values(), ids=CUDA_DTYPES.keys())
def test_cuda_sigmoid_gate_matches_the_reference(dtype, N, heads, head_dim, extra):
    # the gate as a view of a q projection's output (query rows, then gate rows, per head, then
    # `extra` k/v columns); head_dim 100 or a row stride not a multiple of 8: the scalar path
    assert plugins.load() is not None
    qkv = rand(N, heads * 2 * head_dim + extra, dtype=dtype, device="cuda", seed=N, scale=4.0)
    gate = qkv[:, :heads * 2 * head_dim].unflatten(-1, (heads, 2 * head_dim))[..., head_dim:]
    x = rand(N, heads, head_dim, dtype=dtype, device="cuda", seed=N + 1, scale=2.0)
    ref = sigmoid_gate_reference(x, gate)
    check_close("sigmoid_gate", sigmoid_gate(x, gate), ref, ulp(ref, dtype))


# ----------------------------------------------------------------------------------------------
# CUDA graphs: capture once, change the inputs in place, replay.


def replay_after(run, update):
    """Capture run() in a CUDA graph, call update() to change its inputs in place, replay."""
    run()  # build and first launches outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    update()
    graph.replay()
    torch.cuda.synchronize()
    return out


def refill(*tensors, seed):
    for i, t in enumerate(tensors):
        t.copy_(rand(*t.shape, dtype=t.dtype, device="cuda", seed=seed + i, scale=2.0))


@pytest.mark.cuda
def test_cuda_rms_norms_replay_in_a_cuda_graph():
    dtype = torch.bfloat16
    w = cuda_norm_weight(4096, dtype, seed=3)
    x = rand(16, 4096, device="cuda")
    delta = rand(16, 4096, dtype=dtype, device="cuda", seed=1)
    y, (s, y2) = replay_after(lambda: (rms_norm(x, w, EPS), add_rms_norm(x, delta, w, EPS)),
                              lambda: refill(x, delta, seed=10))
    y_ref = rms_norm_reference(x, w, EPS)
    s_ref, y2_ref = add_rms_norm_reference(x, delta, w, EPS)
    check_close("rms_norm", y, y_ref, 2 * ulp(y_ref, dtype))
    assert torch.equal(s, s_ref)
    check_close("add_rms_norm", y2, y2_ref, 2 * ulp(y2_ref, dtype))


# Qwen3-8B's attention, and Qwen3.5-9B's gated one (head_dim 256, rotary_dim 64), at a verify's 16 rows
QK_GRAPH_CASES = {"qwen3": (32, 8, 128, {}), "qwen3.5 gated": (16, 4, 256, dict(zero_centered=True, rotary_dim=64,
                                                                                q_gate=True))}


@pytest.mark.cuda
@pytest.mark.parametrize("Hq, Hkv, d, variant", QK_GRAPH_CASES.values(), ids=QK_GRAPH_CASES.keys())
def test_cuda_qk_norm_rope_replays_in_a_cuda_graph_with_new_slots_and_positions(Hq, Hkv, d, variant):
    dtype, N = torch.bfloat16, 16
    qkv, q_w, k_w, cos, sin = qkv_case(N, Hq, Hkv, d, dtype, **variant)
    k_cache = torch.zeros(2, 4, 64, Hkv, d, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots, positions = (t.cuda() for t in ragged_rows(N, 4, 64, seed=1))

    def update():
        refill(qkv, cos, sin, seed=20)
        new_slots, new_positions = ragged_rows(N, 4, 64, seed=2)
        slots.copy_(new_slots)
        positions.copy_(new_positions)
        k_cache.zero_()
        v_cache.zero_()

    q, _, _ = replay_after(lambda: qk_norm_rope(qkv, Hq, Hkv, q_w, k_w, EPS, cos, sin, k_cache[1], v_cache[1], slots,
                                                positions, **variant), update)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    q_ref, _, _ = qk_norm_rope_reference(qkv, Hq, Hkv, q_w, k_w, EPS, cos, sin, k_ref[1], v_ref[1], slots, positions,
                                         **variant)
    index = (1, slots.long(), positions.long())
    check_qk(N, Hq, Hkv, d, qkv, q_w, k_w, q, k_cache[index], q_ref, k_ref[index],
             zero_centered=variant.get("zero_centered", False), q_gate=variant.get("q_gate", False))
    k_cache[index] = k_ref[index]  # the rest must be untouched (zero)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.cuda
def test_cuda_sigmoid_gate_replays_in_a_cuda_graph():
    qkv = rand(16, 16 * 512 + 2304, dtype=torch.bfloat16, device="cuda")
    gate = qkv[:, :16 * 512].unflatten(-1, (16, 512))[..., 256:]
    x = rand(16, 16, 256, dtype=torch.bfloat16, device="cuda", seed=1)
    out = replay_after(lambda: sigmoid_gate(x, gate), lambda: refill(qkv, x, seed=31))
    ref = sigmoid_gate_reference(x, gate)
    check_close("sigmoid_gate", out, ref, ulp(ref, torch.bfloat16))


@pytest.mark.cuda
def test_cuda_silu_mul_replays_in_a_cuda_graph():
    gate_up = rand(16, 2 * 12288, dtype=torch.bfloat16, device="cuda")
    out = replay_after(lambda: silu_mul(gate_up), lambda: refill(gate_up, seed=30))
    ref = silu_mul_reference(gate_up)
    check_close("silu_mul", out, ref, ulp(ref, torch.bfloat16))
