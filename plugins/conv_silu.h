// One channel's causal conv tap sum and SiLU at one token, shared by the conv kernel
// (layer_ops.cu) and the decode step that runs the conv itself (gated_delta.cu), so that both
// give the same bits. Device code: include from .cu only.

#pragma once

#include <cuda_runtime.h>

#include "float_convert.h"

namespace dflash {

// SiLU of sum_j win[j] w[j] over taps 0..W (win[W] is the token itself), each product and each
// partial sum rounded to T as torch's bf16/fp16 conv rounds them; the result before its own
// rounding to T (the caller stores it as a T).
template <typename T, int kMaxTaps>
__device__ __forceinline__ float conv_silu(const float (&win)[kMaxTaps], const float (&w)[kMaxTaps], int W) {
  float acc = rounded<T>(__fmul_rn(win[0], w[0]));
#pragma unroll
  for (int j = 1; j < kMaxTaps; ++j) {
    if (j <= W) acc = rounded<T>(__fadd_rn(acc, rounded<T>(__fmul_rn(win[j], w[j]))));
  }
  return acc / (1.0f + expf(-acc));
}

}  // namespace dflash
