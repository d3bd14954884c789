// A byte range for a latency-bound kernel to pull into L2 for the kernel after it: the next
// projection's weights, while this kernel leaves the memory bus mostly idle (an AR step's delta
// rule before out_proj, its attention before o_proj). A hint: results never depend on it.

#pragma once

#include <cstdint>

namespace dflash {

struct L2Prefetch {
  const void* ptr = nullptr;  // 16-byte aligned; null: nothing
  int64_t bytes = 0;          // a multiple of 16
};

#ifdef __CUDACC__
// The grid's threads issue one bulk L2 prefetch (sm_90 on) per kChunk bytes of the range, spread
// over the CTAs so that no SM issues them all. Call after the kernel's programmatic wait: before
// it, the kernel before would still be streaming its own weights.
__device__ __forceinline__ void prefetch_range_l2(const L2Prefetch& r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int64_t kChunk = 64 << 10;
  if (r.ptr == nullptr) return;
  const int64_t ctas = static_cast<int64_t>(gridDim.x) * gridDim.y * gridDim.z;
  const int64_t cta = blockIdx.x + gridDim.x * (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
  const int64_t cta_threads = static_cast<int64_t>(blockDim.x) * blockDim.y * blockDim.z;
  const int64_t thread = threadIdx.x + blockDim.x * (threadIdx.y + static_cast<int64_t>(blockDim.y) * threadIdx.z);
  for (int64_t t = thread;; t += cta_threads) {  // chunk c: CTA c % ctas, its thread c / ctas
    const int64_t c = cta + ctas * t, left = r.bytes - c * kChunk;
    if (left <= 0) break;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(static_cast<const char*>(r.ptr) + c * kChunk),
                 "r"(static_cast<uint32_t>(left < kChunk ? left : kChunk))
                 : "memory");
  }
#endif
}
#endif

}  // namespace dflash
