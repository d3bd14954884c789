// RMSNorm arithmetic for the kernels that run a norm inside another launch, with the bits of
// layer_ops.cu's rms_norm kernel (the same formula, kept there as it was so that the norm
// kernels' code is unchanged; semantics in layer_ops.h, RmsNormParams): the add + norm of one
// row by one CTA after a GEMV (gemv.cu; tests/test_gemv.py holds it to the same bits) and the
// gated norm of gated_delta.cu's fused decode step (tests/test_gated_delta_kernel.py). Device
// code: include from .cu only.

#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "float_convert.h"
#include "gemv.h"
#include "lanes.h"
#include "pdl.h"

namespace dflash {

// 1 / rms from the row's sum of squares, as torch: mean = sum * (1 / H), + eps, rsqrt (CUDA's
// rsqrtf, as torch.rsqrt).
__device__ __forceinline__ float inv_rms(float sum_sq, int H, float eps) {
  return rsqrtf(__fadd_rn(__fmul_rn(sum_sq, 1.0f / H), eps));
}

// One normalised element before its final rounding: Qwen3 rounds n to the model dtype and scales
// in it; Qwen3.5 (zero-centred) scales by 1 + w in fp32.
template <typename T>
__device__ __forceinline__ float rms_scaled(float s, float inv, float w, bool zero_centered) {
  const float n = __fmul_rn(s, inv);
  return zero_centered ? __fmul_rn(n, __fadd_rn(1.0f, w)) : __fmul_rn(w, rounded<T>(n));
}

// rms_norm's one-pass rows: up to this many 16-byte vectors (H <= 8192 in 16-bit types), one a
// thread, the threads the vectors rounded up to a warp.
constexpr int kRowNormMaxVectors = 1024;

// sum = residual + delta (fp32) and out = its RMSNorm, of one row of H elements (a multiple of 8,
// at most 8 kPlays kThreads), by a whole CTA of kThreads threads, with the bits of rms_norm's
// one-pass row: there vector v is thread v's, each thread sums its squares in order, each warp by
// warp_sum, then warp 0 the warps' sums by warp_sum. Here thread t plays the threads t, t +
// kThreads, ... of that launch, so every sum is added in the same order. All of a thread's loads
// are issued before its first sum: one memory round trip, not one a play. delta is read through
// L2 (__ldcg): other CTAs of the grid wrote it. Every thread of the CTA must call it.
template <typename T, int kThreads, int kPlays>
__device__ void cta_add_rms_norm(const float* residual, const T* delta, const T* weight, int H, float eps,
                                 bool zero_centered, float* sum, T* out) {
  static_assert(kThreads % 32 == 0 && kPlays * kThreads <= kRowNormMaxVectors, "whole warps, one-pass rows");
  __shared__ float warp_sums[kRowNormMaxVectors / 32];
  __shared__ float total;
  const int vectors = H / 8, warps = (vectors + 31) / 32, lane = threadIdx.x % 32;
  float4 r[kPlays][2];
  uint4 d[kPlays], w[kPlays];
#pragma unroll
  for (int j = 0; j < kPlays; ++j) {
    const int v = j * kThreads + static_cast<int>(threadIdx.x);  // the played thread, and its vector
    if (v < vectors) {
      r[j][0] = reinterpret_cast<const float4*>(residual)[2 * v];
      r[j][1] = reinterpret_cast<const float4*>(residual)[2 * v + 1];
      d[j] = __ldcg(reinterpret_cast<const uint4*>(delta) + v);
      w[j] = reinterpret_cast<const uint4*>(weight)[v];
    }
  }
  float s[kPlays][8];
#pragma unroll
  for (int j = 0; j < kPlays; ++j) {
    const int v = j * kThreads + static_cast<int>(threadIdx.x);
    float sq = 0.0f;
    if (v < vectors) {
      const float rf[8] = {r[j][0].x, r[j][0].y, r[j][0].z, r[j][0].w, r[j][1].x, r[j][1].y, r[j][1].z, r[j][1].w};
      float df[8];
      unpack8<T>(d[j], df);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        s[j][k] = __fadd_rn(rf[k], df[k]);
        sq = __fadd_rn(sq, __fmul_rn(s[j][k], s[j][k]));
      }
      reinterpret_cast<float4*>(sum)[2 * v] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
      reinterpret_cast<float4*>(sum)[2 * v + 1] = make_float4(s[j][4], s[j][5], s[j][6], s[j][7]);
    }
    sq = warp_sum(sq);
    if (lane == 0 && v / 32 < warps) warp_sums[v / 32] = sq;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const float t = warp_sum(lane < warps ? warp_sums[lane] : 0.0f);
    if (lane == 0) total = t;
  }
  __syncthreads();
  const float inv = inv_rms(total, H, eps);
#pragma unroll
  for (int j = 0; j < kPlays; ++j) {
    const int v = j * kThreads + static_cast<int>(threadIdx.x);
    if (v >= vectors) break;
    float wf[8];
    unpack8<T>(w[j], wf);
    float y[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) y[k] = rms_scaled<T>(s[j][k], inv, wf[k], zero_centered);
    reinterpret_cast<uint4*>(out)[v] = pack8<T>(y);
  }
}

// The add + norm after a launch whose CTAs each wrote part of delta (H elements, in T): every CTA
// calls it after its writes. The CTA that takes the last ticket sees all of delta; it lets the
// next kernel start (whose CTAs may fetch their weights while it norms), runs cta_add_rms_norm
// (each of its kThreads threads over kPlays vectors) and zeroes the ticket for the next launch.
template <typename T, int kThreads, int kPlays>
__device__ void add_rms_norm_if_last(const T* delta, int H, const GemvNorm& n) {
  __shared__ bool last;
  __threadfence();  // this CTA's part of delta before its ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(n.ticket, 1) == static_cast<int>(gridDim.x) - 1;
  __syncthreads();
  if (!last) return;
  pdl_allow_dependents();
  __threadfence();
  cta_add_rms_norm<T, kThreads, kPlays>(n.residual, delta, static_cast<const T*>(n.weight), H, n.eps, n.zero_centered,
                                        n.sum, static_cast<T*>(n.out));
  if (threadIdx.x == 0) *n.ticket = 0;
}

}  // namespace dflash
