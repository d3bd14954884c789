// Block attention over a KV cache (semantics in block_attention.h), flash-decoding style.
//
// Work split. One CTA takes one (batch row b, KV head, query chunk, key split):
//   - all queries that read this KV head, i.e. the T tokens x G = Hq / Hkv heads of the GQA
//     group, as one matrix of M = T * G rows (row r = token r / G, head r % G), so every K/V
//     tile is loaded once and used by all of them (up to 64 rows per CTA; larger M gets
//     more query chunks, which re-read K/V mostly from L2, and so does a launch too small
//     to occupy half the SMs, which takes fewer rows per CTA: see launch_plan);
//   - a contiguous share of the row's keys. Long contexts are cut into `num_splits` shares so
//     that a small batch still fills every SM; each CTA leaves a partial result (normalised
//     output + log-sum-exp) and a small combine kernel merges them; one token at batch 1 with at
//     most 8 splits, the splits form a cluster and merge through shared memory instead
//     (merge_cluster). With one split the attention kernel writes the output directly.
//
// Inside a CTA (4 warps). Keys stream through shared memory in tiles of 64 (32 at head_dim
// 256) with cp.async 16-byte copies, double buffered, so the next tile's loads are in flight
// while the tensor cores work on this one. The M rows are MT m16 tiles (MT = 1, 2 or 4; at
// least 2 at head_dim 256, see tile_keys_for); the 4 / MT warps that share an m-tile each
// take a quarter / half / all of the tile's keys and keep their own online-softmax state,
// merged once at the end through shared memory. So decode (M <= 16) still uses all four
// warps, and M = 64 (T = 16, G = 4) gives each warp one m-tile.
// Q.K^T and P.V run on mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate); the score
// accumulators are re-packed in registers as the A operand of P.V (no shared round trip).
//
// Keys of a row are numbered "virtually": [0, n_cache) are cache rows lo .. lo + n_cache - 1
// (lo/hi trimmed by the window and the causal limit, so masked-out context is never read),
// [n_cache, n_keys) are the block's rows. Splits cut this virtual range.
//
// fp32 has its own CUDA-core kernel (one warp per query; see "fp32" below) with the same
// semantics and split + combine scheme.
//
// This file has no torch dependency: it compiles alone with
//   nvcc -std=c++17 -arch=sm_90 -c block_attention.cu

#include "block_attention.h"

#include "cp_async.h"
#include "device.h"
#include "lanes.h"
#include "pdl.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace dflash {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileKeys = 64;   // keys per shared-memory tile (fewer at d = 256, see tile_keys_for)
constexpr int kMaxMTiles = 4;   // m16 tiles of query rows per CTA at most (64 rows)
constexpr int kMinChunk = 128;  // keys per split at least (a split must amortise its epilogue)
constexpr int kMinChunkOneToken = 64;  // the same for an AR step at batch 1 (min_chunk_keys)
constexpr int kMaxSplits = 64;
constexpr int kMaxClusterSplits = 8;  // splits merged in one cluster at most (the portable cluster size)
constexpr float kLog2e = 1.4426950408889634f;

// Keys a split reads at least. An AR step at batch 1 (one token a row) is latency-bound: splits of
// one tile put more SMs to work on a short context and their cluster merge is cheap; blocks of
// tokens keep 128, as 64 made the draft and verify passes slower (3dd4d01's draft and verify in
// benchmarks/ar_b1_ab_h200.json, round 2).
__host__ __device__ __forceinline__ int min_chunk_keys(const BlockAttentionParams& p) {
  return p.batch == 1 && p.num_tokens == 1 ? kMinChunkOneToken : kMinChunk;
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// How many m16 tiles a CTA holds for M query rows: 1, 2 or 4 (3 is padded to 4 so that
// the 4 warps split evenly between m-tiles and key quarters).
__host__ __device__ constexpr int m_tiles_for(int rows) { return rows <= 16 ? 1 : rows <= 32 ? 2 : kMaxMTiles; }

// Keys per shared-memory tile at head_dim d: 64, but 32 at d = 256, where acc alone takes
// 128 registers a thread: a warp that takes all of a tile's keys (MT = 4) has room for 32
// scores but not 64 (ptxas spills), and a stage of K and V stays at 33 KB as at d = 128.
// With 32-key tiles one m-tile's 4 warps would get 8 keys each, less than a k16 step of
// P.V, so at d = 256 a CTA holds at least 2 m-tiles (min_m_tiles_for).
__host__ __device__ constexpr int tile_keys_for(int d) { return d <= 128 ? kTileKeys : 32; }
__host__ __device__ constexpr int min_m_tiles_for(int d) { return d <= 128 ? 1 : 2; }

// ---------------------------------------------------------------------------------------------
// PTX wrappers

// Four 8x8 b16 matrices; lane i gives the address of row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// D(16x8 fp32) += A(16x16) * B(16x8), A row-major, B column-major.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats -> one register of two 16-bit values (low half = first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

template <typename T>
__device__ __forceinline__ void store4(T* dst, float4 v) {  // dst 8-byte aligned
  uint2 packed = make_uint2(pack2<T>(v.x, v.y), pack2<T>(v.z, v.w));
  *reinterpret_cast<uint2*>(dst) = packed;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ void fma4(float4& acc, float w, float4 x) {
  acc.x = fmaf(w, x.x, acc.x);
  acc.y = fmaf(w, x.y, acc.y);
  acc.z = fmaf(w, x.z, acc.z);
  acc.w = fmaf(w, x.w, acc.w);
}

// A float4 of results to out: rounded to bf16/fp16 (dst 8-byte aligned) or as is (16-byte).
template <typename T>
__device__ __forceinline__ void store_out4(T* dst, float4 v) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(dst) = v;
  } else {
    store4<T>(dst, v);
  }
}

// ---------------------------------------------------------------------------------------------
// Which keys a row can see at all, and which split of them this CTA takes.

struct RowKeys {
  int t_first, t_last;  // the tokens of this CTA's query rows
  int lo;               // first cache row read
  int n_cache;          // cache rows lo .. lo + n_cache - 1
  int n_keys;           // n_cache + block rows
  int begin;            // this split's virtual keys: [begin, end)
  int end;
};

