// The Gated DeltaNet recurrence of a decode/verify pass, on the cache in place: the plain C++
// launcher API (no torch types), so a torch op (ops.cpp) and a TensorRT IPluginV3 can both
// wrap it.
//
// Row b (of bs), value head h (of Hv; it reads key head kh = h / (Hv / Hk)), in fp32:
//   S = state_cache[slots[b], h]  ([dk, dv]), or zeros when start[b] == 0 (a new sequence:
//       whatever an earlier occupant of the slot left there is ignored)
//   for t < min(num_tokens[b], T):
//     S = exp(g[b, t, h]) * S
//     delta = beta[b, t, h] * (v[b, t, h] - S^T k[b, t, kh])
//     S = S + k[b, t, kh] delta^T
//     out[b, t, h] = S^T q[b, t, kh]
//     j = t + NS - num_tokens[b]; if j >= 0: snapshot_cache[slots[b], j, h] = S
//   out[b, t, h] = 0 for the padding tokens t >= num_tokens[b].
// So snapshot NS-1-d holds the state after num_tokens[b] - d tokens (right-aligned); the other
// snapshots of the slot, and state_cache, are left as they are. With NS = 0 the pass writes
// only out. q and k come L2-normalised and scaled already.
//
// Slots should be distinct. Rows that share one (CUDA-graph padding rows on a scratch slot)
// leave each snapshot element they both write holding one of their values, unspecified which.
// state_cache and snapshot_cache must not overlap, except that with NS = 1 snapshot_cache may
// be state_cache itself (an in-place step): each lane writes only the slice of the state it
// read, once, after its last token.
//
// The Python reference with exactly these semantics is
// dflash_trt.ops.gated_delta_recurrent_reference.

#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "block_attention.h"  // dflash::DType

namespace dflash {

// The head sizes the kernel runs: dk and dv multiples of 16 from 16 to 256.
// dflash_trt.ops.gated_delta_kernel_supports mirrors this.
constexpr bool gated_delta_supports(int key_dim, int value_dim) {
  return key_dim >= 16 && key_dim <= 256 && key_dim % 16 == 0 && value_dim >= 16 && value_dim <= 256 &&
         value_dim % 16 == 0;
}

// Every tensor is fp32 (indices int32) and contiguous; the float ones 16-byte aligned.
struct GatedDeltaParams {
  int batch = 0;               // bs, <= 65535
  int width = 0;               // T: tokens per row, padding included
  int num_k_heads = 0;         // Hk
  int num_v_heads = 0;         // Hv, a multiple of Hk, <= 65535
  int key_dim = 0;             // dk (see gated_delta_supports)
  int value_dim = 0;           // dv
  int num_snapshots = 0;       // NS >= 0; with 0 nothing is written but out

  const float* q = nullptr;    // [bs, T, Hk, dk]
  const float* k = nullptr;    // [bs, T, Hk, dk]
  const float* v = nullptr;    // [bs, T, Hv, dv]
  const float* g = nullptr;    // [bs, T, Hv] log decay
  const float* beta = nullptr; // [bs, T, Hv]
  const float* state_cache = nullptr;  // [num_slots, Hv, dk, dv], read only
  float* snapshot_cache = nullptr;     // [num_slots, NS, Hv, dk, dv]; may be null when NS == 0
  const int32_t* slots = nullptr;      // [bs] device
  const int32_t* start = nullptr;      // [bs] device: 0 starts from zeros
  const int32_t* num_tokens = nullptr; // [bs] device: real tokens of the row, in [0, T]
  DType out_dtype = DType::kFloat32;  // of out: fp32, or rounded to bf16 / fp16 (what the model casts to)
  void* out = nullptr;         // [bs, T, Hv, dv], or null: no outputs, q unread (a commit's replay)
};

// Non-null when the parameters are unsupported (the message says why).
const char* gated_delta_recurrent_check(const GatedDeltaParams& p);

// One kernel on `stream`; never reads device data on the host and allocates nothing, so it
// can be captured in a CUDA graph. Returns cudaErrorInvalidValue for unsupported parameters.
cudaError_t gated_delta_recurrent_launch(const GatedDeltaParams& p, cudaStream_t stream);

// The recurrence's inputs for a decode/verify pass, from the layer's projections: one launch
// for what PyTorch runs as about 25 small kernels (dflash_trt.gated_delta.recurrence_inputs
// and the gates in models/qwen3_5.py). For token n (of N) and head h, in fp32:
//   xq = float(qkv[n, h dk ..]), xk = float(qkv[n, (Hk + h) dk ..])           (h < Hk, dk each)
//   q[n, h] = round(round(xq * rsqrt(sum(xq^2) + eps)) * q_scale)
//   k[n, h] = xk * rsqrt(sum(xk^2) + eps)
//   v[n]    = float(qkv[n, 2 Hk dk ..])                                       (Hv dv)
//   g[n, h] = neg_a[h] * softplus(float(a[n, h]) + dt_bias[h])                  (h < Hv)
//            softplus(x) = x > 20 ? x : log1p(exp(x))
//   beta[n, h] = 1 / (1 + exp(-float(b[n, h])))
// rounding (to fp32) after each operation as PyTorch does; only the sums over dk run in
// another order (a few fp32 ulps). The Python reference is dflash_trt.ops.gated_delta_prepare_reference.
struct GatedDeltaPrepareParams {
  DType dtype = DType::kBFloat16;  // of qkv, a and b
  int64_t tokens = 0;              // N
  int num_k_heads = 0;             // Hk
  int num_v_heads = 0;             // Hv
  int key_dim = 0;                 // dk, 1 .. 256
  int value_dim = 0;               // dv
  float eps = 1e-6f;
  float q_scale = 1.0f;

