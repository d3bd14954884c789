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
// One CTA an SM (the grid is what the GPU holds at once, so grid barriers cannot deadlock).
// In each CTA a producer thread streams the CTA's share of every matmul's weight rows, in the
// order the matmuls run, through a ring of shared-memory stages with bulk copies (the Hopper
// copy engine: many bytes in flight for one thread's instructions), and runs ahead of the
// consumers across grid barriers, as far as the ring and the routing allow: the next matmul's
// first rows are in shared memory when the barrier before it opens. Consumer warps take whole
// rows (a row's dot in one warp, written once: no atomics, a fixed order). A CTA's share of the
// gate_up rows is a slice of every pick's, the shared expert's first: those stream before the
// routing is known. The work between matmuls (norms, top-k, SiLU) runs in every CTA on what it
// needs, read from L2, so only the matmuls' outputs need a grid barrier.
//
// (A first design, warps streaming with loads into registers and adding row sums with atomics,
// ran slower than the engine's kernels: benchmarks/persistent_span_h200.json at eeacb99.)
//
// Shapes are the 35B-A3B's, fixed at compile time.

#include <torch/extension.h>

#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>

#include <cstdint>

namespace {

using bf16 = __nv_bfloat16;

constexpr int H = 2048, V = 4096, I = 512, E = 256, K = 8, P = K + 1, N = 12352;  // P picks: K routed + shared
constexpr int kConsumerWarps = 16, kConsumers = kConsumerWarps * 32, kThreads = kConsumers + 32;
constexpr int kStageBytes = 16384;
constexpr int kGateUpRows = 2 * I, kRouterRows = E + 1;

struct Layer {
  const char* out_proj;  // [H, V]
  const char* router;    // [E + 1, H] (the shared expert's gate last)
  const char* gate_up;   // [E + 1, 2I, H] (the shared expert last)
  const char* down;      // [E + 1, H, I]
  const char* in_proj;   // [N, H]
  const bf16* norm1;     // [H] zero-centred: scale 1 + w
  const bf16* norm2;     // [H]
};

struct Params {
  const Layer* layers;
  int num_layers;
  float eps;
  const bf16* x0;     // [V] the first layer's out_proj input
  const float* res0;  // [H] the first residual
  float* res[2];      // [H] residuals after layer l: res[(l + 1) % 2]
  float* d;           // [H] out_proj's output, rounded to bf16
  float* logits;      // [E + 1]
  float* gu;          // [P, 2I] in pick order (pick j's gate rows, then its up rows)
  float* dn;          // [H, P] each pick's down output
  float* z;           // [N] in_proj's output: the kernel's after the last layer
  float* sumsq;       // [gridDim.x] each CTA's part of the second norm's sum of squares
  int* ids_out;       // [layers, P] the routing, for the check
  unsigned* barrier;  // zero at launch
  int prefetch_bytes;  // of its in_proj share, pulled into L2 while the producer waits for the routing
  unsigned long long* timeline = nullptr;  // null, or [layers, 6, 3] ns: see grid_barrier
};

// The matmuls of a layer, in the order they run and stream.
enum Phase { kOutProj, kRouter, kGateUp, kDown, kInProj, kNumPhases };

__host__ __device__ constexpr int row_bytes(int phase) {
  return phase == kOutProj ? V * 2 : phase == kDown ? I * 2 : H * 2;
}
__host__ __device__ constexpr int rows_per_stage(int phase) { return kStageBytes / row_bytes(phase); }
constexpr int kStageRows = rows_per_stage(kDown);  // the most rows a stage holds

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

// The consumer warps' own barrier: the producer warp never waits on one.
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"r"(kConsumers) : "memory"); }

// The consumers' sum of v, the same in every CTA for the same inputs.
__device__ float consumer_sum(float v, float* scratch) {
  v = warp_sum(v);
  consumer_sync();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  consumer_sync();
  float t = 0.0f;
  for (int w = 0; w < kConsumerWarps; ++w) t += scratch[w];
  return t;
}

// -- mbarriers and bulk copies (sm_90 PTX) --------------------------------------------------------

__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(smem(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem(bar)), "r"(parity)
        : "memory");
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem(dst)),
               "l"(src), "r"(bytes), "r"(smem(bar))
               : "memory");
}

__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// -- grid barrier ---------------------------------------------------------------------------------

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

// Every CTA's consumers arrive before any leave; `target` counts arrivals over the launch.
// `times`: null, or three timeline entries: the first and the last CTA's arrival (atomicMin /
// atomicMax, starting at INT64_MAX / 0) and CTA 0's departure.
__device__ void grid_barrier(unsigned* counter, unsigned& target, unsigned long long* times) {
  target += gridDim.x;
  consumer_sync();
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
  consumer_sync();
}

// -- who streams what -----------------------------------------------------------------------------

