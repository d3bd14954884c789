// Routed experts (semantics in moe.h).
//
// Sort. One CTA counts the slots of each expert in shared memory, scans the counts into slot
// offsets and chunk offsets (an expert's slots split into chunks of up to 8 NT), writes one
// descriptor per chunk (expert, first position, slot count) and places every slot with a
// shared atomic. The order inside an expert depends on those atomics; no result does, since
// each slot's dot products are computed on their own, in an order fixed by the shapes (so a
// token's output is also the same whatever other tokens share its pass). One token (an AR
// step at batch 1) skips the sort: in fp32 each of its picks is a chunk of its own, as the sort
// would have made them, which saves a kernel as long as the routing's own; in bf16 and fp16 it
// runs the CUDA-core kernels of its own below.
//
// Projections. A CTA takes one chunk and a tile of output rows of that chunk's expert (from
// 16-slot chunks four tiles in turn: row_tiles_per_cta, and in 16-bit weights through shared
// memory: "Streamed tiles" below); its warps (8 for gate_up, 4 for down) split the reduction
// (K) dimension, and each applies the tile's weight rows to the chunk's slots with mma.sync:
// rows are M, slots N (8 per MMA), fp32 accumulators, the weights read once per chunk
// (mma_tile.h: the fragment layout, and fp32's three TF32 MMAs).
//
// Weighted sum. A thread adds a few elements of a token's output over its picks, in pick
// order (16 bytes of them in the kernel of its own, 4 in the down kernel's tail). Up to
// kMoeFusedCombineTokens tokens the down kernel does it: the CTAs of a row tile count
// themselves done on a counter (zeroed by the gate_up kernel), and the last one sums that tile
// for every token, the same arithmetic as the kernel of its own that larger passes launch.
//
// Overlap. For one token (either kernel pair) the down kernel is launched as a programmatic
// dependent of gate_up (pdl.h): its experts are known before gate_up ends (the ids come from
// the kernel before it), so its CTAs pull their weight rows into L2 while gate_up's last CTAs
// run, then wait. With MoeTokenFusion::route_logits each CTA of both routes the token itself
// (route_warp.h) and no routing kernel runs before them: gate_up's CTAs after their wait, up
// to their own pick, down's in full before theirs.
// With more tokens the grids run in several waves, and the same launch was slower
// (commit 3f4c439, BENCHMARKS.md at that commit, "Mixture of experts").
//
// This file has no torch dependency: it compiles alone with
//   nvcc -std=c++17 -arch=sm_90 -c moe.cu

#include "moe.h"
#include "moe_route.h"  // kMoeRouteMaxTopK

#include "cp_async.h"
#include "device.h"
#include "float_convert.h"
#include "lanes.h"
#include "mma_tile.h"
#include "pdl.h"
#include "route_warp.h"
#include "row_norm.h"

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
constexpr int kDownTileRows = 32;  // output rows of a down CTA
constexpr int kMaxGridY = 65535;

// Where the sort's outputs live in the work buffer (ints); ends first, so that it is 16-byte
// aligned as a GEMM's offsets may need to be.
struct Layout {
  int64_t ends = 0;        // [E] cumulative slot counts
  int64_t num_chunks = 0;  // [1]
  int64_t order = 0;       // [S] slots grouped by expert
  int64_t rows = 0;        // [S] position of each slot in order
  int64_t chunks = 0;      // [max_chunks] int4 (expert, first position, count, unused), 16-byte aligned
  int64_t tiles_done = 0;  // [down row tiles] when the down kernel sums: its CTAs done per tile
  int64_t total = 0;
  int row_tiles = 1;  // consecutive row tiles of its chunk a projection CTA runs (row_tiles_per_cta)
};

Layout layout(int64_t slots, int64_t experts, int64_t max_chunks, int64_t counted_tiles = 0) {
  Layout l;
  l.num_chunks = experts;
  l.order = experts + 1;
  l.rows = l.order + slots;
  l.chunks = (l.rows + slots + 3) / 4 * 4;
  l.tiles_done = l.chunks + 4 * max_chunks;
  l.total = l.tiles_done + counted_tiles;
  return l;
}

__host__ __device__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool fused_combine(const MoeParams& p) { return p.tokens <= kMoeFusedCombineTokens; }

// A projection's row tiles: gate_up's of 16 intermediate rows (gate and up), down's of
// kDownTileRows hidden rows.
template <bool kGateUp>
__host__ __device__ constexpr int tile_rows() { return kGateUp ? 16 : kDownTileRows; }
template <bool kGateUp>
__host__ __device__ int projection_tiles(const MoeParams& p) {
  return ((kGateUp ? p.inter : p.hidden) + tile_rows<kGateUp>() - 1) / tile_rows<kGateUp>();
}

// The most n-tiles a chunk of 16-bit weights takes (the streamed tiles' registers do not grow
// with them; fp32's register tiles stop at 2), and from how many 16-bit chunks stream through
// shared memory ("Streamed tiles").
constexpr int kMaxTilesPerChunk = 4, kStreamMinTiles = 2;

// n-tiles per chunk: as many as the slots average per expert in 8s, up to 1, 2 or 4 (16-bit
// weights; fp32: up to 2): each expert's weights read about once, not once for every 8 of its
// slots, and no more slots in a chunk than it usually has.
int tiles_per_chunk(const MoeParams& p) {
  const int64_t slots = static_cast<int64_t>(p.tokens) * p.top_k, per8 = static_cast<int64_t>(kTileTokens) * p.experts;
  const int most = p.dtype == DType::kFloat32 ? 2 : kMaxTilesPerChunk;
  return most >= 4 && slots >= 2 * per8 ? 4 : slots >= per8 ? 2 : 1;
}

// k blocks per warp iteration of the register tiles: four n-tiles' loads take as many
// registers as their weights'.
template <int NT>
__host__ __device__ constexpr int tile_unroll() { return NT >= 4 ? 2 : mma_tile::kTileUnroll; }

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

// The chunk of this CTA (blockIdx.y): one token's pick blockIdx.y, or the sort's chunk; false
// past the routed work.
__device__ __forceinline__ bool read_chunk(const MoeParams& p, const Layout& l, int4& chunk) {
  if (p.tokens == 1) {
    const int pick = blockIdx.y, e = pick < p.top_k ? p.ids[pick] : -1;
    chunk = make_int4(e, pick, 1, 0);
    return e >= 0 && e < p.experts;
  }
  if (static_cast<int>(blockIdx.y) >= p.work[l.num_chunks]) return false;
  chunk = reinterpret_cast<const int4*>(p.work + l.chunks)[blockIdx.y];
  return true;
}

