// Fused per-layer ops (semantics in layer_ops.h): each replaces a chain of small torch kernels.
//
// Rounding. The reference is eager PyTorch on bf16/fp16 tensors, which computes every
// elementwise op in fp32 and rounds the result to the dtype. The kernels keep that order
// step by step (round<T> after each op that torch runs as its own kernel), and use the
// _rn intrinsics where nvcc could otherwise contract a multiply and an add into one FMA
// (torch rounds between the two). Products of two bf16/fp16 values are exact in fp32, so
// those steps match torch bit for bit; the only step that can differ is the fp32 sum of
// squares of an RMSNorm, whose order is not torch's; that moves the normalised value by one
// unit in its last place, and only where it lands next to a rounding boundary.
//
// This file has no torch dependency: it compiles alone with
//   nvcc -std=c++17 -arch=sm_90 -c layer_ops.cu

#include "layer_ops.h"

#include "float_convert.h"
#include "lanes.h"
#include "pdl.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace dflash {
namespace {

// N consecutive elements at src (N * sizeof(T) a multiple of 16: 16-byte loads; N == 1: one
// plain load) -> fp32.
template <int N, typename T>
__device__ __forceinline__ void load(const T* src, float (&dst)[N]) {
  if constexpr (N * sizeof(T) % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < N / kPer; ++c) {
      const uint4 raw = reinterpret_cast<const uint4*>(src)[c];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPer; ++i) dst[c * kPer + i] = to_float(e[i]);
    }
  } else {
    static_assert(N == 1, "vector loads must be whole 16-byte chunks");
    dst[0] = to_float(src[0]);
  }
}

// fp32 -> N consecutive elements at dst, each rounded to T (a float T stores as is).
template <int N, typename T>
__device__ __forceinline__ void store(T* dst, const float (&src)[N]) {
  if constexpr (N * sizeof(T) % 16 == 0) {
    constexpr int kPer = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < N / kPer; ++c) {
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        if constexpr (std::is_same_v<T, float>) e[i] = src[c * kPer + i];
        else e[i] = from_float<T>(src[c * kPer + i]);
      }
      reinterpret_cast<uint4*>(dst)[c] = raw;
    }
  } else {
    static_assert(N == 1, "vector stores must be whole 16-byte chunks");
    if constexpr (std::is_same_v<T, float>) dst[0] = src[0];
    else dst[0] = from_float<T>(src[0]);
  }
}

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

template <typename T>
struct Type {
  using type = T;
};
template <int N>
struct Int {
  static constexpr int value = N;
};

template <typename F>
auto by_dtype(DType dtype, F&& f) {
  return dtype == DType::kBFloat16 ? f(Type<__nv_bfloat16>{}) : f(Type<__half>{});
}

// ---------------------------------------------------------------------------------------------
// rms_norm / add_rms_norm: one CTA per row. A thread owns up to kIters vectors of V elements
// (vector i of the row is thread i % blockDim's, pass i / blockDim) and keeps their fp32 sums
// in registers between the two passes, so the row is read from memory once. Rows of up to 1024
// vectors take one pass (512 threads for 4096 bf16 elements); only rows over 32768 elements
// (kIters = 8 with V = 8) spill a few registers. Rows of at most 32 vectors (a Qwen3.5 value
// head's gated norm, a small model's hidden) take a warp each, kWarpRows to a CTA: a CTA per
// such row left most of each SM's warp slots empty (an SM holds at most 32 CTAs) and paid a
// barrier for a sum that one warp does in registers. A one-pass row loads its gate with x,
// so the gate's latency overlaps the sum's.

constexpr int kNormMaxThreads = 1024;
constexpr int kNormMaxIters = 8;
constexpr int kWarpRows = 8;

// Where the gate's row `row` starts (RmsNormParams::gate_group).
__device__ __forceinline__ int64_t gate_row(const RmsNormParams& p, int64_t row) {
  if (p.gate_group == 0) return row * p.hidden;
  return row / p.gate_group * p.gate_group_stride + row % p.gate_group * p.hidden;
}