// The CTA's rows of a phase: [begin, end) in the phase's row numbering (gate_up: row j 2I + r
// of pick j; down: row h P + j, pick j's row h). Gate_up and down are a slice of every pick's
// rows, visited pick by pick (gate_up's shared pick first): `slot` counts the CTA's rows,
// row_at maps it to a phase row.
struct Share {
  int begin, end;  // gate_up: the slice [begin, end) of each pick's 2I rows
  int count;       // rows the CTA streams in the phase
};

__device__ __forceinline__ Share share(int phase) {
  const int c = blockIdx.x, g = gridDim.x;
  const int rows = phase == kOutProj ? H : phase == kRouter ? kRouterRows : phase == kGateUp ? kGateUpRows
                                                          : phase == kDown ? H : N;
  Share s{c * rows / g, (c + 1) * rows / g, 0};
  s.count = (s.end - s.begin) * (phase == kGateUp || phase == kDown ? P : 1);
  return s;
}

// The phase row of the CTA's slot-th row.
__device__ __forceinline__ int row_at(int phase, const Share& s, int slot) {
  if (phase == kGateUp) {  // the shared pick (P - 1) first, then picks 0 .. K - 1
    const int n = s.end - s.begin, j = (slot / n + P - 1) % P;
    return j * kGateUpRows + s.begin + slot % n;
  }
  if (phase == kDown) {  // pick by pick: a pick's rows h are contiguous in its weights
    const int n = s.end - s.begin;
    return (s.begin + slot % n) * P + slot / n;
  }
  return s.begin + slot;
}

// Where a phase row's weights are.
__device__ __forceinline__ const char* row_src(const Layer& L, int phase, int row, const int* ids) {
  switch (phase) {
    case kOutProj: return L.out_proj + static_cast<int64_t>(row) * row_bytes(kOutProj);
    case kRouter: return L.router + static_cast<int64_t>(row) * row_bytes(kRouter);
    case kGateUp: {
      const int j = row / kGateUpRows;
      return L.gate_up + (static_cast<int64_t>(ids[j]) * kGateUpRows + row % kGateUpRows) * row_bytes(kGateUp);
    }
    case kDown: {
      const int h = row / P, j = row % P;
      return L.down + (static_cast<int64_t>(ids[j]) * H + h) * row_bytes(kDown);
    }
    default: return L.in_proj + static_cast<int64_t>(row) * row_bytes(kInProj);
  }
}

// The producer: every phase's rows of every layer, in order, into the ring. Gate_up's routed
// picks (and down) wait until the consumers have routed the layer's token (ids_layer).
template <int S>
__device__ void produce(const Params& p, char* ring, uint64_t* full, uint64_t* empty, const int* ids,
                        const volatile int* ids_layer) {
  unsigned fill = 0;
  for (int l = 0; l < p.num_layers; ++l) {
    const Layer L = p.layers[l];
    for (int phase = 0; phase < kNumPhases; ++phase) {
      const Share s = share(phase);
      const int per = rows_per_stage(phase), known = phase == kGateUp ? s.end - s.begin : 0;
      for (int slot = 0; slot < s.count; slot += per, ++fill) {
        if ((phase == kGateUp && slot + per > known) || phase == kDown) {
          if (*ids_layer < l) {
            if (p.prefetch_bytes && phase == kGateUp) {  // the bus is idle until the routing: in_proj into L2
              const Share in = share(kInProj);
              const int bytes = min(p.prefetch_bytes, (in.end - in.begin) * row_bytes(kInProj));
              if (bytes > 0) prefetch_l2(L.in_proj + static_cast<int64_t>(in.begin) * row_bytes(kInProj), bytes);
            }
            while (*ids_layer < l) {
            }
            __threadfence_block();  // ids is read after the flag
          }
        }
        const int stage = fill % S;
        if (fill >= S) mbar_wait(empty + stage, (fill / S - 1) & 1);
        const int n = min(per, s.count - slot);
        mbar_arrive(empty + stage, kStageRows - n);  // the rows no consumer will take
        mbar_expect(full + stage, n * row_bytes(phase));
        for (int i = 0; i < n;) {  // one copy a run of rows contiguous in memory
          const char* src = row_src(L, phase, row_at(phase, s, slot + i), ids);
          int run = 1;
          while (i + run < n && row_src(L, phase, row_at(phase, s, slot + i + run), ids) == src + run * row_bytes(phase))
            ++run;
          bulk_copy(ring + stage * kStageBytes + i * row_bytes(phase), src, run * row_bytes(phase), full + stage);
          i += run;
        }
      }
    }
  }
}