// The slot at position pos of the expert order (one token: its picks in order).
__device__ __forceinline__ int slot_at(const MoeParams& p, const Layout& l, int pos) {
  return p.tokens == 1 ? pos : p.work[l.order + pos];
}

// acc += weights[s] * y[row(s), c .. c + V) over token tok's picks s in order, in fp32 (a
// product, then a sum, each rounded), skipping ids outside [0, E); V elements of y per load
// of an L. The loads of G picks are issued together, y's whatever the ids (a slot's row is in
// bounds, read and not added when its id is invalid): the sum waits on one memory round trip
// per G picks, not one or two per pick. kFromL2: y was written by other CTAs of the running
// kernel, so it is read past this SM's L1.
template <typename T, typename L, int G, bool kFromL2, int V = sizeof(L) / sizeof(T)>
__device__ __forceinline__ void sum_picks(const T* y, const int32_t* rows, const float* weights, const int32_t* ids,
                                          int top_k, int experts, int64_t hidden, int64_t tok, int64_t c,
                                          float (&acc)[V]) {
#pragma unroll 1
  for (int j0 = 0; j0 < top_k; j0 += G) {
    int e[G];
    float w[G];
    L raw[G];
#pragma unroll
    for (int u = 0; u < G; ++u) {
      e[u] = -1;
      if (j0 + u >= top_k) continue;
      const int64_t s = tok * top_k + j0 + u;
      e[u] = ids[s];
      w[u] = weights[s];
      const L* src = reinterpret_cast<const L*>(y + (rows != nullptr ? rows[s] : s) * hidden + c);
      raw[u] = kFromL2 ? __ldcg(src) : __ldg(src);
    }
#pragma unroll
    for (int u = 0; u < G; ++u) {
      if (e[u] < 0 || e[u] >= experts) continue;
      const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = __fadd_rn(acc[k], __fmul_rn(w[u], to_float(v[k])));
    }
  }
}

template <typename O, int V>
struct alignas(sizeof(O) * V) Pack {
  O v[V];
};

// out[at .. at + V) = acc, in fp32 or rounded to T, in one store per 16 bytes.
template <typename T, int V>
__device__ __forceinline__ void store_sum(void* out, DType out_dtype, int64_t at, const float (&acc)[V]) {
  if (out_dtype == DType::kFloat32) {
    Pack<float, V> pack;
#pragma unroll
    for (int k = 0; k < V; ++k) pack.v[k] = acc[k];
    *reinterpret_cast<Pack<float, V>*>(static_cast<float*>(out) + at) = pack;
  } else {
    Pack<T, V> pack;
#pragma unroll
    for (int k = 0; k < V; ++k) pack.v[k] = to_dtype<T>(acc[k]);
    *reinterpret_cast<Pack<T, V>*>(static_cast<T*>(out) + at) = pack;
  }
}

// The row tiles of a projection CTA: l.row_tiles consecutive ones from blockIdx.x's first. A CTA
// runs them in turn on the same slots, so its warps read their share of the slots' rows from
// L2 once and then from L1, where one CTA a tile read them from L2 once a tile; each tile's
// sums are those of a CTA of its own, so the choice does not change a bit.
__device__ __forceinline__ int first_row_tile(const Layout& l) { return blockIdx.x * l.row_tiles; }

// b[n] = row slot / per of rows (each `chunks` 16-byte chunks long) for the chunk's slot 8 n + g,
// null past its count: x's token rows (per = k) or act's slot rows (per = 1). g: the lane's
// column of an n-tile (lane / 4), or a copying thread's.
template <int NT>
__device__ __forceinline__ void slot_rows(const MoeParams& p, const Layout& l, const int4& chunk, const void* rows,
                                          int64_t chunks, int per, int g, const uint4* (&b)[NT]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int col = 8 * n + g;
    const int64_t row = col < chunk.z ? slot_at(p, l, chunk.y + col) / per : 0;
    b[n] = col < chunk.z ? static_cast<const uint4*>(rows) + row * chunks : nullptr;
  }
}

// Row r (0 .. 31) of a projection tile from row0, in its expert's matrix: gate_up's gate rows
// row0 .. row0 + 15, then its up rows I + row0 ..; down's rows row0 .. row0 + 31. A row past
// the matrix reads its last one again and is never stored. r = 8 j + g: the rows of m-tile
// j / 2 (mma_tile.h's a[j]).
template <bool kGateUp>
__device__ __forceinline__ int64_t weight_row(const MoeParams& p, int row0, int r) {
  if constexpr (kGateUp) {
    const int row = min(row0 + r % 16, p.inter - 1);
    return r < 16 ? row : p.inter + row;
  } else {
    return min(row0 + r, p.hidden - 1);
  }
}

// act[slot, r] from warp 0's sums of the 16 intermediate rows r from row0 (acc[0]: gate, acc[1]: up).
template <typename T, int NT>
__device__ __forceinline__ void store_act(const MoeParams& p, const Layout& l, const int4& chunk, int row0,
                                          const float (&acc)[2][NT][4]) {
  const int first = chunk.y, count = chunk.z, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int I = p.inter;
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
      act[static_cast<int64_t>(slot_at(p, l, first + col)) * I + row] = to_dtype<T>(__fmul_rn(silu, up));
    }
  }
}

// y[slot, h] from warp 0's sums of the 32 rows h from row0 (acc[m]: rows row0 + 16 m ..).
template <typename T, int NT>
__device__ __forceinline__ void store_y(const MoeParams& p, const Layout& l, const int4& chunk, int row0,
                                        const float (&acc)[2][NT][4]) {
  const int first = chunk.y, count = chunk.z, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int H = p.hidden;
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + 16 * m + g + 8 * (i / 2), col = 8 * n + 2 * t + i % 2;
        if (row < H && col < count)
          y[static_cast<int64_t>(slot_at(p, l, first + col)) * H + row] = to_dtype<T>(acc[m][n][i]);
      }
    }
  }
}

template <typename T, int NT, bool kGateUp>
__device__ __forceinline__ void store_tile(const MoeParams& p, const Layout& l, const int4& chunk, int row0,
                                           const float (&acc)[2][NT][4]) {
  if constexpr (kGateUp) store_act<T, NT>(p, l, chunk, row0, acc);
  else store_y<T, NT>(p, l, chunk, row0, acc);
}