__device__ __forceinline__ RowKeys row_keys(const BlockAttentionParams& p, int ctx, int qs, int cta_rows, int q_chunk,
                                            int split, int num_splits) {
  const int group = p.num_q_heads / p.num_kv_heads;
  RowKeys r;
  r.t_first = q_chunk * cta_rows / group;
  r.t_last = min(p.num_tokens - 1, (q_chunk * cta_rows + cta_rows - 1) / group);
  // The CTA's earliest query has the strictest window, its latest the loosest causal limit:
  // keys outside [lo, hi) are invisible to all of its queries (for a long prefill this also
  // keeps early query chunks from reading keys that only later chunks see).
  r.lo = p.window > 0 ? max(0, qs + r.t_first - p.window + 1) : 0;
  const int hi = p.causal ? min(ctx, qs + r.t_last + 1) : ctx;
  r.n_cache = max(0, hi - r.lo);
  const int n_blk = p.k_blk == nullptr ? 0 : p.causal ? r.t_last + 1 : p.num_tokens;
  r.n_keys = r.n_cache + n_blk;
  // Per-row chunk: every row uses at most num_splits CTAs whatever its length, so results
  // never depend on the host's max_keys hint; short rows leave their last CTAs empty.
  int chunk = ceil_div(r.n_keys, num_splits);
  chunk = max(min_chunk_keys(p), ceil_div(chunk, kTileKeys) * kTileKeys);
  r.begin = min(split * chunk, r.n_keys);
  r.end = min(r.begin + chunk, r.n_keys);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Combine: one warp per (b, t, head) row merges the num_splits partials of either kernel
//   out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),  M = max_s lse_s.
// Every split writes every row's partial, an empty one lse = -inf and o = 0 (both attention
// kernels), so its weight is 0 and adding it adds 0. With many splits (up to 64; 33 at
// batch 1 and 32k context on the H100) a loop that loads split s + 1 only after using split
// s waits out two memory latencies per split, so no load here waits on another: the lanes
// read 32 splits' lse at once (row max and weights), and the weighted sum, branch-free, is
// unrolled so that the o rows of 8 splits are in flight, each weight broadcast from the lane
// that computed it. The o rows past the last split with a key are not read: they would add
// exact zeros, and a graph's split count follows its context bucket's bound on the keys
// (graphs.py), not the context, so an AR step early in its bucket has its last splits empty
// (attn-trim in benchmarks/ar_b1_ab_h200.json, session 34, measured when the bound was the
// cache's capacity).
// Lane l holds columns 4 l .. 4 l + 3 of each 128-column group (NC groups: d <= 128 NC).

// One row's merge, by one warp: lse_at(s) is split s's log-sum-exp, o_at(s) its D floats.
// The combine kernel reads them from the global partials; a cluster's first CTA from its
// CTAs' shared memory (below), with the same arithmetic in the same order.
template <typename T, int NC, typename Lse, typename Part>
__device__ __forceinline__ void combine_row(int num_splits, int head_dim, int lane, Lse lse_at, Part o_at,
                                            T* __restrict__ out) {
  float mx = -INFINITY;
  for (int s = lane; s < num_splits; s += 32) mx = fmaxf(mx, lse_at(s));
  mx = warp_max(mx);
  const float m_use = mx == -INFINITY ? 0.f : mx;
  float wsum = 0.f;  // this lane's splits' weights
  float4 o[NC];
  int load_col[NC];  // a lane past head_dim reads the last columns again (no branch in the
                     // loop below) and does not store them
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    o[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    load_col[c] = min(4 * lane + 128 * c, head_dim - 4);
  }
  for (int s0 = 0; s0 < num_splits; s0 += 32) {
    const float lse = s0 + lane < num_splits ? lse_at(s0 + lane) : -INFINITY;
    const float w_lane = lse == -INFINITY ? 0.f : exp2f(lse - m_use);
    wsum += w_lane;
    const int n = 32 - __clz(__ballot_sync(0xffffffffu, lse != -INFINITY));  // past num_splits: -inf
#pragma unroll 8
    for (int j = 0; j < n; ++j) {
      const float w = __shfl_sync(0xffffffffu, w_lane, j);
      const float* src = o_at(s0 + j);
#pragma unroll
      for (int c = 0; c < NC; ++c) fma4(o[c], w, *reinterpret_cast<const float4*>(src + load_col[c]));
    }
  }
  wsum = warp_sum(wsum);
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;  // 0: no visible key in any split -> zeros
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int col = 4 * lane + 128 * c;
    if (col < head_dim) store_out4<T>(out + col, make_float4(o[c].x * inv, o[c].y * inv, o[c].z * inv, o[c].w * inv));
  }
}

// A cluster's merge (a launch with cluster_combine: the num_splits CTAs of one (row, KV head,
// query chunk) form one cluster, sm_90 on): each CTA has left its rows' normalised partials in
// its shared memory, o_s [CR][D] and lse_s [CR]; the first CTA's warps merge them row by row
// (combine_row), reading the others' shared memory, and store the output: no partials in
// global memory and no combine launch. Query rows first_row .. first_row + cta_rows - 1 are
// the CTA's, those below `rows` real; out_row(r) is query row r's output row.
template <typename T, int D, typename OutRow>
__device__ __forceinline__ void merge_cluster(const float* o_s, const float* lse_s, T* out, int rows, int first_row,
                                              int cta_rows, OutRow out_row, int num_splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every split's partials are in its shared memory
  if (cluster.block_rank() == 0) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int rr = warp; rr < cta_rows && first_row + rr < rows; rr += kWarps)
      combine_row<T, D <= 128 ? 1 : 2>(
          num_splits, D, lane, [&](int s) { return cluster.map_shared_rank(lse_s, s)[rr]; },
          [&](int s) { return cluster.map_shared_rank(o_s, s) + rr * D; }, out + out_row(first_row + rr) * D);
  }
  cluster.sync();  // no CTA leaves while the first reads its shared memory
#endif
}

// ---------------------------------------------------------------------------------------------
// The attention kernel. grid = (num_splits, Hkv * q_chunks, bs), block = 128 threads.

