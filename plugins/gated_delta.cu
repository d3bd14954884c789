// Gated DeltaNet recurrence of a decode/verify pass, on the cache in place (semantics in
// gated_delta.h): reads each row's committed state from state_cache, writes the state after
// the row's last NS tokens into snapshot_cache, one launch per layer. The engine uses NS = 0
// (outputs only: a verify pass) and NS = 1 in place (an AR step, a short prefill, and the
// replay of a verify's accepted tokens at commit). Two kernels: the token loop below for every
// pass, and the chunk form further down, which unrolls 16 tokens at a time: a verify pass's one
// chunk, and (dk = 128) the chunks in turn of a prefill of a few rows, the state updated in
// registers.
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
#include "mma_tile.h"
#include "pdl.h"
#include "row_norm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

// One token of the recurrence on a lane's slice of S (rows r + 8 m for m < rows, 4 columns):
// the lane's partial sums over its rows of S^T k, S^T q (4 columns each) and k . q, summed
// over the 8 row lanes (lane bits 2..4; the xor butterfly leaves the same bits in all of them,
// so every row lane applies the same delta), then delta, the outputs out4 and the update.
// k and q: the token's k and q from element r, a row lane's first row, on (stride 8 a row).
template <int kRows, bool kOutputs>
__device__ __forceinline__ void step_token(float4 (&S)[kRows], int rows, const float* k, const float* q, float4 v,
                                           float a, float beta, float (&out4)[4]) {
  float sk[4] = {}, sq[4] = {}, kq = 0.0f;
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    if (m < rows) {
      const float km = k[kRowLanes * m];
      sk[0] = fmaf(S[m].x, km, sk[0]);
      sk[1] = fmaf(S[m].y, km, sk[1]);
      sk[2] = fmaf(S[m].z, km, sk[2]);
      sk[3] = fmaf(S[m].w, km, sk[3]);
      if (kOutputs) {
        const float qm = q[kRowLanes * m];
        sq[0] = fmaf(S[m].x, qm, sq[0]);
        sq[1] = fmaf(S[m].y, qm, sq[1]);
        sq[2] = fmaf(S[m].z, qm, sq[2]);
        sq[3] = fmaf(S[m].w, qm, sq[3]);
        kq = fmaf(km, qm, kq);
      }
    }
  }
#pragma unroll
  for (int o = kColLanes; o < 32; o *= 2) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sk[e] += __shfl_xor_sync(0xffffffffu, sk[e], o);
      if (kOutputs) sq[e] += __shfl_xor_sync(0xffffffffu, sq[e], o);
    }
    if (kOutputs) kq += __shfl_xor_sync(0xffffffffu, kq, o);
  }
  const float vs[4] = {v.x, v.y, v.z, v.w};
  float delta[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    delta[e] = beta * (vs[e] - a * sk[e]);
    out4[e] = fmaf(a, sq[e], delta[e] * kq);
  }
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    if (m < rows) {
      const float km = k[kRowLanes * m];
      S[m].x = fmaf(km, delta[0], a * S[m].x);
      S[m].y = fmaf(km, delta[1], a * S[m].y);
      S[m].z = fmaf(km, delta[2], a * S[m].z);
      S[m].w = fmaf(km, delta[3], a * S[m].w);
    }
  }
}