// K of a projection in 16-byte chunks (gate_up: H, down: I), and its expert's matrix.
template <typename T, bool kGateUp>
__device__ __forceinline__ int64_t row_chunks(const MoeParams& p) {
  return static_cast<int64_t>(kGateUp ? p.hidden : p.inter) * sizeof(T) / 16;
}
template <typename T, bool kGateUp>
__device__ __forceinline__ const uint4* expert_matrix(const MoeParams& p, int e) {
  return static_cast<const uint4*>(kGateUp ? p.gate_up : p.down) +
         static_cast<int64_t>(e) * (kGateUp ? 2 * p.inter : p.hidden) * row_chunks<T, kGateUp>(p);
}

// act[slot, r] for the 16 intermediate rows r from row0 (gate rows r, up rows I + r), or
// y[slot, h] for the 32 rows h from row0, of the chunk's slots (rows b), on the register tiles.
template <typename T, int NT, bool kGateUp>
__device__ __forceinline__ void project_tile(const MoeParams& p, const Layout& l, const int4& chunk, int row0,
                                             const uint4* const (&b)[NT], float (*part)[2][NT][4][32]) {
  constexpr int W = kGateUp ? kGateUpWarps : kDownWarps;
  const int64_t chunks = row_chunks<T, kGateUp>(p);
  const uint4* w = expert_matrix<T, kGateUp>(p, chunk.x);
  const int g = threadIdx.x % 32 / 4;
  const uint4* a[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) a[j] = w + weight_row<kGateUp>(p, row0, 8 * j + g) * chunks;
  float acc[2][NT][4] = {};
  warp_tile<T, W, 2, NT, false, tile_unroll<NT>()>(a, b, chunks, threadIdx.x / 32, acc);
  if (sum_warps<W, 2, NT>(acc, part)) store_tile<T, NT, kGateUp>(p, l, chunk, row0, acc);
}

// The CTA's row tiles of its chunk in turn (l.row_tiles of them from first_row_tile), on the
// register tiles.
template <typename T, int NT, bool kGateUp>
__device__ __forceinline__ void project_row_tiles(const MoeParams& p, const Layout& l, const int4& chunk,
                                                  const uint4* const (&b)[NT], float (*part)[2][NT][4][32]) {
  const int end = min(first_row_tile(l) + l.row_tiles, projection_tiles<kGateUp>(p));
#pragma unroll 1
  for (int tile = first_row_tile(l); tile < end; ++tile) {
    project_tile<T, NT, kGateUp>(p, l, chunk, tile * tile_rows<kGateUp>(), b, part);
    __syncthreads();  // warp 0 has read `part` before the next tile's warps write it
  }
}

template <typename T, int NT>
__global__ void __launch_bounds__(kGateUpWarps * 32) moe_gate_up_kernel(MoeParams p, Layout l) {
  __shared__ float part[kGateUpWarps - 1][2][NT][4][32];
  pdl_allow_dependents();
  if (blockIdx.x == 0 && blockIdx.y == 0) {  // the down kernel that follows counts from zero
    for (int64_t i = l.tiles_done + threadIdx.x; i < l.total; i += blockDim.x) p.work[i] = 0;
  }
  int4 chunk;
  if (!read_chunk(p, l, chunk)) return;
  const uint4* b[NT];  // the rows of x of the chunk's tokens
  slot_rows(p, l, chunk, p.x, row_chunks<T, true>(p), p.top_k, threadIdx.x % 32 / 4, b);
  if constexpr (NT == 1) {  // one tile a CTA (row_tiles_per_cta): the loop would slow these kernels
    project_tile<T, NT, true>(p, l, chunk, 16 * blockIdx.x, b, part);
  } else {
    project_row_tiles<T, NT, true>(p, l, chunk, b, part);
  }
}

// kSum: the last CTA of each row tile to finish also sums that tile's rows for every token
// (a CTA a row tile then, as for one token, whose CTAs prefetch their tile).
template <typename T, int NT, bool kSum>
__device__ __forceinline__ void down_tiles(const MoeParams& p, const Layout& l) {
  __shared__ float part[kDownWarps - 1][2][NT][4][32];
  int4 chunk;
  const bool routed = read_chunk(p, l, chunk);
  if (routed && p.tokens == 1) {  // overlapping gate_up (project()): the tile's weight rows, 128-byte lines
    const int64_t row_bytes = static_cast<int64_t>(p.inter) * sizeof(T), lines = row_bytes / 128;
    const int row0 = blockIdx.x * kDownTileRows, rows = min(kDownTileRows, p.hidden - row0);
    const char* w = static_cast<const char*>(p.down) + (static_cast<int64_t>(chunk.x) * p.hidden + row0) * row_bytes;
    for (int64_t i = threadIdx.x; i < rows * lines; i += blockDim.x)
      prefetch_l2(w + i / lines * row_bytes + i % lines * 128);
  }
  pdl_wait();
  if (routed) {
    const uint4* b[NT];  // the act rows of the chunk's slots
    slot_rows(p, l, chunk, p.act, row_chunks<T, false>(p), 1, threadIdx.x % 32 / 4, b);
    if constexpr (kSum || NT == 1) {
      project_tile<T, NT, false>(p, l, chunk, blockIdx.x * kDownTileRows, b, part);
    } else {
      project_row_tiles<T, NT, false>(p, l, chunk, b, part);
    }
  }
  if constexpr (kSum) {
    __shared__ bool last;
    __threadfence();  // this CTA's y rows are visible to the CTA that sums them before it counts
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(p.work + l.tiles_done + blockIdx.x, 1) == static_cast<int>(gridDim.y) - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();  // and the rows other CTAs wrote before counting are visible here
    // The sum is a serial tail of the kernel: 4 bytes of y per thread spread it over more
    // threads, and a batch of 12 picks takes a token's top 10 and shared expert (the largest
    // release's) in one round trip, with registers few enough to keep the kernel's occupancy.
    constexpr int V = 4 / sizeof(T), kPerToken = kDownTileRows / V;
    const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kDownTileRows;
#pragma unroll 1
    for (int i = threadIdx.x; i < p.tokens * kPerToken; i += blockDim.x) {
      const int64_t tok = i / kPerToken, c = row0 + (i % kPerToken) * V;
      if (c >= p.hidden) continue;
      float acc[V] = {};
      sum_picks<T, uint32_t, 12, true>(static_cast<const T*>(p.y), nullptr, p.weights, p.ids, p.top_k, p.experts,
                                       p.hidden, tok, c, acc);
      store_sum<T>(p.out, p.out_dtype, tok * p.hidden + c, acc);
    }
  }
}

