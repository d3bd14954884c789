"""The skinny matmul (plugins/gemv.cu): its reference sums in fp32 and rounds once, the wrapper
rejects bad arguments, models route their linears through ops.linear unchanged on the CPU,
and on the GPU the kernel agrees with the reference (to a unit in the last place for one row;
within the tensor cores' fp32 sum for 2 to 16) for every row count it takes, ragged feature
counts and each warp layout, and ops.linear takes it for up to 16 rows (cuda marker). The add +
norm a one-row GEMV runs after its matmul (ops.linear_add_rms_norm) has the bits of the two ops
it replaces, in the kernel and in the models' AR step."""

import pytest
import torch
import torch.nn.functional as F
from test_layer_ops import dims_for, rand, randomise

from dflash_trt import ops
from dflash_trt.benchmark import random_weights as rw
from dflash_trt.models.layers import MLP, Linear, PackedLinear, RMSNorm


@pytest.mark.parametrize("bias", [False, True])
def test_reference_sums_in_fp32_and_rounds_once(bias):
    x, w = rand(3, 40, dtype=torch.bfloat16, seed=1), rand(7, 40, dtype=torch.bfloat16, seed=2)
    b = rand(7, dtype=torch.bfloat16, seed=3) if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    y = ops.gemv_reference(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 7)
    # one rounding of a (nearly) exact sum: within half a unit in the last place of bf16
    assert ((y.double() - exact).abs() <= exact.abs() * (2**-8 + 1e-5)).all()


def test_linear_layers_compute_what_nn_linear_does_on_the_cpu():
    layer = randomise(Linear(40, 7, bias=True))
    x = rand(2, 3, 40, seed=4)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    mlp = randomise(MLP(dims_for(4, 2, 16)))
    assert isinstance(mlp.gate_up_proj, PackedLinear) and isinstance(mlp.down_proj, Linear)
    x = rand(1, 1, 64, seed=5)
    expected = F.linear(ops.silu_mul(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    assert torch.equal(mlp(x).value(), expected)


def test_linear_takes_empty_inputs_as_nn_linear_does():
    for x, w in ((torch.ones(2, 0), torch.ones(3, 0)), (torch.ones(0, 4), torch.ones(3, 4))):
        assert torch.equal(ops.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 40), (2, 3, 40)])
def test_linear_into_a_buffer_computes_what_nn_linear_does(bias, shape):
    # a decode graph's logits go into a buffer every graph shares (graphs.GraphedPasses)
    w, b, x = rand(7, 40, seed=2), rand(7, seed=3) if bias else None, rand(*shape, seed=1)
    buffer = torch.full((8 * 7,), float("nan"))
    out = buffer[: x[..., 0].numel() * 7].view(*shape[:-1], 7)
    y = ops.linear(x, w, b, out=out)
    assert y.data_ptr() == buffer.data_ptr() and y.shape == (*shape[:-1], 7)
    torch.testing.assert_close(y, F.linear(x, w, b))
    with pytest.raises(AssertionError, match="out must be a contiguous torch.float32 \\(3, 7\\)"):
        ops.linear(x[0] if len(shape) == 3 else x, w, b, out=torch.empty(3, 8))


@pytest.mark.parametrize("args, message", [
    ((torch.ones(2, 8), torch.ones(3, 16)), "x must be \\[M, K\\] and weight \\[N, K\\]"),
    ((torch.ones(8), torch.ones(3, 8)), "x must be \\[M, K\\]"),
    ((torch.ones(2, 8), torch.ones(3, 8, dtype=torch.float64)), "share a dtype"),
    ((torch.ones(2, 8), torch.ones(3, 8), torch.ones(4)), "bias be \\[N\\]"),
    ((torch.ones(2, 8), torch.ones(3, 8, device="meta")), "weight and bias must be on x's"),
    ((torch.ones(2, 8), torch.ones(3, 8), torch.ones(3, device="meta")), "weight and bias must be on x's"),
])
def test_gemv_rejects_bad_arguments_naming_them(args, message):
    with pytest.raises(AssertionError, match=message):
        ops.gemv(*args)


# -- GPU -------------------------------------------------------------------------------------


def case(m, n, k, dtype, bias, seed=0, device="cuda"):
    x = rand(m, k, dtype=dtype, device=device, seed=seed)
    w = rand(n, k, dtype=dtype, device=device, seed=seed + 1, scale=k ** -0.5)
    b = rand(n, dtype=dtype, device=device, seed=seed + 2) if bias else None
    return x, w, b


