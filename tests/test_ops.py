"""Custom ops: the paged block-attention reference agrees with an explicit-mask SDPA oracle
(CPU), the CUDA kernel agrees with the fp32 reference (cuda marker), ops.py's list of what
the kernel supports agrees with ops.cpp and block_attention.h, and every plugins/*.cu
compiles alone with nvcc (CI, no GPU needed)."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from host_program import run_host_program

from dflash_trt import plugins
from dflash_trt.ops import (
    _cuda_block_attention_supported,
    block_attention_kernel_supports,
    paged_block_attention,
    paged_block_attention_reference,
)


# An independent oracle: an explicit [bs, T, L] mask over gathered keys, then SDPA.
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


PLUGINS = Path(__file__).resolve().parent.parent / "plugins"


def make_case(bs, T, Hq, Hkv, d, starts, block, num_tokens=None, dtype=torch.float32, device="cpu", seed=0):
    """Random cache + queries for rows whose block sits at positions starts[i] .. + T - 1.

    block="given": the block's K/V are passed separately and ctx_len = start (the drafter);
    block="cached": the first num_tokens[i] block rows are written into the cache and
    ctx_len = start + num_tokens (the target verify; padding queries see the same keys).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)  # noqa: E731
    capacity = max(starts) + T + 5
    num_slots = bs + 2
    k_cache, v_cache = rand(num_slots, capacity, Hkv, d), rand(num_slots, capacity, Hkv, d)
    q, k_blk, v_blk = rand(bs, T, Hq, d), rand(bs, T, Hkv, d), rand(bs, T, Hkv, d)
    slots = torch.randperm(num_slots, generator=g, device=device)[:bs].to(torch.int32)
    num_tokens = num_tokens or [T] * bs
    if block == "cached":
        for i, (slot, s, n) in enumerate(zip(slots.tolist(), starts, num_tokens)):
            k_cache[slot, s:s + n], v_cache[slot, s:s + n] = k_blk[i, :n], v_blk[i, :n]
        ctx = [s + n for s, n in zip(starts, num_tokens)]
        k_blk = v_blk = None
    else:
        ctx = list(starts)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, slots=slots, ctx_len=as_i32(ctx),
                q_start=as_i32(starts), k_blk=k_blk, v_blk=v_blk)


def as_fp32(c):
    return {k: v.float() if v is not None and v.is_floating_point() else v for k, v in c.items()}


def mask_and_sdpa(c, causal, window, scale):
    """The path the kernel replaces: gather rows [0, max ctx) of each slot (+ the block), explicit mask, SDPA."""
    bs, T, Hq, d = c["q"].shape
    length = int(c["ctx_len"].max())
    k = c["k_cache"][c["slots"].long(), :length]
    v = c["v_cache"][c["slots"].long(), :length]
    k_pos = torch.arange(length).expand(bs, -1)
    k_valid = k_pos < c["ctx_len"][:, None]
    q_pos = c["q_start"].long()[:, None] + torch.arange(T)
    if c["k_blk"] is not None:
        k, v = torch.cat([k, c["k_blk"]], 1), torch.cat([v, c["v_blk"]], 1)
        k_pos = torch.cat([k_pos, q_pos], 1)
        k_valid = torch.cat([k_valid, torch.ones(bs, T, dtype=torch.bool)], 1)
    mask = attention_mask(q_pos, k_pos, k_valid, causal, window)
    return block_attention_reference(c["q"], k, v, mask, scale).view(bs, T, Hq, d)