template <typename T, int NT>
__global__ void __launch_bounds__(kDownWarps * 32) moe_down_kernel(MoeParams p, Layout l) {
  down_tiles<T, NT, false>(p, l);
}

// The summing down kernel (at most kMoeFusedCombineTokens tokens: a verify at batch 1) takes
// both as one struct over 128 bytes, which nvcc reads through its address: there this ran
// faster than the values in registers (BENCHMARKS.md, "Mixture of experts").
struct DownSumArgs {
  MoeParams p;
  Layout l;
};
static_assert(sizeof(DownSumArgs) > 128, "the summing down kernel was measured reading its parameter by address");

template <typename T, int NT>
__global__ void __launch_bounds__(kDownWarps * 32) moe_down_sum_kernel(DownSumArgs a) {
  down_tiles<T, NT, true>(a.p, a.l);
}

// --------------------------------------------------------------------------------------------
// Streamed tiles: 16-bit weights, chunks of two n-tiles (a pass of many tokens). The register
// tiles above hold a warp's loads in its registers, one round of them at a time, and at two
// n-tiles those registers leave two CTAs an SM: between a CTA's rounds, and while it sums its
// warps and stores, its SM's DRAM stream has gaps. Here a CTA's weight rows and its slots' rows
// go through a few stages of shared memory by cp.async, the copies of the next stages
// in flight while the warps multiply this one, across the CTA's row tiles. Warp w multiplies
// the 64-byte block w of each stage's rows: the blocks the register tile gives it (kb = w mod
// W), in the same order, with the same MMAs, so every slot's sums are the register tiles' to
// the bit (and a pass's results do not depend on which kernels ran it).

// A stage holds 32 weight rows (two m-tiles), then the chunk's 8 NT slot rows, 64 W bytes of
// each (a block a warp), each row followed by kStreamPad unused 16-byte chunks: rows g and
// g + 1 then start 64 bytes apart in the banks, and a quarter warp's 16-byte reads (rows g and
// g + 1, chunks t = 0..3) fall in 32 different banks.
constexpr int kStreamPad = 4;

// Stages a streamed kernel keeps: the most whose shared memory leaves gate_up two CTAs an SM
// and down three (227 KB an SM, less 1 KB a CTA).
__host__ __device__ constexpr int stream_stages(bool gate_up, int nt) {
  const int stage_bytes = (32 + 8 * nt) * (4 * (gate_up ? kGateUpWarps : kDownWarps) + kStreamPad) * 16;
  return (227 * 1024 / (gate_up ? 2 : 3) - 1024) / stage_bytes;
}

template <int W, int NT, int Stages>
struct Staging {
  static_assert(Stages >= 2, "a stage in use and one in flight");
  static constexpr int kStages = Stages;
  static constexpr int kRowChunks = 4 * W;  // 16-byte chunks of a row in a stage
  static constexpr int kStride = kRowChunks + kStreamPad;
  static constexpr int kRows = 32 + 8 * NT;
  static constexpr int kStageChunks = kRows * kStride;
  static constexpr size_t kBytes = size_t{kStages} * kStageChunks * 16;  // dynamic shared memory
};

template <typename T, int NT, bool kGateUp>
__global__ void __launch_bounds__((kGateUp ? kGateUpWarps : kDownWarps) * 32) moe_stream_kernel(MoeParams p,
                                                                                                 Layout l) {
  constexpr int W = kGateUp ? kGateUpWarps : kDownWarps;
  using S = Staging<W, NT, stream_stages(kGateUp, NT)>;
  extern __shared__ uint4 stages[];
  static_assert(sizeof(float) * (W - 1) * 2 * NT * 4 * 32 <= 16 * S::kStageChunks, "part[] fits a stage");
  if (kGateUp && blockIdx.x == 0 && blockIdx.y == 0) {  // as the register kernel: a summing down kernel counts from 0
    for (int64_t i = l.tiles_done + threadIdx.x; i < l.total; i += blockDim.x) p.work[i] = 0;
  }
  int4 chunk;
  if (!read_chunk(p, l, chunk)) return;
  const int64_t k_chunks = row_chunks<T, kGateUp>(p);  // K
  const int tile0 = first_row_tile(l), k_stages = static_cast<int>((k_chunks + S::kRowChunks - 1) / S::kRowChunks);
  const int total = min(l.row_tiles, projection_tiles<kGateUp>(p) - tile0) * k_stages;  // (tile, k stage), tile-major
  const uint4* w = expert_matrix<T, kGateUp>(p, chunk.x);
  // This thread copies chunk c of staged rows q + 8 j: weight rows (j < 4), then slot rows.
  const int q = threadIdx.x / S::kRowChunks, c = threadIdx.x % S::kRowChunks;
  const uint4* slots[NT];
  slot_rows(p, l, chunk, kGateUp ? p.x : p.act, k_chunks, kGateUp ? p.top_k : 1, q, slots);
  const auto issue = [&](int s) {
    uint4* st = stages + (s % S::kStages) * S::kStageChunks + q * S::kStride + c;
    const int row0 = (tile0 + s / k_stages) * tile_rows<kGateUp>();
    const int64_t k = static_cast<int64_t>(s % k_stages) * S::kRowChunks + c;
    const int bytes = k < k_chunks ? 16 : 0;  // past K: zeros, as the register tile's
    const int64_t kk = bytes ? k : 0;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      cp_async_16(st + 8 * j * S::kStride, w + weight_row<kGateUp>(p, row0, q + 8 * j) * k_chunks + kk, bytes);
#pragma unroll
    for (int j = 0; j < NT; ++j)  // a slot past the chunk's count: zeros
      cp_async_16_l1(st + (32 + 8 * j) * S::kStride, slots[j] ? slots[j] + kk : w, slots[j] ? bytes : 0);
  };

  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  float acc[2][NT][4] = {};
#pragma unroll
  for (int s = 0; s < S::kStages - 1; ++s) {
    if (s < total) issue(s);
    cp_async_commit();
  }
#pragma unroll 1
  for (int s = 0; s < total; ++s) {
    cp_async_wait<S::kStages - 2>();
    __syncthreads();  // stage s is in for every thread, and stage s - 1 read by every warp
    if (s + S::kStages - 1 < total) issue(s + S::kStages - 1);  // into stage s - 1's buffer
    cp_async_commit();
    const uint4* st = stages + (s % S::kStages) * S::kStageChunks + 4 * warp + t;
    const uint4 a0 = st[g * S::kStride], a1 = st[(g + 8) * S::kStride];
    const uint4 a2 = st[(g + 16) * S::kStride], a3 = st[(g + 24) * S::kStride];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const uint4 b = st[(32 + 8 * n + g) * S::kStride];
      mma_tile::mma_chunk<T>(acc[0][n], a0, a1, b);
      mma_tile::mma_chunk<T>(acc[1][n], a2, a3, b);
    }
    if (s % k_stages == k_stages - 1) {  // the tile's last stage: its sums, stored
      // The warps' partial sums go through this stage's buffer, free once every warp has read
      // it, until the copies the next iteration issues (after its barrier) fill it again.
      __syncthreads();
      const auto part = reinterpret_cast<float(*)[2][NT][4][32]>(stages + (s % S::kStages) * S::kStageChunks);
      const int row0 = (tile0 + s / k_stages) * tile_rows<kGateUp>();
      if (sum_warps<W, 2, NT>(acc, part)) store_tile<T, NT, kGateUp>(p, l, chunk, row0, acc);
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[0][n][i] = acc[1][n][i] = 0.f;
    }
  }
  cp_async_wait<0>();  // no copy outlives the CTA's shared memory
}

