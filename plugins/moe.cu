// Routed experts (semantics in moe.h).
//
// Sort. One CTA counts the slots of each expert in shared memory, scans the counts into slot
// offsets and chunk offsets (an expert's slots split into chunks of up to 8 NT), writes one
// descriptor per chunk (expert, first position, slot count) and places every slot with a
// shared atomic. The order inside an expert depends on those atomics; no result does, since
// each slot's dot products are computed on their own, in an order fixed by the shapes (so a
// token's output is also the same whatever other tokens share its pass).
//
// Projections. A CTA takes one chunk and a tile of output rows of that chunk's expert; its
// warps (8 for gate_up, 4 for down) split the reduction (K) dimension, and each applies the
// tile's weight rows to the chunk's slots with mma.sync: rows are M, slots N (8 per MMA), fp32
// accumulators, the weights read once per chunk (mma_tile.h: the fragment layout, and fp32's
// three TF32 MMAs).
//
// This file has no torch dependency: it compiles alone with
//   nvcc -std=c++17 -arch=sm_90 -c moe.cu

#include "moe.h"

#include "float_convert.h"
#include "mma_tile.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace dflash {
namespace {

using mma_tile::sum_warps;
using mma_tile::warp_tile;

constexpr int kSortThreads = 1024;
// Warps per projection CTA, splitting K. gate_up's K (H) is two to four times down's (I): with
// twice the warps its CTAs keep as many loads in flight per row as down's, which counts when a
// decode step picks few experts and the grid is small.
constexpr int kGateUpWarps = 8;
constexpr int kDownWarps = 4;
constexpr int kTileTokens = 8;  // an MMA's N
constexpr int kMaxGridY = 65535;

// Where the sort's outputs live in the work buffer (ints); ends first, so that it is 16-byte
// aligned as a GEMM's offsets may need to be.
struct Layout {
  int64_t ends = 0;        // [E] cumulative slot counts
  int64_t num_chunks = 0;  // [1]
  int64_t order = 0;       // [S] slots grouped by expert
  int64_t rows = 0;        // [S] position of each slot in order
  int64_t chunks = 0;      // [max_chunks] int4 (expert, first position, count, unused), 16-byte aligned
  int64_t total = 0;
};

Layout layout(int64_t slots, int64_t experts, int64_t max_chunks) {
  Layout l;
  l.num_chunks = experts;
  l.order = experts + 1;
  l.rows = l.order + slots;
  l.chunks = (l.rows + slots + 3) / 4 * 4;
  l.total = l.chunks + 4 * max_chunks;
  return l;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// n-tiles per chunk: 2 (16 slots, half the weight reads of an expert with many) once the
// slots average 8 per expert, else 1.
int tiles_per_chunk(const MoeParams& p) {
  return static_cast<int64_t>(p.tokens) * p.top_k >= static_cast<int64_t>(kTileTokens) * p.experts ? 2 : 1;
}

// The most chunks any routing of S slots over E experts makes (chunks of c slots): every
// chunk holds a slot, and each active expert leaves at most c - 1 empty places.
int64_t max_chunks(int64_t slots, int64_t experts, int64_t c) {
  const int64_t active = std::min(experts, slots);
  return std::min(slots, (slots + active * (c - 1)) / c);
}

// --------------------------------------------------------------------------------------------
// Sort

struct SortArgs {
  int slots = 0;
  int experts = 0;
  int chunk = 0;  // slots per chunk; 0: no chunk list
  const int32_t* ids = nullptr;
  int32_t* order = nullptr;
  int32_t* rows = nullptr;
  int32_t* ends = nullptr;
  int32_t* num_chunks = nullptr;
  int4* chunks = nullptr;
};

__device__ __forceinline__ int bucket(int id, int experts) { return id >= 0 && id < experts ? id : experts; }

__global__ void __launch_bounds__(kSortThreads) moe_sort_kernel(SortArgs a) {
  extern __shared__ int smem[];
  const int E = a.experts;
  int* count = smem;                // [E + 1]; bucket E holds the ids outside [0, E)
  int* next = count + E + 1;        // [E + 1]: the next free position of each bucket
  int* first_chunk = next + E + 1;  // [E]
  for (int e = threadIdx.x; e <= E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < a.slots; s += blockDim.x) atomicAdd(&count[bucket(a.ids[s], E)], 1);
  __syncthreads();

  if (threadIdx.x < 32) {  // exclusive scans of the slot and chunk counts, 32 buckets at a time
    const int lane = threadIdx.x;
    int slot_base = 0, chunk_base = 0;
    for (int e0 = 0; e0 <= E; e0 += 32) {
      const int e = e0 + lane;
      const int c = e <= E ? count[e] : 0;
      const int nc = e < E && a.chunk > 0 ? (c + a.chunk - 1) / a.chunk : 0;
      int cs = c, ns = nc;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int cu = __shfl_up_sync(0xffffffffu, cs, o), nu = __shfl_up_sync(0xffffffffu, ns, o);
        if (lane >= o) cs += cu, ns += nu;
      }
      if (e <= E) next[e] = slot_base + cs - c;
      if (e < E) {
        first_chunk[e] = chunk_base + ns - nc;
        a.ends[e] = slot_base + cs;
      }
      slot_base += __shfl_sync(0xffffffffu, cs, 31);
      chunk_base += __shfl_sync(0xffffffffu, ns, 31);
    }
    if (lane == 0) *a.num_chunks = chunk_base;
  }
  __syncthreads();

  if (a.chunk > 0) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const int begin = next[e], end = begin + count[e];
      int4* dst = a.chunks + first_chunk[e];
      for (int pos = begin; pos < end; pos += a.chunk) *dst++ = make_int4(e, pos, min(a.chunk, end - pos), 0);
    }
    __syncthreads();  // the placing below moves next[]
  }
  for (int s = threadIdx.x; s < a.slots; s += blockDim.x) {
    const int pos = atomicAdd(&next[bucket(a.ids[s], E)], 1);
    a.order[pos] = s;
    a.rows[s] = pos;
  }
}

