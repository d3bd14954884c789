// Fused per-layer ops of a Qwen3 decoder layer: the plain C++ launcher API (no torch types),
// so a torch op (ops.cpp) and a TensorRT IPluginV3 can both wrap it.
//
//   rms_norm / add_rms_norm  RMSNorm of a row, optionally after adding a residual delta
//                            (Qwen3's, or the zero-centred or gated ones of Qwen3.5/3.6)
//   qk_norm_rope             per-head q/k RMSNorm + neox RoPE on the packed qkv output, and
//                            optionally the K/V cache write, in one launch (also Qwen3.5/3.6's
//                            gated attention: zero-centred norms, RoPE on part of each head)
//   silu_mul                 silu(gate) * up of the packed gate_up output
//   sigmoid_gate             attention output times sigmoid of its gate (Qwen3.5/3.6's gated
//                            attention), the gate read in place in the q projection's output
//   causal_conv              the Gated DeltaNet conv + SiLU of a decode pass, with its window
//
// Every op rounds exactly where the PyTorch model code does (bf16/fp16 elementwise ops
// compute in fp32 and round after each op); the only difference from torch is the order
// of an RMSNorm's fp32 sum of squares, which rarely (about 1e-5 of bf16 outputs, 1e-4 of
// fp16) moves a normalised value by one unit in its last place.
// The Python references with exactly these semantics are dflash_trt.ops.rms_norm_reference,
// add_rms_norm_reference, qk_norm_rope_reference, silu_mul_reference and sigmoid_gate_reference.

#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "block_attention.h"  // dflash::DType

namespace dflash {

// Row r (of `rows` rows of `hidden` elements, all contiguous):
//   s = float(x) + float(delta)                     (fp32; s = float(x) without delta)
//   n = s * rsqrt(sum(s * s) / hidden + eps)        (fp32)
//   y = round(float(weight) * float(round(n)))      (round: to dtype, nearest even)
//   zero_centered (Qwen3.5/3.6's RMSNorm, whose weight is an offset from 1):
//   y = round(n * (1 + float(weight)))              (fp32 throughout, one rounding)
//   with gate (Qwen3.5/3.6's gated norm of the linear-attention output), z = float(gate):
//   y = round(float(round(float(weight) * float(round(n)))) * z / (1 + exp(-z)))
struct RmsNormParams {
  DType dtype = DType::kBFloat16;  // of weight, delta, gate and y
  bool x_fp32 = false;             // x is fp32 (the residual stream); else `dtype`
  bool zero_centered = false;      // scale by 1 + weight, as above; not with gate
  const void* gate = nullptr;      // [rows, H] or null; see gate_group
  // gate_group > 0: the gate's rows come in groups of gate_group contiguous rows, the groups
  // gate_group_stride elements apart (a slice of a packed projection's output); 0: contiguous
  int64_t gate_group = 0;
  int64_t gate_group_stride = 0;
  int64_t rows = 0;
  int hidden = 0;                  // H, >= 1
  const void* x = nullptr;         // [rows, H]
  const void* delta = nullptr;     // [rows, H] or null (plain rms_norm)
  const void* weight = nullptr;    // [H]
  float eps = 1e-6f;
  float* sum = nullptr;            // [rows, H] fp32: x + delta; required with delta, else ignored
  void* out = nullptr;             // [rows, H]: y
};

// Non-null when the parameters are unsupported (the message says why).
const char* rms_norm_check(const RmsNormParams& p);
cudaError_t rms_norm_launch(const RmsNormParams& p, cudaStream_t stream);

// Row r of qkv holds Hq query heads, then Hkv key heads, then Hkv value heads of d elements;
// with q_gate (Qwen3.5/3.6's gated attention) each query head is followed by d gate elements,
// which are left for the caller. Each q (k) head: h = RMSNorm over d with q_weight (k_weight),
// rounded as above (zero_centered: as that one); then on its first R = rotary_dim channels
//   rotated = cat(-h[R/2:R], h[:R/2]);  out = round(round(h * cos[r]) + round(rotated * sin[r]))
// and out = h on the other d - R. v heads are copied unchanged. q goes to q_out [rows, Hq, d].
// With k_cache/v_cache, k and v of row r go to cache[slots[r], positions[r]] (every row; the
// caller keeps positions below the capacity) and k_out/v_out are unused; without, to
// k_out/v_out [rows, Hkv, d].
struct QkNormRopeParams {
  DType dtype = DType::kBFloat16;  // of everything but slots/positions
  int64_t rows = 0;
  int num_q_heads = 0;             // Hq; 0: no queries (the drafter's context K/V)
  int num_kv_heads = 0;            // Hkv >= 1
  int head_dim = 0;                // d: 64, 128 or 256
  int rotary_dim = 0;              // R: a multiple of 64 up to d; 0: d
  bool zero_centered = false;      // the q/k norms scale by 1 + weight, as in RmsNormParams
  bool q_gate = false;             // each query head's d elements are followed by its gate's
  float eps = 1e-6f;