// kRows: rows of S per lane, a power of two with dk <= 8 kRows; lanes hold rows r + 8 m for
// m < dk / 8 (the same bound for every lane, so the guards never split a warp).
// kOutputs false (out null): a commit's replay wants only the state, so q, k . q, S^T q and the
// outputs are left out (a third of the token loop's arithmetic and its q staging).
template <int kRows, bool kOutputs>
__global__ void __launch_bounds__(kMaxWarps * 32, kOutputs || kRows > 16 ? 0 : 5) gated_delta_kernel(GatedDeltaParams p) {
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
      if (kOutputs) *reinterpret_cast<float4*>(&q_s[tt][e]) = __ldg(reinterpret_cast<const float4*>(p.q + at));
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
      float out4[4];
      step_token<kRows, kOutputs>(S, rows, k_s[tt] + r, q_s[tt] + r, load4(&v_s[tt][wcol]), decay_s[tt], beta_s[tt],
                                  out4);

      const int64_t token = token0 + t0 + tt;
      if (kOutputs && r == 0) store_out4(p, (token * Hv + h) * dv + col, out4[0], out4[1], out4[2], out4[3]);
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
  if (kOutputs && r == 0) {
    for (int t = n; t < T; ++t) store_out4(p, ((token0 + t) * Hv + h) * dv + col, 0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// -- Outputs only (NS = 0: a verify pass), T <= 16, dk <= 128: the chunk's recurrence unrolled.
// With E_t = exp(g_0 + .. + g_t) and D[t][s] = exp(g_{s+1} + .. + g_t) (D[t][t] = 1), the state
// before token t, decayed by exp(g_t), is E_t S0 + sum_{s<t} D[t][s] k_s delta_s^T, so with
// P_t = S0^T k_t and Q_t = S0^T q_t (one sum over dk per column each)
//   delta_t = beta_t (v_t - E_t P_t - sum_{s<t} D[t][s] (k_s . k_t) delta_s)
//   out_t   = E_t Q_t + sum_{s<=t} D[t][s] (k_s . q_t) delta_s.
// Every sum over dk (P, Q and the chunk's decayed Gram matrices) is independent of the others;
// what stays sequential is a T-step recurrence of scalars per column, and no state is updated
// (a verify pass writes none). The token loop above runs the T steps one after another on the
// whole [dk, dv] state: at T = 16 that chain, not the bytes, is a verify's delta-rule time.
// Same algebra as the reference in another order: a few fp32 ulps.
//
// Two ways to get P and Q, the bulk of the arithmetic (2 T dk dv per (row, head)):
// - CUDA cores (kMma false): a CTA takes 32 columns of one (row, head), stages them in shared
//   memory, and warp w sums tokens w and w + 8 (a lane per column). Its CTAs each redo the
//   Gram matrices and pass the state through shared memory: once they fill the SMs a few times
//   over the token loop is as fast.
// - tensor cores (kMma, dk = 128): a CTA takes 128 columns, warp w columns 16w .. 16w + 15, as
//   [K; Q] (32 x dk) times its [dk x 16] of S0, in m16n8k8 TF32 MMAs three at a time for fp32
//   precision (mma_tile.h). Its lanes hold their fragments of S0 in registers, loaded from the
//   cache before the first barrier, so the state is read once, straight from global memory,
//   with all of it in flight. It still takes several times the state's bytes' time (two CTAs
//   an SM, and each one's phases in turn: commit d6f32c8, BENCHMARKS.md at that commit,
//   "Qwen3.5 hybrid").
// Either way the threads of group 0 (a column each) run the recurrence and every group writes
// its tokens' outputs.

constexpr int kOutWidth = 16;  // at most T tokens
constexpr int kOutThreads = 256;
constexpr int kOutMaxDk = 128;
constexpr int kOutPad = 4;     // k/q rows 16-byte aligned, and rows t, t + 1 start in other banks
constexpr int kMmaDk = 128;    // the tensor-core form's dk (Qwen3.5/3.6)

template <bool kMma>
__host__ __device__ constexpr int out_cols() { return kMma ? 128 : 32; }  // value columns per CTA

// Where the CUDA-core form runs: a few rows (its CTAs fill the SMs at most four times over);
// past that the tensor-core form where it applies, else the token loop.
bool outputs_form_runs(const GatedDeltaParams& p) {
  if (p.num_snapshots != 0 || p.width > kOutWidth || p.key_dim > kOutMaxDk || p.value_dim % out_cols<false>() != 0)
    return false;
  const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_v_heads * (p.value_dim / out_cols<false>());
  const int sms = device_sms();
  return sms > 0 && ctas <= 4 * static_cast<int64_t>(sms);
}

// The tensor-core form: a verify (NS = 0, one chunk), or a prefill (NS = 1 past one chunk: its
// chunks in turn, the state kept in registers between them). A prefill's chunks run one after
// another at one CTA an SM, so it wins only while its CTAs fit one wave (a prompt or a few);
// a burst of many rows keeps the token loop, whose many small CTAs hide its latencies better
// (benchmarks/gated_delta_prefill_chunks.json).
bool mma_form_runs(const GatedDeltaParams& p) {
  if (p.out == nullptr || p.key_dim != kMmaDk || p.value_dim % out_cols<true>() != 0) return false;
  if (p.num_snapshots == 0) return p.width <= kOutWidth;
  const int64_t ctas = static_cast<int64_t>(p.batch) * p.num_v_heads * (p.value_dim / out_cols<true>());
  return p.num_snapshots == 1 && p.width > kOutWidth && ctas <= device_sms();
}

// kKeepState (tensor cores, NS = 1): the prefill's chunk loop with the state updated in registers;
// its own instantiation, so that the verify's keeps its registers.
template <bool kMma, bool kKeepState = false>
__global__ void __launch_bounds__(kOutThreads, kMma && !kKeepState ? 2 : 1) gated_delta_outputs_kernel(GatedDeltaParams p) {
  constexpr int kCols = out_cols<kMma>(), kGroups = kOutThreads / kCols;
  __shared__ __align__(16) float k_s[kOutWidth][kOutMaxDk + kOutPad];
  __shared__ __align__(16) float q_s[kOutWidth][kOutMaxDk + kOutPad];
  __shared__ __align__(16) float s_s[kMma ? 1 : kOutMaxDk][kCols];  // S0's columns of the CTA (CUDA cores)
  __shared__ __align__(16) float v_s[kOutWidth][kCols];
  __shared__ float p_s[kOutWidth][kCols];   // P, then delta
  __shared__ float q0_s[kOutWidth][kCols];  // Q
  __shared__ float kk_s[kOutWidth][kOutWidth];  // D[t][s] (k_s . k_t), s < t
  __shared__ float kq_s[kOutWidth][kOutWidth];  // D[t][s] (k_s . q_t), s <= t
  __shared__ float g_s[kOutWidth], beta_s[kOutWidth], e_s[kOutWidth];
  __shared__ float w_s[kOutWidth];  // D[n - 1][s]: a chunk's state update (NS = 1)

  const int T = p.width, Hk = p.num_k_heads, Hv = p.num_v_heads, dk = p.key_dim, dv = p.value_dim;
  const int b = blockIdx.z, h = blockIdx.y, kh = h / (Hv / Hk);
  const int col0 = blockIdx.x * kCols;
  const int tid = threadIdx.x, j = tid % kCols, group = tid / kCols;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  // Read before the wait: the slots, starts and committed state are written before the pass
  // (its batch copy, the last commit), never by the kernel just before this one, the only one
  // that may still run (pdl.h).
  const int64_t slot = p.slots[b];
  const bool fresh = p.start[b] == 0;
  const float* state = p.state_cache + (slot * Hv + h) * static_cast<int64_t>(dk) * dv + col0;

  // Tensor cores: the lane's B fragments of S (rows 8 ks + 2 t4 + i, columns 16 warp + 8 nt + g:
  // each 8-row block's MMA k positions t4 and t4 + 4 relabelled as rows 2 t4 and 2 t4 + 1, which
  // the A operands below follow, so that a chunk's state update lands in the same registers).
  float sb[kMma ? kMmaDk / 8 : 1][2][2];
  if constexpr (kMma) {
    const float* w = state + 16 * warp + g;
#pragma unroll
    for (int ks = 0; ks < kMmaDk / 8; ++ks)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          sb[ks][nt][i] = fresh ? 0.0f : __ldcs(w + static_cast<int64_t>(8 * ks + 2 * t4 + i) * dv + 8 * nt);
  }
  pdl_wait();
  pdl_allow_dependents();
  const int n_row = min(max(p.num_tokens[b], 0), T);
  // as the token loop: a row of more tokens than the pass has never reaches its snapshot
  const bool snapshot_reached = p.num_tokens[b] >= 1 && p.num_tokens[b] <= T;
  // NS = 1 (tensor cores only): the state after the row's last token goes to its snapshot,
  // each chunk's update applied to the registers (a prefill, in place).
  constexpr bool keep_state = kMma && kKeepState;
  const int chunks = keep_state ? (T + kOutWidth - 1) / kOutWidth : 1;

  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int64_t token0 = static_cast<int64_t>(b) * T + chunk * kOutWidth;  // the chunk's first token
    const int n = min(max(n_row - chunk * kOutWidth, 0), kOutWidth);        // its real tokens
    const int width = min(T - chunk * kOutWidth, kOutWidth);                // and with padding
    if (chunk > 0) __syncthreads();  // every thread is done with the last chunk's shared memory

    const int dk4 = dk / 4;
    for (int i = tid; i < kOutWidth * dk4; i += kOutThreads) {
      const int t = i / dk4, e = i % dk4 * 4;
      const int64_t at = ((token0 + t) * Hk + kh) * dk + e;
      if (t < n) {
        *reinterpret_cast<float4*>(&k_s[t][e]) = __ldg(reinterpret_cast<const float4*>(p.k + at));
        *reinterpret_cast<float4*>(&q_s[t][e]) = __ldg(reinterpret_cast<const float4*>(p.q + at));
      } else if (keep_state) {  // the update's B operand: zeros, not stale bits (0 x NaN is NaN)
        *reinterpret_cast<float4*>(&k_s[t][e]) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    constexpr int cols4 = kCols / 4;
    for (int i = tid; i < n * cols4; i += kOutThreads) {
      const int t = i / cols4, e = i % cols4 * 4;
      const int64_t at = ((token0 + t) * Hv + h) * dv + col0 + e;
      *reinterpret_cast<float4*>(&v_s[t][e]) = __ldg(reinterpret_cast<const float4*>(p.v + at));
    }
    if constexpr (!kMma) {
      if (!fresh) {  // a new sequence starts from zeros: P = Q = 0, nothing read
        for (int i = tid; i < dk * cols4; i += kOutThreads) {
          const int row = i / cols4, e = i % cols4 * 4;
          *reinterpret_cast<float4*>(&s_s[row][e]) =
              __ldcs(reinterpret_cast<const float4*>(state + static_cast<int64_t>(row) * dv + e));
        }
      }
    }
    if (tid < n) {
      const int64_t at = (token0 + tid) * Hv + h;
      g_s[tid] = p.g[at];
      beta_s[tid] = p.beta[at];
    }
    __syncthreads();

    if constexpr (kMma) {
      // P (M rows 0-15: k_t) and Q (q_t) of the warp's 16 columns. Rows t >= n of k_s and q_s
      // may hold anything: an MMA's output row reads only its own A row, and rows t >= n of P
      // and Q are never read.
      float acc[2][2][4] = {};  // [P, Q][n tile][fragment]
#pragma unroll
      for (int ks = 0; ks < kMmaDk / 8; ++ks) {
        // each operand split into TF32 halves once, for the two MMAs it meets (mma_tile.h)
        const int e = 8 * ks + 2 * t4;
        uint32_t ab[2][4], as[2][4], bb[2][2], bs[2][2];
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const float(*a)[kOutMaxDk + kOutPad] = m == 0 ? k_s : q_s;
          const float x[4] = {a[g][e], a[g + 8][e], a[g][e + 1], a[g + 8][e + 1]};
#pragma unroll
          for (int i = 0; i < 4; ++i) mma_tile::split_tf32(__float_as_uint(x[i]), ab[m][i], as[m][i]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int i = 0; i < 2; ++i) mma_tile::split_tf32(__float_as_uint(sb[ks][nt][i]), bb[nt][i], bs[nt][i]);
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            float c[4] = {};  // small terms first, then added to the running sum rounded (as mma_3xtf32)
            mma_tile::mma_tf32(c, as[m], bb[nt]);
            mma_tile::mma_tf32(c, ab[m], bs[nt]);
            mma_tile::mma_tf32(c, ab[m], bb[nt]);
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[m][nt][i] += c[i];
          }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int c = 16 * warp + 8 * nt + 2 * t4;
        p_s[g][c] = acc[0][nt][0];
        p_s[g][c + 1] = acc[0][nt][1];
        p_s[g + 8][c] = acc[0][nt][2];
        p_s[g + 8][c + 1] = acc[0][nt][3];
        q0_s[g][c] = acc[1][nt][0];
        q0_s[g][c + 1] = acc[1][nt][1];
        q0_s[g + 8][c] = acc[1][nt][2];
        q0_s[g + 8][c + 1] = acc[1][nt][3];
      }
    } else {
      // P and Q of this warp's tokens (group and group + 8), a lane per column: each S element
      // read from shared memory serves all four sums.
      const int t0 = group, t1 = group + kGroups;
      float4 pk0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), pq0 = pk0, pk1 = pk0, pq1 = pk0;
      if (!fresh && t0 < n) {
        const int u = t1 < n ? t1 : t0;  // a row that was loaded
        for (int e = 0; e < dk; e += 4) {
          const float s0 = s_s[e][j], s1 = s_s[e + 1][j], s2 = s_s[e + 2][j], s3 = s_s[e + 3][j];
          const float4 k0 = *reinterpret_cast<const float4*>(&k_s[t0][e]);
          const float4 q0 = *reinterpret_cast<const float4*>(&q_s[t0][e]);
          const float4 k1 = *reinterpret_cast<const float4*>(&k_s[u][e]);
          const float4 q1 = *reinterpret_cast<const float4*>(&q_s[u][e]);
          pk0 = make_float4(fmaf(s0, k0.x, pk0.x), fmaf(s1, k0.y, pk0.y), fmaf(s2, k0.z, pk0.z), fmaf(s3, k0.w, pk0.w));
          pq0 = make_float4(fmaf(s0, q0.x, pq0.x), fmaf(s1, q0.y, pq0.y), fmaf(s2, q0.z, pq0.z), fmaf(s3, q0.w, pq0.w));
          pk1 = make_float4(fmaf(s0, k1.x, pk1.x), fmaf(s1, k1.y, pk1.y), fmaf(s2, k1.z, pk1.z), fmaf(s3, k1.w, pk1.w));
          pq1 = make_float4(fmaf(s0, q1.x, pq1.x), fmaf(s1, q1.y, pq1.y), fmaf(s2, q1.z, pq1.z), fmaf(s3, q1.w, pq1.w));
        }
      }
      if (t0 < n) {
        p_s[t0][j] = (pk0.x + pk0.y) + (pk0.z + pk0.w);
        q0_s[t0][j] = (pq0.x + pq0.y) + (pq0.z + pq0.w);
      }
      if (t1 < n) {
        p_s[t1][j] = (pk1.x + pk1.y) + (pk1.z + pk1.w);
        q0_s[t1][j] = (pq1.x + pq1.y) + (pq1.z + pq1.w);
      }
    }
    // The decayed Gram matrices, an entry a thread: (t, s) of k.q for s <= t (the first 136
    // threads, row t from thread t (t + 1) / 2 on), of k.k for s < t (the other 120).
    {
      constexpr int kWithDiagonal = kOutWidth * (kOutWidth + 1) / 2;
      static_assert(kWithDiagonal + kOutWidth * (kOutWidth - 1) / 2 == kOutThreads, "an entry per thread");
      const bool is_q = tid < kWithDiagonal;
      const int i = is_q ? tid : tid - kWithDiagonal;
      const float root = sqrtf(8.0f * i + 1.0f);  // exact where it is an integer: t is exact
      const int t = is_q ? static_cast<int>((root - 1.0f) * 0.5f) : static_cast<int>((root + 1.0f) * 0.5f);
      const int s = is_q ? i - t * (t + 1) / 2 : i - t * (t - 1) / 2;
      if (t < n) {
        const float* x = is_q ? q_s[t] : k_s[t];
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int e = 0; e < dk; e += 4) {
          const float4 a = *reinterpret_cast<const float4*>(&k_s[s][e]), c = *reinterpret_cast<const float4*>(&x[e]);
          acc = make_float4(fmaf(a.x, c.x, acc.x), fmaf(a.y, c.y, acc.y), fmaf(a.z, c.z, acc.z), fmaf(a.w, c.w, acc.w));
        }
        float log_decay = 0.0f;
        for (int u = s + 1; u <= t; ++u) log_decay += g_s[u];
        (is_q ? kq_s : kk_s)[t][s] = expf(log_decay) * ((acc.x + acc.y) + (acc.z + acc.w));
      }
    }
    if (tid < n) {
      float log_decay = 0.0f;
      for (int u = 0; u <= tid; ++u) log_decay += g_s[u];
      e_s[tid] = expf(log_decay);
      // D[n - 1][tid]: how much of token tid's update is left after the chunk's last token
      float rest = 0.0f;
      for (int u = tid + 1; u < n; ++u) rest += g_s[u];
      w_s[tid] = expf(rest);
    }
    __syncthreads();

    if (group == 0) {  // the recurrence over the chunk, column j; delta replaces P
      float delta[kOutWidth];
#pragma unroll
      for (int t = 0; t < kOutWidth; ++t) {
        if (t < n) {
          float x = v_s[t][j] - e_s[t] * p_s[t][j];
#pragma unroll
          for (int s = 0; s < t; ++s) x = fmaf(-kk_s[t][s], delta[s], x);
          delta[t] = beta_s[t] * x;
          p_s[t][j] = delta[t];
        }
      }
    }
    __syncthreads();

    for (int t = group; t < width; t += kGroups) {
      float out = 0.0f;  // padding tokens output zeros
      if (t < n) {
        out = e_s[t] * q0_s[t][j];
        for (int s = 0; s <= t; ++s) out = fmaf(kq_s[t][s], p_s[s][j], out);
      }
      const int64_t at = ((token0 + t) * Hv + h) * dv + col0 + j;
      switch (p.out_dtype) {
        case DType::kBFloat16: static_cast<__nv_bfloat16*>(p.out)[at] = from_float<__nv_bfloat16>(out); break;
        case DType::kFloat16: static_cast<__half*>(p.out)[at] = from_float<__half>(out); break;
        default: static_cast<float*>(p.out)[at] = out;
      }
    }
    if constexpr (keep_state) {
      // The state after the chunk: S = E[n - 1] S + sum_s k_s (D[n - 1][s] delta_s)^T, as the
      // warp's [16 columns x dk] of S^T += (w delta)^T [16 x T] K [T x dk]: its C fragments are
      // the lane's registers of S (the relabelling above), so the update needs no shuffle.
      if (n > 0) {
        const float decay = e_s[n - 1];
        uint32_t ab[2][4], as[2][4];  // A: (w delta)^T, rows = columns 16 warp + g (+ 8), k = tokens
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
          const int s0 = 8 * kt + t4, s1 = s0 + 4, c0 = 16 * warp + g, c1 = c0 + 8;
          const float x[4] = {s0 < n ? w_s[s0] * p_s[s0][c0] : 0.0f, s0 < n ? w_s[s0] * p_s[s0][c1] : 0.0f,
                              s1 < n ? w_s[s1] * p_s[s1][c0] : 0.0f, s1 < n ? w_s[s1] * p_s[s1][c1] : 0.0f};
#pragma unroll
          for (int i = 0; i < 4; ++i) mma_tile::split_tf32(__float_as_uint(x[i]), ab[kt][i], as[kt][i]);
        }
#pragma unroll
        for (int ks = 0; ks < kMmaDk / 8; ++ks) {
          float acc[4] = {};
#pragma unroll
          for (int kt = 0; kt < 2; ++kt) {  // B: K, k = tokens 8 kt + t4 (+ 4), n = rows 8 ks + g
            uint32_t bb[2], bs[2];
            mma_tile::split_tf32(__float_as_uint(k_s[8 * kt + t4][8 * ks + g]), bb[0], bs[0]);
            mma_tile::split_tf32(__float_as_uint(k_s[8 * kt + t4 + 4][8 * ks + g]), bb[1], bs[1]);
            float c[4] = {};
            mma_tile::mma_tf32(c, as[kt], bb);
            mma_tile::mma_tf32(c, ab[kt], bs);
            mma_tile::mma_tf32(c, ab[kt], bb);
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] += c[i];
          }
          // C[m][n]: m = g (column nt 0) or g + 8 (nt 1), n = 2 t4 + i (row 8 ks + 2 t4 + i)
          sb[ks][0][0] = fmaf(decay, sb[ks][0][0], acc[0]);
          sb[ks][0][1] = fmaf(decay, sb[ks][0][1], acc[1]);
          sb[ks][1][0] = fmaf(decay, sb[ks][1][0], acc[2]);
          sb[ks][1][1] = fmaf(decay, sb[ks][1][1], acc[3]);
        }
      }
    }
  }
  if (keep_state && snapshot_reached) {  // snapshot 0: the state after the row's last token (NS = 1)
    float* snapshot = p.snapshot_cache + (slot * Hv + h) * static_cast<int64_t>(dk) * dv + col0 + 16 * warp + g;
#pragma unroll
    for (int ks = 0; ks < kMmaDk / 8; ++ks)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          snapshot[static_cast<int64_t>(8 * ks + 2 * t4 + i) * dv + 8 * nt] = sb[ks][nt][i];
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
constexpr int kVAhead = 8;

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
  // v: kVAhead loads in flight per thread before the first store (the stores could alias
  // the loads as far as the compiler knows, so a plain loop waits out each load in turn)
  const int64_t v0 = in0 + 2 * static_cast<int64_t>(Hk) * dk;
  const int per_part = (Hv * dv + parts - 1) / parts, end = min(Hv * dv, (part + 1) * per_part);
  for (int e0 = part * per_part + threadIdx.x; e0 < end; e0 += kVAhead * blockDim.x) {
    float x[kVAhead];
#pragma unroll
    for (int u = 0; u < kVAhead; ++u) {
      const int e = e0 + u * blockDim.x;
      if (e < end) x[u] = load_as_float(p.qkv, v0 + e, p.dtype);
    }
#pragma unroll
    for (int u = 0; u < kVAhead; ++u) {
      const int e = e0 + u * blockDim.x;
      if (e < end) p.v[n * Hv * dv + e] = x[u];
    }
  }
  for (int h = part * blockDim.x + threadIdx.x; h < Hv; h += parts * blockDim.x) {
    const float x = __fadd_rn(load_as_float(p.a, n * p.ab_stride + h, p.dtype), p.dt_bias[h]);
    const float softplus = x > 20.0f ? x : log1pf(expf(x));  // torch's threshold
    p.g[n * Hv + h] = __fmul_rn(p.neg_a[h], softplus);
    p.beta[n * Hv + h] = 1.0f / (1.0f + expf(-load_as_float(p.b, n * p.ab_stride + h, p.dtype)));
  }
}