# (bs, T, Hq, Hkv, d, starts, block, num_tokens, causal, window)
CPU_CASES = {
    "draft full layer, ragged context": (3, 4, 8, 2, 16, [0, 5, 17], "given", None, False, None),
    "draft sliding layer, window": (2, 16, 8, 2, 16, [3, 30], "given", None, True, 8),
    "draft window without causal": (2, 4, 4, 4, 8, [1, 20], "given", None, False, 5),
    "draft T=1 one context row": (2, 1, 4, 1, 8, [1, 7], "given", None, False, None),
    "verify T=16 GQA 4:1": (2, 16, 8, 2, 16, [3, 40], "cached", None, True, None),
    "verify with padding queries": (3, 8, 4, 4, 8, [2, 9, 0], "cached", [8, 3, 5], True, None),
    "decode T=1 GQA 1:1": (3, 1, 4, 4, 8, [0, 1, 12], "cached", None, True, None),
    "verify causal + window": (2, 16, 8, 2, 16, [3, 40], "cached", None, True, 6),
    "cached block, non-causal": (2, 4, 8, 2, 16, [0, 11], "cached", None, False, None),
    "Qwen3.5 head_dim 256, GQA 16:4": (3, 4, 16, 4, 256, [0, 1, 65], "cached", None, True, None),
}


@pytest.mark.parametrize("case", CPU_CASES.values(), ids=CPU_CASES.keys())
def test_paged_reference_matches_mask_and_sdpa_path(case):
    bs, T, Hq, Hkv, d, starts, block, num_tokens, causal, window = case
    c = make_case(bs, T, Hq, Hkv, d, starts, block, num_tokens)
    scale = d ** -0.5
    expected = mask_and_sdpa(c, causal, window, scale)
    got = paged_block_attention_reference(**c, causal=causal, window=window, scale=scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The asserting wrapper takes the same path on CPU.
    torch.testing.assert_close(paged_block_attention(**c, causal=causal, window=window, scale=scale), got)


def test_query_that_sees_no_key_outputs_zeros():
    c = make_case(2, 3, 4, 2, 8, [0, 4], "given")
    c.update(k_blk=None, v_blk=None)  # row 0: no context and no block; row 1: 4 context rows
    out = paged_block_attention_reference(**c, causal=False, window=None, scale=0.3)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out[1].abs().sum() > 0 and not out.isnan().any()
    c["ctx_len"].zero_()  # no row has any key
    out = paged_block_attention_reference(**c, causal=False, window=None, scale=0.3)
    assert torch.equal(out, torch.zeros_like(out))


def bad_attention_calls():
    """What the kernel's own checks would reject, which the wrapper must (an error in the op
    itself may crash the process): name -> (message, change to a good call)."""
    def strided(c):  # a [bs] view with stride 2
        return torch.stack([c["slots"], c["slots"]], 1)[:, 0]
    return {
        "int64 slots": ("slots must be a contiguous int32", lambda c: {"slots": c["slots"].long()}),
        "strided slots": ("slots must be a contiguous int32", lambda c: {"slots": strided(c)}),
        "caches elsewhere": ("the caches must be on q's", lambda c: {"k_cache": c["k_cache"].to("meta"),
                                                                      "v_cache": c["v_cache"].to("meta")}),
        "block elsewhere": ("k_blk and v_blk must be on q's", lambda c: {"k_blk": c["k_blk"].to("meta"),
                                                                          "v_blk": c["v_blk"].to("meta")}),
        "no query heads": ("torch.Size", lambda c: {"q": c["q"][:, :, :0]}),
    }


def test_an_empty_block_attends_to_nothing():
    c = make_case(2, 2, 4, 2, 8, [3, 1], "given")
    c.update(q=c["q"][:, :0], k_blk=c["k_blk"][:, :0], v_blk=c["v_blk"][:, :0])
    out = paged_block_attention(**c, causal=False, window=None, scale=0.3)
    assert out.shape == (2, 0, 4, 8)


@pytest.mark.cuda
def test_cuda_an_empty_block_launches_nothing():
    """Freshly allocated empty tensors have no data pointer, which the kernel's checks reject
    (a check failing inside the op would crash the process on some torch builds)."""
    assert plugins.load() is not None
    c = make_case(2, 2, 4, 2, 64, [3, 1], "given", dtype=torch.bfloat16, device="cuda")
    empty = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="cuda")  # noqa: E731
    c.update(q=empty(2, 0, 4, 64), k_blk=empty(2, 0, 2, 64), v_blk=empty(2, 0, 2, 64))
    assert paged_block_attention(**c, causal=False, window=None, scale=0.3).shape == (2, 0, 4, 64)


