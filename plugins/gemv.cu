// Skinny matmul for decode and verify (semantics in gemv.h).
//
// One row of x (an AR step at batch 1) runs on CUDA cores. A warp owns R consecutive output
// features (rows of W) over a contiguous slice of K: each lane reads 16-byte chunks c = lane,
// lane + 32, ... of its slice of the R weight rows, U = 8 / R chunks per row per iteration, so
// every lane has eight independent 16-byte loads in flight whatever R is (a decode step is
// bound by how many bytes are in flight per SM). The weight is read once, streaming (__ldcs:
// it will not be reused); x is small and read by every warp, through L1 (__ldg), one x load
// per R weight loads. fp32 partial sums per row, a warp sum, then the slices' sums added in
// shared memory. Where there are many waves of CTAs (an LM head, a dense MLP's gate_up), a warp
// issues its next loads before its math (lanes.h, lane_dots_pipelined). launch_one_row picks R,
// the slices and the pipelining per feature count. The launch may
// overlap the kernel before it (pdl.h): the CTAs that start early pull their first weight
// lines into L2 while the input is being computed. With a GemvNorm, the CTA that finishes last
// (a ticket) runs the residual add + RMSNorm that follows the matmul (row_norm.h): a layer's
// o_proj or down_proj and the next norm in one launch, which saves the norm's launch and its
// wait on the matmul's tail.
//
// Two to 16 rows (a verify or draft block at batch 1, a small batch) run on the tensor cores: a
// CTA owns 16 MT output features and every row of x, its warps split K, and each warp applies
// its 16-row weight tiles to the x rows in 8-row tiles (mma_tile.h), the weight streamed once
// as above. Each extra 8 rows of x cost one MMA per weight chunk, not another read of the
// weight; but also another 16-byte load of x per weight chunk, which beyond 16 rows costs more
// than cuBLAS's shared-memory tiles. launch_rows picks the CTA layout per row count and size.
//
// This file has no torch dependency: it compiles alone with
//   nvcc -std=c++17 -arch=sm_90 -c gemv.cu

#include "gemv.h"

#include "device.h"
#include "float_convert.h"
#include "lanes.h"
#include "mma_tile.h"
#include "pdl.h"
#include "row_norm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dflash {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kLoadsInFlight = 8;  // 16-byte weight loads per lane per iteration

// A CTA's 8 warps are 8 / S groups of S: a group owns R consecutive output features, its S
// warps each a contiguous 1/S of K; the S sums meet in shared memory, added in slice order.
// kPipelined: each warp's loop is lane_dots_pipelined. kNormPlays > 0: a norm follows (which
// decides when the next kernel may start).
template <typename T, int R, int S, bool kPipelined, int kNormPlays>
__device__ __forceinline__ void gemv_row(const GemvParams& p) {
  constexpr int U = kLoadsInFlight / R, kGroups = kWarps / S;
  __shared__ float part[kGroups][S][R];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = warp / S, slice = warp % S;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kGroups + group) * R;
  const int64_t chunks = p.in_features / 8, per = (chunks + S - 1) / S;
  const int64_t begin = min(slice * per, chunks), count = min(per, chunks - begin);
  const uint4* w = static_cast<const uint4*>(p.weight);
  const uint4* x = static_cast<const uint4*>(p.x) + begin;
  const uint4* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r)  // past the last feature: read the last row again, never written
    rows[r] = w + (n0 + r < p.out_features ? n0 + r : p.out_features - 1) * chunks + begin;

#pragma unroll
  for (int u = 0; u < U; ++u) {  // the first iteration's weight lines, while the input is computed
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (lane + 32 * u < count) prefetch_l2(rows[r] + lane + 32 * u);
  }
  pdl_wait();
  // With the norm, the last CTA lets the next kernel start (the others count once they exit):
  // started with every CTA, its CTAs would wait out this one's whole matmul.
  if constexpr (kNormPlays == 0) pdl_allow_dependents();

  float acc[R] = {};
  if constexpr (kPipelined) {
    lane_dots_pipelined<T, R, U>(rows, x, count, lane, acc);
  } else {
    lane_dots<T, R, U>(rows, x, count, lane, acc);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) part[group][slice][r] = acc[r];
  }
  __syncthreads();  // every warp gets here: none returns early
  if (slice == 0 && lane < R && n0 + lane < p.out_features) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < S; ++i) sum += part[group][i][lane];
    const int64_t n = n0 + lane;
    const T* bias = static_cast<const T*>(p.bias);
    const float b = bias != nullptr ? to_float(bias[n]) : 0.0f;
    static_cast<T*>(p.y)[n] = from_float<T>(sum + b);
  }
}