  const void* qkv = nullptr;       // [N, 2 Hk dk + Hv dv], contiguous rows
  const void* a = nullptr;         // [N, Hv], rows `ab_stride` elements apart
  const void* b = nullptr;         // [N, Hv], likewise
  int64_t ab_stride = 0;
  const float* neg_a = nullptr;    // [Hv]: -exp(A_log)
  const float* dt_bias = nullptr;  // [Hv]

  float* q = nullptr;              // [N, Hk, dk], contiguous like the rest of the outputs
  float* k = nullptr;              // [N, Hk, dk]
  float* v = nullptr;              // [N, Hv, dv]
  float* g = nullptr;              // [N, Hv]
  float* beta = nullptr;           // [N, Hv]
};

const char* gated_delta_prepare_check(const GatedDeltaPrepareParams& p);
cudaError_t gated_delta_prepare_launch(const GatedDeltaPrepareParams& p, cudaStream_t stream);

// One in-place decode step (one token a row) of a Gated DeltaNet layer, from its conv output to
// its gated norm: gated_delta_prepare, gated_delta_recurrent with NS = 1 on state_cache itself,
// and the gated RMSNorm of the outputs (layer_ops.h: rms_norm with a gate, not zero-centred)
// in one launch, with their arithmetic (the same bits). Row b, value head h (key head kh):
//   q, k, v, g, beta of qkv[b], a[b], b[b] as gated_delta_prepare makes them;
//   state_cache[slots[b], h] stepped once as gated_delta_recurrent steps it, its output
//   rounded to the dtype (a padding row, num_tokens[b] == 0, keeps its state, outputs zeros);
//   y[b, h] = rms_norm(that output, norm_weight, norm_eps) times silu(z[b, h]), rounded.
// dk = dv = 128 (every Qwen3.5/3.6 release), bf16 or fp16.
constexpr int kGatedDeltaStepDim = 128;

struct GatedDeltaStepParams {
  DType dtype = DType::kBFloat16;  // of qkv, a, b, z, norm_weight and y: bf16 or fp16
  int batch = 0;                   // bs, <= 65535
  int num_k_heads = 0;             // Hk
  int num_v_heads = 0;             // Hv, a multiple of Hk, <= 65535
  const void* qkv = nullptr;       // [bs, 2 Hk dk + Hv dv], rows qkv_stride elements apart
  int64_t qkv_stride = 0;
  const void* a = nullptr;         // [bs, Hv], rows ab_stride apart (views of the projection)
  const void* b = nullptr;
  int64_t ab_stride = 0;
  const void* z = nullptr;         // [bs, Hv, dv], rows z_stride apart, each row's heads contiguous
  int64_t z_stride = 0;
  const float* neg_a = nullptr;    // [Hv]: -exp(A_log)
  const float* dt_bias = nullptr;  // [Hv]
  float l2_eps = 0.0f;             // of q and k's L2 norms
  float q_scale = 1.0f;
  const void* norm_weight = nullptr;  // [dv]
  float norm_eps = 0.0f;
  float* state_cache = nullptr;    // [num_slots, Hv, dk, dv] fp32, stepped in place
  const int32_t* slots = nullptr;  // [bs] device
  const int32_t* start = nullptr;  // [bs] device: 0 starts from zeros
  const int32_t* num_tokens = nullptr;  // [bs] device: 1, or 0 for a padding row
  void* y = nullptr;               // [bs, Hv, dv] contiguous
};

const char* gated_delta_step_check(const GatedDeltaStepParams& p);
cudaError_t gated_delta_step_launch(const GatedDeltaStepParams& p, cudaStream_t stream);

}  // namespace dflash