template <typename T>
__device__ __forceinline__ T to_dtype(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return from_float<T>(x);
}

template <typename T>
__device__ __forceinline__ float rounded(float x) { return to_float(to_dtype<T>(x)); }

// The chunk of this CTA (blockIdx.y), or false past the routed work.
__device__ __forceinline__ bool read_chunk(const int32_t* work, const Layout& l, int4& chunk) {
  if (static_cast<int>(blockIdx.y) >= work[l.num_chunks]) return false;
  chunk = reinterpret_cast<const int4*>(work + l.chunks)[blockIdx.y];
  return true;
}

// act[slot, r] for the 16 intermediate rows r of tile blockIdx.x: gate rows r, up rows I + r.
template <typename T, int NT>
__global__ void __launch_bounds__(kGateUpWarps * 32) moe_gate_up_kernel(MoeParams p, Layout l) {
  __shared__ float part[kGateUpWarps - 1][2][NT][4][32];
  int4 chunk;
  if (!read_chunk(p.work, l, chunk)) return;
  const int e = chunk.x, first = chunk.y, count = chunk.z;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int I = p.inter, row0 = blockIdx.x * 16;
  const int64_t chunks = static_cast<int64_t>(p.hidden) * sizeof(T) / 16;
  const uint4* w = static_cast<const uint4*>(p.gate_up) + static_cast<int64_t>(e) * 2 * I * chunks;
  const uint4* a[4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows past I read row I - 1 again and are never written
    const int r = min(row0 + g + 8 * h, I - 1);
    a[h] = w + static_cast<int64_t>(r) * chunks;
    a[2 + h] = w + static_cast<int64_t>(I + r) * chunks;
  }
  const int32_t* order = p.work + l.order;
  const uint4* b[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int col = 8 * n + g;
    b[n] = col < count ? static_cast<const uint4*>(p.x) + static_cast<int64_t>(order[first + col] / p.top_k) * chunks
                       : nullptr;
  }
  float acc[2][NT][4] = {};
  warp_tile<T, kGateUpWarps, 2, NT>(a, b, chunks, threadIdx.x / 32, acc);
  if (!sum_warps<kGateUpWarps, 2, NT>(acc, part)) return;

  T* act = static_cast<T*>(p.act);
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + g + 8 * (i / 2), col = 8 * n + 2 * t + i % 2;
      if (row >= I || col >= count) continue;
      // as the reference: gate and up rounded, torch's silu x / (1 + exp(-x)) rounded, the product rounded
      const float gate = rounded<T>(acc[0][n][i]), up = rounded<T>(acc[1][n][i]);
      const float silu = rounded<T>(gate / (1.0f + expf(-gate)));
      act[static_cast<int64_t>(order[first + col]) * I + row] = to_dtype<T>(__fmul_rn(silu, up));
    }
  }
}

