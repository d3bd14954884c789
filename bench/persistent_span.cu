// A measurement, not an op of the engine: one persistent kernel running the weight-streaming
// span of Qwen3.6-35B-A3B's linear-attention layers for one token (an AR step at batch 1),
// layer after layer:
//
//   out_proj -> add + norm -> router -> top-k -> experts' gate_up -> down -> add + norm -> in_proj
//
// with the engine's arithmetic to bf16 rounding (not its bits: sums run in another order), so
// that bench/persistent_span.py can check it against the engine's kernels and time the two.
// The question it answers: how much of the step's time between its weight reads (kernel
// boundaries, launch ramps and tails) would a persistent design win back (issue 18's roofline
// goal)?
//
// The grid is every CTA the GPU holds at once (so grid barriers cannot deadlock); a phase's
// weights are split evenly over all warps in 32-chunk groups (a chunk is 16 bytes), each warp
// streaming its groups with kLoads loads a lane in flight and adding its rows' fp32 sums into
// the phase's accumulators with atomics (a row split between two warps gets two adds: the sums'
// order is not fixed, unlike the engine's). The work between matmuls (norms, top-k, SiLU) runs
// in every CTA on what it needs, read from L2, so only the matmuls' outputs need a barrier.
// Before each barrier a CTA may prefetch into L2 the first bytes of its share of the next
// phase's weights, where their addresses are known then (the experts' only after the routing,
// but for the shared expert): a persistent design's answer to the ramp after every barrier.
// Or (kDynamic) the warps take pieces of a phase from a counter, so that a fast SM takes more.
//
// Two other designs were measured and not kept (6309392: a producer thread with bulk copies
// through a shared-memory ring; 8dbe160: a cp.async pipeline per warp); every figure is in
// benchmarks/persistent_span_h200.json and BENCHMARKS.md, "Mixture of experts".
//
// Shapes are the 35B-A3B's, fixed at compile time.

#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace {

using bf16 = __nv_bfloat16;

constexpr int H = 2048, V = 4096, I = 512, E = 256, K = 8, P = K + 1, N = 12352;  // P picks: K routed + shared
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kGateUpRows = 2 * I, kRouterRows = E + 1;

struct Layer {
  const uint4* out_proj;  // [H, V]
  const uint4* router;    // [E + 1, H] (the shared expert's gate last)
  const uint4* gate_up;   // [E + 1, 2I, H] (the shared expert last)
  const uint4* down;      // [E + 1, H, I]
  const uint4* in_proj;   // [N, H]
  const bf16* norm1;      // [H] zero-centred: scale 1 + w
  const bf16* norm2;      // [H]
};

struct Params {
  const Layer* layers;
  int num_layers;
  float eps;
  const bf16* x0;     // [V] the first layer's out_proj input
  const float* res0;  // [H] the first residual
  float* res[2];      // [H] the residual after layer l: res[(l + 1) % 2]
  float* d_acc;       // [H] out_proj's sums
  float* logit_acc;   // [E + 1]
  float* gu_acc;      // [P, 2I]
  float* down_acc;    // [H, P]
  float* z_acc;       // [N] in_proj's sums: the output after the last layer
  float* sumsq;       // [gridDim.x] each CTA's part of the second norm's sum of squares
  int* ids_out;       // [layers, P] the routing, for the check
  unsigned* barrier;  // zero at launch
  int prefetch_bytes;  // of its share of the next matmul a CTA pulls into L2 before a barrier
  // null, or [layers, 6 barriers, 3] ns (%globaltimer): the first and the last CTA's arrival,
  // CTA 0's departure; the first two start at INT64_MAX / 0
  unsigned long long* timeline = nullptr;
  unsigned long long* claims = nullptr;  // [layers, 5 matmuls] zero at launch (kDynamic)
};

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ float bf(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The CTA's sum of v over its threads, the same in every CTA for the same inputs.
__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < kWarps; ++w) t += scratch[w];
  return t;
}

