// One token's mixture-of-experts routing by one warp (semantics in moe_route.h): the routing
// kernel runs it for each of a pass's tokens, and the one-token expert kernels (moe.cu) in
// each of their CTAs, so that an AR step launches no routing kernel. One function, so both
// give the same picks and weights to the bit. Device code: include from .cu only.
//
// Lane l holds the logits of experts l, l + 32, ... (V per lane), so the softmax is two warp
// reductions (max, then the sum of exponentials) and each pick one warp arg-max over the
// values not picked yet, ties to the lower expert id.

#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "float_convert.h"

namespace dflash {

// (value, id) of the larger; equal values: the lower id (torch.topk's order on CPU)
__device__ __forceinline__ void keep_larger(float& v, int& id, float ov, int oid) {
  if (ov > v || (ov == v && oid < id)) {
    v = ov;
    id = oid;
  }
}

// The first `rounds` picks (rounds <= top_k <= 16) of the token whose logit of expert e is
// row[e es] (experts + 1 of them with `shared`, the last the shared expert's gate): ids[j] for
// j < rounds, and with rounds == top_k the weights too, w[j] (renormalised over the top_k
// where asked), and with `shared` pick top_k: expert `experts`, weight sigmoid(gate). A
// caller that needs one pick's expert only (a one-token gate_up CTA) stops at its round. V:
// at least experts / 32, rounded up. Every lane of the warp calls it; lanes write their own
// picks.
template <typename T, int V>
__device__ __forceinline__ void route_warp(const T* row, int64_t es, int experts, int top_k, int rounds,
                                           bool renormalize, bool shared, float* w, int32_t* ids) {
  const int lane = threadIdx.x % 32;
  float x[V];
  float hi = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = lane + 32 * i;
    x[i] = e < experts ? to_float(row[e * es]) : -FLT_MAX;
    hi = fmaxf(hi, x[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int e = lane + 32 * i;
    x[i] = e < experts ? expf(x[i] - hi) : 0.f;  // x becomes exp(logit - max); padding 0
    sum += x[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float inv = 1.f / sum;

  // lane r keeps pick r (k <= 16 < 32), so the picks are written at once, not looped over
  float picked_w = 0.f, total = 0.f;
  int picked_id = 0;
  for (int r = 0; r < rounds; ++r) {
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
  if (lane < rounds) {
    if (rounds == top_k) w[lane] = rounded<T>(renormalize ? picked_w * (1.f / total) : picked_w);
    ids[lane] = picked_id;
  } else if (shared && lane == top_k) {  // the shared expert: sigmoid of its gate, rounded like the logits
    w[lane] = rounded<T>(1.f / (1.f + expf(-to_float(row[experts * es]))));
    ids[lane] = experts;
  }
}

}  // namespace dflash
