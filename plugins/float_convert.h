// fp32 <-> bf16/fp16 conversions shared by the kernels (device code: include from .cu only).
// from_float rounds to nearest even, as torch's .to(dtype) does.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace dflash {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

// x rounded to T (nearest even, as torch's .to(dtype)) and back: the value a torch op
// producing a T tensor hands to the next op (T = float: x itself).
template <typename T>
__device__ __forceinline__ float rounded(float x) { return to_float(from_float<T>(x)); }

}  // namespace dflash
