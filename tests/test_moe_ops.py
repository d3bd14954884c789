"""Routed experts (ops.moe_experts, plugins/moe.cu): the reference equals a dense per-token,
per-pick formulation (CPU, fp32 and bf16), the wrapper rejects bad arguments naming them, and
on CUDA the fused kernels and the grouped-GEMM path agree with the reference from decode to
prefill sizes, are deterministic and batch-invariant, and replay from a CUDA graph (cuda marker)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import write_report

from dflash_trt import ops, plugins
from dflash_trt.ops import moe_experts, moe_experts_reference


def make_experts(E, H, I, dtype, device="cpu", seed=0):
    """gate_up [E, 2I, H], down [E, H, I] scaled so that gate, up and y come out of order 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g, device=device) * H ** -0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g, device=device) * I ** -0.5).to(dtype)
    return gate_up, down


def make_routing(N, E, k, device="cpu", seed=0, skew=None):
    """(weights [N, k] fp32 summing to 1, ids [N, k] int32: k distinct experts per token).
    skew "hot": every token's first pick is expert 3; "cold": no token picks expert 0."""
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(N, E, generator=g, device=device)
    if skew == "hot":
        scores[:, 3] = 2.0
    elif skew == "cold":
        scores[:, 0] = -1.0
    ids = scores.topk(k, dim=-1).indices.int()
    weights = torch.softmax(torch.randn(N, k, generator=g, device=device), dim=-1)
    return weights, ids


def make_x(N, H, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed + 1000)
    return torch.randn(N, H, generator=g, device=device).to(dtype)


def dense_moe(x, gate_up, down, weights, ids):
    """The experts token by token and pick by pick, in fp32 with the model's roundings written
    out: each projection rounded to x's dtype, silu rounded, silu * up rounded."""
    dtype = x.dtype
    N, k = ids.shape
    I = down.shape[2]
    out = torch.zeros(N, x.shape[1])
    for t in range(N):
        for j in range(k):
            e = int(ids[t, j])
            h = (gate_up[e].float() @ x[t].float()).to(dtype).float()
            gate, up = h[:I], h[I:]
            a = (F.silu(gate).to(dtype).float() * up).to(dtype).float()
            y = (down[e].float() @ a).to(dtype).float()
            out[t] += weights[t, j] * y
    return out


def pick_outputs(x, gate_up, down, ids):
    """|y| of every pick [N, k, H] fp32, expert by expert (the error scale of the tests below)."""
    N, k = ids.shape
    y = torch.zeros(N, k, x.shape[1], device=x.device)
    for e in ids.unique().tolist():
        token, j = (ids == e).nonzero(as_tuple=True)
        a = ops.silu_mul_reference(F.linear(x[token], gate_up[e]))
        y[token, j] = F.linear(a, down[e]).float().abs()
    return y


# Each pick's y is rounded to the dtype. Another fp32 summation order than the reference's
# moves a projection's fp32 value by a few fp32 units, which flips its rounding to bf16/fp16
# where it sits next to a rounding boundary. A flip in y moves out by w ulp(y) <= w |y| 2^-m
# (m: explicit mantissa bits); REL allows two of them relative to sum_j w_j |y_j|. A flip in
# h or a moves y by |down[h, i]| ulp(a_i) at every h, whatever y's own size: with these weights
# (|down| within 4.5 / sqrt(I), |a| below 8) that is within 2^-5 (bf16; 2^-8 fp16) of a
# typical |y|, so ABS allows two such flips relative to the scale's mean. fp32 rounds nothing:
# REL and ABS cover the fp32 summation orders and the kernels' three-TF32 products.
REL = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 1e-5}
ABS = {torch.bfloat16: 2.0 ** -4, torch.float16: 2.0 ** -7, torch.float32: 2e-5}
STATS = {}  # (path, dtype) -> [elements, beyond REL, worst error / bound, worst mean error / mean scale]


