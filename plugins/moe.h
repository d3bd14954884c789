// The routed experts of a mixture-of-experts layer: the plain C++ launcher API (no torch
// types), so a torch op (ops.cpp) and a TensorRT IPluginV3 can both wrap it.
//
// Token t picks experts ids[t, j] (j < k) with weights[t, j]; its pick j is slot s = t k + j.
// Per slot, with e = ids[t, j] and round() to the dtype (nearest even):
//   h   = round(gate_up[e] @ x[t])                 [2I]  (gate rows 0..I-1, up rows I..2I-1)
//   a   = round(round(silu(h[:I])) * h[I:])        [I]   (silu(z) = z / (1 + exp(-z)), fp32)
//   y_s = round(down[e] @ a)                        [H]
//   out[t] = sum over j = 0..k-1, in order, of weights[t, j] * y_s    (fp32, [N, H])
// and out is that sum in fp32 or rounded to the dtype (out_dtype).
// Dot products sum in fp32 in the kernel's own order (fp32 inputs: three TF32 products per
// term, see moe.cu). A slot whose id is outside [0, E) adds nothing (no memory is read for it).
// The Python reference with these semantics is dflash_trt.ops.moe_experts_reference.
//
// moe_launch runs up to four kernels: a sort of the slots by expert (one CTA; not for one
// token, whose picks are its chunks), gate_up and down kernels that read each active expert's
// weights once per chunk of up to 8, 16 or 32 of its slots and apply them with tensor-core MMAs,
// and the fixed-order weighted sum (for up to kMoeFusedCombineTokens tokens, done by the down
// kernel's last CTA of each row tile instead). One token in bf16 or fp16 runs two CUDA-core
// kernels instead (gate_up with the activation, down with the weighted sum), in their own
// summation order. Grid sizes depend only on the shapes (CTAs past the routed work exit at
// once) and nothing is read back on the host, so a launch can be captured in a CUDA graph. A
// token's output does not depend on the other tokens of its launch, nor, from two tokens on
// (in fp32 from one), on how many tokens the launch has.
//
// The grouped-GEMM path of ops.py (many tokens per expert) uses the sort and the weighted sum
// on their own: moe_sort_launch and moe_combine_launch.

#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "block_attention.h"  // dflash::DType
#include "gemv.h"             // dflash::GemvNorm

