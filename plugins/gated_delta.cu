// Gated DeltaNet recurrence of a decode/verify pass, on the cache in place (semantics in
// gated_delta.h): reads each row's committed state from state_cache, writes the state after
// the row's last NS tokens into snapshot_cache, one launch per layer. The engine uses NS = 0
// (outputs only: a verify pass) and NS = 1 in place (an AR step, and the replay of a verify's
// accepted tokens at commit).
//
// Work split. Column j of the state S [dk, dv] evolves on its own: its update needs only the
// sums S[:, j]^T k and S[:, j]^T q over dk, and v[j]. So a warp owns 16 value columns of one
// (row, head) for the whole pass. Its lanes are 8 (dk) x 4 (columns, a float4 each): lane
// (r, c) keeps rows r, r + 8, r + 16, ... of columns 4c .. 4c + 3 in registers (dk / 2 floats,
// 64 for dk = 128), and a sum over dk is the lane's partial sum plus a 3-step xor butterfly
// across the 8 row lanes, no shared memory and no barrier. A CTA is 1, 2 or 4 warps on
// adjacent column groups of the same (row, head); they stage each chunk of up to 16 tokens'
// k, q, v, exp(g) and beta in shared memory once, so the token loop reads nothing from global
// memory. Grid (dv / CTA columns, Hv, bs): Qwen3.5-9B at batch 1 (Hv 32, dv 128) runs 256
// one-warp CTAs, about two per SM of an H100; larger batches get 4-warp CTAs.
//
// Memory. The pass reads the state once and writes each snapshot once; the snapshots are
// most of the traffic (16 x the state at T = 16). A warp's store covers 8 rows x 64
// contiguous bytes (whole 32-byte sectors). Snapshots are stored with the streaming hint:
// commit reads back one of them after every layer has run, so keeping them in L2 would only
// evict the weights.
//
// Arithmetic. Per token, with a = exp(g):
//   S^T k and S^T q of the decayed state a S are a (S^T k) and a (S^T q), and
//   out = (a S + k delta^T)^T q = a (S^T q) + delta (k . q),
// so the three sums come from the old S in one butterfly (9 values), then the update
// S = a S + k delta^T. It is the reference's algebra with another rounding order: a few fp32
// ulps per token, and the recurrence does not amplify them (the decay is <= 1 and
// I - beta k k^T, |k| = 1, 0 < beta < 1, is a contraction).
//
// This file has no torch dependency: it compiles alone with
//   nvcc -std=c++17 -arch=sm_90 -c gated_delta.cu

#include "gated_delta.h"

#include "device.h"
#include "float_convert.h"
#include "lanes.h"
#include "pdl.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dflash {
namespace {

constexpr int kRowLanes = 8;              // lanes across dk
constexpr int kColLanes = 4;              // lanes across a warp's columns, a float4 each
constexpr int kWarpCols = 4 * kColLanes;  // 16 value columns per warp
constexpr int kMaxWarps = 4;              // per CTA
constexpr int kChunk = 16;                // tokens staged in shared memory at a time

__device__ __forceinline__ float4 load4(const float* src) { return *reinterpret_cast<const float4*>(src); }

template <typename T>
__device__ __forceinline__ uint2 pack4(float a, float b, float c, float d) {
  T v[4] = {from_float<T>(a), from_float<T>(b), from_float<T>(c), from_float<T>(d)};
  return *reinterpret_cast<const uint2*>(v);
}

// out[at .. at + 4) in out_dtype (16 or 8 bytes, aligned: at is a multiple of 4)
__device__ __forceinline__ void store_out4(const GatedDeltaParams& p, int64_t at, float a, float b, float c, float d) {
  switch (p.out_dtype) {
    case DType::kBFloat16:
      *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.out) + at) = pack4<__nv_bfloat16>(a, b, c, d);
      break;
    case DType::kFloat16:
      *reinterpret_cast<uint2*>(static_cast<__half*>(p.out) + at) = pack4<__half>(a, b, c, d);
      break;
    default: *reinterpret_cast<float4*>(static_cast<float*>(p.out) + at) = make_float4(a, b, c, d);
  }
}