@pytest.mark.parametrize("name", bad_attention_calls())
def test_wrapper_rejects_bad_index_tensors_and_tensors_on_other_devices_naming_them(name):
    c = make_case(2, 2, 4, 2, 8, [3, 1], "given")
    message, change = bad_attention_calls()[name]
    with pytest.raises(AssertionError, match=message):
        paged_block_attention(**{**c, **change(c)}, causal=False, window=None, scale=0.3)


def test_plugins_are_not_loaded_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert plugins.load() is None
    assert (plugins.plugin_dir() / "block_attention.cu").is_file()


def test_kernel_supports_lists_bf16_fp16_at_64_128_256_and_fp32_at_multiples_of_8():
    assert [d for d in range(300) if block_attention_kernel_supports(torch.bfloat16, d)] == [64, 128, 256]
    assert [d for d in range(300) if block_attention_kernel_supports(torch.float16, d)] == [64, 128, 256]
    assert [d for d in range(300) if block_attention_kernel_supports(torch.float32, d)] == list(range(8, 257, 8))
    assert not any(block_attention_kernel_supports(torch.float64, d) for d in range(300))
    assert not _cuda_block_attention_supported(torch.zeros(1, 1, 1, 64))  # CPU tensors take the reference


# What the op accepts comes from two places: ops.cpp's torch dtype -> DType switch, and
# dflash::block_attention_supports(DType, head_dim) in block_attention.h, which
# block_attention_check applies. Python's block_attention_kernel_supports must say the same.
OPS_CPP_TORCH_TYPES = {"BFloat16": torch.bfloat16, "Half": torch.float16, "Float": torch.float32}
DTYPE_ENUM = {"BFloat16": torch.bfloat16, "Float16": torch.float16, "Float32": torch.float32}
SUPPORTS_PROGRAM = r"""
#include <cstdio>
#include "block_attention.h"
int main() {
  using dflash::DType;
  const struct { DType dtype; const char* name; } types[] = {
      {DType::kBFloat16, "BFloat16"}, {DType::kFloat16, "Float16"}, {DType::kFloat32, "Float32"}};
  for (const auto& t : types)
    for (int d = 0; d <= 512; ++d)
      if (dflash::block_attention_supports(t.dtype, d)) std::printf("%s %d\n", t.name, d);
}
"""


def test_kernel_supports_matches_ops_cpp_dtype_switch():
    source = (PLUGINS / "ops.cpp").read_text()
    body = re.search(r"attention_dtype\(at::ScalarType t\) \{(.*?)\n\}", source, re.S).group(1)
    cases = re.findall(r"case at::k(\w+): return dflash::DType::k(\w+);", body)
    assert cases and all(OPS_CPP_TORCH_TYPES[a] == DTYPE_ENUM[b] for a, b in cases), cases
    accepted = {OPS_CPP_TORCH_TYPES[a] for a, _ in cases}
    candidates = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8)
    supported = {t for t in candidates if any(block_attention_kernel_supports(t, d) for d in range(513))}
    assert supported == accepted


def test_kernel_supports_matches_block_attention_supports(tmp_path):
    """Compiles a host program against block_attention.h and runs it (no GPU needed)."""
    lines = run_host_program(tmp_path, SUPPORTS_PROGRAM).split()
    in_cpp = {(DTYPE_ENUM[name], int(d)) for name, d in zip(lines[::2], lines[1::2])}
    in_python = {(t, d) for t in DTYPE_ENUM.values() for d in range(513) if block_attention_kernel_supports(t, d)}
    assert in_cpp == in_python