// Two CTAs per SM at d = 128 (about 250 registers a thread, 70 KB of shared memory each):
// a third would need spills, and two already keep two 32 KB tiles per SM in flight, more
// than the bandwidth-latency product of HBM3 per SM (about 20 KB). d = 256 keeps that: its
// 32-key tiles are 33 KB too, and K/V stages plus Q take 83 or 99 KB (MT = 2 or 4).
template <typename T, int D, int MT, int TK>
__global__ void __launch_bounds__(kThreads, 2)
    block_attention_kernel(const BlockAttentionParams p, int num_splits, float* __restrict__ o_part,
                           float* __restrict__ lse_part, bool cluster_combine) {
  constexpr int KG = kWarps / MT;      // warps per m-tile, each on its own slice of every tile
  constexpr int NK = TK / KG;          // keys per warp per tile: 16, 32 or 64 (d = 256: 16 or 32)
  constexpr int STRIDE = D + 8;        // shared row stride in elements: the 16-byte pad puts the
                                       // 8 rows of an ldmatrix in 8 different bank groups
  constexpr int TILE = TK * STRIDE;
  static_assert(D == 64 || D == 128 || D == 256, "head_dim");
  static_assert(NK % 16 == 0, "a warp's key slice must be whole k16 steps of P.V");
  pdl_wait();
  pdl_allow_dependents();
  static_assert(kTileKeys % TK == 0, "split chunks (multiples of kTileKeys) must be whole tiles");
  static_assert(TK * D / 8 % kThreads == 0, "every thread copies the same number of 16-byte chunks");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);  // [stage][K | V][TK][STRIDE], then Q at d = 256

  const int split = blockIdx.x;
  const int kvh = blockIdx.y % p.num_kv_heads;
  const int q_chunk = blockIdx.y / p.num_kv_heads;
  const int b = blockIdx.z;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int rows = p.num_tokens * group;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int mt = warp % MT, kg = warp / MT;
  const int gid = lane / 4, tig = lane % 4;  // mma fragment coordinates: row gid (+8), column 2*tig (+1)

  const int slot = p.slots[b];
  const int ctx = max(p.ctx_len[b], 0);
  const int qs = p.q_start[b];
  constexpr int CR = MT * 16;  // query rows per CTA: query chunk q_chunk is rows [CR q_chunk, CR q_chunk + CR)
  const RowKeys rk = row_keys(p, ctx, qs, CR, q_chunk, split, num_splits);

  // ---- Q fragments (A operand of Q.K^T). Rows past M are zero. ----------------------------
  // Up to d = 128 they stay in registers for the whole key loop: this thread's two rows,
  // r = gid and gid + 8 of its m-tile. At d = 256 they would take 64 registers next to the
  // 128 of acc and spill; they wait in shared memory instead (after the K/V stages) and
  // each k16 step of Q.K^T reloads its fragment with one ldmatrix.
  constexpr bool kQInRegs = D <= 128;
  const T* q = static_cast<const T*>(p.q);
  T* q_s = smem + 2 * 2 * TILE;  // [MT * 16][STRIDE], d = 256 only
  uint32_t qf[kQInRegs ? D / 16 : 1][4];
  int q_pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = q_chunk * CR + mt * 16 + gid + 8 * h;
    const int t = r / group;
    q_pos[h] = qs + t;
    if constexpr (kQInRegs) {
      const bool valid = r < rows;
      const T* src =
          q + (valid ? b * p.q_stride[0] + t * p.q_stride[1] + (kvh * group + r % group) * p.q_stride[2] : 0);
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        qf[ks][h] = valid ? *reinterpret_cast<const uint32_t*>(src + ks * 16 + 2 * tig) : 0u;
        qf[ks][h + 2] = valid ? *reinterpret_cast<const uint32_t*>(src + ks * 16 + 8 + 2 * tig) : 0u;
      }
    }
  }
  if constexpr (!kQInRegs) {
    // The CTA's MT * 16 rows, one per step, thread i copying columns 2i and 2i + 1 with a
    // 4-byte cp.async (q is only 4-byte aligned). They join the first K/V tile's group, so
    // the key loop's first wait + __syncthreads publishes them.
    static_assert(D / 2 == kThreads, "one row per step");
    const int r0 = q_chunk * CR;
    int t = r0 / group, hq = r0 % group;  // row r0 + rr: token t, head kvh * group + hq
    for (int rr = 0; rr < MT * 16; ++rr) {
      const bool valid = r0 + rr < rows;  // else zeros, from any valid address
      const T* src = valid ? q + b * p.q_stride[0] + t * p.q_stride[1] + (kvh * group + hq) * p.q_stride[2] : q;
      cp_async_4(q_s + rr * STRIDE + 2 * threadIdx.x, src + 2 * threadIdx.x, valid ? 4 : 0);
      if (++hq == group) {
        hq = 0;
        ++t;
      }
    }
  }

  // ---- K/V tile loader: TK keys x D, 16 bytes per copy, spread over all 128 threads. -------
  const T* k_cache = static_cast<const T*>(p.k_cache);
  const T* v_cache = static_cast<const T*>(p.v_cache);
  const T* k_blk = static_cast<const T*>(p.k_blk);
  const T* v_blk = static_cast<const T*>(p.v_blk);
  const int64_t k_slot_base = slot * p.k_cache_stride[0] + kvh * p.k_cache_stride[2];
  const int64_t v_slot_base = slot * p.v_cache_stride[0] + kvh * p.v_cache_stride[2];
  auto load_tile = [&](int stage, int v0) {
    T* ks = smem + stage * 2 * TILE;
    T* vs = ks + TILE;
    constexpr int kChunksPerRow = D / 8;
#pragma unroll
    for (int i = 0; i < TK * kChunksPerRow / kThreads; ++i) {
      const int c = threadIdx.x + i * kThreads;  // consecutive threads: consecutive 16 B of a row
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const int v = v0 + r;
      // Rows past the keys copy zeros: their zero K gives a finite score that the mask removes,
      // their zero V keeps 0 * V finite.
      const T* ksrc = k_cache;  // any valid address when nothing is read
      const T* vsrc = v_cache;
      int bytes = 0;
      if (v < rk.end) {
        bytes = 16;
        if (v < rk.n_cache) {
          ksrc = k_cache + k_slot_base + (rk.lo + v) * p.k_cache_stride[1] + col;
          vsrc = v_cache + v_slot_base + (rk.lo + v) * p.v_cache_stride[1] + col;
        } else {
          const int j = v - rk.n_cache;
          ksrc = k_blk + b * p.k_blk_stride[0] + j * p.k_blk_stride[1] + kvh * p.k_blk_stride[2] + col;
          vsrc = v_blk + b * p.v_blk_stride[0] + j * p.v_blk_stride[1] + kvh * p.v_blk_stride[2] + col;
        }
      }
      cp_async_16(ks + r * STRIDE + col, ksrc, bytes);
      cp_async_16(vs + r * STRIDE + col, vsrc, bytes);
    }
  };

  // ---- Online softmax state (log2 domain) for rows gid and gid + 8. -----------------------
  // m: running max of scaled scores (-inf until a key is seen), l: this thread's partial
  // sum of exp2(s - m) (the quad's four partials are summed at the end), acc: P.V.
  const float scale_log2 = p.scale * kLog2e;
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  const int num_tiles = ceil_div(rk.end - rk.begin, TK);
  const int kw = kg * NK;  // this warp's slice of every tile
  if (num_tiles > 0) load_tile(0, rk.begin);
  cp_async_commit();

  for (int it = 0; it < num_tiles; ++it) {
    // Prefetch the next tile into the other stage (always commit, so wait_group<1> below
    // means "the tile for this iteration has landed").
    if (it + 1 < num_tiles) load_tile((it + 1) & 1, rk.begin + (it + 1) * TK);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const int v0 = rk.begin + it * TK;
    const T* ks = smem + (it & 1) * 2 * TILE;
    const T* vs = ks + TILE;

    // S = Q.K^T for this warp's NK keys: NK / 8 n-tiles. One ldmatrix.x4 gives the B
    // fragments of two n-tiles (keys kw + 16 jp .. + 15) for one k16 step of head_dim.
    float s[NK / 8][4];
#pragma unroll
    for (int j = 0; j < NK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd) {
      // From shared: lane i addresses row i % 16, column (i / 16) * 8 of the 16 x 16 A block,
      // so the four 8 x 8 matrices land as qf[kd][0..3] of the register path: rows gid and
      // gid + 8, columns 2 tig (+1), then the same rows at columns 8 + 2 tig.
      if constexpr (!kQInRegs) ldmatrix_x4(qf[0], q_s + (mt * 16 + lane % 16) * STRIDE + kd * 16 + (lane / 16) * 8);
      const uint32_t(&qa)[4] = qf[kQInRegs ? kd : 0];
#pragma unroll
      for (int jp = 0; jp < NK / 16; ++jp) {
        uint32_t kb[4];
        ldmatrix_x4(kb, ks + (kw + jp * 16 + (lane / 16) * 8 + lane % 8) * STRIDE + kd * 16 + ((lane / 8) & 1) * 8);
        mma_16816<T>(s[2 * jp], qa, kb[0], kb[1]);
        mma_16816<T>(s[2 * jp + 1], qa, kb[2], kb[3]);
      }
    }

    // Mask. Most tiles are plain context that every query of the row sees; test that once
    // per tile and skip the per-element checks for them.
    const bool all_visible = v0 + TK <= rk.end && v0 + TK <= rk.n_cache &&
                             (!p.causal || rk.lo + v0 + TK - 1 <= qs + rk.t_first) &&
                             (p.window <= 0 || rk.lo + v0 > qs + rk.t_last - p.window);
#pragma unroll
    for (int j = 0; j < NK / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * scale_log2;
        if (!all_visible) {
          const int v = v0 + kw + j * 8 + 2 * tig + (e & 1);
          const int qp = q_pos[e / 2];
          const int kp = v < rk.n_cache ? rk.lo + v : qs + (v - rk.n_cache);
          const bool visible = v < rk.end && (!p.causal || kp <= qp) && (p.window <= 0 || kp > qp - p.window);
          if (!visible) x = -INFINITY;
        }
        s[j][e] = x;
      }
    }

    // Online softmax update. A row's scores in this warp live in the 4 lanes of a quad
    // (two per n-tile each), so a row reduction is a local one plus two xor-shuffles.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < NK / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[h], mx);
      // While nothing is visible m_new is -inf; subtracting 0 instead keeps exp2 at 0
      // rather than NaN (-inf - -inf).
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_run[h] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < NK / 8; ++j) {
        s[j][2 * h] = exp2f(s[j][2 * h] - m_use);
        s[j][2 * h + 1] = exp2f(s[j][2 * h + 1] - m_use);
        sum += s[j][2 * h] + s[j][2 * h + 1];
      }
      l_run[h] = l_run[h] * alpha + sum;
      m_run[h] = m_new;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][2 * h] *= alpha;
        acc[n][2 * h + 1] *= alpha;
      }
    }

    // acc += P.V. The C fragments of n-tiles 2k and 2k+1 are exactly the A fragment of
    // k16 step k; V's B fragments come from ldmatrix.trans (V is [key][d] in shared).