template <typename T, typename X, bool kDelta, int V, int kIters, bool kRowPerWarp>
__global__ void __launch_bounds__(kNormMaxThreads) rms_norm_kernel(RmsNormParams p) {
  pdl_wait();
  pdl_allow_dependents();  // a matmul reads this output next: it may fetch its weights meanwhile
  __shared__ float warp_sums[kNormMaxThreads / 32];
  const int H = p.hidden;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row = kRowPerWarp ? static_cast<int64_t>(blockIdx.x) * kWarpRows + warp : blockIdx.x;
  if (kRowPerWarp && row >= p.rows) return;  // whole warps: the shuffles below see all 32 lanes
  const int tid = kRowPerWarp ? lane : threadIdx.x, threads = kRowPerWarp ? 32 : blockDim.x;
  const int64_t base = row * H;
  const X* x = static_cast<const X*>(p.x) + base;
  const T* delta = kDelta ? static_cast<const T*>(p.delta) + base : nullptr;
  const T* gate = p.gate ? static_cast<const T*>(p.gate) + gate_row(p, row) : nullptr;
  constexpr bool kGateAhead = kIters == 1;
  float s[kIters][V], z[V];  // z: the gate (kIters == 1: loaded with x)
  float sq = 0.0f;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = (it * threads + tid) * V;
    if (i < H) {
      load<V>(x + i, s[it]);
      if constexpr (kGateAhead) {
        if (gate) load<V>(gate + i, z);
      }
      if constexpr (kDelta) {
        float d[V];
        load<V>(delta + i, d);
#pragma unroll
        for (int k = 0; k < V; ++k) s[it][k] = __fadd_rn(s[it][k], d[k]);
        store<V>(p.sum + base + i, s[it]);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) sq = __fadd_rn(sq, __fmul_rn(s[it][k], s[it][k]));
    }
  }
  sq = warp_sum(sq);
  if constexpr (!kRowPerWarp) {  // block sum: the first warp over the warp sums; every thread reads it
    const int warps = blockDim.x / 32;
    if (lane == 0) warp_sums[warp] = sq;
    __syncthreads();
    if (warp == 0) {
      sq = warp_sum(lane < warps ? warp_sums[lane] : 0.0f);
      if (lane == 0) warp_sums[0] = sq;
    }
    __syncthreads();
    sq = warp_sums[0];
  }
  // torch: mean = sum * (1 / H), then + eps, then rsqrt (CUDA's rsqrtf, as torch.rsqrt).
  const float inv = rsqrtf(__fadd_rn(__fmul_rn(sq, 1.0f / H), p.eps));
  const T* weight = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + base;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = (it * threads + tid) * V;
    if (i < H) {
      float w[V], y[V];
      load<V>(weight + i, w);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float n = __fmul_rn(s[it][k], inv);
        // Qwen3 rounds n to the model dtype and scales in it; Qwen3.5 scales by 1 + w in fp32
        y[k] = p.zero_centered ? __fmul_rn(n, __fadd_rn(1.0f, w[k])) : __fmul_rn(w[k], rounded<T>(n));
      }
      if (gate) {  // the scaled value, rounded, times torch's silu of the gate in fp32
        if constexpr (!kGateAhead) load<V>(gate + i, z);
#pragma unroll
        for (int k = 0; k < V; ++k) y[k] = __fmul_rn(rounded<T>(y[k]), z[k] / (1.0f + expf(-z[k])));
      }
      store<V>(out + i, y);
    }
  }
}

// The vector width: 16-byte loads of T (8 elements) when every row and pointer allows it.
int norm_vec(const RmsNormParams& p) {
  const bool ok = p.hidden % 8 == 0 && aligned(p.x, 16) && aligned(p.weight, 16) && aligned(p.out, 16) &&
                  (p.delta == nullptr || (aligned(p.delta, 16) && aligned(p.sum, 16))) &&
                  (p.gate == nullptr || (aligned(p.gate, 16) && p.gate_group_stride % 8 == 0));
  return ok ? 8 : 1;
}

// ---------------------------------------------------------------------------------------------
// qk_norm_rope: one warp per (row, head) of the packed qkv output. Lane l owns elements
// l + 32 j (j < D / 32): each warp load is 64 contiguous bytes, no alignment beyond the
// element's is needed, and the RoPE partner of element i < R (i +- R/2) is chunk j +- R / 64
// of the same lane, so the rotation needs no shuffle. R is a template argument so that the
// partner's register is known at compile time.