@pytest.mark.parametrize("source", sorted(PLUGINS.glob("*.cu")), ids=lambda p: p.name)
def test_plugin_compiles_alone_with_nvcc(source):
    if plugins.nvcc_path() is None:
        pytest.skip("nvcc not found")
    result = plugins.compile_check(source, arch="sm_90")
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------------------------
# CUDA kernel against the fp32 reference. bf16: P and the output are rounded to bf16 (8-bit
# mantissa); an emulation of exactly those roundings on random data peaks at 8e-3, so 2e-2
# leaves 2.5x margin. fp16 (11-bit mantissa) peaked at 1.2e-3; 4e-3 likewise. fp32: both
# sides compute in fp32 and differ only in summation order and exp rounding (relative
# weight errors of a few 1e-7); a float32 emulation of the fp32 kernel's operation order
# (CPU, d 8 to 256, up to 2000 keys, 1 to 7 splits) peaked at 1.2e-6 from the reference,
# which itself is up to 1e-6 from float64. 1e-5 leaves about 8x margin and is still about
# 2000x below the bf16 bound, so a wrong key or mask (errors of order 0.1) cannot hide.

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}

# (bs, T, Hq, Hkv, starts, block, causal, window)
CUDA_CASES = {
    "draft ragged edges": (6, 16, 32, 8, [0, 1, 63, 64, 65, 4095], "given", False, None),
    "draft sliding ragged edges": (6, 16, 32, 8, [0, 1, 63, 64, 65, 4095], "given", True, 64),
    "verify ragged edges": (6, 16, 32, 8, [0, 1, 63, 64, 65, 4095], "cached", True, None),
    "decode T=1 GQA 4:1": (6, 1, 32, 8, [0, 1, 63, 64, 65, 4095], "cached", True, None),
    "decode T=1 GQA 1:1": (4, 1, 8, 8, [1, 64, 65, 1000], "cached", True, None),
    # Rows per KV head = T x the GQA group; small launches take 16- or 32-row CTAs (launch_plan)
    "T=8 GQA 4:1 (32 rows)": (3, 8, 16, 4, [5, 129, 700], "given", False, None),
    "T=12 GQA 4:1 (48 rows)": (3, 12, 16, 4, [5, 129, 700], "given", True, 100),
    "T=12 GQA 4:1, batch 8 (48 rows in one 64-row CTA)": (8, 12, 32, 8, [0, 1, 65, 300, 700, 1000, 2000, 4095],
                                                         "given", True, 100),
    "T=32 GQA 4:1 (two query chunks)": (2, 32, 16, 4, [77, 1500], "cached", True, None),
    "T=16 GQA 5:1 (80 rows)": (2, 16, 40, 8, [0, 333], "given", False, None),
    "batch 1 verify, short context (16-row CTAs)": (1, 16, 32, 8, [500], "cached", True, None),
    "prefill T=100 (seven query chunks)": (2, 100, 32, 8, [0, 300], "cached", True, None),
    "prefill T=100 sliding": (1, 100, 32, 8, [500], "given", True, 64),
    "long context 32768": (2, 16, 32, 8, [32768, 100], "given", False, None),
    "long context 32768 verify": (1, 16, 32, 8, [32768], "cached", True, None),
    "long context 32768 window": (1, 16, 32, 8, [32768], "given", True, 4096),
    # Qwen3.5 full-attention layers: 16 query heads on 4 KV heads (9B), 24 on 4 (27B). At
    # d = 256, M = 64 takes 4 m-tiles, decode's M = 4 two (the second all padding) and the
    # 27B block's M = 96 two query chunks.
    "Qwen3.5 draft GQA 16:4": (5, 16, 16, 4, [0, 1, 63, 65, 4095], "given", False, None),
    "Qwen3.5 draft sliding GQA 16:4": (5, 16, 16, 4, [0, 1, 63, 65, 4095], "given", True, 64),
    "Qwen3.5 verify GQA 16:4": (5, 16, 16, 4, [0, 1, 63, 65, 4095], "cached", True, None),
    "Qwen3.5 cached non-causal GQA 16:4": (5, 16, 16, 4, [0, 1, 63, 65, 4095], "cached", False, None),
    "Qwen3.5 decode T=1 GQA 16:4": (5, 1, 16, 4, [0, 1, 63, 65, 4095], "cached", True, None),
    "Qwen3.5-27B verify GQA 24:4": (3, 16, 24, 4, [0, 65, 4095], "cached", True, None),
}