// -- step: one in-place decode token from the conv output to the gated norm (gated_delta.h),
// a CTA per (row, value head): 8 warps of 16 value columns, the whole head, so that the norm
// over its 128 outputs needs no other CTA. Each phase repeats the arithmetic of the kernel it
// replaces: prepare's L2 norms and gates (one warp a q or k head), the token loop's step of
// gated_delta_kernel (the same lanes, sums and butterfly), then rms_norm_kernel's row-per-warp
// gated norm (one warp, 16-byte vectors). Three launches and their fp32 round trips become one,
// and the state is read before the wait: no kernel of the pass before this one writes it (each
// waits for its predecessor before it lets its own successor start, so all but the conv have
// finished when this kernel starts).

constexpr int kStepWarps = kGatedDeltaStepDim / kWarpCols;  // 8

template <typename T>
__global__ void __launch_bounds__(kStepWarps * 32) gated_delta_step_kernel(GatedDeltaStepParams p) {
  constexpr int D = kGatedDeltaStepDim, kRows = D / kRowLanes;
  __shared__ __align__(16) float q_s[D];
  __shared__ __align__(16) float k_s[D];
  __shared__ __align__(16) float v_s[D];
  __shared__ __align__(16) float o_s[D];
  __shared__ float decay_s, beta_s;
  const int Hk = p.num_k_heads, Hv = p.num_v_heads;
  const int b = blockIdx.y, h = blockIdx.x, kh = h / (Hv / Hk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane / kColLanes, c = lane % kColLanes;
  const int col = warp * kWarpCols + c * 4;

  const int64_t slot = p.slots[b];
  const bool fresh = p.start[b] == 0, live = p.num_tokens[b] > 0;
  float* state = p.state_cache + (slot * Hv + h) * D * D + col;
  float4 S[kRows];
#pragma unroll
  for (int m = 0; m < kRows; ++m)
    S[m] = fresh ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                 : __ldcs(reinterpret_cast<const float4*>(state + static_cast<int64_t>(r + kRowLanes * m) * D));
  pdl_wait();  // the conv's output
  pdl_allow_dependents();

  // prepare (gated_delta_prepare_kernel's arithmetic): warp 0 the q head, warp 1 the k head,
  // warps 2-5 v, one thread the gates
  const T* x = static_cast<const T*>(p.qkv) + b * p.qkv_stride;
  if (warp < 2) {
    float xv[8];  // a lane holds elements lane + 32 i, as prepare's (its 8 slots: dk <= 256)
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = lane + 32 * i;
      xv[i] = e < D ? to_float(x[static_cast<int64_t>(warp * Hk + kh) * D + e]) : 0.0f;
      sq = __fadd_rn(sq, __fmul_rn(xv[i], xv[i]));
    }
    const float rr = rsqrtf(__fadd_rn(warp_sum(sq), p.l2_eps));
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int e = lane + 32 * i;
      if (e < D) {
        if (warp == 0) q_s[e] = __fmul_rn(__fmul_rn(xv[i], rr), p.q_scale);
        else k_s[e] = __fmul_rn(xv[i], rr);
      }
    }
  } else if (warp < 6) {
    const int e = (warp - 2) * 32 + lane;
    v_s[e] = to_float(x[2 * static_cast<int64_t>(Hk) * D + static_cast<int64_t>(h) * D + e]);
  } else if (warp == 6 && lane == 0) {
    const float xa = __fadd_rn(to_float(static_cast<const T*>(p.a)[b * p.ab_stride + h]), p.dt_bias[h]);
    const float softplus = xa > 20.0f ? xa : log1pf(expf(xa));  // torch's threshold
    decay_s = expf(__fmul_rn(p.neg_a[h], softplus));            // the token loop's exp(g)
    beta_s = 1.0f / (1.0f + expf(-to_float(static_cast<const T*>(p.b)[b * p.ab_stride + h])));
  }
  __syncthreads();

  // the step (gated_delta_kernel's token loop at one token, outputs on, the state in place)
  float out4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (live) {
    step_token<kRows, true>(S, kRows, k_s + r, q_s + r, load4(&v_s[col]), decay_s, beta_s, out4);
#pragma unroll
    for (int m = 0; m < kRows; ++m)
      __stcs(reinterpret_cast<float4*>(state + static_cast<int64_t>(r + kRowLanes * m) * D), S[m]);
  }
  if (r == 0) {  // the output as the token loop stores it: rounded to the dtype
#pragma unroll
    for (int e = 0; e < 4; ++e) o_s[col + e] = rounded<T>(out4[e]);
  }
  __syncthreads();

  // the gated norm (rms_norm_kernel, a row per warp, 16-byte vectors: lane l elements 8 l ..)
  if (warp != 0) return;
  const int i = lane * 8;
  const T* z = static_cast<const T*>(p.z) + b * p.z_stride + static_cast<int64_t>(h) * D;
  float sv[8], zv[8];
  float sq = 0.0f;
  if (i < D) {
#pragma unroll
    for (int k = 0; k < 8; ++k) sv[k] = o_s[i + k];
    const uint4 zr = *reinterpret_cast<const uint4*>(z + i);
    unpack8<T>(zr, zv);
#pragma unroll
    for (int k = 0; k < 8; ++k) sq = __fadd_rn(sq, __fmul_rn(sv[k], sv[k]));
  }
  sq = warp_sum(sq);
  const float inv = inv_rms(sq, D, p.norm_eps);
  if (i < D) {
    float w[8], y[8];
    const uint4 wr = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.norm_weight) + i);
    unpack8<T>(wr, w);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      y[k] = rms_scaled<T>(sv[k], inv, w[k], false);
      y[k] = __fmul_rn(rounded<T>(y[k]), zv[k] / (1.0f + expf(-zv[k])));
    }
    *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + (static_cast<int64_t>(b) * Hv + h) * D + i) = pack8<T>(y);
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
  if ((p.out && !p.q) || !p.k || !p.v || !p.g || !p.beta || !p.state_cache || (snapshots && !p.snapshot_cache) ||
      !p.slots || !p.start || !p.num_tokens)
    return "null pointer";
  if ((p.out && (!aligned16(p.q) || !aligned16(p.out))) || !aligned16(p.k) || !aligned16(p.v) ||
      !aligned16(p.state_cache) || (snapshots && !aligned16(p.snapshot_cache)))
    return "q, k, v, out and the caches must be 16-byte aligned";
  return nullptr;
}