  // Strides are in elements; the last dimension is contiguous everywhere.
  const void* qkv = nullptr;       // [rows, (Hq + 2 Hkv) d], with q_gate [rows, (2 Hq + 2 Hkv) d]
  int64_t qkv_stride = 0;          //   row
  const void* q_weight = nullptr;  // [d]; null when Hq == 0
  const void* k_weight = nullptr;  // [d]
  const void* cos = nullptr;       // [rows, R]
  int64_t cos_stride = 0;
  const void* sin = nullptr;       // [rows, R]
  int64_t sin_stride = 0;

  void* q_out = nullptr;           // [rows, Hq, d] contiguous
  void* k_out = nullptr;           // [rows, Hkv, d] contiguous, when there is no cache
  void* v_out = nullptr;

  void* k_cache = nullptr;         // [num_slots, capacity, Hkv, d], e.g. one layer of a 5-D cache
  int64_t k_cache_stride[3] = {};  //   slot, row, head
  void* v_cache = nullptr;
  int64_t v_cache_stride[3] = {};
  const int32_t* slots = nullptr;      // [rows] device, with the caches
  const int32_t* positions = nullptr;  // [rows] device, with the caches
};

const char* qk_norm_rope_check(const QkNormRopeParams& p);
cudaError_t qk_norm_rope_launch(const QkNormRopeParams& p, cudaStream_t stream);

// out[r, i] = round(round(silu(g)) * float(up)) with g = gate_up[r, i], up = gate_up[r, I + i],
// silu(g) = g / (1 + exp(-g)) in fp32 (torch's formula).
struct SiluMulParams {
  DType dtype = DType::kBFloat16;
  int64_t rows = 0;
  int64_t inter = 0;               // I
  const void* gate_up = nullptr;   // [rows, 2 I] contiguous
  void* out = nullptr;             // [rows, I] contiguous
};

const char* silu_mul_check(const SiluMulParams& p);
cudaError_t silu_mul_launch(const SiluMulParams& p, cudaStream_t stream);

// out[r, h, j] = round(float(x[r, h, j]) * round(sigmoid(g))) with g = gate[r, h, j],
// sigmoid(g) = 1 / (1 + exp(-g)) in fp32 (torch's formula).
struct SigmoidGateParams {
  DType dtype = DType::kBFloat16;
  int64_t rows = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  const void* x = nullptr;         // [rows, heads, head_dim] contiguous
  const void* gate = nullptr;      // [rows, heads, head_dim], elements gate_row_stride / gate_head_stride / 1 apart
  int64_t gate_row_stride = 0;
  int64_t gate_head_stride = 0;
  void* out = nullptr;             // [rows, heads, head_dim] contiguous
};

const char* sigmoid_gate_check(const SigmoidGateParams& p);
cudaError_t sigmoid_gate_launch(const SigmoidGateParams& p, cudaStream_t stream);

// The depthwise causal conv + SiLU of a Gated DeltaNet decode pass (Qwen3.5/3.6), every row
// T tokens, continuing each row's window in the cache. Row b, channel c, K = W + 1 taps:
//   full = [window (W inputs; zeros when start[b] == 0), x[b, 0..T-1]]   (the inputs, in dtype)
//   acc_t = round(full[t] w[0]); acc_t = round(acc_t + round(full[t + j] w[j])) for j = 1..W
//   out[b, t] = round(acc_t / (1 + exp(-acc_t)))                         (torch's silu, fp32)
// and then, with NS == 0, conv_cache[slots[b]] = full[n .. n + W - 1] for n = min(num_tokens[b],
// T) (the window after the row's tokens, in place; n = T when num_tokens is null: every row
// full, a padded prefill's rows each their own length); with NS > 0 (every row full),
// snapshots[slots[b], j] = full[n .. n + W - 1] for n = T - NS + 1 + j >= 0 (the window after
// each of the last NS tokens; conv_cache is read only). NS > T + 1 (a verify narrower than the
// snapshots): entries j < NS - T - 1 (n < 0, before the pass; no commit reads them) stay.
// Every value is an input, copied: the writes are exact.
struct CausalConvParams {
  DType dtype = DType::kBFloat16;  // of x, weight, conv_cache, snapshots and out
  int batch = 0;                   // bs
  int width = 0;                   // T >= 1
  int channels = 0;                // C
  int kernel_size = 0;             // K = W + 1, 2 .. 8
  int num_snapshots = 0;           // NS
  const void* x = nullptr;         // [bs, T, C], token rows `x_stride` elements apart
  int64_t x_stride = 0;
  const void* weight = nullptr;    // [C, K] contiguous
  void* conv_cache = nullptr;      // [num_slots, W, C] contiguous (one layer of the cache)
  void* snapshots = nullptr;       // [num_slots, NS, W, C] contiguous, when NS > 0
  const int32_t* slots = nullptr;  // [bs] device
  const int32_t* start = nullptr;  // [bs] device: 0 starts from a zero window
  const int32_t* num_tokens = nullptr;  // [bs] device, or null (every row T tokens); NS == 0 only
  void* out = nullptr;             // [bs, T, C] contiguous
};

const char* causal_conv_check(const CausalConvParams& p);
cudaError_t causal_conv_launch(const CausalConvParams& p, cudaStream_t stream);

}  // namespace dflash