// kRows: rows of S per lane, a power of two with dk <= 8 kRows; lanes hold rows r + 8 m for
// m < dk / 8 (the same bound for every lane, so the guards never split a warp).
template <int kRows>
__global__ void __launch_bounds__(kMaxWarps * 32) gated_delta_kernel(GatedDeltaParams p) {
  pdl_wait();
  pdl_allow_dependents();
  constexpr int kMaxDk = kRowLanes * kRows;
  __shared__ __align__(16) float k_s[kChunk][kMaxDk];
  __shared__ __align__(16) float q_s[kChunk][kMaxDk];
  __shared__ __align__(16) float v_s[kChunk][kMaxWarps * kWarpCols];  // the CTA's columns
  __shared__ float decay_s[kChunk];
  __shared__ float beta_s[kChunk];

  const int T = p.width, Hk = p.num_k_heads, Hv = p.num_v_heads, dk = p.key_dim, dv = p.value_dim;
  const int b = blockIdx.z, h = blockIdx.y, kh = h / (Hv / Hk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / kColLanes, c = lane % kColLanes;  // row lane 0..7, column lane 0..3
  const int cta_cols = blockDim.x / 32 * kWarpCols;
  const int col0 = blockIdx.x * cta_cols;                // the CTA's first column
  const int wcol = warp * kWarpCols + c * 4;             // the lane's first column, in the CTA
  const int col = col0 + wcol;
  const int rows = dk / kRowLanes;

  const int64_t slot = p.slots[b];
  const int num_tokens = p.num_tokens[b];
  const int n = min(max(num_tokens, 0), T);                  // tokens that run
  const int first_snapshot = p.num_snapshots - num_tokens;  // token t writes snapshot t + this
  const int64_t head_size = static_cast<int64_t>(dk) * dv;
  const int64_t token0 = static_cast<int64_t>(b) * T;       // row b's token 0

  // The lane's slice of S: rows r + 8 m, columns col .. col + 3. A new sequence starts from
  // zeros and reads nothing (the slot holds an earlier occupant's state).
  float4 S[kRows];
  const bool fresh = p.start[b] == 0;
  const float* state = p.state_cache + (slot * Hv + h) * head_size + col;
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    S[m] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (!fresh && m < rows)
      S[m] = __ldcs(reinterpret_cast<const float4*>(state + static_cast<int64_t>(r + kRowLanes * m) * dv));
  }

  for (int t0 = 0; t0 < n; t0 += kChunk) {
    const int len = min(kChunk, n - t0);
    __syncthreads();  // every warp is done with the previous chunk
    const int dk4 = dk / 4;
    for (int i = threadIdx.x; i < len * dk4; i += blockDim.x) {
      const int tt = i / dk4, e = i % dk4 * 4;
      const int64_t at = ((token0 + t0 + tt) * Hk + kh) * dk + e;
      *reinterpret_cast<float4*>(&k_s[tt][e]) = __ldg(reinterpret_cast<const float4*>(p.k + at));
      *reinterpret_cast<float4*>(&q_s[tt][e]) = __ldg(reinterpret_cast<const float4*>(p.q + at));
    }
    const int cols4 = cta_cols / 4;
    for (int i = threadIdx.x; i < len * cols4; i += blockDim.x) {
      const int tt = i / cols4, e = i % cols4 * 4;
      const int64_t at = ((token0 + t0 + tt) * Hv + h) * dv + col0 + e;
      *reinterpret_cast<float4*>(&v_s[tt][e]) = __ldg(reinterpret_cast<const float4*>(p.v + at));
    }
    if (threadIdx.x < len) {  // blockDim.x >= 32 > kChunk
      const int64_t at = (token0 + t0 + threadIdx.x) * Hv + h;
      decay_s[threadIdx.x] = expf(p.g[at]);
      beta_s[threadIdx.x] = p.beta[at];
    }
    __syncthreads();

    for (int tt = 0; tt < len; ++tt) {
      // The lane's partial sums over its rows of S^T k, S^T q (4 columns each) and k . q.
      float sk[4] = {}, sq[4] = {}, kq = 0.0f;
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m < rows) {
          const float km = k_s[tt][r + kRowLanes * m], qm = q_s[tt][r + kRowLanes * m];
          sk[0] = fmaf(S[m].x, km, sk[0]);
          sk[1] = fmaf(S[m].y, km, sk[1]);
          sk[2] = fmaf(S[m].z, km, sk[2]);
          sk[3] = fmaf(S[m].w, km, sk[3]);
          sq[0] = fmaf(S[m].x, qm, sq[0]);
          sq[1] = fmaf(S[m].y, qm, sq[1]);
          sq[2] = fmaf(S[m].z, qm, sq[2]);
          sq[3] = fmaf(S[m].w, qm, sq[3]);
          kq = fmaf(km, qm, kq);
        }
      }
      // Sum over the 8 row lanes (lane bits 2..4); the xor butterfly leaves the same bits in
      // all of them, so every row lane applies the same delta.
#pragma unroll
      for (int o = kColLanes; o < 32; o *= 2) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sk[e] += __shfl_xor_sync(0xffffffffu, sk[e], o);
          sq[e] += __shfl_xor_sync(0xffffffffu, sq[e], o);
        }
        kq += __shfl_xor_sync(0xffffffffu, kq, o);
      }
      const float a = decay_s[tt], beta = beta_s[tt];
      const float4 v = load4(&v_s[tt][wcol]);
      const float vs[4] = {v.x, v.y, v.z, v.w};
      float delta[4], out4[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        delta[e] = beta * (vs[e] - a * sk[e]);
        out4[e] = fmaf(a, sq[e], delta[e] * kq);
      }
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        if (m < rows) {
          const float km = k_s[tt][r + kRowLanes * m];
          S[m].x = fmaf(km, delta[0], a * S[m].x);
          S[m].y = fmaf(km, delta[1], a * S[m].y);
          S[m].z = fmaf(km, delta[2], a * S[m].z);
          S[m].w = fmaf(km, delta[3], a * S[m].w);
        }
      }

      const int64_t token = token0 + t0 + tt;
      if (r == 0) store_out4(p, (token * Hv + h) * dv + col, out4[0], out4[1], out4[2], out4[3]);
      const int j = t0 + tt + first_snapshot;
      if (j >= 0) {
        float* snapshot = p.snapshot_cache + ((slot * p.num_snapshots + j) * Hv + h) * head_size + col;
#pragma unroll
        for (int m = 0; m < kRows; ++m) {
          if (m < rows)
            __stcs(reinterpret_cast<float4*>(snapshot + static_cast<int64_t>(r + kRowLanes * m) * dv), S[m]);
        }
      }
    }
  }

  // Padding tokens output zeros.
  if (r == 0) {
    for (int t = n; t < T; ++t) store_out4(p, ((token0 + t) * Hv + h) * dv + col, 0.0f, 0.0f, 0.0f, 0.0f);
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Warps per CTA: 4 while that still leaves two CTAs per SM, else fewer (batch 1 needs the
// spread more than the shared staging).
int warps_per_cta(const GatedDeltaParams& p) {
  const int sms = device_sms();  // 0 where unknown: 4-warp CTAs, which run anywhere
  const int64_t warps_total = static_cast<int64_t>(p.batch) * p.num_v_heads * (p.value_dim / kWarpCols);
  int warps = kMaxWarps;
  while (warps > 1 && (p.value_dim % (kWarpCols * warps) != 0 || warps_total / warps < 2 * sms)) warps /= 2;
  return warps;
}

// -- prepare: a token's work split over a few CTAs (grid: tokens x parts), so that a decode
// step's one token is not one CTA walking every head in turn: warp w of part y takes the q/k
// heads y W + w, (y + parts) W + w, ... (W warps; a head's sum of squares over dk is a warp
// sum), and each part streams its share of v and of the gates.

constexpr int kPrepareThreads = 256;
constexpr int kPrepareWarps = kPrepareThreads / 32;

__device__ __forceinline__ float load_as_float(const void* base, int64_t i, DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kFloat16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

__global__ void __launch_bounds__(kPrepareThreads) gated_delta_prepare_kernel(GatedDeltaPrepareParams p) {
  pdl_wait();
  pdl_allow_dependents();
  const int64_t n = blockIdx.x;
  const int Hk = p.num_k_heads, Hv = p.num_v_heads, dk = p.key_dim, dv = p.value_dim;
  const int64_t row = 2 * static_cast<int64_t>(Hk) * dk + static_cast<int64_t>(Hv) * dv;
  const int64_t in0 = n * row;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int part = blockIdx.y, parts = gridDim.y;
  // q heads are 0 .. Hk-1, k heads Hk .. 2Hk-1: both L2-normalised, q then scaled
  for (int h = part * kPrepareWarps + warp; h < 2 * Hk; h += parts * kPrepareWarps) {
    float x[8];  // dk <= 256: a lane holds elements lane + 32 i
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = lane + 32 * i;
      x[i] = e < dk ? load_as_float(p.qkv, in0 + static_cast<int64_t>(h) * dk + e, p.dtype) : 0.0f;
      sq = __fadd_rn(sq, __fmul_rn(x[i], x[i]));
    }
    const float r = rsqrtf(__fadd_rn(warp_sum(sq), p.eps));
    const bool is_q = h < Hk;
    float* out = (is_q ? p.q + (n * Hk + h) * dk : p.k + (n * Hk + h - Hk) * dk);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = lane + 32 * i;
      if (e < dk) out[e] = is_q ? __fmul_rn(__fmul_rn(x[i], r), p.q_scale) : __fmul_rn(x[i], r);
    }
  }
  const int64_t v0 = in0 + 2 * static_cast<int64_t>(Hk) * dk;
  const int per_part = (Hv * dv + parts - 1) / parts, end = min(Hv * dv, (part + 1) * per_part);
  for (int e = part * per_part + threadIdx.x; e < end; e += blockDim.x)
    p.v[n * Hv * dv + e] = load_as_float(p.qkv, v0 + e, p.dtype);
  for (int h = part * blockDim.x + threadIdx.x; h < Hv; h += parts * blockDim.x) {
    const float x = __fadd_rn(load_as_float(p.a, n * p.ab_stride + h, p.dtype), p.dt_bias[h]);
    const float softplus = x > 20.0f ? x : log1pf(expf(x));  // torch's threshold
    p.g[n * Hv + h] = __fmul_rn(p.neg_a[h], softplus);
    p.beta[n * Hv + h] = 1.0f / (1.0f + expf(-load_as_float(p.b, n * p.ab_stride + h, p.dtype)));
  }
}

}  // namespace