constexpr int kQkWarps = 8;

template <typename T, int D, int R>
__global__ void __launch_bounds__(kQkWarps * 32) qk_norm_rope_kernel(QkNormRopeParams p) {
  pdl_wait();
  pdl_allow_dependents();
  constexpr int kChunks = D / 32;
  constexpr int kRotChunks = R / 32;    // chunks [kRotChunks, kChunks) pass through unrotated
  constexpr int kHalf = kRotChunks / 2;  // chunks [0, kHalf) are the first half of the rotated part
  const int heads = p.num_q_heads + 2 * p.num_kv_heads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kQkWarps + threadIdx.x / 32;
  if (item >= p.rows * heads) return;  // whole warps: the shuffles below see all 32 lanes
  const int64_t r = item / heads;
  const int head = static_cast<int>(item % heads);
  const int lane = threadIdx.x % 32;
  // With q_gate, query head h sits at head slot 2h (its gate in 2h + 1) and k/v after all gates.
  const int col = head + (p.q_gate ? min(head, p.num_q_heads) : 0);
  const T* src = static_cast<const T*>(p.qkv) + r * p.qkv_stride + static_cast<int64_t>(col) * D + lane;
  const bool to_cache = p.k_cache != nullptr;
  const int64_t slot = to_cache ? p.slots[r] : 0, pos = to_cache ? p.positions[r] : 0;

  if (head >= p.num_q_heads + p.num_kv_heads) {  // v: copied as is
    const int vh = head - p.num_q_heads - p.num_kv_heads;
    T* dst = to_cache ? static_cast<T*>(p.v_cache) + slot * p.v_cache_stride[0] + pos * p.v_cache_stride[1] +
                            vh * p.v_cache_stride[2]
                      : static_cast<T*>(p.v_out) + (r * p.num_kv_heads + vh) * D;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) dst[lane + 32 * j] = src[32 * j];
    return;
  }

  const bool is_q = head < p.num_q_heads;
  float x[kChunks];
  float sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    x[j] = to_float(src[32 * j]);
    sq = __fadd_rn(sq, __fmul_rn(x[j], x[j]));
  }
  const float inv = rsqrtf(__fadd_rn(__fmul_rn(warp_sum(sq), 1.0f / D), p.eps));
  const T* weight = static_cast<const T*>(is_q ? p.q_weight : p.k_weight) + lane;
  float h[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const float n = __fmul_rn(x[j], inv), w = to_float(weight[32 * j]);
    // as rms_norm_kernel: Qwen3 rounds n and scales in the dtype, Qwen3.5 scales by 1 + w in fp32
    h[j] = rounded<T>(p.zero_centered ? __fmul_rn(n, __fadd_rn(1.0f, w)) : __fmul_rn(w, rounded<T>(n)));
  }

  const T* cos = static_cast<const T*>(p.cos) + r * p.cos_stride + lane;
  const T* sin = static_cast<const T*>(p.sin) + r * p.sin_stride + lane;
  T* dst;
  if (is_q) {
    dst = static_cast<T*>(p.q_out) + (r * p.num_q_heads + head) * D;
  } else {
    const int kh = head - p.num_q_heads;
    dst = to_cache ? static_cast<T*>(p.k_cache) + slot * p.k_cache_stride[0] + pos * p.k_cache_stride[1] +
                         kh * p.k_cache_stride[2]
                   : static_cast<T*>(p.k_out) + (r * p.num_kv_heads + kh) * D;
  }
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    if (j >= kRotChunks) {  // past the rotary part: h as it is (already rounded)
      dst[lane + 32 * j] = from_float<T>(h[j]);
      continue;
    }
    // rotated = cat(-h[R/2:R], h[:R/2]); out = round(round(h * cos) + round(rotated * sin))
    const float rot = j < kHalf ? -h[j + kHalf] : h[j - kHalf];
    const float a = rounded<T>(__fmul_rn(h[j], to_float(cos[32 * j])));
    const float b = rounded<T>(__fmul_rn(rot, to_float(sin[32 * j])));
    dst[lane + 32 * j] = from_float<T>(__fadd_rn(a, b));
  }
}