__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Every CTA of the grid arrives before any leaves; `target` counts arrivals over the launch.
// `times`: null, or the barrier's three timeline entries (Params::timeline).
__device__ void grid_barrier(unsigned* counter, unsigned& target, unsigned long long* times) {
  target += gridDim.x;
  __syncthreads();
  if (threadIdx.x == 0) {
    if (times != nullptr) {
      const unsigned long long now = global_ns();
      atomicMin(times, now);
      atomicMax(times + 1, now);
    }
    __threadfence();
    atomicAdd(counter, 1u);
    long long spins = 0;
    while (load_acquire(counter) < target)
      if (++spins > (1ll << 28)) asm volatile("trap;");  // a hang is a bug: fail instead
    __threadfence();
    if (times != nullptr && blockIdx.x == 0) times[2] = global_ns();
  }
  __syncthreads();
}

// Unit u of `units`' share of T chunks (T a multiple of 32): whole 32-chunk groups.
__device__ __forceinline__ int64_t share_begin(int64_t T, int64_t units, int64_t u) {
  return u * (T / 32) / units * 32;
}

// A warp's piece of a phase: chunks [base, b), at most 32 kLoads, into registers ...
template <int kLoads, typename Map>
__device__ __forceinline__ void load_piece(const Map& m, int64_t base, int64_t b, uint4 (&w)[kLoads], int lane) {
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int64_t pos = base + 32 * i + lane;
    w[i] = pos < b ? __ldcs(m.w(pos)) : make_uint4(0, 0, 0, 0);
  }
}

// ... and against the input: row `cur`'s sum so far in acc, added to out[cur] (an atomic) when
// the rows change.
template <int kLoads, typename Map>
__device__ __forceinline__ void use_piece(const Map& m, int64_t base, int64_t b, const uint4 (&w)[kLoads],
                                          int64_t& cur, float& acc, float* out, int lane) {
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int64_t g = base + 32 * i;  // the group's first chunk: the same for the whole warp
    if (g >= b) break;
    const int64_t row = m.row(g);
    if (row != cur) {
      if (cur >= 0) {
        const float s = warp_sum(acc);
        if (lane == 0) atomicAdd(out + cur, s);
      }
      cur = row;
      acc = 0.0f;
    }
    acc += dot8(w[i], m.x(g + lane));
  }
}

// The next piece of a phase for the warp: the first chunk of 32 kLoads taken from the counter.
__device__ __forceinline__ int64_t claim(unsigned long long* counter, int pieces, int lane) {
  unsigned long long v = 0;
  if (lane == 0) v = atomicAdd(counter, static_cast<unsigned long long>(pieces));
  return static_cast<int64_t>(__shfl_sync(0xffffffffu, v, 0));
}

// A phase of T chunks: w(pos) is a weight chunk, x(pos) the input chunk it meets, row(pos) the
// accumulator it adds to (a row never straddles a 32-chunk group). Each warp streams an even
// share (claims null), or takes pieces from a counter (zero before the phase) until none are
// left, the next claim issued before the piece's math: a fast SM takes more.
template <int kLoads, typename Map>
__device__ void stream(const Map& m, int64_t T, float* out, unsigned long long* claims) {
  const int lane = threadIdx.x % 32;
  constexpr int kPiece = 32 * kLoads;
  int64_t cur = -1;
  float acc = 0.0f;
  uint4 w[kLoads];
  if (claims == nullptr) {
    const int64_t units = static_cast<int64_t>(gridDim.x) * kWarps, u = blockIdx.x * kWarps + threadIdx.x / 32;
    const int64_t a = share_begin(T, units, u), b = share_begin(T, units, u + 1);
    for (int64_t base = a; base < b; base += kPiece) {
      load_piece(m, base, b, w, lane);
      use_piece(m, base, b, w, cur, acc, out, lane);
    }
  } else {
    for (int64_t base = claim(claims, kPiece, lane); base < T;) {
      const int64_t b = base + kPiece < T ? base + kPiece : T;
      load_piece(m, base, b, w, lane);
      const int64_t next = claim(claims, kPiece, lane);
      use_piece(m, base, b, w, cur, acc, out, lane);
      base = next;
    }
  }
  if (cur >= 0) {
    const float s = warp_sum(acc);
    if (lane == 0) atomicAdd(out + cur, s);
  }
}

