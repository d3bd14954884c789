// Bulk global -> shared copies by the copy engine (cp.async.bulk, sm_90 on; device code: include
// from .cu only). One thread starts a copy of a whole contiguous range (16-byte aligned, a
// multiple of 16 bytes) and an mbarrier in shared memory counts its bytes in: the copy holds no
// registers and goes around L1's per-thread request tracking, so a CTA of a few warps keeps as
// many bytes in flight as its shared memory holds. Before sm_90 these compile to nothing: callers
// launch such kernels only where bulk_copy_supported().

#pragma once

#include <cstdint>

#include "cp_async.h"
#include "device.h"

namespace dflash {

inline bool bulk_copy_supported() { return device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9; }

// Before any copy signals it: one arrival expected per phase; the fence makes the barrier's
// initial state visible to the copy engine (its async proxy).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// The one arrival of the current phase, which also expects `bytes` more from copies.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

// Copy `bytes` from global src to shared dst; the barrier's phase completes once every byte it
// expects has landed.
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
#endif
}

// Returns once the barrier's phase of this parity (0 for the first) has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
#endif
}

}  // namespace dflash