// Over 48 KB of dynamic shared memory is opted into per device, so before every launch (a
// cheap host call, legal during graph capture; as block_attention.cu's prepare()).
template <typename T, int NT, bool kGateUp>
cudaError_t launch_stream(const MoeParams& p, const Layout& l, dim3 grid, cudaStream_t stream) {
  constexpr int W = kGateUp ? kGateUpWarps : kDownWarps;
  constexpr size_t bytes = Staging<W, NT, stream_stages(kGateUp, NT)>::kBytes;
  const auto kernel = moe_stream_kernel<T, NT, kGateUp>;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  kernel<<<grid, W * 32, bytes, stream>>>(p, l);
  return cudaGetLastError();
}

// --------------------------------------------------------------------------------------------
// One token in 16-bit weights (an AR step at batch 1), on CUDA cores: the picks' weight rows
// stream like a dense matrix through the one-row matmul's pattern (gemv.cu), a warp (gate_up)
// or a group of lanes (down) per output and pick and small CTAs, so that many are resident and
// every SM has loads in flight to the end of the kernel. The tensor-core tiles above spend a CTA on 16 rows of one
// pick and ran these two projections slower (commit 5155253, BENCHMARKS.md at that commit,
// "Mixture of experts"). The sums run in another order than the tiles': a token alone is not
// bit-identical to the same token in a larger pass (fp32 keeps the tiles, and that identity).

constexpr int kTokenThreads = 256;
constexpr int kTokenWarps = kTokenThreads / 32;
constexpr int kTokenGateUpLoads = 2;  // per row (gate, up) and lane in flight: more CTAs resident beat more loads
constexpr int kTokenMaxPicks = 32;  // k of the one-token kernels (their shared memory); more take the tiles

// One token's routing inside the expert kernels (MoeTokenFusion::route_logits): warp 0 of the CTA
// routes it into shared memory (route_warp.h) for the first `rounds` picks (the weights with
// all of them), while the other warps wait at the barrier. The kernels take route_warp's V
// (kRouteV: 8 up to 256 experts, else 16, whose registers cost the down kernel a spill) as a
// template argument, 0 for ids read from memory, which compiles the routing out.
static_assert(kTokenMaxPicks >= kMoeRouteMaxTopK + 1, "a routed token's picks fit the shared arrays");

// The one-token kernels' parameter: both structs in one, over 128 bytes, so that nvcc reads it
// through its address as it did when they were tuned and measured (commit b681fc9;
// benchmarks/moe_params_ab_h200.json): it keeps the values out of registers, and by value the
// down kernel spills under its register cap. The tile kernels take MoeParams alone (moe.h).
struct MoeTokenArgs {
  MoeParams p;
  MoeTokenFusion f;
};
static_assert(sizeof(MoeTokenArgs) > 128, "the one-token kernels were tuned reading their parameter by address");

inline int route_lanes(const MoeParams& p, const MoeTokenFusion& f) {
  return f.route_logits == nullptr ? 0 : p.experts - (p.shared_last ? 1 : 0) <= 256 ? 8 : 16;
}

template <typename T, int kRouteV>
__device__ __forceinline__ void route_in_cta(const MoeParams& p, const MoeTokenFusion& f, int rounds, float* w,
                                             int32_t* ids) {
  const int s = p.shared_last ? 1 : 0;
  if (threadIdx.x < 32)
    route_warp<T, kRouteV>(static_cast<const T*>(f.route_logits), f.route_stride, p.experts - s, p.top_k - s,
                               rounds, f.route_renormalize, p.shared_last, w, ids);
  __syncthreads();
}