def check_close(path, out, ref, scale, dtype):
    assert out.dtype == torch.float32 and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    bound = REL[dtype] * scale + ABS[dtype] * scale.mean()
    err = (out - ref).abs()
    stats = STATS.setdefault((path, str(dtype).removeprefix("torch.")), [0, 0, 0.0, 0.0])
    stats[0] += ref.numel()
    stats[1] += int((err > REL[dtype] * scale).sum())
    stats[2] = max(stats[2], float((err / bound).max()))
    stats[3] = max(stats[3], float(err.mean() / scale.mean()))
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), \
        f"{path}: error {err.flatten()[worst]} > bound {bound.flatten()[worst]} at {worst} (ref {ref.flatten()[worst]})"


@pytest.fixture(scope="module", autouse=True)
def report_stats(request):
    yield
    if not STATS:
        return
    lines = ["moe_experts vs reference: path dtype elements beyond-REL worst-error/bound worst-mean-error/mean-scale"]
    for (path, dtype), (n, beyond, worst, mean) in sorted(STATS.items()):
        lines.append(f"  {path:<8} {dtype:<9} {n:>11} {beyond:>9} {worst:.3f} {mean:.2e}")
    write_report(request, lines, "DFLASH_MOE_STATS")


# ----------------------------------------------------------------------------------------------
# CPU: the reference