def check_cuda_kernel_against_reference(case, dtype, d):
    assert plugins.load() is not None
    bs, T, Hq, Hkv, starts, block, causal, window = case
    c = make_case(bs, T, Hq, Hkv, d, starts, block, dtype=dtype, device="cuda")
    assert _cuda_block_attention_supported(c["q"])  # the kernel runs, not the reference
    scale = d ** -0.5
    got = paged_block_attention(**c, causal=causal, window=window, scale=scale)
    expected = paged_block_attention_reference(**as_fp32(c), causal=causal, window=window, scale=scale)
    assert got.dtype == dtype and got.shape == expected.shape
    assert not got.isnan().any()
    err = (got.float() - expected).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max abs error {err}"


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", CUDA_CASES.values(), ids=CUDA_CASES.keys())
def test_cuda_kernel_matches_fp32_reference(case, dtype, d):
    check_cuda_kernel_against_reference(case, dtype, d)


# The fp32 kernel takes any head_dim that is a multiple of 8 up to 256 (the tiny test models
# use 16 and 32; 256, run above, and 200 use a second column group per lane, 200 and 8 partly).
FP32_HEAD_SIZE_CASES = [(name, d) for d in (16, 32) for name in CUDA_CASES] + [
    (name, d) for d in (8, 200) for name in ("draft ragged edges", "verify ragged edges", "long context 32768")]


@pytest.mark.cuda
@pytest.mark.parametrize("name,d", FP32_HEAD_SIZE_CASES, ids=[f"{n}-d{d}" for n, d in FP32_HEAD_SIZE_CASES])
def test_cuda_fp32_kernel_other_head_sizes_match_reference(name, d):
    check_cuda_kernel_against_reference(CUDA_CASES[name], torch.float32, d)


KERNELS = [(torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float16, 256), (torch.float32, 128),
           (torch.float32, 32), (torch.float32, 256)]
KERNEL_IDS = [f"{str(t).removeprefix('torch.')}-d{d}" for t, d in KERNELS]


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [1, 2, 7, 40, 64])  # the combine reads lse 32 splits at a time
@pytest.mark.parametrize("dtype,d", KERNELS, ids=KERNEL_IDS)
def test_cuda_split_count_does_not_change_the_result(dtype, d, num_splits):
    assert plugins.load() is not None
    c = make_case(3, 16, 32, 8, d, [0, 70, 3000], "given", dtype=dtype, device="cuda")
    expected = paged_block_attention_reference(**as_fp32(c), causal=True, window=None, scale=0.1)
    got = torch.ops.dflash.block_attention(c["q"], c["k_cache"], c["v_cache"], c["slots"], c["ctx_len"],
                                           c["q_start"], c["k_blk"], c["v_blk"], True, 0, 0.1, 0, num_splits)
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [3, 40])
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256)],
                         ids=["bf16-d128", "fp16-d64", "bf16-d256"])
def test_cuda_forced_split_count_with_small_ctas_matches_reference(dtype, d, num_splits):
    # batch 1, short context: the launch takes 16-row CTAs (32 at d = 256) whatever the splits
    assert plugins.load() is not None
    c = make_case(1, 16, 32, 8, d, [500], "cached", dtype=dtype, device="cuda")
    expected = paged_block_attention_reference(**as_fp32(c), causal=True, window=None, scale=0.1)
    got = torch.ops.dflash.block_attention(c["q"], c["k_cache"], c["v_cache"], c["slots"], c["ctx_len"],
                                           c["q_start"], c["k_blk"], c["v_blk"], True, 0, 0.1, 0, num_splits)
    assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [2, 5, 8, 9])  # up to 8: one cluster a row's splits, merged on chip
@pytest.mark.parametrize("T, Hq, Hkv", [(1, 16, 2), (1, 32, 8), (16, 32, 8)])  # decode (35B-A3B, 8B); a verify
# block takes the combine kernel
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 256),
                                     (torch.bfloat16, 256)], ids=["bf16-d64", "bf16-d128", "fp16-d256", "bf16-d256"])