// The instantiation for rotary_dim `rotary` (a multiple of 64 up to D, checked before).
template <typename T, int D, int R = 64>
cudaError_t launch_qk_norm_rope(const QkNormRopeParams& p, int rotary, dim3 grid, cudaStream_t stream) {
  if constexpr (R < D) {
    if (rotary != R) return launch_qk_norm_rope<T, D, R + 64>(p, rotary, grid, stream);
  }
  return pdl_launch(qk_norm_rope_kernel<T, D, R>, grid, dim3(kQkWarps * 32), 0, stream, true, p);
}

// ---------------------------------------------------------------------------------------------
// silu_mul: a grid-stride loop over vectors of V outputs.

constexpr int kSiluThreads = 256;
constexpr int kSiluMaxBlocks = 8192;

template <typename T, int V>
__global__ void __launch_bounds__(kSiluThreads) silu_mul_kernel(SiluMulParams p) {
  pdl_wait();
  pdl_allow_dependents();  // as rms_norm_kernel
  const int64_t per_row = p.inter / V;
  const int64_t total = p.rows * per_row;
  const T* gate_up = static_cast<const T*>(p.gate_up);
  T* out = static_cast<T*>(p.out);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = (i % per_row) * V;
    float g[V], u[V], y[V];
    load<V>(gate_up + r * 2 * p.inter + c, g);
    load<V>(gate_up + r * 2 * p.inter + p.inter + c, u);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      // torch's silu: x / (1 + exp(-x)) in fp32, rounded; then the product, rounded.
      const float silu = rounded<T>(g[k] / (1.0f + expf(-g[k])));
      y[k] = __fmul_rn(silu, u[k]);
    }
    store<V>(out + r * p.inter + c, y);
  }
}

// ---------------------------------------------------------------------------------------------
// sigmoid_gate: a grid-stride loop over vectors of V outputs (as silu_mul), the gate gathered
// through its strides. A programmatic dependent of the attention before it, and o_proj after it
// may fetch its first weight lines meanwhile: two PyTorch kernels (sigmoid, multiply) did this
// without either.

template <typename T, int V>
__global__ void __launch_bounds__(kSiluThreads) sigmoid_gate_kernel(SigmoidGateParams p) {
  pdl_wait();
  pdl_allow_dependents();  // as rms_norm_kernel
  const int64_t per_head = p.head_dim / V, per_row = p.heads * per_head;
  const int64_t total = p.rows * per_row;
  const T* x = static_cast<const T*>(p.x);
  const T* gate = static_cast<const T*>(p.gate);
  T* out = static_cast<T*>(p.out);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, h = i % per_row / per_head, j = i % per_head * V;
    float a[V], g[V], y[V];
    load<V>(x + i * V, a);
    load<V>(gate + r * p.gate_row_stride + h * p.gate_head_stride + j, g);
#pragma unroll
    for (int k = 0; k < V; ++k) y[k] = __fmul_rn(a[k], rounded<T>(1.0f / (1.0f + expf(-g[k]))));
    store<V>(out + i * V, y);
  }
}

// ---------------------------------------------------------------------------------------------
// causal_conv: a thread per (row, channel) keeps the channel's last W inputs in registers and
// walks the row's T tokens; neighbouring threads take neighbouring channels (coalesced). The
// Qwen3.5/3.6 kernel size (4) is a template argument, so that the window's indices are known
// at compile time and it stays in registers (a runtime size, kTaps 0, keeps it in local
// memory); small CTAs spread a decode pass's few rows over more SMs. The walk is serial, so
// the inputs of kConvAhead tokens are loaded before any of them is used: one memory latency
// per kConvAhead tokens instead of one per token (a verify is 16, a prefill hundreds).

constexpr int kConvThreads = 64;
constexpr int kConvMaxTaps = 8;
constexpr int kConvAhead = 8;

