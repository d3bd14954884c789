// Asynchronous global -> shared copies (cp.async, sm_80 on; device code: include from .cu only),
// shared by the block attention (block_attention.cu) and the routed experts (moe.cu). A copy of
// src_bytes below its size fills the rest of its destination with zeros (0: all zeros, nothing
// read). Copies complete in commit groups: cp_async_wait<N> returns once at most N of this
// thread's groups are still in flight.

#pragma once

#include <cstdint>

namespace dflash {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes through L2 only (.cg): data this SM reads once.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// 16 bytes kept in L1 as well (.ca): data this SM reads again soon.
__device__ __forceinline__ void cp_async_16_l1(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
// 4 bytes (.cg takes 16 bytes only), for rows that are only 4-byte aligned.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

}  // namespace dflash