def assert_within_an_ulp(y, ref, slack=None):
    # The kernel's fp32 sum runs in another order than the reference's, so the rounded
    # results may differ by one unit in the last place where the sum lands near a boundary.
    # `slack`: what the sum itself may be off by, beyond that.
    ulp = torch.finfo(ref.dtype).eps * ref.float().abs().clamp(min=torch.finfo(ref.dtype).tiny)
    bound = ulp + 1e-5 + (0 if slack is None else slack)
    assert ((y.float() - ref.float()).abs() <= bound).all(), ((y.float() - ref.float()).abs() - bound).max()


def tensor_core_slack(x, w):
    """What the tensor cores' fp32 sums may be off by: each MMA adds to its accumulator dropping
    the bits below the larger addend's last place (truncating, not rounding), about 2^-23 of
    the running sum, once per 16 k positions of a warp's eighth of K, then the eight warps' sums
    are added: at most that many such units of sum_k |x_k w_k|."""
    steps = x.shape[1] / (16 * 8) + 8
    return steps * 2.0 ** -23 * (x.float().abs() @ w.float().abs().T)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 16])
@pytest.mark.parametrize("n, k", [
    (1, 8),  # one feature, one chunk: one row, three of the four K slices empty
    (37, 264),  # few features (one a warp, K in four slices of 9, 9, 9 and 6 chunks): ragged
    (4096, 4096),  # o_proj: two features a warp, K in two slices; one 16-feature tile per CTA (more rows)
    (6151, 4096),  # past qkv_proj's 6144: the last warp's second feature out of range
    (12291, 4104),  # one row: two K slices of 257 and 256 chunks, the last feature alone in its warp
    (24578, 4104),  # many CTAs: four features a warp, pipelined loads, ragged K; two tiles per CTA
    (4096, 12288),  # down_proj
    (257, 2048),  # a Qwen3.5 MoE router: fewer CTAs of two features than SMs, so one feature a warp
])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_kernel_matches_the_reference(dtype, m, n, k, bias):
    x, w, b = case(m, n, k, dtype, bias, seed=m + n + k)
    assert ops._gemv_kernel_fits(x, w, b)  # else ops.gemv would compare the reference with itself
    y = ops.gemv(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    assert_within_an_ulp(y, ops.gemv_reference(x, w, b), None if m == 1 else tensor_core_slack(x, w))


@pytest.fixture
def calls(monkeypatch):
    """Which path each ops.linear call took: 'cublas' (F.linear) or 'kernel'."""
    taken = []
    cublas, kernel = ops.F.linear, torch.ops.dflash.gemv

    def via_cublas(*args):
        taken.append("cublas")
        return cublas(*args)

    def via_kernel(*args):
        taken.append("kernel")
        return kernel(*args)

    monkeypatch.setattr(ops.F, "linear", via_cublas)
    monkeypatch.setattr(ops.torch.ops.dflash, "gemv", via_kernel)
    return taken


@pytest.mark.cuda
def test_linear_takes_the_kernel_up_to_16_rows_and_cublas_beyond(monkeypatch, calls):
    # up to 16 rows (a verify block at batch 1) the kernel reads the weights faster than cuBLAS
    # on the Qwen3-8B linears (BENCHMARKS.md, "GEMV")
    x, w, _ = case(48, 300, 256, torch.bfloat16, False)
    y = ops.linear(x[:1], w)
    assert_within_an_ulp(y, ops.gemv_reference(x[:1], w))
    y = ops.linear(x[:1, None], w)  # [bs = 1, T = 1, K]: an AR step at batch 1
    assert y.shape == (1, 1, 300)
    assert_within_an_ulp(y[:, 0], ops.gemv_reference(x[:1], w))
    y = ops.linear(x[:16].reshape(1, 16, 256), w)  # a verify block of 16 at batch 1
    assert y.shape == (1, 16, 300)
    assert_within_an_ulp(y[0], ops.gemv_reference(x[:16], w), tensor_core_slack(x[:16], w))
    assert calls == ["kernel"] * 3
    for rows in (2, 17, 32):
        ops.linear(x[:rows], w)
    ops.linear(x[:32].reshape(2, 16, 256), w)  # batch 2
    ops.linear(x[::4], w)  # 12 rows, strided
    assert calls[3:] == ["kernel", "cublas", "cublas", "cublas", "cublas"]


@pytest.mark.cuda
def test_linear_into_a_buffer_has_the_bits_of_either_path(monkeypatch, calls):
    x, w, _ = case(48, 300, 256, torch.bfloat16, False)
    buffer = torch.empty(48 * 300, dtype=torch.bfloat16, device=x.device)
    for rows in (1, 16, 48):  # the kernel's, then cuBLAS's
        y = ops.linear(x[:rows], w, out=buffer[: rows * 300].view(rows, 300))
        assert y.data_ptr() == buffer.data_ptr() and torch.equal(y, ops.linear(x[:rows], w))
    assert calls == ["kernel", "kernel", "kernel", "kernel", "cublas"]


@pytest.mark.cuda
def test_linear_leaves_what_the_kernel_cannot_take_to_cublas(monkeypatch, calls):
    x, w, _ = case(1, 64, 36, torch.bfloat16, False)  # K not a multiple of 8
    ops.linear(x, w)
    x, w, _ = case(1, 64, 64, torch.float32, False)  # fp32
    ops.linear(x, w)
    x, w, _ = case(3, 64, 64, torch.bfloat16, False)
    ops.linear(x[:1, 8:40], w[:, :32])  # a strided weight
    assert calls == ["cublas"] * 3


@pytest.mark.cuda
def test_kernel_refuses_what_it_cannot_take():
    x, w, _ = case(17, 64, 64, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="rows must be in"):
        torch.ops.dflash.gemv(x, w, None)
    x, w, _ = case(2, 64, 36, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.dflash.gemv(x, w, None)


# -- the add + norm after a one-row projection (ops.linear_add_rms_norm) ----------------------


def norm_case(n, k, dtype, bias, device, seed=0):
    x, w, b = case(1, n, k, dtype, bias, seed, device)
    residual = rand(1, 1, n, dtype=torch.float32, device=device, seed=seed + 3, scale=4.0)
    norm_weight = rand(n, dtype=dtype, device=device, seed=seed + 4)
    return x.reshape(1, 1, k), w, b, residual, norm_weight


@pytest.mark.parametrize("zero_centered", [False, True], ids=["", "zero-centred"])
def test_linear_add_rms_norm_is_the_projection_then_the_add_and_norm_on_the_cpu(zero_centered):
    x, w, b, residual, norm_weight = norm_case(48, 32, torch.float32, True, "cpu")
    ticket = torch.zeros(1, dtype=torch.int32)
    s, y = ops.linear_add_rms_norm(x, w, b, residual, norm_weight, 1e-6, zero_centered, ticket)
    ref_s, ref_y = ops.add_rms_norm_reference(residual, F.linear(x, w, b), norm_weight, 1e-6, zero_centered)
    assert torch.equal(s, ref_s) and torch.equal(y, ref_y) and s.shape == (1, 1, 48)


def test_a_norm_applies_a_projection_with_hooks_through_the_module():
    # tensor parallelism sums o_proj's and down_proj's partial outputs in a forward hook
    # (parallel.py): a norm that ran the matmul itself would skip the sum
    norm, proj = randomise(RMSNorm(32, 1e-6)), randomise(Linear(16, 32))
    x, residual = rand(1, 1, 16, seed=1), rand(1, 1, 32, seed=2)
    proj.register_forward_hook(lambda module, args, out: out * 2)
    s, y = norm.add_and_norm(residual, proj.deferred(x))
    ref_s, ref_y = ops.add_rms_norm_reference(residual, 2 * F.linear(x, proj.weight, proj.bias), norm.weight, 1e-6)
    assert torch.equal(s, ref_s) and torch.equal(y, ref_y)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n, k", [
    (64, 64),  # a tiny model: one warp's row in rms_norm, one CTA's features
    (2048, 4096),  # Qwen3.5/3.6-35B-A3B's o_proj and out_proj
    (4096, 12288),  # Qwen3-8B's down_proj (and o_proj's N)
    (5120, 5120),  # 640 vectors: the last played warp of each CTA thread's third play partly empty
    (4104, 512),  # 513 vectors: one vector alone in the last warp
    (8192, 1024),  # the most the add + norm takes: four plays a thread
])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["", "zero-centred"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_kernel_add_rms_norm_has_the_bits_of_gemv_then_add_rms_norm(dtype, n, k, zero_centered, bias):
    x, w, b, residual, norm_weight = norm_case(n, k, dtype, bias, "cuda", seed=n + k)
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")
    two_ops = ops.add_rms_norm(residual, torch.ops.dflash.gemv(x[0], w, b)[None], norm_weight, 1e-6, zero_centered)
    fused = torch.ops.dflash.linear_add_rms_norm(x[0], w, b, residual, norm_weight, 1e-6, zero_centered, ticket)
    assert fused[0].shape == residual.shape and fused[1].dtype == dtype
    assert torch.equal(fused[0], two_ops[0]) and torch.equal(fused[1], two_ops[1])
    assert ticket.item() == 0  # left ready for the next launch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dflash.linear_add_rms_norm(x[0], w, b, residual, norm_weight, 1e-6, zero_centered,
                                                        ticket)
    for _ in range(3):  # each replay finds the ticket at zero
        captured[0].zero_(), captured[1].zero_()
        graph.replay()
        assert torch.equal(captured[0], two_ops[0]) and torch.equal(captured[1], two_ops[1])