template <typename T, int kTaps>
__global__ void __launch_bounds__(kConvThreads) causal_conv_kernel(CausalConvParams p) {
  pdl_wait();
  pdl_allow_dependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(p.batch) * p.channels) return;
  const int b = static_cast<int>(i / p.channels), c = static_cast<int>(i % p.channels);
  const int K = kTaps > 0 ? kTaps : p.kernel_size, W = K - 1, T_ = p.width, C = p.channels;
  const int64_t slot = p.slots[b];
  T* cache = static_cast<T*>(p.conv_cache) + slot * W * C + c;
  float w[kConvMaxTaps], win[kConvMaxTaps];
  const T* weight = static_cast<const T*>(p.weight) + static_cast<int64_t>(c) * K;
  const bool fresh = p.start[b] == 0;
#pragma unroll
  for (int j = 0; j < kConvMaxTaps; ++j) {
    w[j] = j < K ? to_float(weight[j]) : 0.0f;
    win[j] = j < W && !fresh ? to_float(cache[static_cast<int64_t>(j) * C]) : 0.0f;
  }
  T* snapshots = p.num_snapshots > 0 ? static_cast<T*>(p.snapshots) + slot * p.num_snapshots * W * C + c : nullptr;
  const int first = T_ - p.num_snapshots + 1;  // tokens seen by snapshot 0 (< 0: it stays)
  auto snapshot = [&](int n) {  // the window after n tokens, if a snapshot wants it
    const int j = n - first;
    if (snapshots == nullptr || j < 0) return;
    for (int k = 0; k < W; ++k) snapshots[(static_cast<int64_t>(j) * W + k) * C] = from_float<T>(win[k]);
  };
  snapshot(0);
  // NS == 0: the window after the row's own tokens goes to the cache (a padded prefill's
  // row stops before the pass does; its padding's outputs are computed and never read)
  const int keep = p.num_tokens != nullptr ? max(0, min(p.num_tokens[b], T_)) : T_;
  auto to_cache = [&](int n) {
    if (snapshots != nullptr || n != keep) return;
    for (int k = 0; k < W; ++k) cache[static_cast<int64_t>(k) * C] = from_float<T>(win[k]);
  };
  to_cache(0);
  const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(b) * T_ * p.x_stride + c;
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(b) * T_ * C + c;
  for (int t0 = 0; t0 < T_; t0 += kConvAhead) {
    T ahead[kConvAhead];
#pragma unroll
    for (int u = 0; u < kConvAhead; ++u)
      if (t0 + u < T_) ahead[u] = x[static_cast<int64_t>(t0 + u) * p.x_stride];
#pragma unroll
    for (int u = 0; u < kConvAhead; ++u) {
      const int t = t0 + u;
      if (t >= T_) break;
      win[W] = to_float(ahead[u]);  // tap W meets the token itself
      float acc = rounded<T>(__fmul_rn(win[0], w[0]));
#pragma unroll
      for (int j = 1; j < kConvMaxTaps; ++j) {
        if (j <= W) acc = rounded<T>(__fadd_rn(acc, rounded<T>(__fmul_rn(win[j], w[j]))));
      }
      out[static_cast<int64_t>(t) * C] = from_float<T>(acc / (1.0f + expf(-acc)));
#pragma unroll
      for (int j = 0; j + 1 < kConvMaxTaps; ++j) {
        if (j < W) win[j] = win[j + 1];
      }
      snapshot(t + 1);
      to_cache(t + 1);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers

const char* rms_norm_check(const RmsNormParams& p) {
  if (p.rows < 0 || p.rows > 0x7fffffff) return "rows must be in [0, 2^31)";
  if (p.hidden < 1) return "hidden must be positive";
  if (p.rows > 0 && (!p.x || !p.weight || !p.out)) return "null pointer";
  if (p.rows > 0 && p.delta && !p.sum) return "add_rms_norm needs the sum output";
  if (p.gate && p.zero_centered) return "a gated norm is not zero-centred";
  if (p.gate_group < 0 || (p.gate_group > 0 && p.gate_group_stride < static_cast<int64_t>(p.gate_group) * p.hidden))
    return "gate_group must not be negative, and its groups must not overlap";
  if (p.hidden > kNormMaxIters * kNormMaxThreads * norm_vec(p))
    return "hidden too large (at most 65536, or 8192 when rows are not 16-byte aligned)";
  return nullptr;
}

cudaError_t rms_norm_launch(const RmsNormParams& p, cudaStream_t stream) {
  if (rms_norm_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  const int vec = norm_vec(p);
  const int vectors = (p.hidden + vec - 1) / vec;
  // Enough threads for one vector each up to the maximum, then more passes: rows of up to 32
  // vectors a warp each, Qwen3-8B's 4096 (bf16, 8 per vector) 512 threads.
  const int iters_needed = (vectors + kNormMaxThreads - 1) / kNormMaxThreads;
  const int iters = iters_needed <= 1 ? 1 : iters_needed <= 2 ? 2 : iters_needed <= 4 ? 4 : 8;
  const bool row_per_warp = vectors <= 32;
  const int threads = row_per_warp ? 32 * kWarpRows : ((vectors + iters - 1) / iters + 31) / 32 * 32;
  const dim3 grid(static_cast<unsigned>(row_per_warp ? (p.rows + kWarpRows - 1) / kWarpRows : p.rows));
  auto launch = [&](auto t, auto x_fp32, auto v, auto n) {
    using T = typename decltype(t)::type;
    using X = std::conditional_t<decltype(x_fp32)::value != 0, float, T>;
    constexpr int V = decltype(v)::value, N = decltype(n)::value;
    if constexpr (N == 1) {
      if (row_per_warp) {
        const auto kernel = p.delta ? rms_norm_kernel<T, X, true, V, 1, true> : rms_norm_kernel<T, X, false, V, 1, true>;
        return pdl_launch(kernel, grid, dim3(threads), 0, stream, true, p);
      }
    }
    const auto kernel = p.delta ? rms_norm_kernel<T, X, true, V, N, false> : rms_norm_kernel<T, X, false, V, N, false>;
    return pdl_launch(kernel, grid, dim3(threads), 0, stream, true, p);
  };
  auto by_iters = [&](auto t, auto x_fp32, auto v) {
    switch (iters) {
      case 1: return launch(t, x_fp32, v, Int<1>{});
      case 2: return launch(t, x_fp32, v, Int<2>{});
      case 4: return launch(t, x_fp32, v, Int<4>{});
      default: return launch(t, x_fp32, v, Int<8>{});
    }
  };
  auto by_vec = [&](auto t, auto x_fp32) {
    return vec == 8 ? by_iters(t, x_fp32, Int<8>{}) : by_iters(t, x_fp32, Int<1>{});
  };
  return by_dtype(p.dtype, [&](auto t) { return p.x_fp32 ? by_vec(t, Int<1>{}) : by_vec(t, Int<0>{}); });
}

const char* qk_norm_rope_check(const QkNormRopeParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return "head_dim must be 64, 128 or 256";
  if (p.rotary_dim < 0 || p.rotary_dim % 64 != 0 || p.rotary_dim > p.head_dim)
    return "rotary_dim must be 0 (all of head_dim) or a multiple of 64 up to head_dim";
  if (p.rows < 0 || p.num_q_heads < 0 || p.num_kv_heads < 1) return "bad rows or head counts";
  if ((p.rows * (p.num_q_heads + 2 * p.num_kv_heads) + kQkWarps - 1) / kQkWarps > 0x7fffffff)
    return "too many rows";
  if ((p.k_cache == nullptr) != (p.v_cache == nullptr)) return "k_cache and v_cache must be given together";
  if (p.rows == 0) return nullptr;  // empty tensors may have null data
  if (!p.qkv || !p.k_weight || !p.cos || !p.sin) return "null pointer";
  if (p.num_q_heads > 0 && (!p.q_weight || !p.q_out)) return "q heads need q_weight and q_out";
  if (p.k_cache && (!p.slots || !p.positions)) return "the cache write needs slots and positions";
  if (!p.k_cache && (!p.k_out || !p.v_out)) return "k_out and v_out are needed without a cache";
  return nullptr;
}

cudaError_t qk_norm_rope_launch(const QkNormRopeParams& p, cudaStream_t stream) {
  if (qk_norm_rope_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  const int64_t items = p.rows * (p.num_q_heads + 2 * p.num_kv_heads);
  const dim3 grid(static_cast<unsigned>((items + kQkWarps - 1) / kQkWarps));
  const int rotary = p.rotary_dim == 0 ? p.head_dim : p.rotary_dim;
  return by_dtype(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    if (p.head_dim == 64) return launch_qk_norm_rope<T, 64>(p, rotary, grid, stream);
    if (p.head_dim == 128) return launch_qk_norm_rope<T, 128>(p, rotary, grid, stream);
    return launch_qk_norm_rope<T, 256>(p, rotary, grid, stream);
  });
}

const char* silu_mul_check(const SiluMulParams& p) {
  if (p.rows < 0 || p.inter < 0) return "negative rows or inter";
  if ((p.rows > 0 && p.inter > 0) && (!p.gate_up || !p.out)) return "null pointer";
  return nullptr;
}

cudaError_t silu_mul_launch(const SiluMulParams& p, cudaStream_t stream) {
  if (silu_mul_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.inter == 0) return cudaSuccess;
  const bool vec8 = p.inter % 8 == 0 && aligned(p.gate_up, 16) && aligned(p.out, 16);
  const int64_t vectors = p.rows * (vec8 ? p.inter / 8 : p.inter);
  const int blocks = static_cast<int>(std::min<int64_t>((vectors + kSiluThreads - 1) / kSiluThreads, kSiluMaxBlocks));
  return by_dtype(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return pdl_launch(vec8 ? silu_mul_kernel<T, 8> : silu_mul_kernel<T, 1>, dim3(blocks), dim3(kSiluThreads), 0, stream,
                      true, p);
  });
}

const char* sigmoid_gate_check(const SigmoidGateParams& p) {
  if (p.rows < 0 || p.heads < 0 || p.head_dim < 0) return "negative rows, heads or head_dim";
  if ((p.rows > 0 && p.heads > 0 && p.head_dim > 0) && (!p.x || !p.gate || !p.out)) return "null pointer";
  return nullptr;
}

cudaError_t sigmoid_gate_launch(const SigmoidGateParams& p, cudaStream_t stream) {
  if (sigmoid_gate_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.heads == 0 || p.head_dim == 0) return cudaSuccess;
  const bool vec8 = p.head_dim % 8 == 0 && p.gate_row_stride % 8 == 0 && p.gate_head_stride % 8 == 0 &&
                    aligned(p.x, 16) && aligned(p.gate, 16) && aligned(p.out, 16);
  const int64_t vectors = p.rows * p.heads * (vec8 ? p.head_dim / 8 : p.head_dim);
  const int blocks = static_cast<int>(std::min<int64_t>((vectors + kSiluThreads - 1) / kSiluThreads, kSiluMaxBlocks));
  return by_dtype(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return pdl_launch(vec8 ? sigmoid_gate_kernel<T, 8> : sigmoid_gate_kernel<T, 1>, dim3(blocks),
                      dim3(kSiluThreads), 0, stream, true, p);
  });
}

const char* causal_conv_check(const CausalConvParams& p) {
  if (p.batch < 0 || p.channels < 1 || p.width < 1) return "batch must not be negative, channels and width positive";
  if (p.kernel_size < 2 || p.kernel_size > kConvMaxTaps) return "kernel_size must be in [2, 8]";
  if (p.num_snapshots < 0) return "num_snapshots must not be negative";
  if (p.x_stride < p.channels) return "x_stride must be at least channels";
  if (p.num_tokens && p.num_snapshots > 0) return "num_tokens (ragged rows) only with num_snapshots = 0";
  if (p.batch > 0 && (!p.x || !p.weight || !p.conv_cache || !p.slots || !p.start || !p.out ||
                      (p.num_snapshots > 0 && !p.snapshots)))
    return "null pointer";
  return nullptr;
}

cudaError_t causal_conv_launch(const CausalConvParams& p, cudaStream_t stream) {
  if (causal_conv_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.batch == 0) return cudaSuccess;
  const int64_t threads = static_cast<int64_t>(p.batch) * p.channels;
  const unsigned blocks = static_cast<unsigned>((threads + kConvThreads - 1) / kConvThreads);
  return by_dtype(p.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return pdl_launch(p.kernel_size == 4 ? causal_conv_kernel<T, 4> : causal_conv_kernel<T, 0>, dim3(blocks),
                      dim3(kConvThreads), 0, stream, true, p);
  });
}

}  // namespace dflash