@pytest.mark.parametrize("skew", [None, "hot", "cold"])
@pytest.mark.parametrize("N, E, k, H, I", [(1, 8, 2, 16, 8), (5, 8, 2, 32, 16), (9, 16, 4, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_dense_per_pick_formula(dtype, N, E, k, H, I, skew):
    gate_up, down = make_experts(E, H, I, dtype, seed=N)
    weights, ids = make_routing(N, E, k, seed=N, skew=skew)
    x = make_x(N, H, dtype, seed=N)
    out = moe_experts_reference(x, gate_up, down, weights, ids)
    scale = (weights[..., None] * pick_outputs(x, gate_up, down, ids)).sum(1)
    check_close("cpu-ref", out, dense_moe(x, gate_up, down, weights, ids), scale, dtype)


def test_reference_sums_the_picks_with_their_weights():
    # one expert picked twice by a token counts twice; a zero weight removes a pick
    gate_up, down = make_experts(4, 16, 8, torch.float32)
    x = make_x(2, 16, torch.float32)
    ids = torch.tensor([[1, 1], [2, 0]], dtype=torch.int32)
    weights = torch.tensor([[0.25, 0.5], [1.0, 0.0]])
    out = moe_experts_reference(x, gate_up, down, weights, ids)
    single = moe_experts_reference(x, gate_up, down, torch.ones(2, 1), ids[:, :1])
    assert torch.allclose(out[0], 0.75 * single[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(out[1], single[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_in_the_model_dtype_is_the_fp32_sum_rounded_once(dtype):
    gate_up, down = make_experts(8, 32, 16, dtype)
    weights, ids = make_routing(5, 8, 3)
    x = make_x(5, 32, dtype)
    fp32 = moe_experts_reference(x, gate_up, down, weights, ids)
    out = moe_experts_reference(x, gate_up, down, weights, ids, out_dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, fp32.to(dtype))


def test_cpu_wrapper_runs_the_reference():
    gate_up, down = make_experts(8, 16, 8, torch.bfloat16)
    weights, ids = make_routing(3, 8, 2)
    x = make_x(3, 16, torch.bfloat16)
    assert torch.equal(moe_experts(x, gate_up, down, weights, ids), moe_experts_reference(x, gate_up, down, weights, ids))


def bad_calls():
    gate_up, down = make_experts(4, 16, 8, torch.float32)
    x = make_x(3, 16, torch.float32)
    weights, ids = make_routing(3, 4, 2)
    ok = {"x": x, "gate_up": gate_up, "down": down, "weights": weights, "ids": ids}
    return {
        "x not 2-D": ("x must be", {"x": x[None]}),
        "gate_up hidden": ("gate_up must be", {"gate_up": gate_up[:, :, :8]}),
        "gate_up odd rows": ("gate_up must be", {"gate_up": gate_up[:, :15]}),
        "down shape": ("down must be", {"down": down[:, :, :4]}),
        "gate_up dtype": ("gate_up and down must have x's dtype", {"gate_up": gate_up.bfloat16()}),
        "down dtype": ("gate_up and down must have x's dtype", {"down": down.half()}),
        "ids tokens": ("ids must be", {"ids": ids[:2], "weights": weights[:2]}),
        "weights shape": ("weights must be", {"weights": weights[:, :1]}),
        "weights fp16": ("weights must be fp32", {"weights": weights.half()}),
        "ids int64": ("ids must be int32", {"ids": ids.long()}),
        "out_dtype": ("out_dtype must be fp32 or x's", {"out_dtype": torch.float16}),
        "no experts": ("at least one expert", {"gate_up": gate_up[:0], "down": down[:0]}),
    }, ok


@pytest.mark.parametrize("name", bad_calls()[0])
def test_wrapper_rejects_bad_arguments_naming_them(name):
    cases, ok = bad_calls()
    message, override = cases[name]
    with pytest.raises(AssertionError, match=message):
        moe_experts(**{**ok, **override})


def test_moe_kernels_are_part_of_the_plugin_library():
    # The nvcc compile check (tests/test_ops.py) covers every plugins/*.cu, this one included.
    assert "moe.cu" in plugins.SOURCES
    assert (plugins.plugin_dir() / "moe.cu").is_file()


# ----------------------------------------------------------------------------------------------
# CUDA: the kernels against the reference on the same CUDA tensors. The reference's GEMMs are
# cuBLAS's with fp32 accumulation throughout (reduced-precision reductions off, no TF32).


@pytest.fixture
def exact_cublas():
    m = torch.backends.cuda.matmul
    saved = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction, m.allow_tf32)
    m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = m.allow_tf32 = False
    yield
    m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction, m.allow_tf32 = saved


@functools.lru_cache(maxsize=1)
def cuda_experts(E, H, I, dtype):
    return make_experts(E, H, I, dtype, device="cuda", seed=E)


SHAPES = {"small": (64, 32), "35b-a3b": (2048, 512)}  # (H, I)
ROUTINGS = [(8, 2), (64, 8), (256, 8), (512, 10)]  # (E, k)
TOKENS = [1, 3, 16, 128, 512, 2048]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def kernel_cases(dtypes):
    """(dtype, shape, (E, k), N), ordered so that one set of weights serves consecutive cases."""
    return [pytest.param(DTYPES[d], shape, ek, n, id=f"{d}-{shape}-E{ek[0]}k{ek[1]}-N{n}")
            for d in dtypes for shape in SHAPES for ek in ROUTINGS for n in TOKENS]


def run_case(dtype, shape, E, k, N, skew=None):
    assert plugins.load() is not None
    H, I = SHAPES[shape]
    gate_up, down = cuda_experts(E, H, I, dtype)
    weights, ids = make_routing(N, E, k, device="cuda", seed=N, skew=skew)
    x = make_x(N, H, dtype, device="cuda", seed=N)
    ref = moe_experts_reference(x, gate_up, down, weights, ids)
    scale = (weights[..., None] * pick_outputs(x, gate_up, down, ids)).sum(1)
    return (x, gate_up, down, weights, ids), ref, scale


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, shape, ek, N", kernel_cases(DTYPES))
def test_cuda_fused_kernels_match_the_reference(exact_cublas, dtype, shape, ek, N):
    args, ref, scale = run_case(dtype, shape, *ek, N)
    check_close("fused", torch.ops.dflash.moe_experts(*args), ref, scale, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, shape, ek, N", kernel_cases(["bf16"]))
def test_cuda_grouped_gemm_path_matches_the_reference(exact_cublas, dtype, shape, ek, N):
    args, ref, scale = run_case(dtype, shape, *ek, N)
    check_close("grouped", ops._moe_experts_grouped(*args), ref, scale, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("skew", ["hot", "cold"])
@pytest.mark.parametrize("N", [1, 16, 512, 2048])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cuda_skewed_routing_matches_the_reference(exact_cublas, dtype, N, skew):
    args, ref, scale = run_case(dtype, "35b-a3b", 256, 8, N, skew=skew)
    check_close("fused", torch.ops.dflash.moe_experts(*args), ref, scale, dtype)
    check_close("wrapper", moe_experts(*args), ref, scale, dtype)
    if dtype == torch.bfloat16:
        check_close("grouped", ops._moe_experts_grouped(*args), ref, scale, dtype)


@pytest.mark.cuda
# The one-token down kernel's groups of 8 lanes a dot: I / 8 odd and below the group (I 24, I 8),
# two rounds of loads (I 1024), a CTA's rows not dividing H (k 11: 3 rows, k 1: 36), one row a
# CTA (k 32); k 40 is past its shared memory, so that token takes the tiles
@pytest.mark.parametrize("E, k, H, I", [(16, 9, 64, 24), (16, 3, 32, 8), (24, 11, 40, 1024), (16, 1, 80, 24),
                                        (48, 32, 64, 16), (64, 40, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_one_token_matches_the_reference_at_any_width_and_pick_count(exact_cublas, dtype, E, k, H, I):
    assert plugins.load() is not None
    gate_up, down = make_experts(E, H, I, dtype, device="cuda", seed=I)
    weights, ids = make_routing(1, E, k, device="cuda", seed=k)
    x = make_x(1, H, dtype, device="cuda", seed=k)
    ref = moe_experts_reference(x, gate_up, down, weights, ids)
    scale = (weights[..., None] * pick_outputs(x, gate_up, down, ids)).sum(1)
    check_close("fused", torch.ops.dflash.moe_experts(x, gate_up, down, weights, ids), ref, scale, dtype)


@pytest.mark.cuda
# One token's routing, experts and the norm after them in one launch pair: each CTA routes the
# token (route_warp.h) and the down kernel's last CTA adds the residual and norms the row
# (MoeTokenFusion::norm): the bits of moe_route, moe_experts, then add_rms_norm, with a shared expert
# packed last or none, 256 routed experts (route_warp's V 8) or 512 (V 16), the weights
# renormalised or not, logits with ties; one play a thread (H 2048), two (H 4096) and a row
# shorter than a CTA (H 40); both norms; graph replays with new logits, the ticket left zero
@pytest.mark.parametrize("E, k, shared, H, I", [(256, 8, True, 2048, 512), (512, 10, True, 4096, 64),
                                                (24, 11, False, 4096, 64), (16, 3, False, 40, 24)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalised", "softmax"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["qwen3-norm", "zero-centred"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_one_token_routing_experts_and_norm_equal_the_three_ops(dtype, zero_centered, renormalize, E, k, shared,
                                                                     H, I):
    assert plugins.load() is not None
    gate_up, down = make_experts(E + shared, H, I, dtype, device="cuda", seed=H)
    g = torch.Generator(device="cuda").manual_seed(H)
    norm_weight = (torch.randn(H, generator=g, device="cuda") * 0.1 + (0.0 if zero_centered else 1.0)).to(dtype)
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")

    def inputs(seed):
        x = make_x(1, H, dtype, device="cuda", seed=seed)
        logits = (torch.randn(1, E + shared, generator=g, device="cuda") * 2).to(dtype)
        if seed == 2:  # ties: the lower expert id goes first
            logits[0, 1::2] = logits[0, 0::2][: logits[0, 1::2].numel()]
        return x, logits, torch.randn(1, 1, H, generator=g, device="cuda") * 4

    def three_ops(x, logits, residual):
        weights, ids = ops.moe_route(logits, k, renormalize, shared)
        out = moe_experts(x, gate_up, down, weights, ids, dtype, shared_last=shared).reshape(residual.shape)
        return ops.add_rms_norm(residual, out, norm_weight, 1e-6, zero_centered)

    def fused(x, logits, residual):
        return torch.ops.dflash.moe_experts_add_rms_norm(x, gate_up, down, logits, k, renormalize, shared, residual,
                                                         norm_weight, 1e-6, zero_centered, ticket)

    static = list(inputs(0))
    for got, want in zip(fused(*static), three_ops(*static)):
        assert got.shape == want.shape and torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused(*static)
    for seed in (1, 2):
        new = inputs(seed)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        for got, want in zip(captured, three_ops(*new)):
            assert torch.equal(got, want), seed
        assert ticket.item() == 0


@pytest.mark.cuda
def test_cuda_experts_with_the_norm_name_what_they_do_not_take():
    assert plugins.load() is not None
    E, k, H, I = 16, 3, 64, 16
    gate_up, down = make_experts(E, H, I, torch.bfloat16, device="cuda")
    logits = torch.randn(2, E, device="cuda").to(torch.bfloat16)
    x = make_x(2, H, torch.bfloat16, device="cuda")
    norm_weight, ticket = torch.ones(H, dtype=torch.bfloat16, device="cuda"), torch.zeros(1, dtype=torch.int32,
                                                                                         device="cuda")
    op = torch.ops.dflash.moe_experts_add_rms_norm
    with pytest.raises(RuntimeError, match="one token"):
        op(x, gate_up, down, logits, k, True, False, torch.zeros(2, H, device="cuda"), norm_weight, 1e-6, False, ticket)
    with pytest.raises(RuntimeError, match="residual must be"):
        op(x[:1], gate_up, down, logits[:1], k, True, False, torch.zeros(1, H + 8, device="cuda"), norm_weight, 1e-6,
           False, ticket)
    with pytest.raises(RuntimeError, match="one token in bf16 or fp16"):
        op(x[:1].float(), gate_up.float(), down.float(), logits[:1].float(), k, True, False,
           torch.zeros(1, H, device="cuda"), norm_weight.float(), 1e-6, False, ticket)
    with pytest.raises(RuntimeError, match=r"logits must be \[N, E\] = \[1, 16\]"):
        op(x[:1], gate_up, down, logits[:1, :8], k, True, False, torch.zeros(1, H, device="cuda"), norm_weight, 1e-6,
           False, ticket)
    with pytest.raises(RuntimeError, match="top_k must be in"):
        op(x[:1], gate_up, down, logits[:1], 17, True, False, torch.zeros(1, H, device="cuda"), norm_weight, 1e-6,
           False, ticket)
    # the wrapper takes the three ops where the launch would not (two tokens, fp32, no ticket)
    residual = torch.randn(2, H, device="cuda")
    s, y = ops.moe_experts_add_rms_norm(x, gate_up, down, logits, k, True, False, residual, norm_weight, 1e-6,
                                        ticket=ticket)
    want = ops.add_rms_norm(residual, moe_experts(x, gate_up, down, *ops.moe_route(logits, k, True), torch.bfloat16),
                            norm_weight, 1e-6)
    assert torch.equal(s, want[0]) and torch.equal(y, want[1])


@pytest.mark.cuda
@pytest.mark.parametrize("last", ["shared", "routed"])
@pytest.mark.parametrize("N", [1, 16, 2048])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cuda_shared_last_hint_changes_no_result(dtype, N, last):
    # the hint only moves a fetch ahead; where the last pick is not expert E - 1 (routed), the
    # ids still decide what is computed
    args, _, _ = run_case(dtype, "35b-a3b", 256, 8, N)
    x, gate_up, down, weights, ids = args
    if last == "shared":
        ids = torch.cat([ids[:, :-1], torch.full_like(ids[:, :1], gate_up.shape[0] - 1)], dim=1)
    plain = moe_experts(x, gate_up, down, weights, ids)
    assert torch.equal(moe_experts(x, gate_up, down, weights, ids, shared_last=True), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_experts(x, gate_up, down, weights, ids, shared_last=True)
    graph.replay()
    assert torch.equal(captured, plain)


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 16, 128, 2048])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cuda_wrapper_takes_the_path_its_threshold_names(dtype, N):
    args, _, _ = run_case(dtype, "35b-a3b", 256, 8, N)
    grouped = dtype == torch.bfloat16 and N * 8 >= ops.MOE_GROUPED_MIN_PICKS_PER_EXPERT * 256
    expected = ops._moe_experts_grouped(*args) if grouped else torch.ops.dflash.moe_experts(*args)
    assert torch.equal(moe_experts(*args), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 16, 17, 2048])  # the sum in the down kernel up to 16 tokens
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cuda_output_in_the_model_dtype_is_the_fp32_sum_rounded_once(dtype, N):
    args, _, _ = run_case(dtype, "35b-a3b", 256, 8, N)
    out = moe_experts(*args, out_dtype=dtype)
    assert out.dtype == dtype and torch.equal(out, moe_experts(*args).to(dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 16, 2048])
def test_cuda_paths_are_deterministic(N):
    args, _, _ = run_case(torch.bfloat16, "35b-a3b", 256, 8, N)
    for run in (torch.ops.dflash.moe_experts, ops._moe_experts_grouped):
        assert torch.equal(run(*args), run(*args)), run


@pytest.mark.cuda
# the sum in the down kernel (16), in a kernel of its own (17, 64, 512); one and two 8-slot tiles
# per chunk (64, 512); a token alone is not sorted
@pytest.mark.parametrize("N", [16, 17, 64, 512])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cuda_fused_token_output_does_not_depend_on_its_batch(dtype, N):
    # A token's numbers in a verify pass are those of any other pass with it: in fp32 also
    # those of the token alone (an AR step); a 16-bit token alone runs the CUDA-core kernels,
    # in their own order, so there the smallest other pass is two tokens.
    (x, gate_up, down, weights, ids), _, _ = run_case(dtype, "35b-a3b", 256, 8, N)
    out = torch.ops.dflash.moe_experts(x, gate_up, down, weights, ids)
    for t in (0, 5, N - 1):
        rows = [t] if dtype == torch.float32 else [t, (t + 1) % N]
        small = torch.ops.dflash.moe_experts(x[rows], gate_up, down, weights[rows], ids[rows])
        assert torch.equal(small[0], out[t]), t


@pytest.mark.cuda
@pytest.mark.parametrize("N", [1, 16, 40, 300, 600])  # 300, 600: two, four n-tiles a chunk (streamed in 16-bit)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_cuda_picks_outside_the_experts_add_nothing(exact_cublas, dtype, N):
    (x, gate_up, down, weights, ids), _, _ = run_case(dtype, "small", 64, 8, N)
    bad = ids.clone()
    bad[::2, 1], bad[::3, 4] = -1, 64
    valid = (bad >= 0) & (bad < 64)
    ref = moe_experts_reference(x, gate_up, down, weights * valid, torch.where(valid, bad, 0).int())
    scale = (weights[..., None] * pick_outputs(x, gate_up, down, ids)).sum(1)
    check_close("fused", torch.ops.dflash.moe_experts(x, gate_up, down, weights, bad), ref, scale, dtype)
    if dtype == torch.bfloat16:
        check_close("grouped", ops._moe_experts_grouped(x, gate_up, down, weights, bad), ref, scale, dtype)


@pytest.mark.cuda
# AR at batch 1 (no sort), decode/verify (fused kernels, the sum in the down kernel), prefill
# (grouped GEMMs in bf16)
@pytest.mark.parametrize("N", [1, 16, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_graph_replays_with_new_inputs(exact_cublas, dtype, N):
    assert plugins.load() is not None
    E, k = 256, 8
    H, I = SHAPES["35b-a3b"]
    gate_up, down = cuda_experts(E, H, I, dtype)
    static = [make_x(N, H, dtype, device="cuda"), *make_routing(N, E, k, device="cuda")]
    moe_experts(static[0], gate_up, down, static[1], static[2])  # warm-up: build, allocate
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(static[0], gate_up, down, static[1], static[2])
    for seed in (1, 2):
        x = make_x(N, H, dtype, device="cuda", seed=seed)
        weights, ids = make_routing(N, E, k, device="cuda", seed=seed, skew="hot" if seed == 2 else None)
        for dst, src in zip(static, (x, weights, ids)):
            dst.copy_(src)
        graph.replay()
        ref = moe_experts_reference(x, gate_up, down, weights, ids)
        scale = (weights[..., None] * pick_outputs(x, gate_up, down, ids)).sum(1)
        check_close("graph", out, ref, scale, dtype)


# ----------------------------------------------------------------------------------------------
# Routing (ops.moe_route, plugins/moe_route.cu): the reference is transformers' router math;
# the kernel picks the same experts and weights within the last fp32 place (before rounding).


def test_route_reference_is_softmax_top_k_renormalised_and_rounded():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]]).to(torch.bfloat16)
    weights, ids = ops.moe_route_reference(logits, 2, renormalize=True)
    p = torch.softmax(torch.tensor([2.0, 0.0, 1.0, -1.0]), 0)
    assert ids.tolist() == [[0, 2]] and ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert weights[0].tolist() == (p[[0, 2]] / p[[0, 2]].sum()).to(torch.bfloat16).float().tolist()
    plain, _ = ops.moe_route_reference(logits.float(), 2, renormalize=False)
    assert torch.allclose(plain[0], p[[0, 2]])


def test_route_reference_adds_the_shared_expert_as_a_last_pick():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, 0.5]])  # 4 experts, then the shared expert's gate
    weights, ids = ops.moe_route_reference(logits, 2, renormalize=True, shared=True)
    routed, _ = ops.moe_route_reference(logits[:, :4], 2, renormalize=True)
    assert ids.tolist() == [[0, 2, 4]]
    assert torch.equal(weights[:, :2], routed) and weights[0, 2].item() == pytest.approx(torch.tensor(0.5).sigmoid())


@pytest.mark.cuda
@pytest.mark.parametrize("E, k", [(8, 2), (60, 4), (128, 8), (256, 8), (512, 10), (512, 16)])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("renormalize, shared", [(True, False), (False, False), (True, True)])
def test_cuda_route_kernel_matches_the_reference(dtype, E, k, renormalize, shared):
    torch.manual_seed(E + k)
    logits = (torch.randn(300, E + shared, device="cuda") * 2).to(dtype)
    weights, ids = ops.moe_route(logits, k, renormalize, shared)
    want_w, want_ids = ops.moe_route_reference(logits, k, renormalize, shared)
    assert ids.shape == (300, k + shared)
    if shared:  # the shared expert, last: its sigmoid weight rounded alike
        assert (ids[:, -1] == E).all() and torch.equal(weights[:, -1], want_w[:, -1])
        weights, ids, want_w, want_ids, logits = weights[:, :-1], ids[:, :-1], want_w[:, :-1], want_ids[:, :-1], \
            logits[:, :-1]
    # Equal logits (frequent in bf16) may be picked in either order, so the picks are checked
    # by their probabilities: the kernel's k picks have the reference's k largest, in order.
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, want_ids.long()))
    assert (ids == want_ids).float().mean() > 0.9  # and mostly the very same experts
    # the kernel's fp32 sums differ from torch's in the last place; bf16/fp16 rounding then
    # agrees but for values that sit on a rounding boundary: one unit in the last place of the
    # dtype (relative spacing up to 2^-7 for bf16's 8-bit significand, 2^-10 for fp16's 11)
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    assert torch.allclose(weights, want_w, rtol=ulp, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shared", [False, True])
def test_cuda_route_kernel_reads_strided_logits_as_their_contiguous_copy(dtype, shared):
    torch.manual_seed(7)
    logits = (torch.randn(48, 256 + shared, device="cuda") * 2).to(dtype)
    strided = logits.t().contiguous().t()  # router_logits' layout: rows of tokens, read as columns
    assert not strided.is_contiguous() and torch.equal(strided, logits)
    for got, want in zip(ops.moe_route(strided, 8, True, shared), ops.moe_route(logits, 8, True, shared)):
        assert torch.equal(got, want)


def test_router_logits_on_the_cpu_are_linears():
    x, w = torch.randn(32, 64), torch.randn(9, 64)
    assert torch.equal(ops.router_logits(x, w), F.linear(x, w))


@pytest.mark.cuda
@pytest.mark.parametrize("N, transposed", [(16, False), (24, True), (512, True), (500, False)])
@pytest.mark.parametrize("rows", [257, 256])
def test_cuda_router_logits_of_a_wide_pass_come_from_weight_times_x_transposed(exact_cublas, N, transposed, rows):
    """Past the gemv kernel's rows, a router whose row count is no multiple of 8 (a Qwen3.5 MoE
    router: experts + the shared expert's gate) is computed as W x^T, and its transpose
    returned: linear's numbers in fp32 up to the GEMM's summation order."""
    torch.manual_seed(N)
    x, w = torch.randn(N, 2048, device="cuda"), torch.randn(rows, 2048, device="cuda") * 2048 ** -0.5
    out = ops.router_logits(x, w)
    took = transposed and rows % 8 != 0
    assert out.shape == (N, rows) and out.is_contiguous() != took
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_a_misaligned_input_takes_the_reference_instead_of_failing_in_the_kernel():
    """The kernels need x 16-byte aligned; a contiguous view that is not goes to the reference
    (a check failing inside the op would crash the process on some torch builds)."""
    (x, *rest), ref, _ = run_case(torch.float32, "35b-a3b", 16, 8, 4)
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    shifted = flat[1:].view_as(x)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 != 0 and shifted.is_contiguous()
    assert torch.equal(ops.moe_experts(shifted, *rest), ref)