#pragma unroll
    for (int kk = 0; kk < NK / 16; ++kk) {
      const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, vs + (kw + kk * 16 + ((lane / 8) & 1) * 8 + lane % 8) * STRIDE + n * 8 + (lane / 16) * 8);
        mma_16816<T>(acc[n], pa, vb[0], vb[1]);
        mma_16816<T>(acc[n + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // everyone is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- Merge the KG warps of each m-tile through shared memory (reusing the K/V tiles). ---
  // o_s[warp][16][D] (unnormalised), m_s/l_s[warp][16].
  float* o_s = reinterpret_cast<float*>(smem_raw);
  float* m_s = o_s + kWarps * 16 * D;
  float* l_s = m_s + kWarps * 16;
  float* lse_s = l_s + kWarps * 16;  // [CR]: a cluster's partials (merge_cluster)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int r = gid + 8 * h;
    if (tig == 0) {
      m_s[warp * 16 + r] = m_run[h];
      l_s[warp * 16 + r] = l;
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(o_s + (warp * 16 + r) * D + n * 8 + 2 * tig) =
          make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
  }
  __syncthreads();

  // Each thread finishes 4 consecutive columns of one row at a time (coalesced stores).
  T* out = static_cast<T*>(p.out);
  const int T_ = p.num_tokens;
  for (int idx = threadIdx.x; idx < MT * 16 * (D / 4); idx += kThreads) {
    const int rr = idx / (D / 4), col = (idx % (D / 4)) * 4;
    const int r = q_chunk * CR + rr;
    if (r >= rows) continue;
    const int t = r / group, head = kvh * group + r % group;
    const int tile = rr / 16, row16 = rr % 16;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < KG; ++w) mx = fmaxf(mx, m_s[(w * MT + tile) * 16 + row16]);
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float l = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < KG; ++w) {
      const int wr = (w * MT + tile) * 16 + row16;  // warp w*MT + tile holds this m-tile's slice w
      const float c = exp2f(m_s[wr] - m_use);
      l += c * l_s[wr];
      const float4 x = *reinterpret_cast<const float4*>(o_s + wr * D + col);
      o.x += c * x.x; o.y += c * x.y; o.z += c * x.z; o.w += c * x.w;
    }
    // l == 0: no visible key (empty split, or a fully masked query): zeros, lse = -inf.
    const float inv = l > 0.f ? 1.f / l : 0.f;
    o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
    const int64_t row_index = (static_cast<int64_t>(b) * T_ + t) * p.num_q_heads + head;
    if (num_splits == 1) {
      store4<T>(out + row_index * D + col, o);
    } else if (cluster_combine) {
      // Row rr of o_s is read only by this thread's item (the slices of the other warps sit
      // past row CR), so the partial can replace it in place.
      *reinterpret_cast<float4*>(o_s + rr * D + col) = o;
      if (col == 0) lse_s[rr] = l > 0.f ? m_use + log2f(l) : -INFINITY;
    } else {
      const int64_t part_row = static_cast<int64_t>(split) * p.batch * T_ * p.num_q_heads + row_index;
      *reinterpret_cast<float4*>(o_part + part_row * D + col) = o;
      if (col == 0) lse_part[part_row] = l > 0.f ? m_use + log2f(l) : -INFINITY;
    }
  }
  if (cluster_combine) {
    const auto out_row = [&](int r) {
      return (static_cast<int64_t>(b) * T_ + r / group) * p.num_q_heads + kvh * group + r % group;
    };
    merge_cluster<T, D>(o_s, lse_s, out, rows, q_chunk * CR, CR, out_row, num_splits);
  }
}