// The consumers' part of a phase: row i of the CTA's by warp i % kConsumerWarps, which waits
// for its fill, writes the row's output rounded to bf16 into out[row] and frees its share of
// the stage (a stage's empty barrier counts its rows; the producer arrives for a short fill's
// missing ones). x(row, c) is the input chunk a weight chunk c of the row meets.
template <int S, typename X>
__device__ void consume(int phase, char* ring, uint64_t* full, uint64_t* empty, unsigned& fill, float* out,
                        const X& x) {
  const Share s = share(phase);
  const int per = rows_per_stage(phase), chunks = row_bytes(phase) / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = warp; i < s.count; i += kConsumerWarps) {
    const unsigned f = fill + i / per;
    const int stage = f % S;
    mbar_wait(full + stage, (f / S) & 1);
    const uint4* w = reinterpret_cast<const uint4*>(ring + stage * kStageBytes + (i % per) * row_bytes(phase));
    const int row = row_at(phase, s, i);
    float acc = 0.0f;
    for (int c = lane; c < chunks; c += 32) acc += dot8(w[c], x(row, c));
    acc = warp_sum(acc);
    if (lane == 0) {
      out[row] = bf(acc);
      mbar_arrive(empty + stage);
    }
  }
  fill += (s.count + per - 1) / per;
}

template <int S>
__global__ void __launch_bounds__(kThreads, 1) persistent_span_kernel(Params p) {
  extern __shared__ __align__(128) char ring[];  // S stages of kStageBytes
  __shared__ __align__(16) bf16 xs[P * I > V ? P * I : V];  // the current matmul's input row
  __shared__ float s[H];                                  // the residual after attention
  __shared__ float scratch[kConsumerWarps];
  __shared__ int ids[P];
  __shared__ float weights[P];
  __shared__ volatile int ids_layer;  // the layer whose routing ids holds
  __shared__ __align__(8) uint64_t full[S], empty[S];
  const uint4* xs4 = reinterpret_cast<const uint4*>(xs);
  const int t = threadIdx.x, cta = blockIdx.x, grid = gridDim.x;

  if (t == 0) {
    for (int i = 0; i < S; ++i) {
      mbar_init(full + i, 1);                // the producer's expect_tx arrival
      mbar_init(empty + i, kStageRows);  // once a row: see consume
    }
    ids[P - 1] = E;  // the shared expert: known before any routing
    ids_layer = -1;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (t >= kConsumers) {
    if (t == kConsumers) produce<S>(p, ring, full, empty, ids, &ids_layer);
    return;
  }

  unsigned target = 0, fill = 0;
  const auto x_dense = [&](int, int c) { return xs4[c]; };
  for (int l = 0; l < p.num_layers; ++l) {
    const Layer L = p.layers[l];
    const float* res_in = l == 0 ? p.res0 : p.res[l % 2];
    float* res_out = p.res[(l + 1) % 2];
    unsigned long long* times = p.timeline ? p.timeline + l * 6 * 3 : nullptr;

    // out_proj: x is the first layer's input, else the last in_proj's first V outputs
    for (int i = t; i < V; i += kConsumers) xs[i] = l == 0 ? p.x0[i] : __float2bfloat16(__ldcg(p.z + i));
    consumer_sync();
    consume<S>(kOutProj, ring, full, empty, fill, p.d, x_dense);
    grid_barrier(p.barrier, target, times ? times + 0 : nullptr);

    // add + norm (every CTA the whole row), then the router
    float sq = 0.0f;
    for (int i = t; i < H; i += kConsumers) {
      s[i] = res_in[i] + __ldcg(p.d + i);
      sq += s[i] * s[i];
    }
    float inv = rsqrtf(consumer_sum(sq, scratch) / H + p.eps);
    for (int i = t; i < H; i += kConsumers) xs[i] = __float2bfloat16(s[i] * inv * (1.0f + __bfloat162float(L.norm1[i])));
    consumer_sync();
    consume<S>(kRouter, ring, full, empty, fill, p.logits, x_dense);
    grid_barrier(p.barrier, target, times ? times + 3 : nullptr);

    // top-k (warp 0): softmax over the routed experts, the k largest, renormalised, bf16
    if (t < 32) {
      float v[E / 32];
      for (int i = 0; i < E / 32; ++i) v[i] = __ldcg(p.logits + t + 32 * i);
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
          if (v[i] > best) best = v[i], at = i;
        const float top = warp_max(best);
        const int who = __ffs(__ballot_sync(0xffffffffu, best == top)) - 1;
        const int i_top = __shfl_sync(0xffffffffu, at, who);
        if (t == who) {
          for (int i = 0; i < E / 32; ++i)
            if (i == i_top) v[i] = -1.0f;  // no dynamic index: v stays in registers
        }
        if (t == 0) ids[k] = who + 32 * i_top, weights[k] = top / sum;
        picked += top / sum;
      }
      __syncwarp();
      if (t < K) weights[t] = bf(weights[t] / picked);
      if (t == 0) {
        weights[K] = bf(1.0f / (1.0f + expf(-__ldcg(p.logits + E))));
        for (int j = 0; j < P; ++j) p.ids_out[l * P + j] = ids[j];
        __threadfence_block();
        ids_layer = l;  // the producer may stream the routed experts
      }
    }
    consumer_sync();
    consume<S>(kGateUp, ring, full, empty, fill, p.gu, x_dense);
    grid_barrier(p.barrier, target, times ? times + 6 : nullptr);

    // SiLU(gate) * up of every pick (every CTA the whole of it), then down
    for (int i = t; i < P * I; i += kConsumers) {
      const int j = i / I, r = i % I;
      const float g = __ldcg(p.gu + j * kGateUpRows + r), u = __ldcg(p.gu + j * kGateUpRows + I + r);
      xs[i] = __float2bfloat16(bf(g / (1.0f + expf(-g))) * u);
    }
    consumer_sync();
    consume<S>(kDown, ring, full, empty, fill, p.dn, [&](int row, int c) { return xs4[row % P * (I / 8) + c]; });
    grid_barrier(p.barrier, target, times ? times + 9 : nullptr);

    // the weighted sum and the residual add: the CTA's slice of H, its part of the sum of squares
    sq = 0.0f;
    for (int i = cta * H / grid + t; i < (cta + 1) * H / grid; i += kConsumers) {
      float out = 0.0f;
      for (int j = 0; j < P; ++j) out += weights[j] * __ldcg(p.dn + i * P + j);
      const float s2 = s[i] + bf(out);
      res_out[i] = s2;
      sq += s2 * s2;
    }
    sq = consumer_sum(sq, scratch);
    if (t == 0) p.sumsq[cta] = sq;
    grid_barrier(p.barrier, target, times ? times + 12 : nullptr);

    // the next layer's input norm (every CTA the whole row), then in_proj
    sq = 0.0f;
    for (int i = t; i < grid; i += kConsumers) sq += __ldcg(p.sumsq + i);
    inv = rsqrtf(consumer_sum(sq, scratch) / H + p.eps);
    for (int i = t; i < H; i += kConsumers)
      xs[i] = __float2bfloat16(__ldcg(res_out + i) * inv * (1.0f + __bfloat162float(L.norm2[i])));
    consumer_sync();
    consume<S>(kInProj, ring, full, empty, fill, p.z, x_dense);
    if (l + 1 < p.num_layers) grid_barrier(p.barrier, target, times ? times + 15 : nullptr);
  }
}

