"""The skinny matmul (plugins/gemv.cu): its reference sums in fp32 and rounds once, the wrapper
rejects bad arguments, models route their linears through ops.linear unchanged on the CPU,
and on the GPU the kernel agrees with the reference (to a unit in the last place for one row;
within the tensor cores' fp32 sum for 2 to 16) for every row count it takes, ragged feature
counts and each warp layout, and ops.linear takes it for up to 16 rows (cuda marker)."""

import pytest
import torch
import torch.nn.functional as F
from test_layer_ops import dims_for, rand, randomise

from dflash_trt import ops
from dflash_trt.models.layers import MLP, Linear, PackedLinear


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
    assert torch.equal(mlp(x), F.linear(ops.silu_mul(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight))


def test_linear_takes_empty_inputs_as_nn_linear_does():
    for x, w in ((torch.ones(2, 0), torch.ones(3, 0)), (torch.ones(0, 4), torch.ones(3, 4))):
        assert torch.equal(ops.linear(x, w), F.linear(x, w))


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


def gpu_case(m, n, k, dtype, bias, seed=0):
    x = rand(m, k, dtype=dtype, device="cuda", seed=seed)
    w = rand(n, k, dtype=dtype, device="cuda", seed=seed + 1, scale=k ** -0.5)
    b = rand(n, dtype=dtype, device="cuda", seed=seed + 2) if bias else None
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
    x, w, b = gpu_case(m, n, k, dtype, bias, seed=m + n + k)
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
    x, w, _ = gpu_case(48, 300, 256, torch.bfloat16, False)
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
def test_linear_leaves_what_the_kernel_cannot_take_to_cublas(monkeypatch, calls):
    x, w, _ = gpu_case(1, 64, 36, torch.bfloat16, False)  # K not a multiple of 8
    ops.linear(x, w)
    x, w, _ = gpu_case(1, 64, 64, torch.float32, False)  # fp32
    ops.linear(x, w)
    x, w, _ = gpu_case(3, 64, 64, torch.bfloat16, False)
    ops.linear(x[:1, 8:40], w[:, :32])  # a strided weight
    assert calls == ["cublas"] * 3


@pytest.mark.cuda
def test_kernel_refuses_what_it_cannot_take():
    x, w, _ = gpu_case(17, 64, 64, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="rows must be in"):
        torch.ops.dflash.gemv(x, w, None)
    x, w, _ = gpu_case(2, 64, 36, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.dflash.gemv(x, w, None)