// ---------------------------------------------------------------------------------------------
template <typename T, int NC>
__global__ void __launch_bounds__(kThreads)
    block_attention_combine_kernel(int64_t num_rows, int head_dim, int num_splits, const float* __restrict__ o_part,
                                   const float* __restrict__ lse_part, T* __restrict__ out) {
  pdl_wait();
  pdl_allow_dependents();  // o_proj reads this output next (pdl.h)
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= num_rows) return;  // whole warps: the shuffles below see all 32 lanes
  combine_row<T, NC>(
      num_splits, head_dim, lane, [&](int s) { return lse_part[s * num_rows + row]; },
      [&](int s) { return o_part + (s * num_rows + row) * head_dim; }, out + row * head_dim);
}

// ---------------------------------------------------------------------------------------------
// fp32. Tensor cores have no fp32 mma (TF32 would give up the precision fp32 is chosen for),
// so this is a CUDA-core kernel, written for correctness runs (fp32 engines, tests) rather
// than speed. Same semantics, same split + combine scheme, same graph safety as above.
//
// One warp per query row (b, t, head) and key split. The 4 warps of a CTA are consecutive
// heads of one token, so with GQA they read the same K/V rows (shared through L1). One
// query's visible keys are two contiguous ranges, cache rows [lo, hi) and block rows
// [j_lo, j_hi), so no per-key mask is needed; they are numbered virtually as in row_keys
// and a split takes a contiguous share. Lane l holds the head-dim columns 4l .. 4l + 3 (and
// 128 further for d > 128). Per tile of 32 keys: each lane dots its columns with every key
// (coalesced 16-byte loads of whole rows), a butterfly transpose-reduce leaves key l's
// score in lane l (31 shuffles for 32 sums), one online-softmax step in the exp2 domain,
// then P.V with each key's p broadcast from its lane.

constexpr int kF32TileKeys = 32;  // one key per lane

struct QueryKeys {
  int lo;       // first cache row read
  int n_cache;  // cache rows lo .. lo + n_cache - 1
  int j_lo;     // first block row read
  int begin;    // this split's virtual keys: [begin, end)
  int end;
};

__device__ __forceinline__ QueryKeys query_keys(const BlockAttentionParams& p, int ctx, int qs, int t, int split,
                                                int num_splits) {
  QueryKeys r;
  const int qp = qs + t;
  r.lo = p.window > 0 ? max(0, qp - p.window + 1) : 0;
  const int hi = p.causal ? min(ctx, qp + 1) : ctx;
  r.n_cache = max(0, hi - r.lo);
  // Block row j sits at qs + j: causal keeps j <= t, the window j > t - window.
  r.j_lo = p.window > 0 ? max(0, t - p.window + 1) : 0;
  const int j_hi = p.k_blk == nullptr ? 0 : p.causal ? t + 1 : p.num_tokens;
  const int n_keys = r.n_cache + max(0, j_hi - r.j_lo);
  // As in row_keys: the chunk depends on this query's keys and num_splits only.
  int chunk = ceil_div(n_keys, num_splits);
  chunk = max(kMinChunk, ceil_div(chunk, kF32TileKeys) * kF32TileKeys);
  r.begin = min(split * chunk, n_keys);
  r.end = min(r.begin + chunk, n_keys);
  return r;
}

// x[j] holds this lane's partial sum for key j; afterwards x[0] holds key `lane`'s total.
// Step W pairs keys j and j + W: lanes with bit W set keep the upper one, the others the
// lower, and each adds its partner's copy of the key it keeps.
template <int W>
__device__ __forceinline__ void transpose_reduce_step(float (&x)[kF32TileKeys], int lane) {
  const bool upper = lane & W;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const float send = upper ? x[j] : x[j + W];
    const float keep = upper ? x[j + W] : x[j];
    x[j] = keep + __shfl_xor_sync(0xffffffffu, send, W);
  }
}

