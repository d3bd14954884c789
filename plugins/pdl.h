// Programmatic dependent launch (Hopper): a kernel launched with pdl_launch may start while the
// kernel before it in the stream still runs, up to its pdl_wait, which returns once that kernel
// has finished and its writes are visible. Before the wait a kernel may only read what no
// earlier kernel of the pass writes (weights) and write nothing; a matmul uses the time to pull
// its first weight lines into L2, so that its loads are in flight when the input is ready
// instead of starting from nothing after every small kernel. One exception: where the kernel
// before allows dependents only after its own wait, what the kernel two back wrote is complete
// before this one starts (the one-token MoE down projection reads its ids so, after the
// one-token gate_up, and checks them again after its wait).
//
// The kernel before it decides how early that can be: pdl_allow_dependents lets the next
// kernel's CTAs be scheduled on whatever the SMs have free from then on (without it, when this
// kernel's CTAs have all exited). Both are no-ops where the launch did not ask for overlap,
// and before sm_90.
//
// The small kernels of a pass (norms, RoPE, the conv, the delta rule, routing, attention) launch
// this way too, waiting first and allowing their successor right after: their CTAs are resident
// when the kernel before ends, instead of starting after its completion reaches the launcher
// (BENCHMARKS.md, "Engine: AR vs DFlash"; benchmarks/pdl_ab.json). The tensor-core matmul tiles
// launch plainly.

#pragma once

#include <cuda_runtime.h>

#include "device.h"

namespace dflash {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// Whether the current device takes programmatic dependent launches (sm_90 on).
inline bool pdl_supported() { return device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9; }

// kernel<<<grid, block, smem, stream>>>(args...), allowed to overlap the kernel before it where
// the device supports that (and `overlap` asks for it: else a plain launch); with cluster_x > 0
// the CTAs along x form clusters of that many (the caller checks the device launches clusters).
template <typename... Params, typename... Args>
cudaError_t pdl_launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                 bool overlap, unsigned cluster_x, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (overlap && pdl_supported()) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 0) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = cluster_x;
    attrs[n].val.clusterDim.y = attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  config.attrs = attrs;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

template <typename... Params, typename... Args>
cudaError_t pdl_launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool overlap,
                       Args... args) {
  return pdl_launch_clustered(kernel, grid, block, smem, stream, overlap, 0u, args...);
}

}  // namespace dflash