cudaError_t gated_delta_recurrent_launch(const GatedDeltaParams& p, cudaStream_t stream) {
  if (gated_delta_recurrent_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.width == 0 || (p.out == nullptr && p.num_snapshots == 0)) return cudaSuccess;
  if (outputs_form_runs(p)) {
    const dim3 grid(p.value_dim / out_cols<false>(), p.num_v_heads, p.batch);
    return pdl_launch(gated_delta_outputs_kernel<false>, grid, dim3(kOutThreads), 0, stream, true, p);
  }
  if (mma_form_runs(p)) {
    const dim3 grid(p.value_dim / out_cols<true>(), p.num_v_heads, p.batch);
    const auto kernel = p.num_snapshots == 1 ? gated_delta_outputs_kernel<true, true> : gated_delta_outputs_kernel<true>;
    return pdl_launch(kernel, grid, dim3(kOutThreads), 0, stream, true, p);
  }
  const int warps = warps_per_cta(p);
  const dim3 grid(p.value_dim / (kWarpCols * warps), p.num_v_heads, p.batch);
  const dim3 block(32 * warps);
  const int rows = p.key_dim / kRowLanes;  // 2 .. 32
  const auto pick = [&](auto outputs) {
    constexpr bool kOut = decltype(outputs)::value;
    return rows <= 2    ? gated_delta_kernel<2, kOut>
           : rows <= 4  ? gated_delta_kernel<4, kOut>
           : rows <= 8  ? gated_delta_kernel<8, kOut>
           : rows <= 16 ? gated_delta_kernel<16, kOut>
                        : gated_delta_kernel<32, kOut>;
  };
  const auto kernel = p.out != nullptr ? pick(std::true_type{}) : pick(std::false_type{});
  return pdl_launch(kernel, grid, block, 0, stream, true, p);
}