// act[j, r] for intermediate row r of pick j (warp w: j = w / I, r = w % I): gate row r and up
// row I + r of expert ids[j], silu(gate) * up rounded as the tile kernel rounds it. Routing
// here (route_logits), a CTA routes up to its own pick (I is a multiple of 8: one pick a CTA),
// a shared expert's CTA not at all.
template <typename T, int kRouteV>
__global__ void __launch_bounds__(kTokenThreads) moe_token_gate_up_kernel(MoeTokenArgs a) {
  const MoeParams& p = a.p;
  const MoeTokenFusion& f = a.f;
  __shared__ float route_w[kTokenMaxPicks];
  __shared__ int32_t route_ids[kTokenMaxPicks];
  const int lane = threadIdx.x % 32;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kTokenWarps + threadIdx.x / 32;
  const int64_t chunks = p.hidden / 8;
  const bool live = w < static_cast<int64_t>(p.top_k) * p.inter;
  const bool shared_pick = p.shared_last && w / p.inter == p.top_k - 1;
  if (live && shared_pick) {  // known before the routing: its rows into L2
    const int64_t row = static_cast<int64_t>(p.experts - 1) * 2 * p.inter + w % p.inter;
    const char* gate = reinterpret_cast<const char*>(static_cast<const uint4*>(p.gate_up) + row * chunks);
    const char* up = gate + static_cast<int64_t>(p.inter) * chunks * 16;
    for (int64_t b = 128 * lane; b < chunks * 16; b += 128 * 32) {
      prefetch_l2(gate + b);
      prefetch_l2(up + b);
    }
  }
  pdl_wait();  // the ids, or the router's logits, come from the kernel before
  pdl_allow_dependents();
  const int j = static_cast<int>(min(w / p.inter, static_cast<int64_t>(p.top_k - 1)));
  constexpr bool routes = kRouteV > 0;
  if constexpr (routes) {
    if (!shared_pick) route_in_cta<T, kRouteV>(p, f, j + 1, route_w, route_ids);  // the CTA is one pick's
    // the last routed pick's first CTA has all of it: for the down CTAs that do not route
    const int routed = p.top_k - (p.shared_last ? 1 : 0);
    if (j == routed - 1 && w == static_cast<int64_t>(j) * p.inter && static_cast<int>(threadIdx.x) < p.top_k) {
      f.route_ids[threadIdx.x] = route_ids[threadIdx.x];
      f.route_weights[threadIdx.x] = route_w[threadIdx.x];
    }
  }
  if (!live) return;
  const int r = static_cast<int>(w % p.inter);
  const int e = !routes ? p.ids[j] : shared_pick ? p.experts - 1 : route_ids[j];
  if (e < 0 || e >= p.experts) return;  // adds nothing: the down kernel skips the pick
  const uint4* gate = static_cast<const uint4*>(p.gate_up) + (static_cast<int64_t>(e) * 2 * p.inter + r) * chunks;
  const uint4* const rows[2] = {gate, gate + static_cast<int64_t>(p.inter) * chunks};  // gate row r, up row I + r
  float acc[2] = {};
  lane_dots<T, 2, kTokenGateUpLoads>(rows, static_cast<const uint4*>(p.x), chunks, lane, acc);
  const float g = rounded<T>(warp_sum(acc[0])), u = rounded<T>(warp_sum(acc[1]));
  if (lane != 0) return;
  const float silu = rounded<T>(g / (1.0f + expf(-g)));
  static_cast<T*>(p.act)[static_cast<int64_t>(j) * p.inter + r] = to_dtype<T>(__fmul_rn(silu, u));
}

// out[h] for output row h: each pick's down row h applied to its act row, rounded, then
// weighted and summed in pick order (sum_picks' arithmetic). A group of kDownLanes lanes takes
// one (row, pick) dot over the whole of I, a CTA the dots of its rows (row r, pick j: group
// r k + j), so that a lane has kDownLoads weight chunks in flight and a dot costs three shuffles.
// Two warps a row, a chunk a lane and pick, spent most of their issue slots beside the loads
// (addresses, a 32-lane butterfly per pick, the activations unpacked again by every warp): ncu
// found them issue-bound, not waiting on memory (benchmarks/moe_token_ncu_h200.json). The ids
// were written two kernels back (routing; gate_up lets this kernel start only after its own
// wait), so the first weight chunks load into registers before the wait, while gate_up runs;
// the ids are read again after it. With route_logits the router's logits are the ones two
// kernels back: each CTA routes the token before the wait.
constexpr int kDownLanes = 8, kDownLoads = 8;  // lanes a dot; chunks a lane in flight
constexpr int kDownGroups = 36;                // dots a CTA at most: 4 rows of the 35B-A3B's 9 picks
constexpr int kDownThreads = kDownGroups * kDownLanes;
constexpr int kDownMinCtas = 4;  // an SM: with 9 picks every CTA of H 2048 is resident at once
static_assert(2 * kDownThreads * 8 >= kMoeNormMaxHidden, "the add + norm's row in two vectors a thread");

// Rows a CTA for k picks (every one of its groups busy where k divides kDownGroups).
inline int down_rows_per_cta(int top_k) { return std::max(1, kDownGroups / top_k); }

__device__ __forceinline__ void load_down_chunks(const uint4* row, int64_t c0, int64_t chunks, bool valid,
                                                 uint4 (&wv)[kDownLoads]) {
#pragma unroll
  for (int u = 0; u < kDownLoads; ++u) {
    const int64_t c = c0 + kDownLanes * u;
    wv[u] = valid && c < chunks ? __ldcs(row + c) : make_uint4(0, 0, 0, 0);
  }
}

// kNormPlays > 0: launched with kDownThreads threads, the add + norm after it (MoeTokenFusion::norm)
// by its last CTA, each thread over kNormPlays vectors of the row.
// With the routing here (kRouteV > 0) the first route_ctas CTAs, those that start while
// gate_up runs (about one an SM beside its CTAs), route the token before their wait; the
// others start as gate_up's CTAs end, where routing would be in the way, and read the routing
// gate_up wrote (MoeTokenFusion::route_ids, route_weights) after the wait.
template <typename T, int kNormPlays, int kRouteV>
__global__ void __launch_bounds__(kDownThreads, kDownMinCtas)
    moe_token_down_kernel(MoeTokenArgs a, int rows_per_cta, int route_ctas) {
  const MoeParams& p = a.p;
  const MoeTokenFusion& f = a.f;
  __shared__ float part[kDownGroups];
  __shared__ float route_w[kTokenMaxPicks];
  __shared__ int32_t route_ids[kTokenMaxPicks];
  constexpr bool routes = kRouteV > 0;
  const bool self_routed = routes && static_cast<int>(blockIdx.x) < route_ctas;
  if constexpr (routes) {
    if (self_routed) route_in_cta<T, kRouteV>(p, f, p.top_k - (p.shared_last ? 1 : 0), route_w, route_ids);
  }
  const int k = p.top_k, group = threadIdx.x / kDownLanes, gl = threadIdx.x % kDownLanes;
  const int r = group / k, j = group % k;
  const int64_t h = static_cast<int64_t>(blockIdx.x) * rows_per_cta + r;
  const bool live = r < rows_per_cta && h < p.hidden;
  const int64_t chunks = p.inter / 8;
  const uint4* down = static_cast<const uint4*>(p.down);
  const int64_t hidden = p.hidden;  // not p in the lambda: taking a parameter's address copies it to local memory
  auto row_of = [=](int e) { return down + (static_cast<int64_t>(e) * hidden + h) * chunks; };
  int e = !live ? -1 : !routes ? p.ids[j] : self_routed ? route_ids[j] : -1;
  bool valid = e >= 0 && e < p.experts;
  uint4 wv[kDownLoads];
  load_down_chunks(row_of(valid ? e : 0), gl, chunks, valid, wv);
  pdl_wait();
  if constexpr (routes) {
    if (!self_routed) {
      if (static_cast<int>(threadIdx.x) < k) {
        route_ids[threadIdx.x] = f.route_ids[threadIdx.x];
        route_w[threadIdx.x] = f.route_weights[threadIdx.x];
      }
      __syncthreads();
      e = live ? route_ids[j] : -1;
      valid = e >= 0 && e < p.experts;
      load_down_chunks(row_of(valid ? e : 0), gl, chunks, valid, wv);
    }
  } else if (live && p.ids[j] != e) {  // never expected (see above); correct if it happens
    e = p.ids[j];
    valid = e >= 0 && e < p.experts;
    load_down_chunks(row_of(valid ? e : 0), gl, chunks, valid, wv);
  }
  const uint4* act = static_cast<const uint4*>(p.act) + j * chunks;
  float dot = 0.0f;
  for (int64_t c0 = gl; valid && c0 < chunks;) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // half the activation chunks at once: registers
      constexpr int U = kDownLoads / 2;
      uint4 av[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t c = c0 + kDownLanes * (half * U + u);
        av[u] = c < chunks ? __ldg(act + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float af[8], wf[8];
        unpack8<T>(av[u], af);
        unpack8<T>(wv[half * U + u], wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fmaf(af[i], wf[i], dot);
      }
    }
    c0 += kDownLanes * kDownLoads;
    if (c0 < chunks) load_down_chunks(row_of(e), c0, chunks, true, wv);
  }
#pragma unroll
  for (int o = kDownLanes / 2; o > 0; o >>= 1) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
  if (live && gl == 0) part[group] = dot;
  __syncthreads();
  const int64_t hr = static_cast<int64_t>(blockIdx.x) * rows_per_cta + threadIdx.x;
  const bool writes = static_cast<int>(threadIdx.x) < rows_per_cta && hr < p.hidden;
  if constexpr (kNormPlays == 0) {
    if (!writes) return;
  }
  if (writes) {
    float out = 0.0f;
    for (int jj = 0; jj < k; ++jj) {
      const int ej = routes ? route_ids[jj] : p.ids[jj];
      if (ej < 0 || ej >= p.experts) continue;
      const float wj = routes ? route_w[jj] : p.weights[jj];
      out = __fadd_rn(out, __fmul_rn(wj, rounded<T>(part[threadIdx.x * k + jj])));
    }
    if (p.out_dtype == DType::kFloat32) static_cast<float*>(p.out)[hr] = out;
    else static_cast<T*>(p.out)[hr] = to_dtype<T>(out);
  }
  if constexpr (kNormPlays > 0) add_rms_norm_if_last<T, kDownThreads, kNormPlays>(static_cast<const T*>(p.out), p.hidden,
                                                                                  f.norm);
}