// y[slot, h] for the 32 rows h of tile blockIdx.x.
template <typename T, int NT>
__global__ void __launch_bounds__(kDownWarps * 32) moe_down_kernel(MoeParams p, Layout l) {
  __shared__ float part[kDownWarps - 1][2][NT][4][32];
  int4 chunk;
  if (!read_chunk(p.work, l, chunk)) return;
  const int e = chunk.x, first = chunk.y, count = chunk.z;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int H = p.hidden, row0 = blockIdx.x * 32;
  const int64_t chunks = static_cast<int64_t>(p.inter) * sizeof(T) / 16;
  const uint4* w = static_cast<const uint4*>(p.down) + static_cast<int64_t>(e) * H * chunks;
  const uint4* a[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = w + static_cast<int64_t>(min(row0 + g + 8 * r, H - 1)) * chunks;
  const int32_t* order = p.work + l.order;
  const uint4* b[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int col = 8 * n + g;
    b[n] = col < count ? static_cast<const uint4*>(p.act) + static_cast<int64_t>(order[first + col]) * chunks
                       : nullptr;
  }
  float acc[2][NT][4] = {};
  warp_tile<T, kDownWarps, 2, NT>(a, b, chunks, threadIdx.x / 32, acc);
  if (!sum_warps<kDownWarps, 2, NT>(acc, part)) return;

  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + 16 * m + g + 8 * (i / 2), col = 8 * n + 2 * t + i % 2;
        if (row < H && col < count) y[static_cast<int64_t>(order[first + col]) * H + row] = to_dtype<T>(acc[m][n][i]);
      }
    }
  }
}

// --------------------------------------------------------------------------------------------
// Weighted sum: a thread per 16 bytes of a y row (V elements), the k picks added in order.

constexpr int kCombineThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(MoeCombineParams p) {
  constexpr int V = 16 / sizeof(T);
  const int64_t per_row = p.hidden / V, total = static_cast<int64_t>(p.tokens) * per_row;
  const T* y = static_cast<const T*>(p.y);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t tok = i / per_row, c = (i % per_row) * V;
    float acc[V] = {};
    for (int j = 0; j < p.top_k; ++j) {
      const int64_t s = tok * p.top_k + j;
      const int e = p.ids[s];
      if (e < 0 || e >= p.experts) continue;
      const float w = p.weights[s];
      const int64_t row = p.rows != nullptr ? p.rows[s] : s;
      const uint4 raw = *reinterpret_cast<const uint4*>(y + row * p.hidden + c);
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = __fadd_rn(acc[k], __fmul_rn(w, to_float(v[k])));  // product, then sum
    }
    float4* dst = reinterpret_cast<float4*>(p.out + tok * p.hidden + c);
#pragma unroll
    for (int k = 0; k < V / 4; ++k) dst[k] = make_float4(acc[4 * k], acc[4 * k + 1], acc[4 * k + 2], acc[4 * k + 3]);
  }
}

template <typename T>
cudaError_t combine_typed(const MoeCombineParams& p, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(p.tokens) * (p.hidden / (16 / sizeof(T)));
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(threads, kCombineThreads), 65536));
  moe_combine_kernel<T><<<blocks, kCombineThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t combine_any(const MoeCombineParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kBFloat16: return combine_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return combine_typed<__half>(p, stream);
    default: return combine_typed<float>(p, stream);
  }
}