template <typename T, int R, int S, bool kPipelined>
__global__ void __launch_bounds__(kThreads) gemv_kernel(GemvParams p) {
  gemv_row<T, R, S, kPipelined, 0>(p);
}

// The matmul, then the add + norm (GemvNorm), each of the last CTA's threads over kNormPlays
// vectors of the row.
template <typename T, int R, int S, bool kPipelined, int kNormPlays>
__global__ void __launch_bounds__(kThreads) gemv_norm_kernel(GemvParams p, GemvNorm n) {
  gemv_row<T, R, S, kPipelined, kNormPlays>(p);
  add_rms_norm_if_last<T, kThreads, kNormPlays>(static_cast<const T*>(p.y), static_cast<int>(p.out_features), n);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Two features a group, K in two slices, unless that leaves fewer CTAs than SMs (a router's few
// hundred features): then one feature a group and K in four slices. Against one warp a feature
// and all of K, the x loads per weight load halve (R = 2) and each warp's loop is shorter, so
// the weights stream nearer copy bandwidth. With four features a warp still at least four CTAs an
// SM, the reads are long enough for the pipelined loop's extra bytes in flight to pay (four
// features, all of K): it wins on the LM heads and gate_up, loses on the smaller projections
// (benchmarks/gemv_slices_ab_h200.json; ar_b1_ab_h200.json: b9e2f38 in round 2, W in session 29).
// As features a CTA: 32 (R = 4, pipelined), 8 (R = 2), 2 (R = 1).
int one_row_features_per_cta(int64_t N, int sms) {
  if (ceil_div(N, 4 * kWarps) >= 4 * sms) return 4 * kWarps;
  if (ceil_div(N, kWarps) >= sms) return kWarps;
  return kWarps / 4;
}

// The one-row kernel of a layout (R features a group, K in S slices), with the add + norm after
// it where a GemvNorm is given.
template <typename T, int R, int S, bool kPipelined, int kNormPlays, typename... Norm>
cudaError_t launch_layout(const GemvParams& p, dim3 grid, cudaStream_t stream, const Norm&... norm) {
  if constexpr (sizeof...(Norm) == 0)
    return pdl_launch(gemv_kernel<T, R, S, kPipelined>, grid, dim3(kThreads), 0, stream, true, p);
  else
    return pdl_launch(gemv_norm_kernel<T, R, S, kPipelined, kNormPlays>, grid, dim3(kThreads), 0, stream, true, p,
                      norm...);
}

template <typename T, int kNormPlays = 0, typename... Norm>
cudaError_t launch_one_row(const GemvParams& p, int sms, cudaStream_t stream, const Norm&... norm) {
  const int per_cta = one_row_features_per_cta(p.out_features, sms);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.out_features, per_cta)));
  if (per_cta == 4 * kWarps) return launch_layout<T, 4, 1, true, kNormPlays>(p, grid, stream, norm...);
  if (per_cta == kWarps) return launch_layout<T, 2, 2, false, kNormPlays>(p, grid, stream, norm...);
  return launch_layout<T, 1, 4, false, kNormPlays>(p, grid, stream, norm...);
}

// y[m, n] for the 16 MT features n of tile blockIdx.x and every row m of x (NT tiles of 8); the
// W warps split K.
template <typename T, int W, int MT, int NT>
__global__ void __launch_bounds__(W * 32, 2) gemm_tile_kernel(GemvParams p) {
  __shared__ float part[W - 1][MT][NT][4][32];
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t N = p.out_features, row0 = static_cast<int64_t>(blockIdx.x) * 16 * MT;
  const int64_t chunks = p.in_features / 8;
  const uint4* w = static_cast<const uint4*>(p.weight);
  const uint4* a[2 * MT];
#pragma unroll
  for (int r = 0; r < 2 * MT; ++r)  // past the last feature: read the last row again, never written
    a[r] = w + (row0 + g + 8 * r < N ? row0 + g + 8 * r : N - 1) * chunks;
  const uint4* b[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) b[n] = 8 * n + g < p.rows ? static_cast<const uint4*>(p.x) + (8 * n + g) * chunks : nullptr;
  float acc[MT][NT][4] = {};
  mma_tile::warp_tile<T, W, MT, NT, true>(a, b, chunks, threadIdx.x / 32, acc);
  if (!mma_tile::sum_warps<W, MT, NT>(acc, part)) return;

  T* y = static_cast<T*>(p.y);
  const T* bias = static_cast<const T*>(p.bias);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t row = row0 + 16 * m + g + 8 * (i / 2);
        const int col = 8 * n + 2 * t + i % 2;
        if (row >= N || col >= p.rows) continue;
        const float b = bias != nullptr ? to_float(bias[row]) : 0.0f;
        y[col * N + row] = from_float<T>(acc[m][n][i] + b);
      }
    }
  }
}