// Row-major [rows, C chunks] weights against one input row in shared memory.
template <int C>
struct Dense {
  const uint4* weight;
  const uint4* xs;
  __device__ const uint4* w(int64_t pos) const { return weight + pos; }
  __device__ uint4 x(int64_t pos) const { return xs[pos % C]; }
  __device__ int64_t row(int64_t pos) const { return pos / C; }
};

// The picks' gate and up rows: row j 2I + r of the phase is row r of expert ids[j].
struct GateUp {
  const uint4* weight;
  const uint4* xs;
  const int* ids;
  static constexpr int C = H / 8;
  __device__ const uint4* w(int64_t pos) const {
    const int j = static_cast<int>(pos / (C * kGateUpRows));
    return weight + pos + static_cast<int64_t>(ids[j] - j) * C * kGateUpRows;
  }
  __device__ uint4 x(int64_t pos) const { return xs[pos % C]; }
  __device__ int64_t row(int64_t pos) const { return pos / C; }
};

// Down rows: row h P + j of the phase is row h of expert ids[j], against pick j's activation.
struct Down {
  const uint4* weight;
  const uint4* act;  // [P, I] in chunks
  const int* ids;
  static constexpr int C = I / 8;
  __device__ const uint4* w(int64_t pos) const {
    const int64_t row = pos / C, h = row / P;
    const int j = static_cast<int>(row - h * P);
    return weight + (static_cast<int64_t>(ids[j]) * H + h) * C + pos % C;
  }
  __device__ uint4 x(int64_t pos) const {
    const int j = static_cast<int>(pos / C % P);
    return act[j * C + pos % C];
  }
  __device__ int64_t row(int64_t pos) const { return pos / C; }
};

// The CTA's share of a phase of T chunks, as chunk positions [begin, end).
__device__ __forceinline__ void cta_share(int64_t T, int64_t& begin, int64_t& end) {
  const int64_t units = static_cast<int64_t>(gridDim.x) * kWarps;
  begin = share_begin(T, units, static_cast<int64_t>(blockIdx.x) * kWarps);
  end = share_begin(T, units, static_cast<int64_t>(blockIdx.x + 1) * kWarps);
}

// Prefetch the first bytes of the CTA's share of a dense phase (contiguous in memory).
__device__ void prefetch_dense(const uint4* weight, int64_t T, int bytes) {
  int64_t begin, end;
  cta_share(T, begin, end);
  const int64_t n = imin(bytes / 16, end - begin);
  if (threadIdx.x == 0 && n > 0) prefetch_l2(weight + begin, static_cast<uint32_t>(n * 16));
}