@pytest.mark.cuda
def test_linear_add_rms_norm_takes_one_launch_for_one_row_only(monkeypatch):
    taken = []
    fused = torch.ops.dflash.linear_add_rms_norm
    monkeypatch.setattr(ops.torch.ops.dflash, "linear_add_rms_norm", lambda *a: taken.append("fused") or fused(*a))
    x, w, _, residual, norm_weight = norm_case(256, 128, torch.bfloat16, False, "cuda")
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")
    ops.linear_add_rms_norm(x, w, None, residual, norm_weight, 1e-6, ticket=ticket)
    ops.linear_add_rms_norm(x, w, None, residual, norm_weight, 1e-6)  # no ticket: the two ops
    two = rand(1, 2, 128, dtype=torch.bfloat16, device="cuda")
    ops.linear_add_rms_norm(two, w, None, residual.expand(1, 2, 256).contiguous(), norm_weight, 1e-6, ticket=ticket)
    assert taken == ["fused"]


@pytest.mark.cuda
def test_kernel_add_rms_norm_refuses_what_it_cannot_take():
    x, w, _, residual, norm_weight = norm_case(64, 64, torch.bfloat16, False, "cuda")
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")
    op = torch.ops.dflash.linear_add_rms_norm
    with pytest.raises(RuntimeError, match="one row of x"):
        op(torch.cat([x[0], x[0]]), w, None, residual, norm_weight, 1e-6, False, ticket)
    with pytest.raises(RuntimeError, match="ticket must be one int32"):
        op(x[0], w, None, residual, norm_weight, 1e-6, False, ticket.long())
    with pytest.raises(RuntimeError, match="residual must be a contiguous fp32"):
        op(x[0], w, None, residual.to(torch.bfloat16), norm_weight, 1e-6, False, ticket)
    x, w, _, residual, norm_weight = norm_case(8200, 64, torch.bfloat16, False, "cuda")
    with pytest.raises(RuntimeError, match="at most 8192"):
        op(x[0], w, None, residual, norm_weight, 1e-6, False, ticket)