def test_cuda_batch_one_splits_merged_in_a_cluster_match_reference(dtype, d, T, Hq, Hkv, num_splits):
    assert plugins.load() is not None
    for start in (700, 0):  # 0 with the block given: the first splits see no key at all
        c = make_case(1, T, Hq, Hkv, d, [start], "given", dtype=dtype, device="cuda", seed=num_splits)
        expected = paged_block_attention_reference(**as_fp32(c), causal=True, window=None, scale=0.1)
        got = torch.ops.dflash.block_attention(c["q"], c["k_cache"], c["v_cache"], c["slots"], c["ctx_len"],
                                               c["q_start"], c["k_blk"], c["v_blk"], True, 0, 0.1, 0, num_splits)
        assert (got.float() - expected).abs().max().item() <= TOLERANCE[dtype], start


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.bfloat16, 256), (torch.float32, 64),
                                     (torch.float32, 16)], ids=["bf16-d64", "bf16-d256", "fp32-d64", "fp32-d16"])
def test_cuda_fully_masked_queries_are_zero_not_nan(dtype, d, num_splits):
    assert plugins.load() is not None
    c = make_case(2, 4, 8, 2, d, [0, 10], "given", dtype=dtype, device="cuda")
    # No block and an empty row 0: nothing visible there. Row 1 keeps its 10 context rows.
    got = torch.ops.dflash.block_attention(c["q"], c["k_cache"], c["v_cache"], c["slots"], c["ctx_len"],
                                           c["q_start"], None, None, False, 0, 0.125, 0, num_splits)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert not got.isnan().any() and got[1].abs().sum() > 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_kernel_reads_a_layer_view_and_strided_block_kv(dtype):
    """The model passes cache.k[layer] of the 5-D cache and v as a slice of the packed qkv output."""
    assert plugins.load() is not None
    bs, T, Hq, Hkv, d = 2, 16, 32, 8, 128
    c = make_case(bs, T, Hq, Hkv, d, [50, 300], "given", dtype=dtype, device="cuda")
    layers = torch.randn(3, *c["k_cache"].shape, dtype=dtype, device="cuda")
    layers[1] = c["k_cache"]
    vlayers = torch.randn_like(layers)
    vlayers[1] = c["v_cache"]
    packed = torch.randn(bs, T, (Hq + 2 * Hkv) * d, dtype=dtype, device="cuda")
    packed[..., (Hq + Hkv) * d:] = c["v_blk"].flatten(2)
    v_view = packed[..., (Hq + Hkv) * d:].unflatten(-1, (Hkv, d))
    assert not v_view.is_contiguous()
    got = paged_block_attention(c["q"], layers[1], vlayers[1], c["slots"], c["ctx_len"], c["q_start"], c["k_blk"],
                                v_view, causal=False, window=None, scale=d ** -0.5)
    expected = paged_block_attention(**c, causal=False, window=None, scale=d ** -0.5)
    assert torch.equal(got, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float32, 128),
                                     (torch.float32, 32)], ids=["bf16-d128", "bf16-d256", "fp32-d128", "fp32-d32"])
def test_cuda_kernel_replays_in_a_cuda_graph_with_new_lengths(dtype, d):
    """Also shows the kernel ran: the reference reads ctx_len on the host, which capture forbids."""
    assert plugins.load() is not None
    c = make_case(4, 16, 32, 8, d, [10, 200, 900, 2000], "given", dtype=dtype, device="cuda")
    run = lambda: paged_block_attention(**c, causal=False, window=None, scale=0.1, max_keys=4096)  # noqa: E731
    run()  # warm up (build, first-launch attributes) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    c["ctx_len"].copy_(torch.tensor([2000, 0, 17, 1024], dtype=torch.int32))
    c["q_start"].copy_(c["ctx_len"])
    graph.replay()
    expected = paged_block_attention_reference(**as_fp32(c), causal=False, window=None, scale=0.1)
    assert (out.float() - expected).abs().max().item() <= TOLERANCE[dtype]