// grid = (ceil(bs * T * Hq / 4), num_splits), block = 128 threads. NV: float4 column groups
// per lane (d <= 128 * NV).
template <int NV>
__global__ void __launch_bounds__(kThreads)
    block_attention_fp32_kernel(const BlockAttentionParams p, int num_splits, float* __restrict__ o_part,
                                float* __restrict__ lse_part) {
  const int lane = threadIdx.x % 32;
  const int64_t num_rows = static_cast<int64_t>(p.batch) * p.num_tokens * p.num_q_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;  // (b * T + t) * Hq + head
  if (row >= num_rows) return;  // whole warps: nothing below syncs more than its own warp
  const int head = static_cast<int>(row % p.num_q_heads);
  const int t = static_cast<int>(row / p.num_q_heads % p.num_tokens);
  const int b = static_cast<int>(row / p.num_q_heads / p.num_tokens);
  const int kvh = head / (p.num_q_heads / p.num_kv_heads);
  const int split = blockIdx.y;
  const int slot = p.slots[b];
  const QueryKeys qk = query_keys(p, max(p.ctx_len[b], 0), p.q_start[b], t, split, num_splits);

  // This lane's columns: float4 groups c = lane + 32 i below d / 4.
  const int d4 = p.head_dim / 4;
  const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p.q) + b * p.q_stride[0] +
                                                    t * p.q_stride[1] + head * p.q_stride[2]);
  float4 qv[NV];
  float4 acc[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = lane + 32 * i;
    qv[i] = c < d4 ? q[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }

  // Virtual key v -> its K or V row.
  const float* k_cache = static_cast<const float*>(p.k_cache);
  const float* v_cache = static_cast<const float*>(p.v_cache);
  const float* k_blk = static_cast<const float*>(p.k_blk);
  const float* v_blk = static_cast<const float*>(p.v_blk);
  const int64_t k_base = slot * p.k_cache_stride[0] + kvh * p.k_cache_stride[2];
  const int64_t v_base = slot * p.v_cache_stride[0] + kvh * p.v_cache_stride[2];
  auto k_row = [&](int v) {
    const float* r = v < qk.n_cache ? k_cache + k_base + (qk.lo + v) * p.k_cache_stride[1]
                                    : k_blk + b * p.k_blk_stride[0] + (qk.j_lo + v - qk.n_cache) * p.k_blk_stride[1] +
                                          kvh * p.k_blk_stride[2];
    return reinterpret_cast<const float4*>(r);
  };
  auto v_row = [&](int v) {
    const float* r = v < qk.n_cache ? v_cache + v_base + (qk.lo + v) * p.v_cache_stride[1]
                                    : v_blk + b * p.v_blk_stride[0] + (qk.j_lo + v - qk.n_cache) * p.v_blk_stride[1] +
                                          kvh * p.v_blk_stride[2];
    return reinterpret_cast<const float4*>(r);
  };

  // Online softmax in the log2 domain. m: running max of the scaled scores; l: this lane's
  // share of sum exp2(s - m) (lane l's keys), summed over the warp at the end.
  const float scale_log2 = p.scale * kLog2e;
  float m_run = -INFINITY;
  float l_run = 0.f;
  for (int v0 = qk.begin; v0 < qk.end; v0 += kF32TileKeys) {
    const int n = min(kF32TileKeys, qk.end - v0);  // warp-uniform
    float x[kF32TileKeys];
#pragma unroll
    for (int j = 0; j < kF32TileKeys; ++j) {
      x[j] = 0.f;
      if (j < n) {
        const float4* k = k_row(v0 + j);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int c = lane + 32 * i;
          if (c < d4) {
            const float4 kv = k[c];
            x[j] = fmaf(qv[i].x, kv.x, fmaf(qv[i].y, kv.y, fmaf(qv[i].z, kv.z, fmaf(qv[i].w, kv.w, x[j]))));
          }
        }
      }
    }
    transpose_reduce_step<16>(x, lane);
    transpose_reduce_step<8>(x, lane);
    transpose_reduce_step<4>(x, lane);
    transpose_reduce_step<2>(x, lane);
    transpose_reduce_step<1>(x, lane);
    const float s = lane < n ? x[0] * scale_log2 : -INFINITY;  // key v0 + lane

    const float m_new = fmaxf(m_run, warp_max(s));
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // as above: exp2(-inf - -inf) would be NaN
    const float alpha = exp2f(m_run - m_use);
    const float pr = exp2f(s - m_use);
    l_run = l_run * alpha + pr;
    m_run = m_new;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      acc[i].x *= alpha; acc[i].y *= alpha; acc[i].z *= alpha; acc[i].w *= alpha;
    }
    // acc += P.V, key by key (rows coalesced across the lanes).
#pragma unroll 4
    for (int j = 0; j < n; ++j) {
      const float pj = __shfl_sync(0xffffffffu, pr, j);
      const float4* v = v_row(v0 + j);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int c = lane + 32 * i;
        if (c < d4) fma4(acc[i], pj, v[c]);
      }
    }
  }

  // l == 0: no visible key (empty split, or a fully masked query): zeros, lse = -inf.
  const float l = warp_sum(l_run);
  float4* dst;
  if (num_splits == 1) {
    dst = reinterpret_cast<float4*>(static_cast<float*>(p.out) + row * p.head_dim);
  } else {
    const int64_t part_row = split * num_rows + row;
    dst = reinterpret_cast<float4*>(o_part + part_row * p.head_dim);
    if (lane == 0) lse_part[part_row] = l > 0.f ? m_run + log2f(l) : -INFINITY;
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int c = lane + 32 * i;
    if (c < d4)
      dst[c] = l > 0.f ? make_float4(acc[i].x / l, acc[i].y / l, acc[i].z / l, acc[i].w / l)
                       : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}


// ---------------------------------------------------------------------------------------------
// Host side

int num_rows_per_kv_head(const BlockAttentionParams& p) { return p.num_tokens * (p.num_q_heads / p.num_kv_heads); }

template <typename T, int D, int MT, int TK>
constexpr size_t smem_bytes() {
  // max(two stages of K and V tiles + Q at d = 256, the merge buffers: o_s, m_s, l_s, lse_s)
  const size_t q_bytes = D > 128 ? MT * 16 * (D + 8) * sizeof(T) : 0;
  return std::max<size_t>(2 * 2 * TK * (D + 8) * sizeof(T) + q_bytes,
                          (kWarps * 16 * D + 3 * kWarps * 16) * sizeof(float));
}

template <typename T>
struct Type {
  using type = T;
};
template <int N>
using Int = std::integral_constant<int, N>;

// Calls f(Type<T>{}, Int<D>{}, Int<MT>{}, Int<TK>{}) for the tensor-core kernel instance with
// m_tiles m16 tiles per CTA for p (bf16/fp16; callers route fp32 to its own kernel first).
template <typename F>
auto dispatch(const BlockAttentionParams& p, int m_tiles, F&& f) {
  auto by_mt = [&](auto t, auto d) {
    constexpr int D = decltype(d)::value;
    constexpr int TK = tile_keys_for(D);
    switch (m_tiles) {  // 1 never comes at d = 256 (launch_plan), but must compile
      case 1: return f(t, d, Int<min_m_tiles_for(D)>{}, Int<TK>{});
      case 2: return f(t, d, Int<2>{}, Int<TK>{});
      default: return f(t, d, Int<4>{}, Int<TK>{});
    }
  };
  auto by_d = [&](auto t) {
    switch (p.head_dim) {
      case 64: return by_mt(t, Int<64>{});
      case 128: return by_mt(t, Int<128>{});
      default: return by_mt(t, Int<256>{});
    }
  };
  return p.dtype == DType::kBFloat16 ? by_d(Type<__nv_bfloat16>{}) : by_d(Type<__half>{});
}

