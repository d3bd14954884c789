// Warp tiles of skinny matmuls on mma.sync (device code: include from .cu only), shared by the
// routed experts (moe.cu) and the dense skinny matmul (gemv.cu).
//
// A warp applies 16-row tiles of A (weight rows: the MMA's M) to 8-column tiles of B (tokens or
// slots: the MMA's N, x rows in memory), summing over K in fp32 (m16n8k16 for bf16/fp16, m16n8k8
// TF32 for fp32). The operands are read in whole 16-byte chunks per lane, straight into the
// fragments: an MMA sums over its 16 (8) k positions in no particular order, so A and B may
// relabel them, as long as they do it alike. Lane (g, t) = (lane / 4, lane % 4) reads 16-byte
// chunk 4 kb + t of rows g and g + 8 (A) and of column g (B) in each 64-byte block kb of the
// rows; the block's first MMA takes each chunk's 32-bit words 0 and 1 where the fragment layout
// puts k pairs (2t, 2t + 1) and (2t + 8, 2t + 9) (TF32: k t and t + 4), the second MMA words 2
// and 3. A CTA's warps split K; their partial sums are added in warp order.
// fp32 runs three TF32 MMAs per step (x = big + small, big = x rounded to TF32, small =
// x - big rounded to TF32; big*big + big*small + small*big): each product is then within a few
// units in the last place of fp32, at the cost of three MMAs, which a memory-bound kernel has;
// each step's MMAs start from zero and their sum is added to the fp32 accumulator with a
// rounded add (mma_3xtf32 says why).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace dflash {
namespace mma_tile {

constexpr int kTileUnroll = 4;  // 64-byte k blocks per warp per iteration: 4 (2 MT + NT) loads in flight

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// fp32 bits -> (big, small) TF32 halves
__device__ __forceinline__ void split_tf32(uint32_t bits, uint32_t& big, uint32_t& small) {
  const float x = __uint_as_float(bits);
  big = tf32(x);
  small = tf32(x - __uint_as_float(big));
}

__device__ __forceinline__ void mma_3xtf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
  uint32_t ab[4], as[4], bb[2], bs[2];
  split_tf32(a0, ab[0], as[0]);
  split_tf32(a1, ab[1], as[1]);
  split_tf32(a2, ab[2], as[2]);
  split_tf32(a3, ab[3], as[3]);
  split_tf32(b0, bb[0], bs[0]);
  split_tf32(b1, bb[1], bs[1]);
  // The tensor cores' fp32 sums drop the bits below the largest addend's unit instead of
  // rounding, an error that would grow along K: each step sums in a fresh accumulator (small
  // terms first) and is added to the running sum with a rounded fp32 add.
  float t[4] = {};
  mma_tf32(t, as, bb);
  mma_tf32(t, ab, bs);
  mma_tf32(t, ab, bb);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] += t[i];
}

// D(16x8 fp32) += A(16x16) * B(16x8) in T's MMA (fp32: three TF32 ones), A row-major, B
// column-major, fragments as registers of two 16-bit values (fp32: one value).
template <typename T>
__device__ __forceinline__ void mma_step(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    mma_3xtf32(d, a0, a1, a2, a3, b0, b1);
  }
}

// The two MMAs of a lane's 16-byte chunks: rows g (lo) and g + 8 (hi) of A, column g of B.
template <typename T>
__device__ __forceinline__ void mma_chunk(float (&acc)[4], const uint4& lo, const uint4& hi, const uint4& b) {
  mma_step<T>(acc, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
  mma_step<T>(acc, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
}

// One warp's share of a CTA tile: acc[m][n] += (16 rows of m-tile m: a[2m] is row g's pointer,
// a[2m + 1] row g + 8's) x (8 slots of n-tile n: b[n] is slot g's row, null past the chunk),
// over the 64-byte k blocks part, part + W, ... of rows `chunks` 16-byte chunks long (W warps).
// kStreamA: A is read once per pass (a dense weight), so its loads evict first and leave the
// caches to B. U: k blocks per iteration (fewer for wide tiles, whose loads take more
// registers); a warp's blocks are summed in the same order whatever U is.
template <typename T, int W, int MT, int NT, bool kStreamA = false, int U = kTileUnroll>
__device__ __forceinline__ void warp_tile(const uint4* const (&a)[2 * MT], const uint4* const (&b)[NT],
                                          int64_t chunks, int part, float (&acc)[MT][NT][4]) {
  const int t = threadIdx.x % 4;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // Loads are never skipped (a branch around each would keep them from being in flight
  // together): past the rows' end or the chunk's slots they read a valid chunk and are zeroed.
  const uint4* bp[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) bp[n] = b[n] != nullptr ? b[n] : a[0];
  for (int64_t kb = part; 4 * kb < chunks; kb += W * U) {
    uint4 av[U][2 * MT], bv[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = 4 * (kb + u * W) + t, cc = c < chunks ? c : chunks - 1;
#pragma unroll
      for (int r = 0; r < 2 * MT; ++r) av[u][r] = kStreamA ? __ldcs(a[r] + cc) : __ldg(a[r] + cc);
#pragma unroll
      for (int n = 0; n < NT; ++n) bv[u][n] = __ldg(bp[n] + cc);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (4 * (kb + u * W) + t < chunks) continue;
#pragma unroll
      for (int r = 0; r < 2 * MT; ++r) av[u][r] = zero;
#pragma unroll
      for (int n = 0; n < NT; ++n) bv[u][n] = zero;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      if (b[n] != nullptr) continue;
#pragma unroll
      for (int u = 0; u < U; ++u) bv[u][n] = zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int n = 0; n < NT; ++n) mma_chunk<T>(acc[m][n], av[u][2 * m], av[u][2 * m + 1], bv[u][n]);
      }
    }
  }
}

// Adds the other warps' partial sums to warp 0's, in warp order; true in warp 0.
template <int W, int MT, int NT>
__device__ __forceinline__ bool sum_warps(float (&acc)[MT][NT][4], float (*part)[MT][NT][4][32]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp > 0) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[warp - 1][m][n][i][lane] = acc[m][n][i];
  }
  __syncthreads();
  if (warp > 0) return false;
#pragma unroll
  for (int w = 0; w < W - 1; ++w)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][n][i] += part[w][m][n][i][lane];
  return true;
}

}  // namespace mma_tile
}  // namespace dflash