namespace dflash {

constexpr int kMoeMaxExperts = 2048;  // the sort keeps three ints per expert in shared memory
// Up to this many tokens the weighted sum runs in the down kernel: its serial tail on one CTA
// per row tile is then shorter than a kernel of its own.
constexpr int kMoeFusedCombineTokens = 16;
// One token's experts with the residual add + norm after them (MoeTokenFusion::norm): H at most this.
constexpr int kMoeNormMaxHidden = 4096;

struct MoeParams {
  DType dtype = DType::kBFloat16;  // of x, gate_up, down, act and y
  int tokens = 0;                  // N
  int top_k = 0;                   // k
  int experts = 0;                 // E
  int hidden = 0;                  // H, a multiple of 8
  int inter = 0;                   // I, a multiple of 8
  const void* x = nullptr;         // [N, H] contiguous
  const void* gate_up = nullptr;   // [E, 2I, H] contiguous
  const void* down = nullptr;      // [E, H, I] contiguous
  const float* weights = nullptr;  // [N, k] contiguous
  const int32_t* ids = nullptr;    // [N, k] contiguous
  int32_t* work = nullptr;         // moe_work_ints(p) ints of scratch
  void* act = nullptr;             // [N k, I] scratch in the dtype
  void* y = nullptr;               // [N k, H] scratch in the dtype
  DType out_dtype = DType::kFloat32;  // fp32 or the dtype
  void* out = nullptr;             // [N, H]
  // true: every token's last pick is expert E - 1 (a shared expert packed as the last one), so
  // the one-token gate_up pulls its rows into L2 before the ids are ready. A hint: the ids
  // decide what is computed.
  bool shared_last = false;
};
// nvcc reads a kernel parameter struct of more than 128 bytes through its address (loads from
// a register-held parameter address), which changed the tile kernels' code and slowed them down
// (BENCHMARKS.md, "Mixture of experts"): what only one token's kernels read is MoeTokenFusion.
// Which form is faster depends on the kernel, so moe.cu picks it per kernel (MoeTokenArgs,
// DownSumArgs).
static_assert(sizeof(MoeParams) <= 128, "MoeParams is every MoE kernel's parameter: keep it to 128 bytes");

// One token's routing and the residual add + norm after its experts, run inside the expert
// kernels (an AR step at batch 1): read by those kernels only (moe.cu, MoeTokenArgs).
struct MoeTokenFusion {
  // With norm.ticket set (one token in bf16 or fp16, out in the dtype, H <= kMoeNormMaxHidden):
  // the residual add + RMSNorm after the experts, norm.sum = norm.residual + out and norm.out
  // its norm, run by the down kernel's last CTA (gemv.h's GemvNorm, with add_rms_norm's bits).
  GemvNorm norm;
  // With route_logits set (one token, with the norm above): MoeParams' weights and ids are not
  // read (may be null): the kernels route the token themselves from the router's logits, with
  // moe_route's semantics and bits (moe_route.h: route_logits[e route_stride] for e < E - s,
  // s = 1 with shared_last, which then holds the shared expert's gate at e = E - 1, picked last
  // as expert E - 1; top_k counts it): no routing launch, and the down kernel routes before
  // it waits for gate_up.
  const void* route_logits = nullptr;  // in the dtype
  int64_t route_stride = 1;
  bool route_renormalize = false;
  int32_t* route_ids = nullptr;    // [k] scratch: gate_up writes the routing here for the down
  float* route_weights = nullptr;  // kernel's CTAs that start after it (moe.cu)
};

// Scratch ints of a launch (the sort's outputs and the chunk list).
int64_t moe_work_ints(const MoeParams& p);
// nullptr when the launch would be valid, else why not. All pointers 16-byte aligned.
// `fusion` (may be null: none) only for one token.
const char* moe_check(const MoeParams& p, const MoeTokenFusion* fusion = nullptr);
cudaError_t moe_launch(const MoeParams& p, cudaStream_t stream, const MoeTokenFusion* fusion = nullptr);

// The sort alone: slots grouped by expert, in expert order, then the slots with an id
// outside [0, E). Writes, from `work` (moe_sort_work_ints ints, 16-byte aligned):
//   [0, E)                  ends: ends[e] = the number of slots of experts 0..e (torch._grouped_mm's offs)
//   [E + 1, E + 1 + S)      order: the slots grouped by expert (order within an expert unspecified)
//   [E + 1 + S, E + 1 + 2S) rows: rows[s] = the position of slot s in order
struct MoeSortParams {
  int slots = 0;                 // S = N k
  int experts = 0;               // E
  const int32_t* ids = nullptr;  // [S]
  int32_t* work = nullptr;
};
int64_t moe_sort_work_ints(const MoeSortParams& p);
const char* moe_sort_check(const MoeSortParams& p);
cudaError_t moe_sort_launch(const MoeSortParams& p, cudaStream_t stream);

// The weighted sum alone: out[t] = sum_j weights[t, j] * y[row(t k + j)] in fp32, j in order,
// skipping slots whose id is outside [0, E); row(s) = rows[s], or s when rows is null; out in
// fp32 or rounded to the dtype.
struct MoeCombineParams {
  DType dtype = DType::kBFloat16;  // of y
  int tokens = 0;                  // N
  int top_k = 0;                   // k
  int experts = 0;                 // E
  int hidden = 0;                  // H, a multiple of 8
  const void* y = nullptr;         // [N k, H] contiguous, 16-byte aligned
  const int32_t* rows = nullptr;   // [N k] or null
  const float* weights = nullptr;  // [N, k]
  const int32_t* ids = nullptr;    // [N, k]
  DType out_dtype = DType::kFloat32;  // fp32 or the dtype
  void* out = nullptr;             // [N, H], 16-byte aligned
};
const char* moe_combine_check(const MoeCombineParams& p);
cudaError_t moe_combine_launch(const MoeCombineParams& p, cudaStream_t stream);

}  // namespace dflash