// The variants bench/persistent_span.py compares: the ring's stages.
using Kernel = void (*)(Params);
constexpr Kernel kVariants[] = {persistent_span_kernel<12>, persistent_span_kernel<6>};
constexpr int kStages[] = {12, 6};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

size_t dynamic_smem(int variant) { return static_cast<size_t>(kStages[variant]) * kStageBytes; }

// The grid that fits the GPU at once for a variant: its CTAs an SM (1) x SMs.
int64_t resident_grid(int64_t variant) {
  TORCH_CHECK(variant >= 0 && variant < kNumVariants, "variant must be in [0, ", kNumVariants, ")");
  int per_sm = 0, device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t bytes = dynamic_smem(static_cast<int>(variant));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kVariants[variant], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kVariants[variant], kThreads, bytes));
  TORCH_CHECK(per_sm >= 1, "the kernel does not fit an SM");
  return static_cast<int64_t>(per_sm) * sms;
}

// layers: [L, 7] int64 device pointers (Layer's fields in order); timeline: empty or [L, 6, 3]
// int64 (Params::timeline). Returns the output, z: a view of scratch.
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
  TORCH_CHECK(barrier.scalar_type() == torch::kInt32 && barrier.numel() >= 1, "barrier: one int32");
  TORCH_CHECK(timeline.numel() == 0 || (timeline.scalar_type() == torch::kInt64 && timeline.numel() >= layers.size(0) * 18),
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
  p.d = f, f += H;
  p.logits = f, f += E + 1;
  p.gu = f, f += P * kGateUpRows;
  p.dn = f, f += H * P;
  p.z = f, f += N;
  p.sumsq = f;
  p.ids_out = ids_out.data_ptr<int>();
  p.barrier = reinterpret_cast<unsigned*>(barrier.data_ptr<int>());
  p.prefetch_bytes = static_cast<int>(prefetch_bytes);
  p.timeline = timeline.numel() > 0 ? reinterpret_cast<unsigned long long*>(timeline.data_ptr<int64_t>()) : nullptr;
  auto stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemsetAsync(p.barrier, 0, sizeof(unsigned), stream));
  kVariants[variant]<<<static_cast<unsigned>(grid), kThreads, dynamic_smem(static_cast<int>(variant)), stream>>>(p);
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
