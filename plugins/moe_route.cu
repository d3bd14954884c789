// Mixture-of-experts routing (semantics in moe_route.h).
//
// One warp per token: lane l holds the logits of experts l, l + 32, ... (V per lane), so
// the softmax is two warp reductions (max, then the sum of exponentials) and each of the k
// picks one warp arg-max over the values not picked yet, ties to the lower expert id.
//
// This file has no torch dependency: it compiles alone with
//   nvcc -std=c++17 -arch=sm_90 -c moe_route.cu

#include "moe_route.h"

#include "float_convert.h"
#include "pdl.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

namespace dflash {
namespace {

constexpr int kThreads = 128;  // 4 warps: 4 tokens per CTA
constexpr int kWarps = kThreads / 32;

// (value, id) of the larger; equal values: the lower id (torch.topk's order on CPU)
__device__ __forceinline__ void keep_larger(float& v, int& id, float ov, int oid) {
  if (ov > v || (ov == v && oid < id)) {
    v = ov;
    id = oid;
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) moe_route_kernel(MoeRouteParams p) {
  pdl_wait();
  pdl_allow_dependents();
  const int lane = threadIdx.x % 32;
  const int token = blockIdx.x * kWarps + threadIdx.x / 32;
  if (token >= p.tokens) return;  // whole warps: the shuffles see all 32 lanes
  const int picks = p.top_k + (p.shared ? 1 : 0);
  const int64_t es = p.expert_stride;
  const T* row = static_cast<const T*>(p.logits) + token * p.token_stride;

  float x[V];
  float hi = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = lane + 32 * i;
    x[i] = e < p.experts ? to_float(row[e * es]) : -FLT_MAX;
    hi = fmaxf(hi, x[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = lane + 32 * i;
    x[i] = e < p.experts ? expf(x[i] - hi) : 0.f;  // x becomes exp(logit - max); padding 0
    sum += x[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float inv = 1.f / sum;

  // lane r keeps pick r (k <= 16 < 32), so the picks are written at once, not looped over
  float picked_w = 0.f, total = 0.f;
  int picked_id = 0;
  for (int r = 0; r < p.top_k; ++r) {
    float v = -1.f;  // probabilities are >= 0; used (picked or padding) values are -1
    int id = INT32_MAX;
#pragma unroll
    for (int i = 0; i < V; ++i) keep_larger(v, id, x[i] < 0.f ? -1.f : x[i] * inv, lane + 32 * i);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oid = __shfl_xor_sync(0xffffffffu, id, o);
      keep_larger(v, id, ov, oid);
    }
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (lane + 32 * i == id) x[i] = -1.f;  // the owner marks it used
    if (lane == r) {
      picked_w = v;
      picked_id = id;
    }
    total += v;
  }
  float* w = p.weights + static_cast<int64_t>(token) * picks;
  int32_t* ids = p.ids + static_cast<int64_t>(token) * picks;
  if (lane < p.top_k) {
    w[lane] = rounded<T>(p.renormalize ? picked_w * (1.f / total) : picked_w);
    ids[lane] = picked_id;
  } else if (p.shared && lane == p.top_k) {  // the shared expert: sigmoid of its gate, rounded like the logits
    w[lane] = rounded<T>(1.f / (1.f + expf(-to_float(row[p.experts * es]))));
    ids[lane] = p.experts;
  }
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
