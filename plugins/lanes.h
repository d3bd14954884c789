// Warp-level pieces shared by the CUDA-core kernels (device code: include from .cu only).

#pragma once

#include <cuda_runtime.h>

#include "float_convert.h"

namespace dflash {

// The sum of x over the warp's 32 lanes, the same bits in every lane (an xor butterfly).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = __fadd_rn(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// A 16-byte chunk of eight 16-bit values (bf16 or fp16) as floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& chunk, float (&f)[8]) {
  static_assert(sizeof(T) == 2, "eight values per 16 bytes: bf16 or fp16");
  const T* e = reinterpret_cast<const T*>(&chunk);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
}

// Eight floats rounded to T (bf16 or fp16) as one 16-byte chunk: unpack8's inverse.
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  static_assert(sizeof(T) == 2, "eight values per 16 bytes: bf16 or fp16");
  uint4 chunk;
  T* e = reinterpret_cast<T*>(&chunk);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = from_float<T>(f[i]);
  return chunk;
}

// Chunks c0, c0 + 32, ..., c0 + 32 (U - 1) of each of the R rows (zeros past `chunks`), streamed:
// read once, evict first.
template <int R, int U>
__device__ __forceinline__ void load_chunks(const uint4* const (&rows)[R], int64_t c0, int64_t chunks,
                                            uint4 (&wv)[R][U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t c = c0 + 32 * u;
#pragma unroll
    for (int r = 0; r < R; ++r) wv[r][u] = c < chunks ? __ldcs(rows[r] + c) : make_uint4(0, 0, 0, 0);
  }
}

// acc[r] += the loaded chunks of row r . the same chunks of x (small, read by every warp: L1).
template <typename T, int R, int U>
__device__ __forceinline__ void dot_chunks(const uint4 (&wv)[R][U], const uint4* x, int64_t c0, int64_t chunks,
                                           float (&acc)[R]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t c = c0 + 32 * u;
    if (c >= chunks) break;
    float xf[8];
    unpack8<T>(__ldg(x + c), xf);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float wf[8];
      unpack8<T>(wv[r][u], wf);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[r] = fmaf(xf[i], wf[i], acc[r]);
    }
  }
}

// acc[r] += this lane's share of rows[r] . x (16-bit values, `chunks` 16-byte chunks each): chunks
// lane, lane + 32, ..., U of each row loaded at once, so that R U loads are in flight.
template <typename T, int R, int U>
__device__ __forceinline__ void lane_dots(const uint4* const (&rows)[R], const uint4* x, int64_t chunks, int lane,
                                          float (&acc)[R]) {
  for (int64_t c0 = lane; c0 < chunks; c0 += 32 * U) {
    uint4 wv[R][U];
    load_chunks<R, U>(rows, c0, chunks, wv);
    dot_chunks<T, R, U>(wv, x, c0, chunks, acc);
  }
}

// lane_dots with the next iteration's R U loads issued before this iteration's math: 2 R U loads
// in flight while the math runs, at twice the registers. The same sums in the same order.
template <typename T, int R, int U>
__device__ __forceinline__ void lane_dots_pipelined(const uint4* const (&rows)[R], const uint4* x, int64_t chunks,
                                                    int lane, float (&acc)[R]) {
  uint4 cur[R][U], next[R][U];
  load_chunks<R, U>(rows, lane, chunks, cur);
  for (int64_t c0 = lane; c0 < chunks; c0 += 32 * U) {
    load_chunks<R, U>(rows, c0 + 32 * U, chunks, next);
    dot_chunks<T, R, U>(cur, x, c0, chunks, acc);
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < R; ++r) cur[r][u] = next[r][u];
    }
  }
}

}  // namespace dflash
