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

}  // namespace dflash
