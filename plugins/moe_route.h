// Mixture-of-experts routing of a pass in one kernel: softmax over the experts, the top k,
// optional renormalisation, the plain C++ launcher API (no torch types).
//
// Per layer and pass the router's output is a few hundred floats per token; as torch ops it
// is five or six tiny kernels (softmax, topk, sum, divide, two casts), and in a decode step
// of a 40-layer MoE those launches cost more than their work. One warp per token does it all.
//
// The Python reference with these semantics is dflash_trt.ops.moe_route:
//   p = softmax(float(logits[t])) over all E experts (fp32)
//   (w, ids) = the k largest p, largest first (equal values: the lower expert id first)
//   w = w / sum(w) if renormalize;  weights[t] = float(round(w to the logits' dtype))
// Sums run in the kernel's own order, so w may differ from torch's in the last fp32 place.
// With `shared`, the logits have a last column more, the shared expert's gate: each token gets
// a pick k + 1, expert E, of weight float(round(sigmoid(logits[t, E]))) (Qwen3.5 MoE's shared
// expert, run by the experts' kernels as one more expert).

#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "block_attention.h"  // dflash::DType

namespace dflash {

constexpr int kMoeRouteMaxExperts = 512;
constexpr int kMoeRouteMaxTopK = 16;

struct MoeRouteParams {
  DType dtype = DType::kBFloat16;  // of the logits: bf16, fp16 or fp32
  int tokens = 0;                  // N
  int experts = 0;                 // E, 1 .. kMoeRouteMaxExperts
  int top_k = 0;                   // k, 1 .. min(E, kMoeRouteMaxTopK)
  bool renormalize = false;
  bool shared = false;             // a shared expert's gate in logits column E (see above)
  const void* logits = nullptr;    // [N, E (+ 1 with shared)]: element (t, e) at t token_stride + e expert_stride
  int64_t token_stride = 0;        // elements, >= 1 (contiguous rows: E (+ 1), 1)
  int64_t expert_stride = 0;
  float* weights = nullptr;        // [N, k (+ 1)] out
  int32_t* ids = nullptr;          // [N, k (+ 1)] out
};

// nullptr when the launch would be valid, else why not.
const char* moe_route_check(const MoeRouteParams& p);
cudaError_t moe_route_launch(const MoeRouteParams& p, cudaStream_t stream);

}  // namespace dflash