// kLoads: 16-byte loads a lane has in flight; kMinCtas: CTAs an SM (64 registers a thread at 2);
// kDynamic: warps take pieces of a phase from a counter (Params::claims) instead of even shares.
template <int kLoads, int kMinCtas, bool kDynamic>
__global__ void __launch_bounds__(kThreads, kMinCtas) persistent_span_kernel(Params p) {
  __shared__ __align__(16) bf16 xs[P * I > V ? P * I : V];  // the current matmul's input row
  __shared__ float s[H];                                  // the residual after attention
  __shared__ float scratch[kWarps];
  __shared__ int ids[P];
  __shared__ float weights[P];
  const uint4* xs4 = reinterpret_cast<const uint4*>(xs);
  const int t = threadIdx.x, cta = blockIdx.x, grid = gridDim.x;
  unsigned target = 0;

  for (int l = 0; l < p.num_layers; ++l) {
    const Layer L = p.layers[l];
    const float* res_in = l == 0 ? p.res0 : p.res[l % 2];
    float* res_out = p.res[(l + 1) % 2];

    // out_proj: x is the first layer's input, else the last in_proj's first V outputs
    for (int i = t; i < V; i += kThreads) xs[i] = l == 0 ? p.x0[i] : __float2bfloat16(__ldcg(p.z_acc + i));
    __syncthreads();
    stream<kLoads>(Dense<V / 8>{L.out_proj, xs4}, static_cast<int64_t>(H) * (V / 8), p.d_acc,
                   kDynamic ? p.claims + l * 5 + 0 : nullptr);
    if (p.prefetch_bytes) prefetch_dense(L.router, static_cast<int64_t>(kRouterRows) * (H / 8), p.prefetch_bytes);
    grid_barrier(p.barrier, target, p.timeline ? p.timeline + (l * 6 + 0) * 3 : nullptr);

    // add + norm (every CTA the whole row), then the router; z_acc is free again
    float sq = 0.0f;
    for (int i = t; i < H; i += kThreads) {
      s[i] = res_in[i] + bf(__ldcg(p.d_acc + i));
      sq += s[i] * s[i];
    }
    float inv = rsqrtf(block_sum(sq, scratch) / H + p.eps);
    for (int i = t; i < H; i += kThreads)
      xs[i] = __float2bfloat16(s[i] * inv * (1.0f + __bfloat162float(L.norm1[i])));
    for (int i = cta * kThreads + t; i < N; i += grid * kThreads) p.z_acc[i] = 0.0f;
    __syncthreads();
    stream<kLoads>(Dense<H / 8>{L.router, xs4}, static_cast<int64_t>(kRouterRows) * (H / 8), p.logit_acc,
                   kDynamic ? p.claims + l * 5 + 1 : nullptr);
    if (p.prefetch_bytes) {  // of the experts only the shared one is known before the routing
      int64_t begin, end;
      cta_share(static_cast<int64_t>(P) * kGateUpRows * (H / 8), begin, end);
      begin = imax(begin, static_cast<int64_t>(K) * kGateUpRows * (H / 8));
      const int64_t n = imin(p.prefetch_bytes / 16, end - begin);
      if (t == 0 && n > 0)
        prefetch_l2(L.gate_up + static_cast<int64_t>(E - K) * kGateUpRows * (H / 8) + begin,
                    static_cast<uint32_t>(n * 16));
    }
    grid_barrier(p.barrier, target, p.timeline ? p.timeline + (l * 6 + 1) * 3 : nullptr);

    // top-k (warp 0): softmax over the routed experts, the k largest, renormalised, bf16
    if (t < 32) {
      float v[E / 32];
      for (int i = 0; i < E / 32; ++i) v[i] = bf(__ldcg(p.logit_acc + t + 32 * i));
      float mx = -INFINITY;
      for (int i = 0; i < E / 32; ++i) mx = fmaxf(mx, v[i]);
      mx = warp_max(mx);
      float sum = 0.0f;
      for (int i = 0; i < E / 32; ++i) {
        v[i] = expf(v[i] - mx);
        sum += v[i];
      }
      sum = warp_sum(sum);
      float picked = 0.0f;
      for (int k = 0; k < K; ++k) {
        float best = -1.0f;
        int at = 0;
        for (int i = 0; i < E / 32; ++i)
          if (v[i] > best) best = v[i], at = t + 32 * i;
        const float top = warp_max(best);
        const int who = __ffs(__ballot_sync(0xffffffffu, best == top)) - 1;  // the lowest lane: lowest expert
        const int e = __shfl_sync(0xffffffffu, at, who);
        if (t == who) v[(e - t) / 32] = -1.0f;
        if (t == 0) ids[k] = e, weights[k] = top / sum;
        picked += top / sum;
      }
      __syncwarp();
      if (t < K) weights[t] = bf(weights[t] / picked);
      if (t == 0) {
        ids[K] = E;
        weights[K] = bf(1.0f / (1.0f + expf(-bf(__ldcg(p.logit_acc + E)))));
        for (int j = 0; j < P; ++j) p.ids_out[l * P + j] = ids[j];
      }
    }
    __syncthreads();
    stream<kLoads>(GateUp{L.gate_up, xs4, ids}, static_cast<int64_t>(P) * kGateUpRows * (H / 8), p.gu_acc,
                   kDynamic ? p.claims + l * 5 + 2 : nullptr);
    if (p.prefetch_bytes) {  // the down rows of the picks: 1 KB each
      int64_t begin, end;
      cta_share(static_cast<int64_t>(H) * P * (I / 8), begin, end);
      const int64_t rows = imin(p.prefetch_bytes / (I * 2), (end - begin + I / 8 - 1) / (I / 8));
      if (t < rows) {
        const int64_t row = begin / (I / 8) + t, h = row / P;
        const int j = static_cast<int>(row - h * P);
        prefetch_l2(L.down + (static_cast<int64_t>(ids[j]) * H + h) * (I / 8), I * 2);
      }
    }
    grid_barrier(p.barrier, target, p.timeline ? p.timeline + (l * 6 + 2) * 3 : nullptr);

    // SiLU(gate) * up of every pick (every CTA the whole of it), then down
    for (int i = t; i < P * I; i += kThreads) {
      const int j = i / I, r = i % I;
      const float g = bf(__ldcg(p.gu_acc + j * kGateUpRows + r)), u = bf(__ldcg(p.gu_acc + j * kGateUpRows + I + r));
      xs[i] = __float2bfloat16(bf(g / (1.0f + expf(-g))) * u);
    }
    __syncthreads();
    stream<kLoads>(Down{L.down, xs4, ids}, static_cast<int64_t>(H) * P * (I / 8), p.down_acc,
                   kDynamic ? p.claims + l * 5 + 3 : nullptr);
    if (p.prefetch_bytes) prefetch_dense(L.in_proj, static_cast<int64_t>(N) * (H / 8), p.prefetch_bytes);
    grid_barrier(p.barrier, target, p.timeline ? p.timeline + (l * 6 + 3) * 3 : nullptr);

    // the weighted sum and the residual add: the CTA's slice of H, its part of the sum of squares
    sq = 0.0f;
    for (int i = cta * H / grid + t; i < (cta + 1) * H / grid; i += kThreads) {
      float out = 0.0f;
      for (int j = 0; j < P; ++j) out += weights[j] * bf(__ldcg(p.down_acc + i * P + j));
      const float s2 = s[i] + bf(out);
      res_out[i] = s2;
      sq += s2 * s2;
    }
    sq = block_sum(sq, scratch);
    if (t == 0) p.sumsq[cta] = sq;
    grid_barrier(p.barrier, target, p.timeline ? p.timeline + (l * 6 + 4) * 3 : nullptr);

    // the next layer's input norm (every CTA the whole row), then in_proj; the accumulators
    // read since the last barrier but one are free again
    sq = 0.0f;
    for (int i = t; i < grid; i += kThreads) sq += __ldcg(p.sumsq + i);
    inv = rsqrtf(block_sum(sq, scratch) / H + p.eps);
    for (int i = t; i < H; i += kThreads)
      xs[i] = __float2bfloat16(__ldcg(res_out + i) * inv * (1.0f + __bfloat162float(L.norm2[i])));
    for (int i = cta * kThreads + t; i < H; i += grid * kThreads) p.d_acc[i] = 0.0f;
    for (int i = cta * kThreads + t; i < kRouterRows; i += grid * kThreads) p.logit_acc[i] = 0.0f;
    for (int i = cta * kThreads + t; i < P * kGateUpRows; i += grid * kThreads) p.gu_acc[i] = 0.0f;
    for (int i = cta * kThreads + t; i < H * P; i += grid * kThreads) p.down_acc[i] = 0.0f;
    __syncthreads();
    stream<kLoads>(Dense<H / 8>{L.in_proj, xs4}, static_cast<int64_t>(N) * (H / 8), p.z_acc,
                   kDynamic ? p.claims + l * 5 + 4 : nullptr);
    if (l + 1 < p.num_layers) {
      if (p.prefetch_bytes)
        prefetch_dense(p.layers[l + 1].out_proj, static_cast<int64_t>(H) * (V / 8), p.prefetch_bytes);
      grid_barrier(p.barrier, target, p.timeline ? p.timeline + (l * 6 + 5) * 3 : nullptr);
    }
  }
}