const char* gated_delta_prepare_check(const GatedDeltaPrepareParams& p) {
  if (p.tokens < 0 || p.tokens > 0x7fffffff) return "tokens must be in [0, 2^31)";
  if (p.num_k_heads < 1 || p.num_v_heads < 1 || p.num_k_heads > 65535) return "head counts must be in [1, 65535]";
  if (p.key_dim < 1 || p.key_dim > 256 || p.value_dim < 1) return "key_dim must be in [1, 256], value_dim positive";
  if (p.ab_stride < p.num_v_heads) return "ab_stride must be at least num_v_heads";
  if (p.tokens == 0) return nullptr;
  if (!p.qkv || !p.a || !p.b || !p.neg_a || !p.dt_bias || !p.q || !p.k || !p.v || !p.g || !p.beta)
    return "null pointer";
  return nullptr;
}

cudaError_t gated_delta_prepare_launch(const GatedDeltaPrepareParams& p, cudaStream_t stream) {
  if (gated_delta_prepare_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.tokens), (2 * p.num_k_heads + kPrepareWarps - 1) / kPrepareWarps);
  return pdl_launch(gated_delta_prepare_kernel, grid, dim3(kPrepareThreads), 0, stream, true, p);
}

const char* gated_delta_recurrent_check(const GatedDeltaParams& p) {
  if (p.batch < 0 || p.batch > 65535) return "batch must be in [0, 65535]";
  if (p.width < 0) return "width must not be negative";
  if (p.num_k_heads < 1 || p.num_v_heads < 1 || p.num_v_heads % p.num_k_heads != 0 || p.num_v_heads > 65535)
    return "num_v_heads must be a positive multiple of num_k_heads, at most 65535";
  if (!gated_delta_supports(p.key_dim, p.value_dim))
    return "key_dim and value_dim must be multiples of 16 in [16, 256]";
  if (p.num_snapshots < 0) return "num_snapshots must not be negative";
  if (p.batch == 0 || p.width == 0) return nullptr;  // nothing to read: empty tensors may have null data
  const bool snapshots = p.num_snapshots > 0;  // else snapshot_cache is never written and may be null
  if (!p.q || !p.k || !p.v || !p.g || !p.beta || !p.state_cache || (snapshots && !p.snapshot_cache) || !p.slots ||
      !p.start || !p.num_tokens || !p.out)
    return "null pointer";
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.state_cache) ||
      (snapshots && !aligned16(p.snapshot_cache)) || !aligned16(p.out))
    return "q, k, v, out and the caches must be 16-byte aligned";
  return nullptr;
}

cudaError_t gated_delta_recurrent_launch(const GatedDeltaParams& p, cudaStream_t stream) {
  if (gated_delta_recurrent_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.width == 0) return cudaSuccess;
  const int warps = warps_per_cta(p);
  const dim3 grid(p.value_dim / (kWarpCols * warps), p.num_v_heads, p.batch);
  const dim3 block(32 * warps);
  const int rows = p.key_dim / kRowLanes;  // 2 .. 32
  const auto kernel = rows <= 2    ? gated_delta_kernel<2>
                      : rows <= 4  ? gated_delta_kernel<4>
                      : rows <= 8  ? gated_delta_kernel<8>
                      : rows <= 16 ? gated_delta_kernel<16>
                                   : gated_delta_kernel<32>;
  return pdl_launch(kernel, grid, block, 0, stream, true, p);
}

}  // namespace dflash