TINY_TARGETS = {
    "qwen3": rw.TinyPairSpec(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                             head_dim=16, target_layer_ids=(1, 2)),
    "hybrid": rw.TinyPairSpec(target_type="qwen3_5", hidden_size=64, intermediate_size=128, num_layers=4,
                              num_heads=4, num_kv_heads=2, head_dim=16, target_layer_ids=(1, 2)),
    "moe hybrid": rw._qwen3_5_moe((1, 2), hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                                  linear_heads=(2, 4), num_experts=8, experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_size=32),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", TINY_TARGETS)
def test_ar_step_is_the_same_with_the_norms_run_by_the_projections(monkeypatch, name):
    from test_profile_step import repeatable_ar_step

    monkeypatch.setitem(rw.PRESETS, "tiny", TINY_TARGETS[name])
    engine = rw.random_engine("tiny", device="cuda", dtype=torch.bfloat16, max_batch_size=1, max_seq_len=128).engine
    ar_step = repeatable_ar_step(engine)
    fused = torch.ops.dflash.linear_add_rms_norm
    taken = []
    monkeypatch.setattr(ops.torch.ops.dflash, "linear_add_rms_norm", lambda *a: taken.append(1) or fused(*a))
    hidden, token = ar_step()
    # the norms after every dense MLP and after the attention before one (MoE blocks take neither)
    layers = engine.target.model.layers
    assert len(taken) == 2 * sum(type(layer.mlp) is MLP for layer in layers) == (0 if name == "moe hybrid" else 8)
    monkeypatch.setattr(ops, "linear_add_rms_norm", lambda x, w, b, residual, norm_weight, eps, zero_centered, ticket:
                        ops.add_rms_norm(residual, ops.linear(x, w, b), norm_weight, eps, zero_centered))
    two_ops = ar_step()
    assert torch.equal(hidden, two_ops[0]) and torch.equal(token, two_ops[1])