template <typename T>
cudaError_t project_token(const MoeParams& p, const MoeTokenFusion& f, cudaStream_t stream) {
  const MoeTokenArgs args{p, f};
  const int64_t warps = static_cast<int64_t>(p.top_k) * p.inter;
  const dim3 block(kTokenThreads);
  const int rv = route_lanes(p, f);  // routing only with the norm (moe_check)
  const auto gate_up = rv == 0 ? moe_token_gate_up_kernel<T, 0>
                               : rv == 8 ? moe_token_gate_up_kernel<T, 8> : moe_token_gate_up_kernel<T, 16>;
  const cudaError_t err =
      pdl_launch(gate_up, dim3(static_cast<unsigned>(ceil_div(warps, kTokenWarps))), block, 0, stream, true, args);
  if (err != cudaSuccess) return err;
  const int rows = down_rows_per_cta(p.top_k);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.hidden, rows)));
  if (f.norm.ticket != nullptr) {
    const bool one_play = p.hidden / 8 <= kDownThreads;
    const auto kernel = rv == 0    ? (one_play ? moe_token_down_kernel<T, 1, 0> : moe_token_down_kernel<T, 2, 0>)
                        : rv == 8  ? (one_play ? moe_token_down_kernel<T, 1, 8> : moe_token_down_kernel<T, 2, 8>)
                                   : (one_play ? moe_token_down_kernel<T, 1, 16> : moe_token_down_kernel<T, 2, 16>);
    // about one down CTA an SM starts beside gate_up's CTAs (moe_token_down_kernel)
    return pdl_launch(kernel, grid, dim3(kDownThreads), 0, stream, true, args, rows, device_sms());
  }
  const int threads = static_cast<int>(ceil_div(static_cast<int64_t>(rows) * p.top_k * kDownLanes, 32)) * 32;
  return pdl_launch(moe_token_down_kernel<T, 0, 0>, grid, dim3(threads), 0, stream, true, args, rows, 0);
}

// --------------------------------------------------------------------------------------------
// Weighted sum: a thread per 16 bytes of a y row (V elements), the k picks added in order.

constexpr int kCombineThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(MoeCombineParams p) {
  constexpr int V = 16 / sizeof(T);
  const int64_t per_row = p.hidden / V, total = static_cast<int64_t>(p.tokens) * per_row;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t tok = i / per_row, c = (i % per_row) * V;
    float acc[V] = {};
    sum_picks<T, uint4, 4, false>(static_cast<const T*>(p.y), p.rows, p.weights, p.ids, p.top_k, p.experts, p.hidden,
                                  tok, c, acc);
    store_sum<T>(p.out, p.out_dtype, tok * p.hidden + c, acc);
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
  const dim3 gate_up_grid(static_cast<unsigned>(ceil_div(projection_tiles<true>(p), l.row_tiles)),
                          static_cast<unsigned>(chunks));
  const dim3 down_grid(static_cast<unsigned>(ceil_div(projection_tiles<false>(p), l.row_tiles)),
                       static_cast<unsigned>(chunks));
  if constexpr (NT >= kStreamMinTiles && !std::is_same_v<T, float>) {
    if (!fused_combine(p)) {
      const cudaError_t err = launch_stream<T, NT, true>(p, l, gate_up_grid, stream);
      return err != cudaSuccess ? err : launch_stream<T, NT, false>(p, l, down_grid, stream);
    }
  }
  moe_gate_up_kernel<T, NT><<<gate_up_grid, kGateUpWarps * 32, 0, stream>>>(p, l);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 block(kDownWarps * 32);
  const bool overlap = p.tokens == 1;
  if (fused_combine(p))
    return pdl_launch(moe_down_sum_kernel<T, NT>, down_grid, block, 0, stream, overlap, DownSumArgs{p, l});
  return pdl_launch(moe_down_kernel<T, NT>, down_grid, block, 0, stream, overlap, p, l);
}

template <typename T>
cudaError_t project_typed(const MoeParams& p, const Layout& l, int64_t chunks, int tiles, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (tiles == 4) return project<T, 4>(p, l, chunks, stream);
  }
  return tiles == 2 ? project<T, 2>(p, l, chunks, stream) : project<T, 1>(p, l, chunks, stream);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