// The kernel instance, with its dynamic shared memory limit raised: over 48 KB must be opted
// into, per device, so this runs before every launch (a cheap host call, legal during graph
// capture).
template <typename T, int D, int MT, int TK>
cudaError_t prepare(decltype(&block_attention_kernel<T, D, MT, TK>)* kernel) {
  *kernel = block_attention_kernel<T, D, MT, TK>;
  return cudaFuncSetAttribute(*kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem_bytes<T, D, MT, TK>()));
}

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// The fp32 kernel instance for p.head_dim.
using Fp32Kernel = decltype(&block_attention_fp32_kernel<1>);
Fp32Kernel fp32_kernel(const BlockAttentionParams& p) {
  return p.head_dim <= 128 ? block_attention_fp32_kernel<1> : block_attention_fp32_kernel<2>;
}

int fp32_num_splits(const BlockAttentionParams& p, int num_sms) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fp32_kernel(p), kThreads, 0) != cudaSuccess) per_sm = 1;
  // Each warp streams its own query's keys (latency-bound), so aim for about two waves of
  // resident warps; a split's partial (d + 1 floats) is small next to the K/V it reads, so
  // kMinChunk keys per split are plenty.
  const int64_t ctas = (static_cast<int64_t>(p.batch) * p.num_tokens * p.num_q_heads + kWarps - 1) / kWarps;
  const int64_t wanted = (2LL * std::max(per_sm, 1) * num_sms + ctas - 1) / ctas;
  const int by_length = ceil_div(p.max_keys, kMinChunk);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({by_length, wanted, kMaxSplits})));
}

// CTAs of the kernel instance with m_tiles m-tiles resident per SM (2 at d = 128 and 256), from
// the occupancy calculator, asked once per instance and device: an eager pass (prefill) plans
// every layer's launch, and the answer never changes.
int resident_ctas(const BlockAttentionParams& p, int m_tiles) {
  constexpr int kMaxDevices = 64;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  return dispatch(p, m_tiles, [&](auto t, auto d, auto mt, auto tk) {
    using T = typename decltype(t)::type;
    constexpr int D = decltype(d)::value, MT = decltype(mt)::value, TK = decltype(tk)::value;
    static std::atomic<int> known[kMaxDevices];  // per instance; 0: not asked yet
    if (device < kMaxDevices && known[device].load(std::memory_order_relaxed) > 0)
      return known[device].load(std::memory_order_relaxed);
    decltype(&block_attention_kernel<T, D, MT, TK>) kernel;
    int n = 0;
    if (prepare<T, D, MT, TK>(&kernel) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem_bytes<T, D, MT, TK>()) != cudaSuccess)
      return 1;  // not cached: ask again next time
    n = std::max(n, 1);
    if (device < kMaxDevices) known[device].store(n, std::memory_order_relaxed);
    return n;
  });
}

// How a bf16/fp16 launch is cut: 16 * m_tiles query rows per CTA, num_splits key shares per row.
struct LaunchPlan {
  int m_tiles;
  int num_splits;
};

LaunchPlan launch_plan(const BlockAttentionParams& p, int num_sms) {
  const int rows = num_rows_per_kv_head(p);
  const int min_mt = min_m_tiles_for(p.head_dim);
  LaunchPlan plan{std::max(m_tiles_for(rows), min_mt), 1};
  for (;;) {
    const int cta_rows = 16 * plan.m_tiles;
    const int ctas = p.batch * p.num_kv_heads * ceil_div(rows, cta_rows);
    // Every row gets num_splits CTAs whatever its length, so in a ragged batch the longest
    // rows' CTAs are the tail: aim for about four waves of resident CTAs, so that they are
    // short. Batch 1 cannot be ragged, and there each extra wave costs: one wave of two CTAs
    // per SM (T = 16 wants the second CTA; T = 1 and 8 would do a little better with one).
    // Larger batches keep four waves: the lengths are on the device, so the plan cannot tell
    // a ragged batch from a uniform one, and one wave costs a ragged batch more than four
    // cost a uniform one (commit 04f8836, BENCHMARKS.md at that commit, "Key splits").
    // But each split must read enough keys to pay for writing and re-reading its fp32
    // partial (M rows x d x 8 bytes against keys x d x 4 bytes of K/V): 8 * M keys keeps
    // that below 1/4 of the traffic, usually far below. Unknown lengths are not split.
    const int min_chunk = std::max(min_chunk_keys(p), 8 * std::min(rows, cta_rows));
    const int by_length = p.max_keys > 0 ? ceil_div(p.max_keys, min_chunk) : 1;
    const int resident = resident_ctas(p, plan.m_tiles);
    const int wanted = p.batch == 1 ? std::max(1, std::min(resident, 2) * num_sms / ctas)
                                    : ceil_div(4 * resident * num_sms, ctas);
    plan.num_splits = std::max(1, std::min({by_length, wanted, kMaxSplits}));
    // A short context at batch 1 leaves most SMs idle even split to the minimum chunk (T = 16
    // at context 512: 16 CTAs of 64 rows). Then fewer rows per CTA put more SMs to work, at
    // the price of re-reading K/V from L2 once per query chunk, a price that grows with the
    // context; once the launch has half the SMs' worth of CTAs, too few SMs are idle to pay
    // for it (commit 04f8836, BENCHMARKS.md at that commit, "Block attention kernel").
    if (plan.m_tiles == min_mt || 2 * ctas * plan.num_splits >= num_sms) return plan;
    plan.m_tiles /= 2;
  }
}

// Whether a bf16/fp16 launch merges its splits in clusters (merge_cluster) rather than through
// global partials and the combine kernel: one token at batch 1 (an AR step: latency-bound, its
// splits even) with 2 to 8 splits (a portable cluster), on devices that launch clusters (sm_90
// on). A block of tokens is not: the first CTA's merge of its rows made the draft and verify
// passes slower than the combine kernel (3dd4d01's draft and verify in
// benchmarks/ar_b1_ab_h200.json, round 2).
bool cluster_combines(const BlockAttentionParams& p, int num_splits) {
  return p.batch == 1 && p.num_tokens == 1 && num_splits >= 2 && num_splits <= kMaxClusterSplits &&
         device_attribute(cudaDevAttrClusterLaunch) > 0;
}