template <typename T, int W, int MT, int NT>
cudaError_t launch_tiles(const GemvParams& p, cudaStream_t stream) {
  const auto ctas = static_cast<unsigned>(ceil_div(p.out_features, 16 * MT));
  // launched plainly: overlapping the kernel before it (as the one-row kernel does) made the
  // model's verify and draft passes slower (commit e337b33, BENCHMARKS.md at that commit, "GEMV")
  gemm_tile_kernel<T, W, MT, NT><<<ctas, W * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

// Up to 8 rows: 16 features per CTA of 8 warps. 9 to 16 (twice the x loads per weight chunk):
// two 16-feature tiles per CTA of 8 warps where that leaves two CTAs per SM, else one per CTA
// of 16 warps. The layouts that won in the model's passes (commit e337b33, BENCHMARKS.md at that
// commit, "GEMV").
template <typename T>
cudaError_t launch_rows(const GemvParams& p, int sms, cudaStream_t stream) {
  if (p.rows <= 8) return launch_tiles<T, 8, 1, 1>(p, stream);
  if (ceil_div(p.out_features, 32) >= 2 * sms) return launch_tiles<T, 8, 2, 2>(p, stream);
  return launch_tiles<T, 16, 1, 2>(p, stream);
}

template <typename T>
cudaError_t launch_typed(const GemvParams& p, const GemvNorm* norm, cudaStream_t stream) {
  const int sms = device_sms();  // 0 where unknown: the widest layouts, which run anywhere
  if (p.rows > 1) return launch_rows<T>(p, sms, stream);
  if (!norm) return launch_one_row<T>(p, sms, stream);
  // the fewest vectors a thread of the norm's CTA that the row needs (registers: the whole
  // kernel is compiled for what its epilogue keeps live)
  const int64_t vectors = p.out_features / 8;
  if (vectors <= kThreads) return launch_one_row<T, 1>(p, sms, stream, *norm);
  if (vectors <= 2 * kThreads) return launch_one_row<T, 2>(p, sms, stream, *norm);
  return launch_one_row<T, 4>(p, sms, stream, *norm);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

const char* gemv_check(const GemvParams& p, const GemvNorm* norm) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return "dtype must be bf16 or fp16";
  if (p.rows < 1 || p.rows > kGemvMaxRows) return "rows must be in [1, 16]";
  if (p.out_features < 1 || p.out_features > (int64_t{1} << 34)) return "out_features must be in [1, 2^34]";
  if (p.in_features < 8 || p.in_features % 8 != 0) return "in_features must be a positive multiple of 8";
  if (!p.x || !p.weight || !p.y) return "null pointer";
  if (!aligned16(p.x) || !aligned16(p.weight)) return "x and weight must be 16-byte aligned";
  if (norm == nullptr) return nullptr;
  const GemvNorm& n = *norm;
  if (p.rows != 1) return "the add + norm takes one row";
  if (p.out_features > kGemvNormMaxFeatures || p.out_features % 8 != 0)
    return "the add + norm needs out_features a multiple of 8, at most 8192";
  if (!n.residual || !n.weight || !n.sum || !n.out || !n.ticket) return "null pointer";
  if (!aligned16(p.y) || !aligned16(n.residual) || !aligned16(n.weight) || !aligned16(n.sum) || !aligned16(n.out))
    return "y, residual, norm weight, sum and out must be 16-byte aligned";
  return nullptr;
}

cudaError_t gemv_launch(const GemvParams& p, cudaStream_t stream, const GemvNorm* norm) {
  if (gemv_check(p, norm) != nullptr) return cudaErrorInvalidValue;
  return p.dtype == DType::kBFloat16 ? launch_typed<__nv_bfloat16>(p, norm, stream)
                                     : launch_typed<__half>(p, norm, stream);
}

}  // namespace dflash