bool known_dtype(DType d) { return d == DType::kBFloat16 || d == DType::kFloat16 || d == DType::kFloat32; }

size_t dtype_bytes(DType d) { return d == DType::kFloat32 ? 4 : 2; }

int64_t launch_chunks(const MoeParams& p) {
  const int64_t slots = static_cast<int64_t>(p.tokens) * p.top_k;
  return max_chunks(slots, p.experts, static_cast<int64_t>(kTileTokens) * tiles_per_chunk(p));
}

// Row tiles per projection CTA: several once the chunks average 8 slots or more (a pass of many
// tokens; a grid of many waves either way), where the slots' rows, read again for every tile,
// would otherwise cost the L2 half as much as the weights. One where the down kernel sums (its CTAs
// count per row tile) and for one token (its down CTAs prefetch one tile).
int row_tiles_per_cta(const MoeParams& p) { return fused_combine(p) || tiles_per_chunk(p) == 1 ? 1 : 4; }

Layout launch_layout(const MoeParams& p) {
  const int64_t slots = static_cast<int64_t>(p.tokens) * p.top_k;
  Layout l = layout(slots, p.experts, launch_chunks(p), fused_combine(p) ? projection_tiles<false>(p) : 0);
  l.row_tiles = row_tiles_per_cta(p);
  return l;
}

}  // namespace

int64_t moe_work_ints(const MoeParams& p) { return launch_layout(p).total; }

const char* moe_check(const MoeParams& p, const MoeTokenFusion* fusion) {
  if (!known_dtype(p.dtype)) return "dtype must be bf16, fp16 or fp32";
  if (p.out_dtype != DType::kFloat32 && p.out_dtype != p.dtype) return "out_dtype must be fp32 or the dtype";
  if (p.tokens < 0 || p.top_k < 0) return "tokens and top_k must be non-negative";
  if (p.experts < 1 || p.experts > kMoeMaxExperts) return "experts must be in [1, 2048]";
  if (p.hidden < 8 || p.hidden % 8 != 0 || p.inter < 8 || p.inter % 8 != 0)
    return "hidden and inter must be positive multiples of 8";
  const int64_t slots = static_cast<int64_t>(p.tokens) * p.top_k;
  if (slots > (int64_t{1} << 30)) return "too many slots (tokens * top_k)";
  if (launch_chunks(p) > kMaxGridY) return "too many slots for one launch";
  const MoeTokenFusion f = fusion != nullptr ? *fusion : MoeTokenFusion{};
  if (f.norm.ticket != nullptr) {
    if (p.tokens != 1 || p.top_k > kTokenMaxPicks || (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16))
      return "the add + norm after the experts takes one token in bf16 or fp16 with at most 32 picks";
    if (p.out_dtype != p.dtype || p.hidden > kMoeNormMaxHidden) return "the add + norm needs out in the dtype, H <= 4096";
    if (!f.norm.residual || !f.norm.weight || !f.norm.sum || !f.norm.out) return "null norm pointer";
    if (!aligned16(f.norm.residual) || !aligned16(f.norm.weight) || !aligned16(f.norm.sum) || !aligned16(f.norm.out))
      return "the norm's residual, weight, sum and out must be 16-byte aligned";
  }
  if (f.route_logits != nullptr) {
    const int s = p.shared_last ? 1 : 0;
    if (f.norm.ticket == nullptr) return "routing in the experts' kernels comes with the add + norm after them";
    if (p.experts - s > kMoeRouteMaxExperts || p.top_k - s < 1 || p.top_k - s > kMoeRouteMaxTopK)
      return "routing in the experts' kernels takes up to 512 routed experts and 1 to 16 routed picks";
    if (f.route_stride < 1) return "route_stride must be positive";
    if (f.route_ids == nullptr || f.route_weights == nullptr) return "null route_ids or route_weights";
  }
  if (p.tokens == 0) return nullptr;
  if (!p.out || !aligned16(p.out)) return "out must be 16-byte aligned";
  if (slots == 0) return nullptr;
  const void* const buffers[] = {p.x, p.gate_up, p.down, p.work, p.act, p.y};
  for (const void* ptr : buffers)
    if (ptr == nullptr || !aligned16(ptr)) return "x, gate_up, down, work, act and y must be 16-byte aligned";
  if (f.route_logits == nullptr && (!p.weights || !p.ids)) return "null pointer";
  return nullptr;
}

cudaError_t moe_launch(const MoeParams& p, cudaStream_t stream, const MoeTokenFusion* fusion) {
  if (moe_check(p, fusion) != nullptr) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  const int slots = p.tokens * p.top_k;
  if (slots == 0)
    return cudaMemsetAsync(p.out, 0, static_cast<size_t>(p.tokens) * p.hidden * dtype_bytes(p.out_dtype), stream);
  const bool one_token = p.tokens == 1 && p.top_k <= kTokenMaxPicks;
  const MoeTokenFusion f = fusion != nullptr ? *fusion : MoeTokenFusion{};
  if (one_token && p.dtype == DType::kBFloat16) return project_token<__nv_bfloat16>(p, f, stream);
  if (one_token && p.dtype == DType::kFloat16) return project_token<__half>(p, f, stream);
  const int tiles = tiles_per_chunk(p);
  const int64_t chunks = launch_chunks(p);
  const Layout l = launch_layout(p);
  cudaError_t err = cudaSuccess;
  if (p.tokens > 1) err = sort_any(sort_args(p.work, l, slots, p.experts, p.ids, kTileTokens * tiles), stream);
  if (err != cudaSuccess) return err;
  switch (p.dtype) {
    case DType::kBFloat16: err = project_typed<__nv_bfloat16>(p, l, chunks, tiles, stream); break;
    case DType::kFloat16: err = project_typed<__half>(p, l, chunks, tiles, stream); break;
    default: err = project_typed<float>(p, l, chunks, tiles, stream); break;
  }
  if (err != cudaSuccess || fused_combine(p)) return err;
  MoeCombineParams c;
  c.dtype = p.dtype;
  c.tokens = p.tokens;
  c.top_k = p.top_k;
  c.experts = p.experts;
  c.hidden = p.hidden;
  c.y = p.y;
  c.weights = p.weights;
  c.ids = p.ids;
  c.out_dtype = p.out_dtype;
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
  if (p.out_dtype != DType::kFloat32 && p.out_dtype != p.dtype) return "out_dtype must be fp32 or the dtype";
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