// Merges the split partials into p.out (after a launch with num_splits > 1).
template <typename T>
void launch_combine(const BlockAttentionParams& p, int num_splits, const float* o_part, const float* lse_part,
                    cudaStream_t stream) {
  const int64_t num_rows = static_cast<int64_t>(p.batch) * p.num_tokens * p.num_q_heads;
  const unsigned ctas = static_cast<unsigned>((num_rows + kWarps - 1) / kWarps);
  T* out = static_cast<T*>(p.out);
  const auto kernel = p.head_dim <= 128 ? block_attention_combine_kernel<T, 1> : block_attention_combine_kernel<T, 2>;
  pdl_launch(kernel, dim3(ctas), dim3(kThreads), 0, stream, true, num_rows, p.head_dim, num_splits, o_part, lse_part,
             out);
}

}  // namespace

const char* block_attention_check(const BlockAttentionParams& p) {
  if (!block_attention_supports(p.dtype, p.head_dim))
    return "unsupported dtype or head_dim (bf16/fp16: 64, 128 or 256; fp32: a multiple of 8 up to 256)";
  if (p.batch < 0 || p.num_tokens < 0) return "negative batch or num_tokens";
  if (p.num_kv_heads <= 0 || p.num_q_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0)
    return "num_q_heads must be a positive multiple of num_kv_heads";
  if (p.batch > 65535) return "batch must be <= 65535";
  if (!p.q || !p.k_cache || !p.v_cache || !p.slots || !p.ctx_len || !p.q_start || !p.out) return "null pointer";
  if ((p.k_blk == nullptr) != (p.v_blk == nullptr)) return "k_blk and v_blk must be given together";
  // 16-byte copies of cache and block rows; bf16/fp16: 4-byte loads of q, 8-byte stores of
  // out; fp32: 16-byte loads and stores of both.
  const bool fp32 = p.dtype == DType::kFloat32;
  const int per16 = fp32 ? 4 : 8;  // elements in 16 bytes
  auto rows16 = [per16](const void* ptr, const int64_t* stride) {
    return aligned(ptr, 16) && stride[0] % per16 == 0 && stride[1] % per16 == 0 && stride[2] % per16 == 0;
  };
  if (!rows16(p.k_cache, p.k_cache_stride) || !rows16(p.v_cache, p.v_cache_stride))
    return "cache rows must be 16-byte aligned (pointer and strides multiples of 16 bytes)";
  if (p.k_blk && (!rows16(p.k_blk, p.k_blk_stride) || !rows16(p.v_blk, p.v_blk_stride)))
    return "block K/V rows must be 16-byte aligned (pointer and strides multiples of 16 bytes)";
  if (fp32) {
    if (!rows16(p.q, p.q_stride)) return "fp32 q rows must be 16-byte aligned (pointer and strides multiples of 4)";
    if (!aligned(p.out, 16)) return "fp32 out must be 16-byte aligned";
    return nullptr;
  }
  if (!aligned(p.q, 4) || p.q_stride[0] % 2 || p.q_stride[1] % 2 || p.q_stride[2] % 2)
    return "q must be 4-byte aligned with even strides";
  if (!aligned(p.out, 8)) return "out must be 8-byte aligned";
  return nullptr;
}

int block_attention_num_splits(const BlockAttentionParams& p, int num_sms) {
  // Shapes only (no pointers needed): a TensorRT plugin sizes its workspace before it has data.
  if (p.max_keys <= 0 || p.batch <= 0 || p.num_tokens <= 0 || !block_attention_supports(p.dtype, p.head_dim) ||
      p.num_kv_heads <= 0 || p.num_q_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0)
    return 1;
  if (num_sms <= 0 && (num_sms = device_sms()) <= 0) return 1;
  if (p.dtype == DType::kFloat32) return fp32_num_splits(p, num_sms);
  return launch_plan(p, num_sms).num_splits;
}

size_t block_attention_workspace_bytes(const BlockAttentionParams& p, int num_splits) {
  if (num_splits <= 1) return 0;
  const size_t rows = static_cast<size_t>(num_splits) * p.batch * p.num_tokens * p.num_q_heads;
  return rows * (p.head_dim + 1) * sizeof(float);  // o_part, then lse_part
}

cudaError_t block_attention_launch(const BlockAttentionParams& p, int num_splits, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream) {
  if (block_attention_check(p) != nullptr || num_splits < 1) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.num_tokens == 0) return cudaSuccess;
  float* o_part = nullptr;
  float* lse_part = nullptr;
  if (num_splits > 1) {
    if (workspace == nullptr || !aligned(workspace, 16) ||
        workspace_bytes < block_attention_workspace_bytes(p, num_splits))
      return cudaErrorInvalidValue;
    o_part = static_cast<float*>(workspace);
    lse_part = o_part + static_cast<size_t>(num_splits) * p.batch * p.num_tokens * p.num_q_heads * p.head_dim;
  }
  if (p.dtype == DType::kFloat32) {
    const int64_t num_rows = static_cast<int64_t>(p.batch) * p.num_tokens * p.num_q_heads;
    const unsigned ctas = static_cast<unsigned>((num_rows + kWarps - 1) / kWarps);
    const Fp32Kernel kernel = fp32_kernel(p);
    kernel<<<dim3(ctas, num_splits), kThreads, 0, stream>>>(p, num_splits, o_part, lse_part);
    if (num_splits > 1) launch_combine<float>(p, num_splits, o_part, lse_part, stream);
    return cudaGetLastError();
  }
  // The plan's query rows per CTA for this device: with block_attention_num_splits' split
  // count it is that function's plan (any split count gives the same result).
  const int m_tiles = launch_plan(p, std::max(device_sms(), 1)).m_tiles;
  const dim3 grid(num_splits, p.num_kv_heads * ceil_div(num_rows_per_kv_head(p), 16 * m_tiles), p.batch);
  const bool cluster = cluster_combines(p, num_splits);
  return dispatch(p, m_tiles, [&](auto t, auto d, auto mt, auto tk) {
    using T = typename decltype(t)::type;
    constexpr int D = decltype(d)::value, MT = decltype(mt)::value, TK = decltype(tk)::value;
    decltype(&block_attention_kernel<T, D, MT, TK>) kernel;
    cudaError_t err = prepare<T, D, MT, TK>(&kernel);
    if (err != cudaSuccess) return err;
    err = pdl_launch_clustered(kernel, grid, dim3(kThreads), smem_bytes<T, D, MT, TK>(), stream, true,
                               cluster ? static_cast<unsigned>(num_splits) : 0u, p, num_splits, o_part, lse_part,
                               cluster);
    if (err != cudaSuccess) return err;
    if (num_splits > 1 && !cluster) launch_combine<T>(p, num_splits, o_part, lse_part, stream);
    return cudaGetLastError();
  });
}

}  // namespace dflash
