// Mixture-of-experts routing (semantics in moe_route.h).
//
// One warp per token (route_warp.h, which the one-token expert kernels run too).
//
// This file has no torch dependency: it compiles alone with
//   nvcc -std=c++17 -arch=sm_90 -c moe_route.cu

#include "moe_route.h"

#include "pdl.h"
#include "route_warp.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dflash {
namespace {

constexpr int kThreads = 128;  // 4 warps: 4 tokens per CTA
constexpr int kWarps = kThreads / 32;

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) moe_route_kernel(MoeRouteParams p) {
  pdl_wait();
  pdl_allow_dependents();
  const int token = blockIdx.x * kWarps + threadIdx.x / 32;
  if (token >= p.tokens) return;  // whole warps: the shuffles see all 32 lanes
  const int picks = p.top_k + (p.shared ? 1 : 0);
  route_warp<T, V>(static_cast<const T*>(p.logits) + token * p.token_stride, p.expert_stride, p.experts, p.top_k,
                   p.top_k, p.renormalize, p.shared, p.weights + static_cast<int64_t>(token) * picks,
                   p.ids + static_cast<int64_t>(token) * picks);
}

template <typename T>
cudaError_t launch_typed(const MoeRouteParams& p, cudaStream_t stream) {
  const dim3 grid((p.tokens + kWarps - 1) / kWarps);
  const int per_lane = (p.experts + 31) / 32;
  const auto kernel = per_lane <= 1   ? moe_route_kernel<T, 1>
                      : per_lane <= 2 ? moe_route_kernel<T, 2>
                      : per_lane <= 4 ? moe_route_kernel<T, 4>
                      : per_lane <= 8 ? moe_route_kernel<T, 8>
                                      : moe_route_kernel<T, 16>;
  return pdl_launch(kernel, grid, dim3(kThreads), 0, stream, true, p);
}

}  // namespace

const char* moe_route_check(const MoeRouteParams& p) {
  if (p.tokens < 0) return "tokens must be >= 0";
  if (p.experts < 1 || p.experts > kMoeRouteMaxExperts) return "experts must be in [1, 512]";
  if (p.top_k < 1 || p.top_k > p.experts || p.top_k > kMoeRouteMaxTopK) return "top_k must be in [1, min(experts, 16)]";
  if (p.tokens > 0 && (p.logits == nullptr || p.weights == nullptr || p.ids == nullptr)) return "null pointer";
  if (p.token_stride < 1 || p.expert_stride < 1) return "logits strides must be positive";
  return nullptr;
}

cudaError_t moe_route_launch(const MoeRouteParams& p, cudaStream_t stream) {
  if (moe_route_check(p) != nullptr) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kFloat32: return launch_typed<float>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dflash