const char* gated_delta_step_check(const GatedDeltaStepParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return "dtype must be bf16 or fp16";
  if (p.batch < 0 || p.batch > 65535) return "batch must be in [0, 65535]";
  if (p.num_k_heads < 1 || p.num_v_heads < 1 || p.num_v_heads % p.num_k_heads != 0 || p.num_v_heads > 65535)
    return "num_v_heads must be a positive multiple of num_k_heads, at most 65535";
  const int64_t width = 2 * static_cast<int64_t>(p.num_k_heads) * kGatedDeltaStepDim +
                        static_cast<int64_t>(p.num_v_heads) * kGatedDeltaStepDim;
  if (p.qkv_stride < width || p.ab_stride < p.num_v_heads ||
      p.z_stride < static_cast<int64_t>(p.num_v_heads) * kGatedDeltaStepDim)
    return "a row stride is shorter than its row";
  if (p.batch == 0) return nullptr;
  if (!p.qkv || !p.a || !p.b || !p.z || !p.neg_a || !p.dt_bias || !p.norm_weight || !p.state_cache || !p.slots ||
      !p.start || !p.num_tokens || !p.y)
    return "null pointer";
  if (!aligned16(p.z) || p.z_stride % 8 != 0 || !aligned16(p.norm_weight) || !aligned16(p.y) ||
      !aligned16(p.state_cache))
    return "z (and its row stride), norm_weight, y and state_cache must be 16-byte aligned";
  return nullptr;
}

cudaError_t gated_delta_step_launch(const GatedDeltaStepParams& p, cudaStream_t stream) {
  if (gated_delta_step_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.batch == 0) return cudaSuccess;
  const dim3 grid(p.num_v_heads, p.batch), block(kStepWarps * 32);
  const auto kernel = p.dtype == DType::kBFloat16 ? gated_delta_step_kernel<__nv_bfloat16> : gated_delta_step_kernel<__half>;
  return pdl_launch(kernel, grid, block, 0, stream, true, p);
}

}  // namespace dflash