cudaError_t sort_any(const SortArgs& a, cudaStream_t stream) {
  const size_t smem = (3 * static_cast<size_t>(a.experts) + 2) * sizeof(int);
  moe_sort_kernel<<<1, kSortThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

SortArgs sort_args(int32_t* work, const Layout& l, int slots, int experts, const int32_t* ids, int chunk) {
  SortArgs a;
  a.slots = slots;
  a.experts = experts;
  a.chunk = chunk;
  a.ids = ids;
  a.order = work + l.order;
  a.rows = work + l.rows;
  a.ends = work + l.ends;
  a.num_chunks = work + l.num_chunks;
  a.chunks = chunk > 0 ? reinterpret_cast<int4*>(work + l.chunks) : nullptr;
  return a;
}

template <typename T, int NT>
cudaError_t project(const MoeParams& p, const Layout& l, int64_t chunks, cudaStream_t stream) {
  const dim3 gate_up_grid(static_cast<unsigned>(ceil_div(p.inter, 16)), static_cast<unsigned>(chunks));
  const dim3 down_grid(static_cast<unsigned>(ceil_div(p.hidden, 32)), static_cast<unsigned>(chunks));
  moe_gate_up_kernel<T, NT><<<gate_up_grid, kGateUpWarps * 32, 0, stream>>>(p, l);
  moe_down_kernel<T, NT><<<down_grid, kDownWarps * 32, 0, stream>>>(p, l);
  return cudaGetLastError();
}

template <typename T>
cudaError_t project_typed(const MoeParams& p, const Layout& l, int64_t chunks, int tiles, cudaStream_t stream) {
  return tiles == 2 ? project<T, 2>(p, l, chunks, stream) : project<T, 1>(p, l, chunks, stream);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

bool known_dtype(DType d) { return d == DType::kBFloat16 || d == DType::kFloat16 || d == DType::kFloat32; }

int64_t launch_chunks(const MoeParams& p) {
  const int64_t slots = static_cast<int64_t>(p.tokens) * p.top_k;
  return max_chunks(slots, p.experts, static_cast<int64_t>(kTileTokens) * tiles_per_chunk(p));
}

}  // namespace

int64_t moe_work_ints(const MoeParams& p) {
  const int64_t slots = static_cast<int64_t>(p.tokens) * p.top_k;
  return layout(slots, p.experts, launch_chunks(p)).total;
}

const char* moe_check(const MoeParams& p) {
  if (!known_dtype(p.dtype)) return "dtype must be bf16, fp16 or fp32";
  if (p.tokens < 0 || p.top_k < 0) return "tokens and top_k must be non-negative";
  if (p.experts < 1 || p.experts > kMoeMaxExperts) return "experts must be in [1, 2048]";
  if (p.hidden < 8 || p.hidden % 8 != 0 || p.inter < 8 || p.inter % 8 != 0)
    return "hidden and inter must be positive multiples of 8";
  const int64_t slots = static_cast<int64_t>(p.tokens) * p.top_k;
  if (slots > (int64_t{1} << 30)) return "too many slots (tokens * top_k)";
  if (launch_chunks(p) > kMaxGridY) return "too many slots for one launch";
  if (p.tokens == 0) return nullptr;
  if (!p.out || !aligned16(p.out)) return "out must be 16-byte aligned";
  if (slots == 0) return nullptr;
  const void* const buffers[] = {p.x, p.gate_up, p.down, p.work, p.act, p.y};
  for (const void* ptr : buffers)
    if (ptr == nullptr || !aligned16(ptr)) return "x, gate_up, down, work, act and y must be 16-byte aligned";
  if (!p.weights || !p.ids) return "null pointer";
  return nullptr;
}

cudaError_t moe_launch(const MoeParams& p, cudaStream_t stream) {
  if (moe_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  const int slots = p.tokens * p.top_k;
  if (slots == 0)
    return cudaMemsetAsync(p.out, 0, static_cast<size_t>(p.tokens) * p.hidden * sizeof(float), stream);
  const int tiles = tiles_per_chunk(p);
  const int64_t chunks = launch_chunks(p);
  const Layout l = layout(slots, p.experts, chunks);
  cudaError_t err = sort_any(sort_args(p.work, l, slots, p.experts, p.ids, kTileTokens * tiles), stream);
  if (err != cudaSuccess) return err;
  switch (p.dtype) {
    case DType::kBFloat16: err = project_typed<__nv_bfloat16>(p, l, chunks, tiles, stream); break;
    case DType::kFloat16: err = project_typed<__half>(p, l, chunks, tiles, stream); break;
    default: err = project_typed<float>(p, l, chunks, tiles, stream); break;
  }
  if (err != cudaSuccess) return err;
  MoeCombineParams c;
  c.dtype = p.dtype;
  c.tokens = p.tokens;
  c.top_k = p.top_k;
  c.experts = p.experts;
  c.hidden = p.hidden;
  c.y = p.y;
  c.weights = p.weights;
  c.ids = p.ids;
  c.out = p.out;
  return combine_any(c, stream);
}

int64_t moe_sort_work_ints(const MoeSortParams& p) { return layout(p.slots, p.experts, 0).total; }

const char* moe_sort_check(const MoeSortParams& p) {
  if (p.slots < 0) return "slots must be non-negative";
  if (p.experts < 1 || p.experts > kMoeMaxExperts) return "experts must be in [1, 2048]";
  if (p.slots > 0 && (!p.ids || !p.work)) return "null pointer";
  return nullptr;
}

cudaError_t moe_sort_launch(const MoeSortParams& p, cudaStream_t stream) {
  if (moe_sort_check(p) != nullptr) return cudaErrorInvalidValue;
  const Layout l = layout(p.slots, p.experts, 0);
  return sort_any(sort_args(p.work, l, p.slots, p.experts, p.ids, 0), stream);
}

const char* moe_combine_check(const MoeCombineParams& p) {
  if (!known_dtype(p.dtype)) return "dtype must be bf16, fp16 or fp32";
  if (p.tokens < 0 || p.top_k < 0 || p.experts < 1) return "tokens, top_k and experts must be valid";
  if (p.hidden < 8 || p.hidden % 8 != 0) return "hidden must be a positive multiple of 8";
  if (p.tokens == 0) return nullptr;
  if (!p.out || !aligned16(p.out)) return "out must be 16-byte aligned";
  if (p.top_k > 0 && (!p.y || !aligned16(p.y) || !p.weights || !p.ids)) return "y must be 16-byte aligned";
  return nullptr;
}

cudaError_t moe_combine_launch(const MoeCombineParams& p, cudaStream_t stream) {
  if (moe_combine_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  return combine_any(p, stream);
}

}  // namespace dflash