// The variants bench/persistent_span.py compares: (loads a lane in flight, CTAs an SM).
using Kernel = void (*)(Params);
constexpr Kernel kVariants[] = {persistent_span_kernel<8, 1, false>, persistent_span_kernel<4, 2, false>,
                                persistent_span_kernel<8, 1, true>, persistent_span_kernel<4, 2, true>};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

// The grid that fits the GPU at once for a variant: its CTAs an SM x SMs.
int64_t resident_grid(int64_t variant) {
  TORCH_CHECK(variant >= 0 && variant < kNumVariants, "variant must be in [0, ", kNumVariants, ")");
  int per_sm = 0, device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kVariants[variant], kThreads, 0));
  return static_cast<int64_t>(per_sm) * sms;
}

// layers: [L, 7] int64 device pointers (Layer's fields in order); scratch: fp32, zero before
// the first run (the kernel leaves its accumulators zero but z_acc, which holds the output:
// run's return value is that view).
torch::Tensor run(torch::Tensor layers, torch::Tensor x0, torch::Tensor res0, torch::Tensor scratch,
                  torch::Tensor ids_out, torch::Tensor barrier, double eps, int64_t prefetch_bytes, int64_t variant,
                  torch::Tensor timeline) {
  TORCH_CHECK(layers.is_cuda() && layers.scalar_type() == torch::kInt64 && layers.dim() == 2 && layers.size(1) == 7,
              "layers must be [L, 7] int64 on the GPU");
  TORCH_CHECK(x0.is_cuda() && x0.scalar_type() == torch::kBFloat16 && x0.numel() == V, "x0 must be [", V, "] bf16");
  TORCH_CHECK(res0.is_cuda() && res0.scalar_type() == torch::kFloat32 && res0.numel() == H, "res0 must be [", H,
              "] fp32");
  const int64_t grid = resident_grid(variant);
  const int64_t need = 3 * H + (E + 1) + P * kGateUpRows + H * P + N + grid;
  TORCH_CHECK(scratch.is_cuda() && scratch.scalar_type() == torch::kFloat32 && scratch.numel() >= need,
              "scratch must hold ", need, " fp32");
  TORCH_CHECK(ids_out.scalar_type() == torch::kInt32 && ids_out.numel() >= layers.size(0) * P, "ids_out: [L, ", P,
              "] int32");
  TORCH_CHECK(barrier.scalar_type() == torch::kInt32 && barrier.numel() >= 2 + 10 * layers.size(0),
              "barrier: 2 + 10 L int32 (the grid barrier's count and the claims' counters)");
  TORCH_CHECK(timeline.numel() == 0 ||
                  (timeline.scalar_type() == torch::kInt64 && timeline.numel() >= layers.size(0) * 18),
              "timeline: empty or [L, 6, 3] int64");
  Params p;
  p.layers = reinterpret_cast<const Layer*>(layers.data_ptr<int64_t>());
  p.num_layers = static_cast<int>(layers.size(0));
  p.eps = static_cast<float>(eps);
  p.x0 = reinterpret_cast<const bf16*>(x0.data_ptr());
  p.res0 = res0.data_ptr<float>();
  float* f = scratch.data_ptr<float>();
  p.res[0] = f, f += H;
  p.res[1] = f, f += H;
  p.d_acc = f, f += H;
  p.logit_acc = f, f += E + 1;
  p.gu_acc = f, f += P * kGateUpRows;
  p.down_acc = f, f += H * P;
  p.z_acc = f, f += N;
  p.sumsq = f;
  p.ids_out = ids_out.data_ptr<int>();
  p.barrier = reinterpret_cast<unsigned*>(barrier.data_ptr<int>());
  p.prefetch_bytes = static_cast<int>(prefetch_bytes);
  p.timeline = timeline.numel() > 0 ? reinterpret_cast<unsigned long long*>(timeline.data_ptr<int64_t>()) : nullptr;
  auto stream = at::cuda::getCurrentCUDAStream();
  p.claims = reinterpret_cast<unsigned long long*>(barrier.data_ptr<int>() + 2);
  C10_CUDA_CHECK(cudaMemsetAsync(p.barrier, 0, sizeof(int) * (2 + 10 * layers.size(0)), stream));
  kVariants[variant]<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(p);
  C10_CUDA_CHECK(cudaGetLastError());
  const int64_t z_offset = 3 * H + (E + 1) + P * kGateUpRows + H * P;
  return scratch.narrow(0, z_offset, N);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run);
  m.def("resident_grid", &resident_grid);
  m.attr("variants") = kNumVariants;
  m.attr("H") = H;
  m.attr("V") = V;
  m.attr("I") = I;
  m.attr("E") = E;
  m.attr("K") = K;
  m.attr("N") = N;
}
